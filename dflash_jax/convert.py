"""`python -m dflash_jax.convert`: the `convert` command (commands/convert.py)."""

from dflash_jax.commands import entry

if __name__ == "__main__":
    entry.run("convert")
