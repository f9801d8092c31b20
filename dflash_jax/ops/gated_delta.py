"""The gated delta rule (Gated DeltaNet's recurrent core): chunked form for training, per-token reference.

Per value head, with state S ∈ R^{dk×dv} starting at 0, for each token t:

    S ← exp(g_t) · S                     (g_t ≤ 0 is the log-decay)
    S ← S + k_t (β_t (v_t − Sᵀ k_t))ᵀ    (delta rule: correct what the memory predicts for k_t)
    o_t = Sᵀ q_t

This is transformers' `torch_recurrent_gated_delta_rule` / `torch_chunk_gated_delta_rule`
(models/qwen3_5/modeling_qwen3_5.py), with q, k already L2-normalised and q scaled by dk^-0.5 by the caller.

Packed rows: `resets[b, t]` marks the first token of a new segment. The state carried into that token is
dropped (S ← 0 before its update), exactly as if g_t were −∞; see `chunked_gated_delta_rule` for how that
enters the chunked form. Decoding continues from the state a previous call returned (`initial_state`, else
0); a reset at t = 0 then drops it. Everything here is fp32 whatever the model dtype; the matmuls are fp32
(Precision.HIGHEST, the exact path) or, with `matmul_dtype="bfloat16"`, the chunked form's per-chunk products
take bf16 operands with fp32 accumulation (tensor-core speed on TPU and GPU) while the triangular inverse and
the state carried across chunks stay fp32 (bench/RESULTS.md, "Gated delta rule precision", has the errors).
Which one a target runs is fixed when it is built (`Qwen3_5(delta_rule_dtype=...)`, from
config.target_matmul_dtype, resolved by `resolve_delta_rule_dtype`), so training, evaluation and regeneration
compute the same products (design §8.3).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

CHUNK_SIZE = 64  # transformers' chunk size; any power of two gives the same result up to fp32 rounding
MATMUL_DTYPES = ("float32", "bfloat16")
MATMUL_CHOICES = ("auto", *MATMUL_DTYPES)  # "auto": bfloat16 on TPU and GPU, float32 on CPU


def resolve_delta_rule_dtype(choice: str, platform: str | None = None) -> str:
    """The chunk products' dtype (MATMUL_DTYPES) of `choice` (MATMUL_CHOICES) on `platform` (the devices the
    model runs on; default JAX's default backend): "auto" is float32 on CPU, bfloat16 elsewhere."""
    if choice not in MATMUL_CHOICES:
        raise ValueError(f"the delta rule's matmul dtype must be one of {MATMUL_CHOICES}, got {choice!r}")
    if choice == "auto":
        return "float32" if (platform or jax.default_backend()) == "cpu" else "bfloat16"
    return choice


def _einsum(spec: str, *operands: jax.Array) -> jax.Array:
    return jnp.einsum(spec, *operands, precision=jax.lax.Precision.HIGHEST)


def _chunk_einsum(matmul_dtype: str, spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """A per-chunk product: exact fp32, or bf16 operands accumulated in fp32."""
    if matmul_dtype == "bfloat16":
        return jnp.einsum(spec, a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
    return _einsum(spec, a, b)


def _matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)


def unit_lower_triangular_inverse(a: jax.Array) -> jax.Array:
    """(I + a)⁻¹ for strictly lower-triangular a [..., C, C], C a power of two, by blocked substitution.

    The inverse of [[X, 0], [B, Y]] (unit lower-triangular X, Y) is [[X⁻¹, 0], [−Y⁻¹ B X⁻¹, Y⁻¹]]: starting
    from 1×1 diagonal blocks, each level merges neighbouring blocks with two batched matmuls, so the whole
    inverse takes log2(C) levels of matmuls (XLA's batched triangular solve measured ~300× slower on CPU).
    """
    size = a.shape[-1]
    blocks = jnp.ones((*a.shape[:-2], size, 1, 1), a.dtype)  # inverses of the diagonal blocks, [..., C/s, s, s]
    block = 1
    while block < size:
        pairs = size // (2 * block)
        upper_left, lower_right = blocks[..., 0::2, :, :], blocks[..., 1::2, :, :]
        # a's block below the diagonal inside each pair: rows of the second block, columns of the first.
        tiles = a.reshape(*a.shape[:-2], pairs, 2, block, pairs, 2, block)[..., :, 1, :, :, 0, :]
        below = jnp.moveaxis(jnp.diagonal(tiles, axis1=-4, axis2=-2), -1, -3)  # [..., pairs, s, s]
        off_diagonal = -_matmul(_matmul(lower_right, below), upper_left)
        top = jnp.concatenate([upper_left, jnp.zeros_like(upper_left)], axis=-1)
        bottom = jnp.concatenate([off_diagonal, lower_right], axis=-1)
        blocks = jnp.concatenate([top, bottom], axis=-2)
        block *= 2
    return blocks[..., 0, :, :]


def segment_starts(segment_ids: jax.Array) -> jax.Array:
    """[B, T] bool: True where a token's segment differs from the previous token's (never at t = 0)."""
    changed = segment_ids[:, 1:] != segment_ids[:, :-1]
    return jnp.pad(changed, ((0, 0), (1, 0)))


def _initial_state(shape: tuple[int, ...], initial_state: jax.Array | None) -> jax.Array:
    """The fp32 state [B, H, dk, dv] a call starts from: the carried one, else zeros."""
    return jnp.zeros(shape, jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)


def recurrent_gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                               resets: jax.Array | None = None, initial_state: jax.Array | None = None
                               ) -> tuple[jax.Array, jax.Array]:
    """Token-by-token reference. q, k: [B, T, H, dk]; v: [B, T, H, dv]; g, beta: [B, T, H]; resets: [B, T];
    initial_state: [B, H, dk, dv] (default 0).

    Returns (out [B, T, H, dv], final state [B, H, dk, dv]), fp32.
    """
    batch, length, heads, key_dim = q.shape
    if resets is None:
        resets = jnp.zeros((batch, length), bool)
    state = _initial_state((batch, heads, key_dim, v.shape[-1]), initial_state)

    def step(state, token):
        q_t, k_t, v_t, g_t, beta_t, reset_t = token
        decay = jnp.where(reset_t[:, None], 0.0, jnp.exp(g_t))  # [B, H]
        state = state * decay[..., None, None]
        predicted = _einsum("bhk,bhkv->bhv", k_t, state)
        update = beta_t[..., None] * (v_t - predicted)
        state = state + k_t[..., :, None] * update[..., None, :]
        return state, _einsum("bhk,bhkv->bhv", q_t, state)

    f32 = lambda x: jnp.moveaxis(x.astype(jnp.float32), 1, 0)  # time-major for the scan
    tokens = (f32(q), f32(k), f32(v), f32(g), f32(beta), jnp.moveaxis(resets, 1, 0))
    state, out = jax.lax.scan(step, state, tokens)
    return jnp.moveaxis(out, 0, 1), state


def chunked_gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                             resets: jax.Array | None = None, initial_state: jax.Array | None = None, *,
                             chunk_size: int = CHUNK_SIZE, matmul_dtype: str = "float32"
                             ) -> tuple[jax.Array, jax.Array]:
    """Same result as `recurrent_gated_delta_rule`, computed a chunk at a time (design §8.3).

    Within a chunk (positions i, j ∈ [0, C)), with S₀ the state carried in and γ_i = Σ_{s≤i} g_s:
    unrolling the recurrence gives S before token i's update as D_i S₀ + Σ_{j<i} e^{γ_i−γ_j} k_j u_jᵀ with
    D_i = e^{γ_i}, so the corrections u_i = β_i (v_i − S_preᵀ k_i) solve the unit lower-triangular system

        (I + A) U_true = β⊙V − (β⊙D⊙K) S₀,   A_ij = β_i (k_i·k_j) e^{γ_i−γ_j}  (j < i)

    i.e. U_true = U − W S₀ with U = (I+A)⁻¹(β⊙V), W = (I+A)⁻¹(β⊙D⊙K), both independent of S₀. Then
    O = (D⊙Q) S₀ + ((Q Kᵀ) ⊙ Λ) U_true with Λ_ij = e^{γ_i−γ_j} (j ≤ i), and the state handed to the next
    chunk is D_{C−1} S₀ + (e^{γ_{C−1}−γ} ⊙ K)ᵀ U_true. Only S₀ is sequential: a `lax.scan` over chunks.

    Segment resets: a reset at token p acts as g_p = −∞, i.e. a factor e^{g_p} = 0 in every decay product
    that spans p. e^{γ_i−γ_j} = Π_{j<s≤i} e^{g_s} spans a reset iff one lies in (j, i], and
    D_i = Π_{s≤i} e^{g_s} iff one lies in [0, i]. Counting resets at positions ≤ i within the chunk as the
    "epoch" e_i, the exact reset form is the plain one with Λ_ij → 0 where e_i ≠ e_j, D_i → 0 where e_i > 0,
    and e^{γ_{C−1}−γ_j} → 0 where e_j ≠ e_{C−1}. The surviving factors only span reset-free stretches, so they
    are computed from the ordinary finite γ and no −∞ is ever formed. (I + A) becomes block diagonal per
    segment, so W vanishes on rows after a reset and those rows never see S₀.

    Only non-positive exponents are ever exponentiated (γ_i − γ_j with j ≤ i, γ_i, γ_{C−1} − γ_j), masked
    before `exp`, so long decays underflow to 0 instead of overflowing. T is padded to a multiple of C with
    g = β = 0 (identity steps on S), so the final state is exact. A call with fewer than C tokens (decoding
    one token, or a short verification block) uses the smallest power of two >= T as C instead: at C = 1 this
    is the recurrent step itself.

    Only the state S₀ of each chunk is sequential: the scan carries it (two matmuls per chunk) and hands out
    S₀ and U_true of every chunk; the outputs O of all chunks are then two batched matmuls.
    matmul_dtype: "float32" (exact) or "bfloat16" (the per-chunk products A, QKᵀ, the solve and the outputs in
    bf16 operands with fp32 accumulation; the inverse and the state recurrence stay fp32).
    """
    if chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two, got {chunk_size}")
    if matmul_dtype not in MATMUL_DTYPES:
        raise ValueError(f"matmul_dtype must be one of {MATMUL_DTYPES}, got {matmul_dtype!r}")
    product = lambda spec, a, b: _chunk_einsum(matmul_dtype, spec, a, b)
    batch, length, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    chunk_size = min(chunk_size, 1 << max(length - 1, 0).bit_length())
    if resets is None:
        resets = jnp.zeros((batch, length), bool)
    pad = -length % chunk_size
    num_chunks = (length + pad) // chunk_size

    def chunked(x):  # [B, T, H, ...] -> fp32 [B, H, N, C, ...], zero-padded in time
        x = jnp.pad(x.astype(jnp.float32), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(batch, num_chunks, chunk_size, *x.shape[2:])
        return jnp.moveaxis(x, 3, 1)

    q, k, v = chunked(q), chunked(k), chunked(v)  # [B, H, N, C, d]
    g, beta = chunked(g[..., None])[..., 0], chunked(beta[..., None])[..., 0]  # [B, H, N, C]
    resets = jnp.pad(resets, ((0, 0), (0, pad))).reshape(batch, 1, num_chunks, chunk_size)
    epoch = jnp.cumsum(resets.astype(jnp.int32), axis=-1)  # [B, 1, N, C]

    gamma = jnp.cumsum(g, axis=-1)  # [B, H, N, C], in-chunk cumulative log decay
    index = jnp.arange(chunk_size)
    same_epoch = epoch[..., :, None] == epoch[..., None, :]
    within = (index[:, None] >= index[None, :]) & same_epoch  # j ≤ i, no reset in (j, i]
    log_decay = gamma[..., :, None] - gamma[..., None, :]
    decay = jnp.where(within, jnp.exp(jnp.where(within, log_decay, 0.0)), 0.0)  # Λ, [B, H, N, C, C]
    from_start = jnp.where(epoch == 0, jnp.exp(gamma), 0.0)  # D
    same_as_last = epoch == epoch[..., -1:]
    to_end = jnp.where(same_as_last, jnp.exp(jnp.where(same_as_last, gamma[..., -1:] - gamma, 0.0)), 0.0)

    k_beta = k * beta[..., None]
    strictly_lower = index[:, None] > index[None, :]
    a = jnp.where(strictly_lower, product("bhnid,bhnjd->bhnij", k_beta, k) * decay, 0.0)
    rhs = jnp.concatenate([v * beta[..., None], k_beta * from_start[..., None]], axis=-1)
    solved = product("bhnij,bhnjd->bhnid", unit_lower_triangular_inverse(a), rhs)
    pseudo_values, key_cumdecay = solved[..., :value_dim], solved[..., value_dim:]  # U, W
    k_to_end = k * to_end[..., None]
    state_decay = from_start[..., -1]  # D_{C-1}, [B, H, N]

    def step(state, chunk):  # the only sequential work: S₀ of the next chunk
        u, w, k_n, decay_n = chunk
        u = u - _einsum("bhik,bhkv->bhiv", w, state)  # U_true
        return decay_n[..., None, None] * state + _einsum("bhik,bhiv->bhkv", k_n, u), (state, u)

    chunk_major = lambda x: jnp.moveaxis(x, 2, 0)
    state = _initial_state((batch, heads, key_dim, value_dim), initial_state)
    state, (start_states, corrections) = jax.lax.scan(step, state, tuple(map(chunk_major, (
        pseudo_values, key_cumdecay, k_to_end, state_decay))))
    start_states, corrections = jnp.moveaxis(start_states, 0, 2), jnp.moveaxis(corrections, 0, 2)  # [B, H, N, ...]

    # O = (D⊙Q) S₀ + ((Q Kᵀ) ⊙ Λ) U_true, every chunk at once.
    attn = product("bhnid,bhnjd->bhnij", q, k) * decay
    out = (product("bhnik,bhnkv->bhniv", q * from_start[..., None], start_states)
           + product("bhnij,bhnjv->bhniv", attn, corrections))
    out = out.reshape(batch, heads, num_chunks * chunk_size, value_dim)
    return jnp.moveaxis(out, 1, 2)[:, :length], state
