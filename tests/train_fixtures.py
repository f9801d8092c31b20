"""A tiny training setup for the train tests: a random HF Qwen3 target with a chat tokenizer saved beside it,
a synthetic prompt/completion JSONL corpus, and a config for both (configs/tiny.py with smaller rows); a workdir of
random drafters as the trainer writes it; the D-PACE weights one slot at a time."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from flax import nnx
from jax.sharding import Mesh
from ml_collections import ConfigDict
from transformers import AutoTokenizer

from configs import tiny
from dflash_jax.data import BatchLoader
from dflash_jax.models.drafter import DrafterConfig
from dflash_jax.ops.backends import resolve_attention_impl
from dflash_jax.runtime.workdir import append_config_history
from dflash_jax.sharding import make_mesh, state_shardings
from dflash_jax.train import validate
from dflash_jax.train.checkpoint import Checkpointer
from dflash_jax.train.startup import load_config_target
from dflash_jax.train.state import StateSpec, TrainState, init_train_state, state_spec
from dflash_jax.train.step import StepFunctions, make_step, put_batch, schedule_length
from dflash_jax.weights.drafter_files import DRAFTER_CONFIG_FILE, drafter_from_torch_layout

from tests.drafter_fixtures import CONFIGS, make_config, random_weights
from tests.hf_fixtures import (QWEN3_5_MOE_TEXT_CONFIG, qwen3_config, randomize_parameters, randomize_qwen3_5,
                               save_qwen3)
from tests.tokenizer_fixture import _WORDS, make_chat_tokenizer


TARGET_VOCAB = 640  # > len(tokenizer) (600), so the mask token defaults to len(tokenizer), an unused row


def make_target(directory: Path, *, num_layers: int = 6, seed: int = 0) -> Path:
    """A random fp32 Qwen3 target (H=64) plus the test tokenizer, loadable by load_target/AutoTokenizer."""
    save_qwen3(directory, qwen3_config(vocab_size=TARGET_VOCAB, num_hidden_layers=num_layers,
                                       tie_word_embeddings=True), seed=seed)
    make_chat_tokenizer().save_pretrained(directory)
    return directory


def make_qwen3_moe_target(directory: Path, *, seed: int = 0, **overrides) -> Path:
    """A random tiny Qwen3-MoE target (6 layers, 8 experts, 2 per token, H=64) plus the test tokenizer; `overrides`
    replace config fields."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    fields = dict(
        vocab_size=TARGET_VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, tie_word_embeddings=True, max_position_embeddings=256)
    config = Qwen3MoeConfig(**{**fields, **overrides})
    model = Qwen3MoeForCausalLM(config).to(torch.float32).eval()
    randomize_parameters(model, seed=seed).save_pretrained(directory)
    make_chat_tokenizer().save_pretrained(directory)
    return directory


def make_qwen3_5_target(directory: Path, *, seed: int = 0) -> Path:
    """A random tiny Qwen3.5 hybrid target (2 x [GDN, GDN, GDN, gated attention], H=64) plus the test tokenizer."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    config = Qwen3_5TextConfig(
        vocab_size=TARGET_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, tie_word_embeddings=False, max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
    Qwen3_5ForCausalLM(config).to(torch.float32).eval().save_pretrained(directory)
    make_chat_tokenizer().save_pretrained(directory)
    return directory


def make_qwen3_5_moe_target(directory: Path, *, seed: int = 0, **overrides) -> Path:
    """A random tiny Qwen3.5-MoE target (2 x [GDN, GDN, GDN, gated attention], 8 experts of which 2 per
    token and a shared expert, H=64) plus the test tokenizer; `overrides` replace config fields."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(seed)
    fields = dict(QWEN3_5_MOE_TEXT_CONFIG, vocab_size=TARGET_VOCAB, hidden_size=64, num_hidden_layers=8, num_experts=8,
                  moe_intermediate_size=32, shared_expert_intermediate_size=48)
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**{**fields, **overrides})).to(torch.float32).eval()
    randomize_qwen3_5(model, seed=seed)
    model.save_pretrained(directory)
    make_chat_tokenizer().save_pretrained(directory)
    return directory


def write_corpus(path: Path, count: int = 200, seed: int = 0) -> Path:
    """Prompt/completion records of English-ish words; completions repeat a per-record phrase so a drafter
    has something to learn beyond the target's own greedy choice."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(count):
            prompt = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 10)))
            phrase = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 5)))
            completion = " ".join([phrase] * rng.randint(2, 6))
            f.write(json.dumps({"prompt": prompt, "completion": " " + completion}) + "\n")
    return path


def tiny_config(target_dir: Path, train_file: Path, **overrides) -> ConfigDict:
    """configs/tiny.py on 64-token rows (8 anchors of 8 slots), fp32 everywhere so results are exact."""
    config = tiny.get_config()
    config.target_dir = str(target_dir)
    config.data.train_files = (str(train_file),)
    config.target_dtype = "float32"
    config.compute_dtype = "float32"
    config.data.seq_len = 64
    config.data.anchor_stride = 8
    config.drafter.block_size = 8
    config.drafter.sliding_window = 24
    config.loss.row_chunk = 24  # not a divisor of N*B = 64: exercises the padded last chunk
    config.loss.vocab_chunk = 200  # not a divisor of V = 640: exercises the remainder chunk
    config.mesh = ConfigDict(dict(data=1, fsdp=1, tensor=1))
    config.target_layout = "fsdp"  # `build` makes the step itself, without the plan that settles "auto"
    for key, value in overrides.items():
        target = config
        *parents, leaf = key.split(".")
        for parent in parents:
            target = target[parent]
        target[leaf] = value
    return config


def losses(workdir: Path) -> dict[int, float]:
    """step -> loss, from a run's metrics.jsonl."""
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {record["step"]: record["loss"] for record in records if "loss" in record}


def restore_last(workdir: Path, config: ConfigDict) -> tuple[int, TrainState, dict]:
    """(step, state on the host, data position) of a run's newest checkpoint, restored as the loop would."""
    drafter_config = DrafterConfig(**json.loads((workdir / DRAFTER_CONFIG_FILE).read_text()))
    abstract = state_spec(drafter_config, config, "xla", mesh_of()).abstract
    checkpointer = Checkpointer(workdir, keep=1)
    step = checkpointer.latest_step()
    state, data = checkpointer.restore(step, abstract)
    checkpointer.close()
    return step, jax.device_get(state), data


class Setup(NamedTuple):
    """The pieces the train loop builds, for tests that drive the step directly."""

    config: ConfigDict
    mesh: Mesh
    target: nnx.Module
    target_state: nnx.State
    drafter_config: DrafterConfig
    spec: StateSpec
    state: TrainState
    step: StepFunctions
    loader: BatchLoader
    total_steps: jax.Array  # the step's schedule-length argument


def build(config: ConfigDict, mesh: Mesh) -> Setup:
    """Target, tokenizer, drafter config, initial state, step functions and loader, as `train` builds them."""
    config = validate.run_config(config)
    validate.validate_config(config)
    attention_impl = resolve_attention_impl(config.attention_impl)
    target, target_config = load_config_target(config, mesh, config.target_layout, attention_impl)
    tokenizer = AutoTokenizer.from_pretrained(config.target_dir)
    drafter_config = validate.resolve_drafter_config(config, target_config, tokenizer)
    spec = state_spec(drafter_config, config, attention_impl, mesh)
    state = init_train_state(drafter_config, config, attention_impl, spec)
    target_graphdef, target_state = nnx.split(target)
    step = make_step(config, drafter_config, spec, target_graphdef,
                     state_shardings(target_state, mesh, config.target_layout), mesh)
    loader = BatchLoader(config.data.train_files, tokenizer, seq_len=config.data.seq_len, anchor_stride=config.data.anchor_stride,
                         batch_size=config.data.batch_size, seed=config.data.shuffle_seed)
    return Setup(config, mesh, target, target_state, drafter_config, spec, state, step, loader,
                 schedule_length(config.total_steps, mesh))


def one_step(config: ConfigDict, mesh: Mesh, steps: int = 2) -> list[dict]:
    """The metrics of the first `steps` train steps (NumPy, on the host) of a fresh setup."""
    setup = build(config, mesh)
    state, history = setup.state, []
    for _ in range(steps):
        state, metrics = setup.step.train_step(state, setup.target_state, put_batch(next(setup.loader), mesh),
                                               setup.total_steps)
        history.append(jax.tree.map(np.asarray, jax.device_get(metrics)))
    return history


def mesh_of(data: int = 1, fsdp: int = 1, tensor: int = 1, context: int = 1) -> Mesh:
    return make_mesh(data, fsdp, tensor, devices=jax.devices()[: data * fsdp * tensor * context], context=context)


def training_workdir(tmp_path, steps=(2, 4)):
    """A workdir as `python -m dflash_jax.train` leaves it: drafter_config.json, config_history.jsonl and Orbax
    checkpoints of the TrainState (written by the trainer's own Checkpointer), one drafter per step."""
    config = make_config(*CONFIGS["sliding_full"])
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "drafter_config.json").write_text(json.dumps(dataclasses.asdict(config)))
    append_config_history(workdir, ConfigDict({"target_dir": "/ckpt/target"}), step=0)
    checkpointer = Checkpointer(workdir, keep=5)
    weights = {}
    for step in steps:
        weights[step] = random_weights(config, seed=step)
        params = nnx.state(drafter_from_torch_layout(weights[step], config), nnx.Param)
        state = TrainState(jnp.asarray(step, jnp.int32), params, optax.adam(1e-3).init(params),
                           jax.random.key_data(jax.random.key(0)))
        checkpointer.save(step, state, {"position": step})
    checkpointer.close()
    return workdir, config, weights


def loop_dpace(ce: np.ndarray, mask: np.ndarray, alpha: float) -> np.ndarray:
    """The formula one slot at a time: w_j = Σ_{m >= j, trained} Π_{i <= m} s_i, s_i = 1 where untrained."""
    weights = np.zeros_like(ce, np.float64)
    for index in np.ndindex(ce.shape[:-1]):
        c, m = ce[index].astype(np.float64), mask[index]
        s = [(1 - alpha) * np.exp(-c[i]) + alpha if m[i] else 1.0 for i in range(len(c))]
        for j in range(len(c)):
            if m[j]:
                weights[index + (j,)] = sum(np.prod(s[: k + 1]) for k in range(j, len(c)) if m[k])
    return weights
