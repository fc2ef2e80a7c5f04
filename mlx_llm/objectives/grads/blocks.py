"""The attention mixer and the FFN branches sent back by hand (M20 §11 applied to M20 §5–§7, §15): a forward that
keeps a tape of what the backward needs, then the backward from that tape.

Every variant of the attention layer is covered: Q/K/V biases (``qkv_bias``), per-head q/k RMSNorms before RoPE
(``qk_norm``), every RoPE scaling (the rotation's transpose is the rotation by the negated angle with the same
attention factor, ``rope_rotate_backward``), causal, bidirectional (``causal`` false) and sliding-window masks
(a masked score has weight exactly 0, so its derivative is exactly 0 whichever mask removed it).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from mlx_llm.config import ModelConfig
from mlx_llm.layers import moe
from mlx_llm.layers.attention import attention_output
from mlx_llm.layers.rope_scaling import position_scale, rope_for, rope_tables
from mlx_llm.objectives.grads.primitives import (_acc, attention_backward, linear_backward, residual_backward,
                                                 rms_norm_backward, rope_rotate_backward, swiglu_backward)
from mlx_llm.ops import attention, dense, rms_norm, swiglu


class AttentionTape(NamedTuple):
    """What the attention branch's backward needs from its forward (M20 §5–§6 names)."""

    h_BTD: jax.Array    # branch input H (input of N_γa)
    x_BTD: jax.Array    # N_γa(H)
    q0_BTHK: jax.Array  # X W^Q (+ b_Q): the input of the q norm (or of RoPE)
    k0_BTGK: jax.Array  # X W^K (+ b_K)
    q_BTHK: jax.Array   # Q̃ (after the q norm and RoPE)
    k_BTGK: jax.Array   # K̃
    v_BTGK: jax.Array   # V
    o_BTHK: jax.Array   # attention output per head, before W^O


class FFNTape(NamedTuple):
    """The SwiGLU branch's tape: Z (input of N_γf) and Y = N_γf(Z)."""

    z_BTD: jax.Array
    y_BTD: jax.Array


class BlockTape(NamedTuple):
    """One dense block (M20 §7): the attention branch's tape, then the FFN branch's."""

    attention: AttentionTape
    ffn: FFNTape


def _flat(w, n_in: int) -> jax.Array:
    """A projection (d, H, K) or (H, K, d) as the matrix of the linear map, first ``n_in`` axes as rows."""
    return w.reshape(int(math.prod(w.shape[:n_in])), -1)


# ----- attention -----------------------------------------------------------------------------------------------
def attention_branch_forward(h_BTD, layer, cfg: ModelConfig, positions_BT, mask_BTS):
    """M20 §7 first line, Z = H + A(N_γa(H)), keeping the tape: Q = X W^Q (+ b_Q), the same for K and V, the
    q/k norms with ``qk_norm``, RoPE as ``cfg.rope_scaling`` says, then M20 §6 under ``mask_BTS`` (already banded
    for a sliding-window layer). Returns ``(Z, tape)``."""
    x_BTD = rms_norm(h_BTD, layer["attn_norm"], cfg.norm_eps)
    q0_BTHK, k0_BTGK, v_BTGK = (dense(x_BTD, layer[name]) for name in ("wq", "wk", "wv"))
    if cfg.qkv_bias:
        q0_BTHK, k0_BTGK, v_BTGK = q0_BTHK + layer["bq"], k0_BTGK + layer["bk"], v_BTGK + layer["bv"]
    q1_BTHK, k1_BTGK = q0_BTHK, k0_BTGK
    if cfg.qk_norm:
        q1_BTHK = rms_norm(q0_BTHK, layer["q_norm"], cfg.norm_eps)
        k1_BTGK = rms_norm(k0_BTGK, layer["k_norm"], cfg.norm_eps)
    q_BTHK, k_BTGK = rope_for(positions_BT, cfg, q1_BTHK, k1_BTGK)
    o_BTHK = attention(q_BTHK, k_BTGK, v_BTGK, mask_BTS)
    z_BTD = h_BTD + attention_output(o_BTHK, layer)
    return z_BTD, AttentionTape(h_BTD, x_BTD, q0_BTHK, k0_BTGK, q_BTHK, k_BTGK, v_BTGK, o_BTHK)


def rope_for_backward(g_BTHK, positions_BT, cfg: ModelConfig) -> jax.Array:
    """The transpose of ``rope_for`` for one of Q̃, K̃: the same table (ω, attention factor; "dynamic" from the same
    max(positions) + 1), rotated back."""
    seq_len = jnp.max(positions_BT) + 1 if cfg.rope_scaling == "dynamic" else None
    omega, factor = rope_tables(cfg, seq_len, _acc(g_BTHK).dtype)
    return rope_rotate_backward(g_BTHK, positions_BT, omega, position_scale=position_scale(cfg),
                                attention_factor=factor)


def _qk_backward(tape: AttentionTape, layer, cfg: ModelConfig, positions_BT, g_q_BTHK, g_k_BTGK):
    """From G_Q̃, G_K̃ back through RoPE, the q/k norms and the biases: (G_Q0, G_K0, their parameters' grads)."""
    g_q, g_k = (rope_for_backward(g, positions_BT, cfg) for g in (g_q_BTHK, g_k_BTGK))
    grads = {}
    if cfg.qk_norm:
        g_q, grads["q_norm"] = rms_norm_backward(tape.q0_BTHK, layer["q_norm"], cfg.norm_eps, g_q)
        g_k, grads["k_norm"] = rms_norm_backward(tape.k0_BTGK, layer["k_norm"], cfg.norm_eps, g_k)
    return g_q, g_k, grads


def attention_branch_backward(tape: AttentionTape, layer, cfg: ModelConfig, positions_BT, mask_BTS, g_z_BTD):
    """Z = H + Concat(O) W^O sent back to G_H (M20 §11: W^O, attention, RoPE's inverse rotation, the q/k norms,
    the biases G_b = Σ_rows G, the three projections of the same N_γa(H), RMSNorm, residual).
    Returns ``(G_H, grads)`` with a gradient for every attention key of the layer."""
    b, t, h, k = tape.o_BTHK.shape
    g_o, g_wo = linear_backward(tape.o_BTHK.reshape(b, t, h * k), _flat(layer["wo"], 2), g_z_BTD)
    g_q_rot, g_k_rot, g_v = attention_backward(tape.q_BTHK, tape.k_BTGK, tape.v_BTGK, mask_BTS,
                                               g_o.reshape(b, t, h, k))
    g_q, g_k, grads = _qk_backward(tape, layer, cfg, positions_BT, g_q_rot, g_k_rot)
    grads["wo"] = g_wo.reshape(layer["wo"].shape)
    g_x = jnp.zeros_like(g_z_BTD)
    for name, bias, g_proj in (("wq", "bq", g_q), ("wk", "bk", g_k), ("wv", "bv", g_v)):
        if cfg.qkv_bias:
            grads[bias] = jnp.sum(g_proj, axis=(0, 1))  # the bias is added to every row
        g_x_part, g_w = linear_backward(tape.x_BTD, _flat(layer[name], 1), g_proj.reshape(b, t, -1))
        g_x = g_x + g_x_part  # the three projections read the same N_γa(H): their gradients add
        grads[name] = g_w.reshape(layer[name].shape)
    g_h_branch, grads["attn_norm"] = rms_norm_backward(tape.h_BTD, layer["attn_norm"], cfg.norm_eps, g_x)
    return residual_backward(g_z_BTD, g_h_branch), grads


# ----- the FFN branches ------------------------------------------------------------------------------------------
def swiglu_branch_forward(z_BTD, layer, cfg: ModelConfig):
    """M20 §7 second line, H' = Z + F(N_γf(Z)), keeping (Z, Y)."""
    y_BTD = rms_norm(z_BTD, layer["ffn_norm"], cfg.norm_eps)
    return z_BTD + swiglu(y_BTD, layer["w_gate"], layer["w_up"], layer["w_down"]), FFNTape(z_BTD, y_BTD)


def swiglu_branch_backward(tape: FFNTape, layer, cfg: ModelConfig, g_out_BTD):
    """H' = Z + F(N_γf(Z)) sent back to G_Z (residual + SwiGLU + RMSNorm, M20 §11)."""
    g_y, g_gate, g_up, g_down = swiglu_backward(tape.y_BTD, layer["w_gate"], layer["w_up"], layer["w_down"],
                                                g_out_BTD)
    g_z_branch, g_gamma_f = rms_norm_backward(tape.z_BTD, layer["ffn_norm"], cfg.norm_eps, g_y)
    grads = {"w_gate": g_gate, "w_up": g_up, "w_down": g_down, "ffn_norm": g_gamma_f}
    return residual_backward(g_out_BTD, g_z_branch), grads


def moe_branch_forward(z_BTD, layer, cfg: ModelConfig):
    """M20 §15's H = Z + F_MoE(N_γf(Z)) (the reference dispatch); the tape is Z (the backward recomputes the rest)."""
    return moe.branch(z_BTD, layer, cfg)[0], z_BTD


# ----- the dense block ------------------------------------------------------------------------------------------
def block_forward(h_BTD, layer, cfg: ModelConfig, positions_BT, mask_BTS):
    """M20 §7 block H' = Z + F(N_γf(Z)), Z = H + A(N_γa(H)), returning ``(H', tape)``."""
    z_BTD, attention_tape = attention_branch_forward(h_BTD, layer, cfg, positions_BT, mask_BTS)
    h_out_BTD, ffn_tape = swiglu_branch_forward(z_BTD, layer, cfg)
    return h_out_BTD, BlockTape(attention_tape, ffn_tape)


def block_backward(tape: BlockTape, layer, cfg: ModelConfig, positions_BT, mask_BTS, g_out_BTD):
    """Backward of one M20 §7 block: returns ``(G_H, grads of the layer's parameters)``."""
    g_z_BTD, grads_ffn = swiglu_branch_backward(tape.ffn, layer, cfg, g_out_BTD)
    g_h_BTD, grads_attn = attention_branch_backward(tape.attention, layer, cfg, positions_BT, mask_BTS, g_z_BTD)
    return g_h_BTD, {**grads_attn, **grads_ffn}
