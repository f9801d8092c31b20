"""`python -m dflash_jax.regenerate`: the `regenerate` command (commands/regenerate.py)."""

from dflash_jax.commands import cli

if __name__ == "__main__":
    cli.run_module("regenerate")
