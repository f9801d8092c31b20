"""`python -m dflash_jax.convert`: the `convert` command (commands/convert.py)."""

from dflash_jax.commands import cli

if __name__ == "__main__":
    cli.run_module("convert")
