"""The train state (design §7); the optimizer is built by train/optimizer.py.

Only the drafter is trained: its Params (fp32 master weights) are the optimizer's whole world. The target is
frozen, passed to the step as a separate argument and never part of `TrainState`, so it is never updated
and never checkpointed. Everything in `TrainState` is a plain pytree of arrays, sharded by the logical-axis
rule table (`dflash_jax.sharding.state_shardings`) and checkpointed as-is by Orbax.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh
from ml_collections import ConfigDict

from dflash_jax.runtime.errors import CheckpointError, ConfigError
from dflash_jax.models.drafter import Drafter, DrafterConfig
from dflash_jax.sharding import state_shardings
from dflash_jax.train.optimizer import init_optimizer_state
from dflash_jax.train.validate import dtype_of
from dflash_jax.weights.drafter_files import read_warm_start


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: optimizer updates done so far
    params: nnx.State  # the drafter's Params, fp32
    opt_state: optax.OptState
    rng: jax.Array  # uint32 raw key data (checkpointable); split once per step for the feature noise


def make_drafter(drafter_config: DrafterConfig, config: ConfigDict, attention_impl: str, seed: int = 0,
                 mesh: Mesh | None = None) -> Drafter:
    """A freshly initialised drafter: fp32 weights, compute in config.compute_dtype; splash per shard of mesh."""
    return Drafter(drafter_config, rngs=nnx.Rngs(seed), param_dtype=jnp.float32,
                   dtype=dtype_of(config.compute_dtype), attention_impl=attention_impl,
                   query_chunk_blocks=config.query_chunk_blocks, mesh=mesh, remat=config.remat)


class StateSpec(NamedTuple):
    """What the step and the checkpointer need to know about the train state without holding it."""

    graphdef: nnx.GraphDef  # the drafter's static structure (merge it with TrainState.params)
    abstract: TrainState  # ShapeDtypeStructs carrying their shardings (an Orbax restore target)
    shardings: TrainState  # NamedShardings, the jit in/out shardings of the state


def state_spec(drafter_config: DrafterConfig, config: ConfigDict, attention_impl: str, mesh: Mesh) -> StateSpec:
    abstract = jax.eval_shape(lambda: _init(drafter_config, config, attention_impl))
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: make_drafter(drafter_config, config, attention_impl, mesh=mesh)))
    shardings = state_shardings(abstract, mesh)
    with_shardings = jax.tree.map(lambda s, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shardings,
                                  abstract)
    return StateSpec(graphdef, with_shardings, shardings)


def init_train_state(drafter_config: DrafterConfig, config: ConfigDict, attention_impl: str,
                     spec: StateSpec) -> TrainState:
    """The step-0 state, created directly on its shardings (no host copy of the full drafter)."""
    state = jax.jit(lambda: _init(drafter_config, config, attention_impl), out_shardings=spec.shardings)()
    if config.drafter.init_from:
        state = state._replace(params=_load_params(config.drafter.init_from, drafter_config, spec, state.params))
        state = state._replace(opt_state=jax.jit(lambda params: init_optimizer_state(config, params),
                                                 out_shardings=spec.shardings.opt_state)(state.params))
    return state


def _init(drafter_config: DrafterConfig, config: ConfigDict, attention_impl: str) -> TrainState:
    drafter = make_drafter(drafter_config, config, attention_impl, seed=config.seed)
    params = nnx.state(drafter, nnx.Param)
    # The noise stream is seeded apart from the weight init (fold_in), so changing one leaves the other.
    rng = jax.random.key_data(jax.random.fold_in(jax.random.key(config.seed), 1))
    return TrainState(jnp.zeros((), jnp.int32), params, init_optimizer_state(config, params), rng)


def _load_params(directory: str, drafter_config: DrafterConfig, spec: StateSpec, initial: nnx.State) -> nnx.State:
    """Drafter weights from a directory in the export layout (design §10) or a Hub repo id, placed on the param
    shardings; the parts its drafter's method lacks (DSpark's heads, starting from a DFlash drafter, design §18)
    keep their values in `initial`, the run's own initialisation."""
    try:
        drafter = read_warm_start(directory, drafter_config, param_dtype=jnp.float32)
    except (CheckpointError, OSError) as error:
        raise ConfigError(f"config.drafter.init_from={directory!r}: {error}") from None
    loaded = jax.tree.map(lambda value, init: init if isinstance(value, jax.ShapeDtypeStruct) else value,
                          nnx.state(drafter, nnx.Param), initial)
    return jax.device_put(loaded, spec.shardings.params)
