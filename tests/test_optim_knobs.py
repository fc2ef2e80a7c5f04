"""The optimizer options of TrainConfig in the one optax chain (train/optim.py, train/muon.py, train/masks.py) against
NumPy references of their first two updates, as tests/test_muon.py checks Muon: NorMuon (Li et al. 2025), Polar
Express (Amsel et al. 2025, Algorithm 1), cautious weight decay (Chen et al. 2025) in both groups, and the per-group
learning rates (``role_lr_scales``). Float64 (conftest); one small stacked tree, so each chain compiles fast."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mlx_llm.config import TrainConfig
from mlx_llm.errors import ConfigError
from mlx_llm.train.masks import role_lr_scales
from mlx_llm.train.muon import POLAR_EXPRESS
from mlx_llm.train.optim import make_optimizer, multiply_scales

LR, WD, B1, B2, EPS, BETA = 0.01, 0.1, 0.9, 0.95, 1e-8, 0.95
NS = (3.4445, -4.775, 2.0315)
# (key, fan_in axes) of the stacked matrices (layer axis 0): wq (d, H, K) → (d, H·K); w_up (d, F)
MATRICES = {"wq": 1, "w_up": 1}
DECAYED = {"embed", "unembed", "wq", "w_up"}  # tables and matrices; gains and biases do not decay
GROUP = {"embed": "embed", "unembed": "head", "final_norm": "scalar", "attn_norm": "scalar", "bq": "scalar",
         "wq": "matrix", "w_up": "matrix"}


def tree(seed=0):
    rng = np.random.default_rng(seed)
    shapes = {"embed": (8, 4), "unembed": (4, 8), "final_norm": (4,),
              "blocks": {"attn_norm": (1, 4), "wq": (1, 4, 2, 2), "bq": (1, 2, 2), "w_up": (1, 4, 6)}}
    return jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s)), shapes, is_leaf=lambda x: isinstance(x, tuple))


def leaves(t):
    return {**{k: np.asarray(v) for k, v in t.items() if k != "blocks"},
            **{k: np.asarray(v) for k, v in t["blocks"].items()}}


@functools.lru_cache(maxsize=None)
def chain(kind="adamw", **options):
    tx = make_optimizer(LR, weight_decay=WD, kind=kind, **options)
    return tx, jax.jit(tx.update)


def two_updates(kind="adamw", **options):
    """The chain's first two updates for two small gradients (below clip_norm: not clipped) → (p, g1, g2, u1, p2, u2)
    as flat dicts of NumPy arrays."""
    tx, update = chain(kind, **options)
    p = tree()
    g1, g2 = (jax.tree.map(lambda x: 1e-2 * x, tree(seed)) for seed in (1, 2))
    u1, state = update(g1, tx.init(p), p)
    p2 = jax.tree.map(jnp.add, p, u1)
    u2, _ = update(g2, state, p2)
    return tuple(leaves(t) for t in (p, g1, g2, u1, p2, u2))


def decay(u, p, key, cautious):
    """λ·θ on the decayed leaves; with ``cautious`` only where u ⊙ θ ≥ 0."""
    if key not in DECAYED:
        return 0.0
    return WD * (np.where(u * p >= 0, p, 0.0) if cautious else p)


def adamw_reference(key, p, g1, g2, p2, cautious=False, scale=1.0):
    """AdamW's first two updates: m̂/(√v̂ + ε) + decay, × −η × the leaf's multiplier."""
    m = v = 0.0
    out = []
    for t, (g, theta) in enumerate(((g1, p), (g2, p2)), start=1):
        m, v = B1 * m + (1 - B1) * g, B2 * v + (1 - B2) * g * g
        u = (m / (1 - B1 ** t)) / (np.sqrt(v / (1 - B2 ** t)) + EPS)
        out.append(-LR * scale * (u + decay(u, theta, key, cautious)))
    return out


def newton_schulz(x, eps=EPS):
    """Jordan et al.'s quintic, 5 steps, on X/(‖X‖_F + ε) (transposed when tall)."""
    a, b, c = NS
    x = x / (np.linalg.norm(x) + eps)
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    for _ in range(5):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if tall else x


def polar_express(g, steps=5):
    """Amsel et al. 2025, Algorithm 1 (in float64): X₀ = G/(1.01‖G‖_F + 10⁻⁷), X ← aX + (bA + cA²)X with A = XXᵀ
    for each of the published (safety-scaled) (a, b, c)."""
    x = g.T if g.shape[0] > g.shape[1] else g
    x = x / (np.linalg.norm(x) * 1.01 + 1e-7)
    for a, b, c in POLAR_EXPRESS[:steps]:
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if g.shape[0] > g.shape[1] else x


def muon_reference(key, p, g1, g2, p2, *, orthogonalize=newton_schulz, normuon=False, cautious=False):
    """Muon's first two updates of the stacked matrix ``key``: optax's EMA momentum with bias-corrected Nesterov,
    ``orthogonalize`` per layer on the (fan_in, fan_out) matrix, NorMuon's per-neuron normalisation (v = β₂v +
    (1 − β₂)·mean over the inputs of O², O/(√v + ε), then O's Frobenius norm restored), × 0.2·√max(fan_in, fan_out),
    + decay, × −η."""
    n_in = MATRICES[key]
    rest = p.shape[1:]
    fan_in, fan_out = math.prod(rest[:n_in]), math.prod(rest[n_in:])
    m, v, out = 0.0, np.zeros((p.shape[0], 1, fan_out)), []
    for t, (g, theta) in enumerate(((g1, p), (g2, p2)), start=1):
        m = BETA * m + (1 - BETA) * g
        hat = BETA * m / (1 - BETA ** (t + 1)) + (1 - BETA) * g / (1 - BETA ** t)
        o = np.stack([orthogonalize(h) for h in hat.reshape(-1, fan_in, fan_out)])
        if normuon:
            v = BETA * v + (1 - BETA) * np.mean(o ** 2, axis=1, keepdims=True)
            scaled = o / (np.sqrt(v) + 1e-10)
            norms = np.linalg.norm(o, axis=(1, 2), keepdims=True)
            o = scaled * norms / (np.linalg.norm(scaled, axis=(1, 2), keepdims=True) + 1e-10)
        u = (0.2 * math.sqrt(max(fan_in, fan_out)) * o).reshape(p.shape)
        out.append(-LR * (u + decay(u, theta, key, cautious)))
    return out


def assert_updates(got1, got2, want, key):
    np.testing.assert_allclose(got1[key], want[0], rtol=0, atol=1e-10, err_msg=key)
    np.testing.assert_allclose(got2[key], want[1], rtol=0, atol=1e-10, err_msg=key)


@pytest.mark.parametrize("kind, options, reference", [
    ("normuon", {}, dict(normuon=True)),
    ("muon", {"polar_express": True}, dict(orthogonalize=polar_express)),
    ("normuon", {"polar_express": True, "cautious_wd": True},
     dict(orthogonalize=polar_express, normuon=True, cautious=True)),
])
def test_muon_variants_first_two_updates(kind, options, reference):
    """NorMuon, Polar Express and cautious decay on the matrices; AdamW (cautious with them) on the rest."""
    p, g1, g2, u1, p2, u2 = two_updates(kind, **options)
    for key in MATRICES:
        assert_updates(u1, u2, muon_reference(key, p[key], g1[key], g2[key], p2[key], **reference), key)
        plain = muon_reference(key, p[key], g1[key], g2[key], p2[key])
        assert np.abs(plain[1] - u2[key]).max() > 1e-6, key  # the option changed the update
    for key in ("embed", "unembed", "final_norm", "attn_norm", "bq"):
        assert_updates(u1, u2, adamw_reference(key, p[key], g1[key], g2[key], p2[key],
                                               cautious=reference.get("cautious", False)), key)


def test_polar_express_is_the_published_algorithm_and_orthogonalises_further():
    """The five published polynomials (safety-scaled, the last kept) and the 1.01 normalisation through optax's
    per-step coefficients; on a matrix whose singular values spread 100×, Polar Express brings them closer to 1
    than the fixed quintic."""
    assert POLAR_EXPRESS[0] == pytest.approx((8.28721201814563 / 1.01, -23.595886519098837 / 1.01 ** 3,
                                              17.300387312530933 / 1.01 ** 5))
    assert POLAR_EXPRESS[-1] == (1.875, -1.25, 0.375)
    rng = np.random.default_rng(0)
    u, _ = np.linalg.qr(rng.normal(size=(12, 6)))
    w, _ = np.linalg.qr(rng.normal(size=(6, 6)))
    g = (u * np.logspace(0, -2, 6)) @ w.T
    err = {f.__name__: np.abs(np.linalg.svd(f(g), compute_uv=False) - 1).max() for f in (newton_schulz, polar_express)}
    assert err["polar_express"] < err["newton_schulz"] < 0.5, err


def test_cautious_decay_in_adamw_skips_the_coordinates_that_would_grow():
    p, g1, g2, u1, p2, u2 = two_updates("adamw", cautious_wd=True)
    for key in GROUP:
        assert_updates(u1, u2, adamw_reference(key, p[key], g1[key], g2[key], p2[key], cautious=True), key)
    m = g1["embed"]  # update 1's direction has the gradient's sign: decay only where sign(g) = sign(θ)
    kept = (m * p["embed"] >= 0)
    assert 0 < kept.mean() < 1
    plain = adamw_reference("embed", p["embed"], g1["embed"], g2["embed"], p2["embed"])[0]
    np.testing.assert_array_equal(np.isclose(u1["embed"], plain, rtol=0, atol=1e-15), kept)


def test_role_lr_scales_per_declared_group():
    """embed, head and scalar leaves × their multipliers, matrices × 1; a tied embedding (no unembed) takes the
    embed multiplier; each leaf's two AdamW updates are the reference's × its multiplier (decay included), also when
    it is the product of two sources (``multiply_scales``)."""
    scales = dict(embed=2.0, head=0.5, scalar=3.0)
    got = leaves(role_lr_scales(tree(), **scales))
    assert got == {k: {**scales, "matrix": 1.0}[g] for k, g in GROUP.items()}
    tied = role_lr_scales({"embed": jnp.zeros((8, 4)), "blocks": {"value_embed": jnp.zeros((1, 8, 2, 2))}}, **scales)
    assert tied == {"embed": 2.0, "blocks": {"value_embed": 2.0}}
    # composed with a second source of per-leaf rates (as a parametrization's would be): the leafwise product
    other = functools.partial(jax.tree_util.tree_map_with_path,
                              lambda path, _: 4.0 if path[-1].key in ("wq", "embed") else 1.0)
    assert multiply_scales() is None and multiply_scales(None, other) is other
    p, g1, g2, u1, p2, u2 = two_updates("adamw", lr_scales=multiply_scales(
        functools.partial(role_lr_scales, **scales), None, other))
    for key, group in GROUP.items():
        factor = {**scales, "matrix": 1.0}[group] * (4.0 if key in ("wq", "embed") else 1.0)
        assert_updates(u1, u2, adamw_reference(key, p[key], g1[key], g2[key], p2[key], scale=factor), key)


def test_the_run_chain_and_refusals():
    from mlx_llm.train.step import optimizer_for, role_scales_for

    assert role_scales_for(TrainConfig()) is None  # all 1: the chain without the multiplier step
    tcfg = TrainConfig(optimizer="normuon", polar_express=True, cautious_wd=True, head_lr_scale=0.5, lr=1e-2)
    p = tree()
    tx = optimizer_for(tcfg)
    u, _ = jax.jit(tx.update)(jax.tree.map(lambda x: 1e-2 * x, tree(1)), tx.init(p), p)
    assert np.isfinite(np.asarray(u["blocks"]["wq"])).all()
    with pytest.raises(ConfigError, match="polar_express = true .* needs --optimizer muon or normuon"):
        TrainConfig(polar_express=True)
    with pytest.raises(ConfigError, match="head_lr_scale"):
        TrainConfig(head_lr_scale=0.0)
    with pytest.raises(ConfigError, match="mtp_weight"):
        TrainConfig(mtp_weight=-1.0)
    with pytest.raises(ConfigError, match="polar_express replaces"):
        make_optimizer(LR, polar_express=True)
