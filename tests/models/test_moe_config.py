"""MoE settings from config.json against transformers' own configs (Qwen3MoeConfig, Qwen3_5MoeTextConfig)."""

import pytest
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_5_moe import Qwen3_5MoeConfig, Qwen3_5MoeTextConfig

from dflash_jax.models.moe_config import MoeSettings


def _hf_sparse_qwen3_moe(config: Qwen3MoeConfig) -> tuple[bool, ...]:
    # transformers' rule (Qwen3MoeDecoderLayer.__init__), restated from the saved config object
    return tuple(i not in config.mlp_only_layers and config.num_experts > 0
                 and (i + 1) % config.decoder_sparse_step == 0 for i in range(config.num_hidden_layers))


@pytest.mark.parametrize("kwargs", [dict(), dict(decoder_sparse_step=2), dict(mlp_only_layers=[0, 3]),
                                    dict(decoder_sparse_step=3, mlp_only_layers=[5], norm_topk_prob=True)])
def test_qwen3_moe_settings_follow_transformers(kwargs):
    hf = Qwen3MoeConfig(num_hidden_layers=6, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                        **kwargs)
    settings = MoeSettings.from_qwen3_moe(hf.to_dict(), hf.num_hidden_layers)
    assert settings.sparse_layers == _hf_sparse_qwen3_moe(hf)
    assert (settings.num_experts, settings.top_k, settings.expert_intermediate_size) == (8, 2, 16)
    assert settings.normalize_top_k == hf.norm_topk_prob
    assert not settings.has_shared_expert


def test_qwen3_moe_published_spelling_num_experts():
    settings = MoeSettings.from_qwen3_moe({"num_experts": 128, "num_experts_per_tok": 8,
                                           "moe_intermediate_size": 768, "norm_topk_prob": True}, 48)
    assert settings.num_experts == 128 and all(settings.sparse_layers) and settings.normalize_top_k


def test_qwen3_5_moe_settings_nested_text_config():
    hf = Qwen3_5MoeConfig(text_config=Qwen3_5MoeTextConfig(num_hidden_layers=4, num_experts=8,
                                                           num_experts_per_tok=2, moe_intermediate_size=16,
                                                           shared_expert_intermediate_size=24).to_dict())
    text = hf.to_dict()["text_config"]
    settings = MoeSettings.from_qwen3_5_moe(text, 4)
    assert settings.sparse_layers == (True,) * 4 and settings.normalize_top_k
    assert settings.shared_expert_intermediate_size == 24 and settings.has_shared_expert


@pytest.mark.parametrize("config, message", [
    ({"num_experts_per_tok": 2, "moe_intermediate_size": 8}, "missing required field\\(s\\): num_experts"),
    ({"num_experts": 4, "num_experts_per_tok": 8, "moe_intermediate_size": 8}, "exceeds 'num_experts'"),
    ({"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8, "mlp_only_layers": [9]},
     "mlp_only_layers"),
    ({"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8, "decoder_sparse_step": 0},
     "decoder_sparse_step"),
])
def test_qwen3_moe_bad_fields_one_clear_error(config, message):
    with pytest.raises(ValueError, match=message):
        MoeSettings.from_qwen3_moe(config, 4)


def test_qwen3_5_moe_missing_shared_expert_size():
    with pytest.raises(ValueError, match="shared_expert_intermediate_size"):
        MoeSettings.from_qwen3_5_moe({"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8}, 4)


def test_active_mlp_params_count_k_experts_router_and_shared_expert():
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    text = Qwen3_5MoeTextConfig(hidden_size=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                shared_expert_intermediate_size=24, num_hidden_layers=2)
    block = Qwen3_5MoeSparseMoeBlock(text)
    experts = sum(p.numel() for n, p in block.named_parameters() if n.startswith("experts."))
    others = sum(p.numel() for n, p in block.named_parameters() if not n.startswith("experts."))
    settings = MoeSettings.from_qwen3_5_moe(text.to_dict(), 2)
    assert settings.active_mlp_params(32, 0) == (experts * 2 // 8 + others,) * 2
    dense = MoeSettings.from_qwen3_moe({"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                                        "mlp_only_layers": [1]}, 2)
    assert dense.active_mlp_params(32, 40) == (3 * 2 * 16 * 32 + 8 * 32, 3 * 32 * 40)
