"""The dense FFN branches (M20 §7): SwiGLU (M20 §7), GeGLU (Shazeer 2020; Gemma) and squared ReLU (So et al.
2021; modded-nanogpt). Keys (DESIGN §1): ``ffn_norm (d)``, ``w_gate`` (gated kinds only), ``w_up (d, m)``,
``w_down (m, d)``; with ``sandwich_norm`` also ``post_ffn_norm (d)``."""

from __future__ import annotations

from mlx_llm.layers import initializers, layout
from mlx_llm.layers.norm import norm, post_norm
from mlx_llm.ops import geglu, relu2, swiglu

KINDS = ("swiglu", "geglu", "relu2")


def init(cfg, normal, L: int, dtype, kind: str = "swiglu") -> dict:
    """The keys of FFN ``kind`` for L stacked layers (``layout.KINDS[kind]``): N(0, 1/fan_in); W_down also
    × 1/√(2·n_layers) (residual writer)."""
    return initializers.init_table(layout.KINDS[kind], cfg, normal, L, dtype)


def ffn(y_BTD, layer, kind: str = "swiglu"):
    """F(Y) of FFN ``kind``: [SiLU(Y W_gate) ⊙ Y W_up] W_down (swiglu), [GELU_tanh(Y W_gate) ⊙ Y W_up] W_down
    (geglu), max(0, Y W_up)² W_down (relu2)."""
    if kind == "relu2":
        return relu2(y_BTD, layer["w_up"], layer["w_down"])
    return (geglu if kind == "geglu" else swiglu)(y_BTD, layer["w_gate"], layer["w_up"], layer["w_down"])


def branch(z_BTD, layer, cfg, kind: str = "swiglu"):
    """M20 §7 second line: H = Z + F(N_γf(Z)) (+ N_post around F with ``cfg.sandwich_norm``). Returns (H, aux)
    with no auxiliary outputs."""
    y_BTD = norm(z_BTD, layer["ffn_norm"], cfg)
    return z_BTD + post_norm(ffn(y_BTD, layer, kind), layer, "post_ffn_norm", cfg), {}
