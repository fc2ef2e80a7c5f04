"""The hand-derived backward pass of M20 §11, op by op, composed for the whole dense model.

This is the *reference* backward used to "compare autodiff to analytic formulas" (DESIGN §5: gradient tests
compare ``jax.grad``, these formulas and central differences). It is not used for training: training uses
``jax.grad``. No automatic differentiation (grad, vjp, jvp) appears here; every derivative below is one of
M20 §11's formulas, written as a small public function that the tests check against ``jax.vjp`` of the
matching forward op in ``mlx_llm.ops``.

``G_X`` denotes the gradient of the loss with respect to X (M20 §11), written ``g_`` in code. The forward
pass (``forward_with_tape``) records what each backward needs: the input of every RMSNorm, the normalised
block inputs, the rotated Q/K, V, the attention output before W^O, and the final normalised rows R.

The mixture-of-experts FFN of M20 §15 has its backward here too (``moe_branch_backward``), for a fixed
selected expert set: the same M20 §11 formulas, plus the router weights' derivative.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from mlx_llm.config import ModelConfig
from mlx_llm.errors import ConfigError
from mlx_llm.objectives.loss import check_loss_mask, masked_cross_entropy
from mlx_llm.layers.attention import attention_output, attention_qkv
from mlx_llm.layers.moe import route
from mlx_llm.model import check_tokens, embed, unembed_matrix
from mlx_llm.ops import attention, causal_mask, rms_norm, rope, softmax, swiglu


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


# ----- the block: forward with a tape, then backward ---------------------------------------------------

class BlockTape(NamedTuple):
    """What one block's backward needs from its forward (M20 §7 names)."""

    h_BTD: jax.Array    # block input H (input of N_γa)
    x_BTD: jax.Array    # N_γa(H)
    q_BTHK: jax.Array   # Q̃ (after RoPE)
    k_BTGK: jax.Array   # K̃ (after RoPE)
    v_BTGK: jax.Array   # V
    o_BTHK: jax.Array   # attention output per head, before W^O
    z_BTD: jax.Array    # Z = H + A(N_γa(H)) (input of N_γf)
    y_BTD: jax.Array    # N_γf(Z)


def block_forward(h_BTD, layer, cfg: ModelConfig, positions_BT, mask_BTS):
    """M20 §7 block H' = Z + F(N_γf(Z)), Z = H + A(N_γa(H)), returning ``(H', tape)``."""
    x_BTD = rms_norm(h_BTD, layer["attn_norm"], cfg.norm_eps)
    q_BTHK, k_BTGK, v_BTGK = attention_qkv(x_BTD, layer, cfg, positions_BT)
    o_BTHK = attention(q_BTHK, k_BTGK, v_BTGK, mask_BTS)
    z_BTD = h_BTD + attention_output(o_BTHK, layer)
    y_BTD = rms_norm(z_BTD, layer["ffn_norm"], cfg.norm_eps)
    h_out_BTD = z_BTD + swiglu(y_BTD, layer["w_gate"], layer["w_up"], layer["w_down"])
    return h_out_BTD, BlockTape(h_BTD, x_BTD, q_BTHK, k_BTGK, v_BTGK, o_BTHK, z_BTD, y_BTD)


def _flat(w, n_in: int) -> jax.Array:
    """A projection (d, H, K) or (H, K, d) as the matrix of the linear map, first ``n_in`` axes as rows."""
    return w.reshape(int(math.prod(w.shape[:n_in])), -1)


def _ffn_backward(tape: BlockTape, layer, cfg: ModelConfig, g_out_BTD):
    """H' = Z + F(N_γf(Z)) sent back to G_Z (residual + SwiGLU + RMSNorm)."""
    g_y, g_gate, g_up, g_down = swiglu_backward(tape.y_BTD, layer["w_gate"], layer["w_up"], layer["w_down"],
                                                g_out_BTD)
    g_z_branch, g_gamma_f = rms_norm_backward(tape.z_BTD, layer["ffn_norm"], cfg.norm_eps, g_y)
    grads = {"w_gate": g_gate, "w_up": g_up, "w_down": g_down, "ffn_norm": g_gamma_f}
    return residual_backward(g_out_BTD, g_z_branch), grads


def _attention_backward_block(tape: BlockTape, layer, cfg: ModelConfig, positions_BT, mask_BTS, g_z_BTD):
    """Z = H + Concat(O) W^O, O from RoPE'd projections of N_γa(H), sent back to G_H."""
    b, t, h, k = tape.o_BTHK.shape
    g_o, g_wo = linear_backward(tape.o_BTHK.reshape(b, t, h * k), _flat(layer["wo"], 2), g_z_BTD)
    g_q_rot, g_k_rot, g_v = attention_backward(tape.q_BTHK, tape.k_BTGK, tape.v_BTGK, mask_BTS,
                                               g_o.reshape(b, t, h, k))
    g_q = rope_backward(g_q_rot, positions_BT, cfg.rope_base, cfg.rope_scale)
    g_k = rope_backward(g_k_rot, positions_BT, cfg.rope_base, cfg.rope_scale)
    g_x = jnp.zeros_like(g_z_BTD)
    grads = {"wo": g_wo.reshape(layer["wo"].shape)}
    for name, g_proj in (("wq", g_q), ("wk", g_k), ("wv", g_v)):
        g_x_part, g_w = linear_backward(tape.x_BTD, _flat(layer[name], 1), g_proj.reshape(b, t, -1))
        g_x = g_x + g_x_part  # the three projections read the same N_γa(H): their gradients add
        grads[name] = g_w.reshape(layer[name].shape)
    g_h_branch, grads["attn_norm"] = rms_norm_backward(tape.h_BTD, layer["attn_norm"], cfg.norm_eps, g_x)
    return residual_backward(g_z_BTD, g_h_branch), grads


def block_backward(tape: BlockTape, layer, cfg: ModelConfig, positions_BT, mask_BTS, g_out_BTD):
    """Backward of one M20 §7 block: returns ``(G_H, grads of the layer's parameters)``."""
    g_z_BTD, grads_ffn = _ffn_backward(tape, layer, cfg, g_out_BTD)
    g_h_BTD, grads_attn = _attention_backward_block(tape, layer, cfg, positions_BT, mask_BTS, g_z_BTD)
    return g_h_BTD, {**grads_attn, **grads_ffn}


# ----- the whole model --------------------------------------------------------------------------------

def _layer(blocks, index: int):
    return jax.tree.map(lambda a: a[index], blocks)


def analytic_value_and_grad(params, tokens_BT, targets_BT, mask_BT, cfg: ModelConfig, *,
                            positions_BT=None, segment_ids_BT=None):
    """The masked cross-entropy of ``forward`` (M20 §10) and its gradient by M20 §11's formulas.

    Forward: H⁽⁰⁾ = E[x], L blocks (tapes kept), R = N_γo(H⁽ᴸ⁾), Λ = RU. Backward in reverse order:
    G_Λ, then U and γ_o, the blocks from last to first, and the embedding scatter-add; with tied
    embeddings (U = Eᵀ) the output role's G_Uᵀ is added to the same table. Returns ``(loss, grads)``
    with ``grads`` shaped like ``params``.
    """
    check_tokens(tokens_BT, cfg)
    check_loss_mask(mask_BT)
    params = jax.tree.map(jnp.asarray, params)
    tokens_BT = jnp.asarray(tokens_BT)
    b, t = tokens_BT.shape
    if positions_BT is None:
        positions_BT = jnp.broadcast_to(jnp.arange(t), (b, t))
    mask_BTS = causal_mask(segment_ids_BT, b, t)

    h_BTD, tapes = embed(params, tokens_BT), []
    for index in range(cfg.n_layers):
        h_BTD, tape = block_forward(h_BTD, _layer(params["blocks"], index), cfg, positions_BT, mask_BTS)
        tapes.append(tape)
    r_BTD = rms_norm(h_BTD, params["final_norm"], cfg.norm_eps)
    u_DV = unembed_matrix(params, cfg)
    logits_BTV = r_BTD @ u_DV

    loss = masked_cross_entropy(logits_BTV, jnp.asarray(targets_BT), mask_BT)
    g_logits = cross_entropy_backward(logits_BTV, targets_BT, mask_BT)
    g_r, g_u = linear_backward(r_BTD, u_DV, g_logits)
    g_h, g_final_norm = rms_norm_backward(h_BTD, params["final_norm"], cfg.norm_eps, g_r)
    block_grads = [None] * cfg.n_layers
    for index in reversed(range(cfg.n_layers)):
        g_h, block_grads[index] = block_backward(tapes[index], _layer(params["blocks"], index), cfg,
                                                 positions_BT, mask_BTS, g_h)
    grads = {
        "embed": embedding_backward(tokens_BT, g_h, cfg.vocab_size),
        "blocks": jax.tree.map(lambda *per_layer: jnp.stack(per_layer), *block_grads),
        "final_norm": g_final_norm,
    }
    if cfg.tie_embeddings:
        grads["embed"] = grads["embed"] + g_u.T  # one table, two roles: lookup and output projection
    else:
        grads["unembed"] = g_u
    return loss, jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)


def analytic_grad(params, tokens_BT, targets_BT, mask_BT, cfg: ModelConfig, *,
                  positions_BT=None, segment_ids_BT=None):
    """∇_θ of ``masked_cross_entropy(forward(params, tokens), targets, mask)`` by M20 §11, without autodiff."""
    return analytic_value_and_grad(params, tokens_BT, targets_BT, mask_BT, cfg, positions_BT=positions_BT,
                                   segment_ids_BT=segment_ids_BT)[1]


# ----- the mixture-of-experts FFN (M20 §15), for a fixed selected set ---------------------------------
# TopK is piecewise constant: away from ties the selected set S(y) does not move under a small change of θ,
# so the derivative below holds S fixed, and the offsets b (which only choose S) get exactly zero.

def _scatter_selected(values_NK: jax.Array, ids_NK: jax.Array, n_experts: int) -> jax.Array:
    """(N, k) values placed at their experts' columns of an (N, X) array of zeros (a row's k ids differ)."""
    rows_N1 = jnp.arange(ids_NK.shape[0])[:, None]
    return jnp.zeros((ids_NK.shape[0], n_experts), values_NK.dtype).at[rows_N1, ids_NK].set(values_NK)


def router_weights_backward(router_logits_NX, ids_NK, g_w_NK, *, router: str = "sigmoid", eps: float = 1e-9):
    """M20 §15 mixture weights sent back to the router logits r (N, X), the selected set S held fixed.

    sigmoid: a = σ(r), s = Σ_{j∈S} a_j, w_e = a_e/(ε+s), ∂w_e/∂a_j = δ_ej/(ε+s) − a_e/(ε+s)², so
    G_a_j = (G_w_j − Σ_e G_w_e w_e)/(ε+s), then G_r = G_a ⊙ a(1−a) (σ', M20 §11).
    softmax (U19 §3): w = softmax(r_S), so G_r_S = w ⊙ (G_w − (G_w·w)1) (M20 §11's softmax backward).
    Logits outside S get exactly zero. Returns G_r (N, X).
    """
    if router not in ("sigmoid", "softmax"):
        raise ConfigError(f"router_weights_backward: router = {router!r} is invalid: valid routers are "
                          "['sigmoid', 'softmax']")
    r_NK = jnp.take_along_axis(_acc(router_logits_NX), ids_NK, axis=-1)
    g_w_NK = _acc(g_w_NK).astype(r_NK.dtype)
    if router == "sigmoid":
        a_NK = jax.nn.sigmoid(r_NK)
        den_N1 = eps + jnp.sum(a_NK, axis=-1, keepdims=True)
        g_a_NK = (g_w_NK - jnp.sum(g_w_NK * a_NK / den_N1, axis=-1, keepdims=True)) / den_N1
        g_r_NK = g_a_NK * a_NK * (1.0 - a_NK)
    else:
        g_r_NK = softmax_backward(softmax(r_NK, axis=-1), g_w_NK)
    return _scatter_selected(g_r_NK, ids_NK, router_logits_NX.shape[-1])


def _routed_experts_backward(y_ND, layer, ids_NK, weights_NK, g_out_ND):
    """Σ_{e∈S} w_e F_e(y) sent back, every expert on every row (a reference, not a dispatch).

    Expert e is a SwiGLU fed c_e ⊙ G_out, c_e = w_e on the rows that chose e and exactly 0 elsewhere (so an
    expert no row chose gets exactly zero); G_w_nk = F_{e_nk}(y_n)·G_out_n. Returns (G_y, G_w (N, k), grads).
    """
    experts = (layer["expert_gate"], layer["expert_up"], layer["expert_down"])
    c_XN = _scatter_selected(weights_NK.astype(y_ND.dtype), ids_NK, experts[0].shape[0]).T
    g_y_XND, g_gate, g_up, g_down = jax.vmap(
        lambda wg, wu, wd, c_N: swiglu_backward(y_ND, wg, wu, wd, c_N[:, None] * g_out_ND))(*experts, c_XN)
    f_XND = jax.vmap(lambda wg, wu, wd: swiglu(y_ND, wg, wu, wd))(*experts)
    picked_NKD = f_XND[ids_NK, jnp.arange(y_ND.shape[0])[:, None]]
    g_w_NK = jnp.sum(picked_NKD * g_out_ND[:, None, :], axis=-1)
    grads = {"expert_gate": g_gate, "expert_up": g_up, "expert_down": g_down}
    return jnp.sum(g_y_XND, axis=0), g_w_NK, grads


def _shared_experts_backward(y_ND, layer, g_out_ND):
    """Σ_shared F_s(y) (always run, unweighted, M20 §15): each a SwiGLU fed G_out. Returns (G_y, grads)."""
    if "shared_gate" not in layer:
        return jnp.zeros_like(y_ND), {}
    shared = (layer["shared_gate"], layer["shared_up"], layer["shared_down"])
    g_y_SND, g_gate, g_up, g_down = jax.vmap(
        lambda wg, wu, wd: swiglu_backward(y_ND, wg, wu, wd, g_out_ND))(*shared)
    return jnp.sum(g_y_SND, axis=0), {"shared_gate": g_gate, "shared_up": g_up, "shared_down": g_down}


def moe_ffn_backward(y_ND, layer, ids_NK, weights_NK, router_logits_NX, g_out_ND, *, router: str = "sigmoid",
                     eps: float = 1e-9):
    """M20 §15 F_MoE(y) = Σ_{e∈S} w_e F_e(y) + Σ_shared F_s(y), r = y W_router, S held fixed, sent back.

    Gradients reach y through the selected experts, the shared ones, and the mixture weights: G_w → G_r
    (``router_weights_backward``) → the router's linear map, G_W_router = yᵀ G_r, G_y += G_r W_routerᵀ
    (M20 §11). Returns ``(G_y, grads)`` with grads for ``router``, ``expert_*`` and ``shared_*`` (if S > 0).
    """
    y_ND, g_out_ND = _acc(y_ND), _acc(g_out_ND)
    g_y_routed, g_w_NK, grads = _routed_experts_backward(y_ND, layer, ids_NK, weights_NK, g_out_ND)
    g_y_shared, grads_shared = _shared_experts_backward(y_ND, layer, g_out_ND)
    g_r_NX = router_weights_backward(router_logits_NX, ids_NK, g_w_NK, router=router, eps=eps)
    g_y_router, grads["router"] = linear_backward(y_ND, layer["router"], g_r_NX.astype(y_ND.dtype))
    return g_y_routed + g_y_shared + g_y_router, {**grads, **grads_shared}


def moe_branch_backward(z_BTD, layer, cfg: ModelConfig, g_BTD):
    """Backward of M20 §15's H = Z + F_MoE(N_γf(Z)) (``mlx_llm.layers.moe.branch``), S held fixed.

    The forward is recomputed (norm, logits, route; the logits in at least float32, float64 in tests), then
    MoE FFN, RMSNorm and residual backward. ``router_offset`` is routing state that only chooses S: its
    gradient is exactly zero. Returns ``(G_Z, grads)``, a gradient for every key the branch reads (M20 §15's
    keys of ``mlx_llm.layers.moe``; a block's attention keys, if ``layer`` has them, are not the branch's).
    """
    b, t, d = z_BTD.shape
    y_ND = rms_norm(z_BTD, layer["ffn_norm"], cfg.norm_eps).reshape(b * t, d)
    logits_NX = _acc(y_ND) @ _acc(layer["router"])
    ids_NK, w_NK = route(logits_NX, layer["router_offset"], cfg.moe_top_k, router=cfg.router, eps=cfg.router_eps)
    g_y_ND, grads = moe_ffn_backward(y_ND, layer, ids_NK, w_NK, logits_NX, g_BTD.reshape(b * t, d),
                                     router=cfg.router, eps=cfg.router_eps)
    g_z_branch, grads["ffn_norm"] = rms_norm_backward(z_BTD, layer["ffn_norm"], cfg.norm_eps,
                                                      g_y_ND.reshape(b, t, d))
    grads["router_offset"] = jnp.zeros_like(layer["router_offset"])
    grads = {name: g.astype(layer[name].dtype) for name, g in grads.items()}
    return residual_backward(g_BTD, g_z_branch), grads
