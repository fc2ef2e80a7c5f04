"""The decode state (M20 §14, §19; U19 §6): allocation and the cached forward pass (bytes: ``accounting``).

One ``DecodeState`` carries what every layer needs to continue a prefix, one store per mixer kind, stacked over
the layers of that kind in stack order. Each mixer declares what it carries (its ``state_spec``:
``layers/state_spec.py``) and decode/ allocates the store that serves it (``decode/cache.py``):
- attention layers: the rotated keys K̃ and the unrotated values 𝖵 of every processed position (M20 §14's
  convention), for the h_kv key/value heads only (GQA, M20 §6), preallocated to ``max_len`` slots; slot s of
  row b holds absolute position s;
- sliding-window ("local") attention layers: a ring buffer of ``sliding_window`` slots: position p lives in
  slot p mod W, so the state stops growing once the prefix is longer than the window;
- Mamba layers: the conv window (the last W−1 conv inputs) and the SSM state (I, N), constant in the prefix.
``lengths[b]`` counts the positions row b has processed, so rows of a batch may hold prefixes of different
lengths.

``forward_cached`` is the prefill and the decode step alike: it computes the mixers' inputs for the new positions
only and hands each layer a view of its store (``MIXERS[kind].decode_branch``): the view writes the new keys and
values (or state) and lets each new query read what it holds. No mixer kind is named here: a new kind that
declares its state adds no line to this module.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from mlx_llm.config import ModelConfig
from mlx_llm.decode import cache as cache_lib
from mlx_llm.errors import InputError
from mlx_llm.model import (FFNS, MIXERS, Context, Params, check_tokens, embed, layer_list, logits_from_hidden,
                           resolved)

from mlx_llm.scaling.accounting import kv_cache_bytes  # noqa: F401  (re-exported: U19 §6's 2·L·t·h_kv·d_h·bytes)


@flax.struct.dataclass
class DecodeState:
    """The state of every layer after ``lengths[b]`` positions of row b.

    stores: mixer kind → its store (``decode/cache.py``), every array of it stacked over the layers of that kind
    with batch on axis 1 (``reorder_rows``) — a paged store's pool has no batch axis: its rows are the page table's.
    lengths: (B,) int32. ``max_len`` bounds the positions the state serves (a ring or a recurrent state holds
    fewer). page_table: (B, n) int32 when the full-attention layers are paged (``init_cache(pages=…)``), else None.

    ``k``/``v`` (L_attn, B, S, G, K), ``k_ring``/``v_ring`` (L_local, B, W, G, K) and ``conv`` (L_mamba, B, W−1, I) /
    ``ssm`` (L_mamba, B, I, N) read the first store of each type (``store_of``; None, or no layers for ``k``/``v``,
    when there is none): what tests and benchmarks inspect.
    """

    stores: dict
    lengths: jax.Array
    max_len: int = flax.struct.field(pytree_node=False)
    page_table: jax.Array | None = None  # (B, n) int32 with paged full-attention layers: row b's pages in order

    def store_of(self, store_type) -> object | None:
        """The first store of type ``store_type`` (``cache.KVCache``, ``cache.RingCache``, ``cache.SlotState``),
        in stack order, or None."""
        return next((s for s in self.stores.values() if isinstance(s, store_type)), None)

    @property
    def k(self) -> jax.Array:
        return self._kv().k

    @property
    def v(self) -> jax.Array:
        return self._kv().v

    def _kv(self) -> cache_lib.KVCache:
        found = self.store_of(cache_lib.KVCache)
        if found is None:  # no full-attention layer: a stack of zero layers
            empty = jnp.zeros((0, self.lengths.shape[0], self.max_len, 1, 1))
            return cache_lib.KVCache(k=empty, v=empty)
        return found

    @property
    def k_ring(self) -> jax.Array | None:
        ring = self.store_of(cache_lib.RingCache)
        return None if ring is None else ring.k

    @property
    def v_ring(self) -> jax.Array | None:
        ring = self.store_of(cache_lib.RingCache)
        return None if ring is None else ring.v

    @property
    def conv(self) -> jax.Array | None:
        slots = self.store_of(cache_lib.SlotState)
        return None if slots is None else slots.arrays[0]

    @property
    def ssm(self) -> jax.Array | None:
        slots = self.store_of(cache_lib.SlotState)
        return None if slots is None else slots.arrays[1]


def _layers_of(cfg: ModelConfig, kind: str) -> list[int]:
    return [l for l in range(cfg.n_layers) if cfg.layer_kinds(l)[0] == kind]


def mixer_kinds(cfg: ModelConfig) -> list[str]:
    """The mixer kinds of the stack, in the order they first appear."""
    return list(dict.fromkeys(cfg.layer_kinds(l)[0] for l in range(cfg.n_layers)))


def kind_index(cfg: ModelConfig) -> list[int]:
    """For each layer, its index among the layers of its mixer kind (its row in that kind's store)."""
    seen: dict[str, int] = {}
    out = []
    for l in range(cfg.n_layers):
        kind = cfg.layer_kinds(l)[0]
        out.append(seen.get(kind, 0))
        seen[kind] = out[-1] + 1
    return out


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32,
               pages: cache_lib.Pages | None = None) -> DecodeState:
    """An empty decode state: zeros (K/V are never read before written; zero conv window and SSM state are
    the padding before the first token) and lengths 0. Each mixer kind's store is what its ``state_spec``
    declares (``cache.allocate``). ``pages``: the full-attention layers keep their keys and values in that pool,
    and each row gets a page table of ⌈max_len / page size⌉ entries, all the padding page until pages are
    assigned (``assign_pages``)."""
    for name, value in (("batch", batch), ("max_len", max_len)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise InputError(f"init_cache: {name} = {value!r} is invalid: it must be a positive integer")
    stores = {kind: cache_lib.allocate(MIXERS[kind].state_spec(cfg, kind), len(_layers_of(cfg, kind)), batch,
                                       max_len, dtype, pages) for kind in mixer_kinds(cfg)}
    paged = any(isinstance(s, cache_lib.PagedKVCache) for s in stores.values())
    table = jnp.full((batch, -(-max_len // pages.size)), cache_lib.PADDING_PAGE, jnp.int32) if paged else None
    return DecodeState(lengths=jnp.zeros((batch,), jnp.int32), stores=stores, max_len=int(max_len), page_table=table)


def assign_pages(state: DecodeState, page_table) -> DecodeState:
    """The state with the page table ``page_table`` (B, n): row b's position p lives in page ``page_table[b, p //
    page size]``. Checked on the host: integers in [1, pages) (page 0 is the padding page) where a row will hold
    positions; two rows may share a page only for a prefix they both hold (the caller's promise)."""
    if state.page_table is None:
        raise InputError("assign_pages: this state has no paged layers (init_cache(..., pages=Pages(...)))")
    table = np.asarray(page_table)
    count = next(s for s in state.stores.values() if isinstance(s, cache_lib.PagedKVCache)).kv.shape[1]
    if table.shape != state.page_table.shape or not np.issubdtype(table.dtype, np.integer):
        raise InputError(f"assign_pages: page_table must be integers of shape {state.page_table.shape}; got "
                         f"{table.dtype} {table.shape}")
    if (table < 0).any() or (table >= count).any():
        raise InputError(f"assign_pages: page ids must be in [0, {count}); got {int(table.min())} … {int(table.max())}")
    return state.replace(page_table=jnp.asarray(table, jnp.int32))


def reorder_rows(state: DecodeState, rows) -> DecodeState:
    """The state of rows ``rows`` (a gather along the batch axis of every array: beam search, repeats)."""
    if state.page_table is not None:
        raise InputError("reorder_rows: a paged state's rows are its page table; share or copy pages instead")
    return state.replace(stores=jax.tree.map(lambda a: a[:, rows], state.stores), lengths=state.lengths[rows])


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


def _cached_layer(h_BTD, stores, layer, kinds, i, cfg: ModelConfig, ctx: Context, call: cache_lib.Call):
    """One layer on the new positions; ``i`` is its row in its mixer kind's store, which it reads and writes
    through a view (Mamba rows stop at their last real token). Returns (H', stores)."""
    view = stores[kinds[0]].view(i, call)
    h_BTD, view = MIXERS[kinds[0]].decode_branch(h_BTD, layer, cfg, ctx, view, kinds[0])
    stores = {**stores, kinds[0]: view.store}
    if kinds[1] == "moe":  # routing is per token, so an MoE FFN decodes exactly like a dense one
        h_BTD, _ = FFNS["moe"].branch(h_BTD, layer, cfg, impl=ctx.kernels.moe_impl, interpret=ctx.kernels.interpret)
    elif kinds[1] != "none":
        h_BTD, _ = FFNS[kinds[1]].branch(h_BTD, layer, cfg, kinds[1])
    return h_BTD, stores


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
    kernels = resolved(kernels)
    call = cache_lib.call_of(cache.stores, cache.lengths, n_new_B, t, cache.max_len, fresh=fresh, kernels=kernels,
                             page_table_BN=cache.page_table)
    positions_BT = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    ctx = Context(positions_BT, None, kernels=kernels, tokens_BT=tokens_BT)
    h_BTD, stores = embed(params, tokens_BT, cfg), cache.stores
    index = kind_index(cfg)
    if cfg.unet_skips and layers is None:  # the skips pair layers across the stack: run them one by one
        layers = unstack_layers(params, cfg)
    if layers is not None:
        half, outs = cfg.n_layers // 2, []
        for l, layer in enumerate(layers):
            if cfg.unet_skips and l >= half:  # H + w_{l−U}·H_{L−1−l} (model._unet_stack)
                h_BTD = h_BTD + params["skip_weights"][l - half].astype(h_BTD.dtype) * outs[cfg.n_layers - 1 - l]
            h_BTD, stores = _cached_layer(h_BTD, stores, layer, cfg.layer_kinds(l), index[l], cfg, ctx, call)
            if (l + 1) % cfg.period == 0:
                # rounded where the scan's carry is (and the trainer's): XLA may otherwise keep a bfloat16 residual
                # stream in float32 across groups, and the logits then differ from the trainer's by rounding
                h_BTD = jax.lax.optimization_barrier(h_BTD)
            outs.append(h_BTD)
    else:
        per_period = {kind: sum(k[0] == kind for k in cfg.group_kinds) for kind in stores}

        def step(carry, xs):
            h_BTD, stores = carry
            group, g = xs
            layers_of_group = [group] if cfg.uniform else group
            for j, (layer, kinds) in enumerate(zip(layers_of_group, cfg.group_kinds)):
                # layer g·P + j is row g·(its kind's layers per period) + (its rank among them in the period)
                h_BTD, stores = _cached_layer(h_BTD, stores, layer, kinds, g * per_period[kinds[0]] + index[j], cfg,
                                              ctx, call)
            return (h_BTD, stores), None

        n_groups = jnp.arange(cfg.n_layers // cfg.period, dtype=jnp.int32)
        (h_BTD, stores), _ = jax.lax.scan(step, (h_BTD, stores), (params["blocks"], n_groups))
    return logits_from_hidden(h_BTD, params, cfg), cache.replace(stores=stores, lengths=cache.lengths + n_new_B)
