"""`dflash-jax export` from a checkout: export a trained drafter for vLLM (see dflash_jax/commands/export.py)."""

from dflash_jax.commands import cli
from dflash_jax.commands.export import FLAGS, main

if __name__ == "__main__":
    cli.run(main, FLAGS)
