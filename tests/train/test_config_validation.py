"""Each bad training config fails at start-up with a ConfigError naming its field; defaults resolve from the
target and tokenizer as design §2/§3/§10 say."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

import jax
import numpy as np
from flax import nnx

from configs import qwen3_8b, qwen27b, qwen27b_dflash2, qwen27b_dspark, tiny
from dflash_jax.runtime.errors import ConfigError
from dflash_jax.models.drafter import Drafter
from dflash_jax.models.qwen3 import Qwen3Config
from dflash_jax.train.validate import (check_overrides, resolve_drafter_config, run_config, settle_batch_size,
                                      validate_config, validate_eval_files)
from tests.tokenizer_fixture import make_chat_tokenizer

REPO = Path(__file__).resolve().parents[2]
TARGET = Qwen3Config(vocab_size=640, hidden_size=64, intermediate_size=96, num_hidden_layers=12,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1e6,
                     max_position_embeddings=512)


def config(**overrides):
    c = tiny.get_config()
    c.target_dir = "/ckpt/target"
    c.data.train_files = ("train.jsonl",)
    for key, value in overrides.items():
        node = c
        *parents, leaf = key.split(".")
        for parent in parents:
            node = node[parent]
        node[leaf] = value
    return c


@pytest.mark.parametrize("overrides, message", [
    ({"target_dir": None}, "config.target_dir is required"),
    ({"data.train_files": None}, "config.data.train_files is required"),
    ({"drafter.block_size": 1}, "config.drafter.block_size must be >= 2"),
    ({"data.seq_len": 100, "data.anchor_stride": 8}, "config.data.seq_len (100) must be a multiple of config.data.anchor_stride (8)"),
    ({"data.seq_len": 8, "data.anchor_stride": 8, "drafter.block_size": 16}, "config.data.seq_len (8) must be >= config.drafter.block_size (16)"),
    ({"data.max_anchors": 0}, "config.data.max_anchors must be an int >= 1 (anchors a row keeps, design §4) or "
                              "None, got 0"),
    ({"loss.gamma": 0.0}, "config.loss.gamma must be > 0"),
    ({"loss.gamma": -4.0}, "config.loss.gamma must be > 0"),
    ({"data.batch_size": None, "data.rows_per_device": 0}, "config.data.rows_per_device must be >= 1, got 0"),
    ({"loss.position_weights": "dpac"}, "config.loss.position_weights must be one of"),
    ({"loss.dpace_alpha": 1.5}, "config.loss.dpace_alpha must lie in [0, 1]"),
    ({"drafter.layer_types": ("full_attention",) * 3}, "config.drafter.layer_types has 3 entries but "
                                                       "config.drafter.num_hidden_layers is 2"),
    ({"drafter.layer_types": ("full_attention", "local")}, "config.drafter.layer_types has unknown types ['local']"),
    ({"drafter.sliding_window": None}, "config.drafter.sliding_window is None"),
    ({"loss.labels": "soft"}, "config.loss.labels must be one of ('target', 'data'), got 'soft'"),
    ({"attention_impl": "flash"},
     "config.attention_impl must be one of ('auto', 'cudnn', 'splash', 'xla'), got 'flash'"),
    ({"target_layout": "sharded"},
     "config.target_layout must be one of ['auto', 'fsdp', 'tensor', 'replicate'], got 'sharded'"),
    ({"data.batch_size": 6, "grad_accum_steps": 4}, "config.data.batch_size (6) must be a multiple of config.grad_accum_steps"),
    ({"compute_dtype": "float64"}, "config.compute_dtype must be one of"),
    ({"loss.noise_std": -0.1}, "config.loss.noise_std must be >= 0"),
    ({"optim.warmup_ratio": 1.0}, "config.optim.warmup_ratio must lie in [0, 1)"),
    ({"profile_steps": (5, 3)}, "config.profile_steps must be (first, last) with 1 <= first <= last, got (5, 3)"),
    ({"eval_continuation": "greedy"}, "config.eval_continuation must be one of ('generate', 'data'), got 'greedy'"),
    ({"eval_max_new_tokens": 0}, "config.eval_max_new_tokens must be >= 1, got 0"),
    ({"optim.name": "lion"}, "config.optim.name must be one of ('adamw', 'muon'), got 'lion'"),
    ({"optim.name": "muon", "optim.muon_momentum": 1.0}, "config.optim.muon_momentum must lie in [0, 1)"),
    ({"optim.name": "muon", "optim.muon_ns_dtype": "float16"}, "config.optim.muon_ns_dtype must be 'float32' or"),
    ({"drafter.method": "eagle3"}, "config.drafter.method must be one of ('dflash', 'dspark', 'dflash2'), got 'eagle3'"),
    ({"drafter.conv_kernel_size": 0}, "config.drafter.conv_kernel_size must be an int >= 1, got 0"),
    ({"drafter.selector_top_k": -3}, "config.drafter.selector_top_k must be an int >= 1, got -3"),
    ({"drafter.selector_alpha": -0.5}, "config.drafter.selector_alpha must be >= 0, got -0.5"),
    ({"drafter.markov_rank": 0}, "config.drafter.markov_rank must be >= 1, got 0"),
    ({"loss.terms": "kld"}, "config.loss.terms must be a JSON object such as '{\"ce\": 0.1, \"tv\": 0.9}', got 'kld'"),
    ({"loss.terms": '{"kl": 1, "nla": 1}'}, "config.loss.terms has unknown terms ['nla']"),
    ({"loss.terms": {"kl": 0.0}}, "config.loss.terms['kl'] must be a number > 0, got 0.0"),
    ({"loss.terms": {}}, "config.loss.terms is empty"),
    ({"loss.terms": "kl"}, "config.loss.position_weights='dpace' is defined for the 'ce' term alone"),
    ({"drafter.confidence_alpha": -1.0}, "config.drafter.confidence_alpha must be >= 0, got -1.0"),
    ({"stop_grace_seconds": 0.0}, "config.stop_grace_seconds must be > 0, got 0.0"),
    ({"drafter.hidden_size": 128}, "config.drafter.hidden_size was removed: the drafter's width is the target's "
                                   "hidden_size"),
])
def test_static_config_errors_name_their_field(overrides, message):
    with pytest.raises(ConfigError) as error:
        validate_config(config(**overrides))
    assert message in str(error.value)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("overrides, message", [
    ({"drafter.target_layer_ids": (1, 12)}, "config.drafter: DrafterConfig.target_layer_ids [1, 12] has ids [12] "
                                            "outside [0, num_target_layers-1 = 11]"),
    ({"drafter.target_layer_ids": (-1, 3)}, "has ids [-1] outside [0, num_target_layers-1 = 11]"),
    ({"drafter.target_layer_ids": (1, 5, 9)}, "config.drafter.target_layer_ids has 3 ids but "
                                              "config.drafter.num_feature_layers is 2"),
    ({"drafter.mask_token_id": 640}, "config.drafter.mask_token_id = 640 (config.drafter.mask_token_id) must lie "
                                     "in [0, target vocab_size = 640)"),
    ({"drafter.num_key_value_heads": 3}, "config.drafter: DrafterConfig.num_attention_heads (4) must be a multiple"),
    ({"drafter.target_layer_ids": (5, 2)}, "config.drafter.target_layer_ids [5, 2] must be strictly increasing"),
    ({"drafter.target_layer_ids": (3, 3)}, "config.drafter.target_layer_ids [3, 3] must be strictly increasing"),
    ({"drafter.num_feature_layers": 12}, "config.drafter.target_layer_ids [1, 2, 2, 3, 4, 5, 5, 6, 7, 8, 8, 9] "
                                         "must be strictly increasing"),
    ({"drafter.method": "dflash2", "drafter.conv_group_size": 24},
     "config.drafter: DrafterConfig.conv_group_size (24) must divide hidden_size (64)"),
    ({"drafter.method": "dflash2", "drafter.conv_kernel_size": 9},
     "config.drafter: DrafterConfig.conv_kernel_size (9) must be at most block_size (8): taps never cross a block"),
    ({"drafter.method": "dflash2", "drafter.selector_top_k": 641},
     "config.drafter: DrafterConfig.selector_top_k (641) must be at most vocab_size (640)"),
])
def test_target_dependent_errors_name_their_field(overrides, message):
    c = config(**overrides)
    validate_config(c)
    with pytest.raises(ConfigError) as error:
        resolve_drafter_config(c, TARGET, make_chat_tokenizer())
    assert message in str(error.value)


def test_the_run_config_parses_text_fields_and_leaves_the_callers_config_as_given():
    """`run_config` is the run's own copy: loss terms and chat template kwargs given as text (the command line's
    form) become mappings there, and validation rewrites nothing."""
    given = config(**{"loss.terms": "kl", "loss.position_weights": "decay",
                      "data.chat_template_kwargs": '{"enable_thinking": false}'})
    run = run_config(given)
    validate_config(run)
    assert run.loss.terms == {"kl": 1.0} and run.data.chat_template_kwargs == {"enable_thinking": False}
    assert given.loss.terms == "kl" and given.data.chat_template_kwargs == '{"enable_thinking": false}'
    run = run_config(config(**{"loss.terms": '{"tv": 0.9, "ce": 0.1}', "loss.position_weights": "decay"}))
    assert run.loss.terms == {"ce": 0.1, "tv": 0.9}
    assert run_config(config()).loss.terms == {"ce": 1.0}
    with pytest.raises(ConfigError, match="config.loss.terms"):
        run_config(config(**{"loss.terms": "nope"}))


def test_evaluation_during_training_needs_eval_files():
    validate_eval_files(config(eval_every=100, **{"data.eval_files": ("eval.jsonl",)}))
    with pytest.raises(ConfigError, match="config.eval_every = 100 needs config.data.eval_files"):
        validate_eval_files(config(eval_every=100))


def test_batch_must_split_over_the_batch_mesh_axes():
    settle_batch_size(config(grad_accum_steps=2, **{"data.batch_size": 8}), 4)
    with pytest.raises(ConfigError, match=r"4 rows per micro-batch must be a multiple of the mesh's data x fsdp"):
        settle_batch_size(config(grad_accum_steps=2, **{"data.batch_size": 8}), 8)


def test_mask_token_defaults_to_the_tokenizers_then_the_first_unused_row():
    tokenizer = make_chat_tokenizer()
    resolved = resolve_drafter_config(config(), TARGET, tokenizer)
    assert resolved.mask_token_id == len(tokenizer)  # no mask token: the first unused embedding row
    tokenizer.add_special_tokens({"mask_token": "<|mask|>"})
    assert resolve_drafter_config(config(), TARGET, tokenizer).mask_token_id == tokenizer.mask_token_id
    assert resolve_drafter_config(config(**{"drafter.mask_token_id": 630}), TARGET, tokenizer).mask_token_id == 630


def test_mask_token_without_any_unused_row_is_an_error():
    small_vocab = Qwen3Config(**{**TARGET.__dict__, "vocab_size": len(make_chat_tokenizer())})
    with pytest.raises(ConfigError, match="no unused embedding row; set config.drafter.mask_token_id"):
        resolve_drafter_config(config(), small_vocab, make_chat_tokenizer())


def test_a_regular_token_as_mask_token_warns(caplog):
    tokenizer = make_chat_tokenizer()
    regular = tokenizer("the", add_special_tokens=False)["input_ids"][0]
    with caplog.at_level(logging.WARNING, logger="dflash_jax.train.validate"):
        resolve_drafter_config(config(**{"drafter.mask_token_id": regular}), TARGET, tokenizer)
    assert f"config.drafter.mask_token_id = {regular}" in caplog.text and "regular token" in caplog.text
    caplog.clear()
    special = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    with caplog.at_level(logging.WARNING, logger="dflash_jax.train.validate"):
        resolve_drafter_config(config(**{"drafter.mask_token_id": special}), TARGET, tokenizer)
    assert caplog.text == ""


def test_drafter_defaults_come_from_the_target():
    resolved = resolve_drafter_config(config(), TARGET, make_chat_tokenizer())
    assert resolved.hidden_size == 64 and resolved.intermediate_size == 96
    assert resolved.rope_theta == 1e6 and resolved.rope_scaling is None
    assert resolved.target_layer_ids == (1, 9)  # design §2 spread for L = 12, n = 2
    assert (resolved.num_target_layers, resolved.vocab_size, resolved.max_position_embeddings) == (12, 640, 512)
    assert resolved.block_size == 8 and resolved.layer_types == ("sliding_attention", "full_attention")


def test_shipped_configs_validate():
    for module in (tiny, qwen3_8b, qwen27b, qwen27b_dflash2, qwen27b_dspark):
        c = module.get_config()
        c.target_dir, c.data.train_files = "/ckpt/target", ("train.jsonl",)
        validate_config(c)


@pytest.mark.parametrize("devices", [8, 32, 64])
def test_the_qwen_recipes_run_on_any_slice_without_a_batch_override(devices):
    """Rows per device (SpecForge's per-GPU batch: 4 for the 8B, 1 for the 27B): the README's commands need no
    --config.data.batch_size on a slice of any size."""
    for module in (qwen3_8b, qwen27b):
        c = module.get_config()
        c.target_dir, c.data.train_files = "/ckpt/target", ("train.jsonl",)
        validate_config(c)
        # the recipes' mesh: fsdp over every device (-1)
        assert dict(c.mesh) == {"data": 1, "fsdp": -1, "tensor": 1, "dcn_data": 1, "context": 1}
        rows_per_device = c.data.rows_per_device
        settle_batch_size(c, devices)
        assert (c.data.batch_size, c.data.rows_per_device) == (rows_per_device * devices, None)
        assert (c.data.seq_len // c.data.anchor_stride, c.epochs, c.optim.b2) == (512, 6, 0.999)
    for module, (seq_len, rows_per_device) in ((qwen3_8b, (3072, 4)), (qwen27b, (4096, 1))):
        data = module.get_config().data
        assert (data.seq_len, data.rows_per_device) == (seq_len, rows_per_device)


def test_a_batch_left_unset_is_one_row_per_device():
    """The base config gives neither data.batch_size nor data.rows_per_device: a step takes one row per (data,
    fsdp) device, with no warning of precedence."""
    from dflash_jax.train.config import base_config
    c = base_config()
    c.target_dir, c.data.train_files, c.total_steps = "/ckpt/target", ("train.jsonl",), 10
    validate_config(c)
    assert (c.data.batch_size, c.data.rows_per_device) == (None, None)
    settle_batch_size(c, 16)
    assert c.data.batch_size == 16


def test_qwen27b_drafter_is_the_spec_one():
    resolved = resolve_drafter_config(qwen27b.get_config(), qwen27b.target_config(), tokenizer=None)
    assert (resolved.hidden_size, resolved.intermediate_size, resolved.num_hidden_layers) == (5120, 17408, 5)
    assert (resolved.num_attention_heads, resolved.num_key_value_heads, resolved.head_dim) == (32, 8, 128)
    assert resolved.layer_types == ("sliding_attention",) * 4 + ("full_attention",) and resolved.sliding_window == 2048
    assert resolved.target_layer_ids == (1, 16, 31, 46, 61) and resolved.mask_token_id == 248070
    assert (resolved.block_size, resolved.rope_theta, resolved.rope_scaling) == (16, 1e7, None)
    drafter = nnx.eval_shape(lambda: Drafter(resolved, rngs=nnx.Rngs(0)))
    params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(drafter, nnx.Param)))
    assert abs(params / 1e9 - 1.73) < 0.01, params  # design §11: ≈1.73 B


def test_qwen27b_dflash2_is_speculators_dflash2_recipe():
    """speculators 0.9.0's `dflash2` training defaults (its TrainConfig, resolved for this target), with the
    departures the recipe names: full-attention layers, the cosine decay."""
    config = qwen27b_dflash2.get_config()
    config.target_dir, config.data.train_files = "/ckpt/target", ("train.jsonl",)
    config = run_config(config)
    validate_config(config)
    assert (config.loss.terms, config.loss.position_weights, config.loss.gamma) == ({"kl": 1.0}, "decay", 4.0)
    assert (config.data.seq_len // config.data.anchor_stride, config.data.seq_len, config.epochs) == (512, 8192, 20)
    optim = config.optim
    assert (optim.name, optim.learning_rate, optim.muon_learning_rate, optim.weight_decay) == ("muon", 1e-3, 1e-3, 0.01)
    assert (optim.muon_weight_decay, optim.b2, optim.clip_grad_norm) == (0.1, 0.999, 1.0)
    resolved = resolve_drafter_config(config, qwen27b_dflash2.target_config(), tokenizer=None)
    assert (resolved.method, resolved.block_size, resolved.num_hidden_layers) == ("dflash2", 8, 5)
    assert (resolved.conv_kernel_size, resolved.conv_group_size, resolved.selector_rank, resolved.selector_top_k) == \
        (2, 16, 256, 16) and config.drafter.selector_alpha == 1.0
    assert (resolved.hidden_size, resolved.intermediate_size) == (5120, 17408)
    assert (resolved.num_attention_heads, resolved.num_key_value_heads, resolved.head_dim) == (20, 4, 256)
    assert resolved.target_layer_ids == (1, 31, 60) and resolved.rope_theta == 1e7  # speculators' aux [2, 32, 61]
    drafter = nnx.eval_shape(lambda: Drafter(resolved, rngs=nnx.Rngs(0)))
    assert drafter.candidate_selector.successor_codebook.shape == (248320, 256)
    assert drafter.layers[4].mlp_conv.kernel_projection.kernel.shape == (5120, 2 * 2 * 320)


def test_qwen3_8b_target_and_drafter_are_the_published_ones():
    target = qwen3_8b.target_config()  # Qwen/Qwen3-8B's config.json
    assert (target.num_hidden_layers, target.hidden_size, target.intermediate_size, target.vocab_size) == \
        (36, 4096, 12288, 151936)
    assert (target.num_attention_heads, target.num_key_value_heads, target.head_dim, target.rope_theta) == \
        (32, 8, 128, 1e6)
    assert not target.tie_word_embeddings
    resolved = resolve_drafter_config(qwen3_8b.get_config(), target, tokenizer=None)
    assert resolved.target_layer_ids == (1, 9, 17, 25, 33) and resolved.mask_token_id == 151669
    assert resolved.layer_types == ("full_attention",) * 5 and resolved.intermediate_size == 12288
    drafter = nnx.eval_shape(lambda: Drafter(resolved, rngs=nnx.Rngs(0)))
    params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(drafter, nnx.Param)))
    assert abs(params / 1e9 - 1.05) < 0.01, params  # design §11: ≈1.05 B


def test_cli_reports_a_config_error_as_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "dflash_jax.train", "--config", str(REPO / "configs" / "tiny.py"),
         "--workdir", str(tmp_path), "--config.target_dir=/nonexistent", "--config.data.train_files=x.jsonl",
         "--config.drafter.block_size=1"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "error: config.drafter.block_size must be >= 2" in result.stderr
    assert "Traceback" not in result.stderr


def test_unknown_or_renamed_override_names_the_field_to_use():
    check_overrides(["--workdir=x", "--config.loss.gamma=4", "--config.mesh.fsdp", "2", "--config.optim.name=adamw"])
    with pytest.raises(ConfigError, match=r"^config.seq_len is now config.data.seq_len "):
        check_overrides(["--config.seq_len=64"])
    with pytest.raises(ConfigError, match=r"^config.loss.gama is not a config field; did you mean config.loss.gamma\?"):
        check_overrides(["--config.loss.gama=4"])
    with pytest.raises(ConfigError, match=r"^config.no_such_thing is not a config field \(fields are listed in "):
        check_overrides(["--config.no_such_thing=1"])
    with pytest.raises(ConfigError, match=r"^config.plan_only was removed: `dflash-jax plan --config <file>` prints "):
        check_overrides(["--config.plan_only=True"])


def test_a_config_file_with_an_old_field_name_is_refused():
    old = config()
    old.learning_rate = 1e-3  # a config file written before the fields were grouped
    with pytest.raises(ConfigError, match=r"^config.learning_rate is now config.optim.learning_rate "):
        validate_config(old)


def test_cli_reports_an_unknown_override_as_one_line(tmp_path):
    for module in ("dflash_jax.train", "dflash_jax.evaluate"):
        result = subprocess.run(
            [sys.executable, "-m", module, "--config", str(REPO / "configs" / "tiny.py"), "--workdir", str(tmp_path),
             "--config.batch_size=2"], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert result.returncode == 2, (module, result.stderr)
        assert result.stderr.strip() == ("error: config.batch_size is now config.data.batch_size (fields are grouped: "
                                         "drafter, data, loss, optim, mesh)")


def test_a_workdir_refuses_a_different_drafter(tmp_path):
    # What train() checks before touching checkpoints, and writes once the start is accepted.
    from dflash_jax.train.startup import _check_drafter_config, _write_drafter_config

    resolved = resolve_drafter_config(config(), TARGET, make_chat_tokenizer())
    _write_drafter_config(tmp_path / "drafter_config.json", resolved)
    _check_drafter_config(tmp_path / "drafter_config.json", resolved)  # the same drafter: a resume
    other = resolve_drafter_config(config(**{"drafter.block_size": 4}), TARGET, make_chat_tokenizer())
    with pytest.raises(ConfigError, match=r"records a different drafter .*'block_size': \(8, 4\)"):
        _check_drafter_config(tmp_path / "drafter_config.json", other)


def test_qwen27b_dspark_is_speculators_dspark_recipe():
    """configs/qwen27b_dspark.py: speculators 0.9.0's DSpark defaults for Qwen3.6-27B (design §18)."""
    config = qwen27b_dspark.get_config()
    config.target_dir, config.data.train_files = "/ckpt/target", ("train.jsonl",)
    validate_config(config)
    resolved = resolve_drafter_config(config, qwen27b_dspark.target_config(), tokenizer=None)
    assert (resolved.method, resolved.markov_rank, resolved.block_size, resolved.draft_length) == ("dspark", 256, 8, 8)
    assert (resolved.num_hidden_layers, resolved.hidden_size, resolved.intermediate_size) == (5, 5120, 17408)
    assert (resolved.num_attention_heads, resolved.num_key_value_heads, resolved.head_dim) == (24, 4, 256)
    assert resolved.layer_types == ("sliding_attention",) * 5 and resolved.sliding_window == 2048
    assert resolved.target_layer_ids == tuple(i - 1 for i in (2, 64 // 2, 64 - 3))  # speculators' aux ids - 1
    assert (dict(config.loss.terms), config.loss.position_weights, config.loss.gamma) == ({"kl": 1.0}, "decay", 4.0)
    assert config.drafter.confidence_alpha == 1.0
    assert (config.data.seq_len, config.data.seq_len // config.data.anchor_stride, config.epochs) == (8192, 512, 20)
    optim = config.optim
    assert (optim.name, optim.learning_rate, optim.muon_learning_rate) == ("muon", 1e-3, None)
    assert (optim.weight_decay, optim.muon_weight_decay, optim.b2, optim.warmup_ratio) == (0.01, 0.1, 0.999, 0.01)
    drafter = nnx.eval_shape(lambda: Drafter(resolved, rngs=nnx.Rngs(0)))
    params = {"/".join(map(str, path)): int(np.prod(x.shape))
              for path, x in nnx.to_flat_state(nnx.state(drafter, nnx.Param))}
    # The Markov head: W1 [V, 256] and W2 [256, V] over the target's 248320 tokens; the confidence head [H + r] -> 1.
    assert params["markov_head/w1"] == params["markov_head/w2"] == 248320 * 256
    assert params["confidence_head/kernel"] == 5120 + 256
    assert abs(sum(params.values()) / 1e9 - 1.91) < 0.01, sum(params.values())  # 0.13 B of it the Markov head


def test_the_feature_layer_count_follows_the_ids_or_defaults_to_five():
    """config.drafter.num_feature_layers unset: the number of target_layer_ids when they are given, else five
    spread over the target (design §2); given beside ids, it must agree with them."""
    from dflash_jax.models.drafter import default_target_layer_ids

    tokenizer = make_chat_tokenizer()
    given = resolve_drafter_config(config(**{"drafter.num_feature_layers": None,
                                             "drafter.target_layer_ids": (1, 5, 9)}), TARGET, tokenizer)
    assert given.target_layer_ids == (1, 5, 9)
    spread = resolve_drafter_config(config(**{"drafter.num_feature_layers": None}), TARGET, tokenizer)
    assert spread.target_layer_ids == tuple(default_target_layer_ids(12, 5))
