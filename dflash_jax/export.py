"""`python -m dflash_jax.export`: the `export` command (commands/export.py)."""

from dflash_jax.commands import cli

if __name__ == "__main__":
    cli.run_module("export")
