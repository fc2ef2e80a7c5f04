"""An independent NumPy float64 reference of the whole model (M20 §3–§9, §15, §19), written from the equations.

Nothing here calls ``mlx_llm``: it takes a ``ModelConfig`` (read for its fields only) and a parameter pytree
(converted to float64 NumPy arrays) and computes logits with plain loops and einsums, one token / head /
expert at a time where that keeps the equation visible. Slow, but obviously correct; tests only.
"""

from __future__ import annotations

import math

import numpy as np

import numpy_mamba_reference

MAMBA_KEYS = ("ssm_norm", "in_x", "in_z", "conv_w", "conv_b", "w_dt", "w_B", "w_C", "dt_proj", "dt_bias", "A_log",
              "D", "out_proj")


def _np(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float64)


def rms_norm(h: np.ndarray, gamma: np.ndarray, eps: float) -> np.ndarray:
    """γ ⊙ h / sqrt(mean(h²) + ε) over the last axis."""
    return gamma * h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + eps)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def silu(x):
    return x * sigmoid(x)


def swiglu(y: np.ndarray, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray) -> np.ndarray:
    """(silu(y W_g) ⊙ (y W_u)) W_d for y (..., d)."""
    return (silu(y @ w_gate) * (y @ w_up)) @ w_down


def rope(x: np.ndarray, base: float, scale: float) -> np.ndarray:
    """rotate_half RoPE on x (B, T, H, Dh), positions 0 … T−1: pair (x_i, x_{i+Dh/2}) turns by (scale·p)·ω_i."""
    _, t, _, dh = x.shape
    half = dh // 2
    out = np.empty_like(x)
    for p in range(t):
        for i in range(half):
            theta = (scale * p) * base ** (-2.0 * i / dh)
            c, s = np.cos(theta), np.sin(theta)
            a, b = x[:, p, :, i], x[:, p, :, i + half]
            out[:, p, :, i] = a * c - b * s
            out[:, p, :, i + half] = a * s + b * c
    return out


def attention(x: np.ndarray, w: dict, cfg) -> np.ndarray:
    """Causal GQA attention on x (B, T, d): query head j reads kv head j // (Hq/Hkv)."""
    bsz, t, _ = x.shape
    hq, hkv, dh = cfg.n_heads, cfg.n_kv_heads, cfg.d_head
    q = rope(np.einsum("btd,dhk->bthk", x, w["wq"]), cfg.rope_base, cfg.rope_scale)
    k = rope(np.einsum("btd,dhk->bthk", x, w["wk"]), cfg.rope_base, cfg.rope_scale)
    v = np.einsum("btd,dhk->bthk", x, w["wv"])
    r = hq // hkv
    o = np.zeros((bsz, t, hq, dh))
    for b in range(bsz):
        for j in range(hq):
            g = j // r
            for i in range(t):
                s = np.array([q[b, i, j] @ k[b, p, g] / np.sqrt(dh) for p in range(i + 1)])
                s = np.exp(s - s.max())
                a = s / s.sum()
                o[b, i, j] = sum(a[p] * v[b, p, g] for p in range(i + 1))
    return o.reshape(bsz, t, hq * dh) @ w["wo"].reshape(hq * dh, -1)


def route_one(r: np.ndarray, offset: np.ndarray, cfg) -> tuple[list[int], np.ndarray]:
    """(selected experts, their weights) for one token's router logits r (X,)."""
    k = cfg.moe_top_k
    if cfg.router == "sigmoid":
        a = sigmoid(r)
        sel = [int(e) for e in np.argsort(-(a + offset), kind="stable")[:k]]
        chosen = a[sel]
        return sel, chosen / (cfg.router_eps + chosen.sum())
    if cfg.router == "softmax":
        sel = [int(e) for e in np.argsort(-(r + offset), kind="stable")[:k]]
        z = np.exp(r[sel] - r[sel].max())
        return sel, z / z.sum()
    raise ValueError(f"unknown router {cfg.router!r}")


def moe(y: np.ndarray, w: dict, cfg, selections: list | None = None) -> np.ndarray:
    """Σ_selected w_e SwiGLU_e(y) + Σ_shared SwiGLU_s(y), token by token; y (B, T, d)."""
    bsz, t, d = y.shape
    out = np.zeros_like(y)
    for b in range(bsz):
        for i in range(t):
            yt = y[b, i]
            sel, weights = route_one(yt @ w["router"], w["router_offset"], cfg)
            if selections is not None:
                selections.append(sel)
            acc = np.zeros(d)
            for e, we in zip(sel, weights):
                acc += we * swiglu(yt, w["expert_gate"][e], w["expert_up"][e], w["expert_down"][e])
            for s in range(cfg.n_shared_experts):
                acc += swiglu(yt, w["shared_gate"][s], w["shared_up"][s], w["shared_down"][s])
            out[b, i] = acc
    return out


def layer_weights(params: dict, cfg, layer: int) -> dict:
    """Layer ℓ's weights as float64 arrays: entry ℓ % P of the blocks, index ℓ // P of each stacked array."""
    P = math.lcm(len(cfg.mixer_pattern), len(cfg.ffn_pattern))
    group = params["blocks"] if (len(cfg.mixer_pattern) == 1 and len(cfg.ffn_pattern) == 1) \
        else params["blocks"][layer % P]
    return {name: _np(arr)[layer // P] for name, arr in group.items()}


def forward(params: dict, tokens, cfg, *, selections: dict | None = None) -> np.ndarray:
    """Logits (B, T, V) in float64. ``selections``, if given, is filled with {layer: [selected experts per
    token (row-major over B, T)]} for every MoE layer."""
    tokens = np.asarray(tokens)
    embed = _np(params["embed"])
    h = embed[tokens]
    for layer in range(cfg.n_layers):
        mixer = cfg.mixer_pattern[layer % len(cfg.mixer_pattern)]
        ffn = cfg.ffn_pattern[layer % len(cfg.ffn_pattern)]
        w = layer_weights(params, cfg, layer)
        if mixer == "attn":
            h = h + attention(rms_norm(h, w["attn_norm"], cfg.norm_eps), w, cfg)
        else:  # the Mamba block's own reference (numpy_mamba_reference.py), written from Gu & Dao's equations
            h = numpy_mamba_reference.branch(h, {k: v for k, v in w.items() if k in MAMBA_KEYS}, cfg.norm_eps)
        if ffn == "none":
            continue
        y = rms_norm(h, w["ffn_norm"], cfg.norm_eps)
        if ffn == "swiglu":
            h = h + swiglu(y, w["w_gate"], w["w_up"], w["w_down"])
        elif ffn == "moe":
            sel = [] if selections is not None else None
            h = h + moe(y, w, cfg, sel)
            if selections is not None:
                selections[layer] = sel
        else:
            raise ValueError(f"unknown ffn kind {ffn!r}")
    unembed = embed.T if cfg.tie_embeddings else _np(params["unembed"])
    return rms_norm(h, _np(params["final_norm"]), cfg.norm_eps) @ unembed
