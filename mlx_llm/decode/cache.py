"""The storage behind the decode state and the views a layer gets of it (DESIGN §8: the engine owns the cache).

A mixer declares what it carries (``layers/state_spec.py``); this module allocates a store for it, stacked over
the layers of that mixer kind, and gives each layer of one cached call a *view*: its own row of the store and what
the call's layers share (``Call``). The layer writes and reads through the view and never sees the layout:

- ``KVSpec`` without a window → ``KVCache``: slot s of row b holds absolute position s (``max_len`` slots);
- ``KVSpec`` with a window W → ``RingCache``: W slots, position p in slot p mod W, so the state stops growing once
  the prefix is longer than the window;
- ``KVSpec`` without a window, in a paged state (``Pages``) → ``PagedKVCache``: fixed-size pages of one pool, a
  page table per row (the state's), a reserved padding page;
- ``SlotSpec`` → ``SlotState``: the mixer's own fixed-size arrays per sequence (Mamba: conv window, SSM state).

``allocate`` picks the store by the declaration's type, so a new mixer kind that declares one of
these needs no line here; a new kind of storage (pages) is a new entry.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from mlx_llm.errors import InputError
from mlx_llm.kernels import Kernels
from mlx_llm.kernels import attention as kernel_attention
from mlx_llm.kernels.paged_attention import PADDING_PAGE, paged_attention  # noqa: F401  (re-exported)
from mlx_llm.layers.state_spec import KVSpec, SlotSpec
from mlx_llm.ops import attention


class RingCall(NamedTuple):
    """A cached call through sliding-window layers (``ring_call``): which of the W ring slots and T new positions
    each new query reads (B, T, W + T), and the ring slot each new position is written to (B, T; W = dropped)."""

    mask_BTS: jax.Array
    slots_BT: jax.Array


class Call(NamedTuple):
    """What every layer of one cached call shares: the real new tokens per row (B,), the slot each new position
    of a ``KVCache`` is written to (B, T; ``max_len`` = dropped) and the slots each new query reads (B, T, S);
    ``fresh``: the cache is empty (a prefill), so attention is self-attention over the new tokens by the path
    ``kernels`` names; ``rings``: the ring bookkeeping per window W of the call's ``RingCache`` stores. A paged
    state adds each row's length before the call (B,), its page table (B, n) and, for each new position, the page
    and offset it is written to (B, T; padding: page P, out of range, so dropped)."""

    n_new_B: jax.Array
    slots_BT: jax.Array
    mask_BTS: jax.Array
    fresh: bool
    kernels: Kernels
    rings: dict
    lengths_B: jax.Array | None = None
    page_table_BN: jax.Array | None = None
    page_BT: jax.Array | None = None
    offset_BT: jax.Array | None = None


def ring_call(window: int, lengths_B, n_new_B, t: int) -> RingCall:
    """What every sliding-window layer of one cached call shares (W = ``window``).

    Before the call, ring slot s of row b holds the latest position p < lengths[b] with p ≡ s (mod W),
    p = n − 1 − ((n − 1 − s) mod W) for n = lengths[b] (none when p < 0). New token t at position q = n + t reads
    slot s iff it holds a position p > q − W, and new token t' ≤ t iff t' is real and t − t' < W. Afterwards the
    last min(W, n_new) real new positions are written to slots p mod W (distinct: fewer than W + 1 consecutive
    positions); the others are dropped (slot W, out of range), as their keys have left every later window."""
    w = window
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
    return RingCall(mask_BTS=jnp.concatenate([ring_BTW, new_BTT], axis=-1),
                    slots_BT=jnp.where(kept_BT, jnp.mod(q_BT, w), w))


def call_of(stores: dict, lengths_B, n_new_B, t: int, max_len: int, *, fresh: bool, kernels: Kernels,
            page_table_BN=None) -> Call:
    """The ``Call`` of T new tokens per row (the first ``n_new_B[b]`` of row b real) after ``lengths_B``: new token
    t of row b sits at position lengths[b] + t, is written to that slot when real, and reads slot s iff
    s ≤ lengths[b] + t and s < lengths[b] + n_new_B[b]. With a page table, position p of row b is written to page
    ``page_table[b, p // page_size]`` at offset ``p % page_size``."""
    t_T, s_S = jnp.arange(t, dtype=jnp.int32), jnp.arange(max_len, dtype=jnp.int32)
    positions_BT = lengths_B[:, None] + t_T[None, :]
    mask_BTS = (s_S <= positions_BT[:, :, None]) & (s_S < (lengths_B + n_new_B)[:, None, None])
    real_BT = t_T[None, :] < n_new_B[:, None]
    slots_BT = jnp.where(real_BT, positions_BT, max_len)
    windows = {s.window for s in stores.values() if isinstance(s, RingCache)}
    rings = {w: ring_call(w, lengths_B, n_new_B, t) for w in sorted(windows)}
    paged = [s for s in stores.values() if isinstance(s, PagedKVCache)]
    if not paged:
        return Call(n_new_B, slots_BT, mask_BTS, fresh, kernels, rings)
    size, n_pages = paged[0].page_size, paged[0].kv.shape[1]
    column_BT = jnp.minimum(positions_BT // size, page_table_BN.shape[1] - 1)
    page_BT = jnp.where(real_BT, jnp.take_along_axis(page_table_BN, column_BT, axis=1), n_pages)
    return Call(n_new_B, slots_BT, mask_BTS, fresh, kernels, rings, lengths_B, page_table_BN, page_BT,
                jnp.mod(positions_BT, size))


def _write(store_LBSGK, l, slots_BT, x_BTGK):
    """Scatter the new positions into layer l of the whole carried buffer (XLA updates a loop carry in place).
    Padding goes to an out-of-range slot and is dropped, so it can never overwrite a valid one."""
    b_B1 = jnp.arange(x_BTGK.shape[0])[:, None]
    return store_LBSGK.at[l, b_B1, slots_BT].set(x_BTGK.astype(store_LBSGK.dtype), mode="drop")


class PerRow:
    """A store whose arrays are (L, B, …), one row per sequence: the engine's row operations."""

    def take_rows(self, rows_R):
        """The store of rows ``rows_R`` (a gather on the batch axis): what one engine call of R rows computes on."""
        return jax.tree.map(lambda a: a[:, rows_R], self)

    def put_rows(self, rows_R, sub):
        """This store with rows ``rows_R`` replaced by ``sub``'s (a row listed twice must carry equal values)."""
        return jax.tree.map(lambda a, b: a.at[:, rows_R].set(b), self, sub)

    def fork(self, src_R, dst_R, src_P, dst_P):
        """Row ``dst_R[i]`` takes row ``src_R[i]``'s state (a reply forked off its prompt); pages are not ours."""
        return self.put_rows(dst_R, self.take_rows(src_R))


# ----- keys and values, one slot per position ---------------------------------------------------------
@flax.struct.dataclass
class KVCache(PerRow):
    """Rotated keys K̃ and unrotated values 𝖵 (M20 §14) of every processed position, (L, B, S, G, K): slot s of
    row b holds position s; slots at or beyond the row's length hold nothing valid and are never read."""

    k: jax.Array
    v: jax.Array

    @classmethod
    def allocate(cls, spec: KVSpec, n_layers: int, batch: int, max_len: int, dtype) -> "KVCache":
        shape = (n_layers, batch, max_len, spec.heads, spec.width)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

    def view(self, l, call: Call) -> "KVView":
        return KVView(self, l, call)


class KVView(NamedTuple):
    """Layer l's view of a ``KVCache`` in one call."""

    store: KVCache
    l: jax.Array | int
    call: Call

    def attend(self, q_BTHK, k_BTGK, v_BTGK, *, cap=None):
        """Write the new K̃/𝖵 into their slots, then each new query reads the slots ``call.mask_BTS`` allows (a
        prefill into an empty cache reads the new tokens only, causally, by the call's attention path)."""
        k_all = _write(self.store.k, self.l, self.call.slots_BT, k_BTGK)
        v_all = _write(self.store.v, self.l, self.call.slots_BT, v_BTGK)
        if self.call.fresh:
            o_BTHK = kernel_attention.attention(q_BTHK, k_BTGK, v_BTGK, None, causal=True, kernels=self.call.kernels,
                                                cap=cap)
        else:
            o_BTHK = attention(q_BTHK, k_all[self.l].astype(q_BTHK.dtype), v_all[self.l].astype(q_BTHK.dtype),
                               self.call.mask_BTS, cap)
        return o_BTHK, self._replace(store=KVCache(k=k_all, v=v_all))


# ----- keys and values in a ring of W slots -----------------------------------------------------------
@flax.struct.dataclass
class RingCache(PerRow):
    """A sliding-window layer's keys and values, (L, B, W, G, K): position p lives in slot p mod W."""

    k: jax.Array
    v: jax.Array

    @property
    def window(self) -> int:
        return self.k.shape[2]

    @classmethod
    def allocate(cls, spec: KVSpec, n_layers: int, batch: int, max_len: int, dtype) -> "RingCache":
        shape = (n_layers, batch, spec.window, spec.heads, spec.width)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

    def view(self, l, call: Call) -> "RingView":
        return RingView(self, l, call)


class RingView(NamedTuple):
    """Layer l's view of a ``RingCache`` in one call."""

    store: RingCache
    l: jax.Array | int
    call: Call

    def attend(self, q_BTHK, k_BTGK, v_BTGK, *, cap=None):
        """Each new query reads the ring (older positions) and the new positions its window allows; then the new
        positions later windows still need are written into their slots. O(W) per token, whatever the prefix."""
        w = self.store.window
        ring = self.call.rings[w]
        if self.call.fresh:  # a prefill into an empty cache: the ring holds nothing yet
            o_BTHK = kernel_attention.attention(q_BTHK, k_BTGK, v_BTGK, None, causal=True, kernels=self.call.kernels,
                                                window=w, cap=cap)
        else:
            keys = jnp.concatenate([self.store.k[self.l].astype(q_BTHK.dtype), k_BTGK], axis=1)
            values = jnp.concatenate([self.store.v[self.l].astype(q_BTHK.dtype), v_BTGK], axis=1)
            o_BTHK = attention(q_BTHK, keys, values, ring.mask_BTS, cap)
        store = RingCache(k=_write(self.store.k, self.l, ring.slots_BT, k_BTGK),
                          v=_write(self.store.v, self.l, ring.slots_BT, v_BTGK))
        return o_BTHK, self._replace(store=store)


# ----- keys and values in pages of one pool -----------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Pages:
    """A paged KV pool: ``count`` pages of ``size`` positions each, shared by every sequence of the state; page
    ``PADDING_PAGE`` (0) is reserved (unused page-table entries point to it; it holds no position)."""

    count: int
    size: int

    def __post_init__(self) -> None:
        for name, value, low in (("count", self.count, 2), ("size", self.size, 1)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise InputError(f"Pages.{name} = {value!r} is invalid: it must be an integer ≥ {low}"
                                 + (" (page 0 is the padding page)" if name == "count" else ""))


@flax.struct.dataclass
class PagedKVCache:
    """Full-attention layers' keys and values in pages: (L, P, page_size, 2·G, K), key head g at 2g and value head g
    at 2g + 1 (the layout of the TPU kernel, ``kernels/paged_attention.py``). Which pages hold a row's positions is
    the state's page table, shared by every paged layer."""

    kv: jax.Array

    @property
    def page_size(self) -> int:
        return self.kv.shape[2]

    @classmethod
    def allocate(cls, spec: KVSpec, n_layers: int, pages: Pages, dtype) -> "PagedKVCache":
        return cls(kv=jnp.zeros((n_layers, pages.count, pages.size, 2 * spec.heads, spec.width), dtype))

    def take_rows(self, rows_R) -> "PagedKVCache":
        """The pool itself: its rows are page tables, which the caller gathers."""
        return self

    def put_rows(self, rows_R, sub: "PagedKVCache") -> "PagedKVCache":
        return sub

    def fork(self, src_R, dst_R, src_P, dst_P) -> "PagedKVCache":
        """Page ``dst_P[i]`` takes a copy of page ``src_P[i]`` (a forked reply's own copy of a shared partial page;
        pairs of padding pages copy the padding page onto itself)."""
        return PagedKVCache(kv=self.kv.at[:, dst_P].set(self.kv[:, src_P]))

    def view(self, l, call: Call) -> "PagedView":
        return PagedView(self, l, call)


class PagedView(NamedTuple):
    """Layer l's view of a ``PagedKVCache`` in one call."""

    store: PagedKVCache
    l: jax.Array | int
    call: Call

    def attend(self, q_BTHK, k_BTGK, v_BTGK, *, cap=None):
        """Write the new K̃/𝖵 into their pages, then each new query reads its row's pages (``paged_attention``; a
        prefill into an empty state reads the new tokens only, by the call's attention path)."""
        b, t, g, k = k_BTGK.shape
        kv_BTCK = jnp.stack([k_BTGK, v_BTGK], axis=3).reshape(b, t, 2 * g, k).astype(self.store.kv.dtype)
        kv = self.store.kv.at[self.l, self.call.page_BT, self.call.offset_BT].set(kv_BTCK, mode="drop")
        call = self.call
        if call.fresh:
            o_BTHK = kernel_attention.attention(q_BTHK, k_BTGK, v_BTGK, None, causal=True, kernels=call.kernels,
                                                cap=cap)
        else:
            o_BTHK = paged_attention(q_BTHK, kv[self.l], call.page_table_BN, call.lengths_B, call.n_new_B,
                                     kernels=call.kernels, cap=cap)
        return o_BTHK, self._replace(store=PagedKVCache(kv=kv))


# ----- a fixed-size state per sequence ----------------------------------------------------------------
@flax.struct.dataclass
class SlotState(PerRow):
    """A recurrent mixer's state: the arrays its ``SlotSpec.init`` declares, each stacked to (L, B, …)."""

    arrays: tuple

    @classmethod
    def allocate(cls, spec: SlotSpec, n_layers: int, batch: int, max_len: int, dtype) -> "SlotState":
        one = spec.init(batch, dtype)
        return cls(arrays=tuple(jnp.broadcast_to(a, (n_layers, *a.shape)) for a in one))

    def view(self, l, call: Call) -> "SlotView":
        return SlotView(self, l, call)


class SlotView(NamedTuple):
    """Layer l's view of a ``SlotState`` in one call: its state, and how many of the new tokens are real."""

    store: SlotState
    l: jax.Array | int
    call: Call

    @property
    def n_new_B(self) -> jax.Array:
        return self.call.n_new_B

    def read(self) -> tuple:
        return tuple(a[self.l] for a in self.store.arrays)

    def write(self, *arrays) -> "SlotView":
        new = tuple(a.at[self.l].set(x.astype(a.dtype)) for a, x in zip(self.store.arrays, arrays, strict=True))
        return self._replace(store=SlotState(arrays=new))


def allocate(spec, n_layers: int, batch: int, max_len: int, dtype, pages: Pages | None = None):
    """The store that serves ``spec`` for ``n_layers`` layers: full attention in ``pages`` when given."""
    if isinstance(spec, KVSpec) and spec.window is None and pages is not None:
        return PagedKVCache.allocate(spec, n_layers, pages, dtype)
    if isinstance(spec, KVSpec):
        store = KVCache if spec.window is None else RingCache
    elif isinstance(spec, SlotSpec):
        store = SlotState
    else:
        raise TypeError(f"no decode storage for the state declaration {spec!r}")
    return store.allocate(spec, n_layers, batch, max_len, dtype)
