"""`load_target`: a target directory (Hugging Face safetensors, or Orbax written by `dflash-jax convert`) or a
Hub repo id into its NNX model, by the family its config.json names (`weights/families.py`)."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from dflash_jax.sharding import state_shardings
from dflash_jax.weights.families import resolve
from dflash_jax.weights.hub import local_dir
from dflash_jax.weights.mapping import load_weights
from dflash_jax.weights.orbax_target import is_orbax_target, load_orbax_target
from dflash_jax.weights.safetensors_dir import CheckpointReader, read_config


def read_target_config(checkpoint_dir: str | Path):
    """The target's config (as `load_target` returns it) from its config.json alone, without its weights."""
    checkpoint_dir = local_dir(checkpoint_dir, "target")
    return resolve(read_config(checkpoint_dir), Path(checkpoint_dir) / "config.json")[1]


def load_target(checkpoint_dir: str | Path, *, param_dtype=jnp.bfloat16, mesh: Mesh | None = None,
                attention_impl: str = "xla", target_layout: str = "fsdp", delta_rule_dtype: str = "float32"
                ) -> tuple[nnx.Module, object]:
    """Load a target checkpoint directory into its NNX model; returns (model, config).

    With a mesh, every weight is placed on its sharding (from the logical-axis rule table, with the rules of
    `target_layout`: dflash_jax/sharding.py TARGET_LAYOUTS) as it is read. An
    Orbax target directory is restored shard by shard. attention_impl ("xla", "splash" or "auto") picks the
    backend of the model's full-sequence forward; delta_rule_dtype (config.target_matmul_dtype) the Gated DeltaNet
    layers' chunk products (`Qwen3_5`). Anything unusable (a missing or corrupt file, an unknown
    model_type, a bad config field, missing, unexpected or mis-shaped tensors) raises CheckpointError naming
    the file and what is wrong. checkpoint_dir may also be a Hugging Face Hub repo id (weights/hub.py).
    """
    name, checkpoint_dir = checkpoint_dir, local_dir(checkpoint_dir, "target")
    if is_orbax_target(checkpoint_dir):
        return load_orbax_target(name, param_dtype=param_dtype, mesh=mesh, attention_impl=attention_impl,
                                 target_layout=target_layout, delta_rule_dtype=delta_rule_dtype)
    family, config = resolve(read_config(checkpoint_dir), Path(checkpoint_dir) / "config.json")
    reader = CheckpointReader(checkpoint_dir)
    abstract = family.abstract_model(config, param_dtype=param_dtype, attention_impl=attention_impl, mesh=mesh,
                                     delta_rule_dtype=delta_rule_dtype)
    shardings = state_shardings(nnx.state(abstract), mesh, target_layout) if mesh is not None else None
    rules = family.checkpoint_rules(config, reader.names())
    model = load_weights(abstract, reader, rules, ignore_prefixes=family.ignored(config), shardings=shardings)
    return model, config
