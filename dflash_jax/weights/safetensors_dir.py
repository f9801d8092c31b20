"""Read a Hugging Face checkpoint directory tensor by tensor, without torch.

A directory holds `config.json` and either `model.safetensors` or `model.safetensors.index.json` plus its
shards. Tensors are memory-mapped from disk and read one at a time, so peak memory is about the largest
tensor. Every failure names the file and what is wrong with it.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from dflash_jax.errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path}: not valid JSON ({error})") from None


def read_config(checkpoint_dir: str | Path) -> dict:
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise CheckpointError(f"{checkpoint_dir}: checkpoint directory not found")
    return read_json(checkpoint_dir / "config.json")


class SafetensorsFile:
    """One .safetensors file: the header is parsed eagerly, tensor data is memory-mapped on demand."""

    def __init__(self, path: Path):
        self.path = path
        if not path.is_file():
            raise CheckpointError(f"{path}: file not found")
        size = path.stat().st_size
        with path.open("rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > size - 8:
                raise CheckpointError(f"{path}: corrupt safetensors header (length {header_len}, file {size} bytes)")
            try:
                header = json.loads(handle.read(header_len))
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                raise CheckpointError(f"{path}: corrupt safetensors header ({error})") from None
        header.pop("__metadata__", None)
        self.data_start = 8 + header_len
        self.entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            dtype = _DTYPES.get(info.get("dtype"))
            if dtype is None:
                raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {info.get('dtype')!r}")
            begin, end = info["data_offsets"]
            shape = tuple(info["shape"])
            if end - begin != int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize or \
                    self.data_start + end > size:
                raise CheckpointError(f"{path}: tensor {name} is truncated or corrupt "
                                      f"(shape {shape}, bytes {begin}..{end}, file {size} bytes)")
            self.entries[name] = (np.dtype(dtype), shape, begin, end)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][1]

    def read(self, name: str) -> np.ndarray:
        dtype, shape, begin, end = self.entries[name]
        count = (end - begin) // dtype.itemsize
        return np.memmap(self.path, dtype=dtype, mode="r", offset=self.data_start + begin, shape=(count,)).reshape(shape)


class CheckpointReader:
    """All tensors of a checkpoint directory by name, whether single-file or sharded with an index."""

    def __init__(self, checkpoint_dir: str | Path):
        self.dir = Path(checkpoint_dir)
        if not self.dir.is_dir():
            raise CheckpointError(f"{self.dir}: checkpoint directory not found")
        index_path, single_path = self.dir / INDEX_FILE, self.dir / SINGLE_FILE
        if index_path.is_file():
            weight_map = read_json(index_path).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index_path}: missing 'weight_map'")
            files = {shard: SafetensorsFile(self.dir / shard) for shard in sorted(set(weight_map.values()))}
            self._file_of = {}
            for name, shard in weight_map.items():
                if name not in files[shard].entries:
                    raise CheckpointError(f"{self.dir / shard}: tensor {name} listed in {INDEX_FILE} is missing")
                self._file_of[name] = files[shard]
        elif single_path.is_file():
            single = SafetensorsFile(single_path)
            self._file_of = {name: single for name in single.entries}
        else:
            raise CheckpointError(f"{self.dir}: no {SINGLE_FILE} or {INDEX_FILE} found")

    def names(self) -> list[str]:
        return sorted(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def shape(self, name: str) -> tuple[int, ...]:
        return self._file_of[name].shape(name)

    def read(self, name: str) -> np.ndarray:
        return self._file_of[name].read(name)
