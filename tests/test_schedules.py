"""Warmup-stable-decay (optim.warmup_stable_decay), spike skipping (optim.skip_spikes) and the z-loss, each
against the formula it implements."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import tiny_cfg, tiny_train
from mlx_llm.config import TrainConfig
from mlx_llm.errors import ConfigError
from mlx_llm.model import init_params, logits_from_hidden, hidden_states
from mlx_llm.train.optim import SPIKE_WARMUP, SpikeState, skip_spikes, warmup_cosine, warmup_stable_decay
from mlx_llm.train.step import schedule_for, summed_loss_and_aux


def wsd_by_hand(s, peak, W, S, F, f, shape):
    D = max(1, round(F * S))
    if s < W:
        return peak * (s + 1) / W
    if s < S - D:
        return peak
    p = min((s - (S - D)) / D, 1.0)
    fall = math.sqrt(p) if shape == "1-sqrt" else p
    return peak * (f + (1 - f) * (1 - fall))


@pytest.mark.parametrize("shape", ["1-sqrt", "linear"])
@pytest.mark.parametrize("W,S,F", [(10, 100, 0.2), (0, 50, 0.5), (3, 7, 0.3)])
def test_wsd_follows_its_formula(shape, W, S, F):
    sched = warmup_stable_decay(3e-3, W, S, F, 0.1, shape)
    for s in range(S + 3):
        assert float(sched(s)) == pytest.approx(wsd_by_hand(s, 3e-3, W, S, F, 0.1, shape), rel=1e-12), s


def test_wsd_is_flat_until_its_decay_and_shares_the_warmup_with_cosine():
    wsd, cos = warmup_stable_decay(1e-3, 10, 100, 0.2), warmup_cosine(1e-3, 10, 100)
    assert [float(wsd(s)) for s in range(10)] == [float(cos(s)) for s in range(10)]
    assert {float(wsd(s)) for s in range(10, 80)} == {1e-3}
    assert float(wsd(80)) == 1e-3 and float(wsd(81)) < 1e-3 and float(wsd(100)) == pytest.approx(1e-4)
    # the stable phase is the same whatever the total: what branching relies on
    longer = warmup_stable_decay(1e-3, 10, 400, 0.2)
    assert [float(longer(s)) for s in range(80)] == [float(wsd(s)) for s in range(80)]


def test_the_run_schedule_is_the_configs():
    tcfg = TrainConfig(steps=40, warmup_steps=4, lr=2e-3, schedule="wsd", decay_fraction=0.25, decay_shape="linear")
    assert tcfg.decay_steps == 10
    assert [float(schedule_for(tcfg)(s)) for s in range(41)] == pytest.approx(
        [wsd_by_hand(s, 2e-3, 4, 40, 0.25, 0.1, "linear") for s in range(41)], rel=1e-12)


@pytest.mark.parametrize("fields,message", [
    (dict(schedule="wsd", steps=10, warmup_steps=9, decay_fraction=0.2), "exceed steps = 10"),
    (dict(decay_fraction=1.0), "decay_fraction = 1.0 is invalid"),
    (dict(decay_fraction=0.0), "decay_fraction = 0.0 is invalid"),
    (dict(schedule="step"), "TrainConfig.schedule = 'step' is invalid"),
    (dict(decay_shape="cosine"), "decay_shape = 'cosine' is invalid"),
    (dict(spike_factor=1.0), "spike_factor = 1.0 is invalid"),
    (dict(z_loss=-1e-4), "z_loss = -0.0001 is invalid"),
    (dict(z_loss=1e-4, objective="diffusion"), "z-loss"),
    (dict(watch_interval=-1), "watch_interval = -1 is invalid"),
    (dict(optimizer="sgd"), "TrainConfig.optimizer = 'sgd' is invalid"),
])
def test_bad_workflow_settings_are_named(fields, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**fields)


# ----- spike skipping ---------------------------------------------------------------------------------------
def _spiky(factor=4.0):
    return skip_spikes(optax.sgd(0.1, momentum=0.9), factor)


def test_a_spike_is_skipped_with_no_step_and_untouched_moments():
    opt = _spiky()
    params = {"w": jnp.ones(3)}
    state = opt.init(params)
    norms = []
    for i in range(SPIKE_WARMUP + 2):
        g = {"w": jnp.full(3, 1.0 + 0.01 * i)}
        updates, state = opt.update(g, state, params)
        norms.append(float(jnp.linalg.norm(g["w"])))
        assert float(jnp.abs(updates["w"]).sum()) > 0
    assert int(state.skipped) == 0 and int(state.accepted) == SPIKE_WARMUP + 2
    ema = sum(0.01 * 0.99 ** (len(norms) - 1 - i) * n for i, n in enumerate(norms))
    assert float(state.norm_ema) == pytest.approx(ema, rel=1e-6)
    mean = ema / (1 - 0.99 ** len(norms))
    spike = {"w": jnp.full(3, 4.01 * mean / math.sqrt(3))}  # just above 4 × the running mean
    updates, after = opt.update(spike, state, params)
    assert float(jnp.abs(updates["w"]).sum()) == 0.0
    assert int(after.skipped) == 1 and int(after.accepted) == int(state.accepted)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), after.inner, state.inner)
    assert float(after.norm_ema) == float(state.norm_ema)
    below = {"w": jnp.full(3, 3.99 * mean / math.sqrt(3))}  # just below: taken
    updates, taken = opt.update(below, state, params)
    assert float(jnp.abs(updates["w"]).sum()) > 0 and int(taken.skipped) == 0


def test_no_update_is_skipped_in_the_warmup_and_a_nan_is_not_hidden():
    opt = _spiky()
    params = {"w": jnp.ones(2)}
    state = opt.init(params)
    for g in (1.0, 1000.0, 1.0):  # a huge early gradient is taken: the mean has too few samples
        updates, state = opt.update({"w": jnp.full(2, g)}, state, params)
        assert float(jnp.abs(updates["w"]).sum()) > 0
    for _ in range(SPIKE_WARMUP):
        _, state = opt.update({"w": jnp.ones(2)}, state, params)
    updates, state = opt.update({"w": jnp.full(2, jnp.nan)}, state, params)
    assert bool(jnp.isnan(updates["w"]).all()) and int(state.skipped) == 0  # the loop's divergence check sees it


@pytest.mark.slow
def test_skip_spikes_sits_in_the_run_optimizer_and_reports_its_count():
    from mlx_llm.train.step import init_state, make_train_step, optimizer_for

    cfg = tiny_cfg()
    tcfg = tiny_train(skip_spikes=True, spike_factor=3.0, steps=4)
    opt = optimizer_for(tcfg)
    state = init_state(cfg, tcfg, opt)
    assert isinstance(state.opt_state, SpikeState)
    step = jax.jit(make_train_step(cfg, tcfg, opt))
    batch = _batch(cfg)
    state, m = step(state, batch)
    assert int(m["spikes_skipped"]) == 0


def _batch(cfg, B=2, T=8, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab_size, (B, T + 1))
    return {"tokens": jnp.asarray(tokens[:, :-1], jnp.int32), "targets": jnp.asarray(tokens[:, 1:], jnp.int32),
            "mask": jnp.ones((B, T), jnp.float32).at[0, :3].set(0.0),
            "segment_ids": jnp.ones((B, T), jnp.int32), "positions": jnp.tile(jnp.arange(T, dtype=jnp.int32), (B, 1))}


# ----- z-loss ------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("chunk", [0, 5])
def test_z_loss_adds_w_log_z_squared_and_its_gradient(chunk):
    from mlx_llm.kernels import Kernels

    cfg = tiny_cfg()
    params = jax.tree.map(lambda a: a.astype(jnp.float64), init_params(cfg, jax.random.key(1)))
    batch = {**_batch(cfg), "mask": _batch(cfg)["mask"].astype(jnp.float64)}
    kernels = Kernels(attention_impl="xla", moe_impl="block", loss_chunk=chunk).resolve("cpu")
    w = 1e-2

    def by_hand(p):
        h = hidden_states(p, batch["tokens"], cfg, positions_BT=batch["positions"],
                          segment_ids_BT=batch["segment_ids"])
        logits = logits_from_hidden(h, p, cfg)
        lse = jax.nn.logsumexp(logits, axis=-1)
        nll = lse - jnp.take_along_axis(logits, batch["targets"][..., None], axis=-1)[..., 0]
        return jnp.sum(batch["mask"] * (nll + w * lse ** 2)), jnp.sum(batch["mask"] * w * lse ** 2)

    def ours(p):
        total, (n, (_, extras)) = summed_loss_and_aux(p, batch, cfg, jnp.float64, kernels=kernels, z_loss=w)
        z = extras["z_loss"]
        return total, z

    (want, want_z), want_g = jax.value_and_grad(by_hand, has_aux=True)(params)
    (got, got_z), got_g = jax.value_and_grad(ours, has_aux=True)(params)
    assert float(got) == pytest.approx(float(want), rel=1e-12) and float(got_z) == pytest.approx(float(want_z), rel=1e-12)
    assert float(got_z) > 0
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12), got_g, want_g)
    plain = jax.grad(lambda p: summed_loss_and_aux(p, batch, cfg, jnp.float64, kernels=kernels)[0])(params)
    assert float(optax.tree.norm(jax.tree.map(jnp.subtract, got_g, plain))) > 1e-6  # it changes the update


@pytest.mark.slow
def test_the_step_reports_the_z_loss_inside_the_loss():
    from mlx_llm.train.step import init_state, make_train_step, optimizer_for

    cfg = tiny_cfg()
    batch = _batch(cfg)
    metrics = {}
    for w in (0.0, 1e-2):
        tcfg = tiny_train(z_loss=w)
        opt = optimizer_for(tcfg)
        _, metrics[w] = jax.jit(make_train_step(cfg, tcfg, opt))(init_state(cfg, tcfg, opt), batch)
    assert "z_loss" not in metrics[0.0] and float(metrics[1e-2]["z_loss"]) > 0
    assert float(metrics[1e-2]["loss"]) - float(metrics[1e-2]["z_loss"]) == pytest.approx(float(metrics[0.0]["loss"]),
                                                                                        rel=1e-6)  # float32 step


@pytest.mark.parametrize("steps", [1, 2, 3, 10, 37, 700])
def test_a_sized_wsd_run_keeps_room_for_its_decay(steps):
    """``--time-budget`` / ``--target-flops`` cap the warmup; under wsd also to leave the decay its steps."""
    from mlx_llm.train.lm import with_steps

    sized = with_steps(TrainConfig(steps=700, warmup_steps=30, schedule="wsd"), steps)
    assert sized.steps == steps and sized.warmup_steps + sized.decay_steps <= steps
    assert sized.warmup_steps == min(30, steps - 1, steps - max(1, round(0.2 * steps)))
