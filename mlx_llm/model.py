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
key into the draws the declarations take and each kind's ``init`` builds its arrays from them. Arrays that only
the knobs add (value embeddings, the MTP modules' projections) draw from a second stream, ``fold_in(key,
EXTRA_STREAM)``, so every seed's other parameters are the same with or without them.

The knobs of ``ModelConfig`` act here: ``embed_scale`` (H⁽⁰⁾ = √d·E[x]), ``unet_skips`` (``run_stack``: two scans,
the second half reading the first half's outputs in reverse), ``logit_softcap`` (``logits_from_hidden``,
``nll_from_hidden``), the window warmup (``training_window``), and the MTP modules (``mtp_hidden``).
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
from mlx_llm.layers.norm import norm
from mlx_llm.ops import token_nll
from mlx_llm.ops import causal_mask, dense, document_mask, softcap

Params = dict

MIXERS = {"attn": attention, "local": attention, "mamba": mamba}
FFNS = {"swiglu": ffn, "geglu": ffn, "relu2": ffn, "moe": moe}
EXTRA_STREAM = 0x6B6E6F62  # fold_in constant of the knobs' second key stream (layout.ParamInfo.extra)
# Normal draws each kind's ``init`` makes (the key stream is split once, so the dense layout draws exactly the
# keys it always drew: embed, wq, wk, wv, wo, w_gate, w_up, w_down, unembed).
_DRAWS = {kind: layout.draws(table) for kind, table in layout.KINDS.items()}


class Context(NamedTuple):
    """What every layer of one forward shares: positions (B, T), the boolean attention mask (B, T, S) of the
    reference attention path (None for the other paths, which read ``segment_ids_BT``) and the execution
    paths (``Kernels``, resolved)."""

    positions_BT: jax.Array
    mask_BTS: jax.Array | None
    segment_ids_BT: jax.Array | None = None
    kernels: Kernels = REFERENCE
    tokens_BT: jax.Array | None = None  # the input ids (value embeddings read them)
    window: jax.Array | None = None  # training under a window warmup: the 'local' layers' window W(s), traced


def _init_layers(cfg: ModelConfig, normal, kinds: tuple[str, str], n: int, dtype) -> dict:
    """The arrays of ``n`` stacked layers of (mixer, FFN) ``kinds``."""
    mixer_kind, ffn_kind = kinds
    layer = MIXERS[mixer_kind].init(cfg, normal, n, dtype)
    if ffn_kind == "moe":
        layer.update(moe.init(cfg, normal, n, dtype))
    elif ffn_kind != "none":
        layer.update(ffn.init(cfg, normal, n, dtype, ffn_kind))
    return layer


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32) -> Params:
    """Random parameters in the DESIGN §1 layout (see the module docstring for the initialisers)."""
    n_draws = layout.draws(layout.TOP) + sum(_DRAWS[m] + _DRAWS[f] for m, f in cfg.group_kinds)
    keys = iter(jax.random.split(key, n_draws))
    extra_key, extra_count = jax.random.fold_in(key, EXTRA_STREAM), iter(range(1 << 30))

    def main(shape, std):
        return (std * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    def extra(shape, std):
        draw = jax.random.normal(jax.random.fold_in(extra_key, next(extra_count)), shape, jnp.float32)
        return (std * draw).astype(dtype)

    normal = (main, extra)
    top = layout.TOP
    embed_table = initializers.init_array(top["embed"], cfg, normal, dtype)  # the first key; ``unembed`` takes the last
    n_groups = cfg.n_layers // cfg.period
    groups = [_init_layers(cfg, normal, kinds, n_groups, dtype) for kinds in cfg.group_kinds]
    params = {"embed": embed_table, "blocks": groups[0] if cfg.uniform else groups,
              "final_norm": initializers.init_array(top["final_norm"], cfg, normal, dtype)}
    if layout.present(top["unembed"], cfg):
        params["unembed"] = initializers.init_array(top["unembed"], cfg, normal, dtype)
    if layout.present(top["skip_weights"], cfg):
        params["skip_weights"] = initializers.init_array(top["skip_weights"], cfg, normal, dtype)
    if cfg.mtp_depth:  # after everything else: its draws come from the second stream
        mtp = initializers.init_table(layout.MTP, cfg, normal, cfg.mtp_depth, dtype)
        mtp.update(_init_layers(cfg, (extra, extra), layout.mtp_kinds(cfg), cfg.mtp_depth, dtype))
        params["mtp"] = {"blocks": mtp}
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


def embed(params: Params, tokens_BT: jax.Array, cfg: ModelConfig | None = None) -> jax.Array:
    """M20 §3: H⁽⁰⁾ = E[x] (× √d under ``cfg.embed_scale``, Gemma, in E's dtype as transformers does); an
    out-of-range id yields a NaN row, never a clamped one."""
    h_BTD = jnp.take(params["embed"], tokens_BT, axis=0, mode="fill", fill_value=jnp.nan)
    if cfg is not None and cfg.embed_scale:
        h_BTD = h_BTD * jnp.asarray(cfg.d_model ** 0.5, h_BTD.dtype)
    return h_BTD


def training_window(cfg: ModelConfig, step) -> jax.Array | None:
    """The sliding window W(s) of the 'local' layers at optimizer update s under ``window_warmup_steps`` S_w
    (modded-nanogpt's attention-window warmup): W(s) = w₀ + ⌊(W − w₀)·min(s, S_w)/S_w⌋, w₀ =
    ``window_warmup_start``, W = ``sliding_window`` (int32, traceable); W from s = S_w on, and at inference.
    None without a warmup."""
    if not cfg.window_warmup_steps:
        return None
    w0, w, n = cfg.window_warmup_start, cfg.sliding_window, cfg.window_warmup_steps
    s = jnp.minimum(jnp.asarray(step, jnp.int32), n)
    return (w0 + ((w - w0) * s) // n).astype(jnp.int32)


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
    return ffn.branch(h_BTD, layer, cfg, ffn_kind)


def block(h_BTD, layer, cfg: ModelConfig, positions_BT, mask_BTS) -> jax.Array:
    """M20 §7 boxed block of the dense model: Z = H + A(N_γa(H)); H' = Z + F(N_γf(Z))."""
    return apply_layer(h_BTD, layer, cfg.layer_kinds(0), cfg, Context(positions_BT, mask_BTS))[0]


def layer_list(params: Params, cfg: ModelConfig) -> list[tuple[dict, tuple[str, str]]]:
    """(weights, kinds) of every layer in order, sliced out of the stacked blocks (tests, decoding)."""
    groups = [params["blocks"]] if cfg.uniform else params["blocks"]
    return [(jax.tree.map(lambda a: a[l // cfg.period], groups[l % cfg.period]), cfg.layer_kinds(l))
            for l in range(cfg.n_layers)]


def logits_from_hidden(h_BTD, params: Params, cfg: ModelConfig) -> jax.Array:
    """M20 §8: R = N_γo(H⁽ᴸ⁾), Λ = R U (soft-capped to c·tanh(Λ/c) under ``cfg.logit_softcap``)."""
    r_BTD = norm(h_BTD, params["final_norm"], cfg)
    acc = jnp.promote_types(r_BTD.dtype, jnp.float32)  # logits leave in ≥ float32 for softmax and loss
    return softcap(dense(r_BTD, unembed_matrix(params, cfg), preferred_element_type=acc), cfg.logit_softcap)


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
    r_BTD = norm(h_BTD, params["final_norm"], cfg)
    if loss_chunk == "auto":
        loss_chunk = choose_chunk(h_BTD.shape[0] * h_BTD.shape[1], cfg.vocab_size)
    nll_BT, lse_BT = chunked_token_nll_lse(r_BTD, unembed_matrix(params, cfg), targets_BT, chunk=loss_chunk,
                                           cap=cfg.logit_softcap)
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

    if cfg.unet_skips:
        return _unet_stack(h_BTD, params, cfg, ctx, remat)
    if remat != "none":
        step = jax.checkpoint(step, policy=REMAT[remat])
    return jax.lax.scan(step, h_BTD, params["blocks"])


def _unet_stack(h_BTD, params: Params, cfg: ModelConfig, ctx: Context, remat: str):
    """``run_stack`` with U-net skips (modded-nanogpt): H_j, the output of layer j < U = L/2, is added to the
    input of layer L − 1 − j with weight w_{L−1−j−U}: layer i ≥ U runs on H + w_{i−U}·H_{L−1−i}. Two scans, each
    over half the groups (U is a multiple of the period): the first also returns every layer's output, the second
    reads them in reverse order as its inputs, so the skips cost U activations, not a carry of U per layer."""
    kinds, p = cfg.group_kinds, cfg.period
    half = cfg.n_layers // 2 // p  # groups per half
    blocks = [params["blocks"]] if cfg.uniform else params["blocks"]
    first = [jax.tree.map(lambda a: a[:half], g) for g in blocks]
    second = [jax.tree.map(lambda a: a[half:], g) for g in blocks]

    def down(h_BTD, group):
        outs, auxes = [], []
        for layer, layer_kinds in zip(group, kinds):
            h_BTD, aux = apply_layer(h_BTD, layer, layer_kinds, cfg, ctx)
            outs.append(h_BTD)
            auxes.append(aux)
        return h_BTD, (jnp.stack(outs), auxes)

    def up(h_BTD, xs):
        group, skips_PBTD, w_P = xs
        auxes = []
        for j, (layer, layer_kinds) in enumerate(zip(group, kinds)):
            h_BTD = h_BTD + w_P[j].astype(h_BTD.dtype) * skips_PBTD[j]
            h_BTD, aux = apply_layer(h_BTD, layer, layer_kinds, cfg, ctx)
            auxes.append(aux)
        return h_BTD, auxes

    if remat != "none":
        down, up = (jax.checkpoint(f, policy=REMAT[remat]) for f in (down, up))
    h_BTD, (outs_GPBTD, aux_down) = jax.lax.scan(down, h_BTD, first)
    skips = outs_GPBTD.reshape(-1, *outs_GPBTD.shape[2:])[::-1].reshape(outs_GPBTD.shape)  # layer order, reversed
    w = params["skip_weights"].reshape(half, p)
    h_BTD, aux_up = jax.lax.scan(up, h_BTD, (second, skips, w))
    aux = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), aux_down, aux_up)
    return h_BTD, aux[0] if cfg.uniform else aux


def resolved(kernels: Kernels | None) -> Kernels:
    """``kernels`` (default: the reference paths), resolved for the default backend unless it already is."""
    kernels = REFERENCE if kernels is None else kernels
    return kernels if kernels.platform is not None else kernels.resolve()


def stack_context(tokens_BT, cfg: ModelConfig, kernels: Kernels, *, positions_BT=None, segment_ids_BT=None,
                  window=None) -> Context:
    """The ``Context`` one forward over whole windows shares: positions (default 0 … T−1), the reference path's
    mask (built once when that path runs), segment ids, the input ids, the warmed-up window (``training_window``)."""
    b, t = tokens_BT.shape
    if positions_BT is None:
        positions_BT = jnp.broadcast_to(jnp.arange(t), (b, t))
    mask_BTS = None
    if attention_path(kernels, t) == "xla" and cfg.attention:  # built once, shared by every layer
        mask_BTS = (causal_mask if cfg.causal else document_mask)(segment_ids_BT, b, t)
    return Context(positions_BT, mask_BTS, segment_ids_BT, kernels=kernels, tokens_BT=tokens_BT, window=window)


def hidden_states(params: Params, tokens_BT, cfg: ModelConfig, *, positions_BT=None, segment_ids_BT=None,
                  return_aux: bool = False, remat: str = "none", kernels: Kernels | None = None, window=None,
                  return_ctx: bool = False):
    """H⁽ᴸ⁾ = (B_L ∘ … ∘ B_1)(E[x]) (and, with ``return_aux``, the per-layer MoE loads); ``remat``: run_stack;
    ``kernels``: the execution paths (default the exact reference ones; kernels/__init__.py); ``window``: the
    'local' layers' window in training under a window warmup (``training_window``; None: ``sliding_window``).
    ``return_ctx`` also returns the forward's ``Context`` (the MTP modules reuse it)."""
    ctx = stack_context(tokens_BT, cfg, resolved(kernels), positions_BT=positions_BT, segment_ids_BT=segment_ids_BT,
                        window=window)
    h_BTD, aux = run_stack(embed(params, tokens_BT, cfg), params, cfg, ctx, remat)
    out = (h_BTD, aux) if return_aux else h_BTD
    return (out, ctx) if return_ctx else out


def mtp_hidden(h_BTD, params: Params, targets_BT, cfg: ModelConfig, ctx: Context) -> list[jax.Array]:
    """The hidden states h^1 … h^D of the ``cfg.mtp_depth`` multi-token-prediction modules (DeepSeek-AI 2024,
    "DeepSeek-V3 Technical Report", §2.2): with h^0 = H⁽ᴸ⁾ and module k's arrays,

        h'^k_t = N_h(h^{k−1}_t) W_h + N_e(E[x_{t+k}]) W_e,   h^k = Layer_k(h'^k)

    (the projection M_k [N(h); N(e)] of the paper with M_k = [W_h; W_e]), where x_{t+k} = ``targets_BT[t+k−1]``
    (the input at position t+k) and Layer_k is one layer of the stack's last kinds over the same positions,
    causal mask and documents. Row t of h^k predicts x_{t+k+1} = ``targets_BT[t+k]`` through the shared final
    norm and output head (``logits_from_hidden``). Shifted-in ids past the window's end are 0; their predictions
    are masked out by the loss (``objectives.loss.mtp_targets``)."""
    kinds = layout.mtp_kinds(cfg)
    mtp = params["mtp"]["blocks"]
    t = targets_BT.shape[1]
    out, h_k = [], h_BTD
    for k in range(1, cfg.mtp_depth + 1):
        layer = jax.tree.map(lambda a: a[k - 1], mtp)
        ids_BT = jnp.pad(targets_BT[:, k - 1:], ((0, 0), (0, k - 1))) if k > 1 else targets_BT
        e_BTD = embed(params, ids_BT[:, :t], cfg)
        mixed_BTD = (dense(norm(h_k, layer["mtp_h_norm"], cfg), layer["mtp_h_proj"])
                     + dense(norm(e_BTD, layer["mtp_e_norm"], cfg), layer["mtp_e_proj"]))
        h_k, _ = apply_layer(mixed_BTD, layer, kinds, cfg, ctx._replace(tokens_BT=ids_BT))
        out.append(h_k)
    return out


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
