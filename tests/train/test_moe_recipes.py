"""The recipes for MoE targets (configs/qwen3_30b_a3b.py, configs/qwen36_35b_a3b.py): they validate, their
target configs are what transformers' own configs of those shapes read as, their parameter counts equal a
meta-device transformers instantiation's, and their drafters have the published shapes."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from configs import qwen3_30b_a3b, qwen36_35b_a3b
from dflash_jax.models.qwen3 import Qwen3, Qwen3Config
from dflash_jax.models.qwen3_5 import Qwen3_5, Qwen3_5Config
from dflash_jax.runtime.errors import ConfigError
from dflash_jax.train.validate import batch_size, resolve_drafter_config, validate_config

# The published config.json values of the targets (the transformers defaults where they agree).
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                     num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                     max_position_embeddings=40960, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
QWEN36_35B_A3B = dict(max_position_embeddings=262144,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                       "mrope_section": [11, 11, 10], "mrope_interleaved": True})
RECIPES = {
    "qwen3_30b_a3b": (qwen3_30b_a3b, Qwen3Config, Qwen3, transformers.Qwen3MoeConfig(**QWEN3_30B_A3B),
                      transformers.Qwen3MoeForCausalLM),
    "qwen36_35b_a3b": (qwen36_35b_a3b, Qwen3_5Config, Qwen3_5, transformers.Qwen3_5MoeTextConfig(**QWEN36_35B_A3B),
                       transformers.Qwen3_5MoeForCausalLM),
}


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_validates_on_any_slice(name):
    module = RECIPES[name][0]
    config = module.get_config()
    config.target_dir, config.data.train_files = "/ckpt/target", ("train.jsonl",)
    validate_config(config)
    assert batch_size(config, 32) == 32  # one row per device
    assert (config.data.seq_len // config.data.anchor_stride, config.epochs, config.optim.b2) == (512, 6, 0.999)


@pytest.mark.parametrize("name", RECIPES)
def test_target_config_is_what_the_checkpoint_config_reads_as(name):
    module, config_type, model_type, hf_config, hf_model = RECIPES[name]
    assert config_type.from_hf(hf_config.to_dict()) == module.target_config()
    with torch.device("meta"):
        expected = sum(p.numel() for p in hf_model(hf_config).parameters())
    abstract = nnx.eval_shape(lambda: model_type(module.target_config(), rngs=nnx.Rngs(0)))
    assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract))) == expected


def test_drafters_have_the_published_shapes():
    drafter = resolve_drafter_config(qwen3_30b_a3b.get_config(), qwen3_30b_a3b.target_config(), tokenizer=None)
    assert (drafter.num_hidden_layers, drafter.target_layer_ids, drafter.mask_token_id) == \
        (5, (1, 12, 23, 34, 45), 151669)
    assert (drafter.hidden_size, drafter.intermediate_size, drafter.rope_theta) == (2048, 6144, 1e6)
    drafter = resolve_drafter_config(qwen36_35b_a3b.get_config(), qwen36_35b_a3b.target_config(), tokenizer=None)
    assert (drafter.num_hidden_layers, drafter.target_layer_ids, drafter.mask_token_id) == \
        (6, (1, 6, 11, 16, 22, 27, 32, 37), 248077)
    assert drafter.layer_types == ("sliding_attention",) * 5 + ("full_attention",) and drafter.sliding_window == 4096
    assert (drafter.num_key_value_heads, drafter.head_dim, drafter.intermediate_size) == (8, 128, 6144)


def test_a_drafter_of_a_target_without_a_dense_mlp_must_give_its_width():
    config = qwen36_35b_a3b.get_config()
    config.drafter.intermediate_size = None
    with pytest.raises(ConfigError, match=r"^config.drafter.intermediate_size must be set: this target has experts"):
        resolve_drafter_config(config, qwen36_35b_a3b.target_config(), tokenizer=None)
