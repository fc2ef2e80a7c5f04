"""The dense MiniLLM: parameter initialisation and the forward pass (M20 §3–§9, §20).

Parameters follow the layout contract of DESIGN §1 (layers stacked on axis 0, projections multiply on the
right). The block stack runs under one ``jax.lax.scan`` so compile time does not grow with depth.

Initialisers (``init_params``), chosen for a pre-norm residual stack:
- ``embed`` ~ N(0, 1) untied: RMSNorm rescales each block's input anyway, and a unit-scale residual stream
  keeps the embedding on the same footing as the branch outputs it is summed with. Tied, the same table
  is also the output projection, so it uses N(0, 1/d) to keep the initial logits at unit scale.
- Every projection ~ N(0, 1/fan_in) (fan_in = d for Q/K/V/gate/up, h_q·d_h for W^O, m for W_down), the
  variance-preserving choice for inputs of unit RMS. The two projections that write into the residual
  stream (W^O, W_down) are further scaled by 1/sqrt(2L) (GPT-2), so the stream's variance at
  initialisation does not grow with depth.
- ``unembed`` ~ N(0, 1/d): unit-scale initial logits, i.e. a near-uniform first prediction (loss ≈ ln V).
- Normalisation gains = 1 (M20 §4), so each RMSNorm starts as a pure rescaling.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from mlx_llm.config import ModelConfig
from mlx_llm.errors import InputError
from mlx_llm.ops import causal_attention, causal_mask, dense, rms_norm, rope, swiglu

Params = dict


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32) -> Params:
    """Random parameters in the DESIGN §1 layout (see the module docstring for the initialisers)."""
    V, d, L, H, G, K, F = (cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads,
                           cfg.d_head, cfg.d_ff)
    keys = iter(jax.random.split(key, 9))

    def normal(shape, std):
        return (std * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    resid = 1.0 / math.sqrt(2 * L)
    params = {
        "embed": normal((V, d), 1.0 / math.sqrt(d) if cfg.tie_embeddings else 1.0),
        "blocks": {
            "attn_norm": jnp.ones((L, d), dtype),
            "wq": normal((L, d, H, K), 1 / math.sqrt(d)),
            "wk": normal((L, d, G, K), 1 / math.sqrt(d)),
            "wv": normal((L, d, G, K), 1 / math.sqrt(d)),
            "wo": normal((L, H, K, d), resid / math.sqrt(H * K)),
            "ffn_norm": jnp.ones((L, d), dtype),
            "w_gate": normal((L, d, F), 1 / math.sqrt(d)),
            "w_up": normal((L, d, F), 1 / math.sqrt(d)),
            "w_down": normal((L, F, d), resid / math.sqrt(F)),
        },
        "final_norm": jnp.ones((d,), dtype),
    }
    if not cfg.tie_embeddings:
        params["unembed"] = normal((d, V), 1 / math.sqrt(d))
    return params


def unembed_matrix(params: Params, cfg: ModelConfig) -> jax.Array:
    """U of M20 §8; with tied embeddings U = Eᵀ (one parameter in two roles, not two copies)."""
    return params["embed"].T if cfg.tie_embeddings else params["unembed"]


def check_tokens(tokens_BT, cfg: ModelConfig, name: str = "tokens") -> None:
    """Reject ids outside [0, vocab_size) before any gather (JAX would clamp them silently).

    Traced arrays cannot be inspected; for them ``embed`` fills out-of-range rows with NaN, so a bad id
    poisons the loss loudly instead of reading a wrong row.
    """
    if isinstance(tokens_BT, jax.core.Tracer):
        return
    arr = np.asarray(tokens_BT)
    if arr.ndim != 2:
        raise InputError(f"{name} must have shape (batch, length); got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise InputError(f"{name} must be integer token ids; got dtype {arr.dtype}")
    if arr.shape[1] > cfg.max_seq_len:
        raise InputError(f"{name} has length {arr.shape[1]}, longer than max_seq_len = {cfg.max_seq_len}")
    bad = (arr < 0) | (arr >= cfg.vocab_size)
    if bad.any():
        b, t = np.argwhere(bad)[0]
        raise InputError(
            f"{name}[{b}, {t}] = {arr[b, t]} is not a valid token id: ids must be in [0, {cfg.vocab_size}) "
            f"({int(bad.sum())} invalid id(s) in total)"
        )


def embed(params: Params, tokens_BT: jax.Array) -> jax.Array:
    """M20 §3: H⁽⁰⁾ = E[x]; an out-of-range id yields a NaN row, never a clamped one."""
    return jnp.take(params["embed"], tokens_BT, axis=0, mode="fill", fill_value=jnp.nan)


def attention_qkv(x_BTD, layer, cfg: ModelConfig, positions_BT):
    """M20 §5: Q_j = X W^Q_j, K_g = X W^K_g, V_g = X W^V_g; RoPE on Q and K only."""
    q_BTHK = dense(x_BTD, layer["wq"])
    k_BTGK = dense(x_BTD, layer["wk"])
    v_BTGK = dense(x_BTD, layer["wv"])
    q_BTHK = rope(q_BTHK, positions_BT, cfg.rope_base, cfg.rope_scale)
    k_BTGK = rope(k_BTGK, positions_BT, cfg.rope_base, cfg.rope_scale)
    return q_BTHK, k_BTGK, v_BTGK


def attention_output(o_BTHK, layer) -> jax.Array:
    """M20 §6: A(X) = Concat(O_0, …, O_{h_q−1}) W^O."""
    b, t, h, k = o_BTHK.shape
    return dense(o_BTHK.reshape(b, t, h * k), layer["wo"].reshape(h * k, -1))


def ffn_sublayer(z_BTD, layer, cfg: ModelConfig) -> jax.Array:
    """M20 §7 second line: H = Z + F(N_γf(Z))."""
    y_BTD = rms_norm(z_BTD, layer["ffn_norm"], cfg.norm_eps)
    return z_BTD + swiglu(y_BTD, layer["w_gate"], layer["w_up"], layer["w_down"])


def block(h_BTD, layer, cfg: ModelConfig, positions_BT, mask_BTS) -> jax.Array:
    """M20 §7 boxed block: Z = H + A(N_γa(H)); H' = Z + F(N_γf(Z)). The residual carries H, not N(H)."""
    x_BTD = rms_norm(h_BTD, layer["attn_norm"], cfg.norm_eps)
    q, k, v = attention_qkv(x_BTD, layer, cfg, positions_BT)
    z_BTD = h_BTD + attention_output(causal_attention(q, k, v, mask_BTS), layer)
    return ffn_sublayer(z_BTD, layer, cfg)


def logits_from_hidden(h_BTD, params: Params, cfg: ModelConfig) -> jax.Array:
    """M20 §8: R = N_γo(H⁽ᴸ⁾), Λ = R U."""
    r_BTD = rms_norm(h_BTD, params["final_norm"], cfg.norm_eps)
    acc = jnp.promote_types(r_BTD.dtype, jnp.float32)  # logits leave in ≥ float32 for softmax and loss
    return dense(r_BTD, unembed_matrix(params, cfg), preferred_element_type=acc)


def hidden_states(params: Params, tokens_BT, cfg: ModelConfig, *, positions_BT=None, segment_ids_BT=None):
    """H⁽ᴸ⁾ = (B_L ∘ … ∘ B_1)(E[x]) with the blocks under one lax.scan."""
    b, t = tokens_BT.shape
    if positions_BT is None:
        positions_BT = jnp.broadcast_to(jnp.arange(t), (b, t))
    mask_BTS = causal_mask(segment_ids_BT, b, t)

    def step(h_BTD, layer):
        return block(h_BTD, layer, cfg, positions_BT, mask_BTS), None

    h_BTD, _ = jax.lax.scan(step, embed(params, tokens_BT), params["blocks"])
    return h_BTD


def forward(params: Params, tokens_BT, cfg: ModelConfig, *, positions_BT=None, segment_ids_BT=None) -> jax.Array:
    """Logits Λ (B, T, V) for every position (M20 §20's boxed equation, all rows kept).

    Positions default to 0 … T−1. For packed windows pass ``segment_ids_BT`` (attention never crosses a
    document boundary) and ``positions_BT`` restarting at each document.
    """
    check_tokens(tokens_BT, cfg)
    tokens_BT = jnp.asarray(tokens_BT)
    h_BTD = hidden_states(params, tokens_BT, cfg, positions_BT=positions_BT, segment_ids_BT=segment_ids_BT)
    return logits_from_hidden(h_BTD, params, cfg)
