"""PPO (post/ppo.py; U19 §12–§13's value network, clipped ratios and KL to the reference): GAE against a hand
loop, the clipped surrogate's gradients, the bandit's closed form, the settings' refusals, and the multi-update
training step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mlx_llm.errors import ConfigError
from mlx_llm.post import ppo, rl
from mlx_llm.runs.configs import RLConfig
from mlx_llm.train.optim import make_optimizer
from mlx_llm.train.step import TrainState, make_update, optimizer_for, schedule_for
from helpers import tiny_train

PI_REF, R = [0.5, 0.3, 0.2], [0.0, 1.0, 2.0]


def _hand_gae(r, v, m, gamma, lam):
    adv = np.zeros_like(r)
    for b in range(r.shape[0]):
        next_adv = next_v = 0.0
        for t in reversed(range(r.shape[1])):
            if not m[b, t]:
                next_adv = next_v = 0.0
                continue
            delta = r[b, t] + gamma * next_v - v[b, t]
            adv[b, t] = next_adv = delta + gamma * lam * next_adv
            next_v = v[b, t]
    return adv, m * (adv + v)


def test_gae_equals_the_recursion_written_out():
    """A_t = δ_t + γλ A_{t+1}, δ_t = r_t + γ V_{t+1} − V_t over each row's reply tokens (prompt before, padding
    after, V = 0 after the last reply token); λ = 1 gives the return minus the value, λ = 0 the one-step δ."""
    rng = np.random.default_rng(0)
    r, v = rng.normal(size=(3, 7)), rng.normal(size=(3, 7))
    m = np.zeros((3, 7))
    m[0, 2:5], m[1, 0:7], m[2, 4:6] = 1, 1, 1
    for gamma, lam in ((1.0, 0.95), (0.9, 0.5), (1.0, 1.0), (1.0, 0.0)):
        adv, ret = ppo.gae(jnp.asarray(r), jnp.asarray(v), jnp.asarray(m), gamma=gamma, lam=lam)
        want_adv, want_ret = _hand_gae(r, v, m, gamma, lam)
        np.testing.assert_allclose(np.asarray(adv), want_adv, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(np.asarray(ret), want_ret, rtol=1e-12, atol=1e-14)
    adv, _ = ppo.gae(jnp.asarray(r), jnp.asarray(v), jnp.asarray(m), gamma=1.0, lam=1.0)
    future = np.cumsum((r * m)[:, ::-1], axis=1)[:, ::-1]  # Σ_{u ≥ t} r_u within the reply
    np.testing.assert_allclose(np.asarray(adv), m * (future - v), rtol=1e-12, atol=1e-14)
    adv, _ = ppo.gae(jnp.asarray(r), jnp.asarray(v), jnp.asarray(m), gamma=1.0, lam=0.0)
    next_v = np.concatenate([v[:, 1:] * m[:, 1:], np.zeros((3, 1))], axis=1)
    np.testing.assert_allclose(np.asarray(adv), m * (r + next_v - v), rtol=1e-12, atol=1e-14)


def test_token_rewards_put_the_kl_on_every_token_and_the_reward_on_the_last():
    logp = jnp.log(jnp.array([[0.9, 0.5, 0.4, 0.3], [0.2, 0.6, 0.7, 0.8]]))
    ref = jnp.log(jnp.array([[0.9, 0.25, 0.8, 0.3], [0.2, 0.3, 0.7, 0.8]]))
    mask = jnp.array([[0, 1, 1, 0], [0, 1, 1, 1]])
    out = np.asarray(ppo.token_rewards(jnp.array([1.0, -2.0]), logp, ref, mask, 0.5))
    np.testing.assert_allclose(out, [[0, -0.5 * np.log(2), -0.5 * np.log(0.5) + 1.0, 0],
                                     [0, -0.5 * np.log(2), 0, -2.0]], rtol=1e-12, atol=1e-15)
    # summed over a reply: r(y) − β Σ_t log(π/π_ref), the leashed return of the group trainer (post/rl.py)
    np.testing.assert_allclose(out.sum(1), np.asarray(rl.shaped_rewards(jnp.array([1.0, -2.0]),
                                                                        jnp.sum(mask * logp, 1),
                                                                        jnp.sum(mask * ref, 1), 0.5)), rtol=1e-12)


def test_clipped_surrogate_stops_pushing_past_the_clip():
    """With A > 0 a ratio above 1 + ε gets no gradient (the surrogate is flat there); below it the unclipped term
    is the minimum and keeps its gradient A·ρ. With A < 0 the mirror image holds at 1 − ε."""
    def grad_of(ratio, adv):
        f = lambda lp: ppo.token_losses(lp, 0.0, adv, 0.0, 0.0, 0.0, clip=0.2, value_clip=0.2)["policy_loss"]
        return float(jax.grad(f)(jnp.log(ratio)))

    assert grad_of(1.5, 2.0) == 0.0 and grad_of(0.5, -2.0) == 0.0
    np.testing.assert_allclose(grad_of(0.5, 2.0), -2.0 * 0.5, rtol=1e-12)
    np.testing.assert_allclose(grad_of(1.1, 2.0), -2.0 * 1.1, rtol=1e-12)
    np.testing.assert_allclose(grad_of(1.5, -2.0), 2.0 * 1.5, rtol=1e-12)
    terms = ppo.token_losses(jnp.log(1.5), 0.0, 2.0, 0.0, 0.0, 0.0, clip=0.2, value_clip=0.2)
    assert float(terms["clip_fraction"]) == 1.0
    np.testing.assert_allclose(float(terms["policy_loss"]), -1.2 * 2.0, rtol=1e-12)
    np.testing.assert_allclose(float(terms["approx_kl"]), 0.5 - np.log(1.5), rtol=1e-12)


def test_value_loss_is_clipped_around_the_rollout_value():
    """½ max((V − G)², (V_old + clip(V − V_old, ±ε_V) − G)²): a value moved past ε_V toward the return gets no
    gradient; one moved away keeps it."""
    def value(v, old, ret):
        return ppo.token_losses(0.0, 0.0, 0.0, v, old, ret, clip=0.2, value_clip=0.2)["value_loss"]

    np.testing.assert_allclose(float(value(1.0, 0.0, 1.0)), 0.5 * 0.8 ** 2, rtol=1e-12)  # the clipped term wins
    assert float(jax.grad(value)(1.0, 0.0, 1.0)) == 0.0
    np.testing.assert_allclose(float(jax.grad(value)(0.1, 0.0, 1.0)), 0.1 - 1.0, rtol=1e-12)
    np.testing.assert_allclose(float(jax.grad(value)(-0.5, 0.0, 1.0)), -0.5 - 1.0, rtol=1e-12)


@pytest.mark.parametrize("beta", [1.0, 2.0])
def test_bandit_converges_to_the_closed_form(beta):
    """PPO on U19 §12's three answers (π_ref = (0.5, 0.3, 0.2), r = (0, 1, 2)), the KL to π_ref in the reward:
    π_θ ends at π* ∝ π_ref e^{r/β}, where every answer's shaped return is β ln Z and the advantages vanish."""
    trace = np.asarray(ppo.train_bandit(PI_REF, R, beta, k=16, steps=1500, lr=0.02, seed=1))
    want = np.asarray(rl.leash(jnp.asarray(PI_REF), jnp.asarray(R), beta)["pi"])
    assert np.abs(trace[0] - want).max() > 0.02  # the first rollout's 16 updates leave it far from π*
    np.testing.assert_allclose(trace[-1], want, atol=1e-3)
    np.testing.assert_allclose(trace[-300:].mean(0), want, atol=1e-3)


@pytest.mark.parametrize("fields, message", [
    (dict(clip=0.0), r"RLConfig.clip = 0.0 is invalid: it must be a finite number > 0"),
    (dict(clip=1.0), r"RLConfig.clip = 1.0 is invalid: it must be in \(0, 1\)"),
    (dict(epochs=0), r"RLConfig.epochs = 0 is invalid: it must be an integer >= 1"),
    (dict(minibatches=0), r"RLConfig.minibatches = 0 is invalid: it must be an integer >= 1"),
    (dict(value_coef=-0.1), r"RLConfig.value_coef = -0.1 is invalid: it must be a finite number >= 0"),
    (dict(value_clip=0.0), r"RLConfig.value_clip = 0.0 is invalid: it must be a finite number > 0"),
    (dict(gae_lambda=1.5), r"RLConfig.gae_lambda = 1.5 is invalid: it must be in \[0, 1\]"),
    (dict(algorithm="group", clip=0.2), r"RLConfig \['clip'\] apply to the clipped algorithms \['grpo', 'dr_grpo', "
                                        r"'dapo', 'gspo', 'ppo'\], not 'group'"),
    (dict(algorithm="grpo", value_coef=0.5), r"RLConfig \['value_coef'\] apply to algorithm 'ppo' only, not 'grpo'"),
    (dict(algorithm="trpo"), r"RLConfig.algorithm = 'trpo' is invalid: valid algorithms are \['group', 'grpo', "
                             r"'dr_grpo', 'dapo', 'gspo', 'ppo'\]"),
    (dict(algorithm="group", k=1), r"k = 1 is invalid: .* k must be an integer ≥ 2"),
])
def test_bad_settings_are_refused(fields, message):
    with pytest.raises(ConfigError, match=message):
        RLConfig(**{"task": "arithmetic", "algorithm": "ppo", **fields})


def test_defaults_and_json_round_trip():
    s = RLConfig(task="arithmetic", algorithm="ppo", k=1)
    assert (s.clip, s.epochs, s.minibatches, s.value_coef, s.value_clip, s.gae_lambda) == (0.2, 4, 4, 0.5, 0.2, 0.95)
    assert RLConfig.from_dict(s.to_dict()) == s
    assert RLConfig(task="arithmetic").clip is None  # the group trainer has no PPO settings


def test_several_updates_per_step_equal_single_updates_in_turn():
    """``make_update`` with 2 epochs of 1 minibatch is two AdamW updates on the whole batch at the step's
    learning rate (the epoch's row order only reorders sums); the state counts one step. With 2 minibatches each
    update sees half the rows."""
    def objective(params, frozen, batch, key):  # least squares, summed over rows
        err = batch["x"] @ params["w_up"] - batch["y"]
        return jnp.sum(err ** 2), (jnp.asarray(batch["x"].shape[0], jnp.float64), None, {})

    rng = np.random.default_rng(0)
    batch = {"x": jnp.asarray(rng.normal(size=(8, 3))), "y": jnp.asarray(rng.normal(size=(8, 2)))}
    tcfg = tiny_train(lr=0.1, warmup_steps=0, steps=4, weight_decay=0.0)
    opt = optimizer_for(tcfg, 2)
    params = {"w_up": jnp.zeros((3, 2), jnp.float64)}
    state = TrainState(step=jnp.asarray(0), params=params, opt_state=opt.init(params),
                       rng=jax.random.key_data(jax.random.key(0)), data_step=jnp.asarray(0))
    new, metrics = jax.jit(make_update(objective, tcfg, opt, epochs=2))(state, batch, None)
    assert int(new.step) == 1 and int(new.data_step) == 1
    lr0 = float(schedule_for(tcfg)(0))
    assert float(metrics["lr"]) == lr0 and float(schedule_for(tcfg)(1)) < lr0
    ref_opt = make_optimizer(lr0, b1=tcfg.b1, b2=tcfg.b2, weight_decay=0.0, clip_norm=tcfg.clip_norm)
    p, st = params, ref_opt.init(params)
    for _ in range(2):
        g = jax.grad(lambda q: objective(q, None, batch, None)[0] / 8)(p)
        u, st = ref_opt.update(g, st, p)
        p = optax.apply_updates(p, u)
    np.testing.assert_allclose(np.asarray(new.params["w_up"]), np.asarray(p["w_up"]), rtol=1e-10)
    halves = jax.jit(make_update(objective, tcfg, opt, minibatches=2))(state, batch, None)[1]
    assert float(halves["targets"]) == 4.0  # each of the two updates counted half the rows
