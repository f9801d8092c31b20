"""The fused LM-head cross-entropy against the dense form (whole [rows, V] logits, autodiff gradient, argmax):
values, gradients, tie rules, the frozen head, row chunks and dtypes."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.train.loss import lm_head_cross_entropy, map_row_chunks


def dense_cross_entropy(hidden, kernel, labels):
    """The unchunked definition: every logit at once, cross-entropy by logsumexp, correctness by argmax."""
    logits = jnp.dot(hidden, kernel.astype(hidden.dtype), preferred_element_type=jnp.float32)
    label_logit = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - label_logit, jnp.argmax(logits, axis=-1) == labels


def inputs(batch, rows, width, vocab, dtype=jnp.float32, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    hidden = jax.random.normal(keys[0], (batch, rows, width), jnp.float32).astype(dtype)
    kernel = (jax.random.normal(keys[1], (width, vocab), jnp.float32) / np.sqrt(width)).astype(dtype)
    labels = jax.random.randint(keys[2], (batch, rows), 0, vocab)
    weights = jax.random.uniform(keys[3], (batch, rows))  # a weighted sum, like the DFlash loss
    return hidden, kernel, labels, weights


def weighted_loss(fn, row_chunk=None):
    def loss(hidden, kernel, labels, weights):
        args = (hidden, kernel, labels) + (() if row_chunk is None else (row_chunk,))
        ce, correct = fn(*args)
        return jnp.sum(ce * weights), (ce, correct)

    return jax.jit(jax.value_and_grad(loss, has_aux=True))


@pytest.mark.parametrize("row_chunk", [16, 24, 64])  # 24 does not divide the 48 rows: a padded last chunk
def test_loss_gradient_and_correctness_equal_the_dense_form(row_chunk):
    hidden, kernel, labels, weights = inputs(batch=3, rows=48, width=32, vocab=200)
    # Make a third of the labels the argmax, so `correct` is exercised both ways.
    logits = np.asarray(hidden @ kernel)
    labels = np.where(np.arange(48) % 3 == 0, logits.argmax(-1), np.asarray(labels))
    labels = jnp.asarray(labels, jnp.int32)

    (loss, (ce, correct)), grad = weighted_loss(lm_head_cross_entropy, row_chunk)(hidden, kernel, labels, weights)
    (loss_ref, (ce_ref, correct_ref)), grad_ref = weighted_loss(dense_cross_entropy)(hidden, kernel, labels,
                                                                                     weights)
    np.testing.assert_allclose(ce, ce_ref, rtol=1e-5)
    np.testing.assert_allclose(loss, loss_ref, rtol=1e-5)
    np.testing.assert_allclose(grad, grad_ref, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(grad_ref))))
    np.testing.assert_array_equal(correct, correct_ref)
    assert 0 < int(correct.sum()) < correct.size


def test_ties_resolve_to_the_lowest_id_like_argmax():
    """A label tied at the row maximum is correct only if no lower id attains it (argmax's rule)."""
    width, vocab = 8, 12
    kernel = 0.1 * np.array(jax.random.normal(jax.random.PRNGKey(1), (width, vocab)))
    kernel[:, [3, 7]] = 0.0
    kernel[0, [3, 7]] = 5.0  # ids 3 and 7 have equal logits, the largest ones for a hidden state e_0
    hidden = np.zeros((1, 6, width), np.float32)
    hidden[0, :4, 0] = 1.0  # rows 0-3: ids 3 and 7 share the maximum
    # Rows 4-5: a zero hidden state, every logit 0.0: all ids tie, argmax is id 0.
    labels = np.array([[3, 7, 2, 0, 0, 5]], np.int32)
    ce, correct = jax.jit(lm_head_cross_entropy, static_argnums=3)(jnp.asarray(hidden), jnp.asarray(kernel),
                                                                   jnp.asarray(labels), 4)
    np.testing.assert_array_equal(correct[0], [True, False, False, False, True, False])
    _, correct_ref = dense_cross_entropy(jnp.asarray(hidden), jnp.asarray(kernel), jnp.asarray(labels))
    np.testing.assert_array_equal(correct, correct_ref)
    np.testing.assert_allclose(ce[0, 4:], np.log(vocab), rtol=1e-6)  # uniform softmax


def test_the_lm_head_is_frozen():
    """No gradient reaches the (frozen, borrowed) LM head, even when asked for."""
    hidden, kernel, labels, weights = inputs(batch=2, rows=8, width=16, vocab=40)
    grad_kernel = jax.grad(lambda k: jnp.sum(lm_head_cross_entropy(hidden, k, labels, 4)[0] * weights))(kernel)
    np.testing.assert_array_equal(grad_kernel, np.zeros_like(kernel))


def test_bfloat16_hidden_keeps_its_dtype_and_matches_the_dense_form():
    hidden, kernel, labels, weights = inputs(batch=2, rows=32, width=64, vocab=300, dtype=jnp.bfloat16)
    (_, (ce, _)), grad = weighted_loss(lm_head_cross_entropy, 16)(hidden, kernel, labels, weights)
    (_, (ce_ref, _)), grad_ref = weighted_loss(dense_cross_entropy)(hidden, kernel, labels, weights)
    assert ce.dtype == jnp.float32 and grad.dtype == jnp.bfloat16
    np.testing.assert_allclose(ce, ce_ref, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad, np.float32), np.asarray(grad_ref, np.float32), rtol=2e-2,
                               atol=2e-2 * float(jnp.max(jnp.abs(grad_ref.astype(jnp.float32)))))


def count_primitive(jaxpr, name: str) -> int:
    """Occurrences of a primitive in a jaxpr and every jaxpr nested in it (loop bodies, custom rules)."""
    total = 0
    for eqn in jaxpr.eqns:
        total += eqn.primitive.name == name
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            total += count_primitive(sub, name)
    return total


def test_one_chunk_of_logits_at_a_time_and_no_recompute():
    """The step holds [batch, row_chunk, V] logits, never [batch, rows, V]; differentiating costs two matmuls
    with the head (the logits, and the gradient back through it), not three (no recomputed logits)."""
    batch, rows, width, vocab, row_chunk = 2, 64, 16, 96, 16
    hidden, kernel, labels, weights = inputs(batch, rows, width, vocab)
    text = weighted_loss(lm_head_cross_entropy, row_chunk).lower(hidden, kernel, labels, weights).as_text()
    assert f"{batch}x{rows}x{vocab}x" not in text
    assert f"{batch}x{row_chunk}x{vocab}xf32" in text
    gradient = jax.grad(lambda h: jnp.sum(lm_head_cross_entropy(h, kernel, labels, row_chunk)[0] * weights))
    assert count_primitive(jax.make_jaxpr(gradient)(hidden).jaxpr, "dot_general") == 2
    # Without differentiation the gradient is not computed at all.
    forward = jax.make_jaxpr(lambda h: lm_head_cross_entropy(h, kernel, labels, row_chunk))(hidden)
    assert count_primitive(forward.jaxpr, "dot_general") == 1


def test_map_row_chunks_keeps_leading_axes_and_drops_padding():
    x = jnp.arange(2 * 10 * 3, dtype=jnp.float32).reshape(2, 10, 3)
    y = jnp.arange(2 * 10).reshape(2, 10)
    doubled, total = map_row_chunks(lambda a, b: (2 * a, b + a.sum(-1).astype(b.dtype)), 4, 1, x, y)
    np.testing.assert_array_equal(doubled, 2 * x)
    np.testing.assert_array_equal(total, y + x.sum(-1).astype(y.dtype))


def test_bf16_head_has_no_fp32_copy_and_matches_fp32():
    """With a bf16 head and hidden, the compiled loss gradient holds no fp32 array of the head's shape (either
    orientation): both products run in bf16 with fp32 accumulation. Its loss and gradient match the fp32 ones
    within bf16 tolerance (inputs rounded to bf16 first, so only the products' precision differs)."""
    H, V, R = 32, 1024, 24
    keys = jax.random.split(jax.random.PRNGKey(3), 3)
    hidden = jax.random.normal(keys[0], (2, R, H)).astype(jnp.bfloat16)
    kernel = (jax.random.normal(keys[1], (H, V)) / np.sqrt(H)).astype(jnp.bfloat16)
    labels = jax.random.randint(keys[2], (2, R), 0, V)

    def loss(h, k):
        return jnp.sum(lm_head_cross_entropy(h, k, labels, 8)[0])

    grad_bf16 = jax.jit(jax.value_and_grad(loss))
    text = grad_bf16.lower(hidden, kernel).compile().as_text()
    assert f"f32[{H},{V}]" not in text and f"f32[{V},{H}]" not in text
    value, grad = grad_bf16(hidden, kernel)
    value32, grad32 = jax.value_and_grad(loss)(hidden.astype(jnp.float32), kernel.astype(jnp.float32))
    np.testing.assert_allclose(float(value), float(value32), rtol=1e-2)
    np.testing.assert_allclose(np.asarray(grad, np.float32), np.asarray(grad32), rtol=5e-2, atol=2e-2)
