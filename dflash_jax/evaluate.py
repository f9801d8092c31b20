"""`python -m dflash_jax.evaluate`: the `evaluate` command (commands/evaluate.py)."""

from dflash_jax.commands import cli

if __name__ == "__main__":
    cli.run_module("evaluate")
