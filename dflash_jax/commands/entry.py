"""The first step of every command's process, before transformers is imported: `dflash-jax` (dflash_jax/cli.py)
and the `python -m dflash_jax.<command>` shims all start here."""

from __future__ import annotations

import os
import sys


def run(command: str | None = None) -> None:
    """`dflash-jax ...` (command None: the command is argv[1]) or `python -m dflash_jax.<command> ...`."""
    # No command uses PyTorch, yet transformers imports it wherever it is installed (about 2 s of CPU at every
    # start on a GPU host or a test machine). A None entry makes it absent to transformers' checks and imports.
    # Without it, transformers' advisory that PyTorch is missing (printed on every TPU host) says nothing useful.
    sys.modules.setdefault("torch", None)
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from dflash_jax.commands import cli

    if command is None:
        cli.main()
    else:
        cli.run_module(command)
