"""Per-layer RMS of the parameters, gradients and updates, computed inside the jitted training step.

Why: a loss that starts to rise (or spikes and diverges) is diagnosed by *where* it began: which layer's
update or gradient RMS grew first, and whether a weight's RMS drifted (attention logit growth shows as rising
``wq``/``wk`` norms; output-logit divergence as a growing ``unembed``). Wortsman et al. 2023, "Small-scale
proxies for large-scale Transformer training instabilities", diagnose instabilities from exactly such per-layer
norms. A global gradient norm hides this: one layer's blow-up is averaged away by the rest.

The statistics are a handful of reductions (one sum of squares per leaf, shared by the leaf's own RMS and its
layer's pooled RMS), so they cost nothing next to the step and return with its other metrics: no host round
trip. ``as_row`` turns them into JSON-ready numbers for metrics.jsonl on the host.

Layout (DESIGN §1): a uniform stack's ``blocks`` is one dict stacked over the layer axis; a mixed stack's is a
list of P dicts, entry j holding layers j, j+P, j+2P, … stacked over L/P. Every per-layer value here is in
LAYER order (entry rows interleaved back), over the layers that have the leaf. Routing state (MoE balancing
offsets, ``optim.ROUTING_STATE_KEYS``) is not θ and is left out everywhere.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from mlx_llm.train.masks import ROUTING_STATE_KEYS


def _accumulator(x) -> jax.Array:
    """``x`` in float32, or in its own dtype where that is wider (float64 stays float64; bfloat16 widens)."""
    x = jnp.asarray(x)
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _put(out: dict, key: str, value) -> None:
    if key in out:
        raise ValueError(f"watch.layer_rms: two statistics would both be named {key!r}")
    out[key] = value


def _entry_leaves(node, path: tuple[str, ...] = ()):
    """(path inside a block, leaf) for every leaf of one block entry, routing state excluded."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k not in ROUTING_STATE_KEYS:
                yield from _entry_leaves(v, path + (str(k),))
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            yield from _entry_leaves(v, path + (str(i),))
    elif node is not None:
        yield "/".join(path), node


def _blocks_rms(blocks, prefix: str, n_layers: int, out: dict) -> None:
    """Per-layer RMS of every leaf of ``blocks`` and of each layer as a whole, in layer order."""
    entries = list(blocks) if isinstance(blocks, (list, tuple)) else [blocks]
    period = len(entries)
    if period == 0 or n_layers % period:
        raise ValueError(f"watch.layer_rms: n_layers = {n_layers} is not a multiple of the {period} block entries")
    rows = n_layers // period
    per_key: dict[str, list[tuple[int, jax.Array]]] = {}  # key → (entry j, per-row mean of squares)
    pooled_ss: list = [None] * period  # per entry: Σ x² per row over all its leaves
    pooled_n = [0] * period  # per entry: scalars per row over all its leaves
    for j, entry in enumerate(entries):
        for key, leaf in _entry_leaves(entry):
            if leaf.ndim == 0 or leaf.shape[0] != rows:
                raise ValueError(f"watch.layer_rms: {prefix}{key} has shape {leaf.shape}, not {rows} stacked "
                                 f"layers ({n_layers} layers in {period} block entries)")
            count = math.prod(leaf.shape[1:])
            if count == 0:  # nothing to measure (a zero-size array)
                continue
            ss = jnp.sum(jnp.square(_accumulator(leaf)).reshape(rows, count), axis=1)
            per_key.setdefault(key, []).append((j, ss / count))
            pooled_ss[j] = ss if pooled_ss[j] is None else pooled_ss[j] + ss
            pooled_n[j] += count
    for key, parts in per_key.items():
        values = jnp.sqrt(jnp.concatenate([ms for _, ms in parts]))
        if len(parts) > 1:  # entry j's row r is layer j + P·r: a static permutation into layer order
            layer_of = np.concatenate([j + period * np.arange(rows) for j, _ in parts])
            values = values[np.argsort(layer_of, kind="stable")]
        _put(out, prefix + key, values)
    # A layer without any leaf (a LoRA tree that adapts no weight of that layer kind) reads 0.
    per_entry = [jnp.zeros(rows, jnp.float32) if n == 0 else jnp.sqrt(ss / n) for ss, n in zip(pooled_ss, pooled_n)]
    _put(out, prefix + "layer", jnp.stack(per_entry, axis=1).reshape(n_layers))


def _walk(node, path: tuple[str, ...], n_layers: int, out: dict) -> None:
    if isinstance(node, dict):
        for k, v in node.items():
            if k in ROUTING_STATE_KEYS:
                continue
            if k == "blocks":  # the MTP modules (``mtp/blocks``) are stacked over their depth D, not over L
                depth = path[-1:] == ("mtp",)
                n = jax.tree.leaves(v)[0].shape[0] if depth and jax.tree.leaves(v) else n_layers
                _blocks_rms(v, "".join(p + "/" for p in path), n, out)
            else:
                _walk(v, path + (str(k),), n_layers, out)
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            _walk(v, path + (str(i),), n_layers, out)
    elif node is not None:
        _put(out, "/".join(path), jnp.sqrt(jnp.mean(jnp.square(_accumulator(node)))))


def layer_rms(tree, n_layers: int) -> dict[str, jax.Array]:
    """RMS = √mean(x²) of a parameter-shaped tree (parameters, gradients or updates), as a flat dict.

    - every leaf under a ``blocks`` subtree (at any depth: a wrapped model's path outside ``blocks`` is a
      prefix, e.g. "policy/"): prefix + the leaf's path inside a block ("wq", LoRA "wq/A") → (n,) RMS per
      layer, in layer order, over the n layers that have the leaf (all L for a uniform stack; only the
      attention layers for ``wq`` in an attention/Mamba stack);
    - prefix + "layer" → (L,) RMS over all trainable scalars of each layer pooled (√(Σx² / Σcount)); a layer
      with no leaf at all reads 0;
    - every other leaf (``embed``, ``unembed``, ``final_norm``, heads): its path joined by "/" → scalar RMS;
    - the MTP modules' ``mtp/blocks`` like the stack's, per module (D of them) instead of per layer.

    Routing state is excluded throughout. Computed in float32, or the leaf's dtype if wider. Traceable under
    ``jax.jit`` (only shapes decide the structure); ``n_layers`` must be static.
    """
    out: dict[str, jax.Array] = {}
    _walk(tree, (), n_layers, out)
    return out


def watch_stats(params, grads, updates, n_layers: int) -> dict[str, dict[str, jax.Array]]:
    """The per-layer RMS of the parameters, their gradients and the optimizer's updates, for one step: a rising
    loss is traced to the layer whose gradient or update RMS grew, relative to its parameter RMS."""
    return {"param_rms": layer_rms(params, n_layers), "grad_rms": layer_rms(grads, n_layers),
            "update_rms": layer_rms(updates, n_layers)}


def _python(value):
    if isinstance(value, dict):
        return {k: _python(v) for k, v in value.items()}
    array = np.asarray(value, dtype=np.float64)
    return float(array) if array.ndim == 0 else array.tolist()


def as_row(stats) -> dict:
    """Host side: ``stats`` (e.g. ``watch_stats``'s) with the same nesting, every array a Python float or a list
    of floats, ready for ``json.dumps`` into metrics.jsonl. Non-finite values stay (json writes NaN/Infinity):
    the step where a statistic became non-finite is the one to see."""
    return _python(jax.device_get(stats))
