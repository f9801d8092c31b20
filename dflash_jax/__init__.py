"""dflash_jax: train DFlash speculative-decoding drafters against frozen Qwen targets in JAX/Flax NNX."""

__version__ = "0.1.0"
