"""`python -m dflash_jax.evaluate`: the `evaluate` command (commands/evaluate.py)."""

from dflash_jax.commands import entry

if __name__ == "__main__":
    entry.run("evaluate")
