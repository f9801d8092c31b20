"""`python -m dflash_jax.regenerate`: the `regenerate` command (commands/regenerate.py)."""

from dflash_jax.commands import entry

if __name__ == "__main__":
    entry.run("regenerate")
