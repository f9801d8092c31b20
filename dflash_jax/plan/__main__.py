"""`python -m dflash_jax.plan`: the `plan` command (commands/plan.py)."""

from dflash_jax.commands import cli

cli.run_module("plan")
