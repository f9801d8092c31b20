"""The drafter methods (design §18), one object each; `method_for(name)` is the registry."""

from __future__ import annotations

from dflash_jax.methods.base import DrafterMethod
from dflash_jax.methods.dflash import DFLASH
from dflash_jax.methods.dflash2 import DFLASH2
from dflash_jax.methods.dspark import DSPARK

METHODS = {method.name: method for method in (DFLASH, DSPARK, DFLASH2)}


def method_for(name: str) -> DrafterMethod:
    """The method called `name` (config.drafter.method); ValueError naming the known ones otherwise."""
    if name not in METHODS:
        raise ValueError(f"unknown drafter method {name!r}: expected one of {', '.join(METHODS)}")
    return METHODS[name]


__all__ = ["DrafterMethod", "METHODS", "method_for"]
