"""The training recipes (`--config NAME` or `--config configs/NAME.py`); installed with the package as
dflash_jax.configs."""
