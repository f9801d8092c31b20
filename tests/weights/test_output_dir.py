"""--overwrite of the converters (`dflash-jax convert`, `dflash-jax export`) only ever replaces an
earlier output of the same kind: a mistyped --out (the input itself, a directory around or inside it, a
target, a directory holding anything else) is refused with one line, and every byte of the input and of
unrelated files stays as it was. Exported files are readable by others (0644)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import jax.numpy as jnp
import pytest

from dflash_jax.runtime.errors import OutputDirError
from dflash_jax.commands.export import export
from dflash_jax.weights.orbax_target import write_orbax_target
from dflash_jax.weights.output_dir import OWNER_FILE
from tests.command import dflash_jax, user_error
from tests.hf_fixtures import qwen3_config, save_qwen3
from tests.train_fixtures import training_workdir


def snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under `root` (or `root` itself): relative path -> (bytes, mode)."""
    files = [root] if root.is_file() else sorted(path for path in root.rglob("*") if path.is_file())
    return {str(path.relative_to(root)): (path.read_bytes(), path.stat().st_mode) for path in files}


def to_orbax(hf_dir: Path, out: Path, overwrite: bool = False) -> Path:
    return write_orbax_target(hf_dir, out, dtype=jnp.float32, overwrite=overwrite, progress=False)


def refused(convert, *args, **kwargs) -> str:
    """Runs a converter that must refuse; returns its message (the command prints it as `error: ...`)."""
    with pytest.raises(OutputDirError) as error:
        convert(*args, **kwargs)
    return str(error.value)


@pytest.fixture
def hf_in_parent(tmp_path):
    """<tmp>/models/hf: a small HF checkpoint (with a tokenizer file), beside an unrelated file."""
    parent = tmp_path / "models"
    save_qwen3(parent / "hf", qwen3_config(), seed=1)
    (parent / "hf" / "tokenizer.json").write_text("{}")
    (parent / "notes.txt").write_text("unrelated")
    return parent / "hf"


def test_hf_to_orbax_never_replaces_the_input_or_a_directory_around_or_inside_it(hf_in_parent):
    parent = hf_in_parent.parent
    before = snapshot(parent)
    for out, relation in ((hf_in_parent, "is"), (parent, "contains"), (hf_in_parent / "orbax", "lies inside")):
        message = refused(to_orbax, hf_in_parent, out, overwrite=True)
        assert message == f"{out}: the output directory {relation} the input {hf_in_parent}; choose an --out outside it"
    # The command line: one line, exit code 2, nothing deleted.
    line = user_error(dflash_jax("convert", "--hf_dir", str(hf_in_parent), "--out", str(parent), "--overwrite"))
    assert line == f"error: {parent}: the output directory contains the input {hf_in_parent}; choose an --out outside it"
    assert snapshot(parent) == before


def test_hf_to_orbax_replaces_only_its_own_earlier_output(hf_in_parent, tmp_path):
    out = tmp_path / "orbax"
    to_orbax(hf_in_parent, out)
    to_orbax(hf_in_parent, out, overwrite=True)  # an earlier Orbax target: replaced
    owner = json.loads((out / OWNER_FILE).read_text())
    assert owner["kind"] == "Orbax target"
    assert sorted(p.name for p in out.iterdir()) == sorted({*owner["entries"], OWNER_FILE} - {"params.partial_save"})

    (out / "notes.txt").write_text("mine")  # someone's file inside the output: the whole directory is kept
    before = snapshot(out)
    message = refused(to_orbax, hf_in_parent, out, overwrite=True)
    assert message == (f"{out}: --overwrite refused: it also holds notes.txt, which 'Orbax target' output "
                    f"does not include; move that away first or choose another --out")
    assert snapshot(out) == before

    foreign = tmp_path / "foreign"  # a directory this project did not write
    foreign.mkdir()
    (foreign / "model.safetensors").write_bytes(b"weights")
    before = snapshot(foreign)
    message = refused(to_orbax, hf_in_parent, foreign, overwrite=True)
    assert message == (f"{foreign}: --overwrite refused: it has no {OWNER_FILE}, so this project did not "
                    f"write it; choose another --out, or empty it yourself if nothing in it matters")
    assert snapshot(foreign) == before


def test_export_never_replaces_a_target_the_workdir_or_another_kind_of_output(hf_in_parent, tmp_path):
    workdir, _, _ = training_workdir(tmp_path)
    target_before, workdir_before = snapshot(hf_in_parent), snapshot(workdir)

    message = refused(export, workdir, hf_in_parent, overwrite=True)
    assert message.startswith(f"{hf_in_parent}: --overwrite refused: it has no {OWNER_FILE}")
    for out, relation in ((workdir, "is"), (workdir.parent, "contains"), (workdir / "export", "lies inside")):
        message = refused(export, workdir, out, overwrite=True)
        assert message.startswith(f"{out}: the output directory {relation} the input {workdir}")

    orbax = to_orbax(hf_in_parent, tmp_path / "orbax")
    orbax_before = snapshot(orbax)
    message = refused(export, workdir, orbax, overwrite=True)
    assert message == f"{orbax}: --overwrite refused: it holds output of kind 'Orbax target', not 'drafter export'"

    assert snapshot(hf_in_parent) == target_before
    assert snapshot(workdir) == workdir_before
    assert snapshot(orbax) == orbax_before


def test_export_replaces_its_own_earlier_export_with_files_readable_by_others(tmp_path, capsys):
    workdir, _, _ = training_workdir(tmp_path)
    out = tmp_path / "export"
    old = os.umask(0o077)  # even under a strict umask: a vLLM server running as another user reads the export
    try:
        export(workdir, out, step=2)
        assert "output directory is not empty" in refused(export, workdir, out)  # no --overwrite
        export(workdir, out, overwrite=True)
    finally:
        os.umask(old)
    assert "exported step 4" in capsys.readouterr().out
    names = sorted(p.name for p in out.iterdir())
    assert names == ["README.md", "config.json", OWNER_FILE, "model.safetensors"]  # README.md: the model card
    for name in names:
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o644, name
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
