"""The Mamba-1 mixer (``mlx_llm.layers.mamba``; M20 §19, Gu & Dao 2023) sent back by hand.

With Y = N_γ(H), X₀ = Y W_x, Z = Y W_z, U = conv(X₀) + b_conv, X = SiLU(U), Δ = softplus(X W_dt W_Δ + b_Δ),
B = X W_B, C = X W_C, A = −exp(A_log), Ā_p = exp(Δ_p A) (0 at a document start), the recurrence
s_p = Ā_p ⊙ s_{p−1} + (Δ_p x_p) ⊗ B_p, o_p = Σ_n C_{p,n} s_{p,·,n} + D ⊙ x_p and H' = H + (o ⊙ SiLU(Z)) W_out.
Its backward runs the recurrence in reverse time (``selective_scan_backward``): λ_p = ∂L/∂s_p collects the
readout at p and what s_p passes to s_{p+1} through Ā_{p+1}; every coefficient's gradient is read off λ_p and
the stored s_{p−1}. The rest is M20 §11 (linear maps, SiLU, RMSNorm, residual), plus the causal depthwise conv's
transpose and softplus' = σ.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from mlx_llm.config import ModelConfig
from mlx_llm.layers.mamba import causal_conv, discretise, document_starts, sequential_scan
from mlx_llm.objectives.grads.primitives import (_acc, linear_backward, residual_backward, rms_norm_backward,
                                                 silu_backward)
from mlx_llm.ops import dense, rms_norm


class MambaTape(NamedTuple):
    """What the Mamba branch's backward needs from its forward (names of the module docstring)."""

    h_BTD: jax.Array    # H, the input of N_γ
    y_BTD: jax.Array    # Y = N_γ(H)
    x0_BTI: jax.Array   # X₀ = Y W_x, the conv's input
    z_BTI: jax.Array    # Z = Y W_z, the gate
    u_BTI: jax.Array    # U = conv(X₀) + b_conv
    x_BTI: jax.Array    # X = SiLU(U)
    r_BTR: jax.Array    # X W_dt (the low-rank Δ input)
    dtr_BTI: jax.Array  # X W_dt W_Δ + b_Δ (before softplus)
    dt_BTI: jax.Array   # Δ
    b_BTN: jax.Array    # B
    c_BTN: jax.Array    # C
    a_IN: jax.Array     # A = −exp(A_log)
    da_BTIN: jax.Array  # Ā (0 at a document start)
    s_BTIN: jax.Array   # every state s_p
    o_BTI: jax.Array    # o before the gate


def mamba_branch_forward(h_BTD, layer, cfg: ModelConfig, segment_ids_BT=None):
    """H' = H + M(N_γ(H)) (``layers.mamba.branch``), keeping the tape; ``segment_ids_BT`` resets the conv window
    and the state at each document start. Returns ``(H', tape)``."""
    y_BTD = rms_norm(h_BTD, layer["ssm_norm"], cfg.norm_eps)
    x0_BTI, z_BTI = dense(y_BTD, layer["in_x"]), dense(y_BTD, layer["in_z"])
    u_BTI = _acc(causal_conv(x0_BTI, layer["conv_w"], layer["conv_b"], segment_ids_BT))
    x_BTI = jax.nn.silu(u_BTI)
    r_BTR = dense(x_BTI, layer["w_dt"])
    dtr_BTI = dense(r_BTR, layer["dt_proj"]) + layer["dt_bias"]
    dt_BTI = jax.nn.softplus(dtr_BTI)
    b_BTN, c_BTN = dense(x_BTI, layer["w_B"]), dense(x_BTI, layer["w_C"])
    a_IN = -jnp.exp(_acc(layer["A_log"]))
    da_BTIN, dbx_BTIN = discretise(dt_BTI, x_BTI, b_BTN, a_IN)
    if segment_ids_BT is not None:
        da_BTIN = jnp.where(document_starts(segment_ids_BT)[:, :, None, None], 0.0, da_BTIN)
    s_BTIN = sequential_scan(da_BTIN, dbx_BTIN)
    o_BTI = jnp.einsum("btin,btn->bti", s_BTIN, c_BTN) + layer["D"] * x_BTI
    out_BTD = dense(o_BTI * jax.nn.silu(z_BTI), layer["out_proj"])
    tape = MambaTape(h_BTD, y_BTD, x0_BTI, z_BTI, u_BTI, x_BTI, r_BTR, dtr_BTI, dt_BTI, b_BTN, c_BTN, a_IN,
                     da_BTIN, s_BTIN, o_BTI)
    return h_BTD + out_BTD.astype(h_BTD.dtype), tape


def selective_scan_backward(tape: MambaTape, g_y_BTI):
    """y_p = Σ_n C_p s_p with s_p = Ā_p ⊙ s_{p−1} + (Δ_p x_p) ⊗ B_p, sent back in reverse time (M20 §19's
    recurrence transposed): λ_p = G_y_p ⊗ C_p + Ā_{p+1} ⊙ λ_{p+1}, λ after the last position 0. Then
    G_C_p = Σ_i G_y_p s_p, G_(Δx)_p = Σ_n λ_p B_p, G_B_p = Σ_i λ_p Δ_p x_p, and through Ā_p = exp(Δ_p A):
    G_Δ_p = Σ_n λ_p s_{p−1} Ā_p A + x_p G_(Δx)_p, G_A = Σ_{b,p} λ_p s_{p−1} Ā_p Δ_p, G_x_p = Δ_p G_(Δx)_p.
    A document start (Ā_p = 0) stops λ there, and gives Δ_p no gradient through Ā_p.
    Returns (G_Δ, G_x, G_B, G_C, G_A)."""
    t = tape
    term_BTIN = g_y_BTI[..., None] * t.c_BTN[:, :, None, :]
    da_next_BTIN = jnp.concatenate([t.da_BTIN[:, 1:], jnp.zeros_like(t.da_BTIN[:, :1])], axis=1)

    def back(lam_next_BIN, xs):
        term_BIN, da_next_BIN = xs
        lam_BIN = term_BIN + da_next_BIN * lam_next_BIN
        return lam_BIN, lam_BIN

    _, lam_TBIN = jax.lax.scan(back, jnp.zeros_like(term_BTIN[:, 0]),
                               (jnp.moveaxis(term_BTIN, 1, 0), jnp.moveaxis(da_next_BTIN, 1, 0)), reverse=True)
    lam_BTIN = jnp.moveaxis(lam_TBIN, 0, 1)
    s_prev_BTIN = jnp.concatenate([jnp.zeros_like(t.s_BTIN[:, :1]), t.s_BTIN[:, :-1]], axis=1)
    q_BTIN = lam_BTIN * s_prev_BTIN * t.da_BTIN  # G_Ā ⊙ Ā
    g_dtx_BTI = jnp.einsum("btin,btn->bti", lam_BTIN, t.b_BTN)
    g_dt_BTI = jnp.einsum("btin,in->bti", q_BTIN, t.a_IN) + g_dtx_BTI * t.x_BTI
    g_b_BTN = jnp.einsum("btin,bti->btn", lam_BTIN, t.dt_BTI * t.x_BTI)
    g_c_BTN = jnp.einsum("bti,btin->btn", g_y_BTI, t.s_BTIN)
    g_a_IN = jnp.einsum("btin,bti->in", q_BTIN, t.dt_BTI)
    return g_dt_BTI, g_dtx_BTI * t.dt_BTI, g_b_BTN, g_c_BTN, g_a_IN


def causal_conv_backward(x_BTI, conv_w_WI, g_BTI, segment_ids_BT=None):
    """The transpose of ``layers.mamba.causal_conv``, u_t = b + Σ_k w_k ⊙ x_{t−j} (j = W−1−k, within t's document):
    G_b = Σ_{b,t} G_u, G_w_k = Σ_{b,t} G_u_t ⊙ x_{t−j}, G_x_{t'} = Σ_k w_k ⊙ G_u_{t'+j} (same document only).
    Returns (G_x, G_w, G_b)."""
    t, w = x_BTI.shape[1], conv_w_WI.shape[0]
    g, x = _acc(g_BTI), _acc(x_BTI)
    g_x_BTI, g_w = jnp.zeros_like(g), []
    for k in range(w):
        j = w - 1 - k
        g_k_BTI = g
        if segment_ids_BT is not None and j:
            same_BT = jnp.pad(segment_ids_BT[:, :-j] == segment_ids_BT[:, j:], ((0, 0), (j, 0)))
            g_k_BTI = jnp.where(same_BT[:, :, None], g, 0.0)
        x_shift_BTI = jnp.pad(x, ((0, 0), (j, 0), (0, 0)))[:, :t]
        g_w.append(jnp.sum(g_k_BTI * x_shift_BTI, axis=(0, 1)))
        g_x_BTI = g_x_BTI + conv_w_WI[k] * jnp.pad(g_k_BTI, ((0, 0), (0, j), (0, 0)))[:, j:]
    return g_x_BTI, jnp.stack(g_w), jnp.sum(g, axis=(0, 1))


def mamba_branch_backward(tape: MambaTape, layer, cfg: ModelConfig, segment_ids_BT, g_out_BTD):
    """H' = H + (o ⊙ SiLU(Z)) W_out sent back to G_H (module docstring). Returns ``(G_H, grads)`` with a gradient
    for every Mamba key of the layer; G_A_log = G_A ⊙ A (A = −exp(A_log)), G_Δ-pre = G_Δ ⊙ σ (softplus' = σ)."""
    t = tape
    gate_BTI = jax.nn.silu(t.z_BTI)
    g_m_BTI, g_out_proj = linear_backward(t.o_BTI * gate_BTI, layer["out_proj"], _acc(g_out_BTD))
    g_o_BTI = g_m_BTI * gate_BTI
    g_z_BTI = silu_backward(t.z_BTI, g_m_BTI * t.o_BTI)
    g_dt_BTI, g_x_BTI, g_b_BTN, g_c_BTN, g_a_IN = selective_scan_backward(tape, g_o_BTI)
    g_x_BTI = g_x_BTI + g_o_BTI * layer["D"]
    grads = {"out_proj": g_out_proj, "D": jnp.sum(g_o_BTI * t.x_BTI, axis=(0, 1)), "A_log": g_a_IN * t.a_IN}
    g_dtr_BTI = g_dt_BTI * jax.nn.sigmoid(t.dtr_BTI)
    grads["dt_bias"] = jnp.sum(g_dtr_BTI, axis=(0, 1))
    g_r_BTR, grads["dt_proj"] = linear_backward(t.r_BTR, layer["dt_proj"], g_dtr_BTI)
    for name, g in (("w_dt", g_r_BTR), ("w_B", g_b_BTN), ("w_C", g_c_BTN)):
        g_x_part, grads[name] = linear_backward(t.x_BTI, layer[name], g)
        g_x_BTI = g_x_BTI + g_x_part  # X feeds Δ, B, C and the skip D ⊙ X: their gradients add
    g_u_BTI = silu_backward(t.u_BTI, g_x_BTI)
    g_x0_BTI, grads["conv_w"], grads["conv_b"] = causal_conv_backward(t.x0_BTI, layer["conv_w"], g_u_BTI,
                                                                      segment_ids_BT)
    g_y_x, grads["in_x"] = linear_backward(t.y_BTD, layer["in_x"], g_x0_BTI)
    g_y_z, grads["in_z"] = linear_backward(t.y_BTD, layer["in_z"], g_z_BTI)
    g_h_branch, grads["ssm_norm"] = rms_norm_backward(t.h_BTD, layer["ssm_norm"], cfg.norm_eps, g_y_x + g_y_z)
    return residual_backward(_acc(g_out_BTD), g_h_branch), grads
