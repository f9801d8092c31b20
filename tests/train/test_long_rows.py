"""Long rows (design §4, §13): the train step of a hybrid target (Gated DeltaNet and full-attention layers) or a
MoE one and a drafter with a sliding layer, of each method, compiled at T = 32K, holds no array of T x T elements
and its temporaries stay linear in T."""

from __future__ import annotations

import math

import pytest

from dflash_jax.planning.plan import plan_train_step, target_architecture
from dflash_jax.train.config import anchor_grid
from tests.train_fixtures import make_qwen3_5_target, make_qwen3_moe_target, mesh_of, tiny_config, write_corpus

LONG_ROW = 32768
METHODS = {
    "dflash": {},
    "dspark": {"drafter.method": "dspark", "drafter.markov_rank": 16},
    "dflash2": {"drafter.method": "dflash2", "drafter.conv_group_size": 8, "drafter.selector_rank": 16,
                "drafter.selector_top_k": 8},
}


@pytest.mark.slow
@pytest.mark.parametrize("family, method", [("hybrid", "dflash"), ("hybrid", "dspark"), ("hybrid", "dflash2"),
                                            ("moe", "dflash")])
def test_a_32k_row_step_holds_no_t_by_t_array(tmp_path, family, method):
    if family == "hybrid":  # 2 x [GDN, GDN, GDN, gated attention]
        target, feature_layers = make_qwen3_5_target(tmp_path / "qwen3_5"), (3, 7)
    else:  # 6 x [attention, MoE]
        target, feature_layers = make_qwen3_moe_target(tmp_path / "qwen3_moe"), (1, 5)
    config = tiny_config(target, write_corpus(tmp_path / "train.jsonl", count=8), **{
        "data.seq_len": LONG_ROW, "data.batch_size": 1, "drafter.mask_token_id": 0,
        "drafter.layer_types": ("sliding_attention", "full_attention"), "drafter.sliding_window": 64,
        "drafter.target_layer_ids": feature_layers, **METHODS[method]})
    grid = anchor_grid(config)
    assert (grid.num_anchors, grid.stride) == (512, 64)  # 4096 anchors at stride 8, capped at the default 512
    plan = plan_train_step(config, target_architecture(config), mesh_of(1, 1, 1))
    # No array has two axes of the row's length, nor T x T / 8 elements: the largest are the Gated DeltaNet
    # chunks' [heads, T/64, 64, 64] or the MoE dispatch's rows (the target's attention scores one [256, 256] key
    # tile at a time).
    largest = [(array.text, array.shape) for array in plan.largest]
    for _, shape in largest:
        assert math.prod(shape) < LONG_ROW * LONG_ROW // 8 and sorted(shape)[-2] < LONG_ROW // 2, largest
    # Linear in T: under 16 KiB of temporaries a position (hybrid DFlash: 296 MiB; the target's attention chunks
    # side by side took 10 GiB, and one T x T fp32 array alone is 4 GiB).
    assert plan.temp_bytes < 16 * 1024 * LONG_ROW, (plan.temp_bytes, largest)
