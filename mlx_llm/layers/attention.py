"""The attention mixer (M20 §5–§6): GQA with RoPE, full-sequence (training, prefill) and cached (decode).

Keys (DESIGN §1): ``attn_norm (d)``, ``wq (d, Hq, Dh)``, ``wk, wv (d, Hkv, Dh)``, ``wo (Hq, Dh, d)``; with
``qkv_bias`` also ``bq (Hq, Dh)``, ``bk, bv (Hkv, Dh)`` (Qwen2); with ``qk_norm`` the per-head RMSNorm gains
``q_norm, k_norm (Dh)`` applied to Q and K before RoPE (Qwen3). The branch is Z = H + A(N_γa(H)); the residual
carries H, not N(H) (M20 §7). Mixer kind "local" is the same layer reading a sliding window of
``cfg.sliding_window`` positions. In decoding the layer declares what it carries (``state_spec``) and reads and
writes it through the view decode/ hands it (``decode_branch``): it never sees the cache's layout.

The knobs (``ModelConfig``): ``sandwich_norm`` adds ``post_attn_norm (d)``, Z = H + N_post(A(N_γa(H)));
``value_embeds`` adds ``value_embed (V, Hkv, Dh)`` and ``value_gate ()``, V = X W^V + λ·E^v[x];
``attn_softcap`` caps every score, in every path (kernels/attention.py); ``rope_local_base`` rotates the
'local' layers at their own base; ``score_dim`` s scales the scores by 1/√s (Q̃ is multiplied by √(d_h/s) after
RoPE, so every path's 1/√d_h gives it); in training ``ctx.window`` is the warmed-up window of 'local' layers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import math

from mlx_llm.kernels import attention as kernels
from mlx_llm.layers import initializers, layout
from mlx_llm.layers.norm import norm, post_norm
from mlx_llm.layers.rope_scaling import rope_for
from mlx_llm.layers.state_spec import KVSpec
from mlx_llm.ops import dense


def init(cfg, normal, L: int, dtype) -> dict:
    """Attention keys for L stacked layers, as ``layout.ATTN`` declares them: projections N(0, 1/fan_in); W^O
    also × 1/√(2·n_layers) because it writes into the residual stream (see ``model``'s docstring)."""
    return initializers.init_table(layout.ATTN, cfg, normal, L, dtype)


def attention_qkv(x_BTD, layer, cfg, positions_BT, tokens_BT=None, *, local: bool = False):
    """M20 §5: Q_j = X W^Q_j, K_g = X W^K_g, V_g = X W^V_g (+ biases with ``qkv_bias``; + λ·E^v[x] with
    ``value_embeds``, which needs ``tokens_BT``); with ``qk_norm`` Q and K are RMS-normalised per head over d_h;
    then RoPE (scaled as ``cfg.rope_scaling`` says, or plain at ``rope_local_base`` for a ``local`` layer) on Q and
    K only; with ``score_dim`` s, Q̃ × √(d_h/s); under μP Q̃ × ``layout.attention_q_mult`` (the logit scale √d₀/d_h
    instead of 1/√d_h)."""
    q_BTHK = dense(x_BTD, layer["wq"])
    k_BTGK = dense(x_BTD, layer["wk"])
    v_BTGK = dense(x_BTD, layer["wv"])
    if cfg.qkv_bias:
        q_BTHK, k_BTGK, v_BTGK = (a + layer[b].astype(a.dtype) for a, b in
                                  ((q_BTHK, "bq"), (k_BTGK, "bk"), (v_BTGK, "bv")))
    if cfg.value_embeds:
        ve_BTGK = jnp.take(layer["value_embed"], tokens_BT, axis=0, mode="fill", fill_value=jnp.nan)
        v_BTGK = v_BTGK + (layer["value_gate"] * ve_BTGK).astype(v_BTGK.dtype)
    if cfg.qk_norm:
        q_BTHK = norm(q_BTHK, layer["q_norm"], cfg)
        k_BTGK = norm(k_BTGK, layer["k_norm"], cfg)
    q_BTHK, k_BTGK = rope_for(positions_BT, cfg, q_BTHK, k_BTGK, local=local)
    if cfg.score_dim is not None and cfg.score_dim != cfg.d_head:
        q_BTHK = q_BTHK * jnp.asarray(math.sqrt(cfg.d_head / cfg.score_dim), q_BTHK.dtype)
    if cfg.parametrization != "sp":  # μP's logit scale √d₀/d_h through the kernels' 1/√d_h (layout.attention_q_mult)
        q_BTHK = q_BTHK * jnp.asarray(layout.attention_q_mult(cfg), q_BTHK.dtype)
    return q_BTHK, k_BTGK, v_BTGK


def attention_output(o_BTHK, layer) -> jax.Array:
    """M20 §6: A(X) = Concat(O_0, …, O_{h_q−1}) W^O."""
    b, t, h, k = o_BTHK.shape
    return dense(o_BTHK.reshape(b, t, h * k), layer["wo"].reshape(h * k, -1))


def _qkv(h_BTD, layer, cfg, ctx, local: bool):
    """N_γa(H), then Q̃, K̃, V of the new positions (``attention_qkv``)."""
    return attention_qkv(norm(h_BTD, layer["attn_norm"], cfg), layer, cfg, ctx.positions_BT, ctx.tokens_BT,
                         local=local)


def _residual(h_BTD, o_BTHK, layer, cfg):
    """Z = H + N_post(A) (the sandwich norm only with ``cfg.sandwich_norm``)."""
    return h_BTD + post_norm(attention_output(o_BTHK, layer), layer, "post_attn_norm", cfg)


def branch(h_BTD, layer, cfg, ctx, window: int | None = None) -> jax.Array:
    """M20 §7 first line: Z = H + A(N_γa(H)), over the whole sequence (causal, per document; bidirectional, per
    document, when ``cfg.causal`` is false; within the last ``window`` positions when set — in training under a
    window warmup, the last ``ctx.window`` of them), by the attention path ``ctx.kernels`` names
    (kernels/attention.py), scores soft-capped at ``cfg.attn_softcap``."""
    q, k, v = _qkv(h_BTD, layer, cfg, ctx, window is not None)
    o_BTHK = kernels.attention(q, k, v, ctx.segment_ids_BT, causal=cfg.causal, kernels=ctx.kernels,
                               mask_BTS=ctx.mask_BTS, window=window, cap=cfg.attn_softcap,
                               window_now=ctx.window if window is not None else None)
    return _residual(h_BTD, o_BTHK, layer, cfg)


# ----- decoding ------------------------------------------------------------------------------------------
def state_spec(cfg, kind: str) -> KVSpec:
    """What a cached call carries for an attention layer of mixer kind ``kind``: the keys and values of its
    h_kv heads (GQA, M20 §6), for every position or, for "local", the last ``sliding_window`` of them."""
    return KVSpec(heads=cfg.n_kv_heads or 1, width=cfg.d_head or 1, window=cfg.window(kind))


def decode_branch(h_BTD, layer, cfg, ctx, view, kind: str):
    """The branch on new positions only (M20 §14): Q̃/K̃/𝖵 of the new positions, then the cache ``view`` (decode's:
    a contiguous cache, a ring, pages) writes the new K̃/𝖵 and lets each new query read what it holds. Returns
    (Z, the updated view)."""
    q_BTHK, k_BTGK, v_BTGK = _qkv(h_BTD, layer, cfg, ctx, cfg.window(kind) is not None)
    o_BTHK, view = view.attend(q_BTHK, k_BTGK, v_BTGK, cap=cfg.attn_softcap)
    return _residual(h_BTD, o_BTHK, layer, cfg), view
