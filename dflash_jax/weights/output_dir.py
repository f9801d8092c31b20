"""Output directories of the converters (the drafter export, the Orbax target), and when `--overwrite` may
replace one.

Every output directory gets an ownership file, `dflash_output.json`, written before anything else: the kind
of output and the names of the entries that kind writes there. `--overwrite` replaces a directory only when
that file says it holds the same kind of output and the directory holds nothing else, so it can never delete
a checkpoint, a training workdir or unrelated files, even when `--out` is mistyped. An output directory may
also never be an input of the command, nor lie inside one or contain one. An output at a URL is checked in
the bucket by the same rules, written to a local staging directory and uploaded (`staged_output`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path, PurePath, PurePosixPath

from dflash_jax.runtime.errors import OutputDirError
from dflash_jax.runtime.paths import filesystem, is_url, local_space

OWNER_FILE = "dflash_output.json"
# Outputs are read by other users (e.g. a vLLM server), whatever the umask: never the 0600 of a temporary file.
FILE_MODE, DIR_MODE = 0o644, 0o755


def check_output_dir(out_dir: str | os.PathLike, *, kind: str, inputs: Iterable[str | os.PathLike],
                     overwrite: bool) -> None:
    """Raises OutputDirError (with the reason) unless `out_dir` may receive a `kind`: absent or empty, or with
    `overwrite` a directory holding exactly an earlier `kind`; never one of `inputs` (the paths the command
    reads), inside one or around one. `out_dir` may be a URL (gs://bucket/export)."""
    where = _place(out_dir)
    for path in inputs:
        source = _place(path)
        if where == source or where in source.parents or source in where.parents:
            relation = "is" if where == source else "contains" if where in source.parents else "lies inside"
            raise OutputDirError(f"{out_dir}: the output directory {relation} the input {path}; choose an --out "
                                 f"outside it")
    if is_url(out_dir):
        fs, inside = filesystem(os.fspath(out_dir))
        is_file, present = fs.isfile(inside), _bucket_entries(fs, inside)
        read_owner = lambda: fs.cat_file(f"{inside}/{OWNER_FILE}").decode()  # noqa: E731
    else:
        local = Path(out_dir)
        is_file, present = local.exists() and not local.is_dir(), _entries(local)
        read_owner = (local / OWNER_FILE).read_text
    if is_file:
        raise OutputDirError(f"{out_dir}: exists and is not a directory")
    if not present:
        return
    if not overwrite:
        raise OutputDirError(f"{out_dir}: output directory is not empty (pass --overwrite to replace an earlier "
                             f"{kind} written there)")
    refused = f"{out_dir}: --overwrite refused"
    if OWNER_FILE not in present:
        raise OutputDirError(f"{refused}: it has no {OWNER_FILE}, so this project did not write it; choose another "
                             f"--out, or empty it yourself if nothing in it matters")
    try:
        owner = json.loads(read_owner())
        written_kind, written_entries = owner["kind"], set(owner["entries"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise OutputDirError(f"{refused}: {out_dir}/{OWNER_FILE} is unreadable ({error})") from None
    if written_kind != kind:
        raise OutputDirError(f"{refused}: it holds output of kind {written_kind!r}, not {kind!r}")
    others = sorted(set(present) - written_entries - {OWNER_FILE})
    if others:
        raise OutputDirError(f"{refused}: it also holds {', '.join(others)}, which {kind!r} output does not "
                             f"include; move that away first or choose another --out")


@contextlib.contextmanager
def staged_output(out_dir: str | os.PathLike) -> Iterator[Path]:
    """The local directory to write an output for `out_dir` into: `out_dir` itself when local. For a URL a
    temporary directory, whose files replace the URL's (after `check_output_dir` allowed that) once the block
    succeeds; the ownership file is uploaded first, so that a half-finished upload can be replaced too."""
    if not is_url(out_dir):
        yield Path(out_dir)
        return
    fs, inside = filesystem(os.fspath(out_dir))
    with tempfile.TemporaryDirectory(prefix="dflash_jax-output-") as staging:
        with local_space(staging, f"the output for {out_dir}"):  # nothing of it reaches the bucket then
            yield Path(staging) / "out"
        if fs.exists(inside):
            fs.rm(inside, recursive=True)
        names = sorted(_entries(Path(staging) / "out"), key=lambda name: name != OWNER_FILE)
        for name in names:
            fs.put_file(os.path.join(staging, "out", name), f"{inside}/{name}")


def prepare_output_dir(out_dir: str | os.PathLike, *, kind: str, entries: Iterable[str],
                       inputs: Iterable[str | os.PathLike], overwrite: bool) -> Path:
    """`check_output_dir`, then empties `out_dir` (an earlier `kind`) and claims it: OWNER_FILE lists
    `entries`, the names this output writes there, including the temporary names an interrupted write may
    leave, so that a half-written output can be replaced too. Returns `out_dir`."""
    check_output_dir(out_dir, kind=kind, inputs=inputs, overwrite=overwrite)
    out_dir = Path(out_dir)
    for name in _entries(out_dir):
        entry = out_dir / name
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    if not out_dir.is_dir():
        out_dir.mkdir(parents=True)
        os.chmod(out_dir, DIR_MODE)
    write_text(out_dir / OWNER_FILE, json.dumps({"kind": kind, "entries": sorted(set(entries))}, indent=2) + "\n")
    return out_dir


def _entries(directory: Path) -> list[str]:
    return sorted(entry.name for entry in directory.iterdir()) if directory.is_dir() else []


def _bucket_entries(fs, directory: str) -> list[str]:
    return sorted(entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(directory)) if fs.isdir(directory) else []


def _place(path: str | os.PathLike) -> PurePath:
    """Where `path` is, for comparing an output with the inputs: a URL as written, a local path resolved."""
    return PurePosixPath(os.fspath(path)) if is_url(path) else Path(path).resolve()


def write_text(path: Path, text: str) -> None:
    """A small output file, readable by others."""
    path.write_text(text)
    os.chmod(path, FILE_MODE)
