"""What a mixer kind needs carried from one decoding call to the next, declared by the mixer (DESIGN §8).

A mixer module's ``state_spec(cfg, kind)`` returns one of these declarations; ``decode/`` allocates the storage
that serves it and hands the layer a *view* of it (``decode/cache.py``), so the layout of the cache — contiguous
slots, a ring, pages — is decode's business and a layer never indexes cache arrays:

- ``KVSpec``: the layer attends. It keeps G key/value heads of width K for every processed position (all of them,
  or only the last ``window``). Its view offers ``attend(q, k, v, cap=…)``: write this call's keys and values,
  then let each new query read what the view holds, and return (O, the updated view).
- ``SlotSpec``: the layer carries a fixed-size state per sequence (a recurrent mixer: Mamba's conv window and SSM
  state), whatever the prefix length. ``init(batch, dtype)`` returns one layer's empty state (a tuple of arrays with
  batch on axis 0); the view offers ``read()``, ``write(*arrays)`` and ``n_new_B`` (the real new tokens per row).
"""

from __future__ import annotations

import dataclasses
from typing import Callable


@dataclasses.dataclass(frozen=True)
class KVSpec:
    """Keys and values of ``heads`` key/value heads of width ``width`` per position; ``window`` W: only the last W
    positions are ever read again (sliding-window attention), None: every earlier position is."""

    heads: int
    width: int
    window: int | None = None


@dataclasses.dataclass(frozen=True)
class SlotSpec:
    """A fixed-size state per sequence: ``init(batch, dtype)`` gives one layer's empty state (arrays, batch on
    axis 0, each in the dtype the mixer chooses for it)."""

    init: Callable
