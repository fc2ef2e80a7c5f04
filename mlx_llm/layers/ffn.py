"""The SwiGLU FFN branch (M20 §7). Keys (DESIGN §1): ``ffn_norm (d)``, ``w_gate, w_up (d, m)``, ``w_down (m, d)``."""

from __future__ import annotations

from mlx_llm.layers import initializers, layout
from mlx_llm.ops import rms_norm, swiglu


def init(cfg, normal, L: int, dtype) -> dict:
    """SwiGLU keys for L stacked layers (``layout.SWIGLU``): N(0, 1/fan_in); W_down also × 1/√(2·n_layers)
    (residual writer)."""
    return initializers.init_table(layout.SWIGLU, cfg, normal, L, dtype)


def branch(z_BTD, layer, cfg):
    """M20 §7 second line: H = Z + F(N_γf(Z)). Returns (H, aux) with no auxiliary outputs."""
    y_BTD = rms_norm(z_BTD, layer["ffn_norm"], cfg.norm_eps)
    return z_BTD + swiglu(y_BTD, layer["w_gate"], layer["w_up"], layer["w_down"]), {}
