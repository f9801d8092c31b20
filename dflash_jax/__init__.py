"""dflash_jax: train DFlash speculative-decoding drafters against frozen Qwen targets in JAX/Flax NNX."""

from flax import nnx

# Every weight carries logical axis names; shardings are applied explicitly by `jax.jit` in/out shardings
# under a mesh (see `dflash_jax.sharding`), so variables are created unsharded.
nnx.use_eager_sharding(False)

__version__ = "0.1.0"
