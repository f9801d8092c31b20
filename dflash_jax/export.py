"""`python -m dflash_jax.export`: the `export` command (commands/export.py)."""

from dflash_jax.commands import entry

if __name__ == "__main__":
    entry.run("export")
