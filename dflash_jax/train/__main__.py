"""`python -m dflash_jax.train`: the `train` command (commands/train.py)."""

from dflash_jax.commands import cli

cli.run_module("train")
