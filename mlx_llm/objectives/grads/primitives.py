"""M20 §11's backward, one op at a time: each function is the derivative of one forward op of ``mlx_llm.ops``
(or of a layer's piece), written from its formula with no automatic differentiation.

``G_X`` denotes the gradient of the loss with respect to X (M20 §11), written ``g_`` in code.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mlx_llm.ops import rope, rope_rotate, softmax


def _acc(x: jax.Array) -> jax.Array:
    """Derivatives are formed in at least float32 (float64 in tests), like the forward's norms and softmax."""
    x = jnp.asarray(x)
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


# ----- one backward per op ------------------------------------------------------------------------------

def cross_entropy_backward(logits_BTV: jax.Array, targets_BT: jax.Array, mask_BT: jax.Array) -> jax.Array:
    """M20 §11 softmax + masked cross-entropy: ∂L/∂λ_v = (b/n)(p_v − 1[v = y]), n = Σ b over the batch."""
    p_BTV = softmax(_acc(logits_BTV), axis=-1)
    onehot_BTV = jax.nn.one_hot(targets_BT, logits_BTV.shape[-1], dtype=p_BTV.dtype)
    b_BT = jnp.asarray(mask_BT).astype(p_BTV.dtype)
    return (b_BT / jnp.sum(b_BT))[..., None] * (p_BTV - onehot_BTV)


def linear_backward(x_BTD: jax.Array, w_DF: jax.Array, g_BTF: jax.Array):
    """M20 §11 linear Y = XW: G_X = G_Y Wᵀ, G_W = Xᵀ G_Y (rows of X summed over batch and positions).

    Returns ``(G_X, G_W)``. X may have any leading axes; W is (D, F).
    """
    d, f = w_DF.shape
    g_x = g_BTF @ w_DF.T
    g_w = x_BTD.reshape(-1, d).T @ g_BTF.reshape(-1, f)
    return g_x, g_w


def residual_backward(g_z_BTD: jax.Array, g_branch_BTD: jax.Array) -> jax.Array:
    """M20 §11 residual Z = H + F(H): G_H = G_Z + J_F(H)ᵀ G_Z.

    ``g_branch_BTD`` is J_F(H)ᵀ G_Z, already sent back through the branch; the identity path adds G_Z itself.
    """
    return g_z_BTD + g_branch_BTD


def silu_backward(a: jax.Array, g_silu: jax.Array) -> jax.Array:
    """d SiLU(a)/da = σ(a) + aσ(a)(1 − σ(a)) (M20 §11), times the incoming gradient."""
    sig = jax.nn.sigmoid(a)
    return g_silu * (sig + a * sig * (1.0 - sig))


def swiglu_backward(y_BTD, w_gate_DF, w_up_DF, w_down_FD, g_BTD):
    """M20 §11 SwiGLU: a = YW_gate, u = YW_up, c = SiLU(a) ⊙ u, F = c W_down.

    G_a = G_c ⊙ u ⊙ [σ(a) + aσ(a)(1−σ(a))], G_u = G_c ⊙ SiLU(a); both projections add their
    contributions at Y. Returns ``(G_Y, G_W_gate, G_W_up, G_W_down)``.
    """
    a_BTF, u_BTF = y_BTD @ w_gate_DF, y_BTD @ w_up_DF
    c_BTF = jax.nn.silu(a_BTF) * u_BTF
    g_c, g_w_down = linear_backward(c_BTF, w_down_FD, g_BTD)
    g_a = silu_backward(a_BTF, g_c * u_BTF)
    g_u = g_c * jax.nn.silu(a_BTF)
    g_y_gate, g_w_gate = linear_backward(y_BTD, w_gate_DF, g_a)
    g_y_up, g_w_up = linear_backward(y_BTD, w_up_DF, g_u)
    return g_y_gate + g_y_up, g_w_gate, g_w_up, g_w_down


def rms_norm_backward(h_BTD: jax.Array, gamma_D: jax.Array, eps: float, g_BTD: jax.Array):
    """M20 §11 RMSNorm, row by row, with the forward's ρ = sqrt(mean(h²) + ε) (ε included):

    v = G_N ⊙ γ;  G_h = v/ρ − h (v·h)/(d ρ³);  G_γ = Σ_rows G_N ⊙ h/ρ. Returns ``(G_h, G_γ)``.
    """
    h, g = _acc(h_BTD), _acc(g_BTD)
    d = h.shape[-1]
    rho = jnp.sqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
    v = g * gamma_D.astype(h.dtype)
    g_h = v / rho - h * jnp.sum(v * h, axis=-1, keepdims=True) / (d * rho**3)
    g_gamma = jnp.sum((g * h / rho).reshape(-1, d), axis=0)
    return g_h, g_gamma


def softmax_backward(a: jax.Array, g_a: jax.Array, axis: int = -1) -> jax.Array:
    """M20 §11 row softmax without a Jacobian: G_s = a ⊙ (G_a − (G_a·a) 1).

    Entries with a = 0 (masked scores) get exactly zero derivative.
    """
    return a * (g_a - jnp.sum(g_a * a, axis=axis, keepdims=True))


def rope_backward(g_BTHK: jax.Array, positions_BT: jax.Array, base: float, scale: float = 1.0) -> jax.Array:
    """M20 §11: RoPE is a rotation, so its transpose is the inverse rotation, by −(scale·p)·ω_i.

    Negating the positions negates every angle exactly, so the forward ``rope`` performs it.
    """
    return rope(g_BTHK, -jnp.asarray(positions_BT), base, scale)


def rope_rotate_backward(g_BTHK, positions_BT, omega_K2, *, position_scale: float = 1.0,
                         attention_factor: float = 1.0) -> jax.Array:
    """The transpose of ``ops.rope_rotate`` (any RoPE scaling, U19 §7): (a, b) ↦ f·(a cos θ − b sin θ,
    a sin θ + b cos θ) has transpose f·R(−θ), the rotation by the negated angle with the same factor f, which the
    forward ``rope_rotate`` performs at the negated positions (M20 §11: "the inverse rotation")."""
    return rope_rotate(g_BTHK, -jnp.asarray(positions_BT), omega_K2, position_scale=position_scale,
                       attention_factor=attention_factor)


def attention_backward(q_BTHK, k_BSGK, v_BSGK, mask_BTS, g_BTHK):
    """M20 §11 attention, from the rotated Q̃, K̃ and V (A is recomputed from them):

    G_A = G_O Vᵀ, G_V = Aᵀ G_O; G_S = a ⊙ (G_a − (G_a·a)1) per row, zero where masked;
    G_Q̃ = G_S K̃/√d_h, G_K̃ = G_Sᵀ Q̃/√d_h. Under GQA the query heads r sharing K/V head g are summed
    into G_K̃ and G_V. Returns ``(G_Q̃, G_K̃, G_V)``.
    """
    b, t, h, k = q_BTHK.shape
    g = k_BSGK.shape[2]
    q_BTGRK = _acc(q_BTHK).reshape(b, t, g, h // g, k)
    k_BSGK, v_BSGK = _acc(k_BSGK), _acc(v_BSGK)
    g_o_BTGRK = _acc(g_BTHK).reshape(b, t, g, h // g, k)
    root = jnp.sqrt(jnp.asarray(k, q_BTGRK.dtype))
    scores_BGRTS = jnp.einsum("btgrk,bsgk->bgrts", q_BTGRK, k_BSGK) / root
    scores_BGRTS = jnp.where(mask_BTS[:, None, None], scores_BGRTS, jnp.finfo(scores_BGRTS.dtype).min)
    a_BGRTS = softmax(scores_BGRTS, axis=-1)
    g_a_BGRTS = jnp.einsum("btgrk,bsgk->bgrts", g_o_BTGRK, v_BSGK)
    g_v_BSGK = jnp.einsum("bgrts,btgrk->bsgk", a_BGRTS, g_o_BTGRK)
    g_s_BGRTS = jnp.where(mask_BTS[:, None, None], softmax_backward(a_BGRTS, g_a_BGRTS), 0.0)
    g_q_BTGRK = jnp.einsum("bgrts,bsgk->btgrk", g_s_BGRTS, k_BSGK) / root
    g_k_BSGK = jnp.einsum("bgrts,btgrk->bsgk", g_s_BGRTS, q_BTGRK) / root
    return g_q_BTGRK.reshape(b, t, h, k), g_k_BSGK, g_v_BSGK


def embedding_backward(tokens_BT: jax.Array, g_BTD: jax.Array, vocab_size: int) -> jax.Array:
    """M20 §11 lookup H⁽⁰⁾ = E[x]: scatter-add each row gradient into row x_t of G_E (repeats accumulate)."""
    d = g_BTD.shape[-1]
    return jnp.zeros((vocab_size, d), g_BTD.dtype).at[tokens_BT.reshape(-1)].add(g_BTD.reshape(-1, d))
