"""The decode state (M20 §14, §19; U19 §6): allocation and the cached forward pass (bytes: ``accounting``).

One ``DecodeState`` carries what every layer needs to continue a prefix:
- attention layers: the rotated keys K̃ and the unrotated values 𝖵 of every processed position (M20 §14's
  convention), for the h_kv key/value heads only (GQA, M20 §6), preallocated to ``max_len`` slots; slot s of
  row b holds absolute position s;
- sliding-window ("local") attention layers: a ring buffer of ``sliding_window`` slots: position p lives in
  slot p mod W, so the state stops growing once the prefix is longer than the window;
- Mamba layers: the conv window (the last W−1 conv inputs) and the SSM state (I, N), constant in the prefix.
``lengths[b]`` counts the positions row b has processed, so rows of a batch may hold prefixes of different
lengths. Each kind's arrays are stacked over the layers of that kind, in stack order.

``forward_cached`` is the prefill and the decode step alike: it computes Q/K/V for the new positions only,
writes their K/V into the slots ``lengths[b] + t`` and lets each new query read every allowed slot.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from mlx_llm.config import ModelConfig
from mlx_llm.errors import InputError
from mlx_llm.layers import attention, mamba
from mlx_llm.model import (FFNS, Context, Params, RingContext, check_tokens, embed, layer_list, logits_from_hidden,
                           resolved)

from mlx_llm.scaling.accounting import kv_cache_bytes  # noqa: F401  (re-exported: U19 §6's 2·L·t·h_kv·d_h·bytes)


@flax.struct.dataclass
class DecodeState:
    """The state of every layer after ``lengths[b]`` positions of row b.

    k, v: (L_attn, B, S, G, K) — attention layers, batch, slots, key/value heads, head width (slots at or beyond
    ``lengths[b]`` hold no valid position and are never read; zero layers without attention). conv:
    (L_mamba, B, W−1, I), ssm: (L_mamba, B, I, N), None without Mamba layers. k_ring, v_ring: (L_local, B, W, G,
    K), None without sliding-window layers. lengths: (B,) int32. Every array but lengths has batch on axis 1
    (``reorder_rows``). ``max_len`` bounds the positions the state serves (the ring buffers do not).
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array
    conv: jax.Array | None = None
    ssm: jax.Array | None = None
    k_ring: jax.Array | None = None  # (L_local, B, W, G, K): sliding-window layers, slot = position mod W
    v_ring: jax.Array | None = None

    @property
    def max_len(self) -> int:
        return self.k.shape[2]




def _layers_of(cfg: ModelConfig, kind: str) -> list[int]:
    return [l for l in range(cfg.n_layers) if cfg.layer_kinds(l)[0] == kind]


def kind_index(cfg: ModelConfig) -> list[int]:
    """For each layer, its index among the layers of its mixer kind (its row in k/v or in conv/ssm)."""
    seen: dict[str, int] = {}
    out = []
    for l in range(cfg.n_layers):
        kind = cfg.layer_kinds(l)[0]
        out.append(seen.get(kind, 0))
        seen[kind] = out[-1] + 1
    return out


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> DecodeState:
    """An empty decode state: zeros (K/V are never read before written; zero conv window and SSM state are
    the padding before the first token) and lengths 0."""
    for name, value in (("batch", batch), ("max_len", max_len)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise InputError(f"init_cache: {name} = {value!r} is invalid: it must be a positive integer")
    n_attn, n_mamba, n_local = (len(_layers_of(cfg, kind)) for kind in ("attn", "mamba", "local"))
    kv_shape = (n_attn, batch, max_len, cfg.n_kv_heads or 1, cfg.d_head or 1)
    conv_BWI, ssm_BIN = mamba.init_state(cfg, batch, dtype) if n_mamba else (None, None)
    stack = lambda a: None if a is None else jnp.broadcast_to(a, (n_mamba, *a.shape))
    ring = (n_local, batch, cfg.sliding_window or 1, cfg.n_kv_heads or 1, cfg.d_head or 1)
    ring_k, ring_v = (jnp.zeros(ring, dtype), jnp.zeros(ring, dtype)) if n_local else (None, None)
    return DecodeState(k=jnp.zeros(kv_shape, dtype), v=jnp.zeros(kv_shape, dtype),
                       lengths=jnp.zeros((batch,), jnp.int32), conv=stack(conv_BWI),
                       ssm=stack(ssm_BIN), k_ring=ring_k, v_ring=ring_v)


def reorder_rows(state: DecodeState, rows) -> DecodeState:
    """The state of rows ``rows`` (a gather along the batch axis of every array: beam search, repeats)."""
    take = lambda a: None if a is None else a[:, rows]
    return state.replace(k=take(state.k), v=take(state.v), conv=take(state.conv), ssm=take(state.ssm),
                         k_ring=take(state.k_ring), v_ring=take(state.v_ring), lengths=state.lengths[rows])


def _check_capacity(cache: DecodeState, n_new_B, t: int) -> None:
    """Reject writes past the last slot before tracing (a clamped write would overwrite valid keys)."""
    if any(isinstance(x, jax.core.Tracer) for x in (cache.lengths, n_new_B)):
        return
    lengths, n_new = np.asarray(cache.lengths), np.asarray(n_new_B)
    if n_new.shape != lengths.shape:
        raise InputError(f"n_new_B has shape {n_new.shape}; expected one count per row, shape {lengths.shape}")
    if (n_new < 0).any() or (n_new > t).any():
        raise InputError(f"n_new_B = {n_new.tolist()} is invalid: each count must be in [0, {t}] (the tokens given)")
    end = lengths + n_new
    if (end > cache.max_len).any():
        b = int(np.argmax(end > cache.max_len))
        raise InputError(
            f"row {b} would hold {int(end[b])} positions ({int(lengths[b])} cached + {int(n_new[b])} new) but the "
            f"cache has only max_len = {cache.max_len} slots; allocate a larger cache"
        )


def _cached_layer(carry, layer, kinds, i, cfg: ModelConfig, ctx: Context, n_new_B):
    """One layer on the new positions; ``i`` is its row among the layers of its mixer kind. Attention writes
    its K̃/𝖵 into the carried cache in place; Mamba advances its conv window and SSM state (rows stop at their
    last real token)."""
    h_BTD, k, v, conv, ssm, k_ring, v_ring = carry
    if kinds[0] == "attn":
        h_BTD, k, v = attention.cached_branch(h_BTD, layer, cfg, ctx, k, v, i)
    elif kinds[0] == "local":
        h_BTD, k_ring, v_ring = attention.ring_branch(h_BTD, layer, cfg, ctx, k_ring, v_ring, i)
    else:
        h_BTD, conv_i, ssm_i = mamba.advance(h_BTD, layer, cfg, conv[i], ssm[i], n_new_B)
        conv, ssm = conv.at[i].set(conv_i), ssm.at[i].set(ssm_i)
    if kinds[1] == "moe":  # routing is per token, so an MoE FFN decodes exactly like a dense one
        h_BTD, _ = FFNS["moe"].branch(h_BTD, layer, cfg, impl=ctx.kernels.moe_impl, interpret=ctx.kernels.interpret)
    elif kinds[1] != "none":
        h_BTD, _ = FFNS[kinds[1]].branch(h_BTD, layer, cfg, kinds[1])
    return h_BTD, k, v, conv, ssm, k_ring, v_ring


def unstack_layers(params: Params, cfg: ModelConfig) -> list[dict]:
    """Each layer's weights as separate arrays, sliced once (outside a decode loop) for ``forward_cached``."""
    return [layer for layer, _ in layer_list(params, cfg)]


def require_causal(cfg: ModelConfig) -> None:
    """Cached next-token decoding exists only for causal models: a bidirectional denoiser (``cfg.causal`` false)
    re-reads the whole changing sequence at every step, so there is no append-only state to carry (M20 §19,
    Figure 6); sample it with ``mlx_llm.decode.diffusion``."""
    if not cfg.causal:
        raise InputError("this model is bidirectional (causal = false): it has no KV cache and no next-token "
                         "decoding; sample it with mlx_llm.decode.diffusion.sample (the CLI does this for a "
                         "diffusion run)")


def ring_context(cfg: ModelConfig, lengths_B, n_new_B, t: int) -> RingContext:
    """What every sliding-window layer of one cached call shares (W = ``cfg.sliding_window``).

    Before the call, ring slot s of row b holds the latest position p < lengths[b] with p ≡ s (mod W),
    p = n − 1 − ((n − 1 − s) mod W) for n = lengths[b] (none when p < 0). New token t at position q = n + t reads
    slot s iff it holds a position p > q − W, and new token t' ≤ t iff t' is real and t − t' < W. Afterwards the
    last min(W, n_new) real new positions are written to slots p mod W (distinct: fewer than W + 1 consecutive
    positions); the others are dropped (slot W, out of range), as their keys have left every later window."""
    w = cfg.sliding_window
    n_B1 = lengths_B[:, None]
    s_W = jnp.arange(w, dtype=jnp.int32)
    t_T = jnp.arange(t, dtype=jnp.int32)
    held_BW = n_B1 - 1 - jnp.mod(n_B1 - 1 - s_W[None, :], w)
    q_BT = n_B1 + t_T[None, :]
    ring_BTW = (held_BW[:, None, :] >= 0) & (held_BW[:, None, :] > q_BT[:, :, None] - w)
    d_TT = t_T[:, None] - t_T[None, :]
    new_BTT = (d_TT >= 0) & (d_TT < w) & (t_T[None, None, :] < n_new_B[:, None, None])
    new_end_B1 = n_B1 + n_new_B[:, None]
    kept_BT = (t_T[None, :] < n_new_B[:, None]) & (q_BT >= new_end_B1 - w)
    return RingContext(mask_BTS=jnp.concatenate([ring_BTW, new_BTT], axis=-1),
                       slots_BT=jnp.where(kept_BT, jnp.mod(q_BT, w), w))


def forward_cached(params: Params, tokens_BT, cache: DecodeState, cfg: ModelConfig, *, n_new_B=None, layers=None,
                   kernels=None, fresh: bool = False):
    """Logits (B, T, V) of the new positions and the cache that includes them (M20 §14).

    Row b's new token t sits at absolute position ``lengths[b] + t`` (after three processed tokens the next
    position is 3, not 0). Only its first ``n_new_B[b]`` tokens (default: all T) are real: they are written
    and become readable; the rest is padding whose logits are meaningless and whose K/V are never read.
    New token t of row b reads slot s iff s ≤ lengths[b] + t and s < lengths[b] + n_new_B[b].

    The blocks run under one ``lax.scan`` over the stacked weights (compile time independent of depth). For a
    decode loop, pass ``layers=unstack_layers(params, cfg)`` computed once outside it: the blocks are then traced
    one by one over separate arrays. XLA:CPU materialises every per-layer slice of a stacked weight before
    its matmul, so under the scan each decode step copies all the weights once more; at batch 1, where a
    step is bound by reading the weights, that copy roughly doubles the step time (experiments/bench_decode.py).

    ``kernels``: the execution paths of the MoE layers and, with ``fresh`` (the cache is empty: a prefill), of the
    attention, which is then self-attention over the new tokens (right padding is never read by a real token).
    """
    require_causal(cfg)
    check_tokens(tokens_BT, cfg)
    tokens_BT = jnp.asarray(tokens_BT)
    b, t = tokens_BT.shape
    n_new_B = jnp.full((b,), t, jnp.int32) if n_new_B is None else jnp.asarray(n_new_B, jnp.int32)
    _check_capacity(cache, n_new_B, t)
    t_T, s_S = jnp.arange(t, dtype=jnp.int32), jnp.arange(cache.max_len, dtype=jnp.int32)
    positions_BT = cache.lengths[:, None] + t_T[None, :]
    new_lengths_B = cache.lengths + n_new_B
    mask_BTS = (s_S <= positions_BT[:, :, None]) & (s_S < new_lengths_B[:, None, None])
    slots_BT = jnp.where(t_T[None, :] < n_new_B[:, None], positions_BT, cache.max_len)

    ring = ring_context(cfg, cache.lengths, n_new_B, t) if cache.k_ring is not None else None
    ctx = Context(positions_BT, None if fresh else mask_BTS, slots_BT=slots_BT, kernels=resolved(kernels), ring=ring,
                  tokens_BT=tokens_BT)
    carry = (embed(params, tokens_BT, cfg), cache.k, cache.v, cache.conv, cache.ssm, cache.k_ring, cache.v_ring)
    index = kind_index(cfg)
    if cfg.unet_skips and layers is None:  # the skips pair layers across the stack: run them one by one
        layers = unstack_layers(params, cfg)
    if layers is not None:
        half, outs = cfg.n_layers // 2, []
        for l, layer in enumerate(layers):
            if cfg.unet_skips and l >= half:  # H + w_{l−U}·H_{L−1−l} (model._unet_stack)
                h_BTD = carry[0] + params["skip_weights"][l - half].astype(carry[0].dtype) * outs[cfg.n_layers - 1 - l]
                carry = (h_BTD, *carry[1:])
            carry = _cached_layer(carry, layer, cfg.layer_kinds(l), index[l], cfg, ctx, n_new_B)
            outs.append(carry[0])
    else:
        per_period = {kind: sum(k[0] == kind for k in cfg.group_kinds) for kind in ("attn", "local", "mamba")}

        def step(carry, xs):
            group, g = xs
            layers_of_group = [group] if cfg.uniform else group
            for j, (layer, kinds) in enumerate(zip(layers_of_group, cfg.group_kinds)):
                # layer g·P + j is row g·(its kind's layers per period) + (its rank among them in the period)
                carry = _cached_layer(carry, layer, kinds, g * per_period[kinds[0]] + index[j], cfg, ctx, n_new_B)
            return carry, None

        n_groups = jnp.arange(cfg.n_layers // cfg.period, dtype=jnp.int32)
        carry, _ = jax.lax.scan(step, carry, (params["blocks"], n_groups))
    h_BTD, k, v, conv, ssm, k_ring, v_ring = carry
    return logits_from_hidden(h_BTD, params, cfg), cache.replace(k=k, v=v, conv=conv, ssm=ssm, k_ring=k_ring,
                                                                  v_ring=v_ring, lengths=new_lengths_B)
