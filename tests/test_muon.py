"""Muon (train/muon.py, Jordan et al. 2024; Liu et al. 2025) against NumPy references: the Newton–Schulz
orthogonalisation, the first two updates of stacked matrices (optax's EMA momentum with bias-corrected Nesterov),
AdamW on every other leaf exactly as ``make_optimizer``, the decay groups, routing state, the dimension numbers
of dense, MoE, hybrid, LoRA and reward trees, and a few training steps of a tiny model (float64: conftest)."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import tiny_cfg
from mlx_llm.config import TrainConfig
from mlx_llm.errors import ConfigError
from mlx_llm.model import init_params
from mlx_llm import lora as lora_lib
from mlx_llm.train.muon import make_muon, muon_dimension_numbers
from mlx_llm.train.optim import make_optimizer

Dims = optax.contrib.MuonDimensionNumbers
NS = (3.4445, -4.775, 2.0315)  # Jordan et al. 2024's quintic
EPS = 1e-8
MOE = tiny_cfg(ffn_pattern=("moe",), n_experts=4, moe_top_k=2, moe_d_ff=8, n_shared_experts=1)
HYBRID = tiny_cfg(mixer_pattern=("attn", "mamba"), ssm_state=4, ssm_conv=3, ssm_expand=2)


def ns_reference(g, steps=5, eps=EPS):
    """X ← G/(‖G‖_F + ε), transposed when rows > cols; ``steps`` × {A = XXᵀ, B = bA + cA², X = aX + BX}."""
    a, b, c = NS
    x = g / (np.linalg.norm(g) + eps)
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if tall else x


def spread_matrix(rng, rows, cols, low=1e-2):
    """A rows × cols matrix with singular values log-spaced from 1 down to ``low``."""
    k = min(rows, cols)
    u, _ = np.linalg.qr(rng.normal(size=(rows, k)))
    v, _ = np.linalg.qr(rng.normal(size=(cols, k)))
    return (u * np.logspace(0, math.log10(low), k)) @ v.T


@functools.lru_cache(maxsize=None)
def params64(cfg):
    """A float64 tree of ``cfg``'s parameter shapes (``init_params``'s, traced only: compiling the real
    initialisers takes tens of seconds on a busy CPU), filled with N(0, 1) draws: the optimizer tests need the
    tree's structure and nonzero weights, not the initial distributions."""
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    rng = np.random.default_rng(123)
    return jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape)), shapes)


LR, WD = 0.01, 0.1  # the chains under test: make_muon(LR, weight_decay=WD), defaults otherwise (clip_norm 1.0)


@functools.lru_cache(maxsize=None)
def jitted(kind: str):
    """(optimizer, jitted update) of ``make_muon`` or ``make_optimizer`` at (LR, WD), compiled once per tree
    structure for the whole module."""
    tx = (make_muon if kind == "muon" else make_optimizer)(LR, weight_decay=WD)
    return tx, jax.jit(tx.update)


def normal_like(tree, seed):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape)), tree)


def muon_leaf_reference(mu_hat, n_batch, n_in, lr, wd, p):
    """−lr·(0.2·√max(fan_in, fan_out)·NS(matrix) + wd·p) for every matrix of the first ``n_batch`` axes (layer,
    expert), each reshaped to (fan_in, fan_out): its next ``n_in`` axes are inputs, the rest outputs."""
    batch, rest = mu_hat.shape[:n_batch], mu_hat.shape[n_batch:]
    fan_in, fan_out = math.prod(rest[:n_in]), math.prod(rest[n_in:])
    mats = np.asarray(mu_hat).reshape(-1, fan_in, fan_out)
    ortho = np.stack([ns_reference(m) for m in mats]).reshape(*batch, *rest)
    return -lr * (0.2 * math.sqrt(max(fan_in, fan_out)) * ortho + wd * np.asarray(p))


# (key, batch axes, input axes) of the MoE model's matrices: layer (and expert) axes are batch axes
MATRICES = (("wq", 1, 1), ("wo", 1, 2), ("router", 1, 1), ("expert_down", 2, 1), ("expert_gate", 2, 1),
            ("shared_down", 2, 1))


def test_newton_schulz_matches_numpy_and_flattens_the_spectrum():
    """optax's orthogonalisation (scale_by_muon with β = 0: the update is NS(g) itself) equals the reference
    for a wide, a tall and a batched matrix, and maps singular values spread 100× into ≈ [0.68, 1.13]."""
    rng = np.random.default_rng(0)
    for g in (spread_matrix(rng, 12, 24), spread_matrix(rng, 24, 12)):
        tx = optax.contrib.scale_by_muon(beta=0.0, nesterov=False)
        out, _ = jax.jit(tx.update)(jnp.asarray(g), tx.init(jnp.asarray(g)))
        np.testing.assert_allclose(np.asarray(out), ns_reference(g), rtol=0, atol=1e-10)
        s_in, s_out = np.linalg.svd(g, compute_uv=False), np.linalg.svd(np.asarray(out), compute_uv=False)
        assert s_in.max() / s_in.min() > 90
        assert 0.6 < s_out.min() and s_out.max() < 1.2 and s_out.max() / s_out.min() < 2
        assert not np.allclose(np.asarray(out), g / np.linalg.norm(g), atol=1e-2)  # it did change the matrix
    stack = np.stack([spread_matrix(rng, 6, 10) for _ in range(3)])  # axis 0 unnamed: a batch axis
    tx = optax.contrib.scale_by_muon(beta=0.0, nesterov=False, weight_dimension_numbers=Dims(1, 2))
    out, _ = jax.jit(tx.update)(jnp.asarray(stack), tx.init(jnp.asarray(stack)))
    np.testing.assert_allclose(np.asarray(out), np.stack([ns_reference(m) for m in stack]), rtol=0, atol=1e-10)


@pytest.mark.slow
def test_first_two_updates_match_the_numpy_reference():
    """Update 1 and 2 of the MoE model's stacked matrices through the whole chain: m_t = β m_{t−1} + (1 − β) g_t
    (optax's EMA), Nesterov m̂_t = β m_t/(1 − β^{t+1}) + (1 − β) g_t/(1 − β^t), per-layer and per-expert NS on the
    (fan_in, fan_out) matrix, × 0.2·√max(fan_in, fan_out), + λθ, × −η. Step 2 tells optax's momentum from the
    plain sum m_t = β m_{t−1} + g_t of modded-nanogpt's first versions (NS is scale-free, step 1 cannot). The
    gradients' norm stays below clip_norm, and NS's ε (against ‖m̂‖_F ≈ 0.01–0.03 per matrix) is in the reference."""
    lr, wd, beta = LR, WD, 0.95
    p = params64(MOE)
    g1, g2 = (jax.tree.map(lambda x: 1e-3 * x, normal_like(p, seed)) for seed in (1, 2))
    assert float(optax.tree.norm(g1)) < 1 and float(optax.tree.norm(g2)) < 1  # below clip_norm: not clipped
    tx, update = jitted("muon")
    u1, state = update(g1, tx.init(p), p)
    p2 = optax.apply_updates(p, u1)
    u2, _ = update(g2, state, p2)
    for key, n_batch, n_in in MATRICES:
        a, b = np.asarray(g1["blocks"][key]), np.asarray(g2["blocks"][key])
        m1 = (1 - beta) * a
        hat1 = beta * m1 / (1 - beta ** 2) + (1 - beta) * a / (1 - beta)
        m2 = beta * m1 + (1 - beta) * b
        hat2 = beta * m2 / (1 - beta ** 3) + (1 - beta) * b / (1 - beta ** 2)
        want1 = muon_leaf_reference(hat1, n_batch, n_in, lr, wd, p["blocks"][key])
        want2 = muon_leaf_reference(hat2, n_batch, n_in, lr, wd, p2["blocks"][key])
        np.testing.assert_allclose(np.asarray(u1["blocks"][key]), want1, rtol=0, atol=1e-10, err_msg=key)
        np.testing.assert_allclose(np.asarray(u2["blocks"][key]), want2, rtol=0, atol=1e-10, err_msg=key)
        summed = muon_leaf_reference(beta * (beta * a + b) + b, n_batch, n_in, lr, wd, p2["blocks"][key])
        assert np.abs(summed - want2).max() > 1e-5  # the sum convention would have failed
    orth = (np.asarray(u1["blocks"]["wq"]) + lr * wd * np.asarray(p["blocks"]["wq"])) / -lr
    rms = np.sqrt(np.mean(orth ** 2))
    assert 0.12 < rms < 0.22  # Liu et al.'s consistent RMS: 0.2 for an exactly orthogonal update


@pytest.mark.slow
def test_other_leaves_move_exactly_as_under_adamw():
    """Embeddings, unembedding and gains: three updates equal ``make_optimizer``'s for the same gradients,
    global clipping active (its norm is over all of θ in both chains)."""
    p = params64(MOE)
    (muon, muon_update), (adamw, adamw_update) = jitted("muon"), jitted("adamw")
    pm, pa, sm, sa = p, p, muon.init(p), adamw.init(p)
    for seed in range(3):
        g = jax.tree.map(lambda x: 10 * x, normal_like(p, seed))
        assert float(optax.tree.norm(g)) > 10  # clipping to 1.0 is active
        um, sm = muon_update(g, sm, pm)
        ua, sa = adamw_update(g, sa, pa)
        for path in (("embed",), ("unembed",), ("final_norm",), ("blocks", "attn_norm"), ("blocks", "ffn_norm")):
            got, want = um, ua
            for k in path:
                got, want = got[k], want[k]
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-12, atol=0, err_msg=str(path))
            assert np.abs(np.asarray(got)).max() > 1e-4
        assert np.abs(np.asarray(um["blocks"]["wq"]) - np.asarray(ua["blocks"]["wq"])).max() > 1e-4
        pm, pa = optax.apply_updates(pm, um), optax.apply_updates(pa, ua)


@pytest.mark.slow
def test_decay_reaches_weights_only():
    """A zero gradient: gains, biases, A_log, D and dt_bias stay exactly; the weights (Muon matrices, the
    AdamW tables, Mamba's conv kernel) move by exactly −η λ θ."""
    lr, wd = LR, WD
    p = params64(HYBRID)
    tx, update = jitted("muon")
    u, _ = update(jax.tree.map(jnp.zeros_like, p), tx.init(p), p)
    attn, mamba = u["blocks"]
    for leaf in (u["final_norm"], attn["attn_norm"], attn["ffn_norm"], mamba["ssm_norm"], mamba["A_log"],
                 mamba["D"], mamba["dt_bias"], mamba["conv_b"]):
        assert np.all(np.asarray(leaf) == 0)
    for got, w in ((u["embed"], p["embed"]), (u["unembed"], p["unembed"]), (attn["wq"], p["blocks"][0]["wq"]),
                   (mamba["in_x"], p["blocks"][1]["in_x"]), (mamba["conv_w"], p["blocks"][1]["conv_w"]),
                   (mamba["w_dt"], p["blocks"][1]["w_dt"])):
        np.testing.assert_allclose(np.asarray(got), -lr * wd * np.asarray(w), rtol=1e-12, atol=0)
        assert np.abs(np.asarray(w)).max() > 0.1


def test_routing_state_gets_a_zero_update_and_no_moments():
    """A small MoE-shaped tree (one stacked layer: compiles fast): the offsets get an exactly zero update and
    no optimizer state; the router (Muon) holds one moment, the gain and the table (AdamW) two each."""
    rng = np.random.default_rng(0)
    p = {"embed": jnp.asarray(rng.normal(size=(8, 4))),
         "blocks": {"ffn_norm": jnp.ones((1, 4)), "router": jnp.asarray(rng.normal(size=(1, 4, 3))),
                    "router_offset": jnp.asarray(rng.normal(size=(1, 3)))}}
    tx = make_muon(LR, weight_decay=WD)
    state = tx.init(p)
    u, _ = jax.jit(tx.update)(normal_like(p, 0), state, p)
    assert np.abs(np.asarray(u["blocks"]["router"])).max() > 1e-4
    assert u["blocks"]["router_offset"].shape == p["blocks"]["router_offset"].shape
    assert np.all(np.asarray(u["blocks"]["router_offset"]) == 0)
    dims = muon_dimension_numbers(p)["blocks"]
    muon_size = sum(x.size for k, x in p["blocks"].items() if dims[k] is not None)
    adam_size = sum(x.size for x in jax.tree.leaves(p)) - muon_size - p["blocks"]["router_offset"].size
    sizes = [x.size for x in jax.tree.leaves(state) if x.ndim > 0]
    assert sum(sizes) == muon_size + 2 * adam_size + len(NS)  # m per matrix, (m, v) per other leaf, NS coeffs
    assert not any(x.shape == p["blocks"]["router_offset"].shape for x in jax.tree.leaves(state))


def test_dimension_numbers_of_moe_hybrid_lora_and_reward_trees():
    moe = muon_dimension_numbers(params64(MOE))
    blocks = moe["blocks"]
    assert blocks["wq"] == Dims((1,), (2, 3)) and blocks["wk"] == Dims((1,), (2, 3))
    assert blocks["wo"] == Dims((1, 2), (3,))
    assert blocks["router"] == Dims((1,), (2,))
    for key in ("expert_gate", "expert_up", "expert_down", "shared_gate", "shared_up", "shared_down"):
        assert blocks[key] == Dims((2,), (3,)), key
    assert blocks["router_offset"] is None and blocks["ffn_norm"] is None and blocks["attn_norm"] is None
    assert moe["embed"] is None and moe["unembed"] is None and moe["final_norm"] is None

    hybrid_params = params64(HYBRID)
    attn, mamba = muon_dimension_numbers(hybrid_params)["blocks"]
    assert attn["wo"] == Dims((1, 2), (3,)) and attn["w_down"] == Dims((1,), (2,))
    assert mamba["in_x"] == Dims((1,), (2,)) and mamba["out_proj"] == Dims((1,), (2,))
    assert mamba["w_dt"] == Dims((1,), (2,)) and mamba["dt_proj"] == Dims((1,), (2,))
    for key in ("conv_w", "conv_b", "A_log", "D", "dt_bias", "ssm_norm"):
        assert mamba[key] is None, key

    adapters = lora_lib.init(hybrid_params, lora_lib.LoRAConfig(rank=2), jax.random.key(0))
    assert jax.tree.leaves(adapters) and all(d is None for d in jax.tree.leaves(
        muon_dimension_numbers(adapters), is_leaf=lambda x: x is None))
    reward = muon_dimension_numbers({"model": hybrid_params, "reward_head": jnp.zeros(16)})
    assert reward["reward_head"] is None and reward["model"]["blocks"][0]["wq"] == Dims((1,), (2, 3))
    unstacked = muon_dimension_numbers({"blocks": {"wq": jnp.zeros((16, 4, 4))}})  # not its stacked rank
    assert unstacked["blocks"]["wq"] is None


@pytest.mark.parametrize("kw, message", [
    (dict(beta=1.0), r"beta = 1.0 is invalid"),
    (dict(b2=-0.1), r"b2 = -0.1 is invalid"),
    (dict(ns_steps=0), r"ns_steps = 0 is invalid: it must be a positive integer"),
    (dict(ns_steps=2.5), r"ns_steps = 2.5 is invalid"),
    (dict(consistent_rms=0.0), r"consistent_rms = 0.0 is invalid: it must be a finite number > 0"),
    (dict(clip_norm=0), r"clip_norm = 0 is invalid: it must be > 0 or None"),
    (dict(weight_decay=-1), r"weight_decay = -1 is invalid"),
])
def test_invalid_arguments_name_the_value(kw, message):
    with pytest.raises(ConfigError, match=message):
        make_muon(0.01, **kw)


@pytest.mark.slow
def test_a_tiny_moe_model_trains_under_the_jitted_step():
    """Six jitted steps of the real train step (mixed swiglu/moe stack: a list of blocks, routing state) with
    Muon: the loss falls well below its start on a fixed batch, and the offsets still follow their rule."""
    from mlx_llm.train.step import init_state, make_train_step

    cfg = dataclasses.replace(tiny_cfg(), ffn_pattern=("moe", "swiglu"), n_experts=4, moe_top_k=2, moe_d_ff=16,
                              offset_rate=0.01)
    tcfg = TrainConfig(batch_size=2, seq_len=24, steps=6, warmup_steps=1, lr=1e-2, attention_impl="xla",
                       moe_impl="block", loss_chunk=0)
    tx = make_muon(tcfg.lr)
    rng = np.random.default_rng(0)
    toks = rng.integers(0, cfg.vocab_size, (2, 25))
    batch = {"tokens": jnp.asarray(toks[:, :-1], jnp.int32), "targets": jnp.asarray(toks[:, 1:], jnp.int32),
             "mask": jnp.ones((2, 24), jnp.float32), "segment_ids": jnp.zeros((2, 24), jnp.int32),
             "positions": jnp.tile(jnp.arange(24, dtype=jnp.int32), (2, 1))}
    state = init_state(cfg, tcfg, tx)
    step = jax.jit(make_train_step(cfg, tcfg, tx, platform="cpu"))
    losses = []
    for _ in range(tcfg.steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert all(np.isfinite(losses))
    assert losses[-1] < losses[0] - 0.5 and all(b < a for a, b in zip(losses, losses[1:])), losses
    assert np.abs(np.asarray(state.params["blocks"][0]["router_offset"])).max() > 0


@pytest.mark.slow
def test_the_run_optimizer_is_this_chain():
    """``--optimizer muon``: ``optimizer_for`` builds ``make_muon``'s chain (same updates, same state), with the
    run's schedule, clipping and decay; ``--skip-spikes`` wraps it like AdamW's."""
    from mlx_llm.train.optim import SpikeState
    from mlx_llm.train.step import optimizer_for, schedule_for

    cfg = tiny_cfg()
    tcfg = TrainConfig(steps=10, warmup_steps=2, lr=1e-2, weight_decay=0.1, clip_norm=0.5, optimizer="muon")
    params = params64(cfg)
    grads = normal_like(params, 3)
    ours, ref = optimizer_for(tcfg), make_muon(schedule_for(tcfg), weight_decay=0.1, clip_norm=0.5)
    s1, s2 = ours.init(params), ref.init(params)
    for _ in range(2):
        (u1, s1), (u2, s2) = ours.update(grads, s1, params), ref.update(grads, s2, params)
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), u1, u2)
    assert isinstance(optimizer_for(TrainConfig(optimizer="muon", skip_spikes=True)).init(params), SpikeState)
