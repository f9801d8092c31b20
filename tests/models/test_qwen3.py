"""Qwen3 target against transformers.Qwen3ForCausalLM (CPU, fp32, random weights including norms)."""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax.models.qwen3 import Qwen3, Qwen3Config
from dflash_jax.weights.targets import load_target
from tests.decode_check import max_relative_error_of_cached_logits
from tests.hf_fixtures import hf_forward, qwen3_config, relative_error, save_qwen3

SEQ_LEN = 77  # not a multiple of 64
TOLERANCE = 1e-4

CONFIGS = {
    # GQA 2, head_dim 24 != 64/4, untied, theta 1e4.
    "gqa2-untied-hd24": (qwen3_config(), None),
    # GQA 4, head_dim 8 != 48/8, tied, theta 1e6.
    "gqa4-tied-theta1e6": (qwen3_config(hidden_size=48, intermediate_size=80, num_hidden_layers=4,
                                        num_attention_heads=8, num_key_value_heads=2, head_dim=8,
                                        tie_word_embeddings=True,
                                        rope_parameters={"rope_type": "default", "rope_theta": 1e6}), None),
    # MQA, head_dim 32 != 64/4, untied, theta 5e5, eps 1e-5, sharded checkpoint with an index file.
    "mqa-sharded-theta5e5": (qwen3_config(num_hidden_layers=2, num_key_value_heads=1, head_dim=32,
                                          rms_norm_eps=1e-5,
                                          rope_parameters={"rope_type": "default", "rope_theta": 5e5}), "20KB"),
}


@functools.partial(nnx.jit, static_argnames="feature_layer_ids")
def run(model, input_ids, positions, segment_ids, feature_layer_ids=()):
    out = model(input_ids, positions, segment_ids, feature_layer_ids)
    return out, model.logits(out.hidden)


def single_document(input_ids):
    batch, length = input_ids.shape
    return jnp.broadcast_to(jnp.arange(length), (batch, length)), jnp.ones((batch, length), jnp.int32)


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    """(HF model, our model loaded from its save_pretrained directory, input ids)."""
    hf_config, shard_size = CONFIGS[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    hf_model = save_qwen3(directory, hf_config, seed=len(request.param), max_shard_size=shard_size)
    assert (directory / "model.safetensors.index.json").is_file() == (shard_size is not None)
    model, _ = load_target(directory, param_dtype=jnp.float32)
    input_ids = np.random.default_rng(0).integers(0, hf_config.vocab_size, (2, SEQ_LEN), dtype=np.int32)
    return hf_model, model, input_ids


def test_parity_with_transformers_every_layer(pair):
    hf_model, model, input_ids = pair
    num_layers = model.config.num_hidden_layers
    hf_logits, hf_hidden, hf_layers = hf_forward(hf_model, input_ids)
    out, logits = run(model, jnp.asarray(input_ids), *single_document(input_ids),
                      feature_layer_ids=tuple(range(num_layers)))
    assert out.features.shape == (2, SEQ_LEN, num_layers, model.config.hidden_size)
    for t in range(num_layers):
        assert relative_error(out.features[:, :, t], hf_layers[t]) < TOLERANCE, f"layer {t}"
        if t < num_layers - 1:  # HF's last entry is final-normed; compared below as `hidden`
            assert relative_error(out.features[:, :, t], hf_hidden[t + 1]) < TOLERANCE, f"hidden_states[{t + 1}]"
    assert relative_error(out.hidden, hf_hidden[num_layers]) < TOLERANCE
    assert relative_error(logits, hf_logits) < TOLERANCE


def test_features_subset_in_request_order(pair):
    hf_model, model, input_ids = pair
    last = model.config.num_hidden_layers - 1
    _, hf_hidden, hf_layers = hf_forward(hf_model, input_ids)
    requested = (last, 0, 1, 0)  # unsorted, with a repeat
    out, _ = run(model, jnp.asarray(input_ids), *single_document(input_ids), feature_layer_ids=requested)
    assert out.features.shape[2] == len(requested)
    for slot, layer_id in enumerate(requested):
        expected = hf_hidden[layer_id + 1] if layer_id < last else hf_layers[last]
        assert relative_error(out.features[:, :, slot], expected) < TOLERANCE, f"slot {slot} (layer {layer_id})"


def test_feature_layer_ids_are_validated(pair):
    _, model, input_ids = pair
    num_layers = model.config.num_hidden_layers
    for bad in ((num_layers,), (-1,), (0.5,)):
        with pytest.raises(ValueError, match=rf"every id must be an integer in \[0, {num_layers - 1}\]"):
            model(jnp.asarray(input_ids), *single_document(input_ids), bad)


def test_lm_head_kernel_matches_logits(pair):
    _, model, input_ids = pair
    out, logits = run(model, jnp.asarray(input_ids), *single_document(input_ids))
    kernel = model.lm_head_kernel()
    assert kernel.shape == (model.config.hidden_size, model.config.vocab_size)
    assert relative_error(out.hidden @ kernel, logits) < 1e-6


def test_decode_cache_logits_equal_the_full_forward(pair):
    """Batched prompts of 3, 9 and 20 tokens, left-padded into one prefill, then single tokens and short
    blocks: every call's logits equal the uncached forward's (fp32)."""
    _, model, _ = pair
    assert max_relative_error_of_cached_logits(model, model.config.vocab_size, (3, 9, 20)) < TOLERANCE


def test_packed_documents_match_documents_alone(tmp_path):
    save_qwen3(tmp_path, qwen3_config(), seed=3)
    model, config = load_target(tmp_path, param_dtype=jnp.float32)
    rng = np.random.default_rng(1)
    lengths = (30, 25)
    docs = [rng.integers(0, config.vocab_size, (length,), dtype=np.int32) for length in lengths]
    padding = SEQ_LEN - sum(lengths)
    input_ids = np.concatenate([*docs, np.zeros(padding, np.int32)])[None]
    positions = np.concatenate([np.arange(n) for n in (*lengths, padding)])[None]
    segment_ids = np.repeat([1, 2, 0], (*lengths, padding))[None]
    packed, packed_logits = run(model, jnp.asarray(input_ids), jnp.asarray(positions), jnp.asarray(segment_ids),
                                feature_layer_ids=(1,))
    start = 0
    for doc in docs:
        alone, alone_logits = run(model, jnp.asarray(doc[None]), *single_document(doc[None]), feature_layer_ids=(1,))
        span = slice(start, start + len(doc))
        assert relative_error(packed_logits[:, span], alone_logits) < 1e-5
        assert relative_error(packed.features[:, span], alone.features) < 1e-5
        start += len(doc)


def test_compile_time_does_not_grow_with_depth():
    """Layers are scanned: the program holds one layer body whatever L is."""

    def lower(num_layers):
        config = Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=num_layers,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16)
        graphdef, state = nnx.split(nnx.eval_shape(lambda: Qwen3(config, rngs=nnx.Rngs(0))))
        ids = jax.ShapeDtypeStruct((2, SEQ_LEN), jnp.int32)

        def forward(state, input_ids, positions, segment_ids):
            model = nnx.merge(graphdef, state)
            return model.logits(model(input_ids, positions, segment_ids, (1,)).hidden)

        return jax.jit(forward).lower(state, ids, ids, ids)

    shallow, deep = lower(2), lower(16)
    assert shallow.as_text().count("dot_general") == deep.as_text().count("dot_general")
    timings = []
    for lowered in (shallow, deep):
        start = time.perf_counter()
        lowered.compile()
        timings.append(time.perf_counter() - start)
    assert timings[1] < 3 * timings[0] + 0.5, f"compile 2 layers {timings[0]:.2f}s, 16 layers {timings[1]:.2f}s"


QWEN3_8B_CONFIG = {  # Qwen3-8B's config.json (design §11), legacy top-level rope keys
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 12288, "max_position_embeddings": 40960,
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "tie_word_embeddings": False, "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_config_from_legacy_and_v5_files():
    legacy = Qwen3Config.from_hf(QWEN3_8B_CONFIG)
    assert legacy == Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                                 num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                 rms_norm_eps=1e-6, rope_theta=1e6, rope_scaling=None, tie_word_embeddings=False,
                                 max_position_embeddings=40960)
    v5 = {key: value for key, value in QWEN3_8B_CONFIG.items() if key not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {"rope_theta": 1e6, "rope_type": "default"}
    assert Qwen3Config.from_hf(v5) == legacy
    hash(legacy)  # static module metadata must be hashable


def test_config_defaults_follow_transformers():
    minimal = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
               "num_attention_heads": 4}
    config = Qwen3Config.from_hf(minimal)
    assert (config.head_dim, config.num_key_value_heads, config.rope_theta) == (128, 4, 10000.0)
    assert (config.rms_norm_eps, config.tie_word_embeddings, config.max_position_embeddings) == (1e-6, False, 32768)


@pytest.mark.parametrize("change, message", [
    ({"hidden_size": None}, "missing required field(s): hidden_size"),
    ({"num_hidden_layers": "36"}, "field 'num_hidden_layers' must be a positive integer"),
    ({"num_key_value_heads": 5}, "'num_attention_heads' (32) must be a multiple of 'num_key_value_heads' (5)"),
    ({"head_dim": 127}, "field 'head_dim' must be even"),
    ({"rms_norm_eps": -1.0}, "field 'rms_norm_eps' must be a positive number"),
    ({"tie_word_embeddings": "yes"}, "field 'tie_word_embeddings' must be a bool"),
    ({"use_sliding_window": True}, "field 'use_sliding_window' is true"),
    ({"attention_bias": True}, "field 'attention_bias' is true"),
    ({"hidden_act": "gelu"}, "field 'hidden_act' must be 'silu'"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "rope_scaling type 'dynamic' is not supported"),
    ({"rope_parameters": 5}, "field 'rope_parameters' must be an object"),
])
def test_config_errors_name_the_field(change, message):
    with pytest.raises(ValueError) as error:
        Qwen3Config.from_hf({**QWEN3_8B_CONFIG, **change})
    assert message in str(error.value)
