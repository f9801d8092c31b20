"""`python -m dflash_jax.plan` (__main__.py); the planning library is dflash_jax/planning/."""
