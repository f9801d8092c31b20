"""`dflash-jax convert` from a checkout: a Hugging Face target into an Orbax target (see dflash_jax/convert.py)."""

from dflash_jax import cli
from dflash_jax.convert import FLAGS, main

if __name__ == "__main__":
    cli.run(main, FLAGS)
