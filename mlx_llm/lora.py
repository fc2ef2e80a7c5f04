"""LoRA: low-rank adapters beside frozen weights (U19 §10, Hu et al. 2021; M20 §16: "LoRA changes the
parameterization of selected matrices").

A target matrix W₀ (d_in × d_out as the model multiplies it, x·W) is used as W = W₀ + (α/r)·A·B with A (d_in × r)
random (N(0, 1/d_in)) and B (r × d_out) zero at initialisation, so the adapted model starts exactly at the base
model. Only A and B are trained: ``adapted(base, adapters, ...)`` builds the weights the forward uses, and a
loss written as a function of the adapters alone never differentiates the base (its gradient is not even
formed). A rank-r adapter holds r(d_in + d_out) numbers (2dr for a square matrix: 65,536 instead of 16,777,216
at d = 4,096, r = 8), and ΔW = A·B has rank ≤ r.

Adapters mirror the parameter layout (DESIGN §1, "Post-training"): ``{"blocks": {target: {"A", "B"}}}`` with a
leading L axis for a uniform stack (or a list of P such dicts for a mixed one, entry j for the layers of kind
j, only where that layer kind has the target). Weights with several output axes (``wq`` (d, h, d_h)) are
adapted as their (d_in, ∏ out) matrix; ``wo`` (h, d_h, d) as its (h·d_h, d) matrix.
``merge`` writes W₀ + (α/r)·A·B into a plain parameter tree (a normal run, no adapters).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from mlx_llm.config import DEFAULT_LORA_TARGETS, LoRAConfig  # noqa: F401 (the adapters' config)
from mlx_llm.errors import ConfigError
from mlx_llm.layers import layout

# target → number of leading (input) axes of the per-layer weight; the rest are output axes (the ``lora_in``
# of each declaration in ``layers.layout``: wq wk wv wo, w_gate w_up w_down, in_x in_z out_proj)
TARGETS = layout.lora_targets()
def _groups(blocks):
    return blocks if isinstance(blocks, list) else [blocks]


def _as_matrix_shape(key: str, shape) -> tuple[int, int]:
    """(d_in, d_out) of one layer's weight ``shape`` (no L axis)."""
    n_in = TARGETS[key]
    return int(np.prod(shape[:n_in])), int(np.prod(shape[n_in:]))


def init(params, lora: LoRAConfig, key) -> dict:
    """Adapters for every target present in ``params["blocks"]``: A ∼ N(0, 1/d_in), B = 0, float32.
    Refuses targets that no layer has."""
    groups, out, found = _groups(params["blocks"]), [], set()
    keys = iter(jax.random.split(key, len(lora.targets) * len(groups)))
    for group in groups:
        entry = {}
        for t in lora.targets:
            k = next(keys)
            if t not in group:
                continue
            found.add(t)
            n_layers = group[t].shape[0]
            d_in, d_out = _as_matrix_shape(t, group[t].shape[1:])
            entry[t] = {"A": jax.random.normal(k, (n_layers, d_in, lora.rank), jnp.float32) / math.sqrt(d_in),
                        "B": jnp.zeros((n_layers, lora.rank, d_out), jnp.float32)}
        out.append(entry)
    missing = [t for t in lora.targets if t not in found]
    if missing:
        raise ConfigError(f"LoRA targets {missing} are not weights of this model (its layers have "
                          f"{sorted(set().union(*(g.keys() for g in groups)))})")
    return {"blocks": out if isinstance(params["blocks"], list) else out[0]}


def delta(a, b, scale: float):
    """(α/r)·A·B for stacked (L, d_in, r) and (L, r, d_out) factors (or single matrices)."""
    return scale * jnp.matmul(a, b)


def adapted(base, adapters, lora: LoRAConfig):
    """The parameters the forward uses: W₀ + (α/r)·A·B for every adapted weight (in W₀'s dtype and shape), the
    base elsewhere. Differentiable in ``adapters``; call it inside the loss so the base stays constant."""
    base_groups, ad_groups = _groups(base["blocks"]), _groups(adapters["blocks"])
    new_groups = []
    for group, ad in zip(base_groups, ad_groups):
        group = dict(group)
        for t, f in ad.items():
            w = group[t]
            group[t] = w + delta(f["A"], f["B"], lora.scale).reshape(w.shape).astype(w.dtype)
        new_groups.append(group)
    return {**base, "blocks": new_groups if isinstance(base["blocks"], list) else new_groups[0]}


@functools.lru_cache(maxsize=16)
def model_of(lora: LoRAConfig):
    """(adapters, base) → the parameters the forward uses (``adapted``): LoRA as a trainability filter of a loss
    (``train.step.lm_objective``'s ``model_of``), so the step and the loop never hear of adapters. One function
    per config (a key of the kept compiled steps, ``train.step.compiled_steps``)."""
    return lambda adapters, base: adapted(base, adapters, lora)


def merge(base, adapters, lora: LoRAConfig):
    """A plain parameter tree with the adapters folded in (``adapted``, materialised): a normal run's params."""
    return jax.tree.map(jnp.asarray, adapted(base, adapters, lora))


def param_count(adapters) -> int:
    """Trainable numbers of the adapters: Σ r(d_in + d_out) over targets and layers."""
    return int(sum(np.prod(a.shape) for a in jax.tree.leaves(adapters)))
