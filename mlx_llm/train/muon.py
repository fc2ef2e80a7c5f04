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

Options (``muon_update``): NorMuon (Li et al. 2025, "NorMuon: Making Muon more efficient and scalable",
arXiv:2510.05491) keeps a second moment per output neuron of the orthogonalised update and divides by its root,
then restores the update's Frobenius norm (``normalize_neurons``); Polar Express (Amsel, Persson, Musco & Gower
2025, "The Polar Express: Optimal Matrix Sign Methods and Their Application to the Muon Algorithm",
arXiv:2505.16932, Algorithm 1) replaces the fixed quintic by one optimal polynomial per iteration
(``POLAR_EXPRESS``); cautious weight decay (Chen et al. 2025, "Cautious Weight Decay", arXiv:2510.12402) decays
only the coordinates where the update has the parameter's sign (``cautious_decay``), in both groups.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
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


# Polar Express, degree 5 (Amsel et al. 2025, Algorithm 1): the optimal (a, b, c) of p_t(x) = a x + b x³ + c x⁵
# for each of the first iterations (the last repeats), each but the last divided by (1.01, 1.01³, 1.01⁵) for
# stability, after X₀ = G/(1.01·‖G‖_F + 10⁻⁷).
_POLAR_EXPRESS_RAW = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
POLAR_EXPRESS = tuple((a / 1.01, b / 1.01**3, c / 1.01**5) for a, b, c in _POLAR_EXPRESS_RAW[:-1]) \
    + (_POLAR_EXPRESS_RAW[-1],)
POLAR_SAFETY, POLAR_EPS = 1.01, 1e-7  # X₀ = G/(1.01·‖G‖_F + 10⁻⁷)


def polar_express_coeffs(steps: int) -> tuple[tuple[float, float, float], ...]:
    """The ``steps`` (a, b, c) of Polar Express as optax's ``scale_by_muon`` runs them: it normalises by ‖G‖_F + ε
    only, so the first triple also absorbs the 1.01 of X₀ (p(x/1.01) = (a/1.01) x + (b/1.01³) x³ + (c/1.01⁵) x⁵),
    and ε = 10⁻⁷/1.01 (``POLAR_EPS / POLAR_SAFETY``) gives the paper's X₀ exactly."""
    hs = (POLAR_EXPRESS + (POLAR_EXPRESS[-1],) * steps)[:steps]
    (a, b, c), rest = hs[0], hs[1:]
    s = POLAR_SAFETY
    return ((a / s, b / s**3, c / s**5),) + rest


class NeuronState(NamedTuple):
    """NorMuon's second moment per output neuron of every Muon matrix (its input axes reduced to 1)."""

    v: optax.Updates


NORMUON_EPS = 1e-10  # NorMuon's ε in 1/(√v + ε) and in the norm ratio (Li et al.'s reference code)


def normalize_neurons(beta2: float = 0.95) -> optax.GradientTransformation:
    """NorMuon's step (Li et al. 2025, Algorithm 1) on an orthogonalised update O of every Muon matrix:
    v_t = β₂ v_{t−1} + (1 − β₂)·mean_in(O ⊙ O) (one entry per output neuron: the mean over the input axes),
    Ô = O/(√v_t + ε), then Ô·‖O‖_F/(‖Ô‖_F + ε) per matrix (per layer and expert), so the update keeps Muon's
    Frobenius norm and only its distribution over neurons changes. v₀ = 0, no bias correction (as published)."""

    dims_of = muon_dimension_numbers

    def init(params):
        def zeros(p, d):
            shape = tuple(1 if a in d.reduction_axis else n for a, n in enumerate(p.shape))
            return jnp.zeros(shape, p.dtype)
        return NeuronState(jax.tree.map(zeros, params, dims_of(params)))

    def update(updates, state, params=None):
        del params

        def moment(o, d, v):
            return beta2 * v + (1 - beta2) * jnp.mean(jnp.square(o), axis=d.reduction_axis, keepdims=True)

        def normalized(o, d, v):
            matrix = tuple(d.reduction_axis) + tuple(d.output_axis)
            scaled = o / (jnp.sqrt(v) + NORMUON_EPS)
            ratio = (jnp.sqrt(jnp.sum(jnp.square(o), axis=matrix, keepdims=True))
                     / (jnp.sqrt(jnp.sum(jnp.square(scaled), axis=matrix, keepdims=True)) + NORMUON_EPS))
            return scaled * ratio

        dims = dims_of(updates)
        new_v = jax.tree.map(moment, updates, dims, state.v)
        return jax.tree.map(normalized, updates, dims, new_v), NeuronState(new_v)

    return optax.GradientTransformation(init, update)


def cautious_decay(weight_decay: float, mask) -> optax.GradientTransformation:
    """Cautious weight decay (Chen et al. 2025): u ← u + λ·𝟙[u ⊙ θ ≥ 0] ⊙ θ on the leaves of ``mask``, where u is
    the optimizer's direction (the update is −η(u + …)): θ decays only where the step already moves it toward 0.
    Stateless; replaces ``optax.add_decayed_weights`` in a chain."""

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("cautious_decay needs the parameters")
        out = jax.tree.map(lambda u, p: u + weight_decay * jnp.where(u * p >= 0, p, 0).astype(u.dtype), updates,
                           params)
        return out, state

    return optax.transforms.masked(optax.GradientTransformation(optax.init_empty_state, update), mask)


def decoupled_decay(weight_decay: float, cautious: bool = False) -> optax.GradientTransformation:
    """AdamW's decoupled decay u + λθ on ``masks.decay_mask``'s leaves, or its cautious form."""
    if cautious:
        return cautious_decay(weight_decay, masks.decay_mask)
    return optax.add_decayed_weights(weight_decay, mask=masks.decay_mask)


def adamw(learning_rate, *, b1: float, b2: float, eps: float, weight_decay: float,
          cautious: bool = False) -> optax.GradientTransformation:
    """optax's AdamW with decay on ``decay_mask`` (the same object when not ``cautious``, so its numbers are
    unchanged), or the same chain — scale_by_adam, cautious decay, × −η — with cautious weight decay."""
    if not cautious:
        return optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=masks.decay_mask)
    return optax.chain(optax.scale_by_adam(b1=b1, b2=b2, eps=eps), decoupled_decay(weight_decay, True),
                       optax.scale_by_learning_rate(learning_rate))


def _check(name: str, value, ok: bool, valid: str) -> None:
    if not ok:
        raise ConfigError(f"make_muon: {name} = {value!r} is invalid: {valid}")


def muon_update(learning_rate: float | Callable, *, b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8,
                weight_decay: float = 0.1, beta: float = 0.95, ns_steps: int = 5,
                consistent_rms: float = 0.2, normuon: bool = False, polar_express: bool = False,
                cautious_wd: bool = False, beta2: float = 0.95) -> optax.GradientTransformation:
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

    ``normuon``: ``normalize_neurons(beta2)`` between the orthogonalisation and the shape scale (NorMuon);
    ``polar_express``: the ``ns_steps`` iterations run Polar Express's polynomials (``polar_express_coeffs``);
    ``cautious_wd``: cautious decay in both groups (``cautious_decay``).
    """
    for name, value, ok in (("b1", b1, 0 <= b1 < 1), ("b2", b2, 0 <= b2 < 1), ("eps", eps, eps > 0),
                            ("weight_decay", weight_decay, weight_decay >= 0), ("beta", beta, 0 <= beta < 1)):
        _check(name, value, ok, "b1, b2, beta in [0, 1); eps > 0; weight_decay >= 0")
    _check("ns_steps", ns_steps, isinstance(ns_steps, int) and not isinstance(ns_steps, bool) and ns_steps >= 1,
           "it must be a positive integer (5 in Jordan et al. 2024)")
    _check("consistent_rms", consistent_rms, isinstance(consistent_rms, (int, float))
           and math.isfinite(consistent_rms) and consistent_rms > 0, "it must be a finite number > 0 (0.2 matches "
           "AdamW's update RMS, Liu et al. 2025)")
    _check("beta2", beta2, 0 <= beta2 < 1, "NorMuon's beta2 is in [0, 1)")
    orthogonalize = {}
    if polar_express:
        orthogonalize = dict(ns_coeffs=polar_express_coeffs(ns_steps), eps=POLAR_EPS / POLAR_SAFETY)
    matrices = optax.chain(
        scale_by_muon(**{"ns_steps": ns_steps, "eps": eps, **orthogonalize}, beta=beta, nesterov=True,
                      weight_dimension_numbers=muon_dimension_numbers),
        *([normalize_neurons(beta2)] if normuon else []),
        scale_by_shape(consistent_rms),
        decoupled_decay(weight_decay, cautious_wd),
        optax.scale_by_learning_rate(learning_rate))
    rest = adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, cautious=cautious_wd)
    return optax.transforms.partition({"muon": matrices, "adam": rest}, _labels)


def make_muon(learning_rate: float | Callable, *, b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8,
              weight_decay: float = 0.1, clip_norm: float | None = 1.0, beta: float = 0.95, ns_steps: int = 5,
              consistent_rms: float = 0.2, **options) -> optax.GradientTransformation:
    """Global clipping g̃ = g·min(1, c/‖g‖₂) over all of θ (as ``make_optimizer``), then ``muon_update``'s two
    groups; routing state excluded (``exclude_routing_state``). ``clip_norm=None`` disables clipping. With the
    default Muon settings this is ``optim.make_optimizer(kind="muon")``, the run's ``--optimizer muon``;
    ``options``: ``muon_update``'s ``normuon``, ``polar_express``, ``cautious_wd``, ``beta2``."""
    _check("clip_norm", clip_norm, clip_norm is None or clip_norm > 0, "it must be > 0 or None")
    groups = muon_update(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, beta=beta,
                         ns_steps=ns_steps, consistent_rms=consistent_rms, **options)
    if clip_norm is None:
        return masks.exclude_routing_state(groups)
    return masks.exclude_routing_state(optax.chain(optax.clip_by_global_norm(clip_norm), groups))
