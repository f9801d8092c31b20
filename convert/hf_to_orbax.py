"""`dflash-jax convert` from a checkout: a Hugging Face target into an Orbax target (see dflash_jax/commands/convert.py)."""

from dflash_jax.commands import cli
from dflash_jax.commands.convert import FLAGS, main

if __name__ == "__main__":
    cli.run(main, FLAGS)
