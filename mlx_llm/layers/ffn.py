"""The SwiGLU FFN branch (M20 §7). Keys (DESIGN §1): ``ffn_norm (d)``, ``w_gate, w_up (d, m)``, ``w_down (m, d)``."""

from __future__ import annotations

import math

import jax.numpy as jnp

from mlx_llm.ops import rms_norm, swiglu


def init(cfg, normal, L: int, dtype) -> dict:
    """SwiGLU keys for L stacked layers: N(0, 1/fan_in); W_down also × 1/√(2·n_layers) (residual writer)."""
    d, F = cfg.d_model, cfg.d_ff
    resid = 1.0 / math.sqrt(2 * cfg.n_layers)
    return {
        "ffn_norm": jnp.ones((L, d), dtype),
        "w_gate": normal((L, d, F), 1 / math.sqrt(d)),
        "w_up": normal((L, d, F), 1 / math.sqrt(d)),
        "w_down": normal((L, F, d), resid / math.sqrt(F)),
    }


def branch(z_BTD, layer, cfg):
    """M20 §7 second line: H = Z + F(N_γf(Z)). Returns (H, aux) with no auxiliary outputs."""
    y_BTD = rms_norm(z_BTD, layer["ffn_norm"], cfg.norm_eps)
    return z_BTD + swiglu(y_BTD, layer["w_gate"], layer["w_up"], layer["w_down"]), {}
