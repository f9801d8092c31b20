"""Read a Hugging Face checkpoint directory tensor by tensor, without torch.

A directory holds `config.json` and either `model.safetensors` or `model.safetensors.index.json` plus its
shards. Files are opened with the `safetensors` library (`safe_open(..., framework="numpy")`), which checks
the header and that every tensor's bytes lie inside the file when it opens one; tensors are read one at a
time (or only a slice of one, `get_slice`), so peak memory is about the largest tensor. Every failure names
the file and what is wrong with it.
"""

from __future__ import annotations

import json
from pathlib import Path

# safetensors' numpy reader names bf16 tensors' dtype "bfloat16", which numpy only knows once ml_dtypes has
# registered it: without this import, reading a bf16 tensor fails with "data type 'bfloat16' not understood".
import ml_dtypes  # noqa: F401
import numpy as np
from safetensors import SafetensorError, safe_open

from dflash_jax.runtime.errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


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
    """One .safetensors file, opened (header checked) at construction; tensors are read on demand."""

    def __init__(self, path: Path):
        self.path = path
        if not path.is_file():
            raise CheckpointError(f"{path}: file not found")
        try:
            self._file = safe_open(path, framework="numpy")
            self.entries = {name: tuple(self._file.get_slice(name).get_shape()) for name in self._file.keys()}
        except SafetensorError as error:  # e.g. "incomplete metadata, file not fully covered" when truncated
            raise CheckpointError(f"{path}: not a readable safetensors file, truncated or corrupt "
                                  f"({path.stat().st_size} bytes): {error}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name]

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """The tensor, or only `index` of it (a tuple of slices, one per leading axis) read from disk."""
        try:
            if index is None:
                return self._file.get_tensor(name)
            return self._file.get_slice(name)[index]
        except (SafetensorError, TypeError, AttributeError) as error:  # a dtype numpy has no type for
            dtype = self._file.get_slice(name).get_dtype()
            raise CheckpointError(f"{self.path}: tensor {name} ({dtype}) cannot be read: {error}") from None


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

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """A tensor by name, or only `index` of it (see `SafetensorsFile.read`)."""
        return self._file_of[name].read(name, index)
