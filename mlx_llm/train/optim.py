"""AdamW with global clipping and decay groups (M20 §12), as one optax chain, plus schedules; per-leaf learning-rate
multipliers (the groups' ``role_lr_scales``, μP's ``mup_lr_scales``) meet in one ``scale_per_leaf`` step."""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from mlx_llm.config import DECAY_SHAPES, OPTIMIZERS, wsd_decay_steps
from mlx_llm.errors import ConfigError
from mlx_llm.layers import layout
from mlx_llm.train import masks, muon
from mlx_llm.train.masks import (ROUTING_STATE_KEYS, decay_mask, exclude_routing_state, role_lr_scales,  # noqa: F401
                                 strip_routing_state)

Schedule = Callable[[jax.Array], jax.Array]


def scale_per_leaf(scales: Callable[[Any], Any]) -> optax.GradientTransformation:
    """u ← s·u leaf by leaf, s = ``scales(updates)`` a tree of numbers like the updates (e.g. ``role_lr_scales``,
    or ``multiply_scales`` of several such functions), read from the tree's paths at trace time, so it costs one
    multiply per leaf whose s ≠ 1. At the end of a chain, after the learning rate, it is a per-leaf learning
    rate: the leaf's decoupled decay scales with it, as AdamW's does with η. Stateless."""

    def update(updates, state, params=None):
        del params
        return jax.tree.map(lambda u, s: u if s == 1.0 else u * jnp.asarray(s, u.dtype), updates,
                            scales(updates)), state

    return optax.GradientTransformation(optax.init_empty_state, update)


def multiply_scales(*scales: Callable[[Any], Any] | None) -> Callable[[Any], Any] | None:
    """One per-leaf multiplier function from several (each a function of the updates tree giving a tree of floats,
    or None for none): their leafwise product, so every source of per-leaf learning rates (the groups' multipliers,
    a parametrization's) meets in the chain's one ``scale_per_leaf`` step. None when none is given; the function
    itself when one is."""
    given = [f for f in scales if f is not None]
    if not given:
        return None
    if len(given) == 1:
        return given[0]

    def product(tree):
        out = given[0](tree)
        for f in given[1:]:
            out = jax.tree.map(lambda a, b: a * b, out, f(tree))
        return out

    return product


def make_optimizer(learning_rate: float | Schedule, *, b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8,
                   weight_decay: float = 0.1, clip_norm: float | None = 1.0, kind: str = "adamw",
                   spike_factor: float | None = None, polar_express: bool = False, cautious_wd: bool = False,
                   lr_scales: Callable[[Any], Any] | None = None) -> optax.GradientTransformation:
    """M20 §12: g̃ = g·min(1, c/‖g‖₂) over all trainable scalars, then AdamW
    θ_s = (1 − η_s λ) θ_{s−1} − η_s m̂_s / (√v̂_s + ε), with λ on the weight matrices only (``decay_mask``).

    Routing state (MoE offsets) is not θ: the chain never sees it (``exclude_routing_state``).
    ``clip_norm=None`` disables clipping. ``learning_rate`` is a float or a schedule of the step count.
    ``kind`` "muon": Muon on each layer's matrices and AdamW on the rest after the same clipping
    (train/muon.py); "normuon": the same with NorMuon's per-neuron normalisation; ``polar_express`` (Muon kinds)
    orthogonalises by Polar Express; ``cautious_wd``: cautious weight decay in every group; ``lr_scales``: a
    function of the updates tree giving each leaf's learning-rate multiplier (``scale_per_leaf``; e.g.
    ``role_lr_scales``, or ``multiply_scales`` of several), None for none; ``spike_factor`` k: ``skip_spikes``
    around the whole chain.
    """
    for name, value, ok in (("b1", b1, 0 <= b1 < 1), ("b2", b2, 0 <= b2 < 1), ("eps", eps, eps > 0),
                            ("weight_decay", weight_decay, weight_decay >= 0)):
        if not ok:
            raise ConfigError(f"make_optimizer: {name} = {value!r} is invalid (b1, b2 in [0, 1); eps > 0; "
                              f"weight_decay >= 0)")
    if clip_norm is not None and not clip_norm > 0:
        raise ConfigError(f"make_optimizer: clip_norm = {clip_norm!r} is invalid: it must be > 0 or None")
    if kind not in OPTIMIZERS:
        raise ConfigError(f"make_optimizer: kind = {kind!r} is invalid: valid optimizers are {list(OPTIMIZERS)}")
    if polar_express and kind == "adamw":
        raise ConfigError("make_optimizer: polar_express replaces Muon's Newton–Schulz iteration: it needs kind "
                          "'muon' or 'normuon'")
    if kind in ("muon", "normuon"):
        update = muon.muon_update(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                                  normuon=kind == "normuon", polar_express=polar_express, cautious_wd=cautious_wd)
    else:
        update = muon.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, cautious=cautious_wd)
    if lr_scales is not None:
        update = optax.chain(update, scale_per_leaf(lr_scales))
    chain = update if clip_norm is None else optax.chain(optax.clip_by_global_norm(clip_norm), update)
    return exclude_routing_state(chain if spike_factor is None else skip_spikes(chain, spike_factor))


def mup_lr_scales(tree, cfg, kind: str = "adamw"):
    """The learning-rate multiplier of every leaf of ``tree`` (parameters or their updates) under μP, as a tree of
    floats: ``layers.layout.mup_lr_mult`` of the leaf's declaration (AdamW: η/m_in on the hidden weights, m_in =
    fan_in / base fan_in, η on everything else; Muon: the spectral condition's multiplier on the matrices Muon
    orthogonalises). All 1.0 under SP. A leaf is a model parameter when its own key is declared in the layout;
    anything else (LoRA factors such as ``blocks/wq/A``) trains at the schedule's η, and the reward and value
    heads are vectors (η): μP's rules are stated for a model's own weights."""
    if kind not in OPTIMIZERS:
        raise ConfigError(f"mup_lr_scales: kind = {kind!r} is invalid: valid optimizers are {list(OPTIMIZERS)}")
    infos = layout.entries()

    def scale(path, leaf):
        key = masks.key_name(path[-1]) if path else None
        return layout.mup_lr_mult(infos[key], cfg, kind) if key in infos else 1.0

    return jax.tree_util.tree_map_with_path(scale, tree)


def warmup_cosine(peak: float, warmup_steps: int, total_steps: int, final_fraction: float = 0.1) -> Schedule:
    """η for update number s = 0, 1, 2, … (optax's count):

    - warmup, s < W:         η = peak·(s + 1)/W   (the first update already moves; none is wasted at η = 0)
    - cosine, W ≤ s < S:     η = peak·[f + (1 − f)·(1 + cos(π (s − W)/(S − W)))/2]
    - after the end, s ≥ S:  η = peak·f
    """
    if not (peak > 0 and math.isfinite(peak)):
        raise ConfigError(f"warmup_cosine: peak = {peak!r} must be a finite number > 0")
    if not (isinstance(warmup_steps, int) and 0 <= warmup_steps <= total_steps):
        raise ConfigError(f"warmup_cosine: warmup_steps = {warmup_steps!r} must be an integer in [0, total_steps = "
                          f"{total_steps}]")
    if not (isinstance(total_steps, int) and total_steps >= 1):
        raise ConfigError(f"warmup_cosine: total_steps = {total_steps!r} must be a positive integer")
    if not 0 <= final_fraction <= 1:
        raise ConfigError(f"warmup_cosine: final_fraction = {final_fraction!r} must be in [0, 1]")

    def schedule(count):
        s = jnp.asarray(count).astype(jnp.result_type(float))  # float64 when x64 is on
        warm = peak * (s + 1) / max(warmup_steps, 1)
        progress = jnp.clip((s - warmup_steps) / max(total_steps - warmup_steps, 1), 0.0, 1.0)
        cosine = peak * (final_fraction + (1 - final_fraction) * 0.5 * (1 + jnp.cos(jnp.pi * progress)))
        return jnp.where(s < warmup_steps, warm, cosine)

    return schedule


def warmup_stable_decay(peak: float, warmup_steps: int, total_steps: int, decay_fraction: float = 0.2,
                        final_fraction: float = 0.1, shape: str = "1-sqrt") -> Schedule:
    """Warmup-stable-decay (Hägele et al. 2024, "Scaling laws and compute-optimal training beyond fixed training
    durations"): η for update number s = 0, 1, 2, … with D = ``wsd_decay_steps(S, F)`` decay steps:

    - warmup, s < W:            η = peak·(s + 1)/W   (as ``warmup_cosine``)
    - stable, W ≤ s < S − D:    η = peak
    - decay, s ≥ S − D:         p = min((s − S + D)/D, 1);  η = peak·[f + (1 − f)·(1 − √p)]  ("1-sqrt", the
                                shape Hägele et al. found best) or peak·[f + (1 − f)·(1 − p)] ("linear")

    The stable phase does not depend on S, so a run branched off at a step before its decay and decayed to
    another S follows the same lr up to the branch point (``--branch-from``).
    """
    warmup_cosine(peak, warmup_steps, total_steps, final_fraction)  # the same checks of the shared arguments
    if isinstance(decay_fraction, bool) or not isinstance(decay_fraction, (int, float)) or not 0 < decay_fraction < 1:
        raise ConfigError(f"warmup_stable_decay: decay_fraction = {decay_fraction!r} must be in (0, 1)")
    if shape not in DECAY_SHAPES:
        raise ConfigError(f"warmup_stable_decay: shape = {shape!r} is invalid: valid shapes are {list(DECAY_SHAPES)}")
    decay = wsd_decay_steps(total_steps, decay_fraction)
    if warmup_steps + decay > total_steps:
        raise ConfigError(f"warmup_stable_decay: warmup_steps = {warmup_steps} + decay steps {decay} (decay_fraction "
                          f"{decay_fraction:g} of {total_steps}) exceed total_steps = {total_steps}")
    start = total_steps - decay

    def schedule(count):
        s = jnp.asarray(count).astype(jnp.result_type(float))
        warm = peak * (s + 1) / max(warmup_steps, 1)
        p = jnp.clip((s - start) / decay, 0.0, 1.0)
        falloff = jnp.sqrt(p) if shape == "1-sqrt" else p
        decayed = peak * (final_fraction + (1 - final_fraction) * (1 - falloff))
        return jnp.where(s < warmup_steps, warm, jnp.where(s < start, peak, decayed))

    return schedule


class SpikeState(NamedTuple):
    """``skip_spikes``' state beside the inner optimizer's: the running mean of accepted gradient norms (an EMA,
    bias-corrected by ``accepted``) and the count of skipped updates."""

    inner: Any
    norm_ema: jax.Array
    accepted: jax.Array
    skipped: jax.Array


SPIKE_EMA = 0.99  # the running mean's decay: about the last 100 accepted updates
SPIKE_WARMUP = 10  # accepted updates before any can be skipped: the mean needs a few samples first


def skip_spikes(inner: optax.GradientTransformation, factor: float) -> optax.GradientTransformation:
    """Skip an update whose gradient norm ‖g‖ exceeds ``factor`` × the running mean of earlier accepted norms:
    its update is zero (no step, no weight decay) and ``inner``'s state (the moments) is left as it was, as
    though the batch had not been drawn (the data cursor still moves on). The first ``SPIKE_WARMUP`` updates are
    never skipped. A non-finite norm is not skipped: the training loop's divergence check reports it. The
    norm is over θ's gradients as the caller gives them (before clipping: the same number as the ``grad_norm``
    metric). ``SpikeState.skipped`` counts the skipped updates (the ``spikes_skipped`` metric)."""
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (math.isfinite(factor) and factor > 1):
        raise ConfigError(f"skip_spikes: factor = {factor!r} is invalid: it must be a finite number > 1")

    def init(params):
        zero = jnp.zeros((), jnp.float32)
        return SpikeState(inner.init(params), zero, jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))

    def update(updates, state, params=None):
        norm = optax.tree.norm(strip_routing_state(updates)).astype(jnp.float32)
        mean = state.norm_ema / (1 - SPIKE_EMA ** jnp.maximum(state.accepted, 1).astype(jnp.float32))
        spike = (state.accepted >= SPIKE_WARMUP) & (norm > factor * mean)
        new_updates, new_inner = inner.update(updates, state.inner, params)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(spike, o, n), new, old)  # noqa: E731
        new_updates = jax.tree.map(lambda u: jnp.where(spike, jnp.zeros_like(u), u), new_updates)
        ema = jnp.where(spike, state.norm_ema, SPIKE_EMA * state.norm_ema + (1 - SPIKE_EMA) * norm)
        return new_updates, SpikeState(keep(new_inner, state.inner), ema, state.accepted + (~spike).astype(jnp.int32),
                                       state.skipped + spike.astype(jnp.int32))

    return optax.GradientTransformation(init, update)
