"""The `dflash-jax` console script's entry (pyproject.toml): the command line is commands/cli.py."""

from dflash_jax.commands.cli import main

__all__ = ["main"]
