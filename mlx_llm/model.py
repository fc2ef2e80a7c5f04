"""The MiniLLM stack: parameter initialisation and the forward pass (M20 §3–§9, §15, §20).

Parameters follow the layout contract of DESIGN §1. A layer is a context mixer then an optional FFN, each in
its own pre-norm residual branch; the kinds come from ``cfg.mixer_pattern`` / ``cfg.ffn_pattern`` and each kind
lives in ``mlx_llm.layers``. A uniform stack keeps ``params["blocks"]`` one dict stacked over L; a stack of
period P > 1 holds a list of P such dicts, entry j holding layers j, j+P, … The blocks run under one
``jax.lax.scan`` (over layers, or over the L/P groups), so compile time does not grow with depth.

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
- Under μP (``cfg.parametrization`` "mup"), output weights take the base width's σ (``layout.mup_init_mult``):
  ``unembed`` N(0, 1/d_base), a tied table N(0, 1/d_base); everything else as above.
Every array's shape and initialiser is declared once, in ``mlx_llm.layers.layout``; ``init_params`` splits the
key into the draws the declarations take and each kind's ``init`` builds its arrays from them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mlx_llm.kernels.loss import choose_chunk, chunked_token_nll_lse
from mlx_llm.config import ATTENTION_KINDS, ModelConfig
from mlx_llm.errors import InputError
from mlx_llm.kernels import REFERENCE, Kernels, attention_path
from mlx_llm.layers import attention, ffn, initializers, layout, mamba, moe
from mlx_llm.ops import token_nll
from mlx_llm.ops import causal_mask, dense, document_mask, rms_norm

Params = dict

MIXERS = {"attn": attention, "local": attention, "mamba": mamba}
FFNS = {"swiglu": ffn, "moe": moe}
# Normal draws each kind's ``init`` makes (the key stream is split once, so the dense layout draws exactly the
# keys it always drew: embed, wq, wk, wv, wo, w_gate, w_up, w_down, unembed).
_DRAWS = {kind: layout.draws(table) for kind, table in layout.KINDS.items()}


class RingContext(NamedTuple):
    """Cached decoding through sliding-window layers (``decode.state.ring_context``): which of the W ring slots
    and T new positions each new query reads (B, T, W + T), and the ring slot each new position is written to
    (B, T; W = dropped)."""

    mask_BTS: jax.Array
    slots_BT: jax.Array


class Context(NamedTuple):
    """What every layer of one forward shares: positions (B, T), the boolean attention mask (B, T, S) of the
    reference attention path (None for the other paths, which read ``segment_ids_BT``) and the execution
    paths (``Kernels``, resolved)."""

    positions_BT: jax.Array
    mask_BTS: jax.Array | None
    segment_ids_BT: jax.Array | None = None
    slots_BT: jax.Array | None = None  # cached decoding only: where new K/V are written
    kernels: Kernels = REFERENCE
    ring: RingContext | None = None  # cached decoding through sliding-window layers only


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32) -> Params:
    """Random parameters in the DESIGN §1 layout (see the module docstring for the initialisers)."""
    n_draws = layout.draws(layout.TOP) + sum(_DRAWS[m] + _DRAWS[f] for m, f in cfg.group_kinds)
    keys = iter(jax.random.split(key, n_draws))

    def normal(shape, std):
        return (std * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    top = layout.TOP
    embed_table = initializers.init_array(top["embed"], cfg, normal, dtype)  # the first key; ``unembed`` takes the last
    n_groups = cfg.n_layers // cfg.period
    groups = []
    for mixer_kind, ffn_kind in cfg.group_kinds:
        layer = MIXERS[mixer_kind].init(cfg, normal, n_groups, dtype)
        if ffn_kind != "none":
            layer.update(FFNS[ffn_kind].init(cfg, normal, n_groups, dtype))
        groups.append(layer)
    params = {"embed": embed_table, "blocks": groups[0] if cfg.uniform else groups,
              "final_norm": initializers.init_array(top["final_norm"], cfg, normal, dtype)}
    if layout.present(top["unembed"], cfg):
        params["unembed"] = initializers.init_array(top["unembed"], cfg, normal, dtype)
    return params


def unembed_matrix(params: Params, cfg: ModelConfig) -> jax.Array:
    """U of M20 §8; with tied embeddings U = Eᵀ (one parameter in two roles, not two copies). Under μP, α·U with
    the output multiplier α = 1/m (``layers.layout.output_mult``), so every path to the logits (whole, chunked,
    decoding) has it."""
    u = params["embed"].T if cfg.tie_embeddings else params["unembed"]
    if cfg.parametrization == "sp":
        return u
    return u * jnp.asarray(layout.output_mult(cfg), u.dtype)


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


def apply_layer(h_BTD, layer, kinds: tuple[str, str], cfg: ModelConfig, ctx: Context):
    """One layer: H ← H + Mixer(N(H)), then H ← H + FFN(N(H)) unless the FFN kind is "none".

    Returns (H', aux): aux holds the MoE expert load under the key of the offsets it steers, else {}.
    """
    mixer_kind, ffn_kind = kinds
    if mixer_kind in ATTENTION_KINDS:
        h_BTD = attention.branch(h_BTD, layer, cfg, ctx, window=cfg.window(mixer_kind))
    else:
        h_BTD = MIXERS[mixer_kind].branch(h_BTD, layer, cfg, ctx)
    if ffn_kind == "none":
        return h_BTD, {}
    if ffn_kind == "moe":
        return moe.branch(h_BTD, layer, cfg, impl=ctx.kernels.moe_impl, interpret=ctx.kernels.interpret)
    return FFNS[ffn_kind].branch(h_BTD, layer, cfg)


def block(h_BTD, layer, cfg: ModelConfig, positions_BT, mask_BTS) -> jax.Array:
    """M20 §7 boxed block of the dense model: Z = H + A(N_γa(H)); H' = Z + F(N_γf(Z))."""
    return apply_layer(h_BTD, layer, cfg.layer_kinds(0), cfg, Context(positions_BT, mask_BTS))[0]


def layer_list(params: Params, cfg: ModelConfig) -> list[tuple[dict, tuple[str, str]]]:
    """(weights, kinds) of every layer in order, sliced out of the stacked blocks (tests, decoding)."""
    groups = [params["blocks"]] if cfg.uniform else params["blocks"]
    return [(jax.tree.map(lambda a: a[l // cfg.period], groups[l % cfg.period]), cfg.layer_kinds(l))
            for l in range(cfg.n_layers)]


def logits_from_hidden(h_BTD, params: Params, cfg: ModelConfig) -> jax.Array:
    """M20 §8: R = N_γo(H⁽ᴸ⁾), Λ = R U."""
    r_BTD = rms_norm(h_BTD, params["final_norm"], cfg.norm_eps)
    acc = jnp.promote_types(r_BTD.dtype, jnp.float32)  # logits leave in ≥ float32 for softmax and loss
    return dense(r_BTD, unembed_matrix(params, cfg), preferred_element_type=acc)


def nll_from_hidden(h_BTD, targets_BT, params: Params, cfg: ModelConfig, loss_chunk: int | str = 0, *,
                    return_lse: bool = False):
    """−log p(x_t | x_<t) (B, T) from H⁽ᴸ⁾ (M20 §8, §10). ``loss_chunk`` 0 forms the whole (B, T, V) logits;
    N (or "auto", sized by ``kernels.loss.choose_chunk``) forms N rows of them at a time, in the forward and again
    in the backward (kernels/loss.py): the same values and gradients without the (B, T, V) tensor.
    ``return_lse``: (nll, log Z) with log Z_t = logsumexp(Λ_t), differentiable (the z-loss)."""
    if not loss_chunk:
        logits_BTV = logits_from_hidden(h_BTD, params, cfg)
        nll_BT = token_nll(logits_BTV, targets_BT)
        return (nll_BT, jax.nn.logsumexp(logits_BTV, axis=-1)) if return_lse else nll_BT
    r_BTD = rms_norm(h_BTD, params["final_norm"], cfg.norm_eps)
    if loss_chunk == "auto":
        loss_chunk = choose_chunk(h_BTD.shape[0] * h_BTD.shape[1], cfg.vocab_size)
    nll_BT, lse_BT = chunked_token_nll_lse(r_BTD, unembed_matrix(params, cfg), targets_BT, chunk=loss_chunk)
    return (nll_BT, lse_BT) if return_lse else nll_BT


REMAT = {"full": jax.checkpoint_policies.nothing_saveable, "dots": jax.checkpoint_policies.dots_saveable}


def run_stack(h_BTD, params: Params, cfg: ModelConfig, ctx: Context, remat: str = "none"):
    """(B_L ∘ … ∘ B_1)(H) under one lax.scan: over layers (uniform) or over the L/P groups of P layers.

    Returns (H⁽ᴸ⁾, aux) with aux stacked like ``params["blocks"]`` (MoE loads (L/P, X) under router_offset).
    ``remat`` trades compute for memory in the backward pass (``jax.checkpoint`` of each scan step): "full"
    keeps only each layer's input and recomputes the layer, "dots" also keeps the matmul outputs and recomputes
    the elementwise work (norms, RoPE, softmax, SwiGLU); "none" keeps every intermediate.
    """
    kinds = cfg.group_kinds

    def step(h_BTD, group):
        if cfg.uniform:
            return apply_layer(h_BTD, group, kinds[0], cfg, ctx)
        auxes = []
        for layer, layer_kinds in zip(group, kinds):
            h_BTD, aux = apply_layer(h_BTD, layer, layer_kinds, cfg, ctx)
            auxes.append(aux)
        return h_BTD, auxes

    if remat != "none":
        step = jax.checkpoint(step, policy=REMAT[remat])
    return jax.lax.scan(step, h_BTD, params["blocks"])


def resolved(kernels: Kernels | None) -> Kernels:
    """``kernels`` (default: the reference paths), resolved for the default backend unless it already is."""
    kernels = REFERENCE if kernels is None else kernels
    return kernels if kernels.platform is not None else kernels.resolve()


def hidden_states(params: Params, tokens_BT, cfg: ModelConfig, *, positions_BT=None, segment_ids_BT=None,
                  return_aux: bool = False, remat: str = "none", kernels: Kernels | None = None):
    """H⁽ᴸ⁾ = (B_L ∘ … ∘ B_1)(E[x]) (and, with ``return_aux``, the per-layer MoE loads); ``remat``: run_stack;
    ``kernels``: the execution paths (default the exact reference ones; kernels/__init__.py)."""
    b, t = tokens_BT.shape
    kernels = resolved(kernels)
    if positions_BT is None:
        positions_BT = jnp.broadcast_to(jnp.arange(t), (b, t))
    mask_BTS = None
    if attention_path(kernels, t) == "xla" and cfg.attention:  # built once, shared by every layer
        mask_BTS = (causal_mask if cfg.causal else document_mask)(segment_ids_BT, b, t)
    ctx = Context(positions_BT, mask_BTS, segment_ids_BT, kernels=kernels)
    h_BTD, aux = run_stack(embed(params, tokens_BT), params, cfg, ctx, remat)
    return (h_BTD, aux) if return_aux else h_BTD


def forward(params: Params, tokens_BT, cfg: ModelConfig, *, positions_BT=None, segment_ids_BT=None,
            kernels: Kernels | None = None) -> jax.Array:
    """Logits Λ (B, T, V) for every position (M20 §20's boxed equation, all rows kept).

    Positions default to 0 … T−1. For packed windows pass ``segment_ids_BT`` (attention never crosses a
    document boundary) and ``positions_BT`` restarting at each document. ``kernels``: see ``hidden_states``.
    """
    check_tokens(tokens_BT, cfg)
    tokens_BT = jnp.asarray(tokens_BT)
    h_BTD = hidden_states(params, tokens_BT, cfg, positions_BT=positions_BT, segment_ids_BT=segment_ids_BT,
                          kernels=kernels)
    return logits_from_hidden(h_BTD, params, cfg)
