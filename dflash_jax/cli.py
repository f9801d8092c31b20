"""The `dflash-jax` console script's entry (pyproject.toml): the command line is commands/cli.py, started by
commands/entry.py."""

from dflash_jax.commands import entry


def main() -> None:
    entry.run()
