"""Where training records come from: the entries of config.data.train_files, resolved into sources.

An entry is `PATH` or `PATH@WEIGHT`, PATH one of
- a JSONL file (`.jsonl`, `.json`; compressed `.gz` / `.zst`) or a Parquet file (`.parquet`), on the local disk or
  at a URL of any filesystem fsspec knows (`gs://bucket/train.jsonl` with gcsfs installed, `s3://`, ...);
- a glob (`data/*.parquet`, `shards/**/*.jsonl.zst`): every match, in sorted order;
- a directory: a Hugging Face dataset written by `save_to_disk` (a DatasetDict's `train` split, or `DIR:SPLIT`),
  else every JSONL and Parquet file under it, in sorted order;
- a Hugging Face dataset id (`HuggingFaceH4/ultrachat_200k:train_sft`; the split defaults to `train`): its
  snapshot in the local Hugging Face cache, never downloaded here (download it first on a machine with internet
  access; see docs/data.md, step 1), loaded with `datasets.load_dataset` (splits from the file names;
  its Arrow cache is built once per machine).
WEIGHT (default 1) says how many times an epoch draws each record of the entry's sources: 2 = twice, 0.5 = a
different half each epoch (data/corpus.py). Every problem is one DataError naming the entry.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dflash_jax.data.jsonl import COMPRESSED, JsonlSource
from dflash_jax.data.tables import DatasetSource, ParquetSource
from dflash_jax.runtime import paths
from dflash_jax.runtime.errors import DataError

JSONL_SUFFIXES = tuple(base + zip_ for base in (".jsonl", ".json") for zip_ in ("", *COMPRESSED))
DATA_SUFFIXES = (*JSONL_SUFFIXES, ".parquet")
_GLOB_CHARS = ("*", "?", "[")
SAVED_DATASET_FILES = ("state.json", "dataset_dict.json")  # what `save_to_disk` writes into its directory


@dataclass(frozen=True)
class WeightedSource:
    source: Any  # JsonlSource, ParquetSource or DatasetSource
    weight: float


def resolve_sources(entries: Sequence[str | os.PathLike], what: str) -> list[WeightedSource]:
    """The sources of `entries`, in order. `what` (the config field) ends every error message."""
    if not entries:
        raise DataError("corpus", f"no input files given ({what})")
    sources = []
    for entry in entries:
        path, split, weight = parse_entry(os.fspath(entry), what)
        sources += [WeightedSource(source, weight) for source in _expand(path, split, what)]
    return sources


def parse_entry(entry: str, what: str) -> tuple[str, str | None, float]:
    """`PATH[:SPLIT][@WEIGHT]` -> (path, split, weight)."""
    path, weight = entry, 1.0
    head, at, tail = entry.rpartition("@")
    if at and head:
        try:
            weight = float(tail)
        except ValueError:
            pass  # an @ that is part of the path
        else:
            path = head
            if not (math.isfinite(weight) and weight >= 0):
                raise DataError(entry, f"weight {tail} must be a finite number >= 0 ({what})")
    head, colon, split = path.rpartition(":")
    if colon and head and split and "/" not in split and not os.path.exists(path):
        return head, split, weight
    return path, None, weight


def _expand(path: str, split: str | None, what: str) -> list[Any]:
    fs, root = filesystem(path, what)
    local = "file" in fs.protocol
    if any(char in path for char in _GLOB_CHARS) and not fs.exists(root):
        matches = sorted(fs.glob(root))
        if not matches:
            raise DataError(path, f"no file matches this pattern ({what})")
        return [source for match in matches for source in _expand(_name(fs, match), split, what)]
    if fs.isdir(root):
        if any(fs.exists(f"{root}/{name}") for name in SAVED_DATASET_FILES):
            dataset, name = saved_dataset(path, split, what)
            return [DatasetSource(name, dataset)]
        files = sorted(file for file in fs.find(root) if file.endswith(DATA_SUFFIXES))
        if not files:
            raise DataError(path, f"directory holds no saved dataset and no JSONL or Parquet files ({what})")
        return [_open_file(_name(fs, file), None if local else fs, what) for file in files]
    if fs.exists(root):
        return [_open_file(path, None if local else fs, what)]
    if local and looks_like_dataset_id(path):
        split = split or "train"
        return [DatasetSource(f"{path}:{split}", cached_dataset(path, split, what))]
    raise DataError(path, f"no such file ({what})")


def filesystem(path: str, what: str) -> tuple[Any, str]:
    """The fsspec filesystem of a path or URL (gs://, s3://, ...) and the path within it."""
    try:
        return paths.filesystem(path)
    except (ImportError, ValueError) as e:  # a scheme whose filesystem package is not installed
        raise DataError(path, f"cannot open: {' '.join(str(e).split())} ({what})") from None


def _name(fs: Any, path: str) -> str:
    """How a listed file is named to the user: a URL on an object store, a path on the local disk."""
    return path if "file" in fs.protocol else fs.unstrip_protocol(path)


def _open_file(path: str, fs: Any, what: str) -> Any:
    if fs is None and not os.access(path, os.R_OK):
        raise DataError(path, f"not readable by this user ({what})")
    if path.endswith(".parquet"):
        return ParquetSource(path, fs)
    return JsonlSource(path, fs)  # any other name is read as JSON Lines


def saved_dataset(path: str, split: str | None, what: str) -> tuple[Any, str]:
    """A `save_to_disk` directory's `datasets.Dataset` (of a DatasetDict: `split`, default train) and its name in
    messages."""
    import datasets  # noqa: PLC0415 (imported only for Hugging Face datasets)

    dataset = datasets.load_from_disk(path)
    if isinstance(dataset, datasets.DatasetDict):
        return _split(dataset, split, path, what), f"{path}:{split or 'train'}"
    return dataset, path


def cached_dataset(dataset_id: str, split: str, what: str, config_name: str | None = None) -> Any:
    """`split` of a dataset id's snapshot in the local Hugging Face cache, as a `datasets.Dataset`; config_name
    picks one of the configs a repo's README declares (e.g. openai/gsm8k's `main`)."""
    from huggingface_hub import snapshot_download  # noqa: PLC0415

    # Only the local Hugging Face cache is read: no command downloads data behind the user's back.
    try:
        directory = snapshot_download(dataset_id, repo_type="dataset", local_files_only=True)
    except Exception as e:  # huggingface_hub raises several kinds for "not cached" and "not a repo id"
        raise DataError(dataset_id, f"not a file, and not a dataset in the local Hugging Face cache "
                                    f"({type(e).__name__}; download it first, e.g. `hf download {dataset_id} "
                                    f"--repo-type dataset`) ({what})") from None
    where = f"{dataset_id}{f' ({config_name})' if config_name else ''}:{split}"
    return load_dataset(where, what, directory, config_name, split=split)


def load_dataset(where: str, what: str, *args: Any, **kwargs: Any) -> Any:
    """`datasets.load_dataset(*args, **kwargs)` (a data directory such as a cache snapshot, configs from its
    README and splits from its file names; or a builder such as "json" with data_files); a failure to read (an
    unknown split or config, unreadable files) is a DataError naming `where`. Its Arrow cache is built once per
    machine."""
    import datasets  # noqa: PLC0415

    try:
        return datasets.load_dataset(*args, **kwargs)
    except (ValueError, datasets.exceptions.DatasetGenerationError) as e:
        raise DataError(where, f"{' '.join(str(e).split())[:300]} ({what})") from None


def _split(dataset_dict: Any, split: str | None, path: str, what: str) -> Any:
    split = split or "train"
    if split not in dataset_dict:
        raise DataError(path, f"the saved dataset has no split {split!r}; it has {sorted(dataset_dict)} "
                              f"(name one as {path}:SPLIT) ({what})")
    return dataset_dict[split]


def looks_like_dataset_id(path: str) -> bool:
    parts = path.split("/")
    return len(parts) == 2 and all(parts) and not path.startswith((".", "~")) and "\\" not in path
