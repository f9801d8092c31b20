"""qwen3_moe target against transformers.Qwen3MoeForCausalLM (CPU, fp32, random weights including norms): every
layer and the logits for all-sparse and mixed dense/sparse layer stacks, renormalised and not, tied and untied;
packed documents against each document run alone by transformers; the FLOP count."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from dflash_jax.weights.targets import load_target
from tests.hf_fixtures import hf_forward, randomize_parameters, relative_error

TOLERANCE = 1e-4
SEQ_LEN = 37
# name -> Qwen3MoeConfig fields over BASE: which layers are sparse (transformers' rule: not in mlp_only_layers and
# (i + 1) % decoder_sparse_step == 0), whether the top-k weights are renormalised, tied embeddings.
BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=6, num_experts_per_tok=2,
            max_position_embeddings=128)
CASES = {
    "all-sparse-renormalised-untied": dict(norm_topk_prob=True, tie_word_embeddings=False),
    "mlp-only-layers-not-renormalised-tied": dict(norm_topk_prob=False, tie_word_embeddings=True,
                                                   mlp_only_layers=[0, 2]),
    "sparse-step-2-renormalised-untied": dict(norm_topk_prob=True, tie_word_embeddings=False, decoder_sparse_step=2),
}
SPARSE = {"all-sparse-renormalised-untied": (True,) * 4, "mlp-only-layers-not-renormalised-tied": (False, True) * 2,
          "sparse-step-2-renormalised-untied": (False, True) * 2}


@functools.partial(nnx.jit, static_argnums=(4,))
def run(model, ids, positions, segments, feature_ids):
    out = model(ids, positions, segments, feature_ids)
    return out.features, model.logits(out.hidden)


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    """(case, transformers model, our model loaded from its save_pretrained directory)."""
    config = transformers.Qwen3MoeConfig(**BASE, **CASES[request.param])
    torch.manual_seed(0)
    hf = randomize_parameters(transformers.Qwen3MoeForCausalLM(config).to(torch.float32).eval(), seed=0)
    directory = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(directory)
    model, ours = load_target(directory, param_dtype=jnp.float32)
    assert ours.moe.sparse_layers == SPARSE[request.param]
    assert [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in hf.model.layers] == \
        list(ours.moe.sparse_layers)
    return request.param, hf, model


def test_every_layer_and_the_logits_match_transformers(pair):
    _, hf, model = pair
    ids = np.random.default_rng(0).integers(0, BASE["vocab_size"], (2, SEQ_LEN))
    hf_logits, hf_hidden, hf_layers = hf_forward(hf, ids)
    layers = tuple(range(BASE["num_hidden_layers"]))
    features, logits = run(model, jnp.asarray(ids), jnp.broadcast_to(jnp.arange(SEQ_LEN), ids.shape),
                           jnp.ones(ids.shape, jnp.int32), layers)
    assert relative_error(logits, hf_logits) < TOLERANCE
    for layer in layers:
        assert relative_error(features[:, :, layer], hf_layers[layer]) < TOLERANCE, layer
    assert relative_error(features[:, :, 0], hf_hidden[1]) < TOLERANCE  # hidden_states[i + 1]: after layer i


def test_packed_documents_equal_each_document_alone_in_transformers(pair):
    """Two documents and padding in one row (positions restarting, segment ids): each document's logits and
    features equal what transformers computes for that document alone."""
    _, hf, model = pair
    rng = np.random.default_rng(1)
    lengths, padding = (20, 13), 4
    documents = [rng.integers(0, BASE["vocab_size"], length) for length in lengths]
    ids = np.concatenate([*documents, np.zeros(padding, int)])[None]
    positions = np.concatenate([np.arange(n) for n in (*lengths, padding)])[None]
    segments = np.repeat([1, 2, 0], (*lengths, padding))[None]
    layers = tuple(range(BASE["num_hidden_layers"]))
    features, logits = run(model, jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(segments), layers)
    start = 0
    for document in documents:
        hf_logits, _, hf_layers = hf_forward(hf, document[None])
        span = slice(start, start + len(document))
        assert relative_error(logits[:, span], hf_logits) < TOLERANCE
        for layer in layers:
            assert relative_error(features[:, span, layer], hf_layers[layer]) < TOLERANCE, layer
        start += len(document)


def test_flop_count_takes_the_k_experts_a_token_reaches(pair):
    """layer_matmul_params against the transformers model's own weights: per layer q/k/v/o and either the dense
    MLP or the router and num_experts_per_tok of the experts (not all of them)."""
    _, hf, model = pair
    config = hf.config
    expected = 0
    for layer in hf.model.layers:
        attention = layer.self_attn
        expected += sum(p.numel() for m in (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj)
                        for p in m.parameters())
        if hasattr(layer.mlp, "experts"):
            one_expert = sum(p.numel() for p in layer.mlp.experts.parameters()) // config.num_experts
            expected += layer.mlp.gate.weight.numel() + config.num_experts_per_tok * one_expert
        else:
            expected += sum(p.numel() for p in layer.mlp.parameters())
    assert model.config.layer_matmul_params == expected
