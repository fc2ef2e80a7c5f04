"""The equations of the dense block (M20 §4–§7) and of the next-token surprise (§9–§10), as pure functions of
arrays; and the one way a seed becomes a random key (``seed_key``).

Shape letters (DESIGN §3): B batch, T query positions, S key positions, D model width, H query heads,
G key/value heads, R query heads per key/value head, K head width, F FFN width.
Normalisation, softmax and log-sum-exp run in at least float32 whatever the compute dtype.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

from mlx_llm.errors import InputError


def _accum_dtype(dtype) -> jnp.dtype:
    """float32 for bf16/f16/f32 inputs, float64 for float64 inputs (tests)."""
    return jnp.promote_types(dtype, jnp.float32)


def rms_norm(h_BTD: jax.Array, gamma_D: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """M20 §4: N_γ(h) = γ ⊙ h / ρ(h), ρ(h) = sqrt(mean(h²) + ε), row by row. ``offset`` 1 applies the gain as
    (1 + γ) (Gemma's parametrisation, ``ModelConfig.norm_unit_offset``), computed in the accumulation dtype."""
    h = h_BTD.astype(_accum_dtype(h_BTD.dtype))
    rho = jnp.sqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
    gain = gamma_D.astype(h.dtype)
    if offset:
        gain = offset + gain
    return (gain * (h / rho)).astype(h_BTD.dtype)


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    """c·tanh(x/c) (Gemma 2's logit soft-capping: smooth, odd, slope 1 at 0, bounded by ±c); ``cap`` None: x."""
    if cap is None:
        return x
    return cap * jnp.tanh(x / cap)


def rope_frequencies(d_head: int, base: float, dtype=jnp.float32) -> jax.Array:
    """M20 §5 / U19 §7: ω_i = base^(-2i/d_h), i = 0 … d_h/2 − 1."""
    i = jnp.arange(d_head // 2, dtype=dtype)
    return jnp.asarray(base, dtype) ** (-2.0 * i / d_head)


def rope_rotate(x_BTHK: jax.Array, positions_BT: jax.Array, omega_K2: jax.Array, *, position_scale: float = 1.0,
                attention_factor: float = 1.0) -> jax.Array:
    """rotate_half RoPE with given inverse frequencies: pair (a, b) = (x_i, x_{i+K/2}) turns by angle
    (position_scale·p)·ω_i, and cos and sin are multiplied by ``attention_factor`` (transformers' attention
    scaling, so rotated q·k scores scale by its square; layers/rope_scaling.py gives both tables).

    Computed in at least float32 (float64 for float64 inputs); returned in ``x_BTHK``'s dtype.
    """
    k = x_BTHK.shape[-1]
    dtype = _accum_dtype(x_BTHK.dtype)
    omega = jnp.asarray(omega_K2).astype(dtype)
    angle_BTK = (positions_BT.astype(dtype) * position_scale)[..., None] * omega
    cos, sin = jnp.cos(angle_BTK)[:, :, None, :], jnp.sin(angle_BTK)[:, :, None, :]
    if not (isinstance(attention_factor, (int, float)) and attention_factor == 1.0):  # 1.0: leave cos/sin as they are
        cos, sin = cos * attention_factor, sin * attention_factor
    x = x_BTHK.astype(dtype)
    a, b = x[..., : k // 2], x[..., k // 2 :]
    return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1).astype(x_BTHK.dtype)


def rope(x_BTHK: jax.Array, positions_BT: jax.Array, base: float, scale: float = 1.0) -> jax.Array:
    """M20 §5 rotate_half RoPE: pair (a, b) = (x_i, x_{i+K/2}) turns by angle (scale·p)·ω_i.

    ``scale`` < 1 is position interpolation (U19 §7): position p acts as scale·p.
    """
    omega = rope_frequencies(x_BTHK.shape[-1], base, _accum_dtype(x_BTHK.dtype))
    return rope_rotate(x_BTHK, positions_BT, omega, position_scale=scale)


def causal_mask(segment_ids_BT: jax.Array | None, batch: int, length: int) -> jax.Array:
    """M20 §6 mask M as booleans (True = may read): key r ≤ query i, and, for packed windows,
    only keys of the same document (M20 §2: packing needs extra attention boundaries)."""
    idx = jnp.arange(length)
    allowed_TS = idx[None, :] <= idx[:, None]
    mask_BTS = jnp.broadcast_to(allowed_TS, (batch, length, length))
    if segment_ids_BT is not None:
        mask_BTS = mask_BTS & (segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :])
    return mask_BTS


def window_band(mask_BTS: jax.Array, window: int | None, offset_BT: jax.Array | None = None) -> jax.Array:
    """``mask_BTS`` restricted to a sliding window: query i reads key r only if i − r < ``window`` (itself and the
    ``window`` − 1 positions before it; Mistral's convention). ``offset_BT``: absolute query positions when the
    queries are not keys 0 … T−1 of the same row (cached decoding); keys are slots 0 … S−1. None: no window."""
    if window is None:
        return mask_BTS
    t, s = mask_BTS.shape[-2:]
    q_BT1 = (jnp.arange(t)[None, :] if offset_BT is None else offset_BT)[..., None]
    return mask_BTS & (q_BT1 - jnp.arange(s)[None, None, :] < window)


def document_mask(segment_ids_BT: jax.Array | None, batch: int, length: int) -> jax.Array:
    """The bidirectional mask of a denoiser (M20 §19): every position reads every position of its document."""
    if segment_ids_BT is None:
        return jnp.ones((batch, length, length), bool)
    return segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :]


def attention_scores(q_BTHK: jax.Array, k_BSGK: jax.Array, mask_BTS: jax.Array, cap: float | None = None) -> jax.Array:
    """M20 §6 scores S_j = Q̃_j K̃_g(j)ᵀ/√d_h + M of every query head, (B, G, R, T, S): query head j = g·R + r reads
    key/value head g (R = H/G). Computed in at least float32; a masked score is the most negative finite value (so
    a fully masked row, padding, gives finite weights instead of NaN). The R query heads of a group are stacked as
    M = R·T rows against that group's S keys, so the product is one batched matrix product over (B, G).
    ``cap`` c: the soft-capped scores c·tanh((Q̃ K̃ᵀ/√d_h)/c) + M (Gemma 2's attention soft-capping)."""
    return grouped_scores(q_BTHK, k_BSGK.transpose(0, 2, 1, 3), mask_BTS, cap)


def grouped_scores(q_BTHK: jax.Array, k_BGSK: jax.Array, mask_BTS: jax.Array, cap: float | None = None) -> jax.Array:
    """``attention_scores`` of keys already laid out head-major, (B, G, S, K) (a paged cache gathers them so)."""
    b, t, h, k = q_BTHK.shape
    g = k_BGSK.shape[1]
    r = h // g
    acc = _accum_dtype(q_BTHK.dtype)
    q_BGMK = q_BTHK.reshape(b, t, g, r, k).transpose(0, 2, 3, 1, 4).reshape(b, g, r * t, k)
    scores_BGMS = jnp.einsum("bgmk,bgsk->bgms", q_BGMK, k_BGSK, preferred_element_type=acc)
    scores_BGRTS = softcap(scores_BGMS.reshape(b, g, r, t, -1) / jnp.sqrt(jnp.asarray(k, acc)), cap)
    return jnp.where(mask_BTS[:, None, None], scores_BGRTS, jnp.finfo(acc).min)


def attention_weights(q_BTHK: jax.Array, k_BSGK: jax.Array, mask_BTS: jax.Array, cap: float | None = None) -> jax.Array:
    """M20 §6 A_j = softmax_row(S_j), (B, G, R, T, S): each allowed row sums to one, masked keys get weight 0."""
    return softmax(attention_scores(q_BTHK, k_BSGK, mask_BTS, cap), axis=-1)


def attention(q_BTHK: jax.Array, k_BSGK: jax.Array, v_BSGK: jax.Array, mask_BTS: jax.Array,
              cap: float | None = None) -> jax.Array:
    """M20 §6 causal GQA attention: S_j = Q̃_j K̃_g(j)ᵀ/√d_h + M, A_j = softmax_row(S_j), O_j = A_j V_g(j).

    Query head j reads key/value head g(j) = ⌊j / R⌋, R = H/G: heads are grouped, never averaged. The weights are
    ``attention_weights``; the R query heads of a group are stacked as M = R·T rows against that group's S values,
    so O is a plain batched matrix product over (B, G) with no copy of the large weight tensor (the small Q/V/O
    tensors are transposed instead). ``mask_BTS`` is boolean; a fully masked row (padding) gives finite, ignorable
    output instead of NaN. ``cap``: soft-capped scores (``attention_scores``).
    """
    return grouped_attention(q_BTHK, k_BSGK.transpose(0, 2, 1, 3), v_BSGK.transpose(0, 2, 1, 3), mask_BTS, cap)


def grouped_attention(q_BTHK: jax.Array, k_BGSK: jax.Array, v_BGSK: jax.Array, mask_BTS: jax.Array,
                      cap: float | None = None) -> jax.Array:
    """``attention`` of keys and values already laid out head-major, (B, G, S, K): the same operations, minus the
    two transposes (a paged cache gathers its pages straight into this layout)."""
    b, t, h, k = q_BTHK.shape
    g = k_BGSK.shape[1]
    r = h // g
    acc = _accum_dtype(q_BTHK.dtype)
    probs_BGMS = softmax(grouped_scores(q_BTHK, k_BGSK, mask_BTS, cap), axis=-1).astype(v_BGSK.dtype)
    probs_BGMS = probs_BGMS.reshape(b, g, r * t, -1)
    o_BGMK = jnp.einsum("bgms,bgsk->bgmk", probs_BGMS, v_BGSK, preferred_element_type=acc)
    return o_BGMK.reshape(b, g, r, t, k).transpose(0, 3, 1, 2, 4).reshape(b, t, h, k).astype(q_BTHK.dtype)


def causal_attention(q_BTHK: jax.Array, k_BTGK: jax.Array, v_BTGK: jax.Array, mask_BTS: jax.Array,
                     block: int = 64, cap: float | None = None) -> jax.Array:
    """``attention`` for a causal mask over the same T positions, skipping the blocks the mask removes.

    Query block i (rows i·c … (i+1)·c − 1) can only read keys 0 … (i+1)·c − 1, so it is computed against those
    keys alone: with n blocks the score work falls from n² to n(n+1)/2 blocks (exactly the same result — the
    skipped keys would have had weight exactly 0). At most 8 blocks, so the traced program stays small.
    """
    t = q_BTHK.shape[1]
    n = min(8, t // block) if block > 0 else 1
    while n > 1 and t % n:
        n -= 1
    if n <= 1:
        return attention(q_BTHK, k_BTGK, v_BTGK, mask_BTS, cap)
    c = t // n
    outs = [attention(q_BTHK[:, i * c:(i + 1) * c], k_BTGK[:, :(i + 1) * c], v_BTGK[:, :(i + 1) * c],
                      mask_BTS[:, i * c:(i + 1) * c, :(i + 1) * c], cap) for i in range(n)]
    return jnp.concatenate(outs, axis=1)


def softmax(x: jax.Array, axis: int = -1) -> jax.Array:
    """Max-shifted softmax (M20 §9): subtracting the row maximum leaves it unchanged and prevents overflow."""
    z = x - jax.lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True))
    e = jnp.exp(z)
    return e / jnp.sum(e, axis=axis, keepdims=True)


def log_softmax(logits_BTV: jax.Array) -> jax.Array:
    """log p = Λ − logsumexp(Λ), with the row maximum subtracted first (M20 §9); in at least float32."""
    x = logits_BTV.astype(_accum_dtype(logits_BTV.dtype))
    z = x - jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
    return z - jnp.log(jnp.sum(jnp.exp(z), axis=-1, keepdims=True))


def token_nll(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
    """Per-token surprise −log p(x_t | x_<t) = logsumexp(Λ_{t−1}) − Λ_{t−1, x_t} (M20 §10), in nats."""
    logp_BTV = log_softmax(logits_BTV)
    return -jnp.take_along_axis(logp_BTV, targets_BT[..., None].astype(jnp.int32), axis=-1)[..., 0]


def dense(x, w, preferred_element_type=None) -> jax.Array:
    """x (..., I) times w (I, ...) as one 2-D matrix product, X W (M20 §5–§8: projections multiply on the right).

    Leading dimensions are flattened first (a free reshape): XLA:CPU lays out the backward of a 2-D product
    without the transposed copies it inserts for the same product written with extra batch-like dimensions.
    """
    lead, out = x.shape[:-1], w.shape[1:]
    y = jnp.matmul(x.reshape(-1, x.shape[-1]), w.reshape(w.shape[0], -1),
                   preferred_element_type=preferred_element_type)
    return y.reshape(*lead, *out)


def swiglu(y_BTD: jax.Array, w_gate_DF: jax.Array, w_up_DF: jax.Array, w_down_FD: jax.Array) -> jax.Array:
    """M20 §7: F(Y) = [SiLU(Y W_gate) ⊙ (Y W_up)] W_down, SiLU(a) = a σ(a)."""
    a_BTF = dense(y_BTD, w_gate_DF)
    u_BTF = dense(y_BTD, w_up_DF)
    return dense(jax.nn.silu(a_BTF) * u_BTF, w_down_FD)


def gelu_tanh(a: jax.Array) -> jax.Array:
    """GELU's tanh form (Hendrycks & Gimpel 2016): a/2·(1 + tanh(√(2/π)(a + 0.044715 a³))), transformers'
    ``gelu_pytorch_tanh``."""
    return jax.nn.gelu(a, approximate=True)


def geglu(y_BTD: jax.Array, w_gate_DF: jax.Array, w_up_DF: jax.Array, w_down_FD: jax.Array) -> jax.Array:
    """GeGLU (Shazeer 2020, "GLU Variants Improve Transformer"; Gemma): F(Y) = [GELU_tanh(Y W_gate) ⊙ (Y W_up)]
    W_down."""
    return dense(gelu_tanh(dense(y_BTD, w_gate_DF)) * dense(y_BTD, w_up_DF), w_down_FD)


def relu2(y_BTD: jax.Array, w_up_DF: jax.Array, w_down_FD: jax.Array) -> jax.Array:
    """Squared ReLU (So et al. 2021, "Primer"; modded-nanogpt): F(Y) = max(0, Y W_up)² W_down."""
    return dense(jnp.square(jax.nn.relu(dense(y_BTD, w_up_DF))), w_down_FD)


SEED_MAX = 2**63 - 1  # seeds are int64 (JSON, numpy's generators); config.SEED_MAX is the same number


def seed_key_data(seed) -> jax.Array:
    """The threefry key of ``seed`` as its two uint32 words [seed >> 32, seed & 0xFFFFFFFF] (what
    ``jax.random.PRNGKey`` returns). jax's own seeding keeps only the low 32 bits when x64 is off (the command line),
    so seed 2**32 drew seed 0's numbers there and another draw in a float64 process; here every seed in
    [0, ``SEED_MAX``] has its own key, the same with x64 on or off, and a seed below 2**32 keeps the key jax gives
    it.
    ``seed``: a Python or NumPy integer, or an integer array (traced under ``jax.vmap``: its high word is 0
    unless it is 64-bit)."""
    if isinstance(seed, numbers.Integral) and not isinstance(seed, bool):
        seed = int(seed)
        if not 0 <= seed <= SEED_MAX:
            raise InputError(f"seed = {seed} is invalid: it must be an integer in [0, {SEED_MAX}]")
        return jnp.asarray(np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32))
    seed = jnp.asarray(seed)
    if not jnp.issubdtype(seed.dtype, jnp.integer):
        raise InputError(f"seed of dtype {seed.dtype} is invalid: it must be an integer")
    high = (seed >> 32) if seed.dtype.itemsize == 8 else jnp.zeros_like(seed)
    return jnp.stack([high.astype(jnp.uint32), seed.astype(jnp.uint32)], axis=-1)


def seed_key(seed) -> jax.Array:
    """``jax.random.key(seed)`` for every seed in [0, ``SEED_MAX``]: the typed threefry key of ``seed_key_data``."""
    return jax.random.wrap_key_data(seed_key_data(seed), impl="threefry2x32")
