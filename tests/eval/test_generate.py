"""The KV-cached target, the drafter's context cache and the speculative generator (design §9.3).

CPU, fp32, a tiny random Qwen3 target (tests/hf_fixtures.py) and a tiny random drafter with a sliding and a
full attention layer. Exact τ against the generator, with a trained drafter, is in test_exact_tau.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax.eval.generate import SpeculativeGenerator, benchmark, continue_text
from dflash_jax.models.drafter import DecodeStep, Drafter
from dflash_jax.ops.anchors import AnchorGrid, DrafterInputs, block_token_ids
from dflash_jax.weights.targets import load_target
from tests.eval_fixtures import BLOCK, VOCAB, drafter_config
from tests.hf_fixtures import qwen3_config, save_qwen3

PROMPT_LENGTHS = (3, 7, 12)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    directory = tmp_path_factory.mktemp("target")
    save_qwen3(directory, qwen3_config(vocab_size=VOCAB), seed=5)
    return load_target(directory, param_dtype=jnp.float32)[0]


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, VOCAB, n).astype(np.int32) for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def generators(target):
    """One plain and one speculative generator (each compiles once), random drafter."""
    drafter = Drafter(drafter_config(), rngs=nnx.Rngs(0))
    return {name: SpeculativeGenerator(target, model, prefill_len=16, capacity=64)
            for name, model in (("plain", None), ("speculative", drafter))}


def test_cached_forward_with_a_cropped_block_matches_the_full_forward(target):
    """Prefill, a rejected verification block, the crop, then the rest: the same hidden states and
    features as one uncached forward over the committed text."""
    ids = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (1, 20)), jnp.int32)
    layers = (0, 1, 2)
    full = target(ids, jnp.arange(20)[None], jnp.ones((1, 20), jnp.int32), layers)
    extend = nnx.jit(lambda model, chunk, cache: continue_text(model, chunk, cache, layers))  # 5 tokens at a time
    cache, outputs = target.init_cache(1, 32), []
    for start in (0, 5, 10, 15):
        if start == 10:
            cache = extend(target, jnp.full((1, 5), 7, jnp.int32), cache).cache  # a block to reject
            assert int(cache.length) == 15
            cache = cache._replace(length=jnp.int32(10))
        out = extend(target, ids[:, start:start + 5], cache)
        outputs.append(out)
        cache = out.cache
    assert int(cache.length) == 20
    np.testing.assert_allclose(jnp.concatenate([o.hidden for o in outputs], 1), full.hidden, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(jnp.concatenate([o.features for o in outputs], 1), full.features, rtol=1e-5,
                               atol=1e-5)


def test_cached_plain_greedy_matches_uncached_greedy(target, generators, prompts):
    """Block size 1, no drafter: token for token the argmax of a full forward over the text so far."""
    length = 48

    @jax.jit
    def next_token(ids, last):  # padding after the text changes nothing before it (causal)
        hidden = target(ids, jnp.arange(length)[None], jnp.ones((1, length), jnp.int32)).hidden
        return jnp.argmax(target.logits(hidden[0, last]))

    for prompt in prompts:
        generated = generators["plain"].generate(prompt, 20)
        text = list(prompt)
        for _ in range(20):
            padded = np.zeros((1, length), np.int32)
            padded[0, :len(text)] = text
            text.append(int(next_token(padded, len(text) - 1)))
        np.testing.assert_array_equal(generated.tokens, text[len(prompt):])
        assert generated.acceptance_lengths == [1] * 19


def test_drafter_cache_matches_the_drafter_forward():
    """The drafter with a cache drafts what it drafts without one at that anchor (stride-1 grid, §5 mask), with
    the context arriving as in the generator: each step writes 5 columns from the previous anchor on, those past
    the new anchor stale (a rejected draft's) until the next step overwrites them. The anchor moves by 1 to 5
    (all drafts accepted: a whole ring's worth at once); the sliding layer (window 5) keeps a ring of 5 columns,
    which the 26 positions wrap five times, the full layer every column. One compile of the step."""
    config = drafter_config()
    drafter = Drafter(config, rngs=nnx.Rngs(1))
    rng = np.random.default_rng(2)
    length, width, step = 26, len(config.target_layer_ids) * config.hidden_size, 5
    features = jnp.asarray(rng.standard_normal((1, length + step, width)), jnp.float32)
    stale = jnp.asarray(rng.standard_normal((1, length + step, width)), jnp.float32)
    ids = rng.integers(0, VOCAB, (1, length)).astype(np.int32)
    embed = jnp.asarray(rng.standard_normal((VOCAB, config.hidden_size)), jnp.float32)
    grid = AnchorGrid(length, 1, BLOCK)
    positions = jnp.arange(length)[None]
    segments = jnp.ones((1, length), jnp.int32)
    block_ids = block_token_ids(ids, grid.anchors, BLOCK, config.mask_token_id)
    expected = nnx.jit(lambda model: model(features[:, :length], embed[block_ids],
                                           DrafterInputs.from_rows(grid, positions, segments))[0])(drafter)
    expected = expected.reshape(length, BLOCK, -1)

    draft = nnx.jit(lambda model, context, block, start, anchor, cache: model(
        context, block, DecodeStep(start, anchor), cache))
    cache = drafter.init_cache(1, 32)
    assert cache.keys.shape == (1, 1, 32, 2, 16) and cache.window_keys.shape == (1, 1, 5, 2, 16)
    assert drafter.init_cache(1, 3).window_keys.shape == (1, 1, 3, 2, 16)  # no wider than its capacity
    start = 0
    for anchor in (3, 8, 9, 12, 17, 19, 24, 25):  # the first step is the prefill of a 3-token prompt
        columns = np.arange(start, start + step)
        context = jnp.where((columns < anchor)[None, :, None], features[:, columns], stale[:, columns])
        block = embed[block_ids[:, anchor * BLOCK:(anchor + 1) * BLOCK]]
        hidden, cache = draft(drafter, context, block, jnp.int32(start), jnp.int32(anchor), cache)
        np.testing.assert_allclose(hidden[0], expected[anchor], rtol=1e-4, atol=1e-5, err_msg=f"anchor {anchor}")
        start = anchor


def test_speculative_output_is_plain_greedy(generators, prompts):
    plain, speculative = generators["plain"], generators["speculative"]
    for prompt in prompts:
        for max_new_tokens in (1, 2, 23):
            expected, got = plain.generate(prompt, max_new_tokens), speculative.generate(prompt, max_new_tokens)
            np.testing.assert_array_equal(got.tokens, expected.tokens)
            assert len(got.tokens) == max_new_tokens
            assert sum(got.acceptance_lengths) == max_new_tokens - 1  # the first token is the prefill's


def test_stop_tokens_end_both_modes_alike(generators, prompts):
    reference = generators["plain"].generate(prompts[1], 23).tokens
    first_stop = next(i for i in range(4, 23) if reference[i] not in reference[:i])  # a token new mid-way
    stop = int(reference[first_stop])
    report, plain_runs, speculative_runs = benchmark(generators["plain"], generators["speculative"], [prompts[1]],
                                                     23, stop_token_ids=(stop,))
    np.testing.assert_array_equal(plain_runs[0].tokens, reference[:first_stop + 1])
    np.testing.assert_array_equal(speculative_runs[0].tokens, reference[:first_stop + 1])
    assert report["outputs_differing_from_plain"] == 0 and report["tau"] >= 1
    assert report["tokens_per_second"]["plain"] > 0 and report["speedup"] > 0


def test_shape_limits_are_explained(target, generators):
    with pytest.raises(ValueError, match="the prompt has 17 tokens; this generator takes 1 to 16"):
        generators["plain"].generate(np.zeros(17, np.int32), 4)
    with pytest.raises(ValueError, match=r"needs capacity >= 66, this generator has 64"):
        generators["speculative"].generate(np.zeros(12, np.int32), 50)
    with pytest.raises(ValueError, match=r"capacity \(8\) must be >= prefill_len \(16\)"):
        SpeculativeGenerator(target, None, prefill_len=16, capacity=8)


@pytest.mark.slow  # a 16K-token prompt through the three decoders on CPU, per family (one to three minutes each)
@pytest.mark.parametrize("family", ["dense", "hybrid"])
def test_decoders_stay_lossless_past_16k_tokens_with_window_sized_sliding_caches(family, tmp_path):
    """A prompt of 16,400 tokens: speculative and DDTree decoding commit plain greedy's tokens on both target
    families, and the drafter cache each decoder holds keeps its window of columns (5) in the sliding layer and
    the whole context in the full layer."""
    from dflash_jax.eval.ddtree_decode import DDTreeGenerator
    from tests.decode_check import tiny_hybrid_target

    config = dataclasses.replace(drafter_config(), max_position_embeddings=32768)
    if family == "dense":
        save_qwen3(tmp_path, qwen3_config(vocab_size=VOCAB, max_position_embeddings=32768), seed=5)
        target = load_target(tmp_path, param_dtype=jnp.float32)[0]
    else:  # two periods of [Gated DeltaNet, gated attention]
        target = tiny_hybrid_target(VOCAB)
        config = dataclasses.replace(config, target_layer_ids=(0, 3), num_target_layers=4)
    drafter = Drafter(config, rngs=nnx.Rngs(0))
    length, new_tokens = 16400, 24
    prompt = np.random.default_rng(3).integers(0, VOCAB, length).astype(np.int32)
    shapes = dict(prefill_len=length, capacity=length + new_tokens + 1 + 8)
    plain = SpeculativeGenerator(target, None, **shapes).generate(prompt, new_tokens)
    for generator in (SpeculativeGenerator(target, drafter, **shapes),
                      DDTreeGenerator(target, drafter, budget=8, **shapes)):
        cache = jax.eval_shape(generator._prefill, generator._target_state, generator._drafter_state, prompt[None],
                               np.int32(length))[1]
        assert cache.window_keys.shape[2] == cache.window_values.shape[2] == 5
        assert cache.keys.shape[2] == cache.values.shape[2] == shapes["capacity"]
        output = generator.generate(prompt, new_tokens)
        np.testing.assert_array_equal(output.tokens, plain.tokens)
