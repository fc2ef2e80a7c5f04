"""The KV cache (M20 §14, U19 §6): allocation and the cached forward pass (byte count: ``accounting``).

The cache keeps, for every layer, the rotated keys K̃ and the unrotated values 𝖵 of every processed position
(M20 §14's convention), for the h_kv key/value heads only (GQA, M20 §6). It is preallocated to ``max_len``
slots; ``lengths[b]`` counts the valid slots of row b, so rows of a batch may hold prefixes of different
lengths. Slot s of row b holds absolute position s.

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
from mlx_llm.layers import attention
from mlx_llm.model import FFNS, Context, Params, check_tokens, embed, layer_list, logits_from_hidden

from mlx_llm.scaling.accounting import kv_cache_bytes  # noqa: F401  (re-exported: U19 §6's 2·L·t·h_kv·d_h·bytes)


@flax.struct.dataclass
class KVCache:
    """Per-layer K̃ and 𝖵 for ``max_len`` slots, and the number of valid slots per row.

    k, v: (L, B, S, G, K) — layers, batch, slots, key/value heads, head width. lengths: (B,) int32.
    Slots at or beyond ``lengths[b]`` hold no valid position and are never read.
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    @property
    def max_len(self) -> int:
        return self.k.shape[2]


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    """An empty cache: zeros for K/V (never read before written) and lengths 0."""
    for name, value in (("batch", batch), ("max_len", max_len)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise InputError(f"init_cache: {name} = {value!r} is invalid: it must be a positive integer")
    shape = (cfg.n_layers, batch, max_len, cfg.n_kv_heads, cfg.d_head)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), lengths=jnp.zeros((batch,), jnp.int32))


def _check_capacity(cache: KVCache, n_new_B, t: int) -> None:
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


def _cached_layer(carry, layer, kinds, l, cfg: ModelConfig, ctx: Context):
    """One layer of the stack on the new positions, its K̃/𝖵 written into the carried cache in place."""
    h_BTD, k_LBSGK, v_LBSGK = carry
    h_BTD, k_LBSGK, v_LBSGK = attention.cached_branch(h_BTD, layer, cfg, ctx, k_LBSGK, v_LBSGK, l)
    if kinds[1] != "none":  # routing is per token, so an MoE FFN decodes exactly like a dense one
        h_BTD, _ = FFNS[kinds[1]].branch(h_BTD, layer, cfg)
    return h_BTD, k_LBSGK, v_LBSGK


def unstack_layers(params: Params, cfg: ModelConfig) -> list[dict]:
    """Each layer's weights as separate arrays, sliced once (outside a decode loop) for ``forward_cached``."""
    return [layer for layer, _ in layer_list(params, cfg)]


def forward_cached(params: Params, tokens_BT, cache: KVCache, cfg: ModelConfig, *, n_new_B=None, layers=None):
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
    """
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

    ctx = Context(positions_BT, mask_BTS, slots_BT=slots_BT)
    carry = (embed(params, tokens_BT), cache.k, cache.v)
    if layers is not None:
        for l, layer in enumerate(layers):
            carry = _cached_layer(carry, layer, cfg.layer_kinds(l), l, cfg, ctx)
    else:
        def step(carry, xs):
            group, g = xs
            if cfg.uniform:
                return _cached_layer(carry, group, cfg.group_kinds[0], g, cfg, ctx), None
            for j, (layer, kinds) in enumerate(zip(group, cfg.group_kinds)):
                carry = _cached_layer(carry, layer, kinds, g * cfg.period + j, cfg, ctx)
            return carry, None

        n_groups = jnp.arange(cfg.n_layers // cfg.period, dtype=jnp.int32)
        carry, _ = jax.lax.scan(step, carry, (params["blocks"], n_groups))
    h_BTD, k, v = carry
    return logits_from_hidden(h_BTD, params, cfg), KVCache(k=k, v=v, lengths=new_lengths_B)
