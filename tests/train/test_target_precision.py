"""One precision for the target (design §8.3): config.target_matmul_dtype is the model's own, so the train step's
teacher and evaluation's scorer, each given the target as its command loads it, take the same greedy tokens on
the same text, also where the Gated DeltaNet's bf16 products move a near-tie away from the fp32 one."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from dflash_jax.eval.exact_tau import DraftScorer
from dflash_jax.models.drafter import Drafter
from dflash_jax.train.startup import load_config_target
from tests.train_fixtures import build, make_qwen3_5_target, mesh_of, tiny_config, write_corpus

LENGTH, TEXTS = 128, 16  # one length bucket of the scorer, and the train rows' length: the same shapes on both sides


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("target_precision")
    return make_qwen3_5_target(root / "target"), write_corpus(root / "train.jsonl")


def evaluation_greedy(config, drafter: Drafter, texts: np.ndarray) -> np.ndarray:
    """[texts, LENGTH] the target's greedy token after each position, as `evaluate` scores it (the target loaded
    by the commands' loader, exact τ's scorer)."""
    target, _ = load_config_target(config, mesh_of(), "fsdp", config.attention_impl)
    scores = DraftScorer(target, drafter, top_k=1, rows=len(texts)).score(list(texts))
    return np.stack([greedy for greedy, _, _ in scores])


@pytest.mark.slow  # the train step's teacher and two scorers of a hybrid target: about 30 s of one core
def test_evaluation_greedy_labels_equal_the_training_teachers(files):
    target_dir, corpus = files
    # Anchor stride 4 with blocks of 8: every position but the last is some drafted slot's label source.
    config = tiny_config(target_dir, corpus, **{"data.seq_len": LENGTH, "data.anchor_stride": 4,
                                                "target_matmul_dtype": "bfloat16"})
    setup = build(config, mesh_of())  # the target, step and drafter as `train` builds them
    texts = np.random.default_rng(0).integers(0, 600, (TEXTS, LENGTH)).astype(np.int32)
    batch = {"input_ids": texts, "positions": np.broadcast_to(np.arange(LENGTH, dtype=np.int32), texts.shape),
             "segment_ids": np.zeros(texts.shape, np.int32), "loss_mask": np.ones(texts.shape, np.int32)}
    teacher = jax.device_get(jax.jit(setup.step.teacher)(setup.target_state, batch).labels)  # [texts, N, B-1]
    # Slot k of the block at anchor a is labelled with the greedy token after position a + k - 1.
    stride, block = config.data.anchor_stride, config.drafter.block_size
    positions = np.minimum(np.arange(0, LENGTH, stride)[:, None] + np.arange(block - 1)[None, :], LENGTH - 2)

    drafter = Drafter(setup.drafter_config, rngs=nnx.Rngs(0))
    greedy = evaluation_greedy(config, drafter, texts)
    np.testing.assert_array_equal(teacher, greedy[:, positions])
    # The texts hold near-ties the products' precision decides (random weights, near-flat logits: one position
    # in 2,048 here): fp32 products take another greedy token somewhere, so the equality above is the two sides'
    # precision agreeing, not texts insensitive to it.
    config.target_matmul_dtype = "float32"
    exact = evaluation_greedy(config, drafter, texts)
    assert (exact[:, positions] != teacher).any()
