"""M20 §15's mixture-of-experts FFN sent back by hand, for a fixed selected expert set.

TopK is piecewise constant: away from ties the selected set S(y) does not move under a small change of θ, so the
derivative below holds S fixed, and the offsets b (which only choose S) get exactly zero. The same M20 §11 formulas
as the dense FFN (``primitives``), plus the router weights' derivative.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mlx_llm.config import ModelConfig
from mlx_llm.errors import ConfigError
from mlx_llm.layers.moe import route
from mlx_llm.objectives.grads.primitives import (_acc, linear_backward, residual_backward, rms_norm_backward,
                                                 softmax_backward, swiglu_backward)
from mlx_llm.ops import rms_norm, softmax, swiglu

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
