"""Muon on each layer's matrices, AdamW on everything else, as one optax chain (beside ``optim.make_optimizer``).

Muon (Jordan et al. 2024, "Muon: an optimizer for hidden layers", modded-nanogpt) replaces a matrix's update by
its Nesterov momentum orthogonalised with a quintic Newton–Schulz iteration: U·S'·Vᵀ with S' ≈ I (roughly
0.7–1.2) for the momentum's SVD U·S·Vᵀ, i.e. steepest descent under the spectral norm. Liu et al. 2025 ("Muon
is scalable for LLM training", arXiv:2502.16982) add AdamW-style decoupled weight decay and scale the
orthogonalised update by 0.2·√max(fan_in, fan_out), which gives it the update RMS of AdamW (≈ 0.2), so one
learning rate and one weight decay serve both parameter groups. Muon is defined for the weights of hidden
matrix products only: embeddings, the unembedding, norm gains, biases and Mamba's elementwise parameters keep
AdamW (Jordan et al.: the first and last layers and scalars "should be optimized by a standard method").

Which weight is a matrix, and which of its axes are its inputs, comes from the layout (layers/layout.py), never
from a leaf's rank: a stacked gain is an (L, d) array, yet not a matrix.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import optax
from optax.contrib import MuonDimensionNumbers, scale_by_muon

from mlx_llm.errors import ConfigError
from mlx_llm.layers import layout
from mlx_llm.train import masks

EXPERT_DIMS = ("X", "S")  # a leading routed / shared expert axis: one matrix per expert, orthogonalised alone
STACK = "blocks"  # the subtree whose leaves are stacked over layers (DESIGN §1); Muon touches nothing outside it


def _leaf_dims(path, leaf) -> MuonDimensionNumbers | None:
    """The dimension numbers of one leaf: its layout entry's input axes (``lora_in`` leading per-layer axes,
    else the first) as the reduction axes and the remaining per-layer axes as output axes, all shifted by one
    for the stacked layer axis 0, which with an expert axis stays a batch axis (optax orthogonalises every
    unnamed axis's slices independently). None (AdamW) for anything that is not a layer's matmul weight of
    its declared stacked rank: tops, heads, gains, elementwise and routing-state leaves, LoRA factors."""
    keys = tuple(masks.key_name(e) for e in path)
    info = masks.declared(keys)
    if STACK not in keys or info.role != "matmul" or len(info.dims) < 2:
        return None
    if keys[-1] not in layout.entries() or getattr(leaf, "ndim", None) != len(info.dims) + 1:
        return None  # a LoRA factor (blocks/wq/A) belongs to wq but is not wq
    first = 2 if info.dims[0] in EXPERT_DIMS else 1  # the first per-layer axis after the batch axes
    n_in = 1 if info.dims[0] in EXPERT_DIMS or info.lora_in is None else info.lora_in
    return MuonDimensionNumbers(reduction_axis=tuple(range(first, first + n_in)),
                                output_axis=tuple(range(first + n_in, leaf.ndim)))


def muon_dimension_numbers(params):
    """A tree like ``params``: ``optax.contrib.MuonDimensionNumbers(reduction_axis, output_axis)`` for every
    matmul weight of a layer inside a "blocks" subtree (role "matmul" in layers/layout.py, at least 2
    per-layer dims), None for everything else (embed, unembed, norms, biases, conv, A_log, D, routing state,
    heads, LoRA adapters). For example ``wq (L, d, H, K)`` → (1,), (2, 3); ``wo (L, H, K, d)`` → (1, 2), (3,);
    ``expert_down (L, X, M, d)`` → (2,), (3,); ``router (L, d, X)`` → (1,), (2,).

    Works for uniform blocks (a dict), mixed stacks (a list of dicts) and trees that wrap a model (reward,
    PPO). Subtrees optax has masked out (``optax.transforms.MaskedNode``, childless) pass through unchanged,
    which is how ``make_muon``'s Muon branch gets a dimension-number tree of its masked structure.
    """
    return jax.tree_util.tree_map_with_path(_leaf_dims, params)


def _labels(params):
    """The ``optax.transforms.partition`` label of every leaf: "muon" where it has dimension numbers, else
    "adam"."""
    return jax.tree_util.tree_map_with_path(lambda p, x: "adam" if _leaf_dims(p, x) is None else "muon", params)


def _fans(x, dims: MuonDimensionNumbers) -> tuple[int, int]:
    """(fan_in, fan_out): the products of a leaf's reduction and output axes."""
    return math.prod(x.shape[a] for a in dims.reduction_axis), math.prod(x.shape[a] for a in dims.output_axis)


def scale_by_shape(consistent_rms: float) -> optax.GradientTransformation:
    """× ``consistent_rms``·√max(fan_in, fan_out) on every leaf with dimension numbers (Liu et al. 2025:
    an orthogonal fan_in × fan_out matrix has RMS 1/√max(fan_in, fan_out), so the product has RMS
    ``consistent_rms``, AdamW's typical 0.2–0.4 at 0.2). Stateless. The same rule as optax's
    ``scale_by_shape(consistent_rms=...)``, which optax 0.2.8 does not export (``optax.contrib._muon`` only)."""

    def update(updates, state, params=None):
        del params
        scale = lambda u, d: u * (consistent_rms * math.sqrt(max(_fans(u, d))))  # noqa: E731
        dims = muon_dimension_numbers(updates)
        return jax.tree.map(scale, updates, dims, is_leaf=lambda x: isinstance(x, MuonDimensionNumbers)), state

    return optax.GradientTransformation(optax.init_empty_state, update)


def _check(name: str, value, ok: bool, valid: str) -> None:
    if not ok:
        raise ConfigError(f"make_muon: {name} = {value!r} is invalid: {valid}")


def muon_update(learning_rate: float | Callable, *, b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8,
                weight_decay: float = 0.1, beta: float = 0.95, ns_steps: int = 5,
                consistent_rms: float = 0.2) -> optax.GradientTransformation:
    """The two parameter groups, without clipping or routing-state exclusion (``optim.make_optimizer(kind=
    "muon")`` and ``make_muon`` add them):

    - Muon, the layers' matmul weights (``muon_dimension_numbers``): optax's ``scale_by_muon`` (EMA momentum
      m_t = β m_{t−1} + (1 − β) g_t, Nesterov direction with bias corrections, ``ns_steps`` Newton–Schulz
      steps on every layer's (and expert's) (fan_in, fan_out) matrix), × ``consistent_rms``·√max(fan_in,
      fan_out) (Liu et al. 2025: the update RMS of AdamW, so the same ``learning_rate`` and ``weight_decay``
      serve both groups), then decoupled decay: θ ← θ − η (update + λ θ).
    - AdamW, everything else, exactly ``make_optimizer``'s (b1, b2, eps, λ on ``decay_mask`` only: tables
      decay, gains, biases, A_log and D do not).

    ``optax.contrib.muon`` is not used: its AdamW branch takes no decay mask, so it would decay norm gains with
    a nonzero ``adam_weight_decay``. ``learning_rate`` is a float or a schedule of the update count.
    """
    for name, value, ok in (("b1", b1, 0 <= b1 < 1), ("b2", b2, 0 <= b2 < 1), ("eps", eps, eps > 0),
                            ("weight_decay", weight_decay, weight_decay >= 0), ("beta", beta, 0 <= beta < 1)):
        _check(name, value, ok, "b1, b2, beta in [0, 1); eps > 0; weight_decay >= 0")
    _check("ns_steps", ns_steps, isinstance(ns_steps, int) and not isinstance(ns_steps, bool) and ns_steps >= 1,
           "it must be a positive integer (5 in Jordan et al. 2024)")
    _check("consistent_rms", consistent_rms, isinstance(consistent_rms, (int, float))
           and math.isfinite(consistent_rms) and consistent_rms > 0, "it must be a finite number > 0 (0.2 matches "
           "AdamW's update RMS, Liu et al. 2025)")
    matrices = optax.chain(
        scale_by_muon(ns_steps=ns_steps, beta=beta, eps=eps, nesterov=True,
                      weight_dimension_numbers=muon_dimension_numbers),
        scale_by_shape(consistent_rms),
        optax.add_decayed_weights(weight_decay, mask=masks.decay_mask),
        optax.scale_by_learning_rate(learning_rate))
    rest = optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=masks.decay_mask)
    return optax.transforms.partition({"muon": matrices, "adam": rest}, _labels)


def make_muon(learning_rate: float | Callable, *, b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8,
              weight_decay: float = 0.1, clip_norm: float | None = 1.0, beta: float = 0.95, ns_steps: int = 5,
              consistent_rms: float = 0.2) -> optax.GradientTransformation:
    """Global clipping g̃ = g·min(1, c/‖g‖₂) over all of θ (as ``make_optimizer``), then ``muon_update``'s two
    groups; routing state excluded (``exclude_routing_state``). ``clip_norm=None`` disables clipping. With the
    default Muon settings this is ``optim.make_optimizer(kind="muon")``, the run's ``--optimizer muon``."""
    _check("clip_norm", clip_norm, clip_norm is None or clip_norm > 0, "it must be > 0 or None")
    groups = muon_update(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, beta=beta,
                         ns_steps=ns_steps, consistent_rms=consistent_rms)
    if clip_norm is None:
        return masks.exclude_routing_state(groups)
    return masks.exclude_routing_state(optax.chain(optax.clip_by_global_norm(clip_norm), groups))
