"""Every objective's hand gradient (mlx_llm.objectives.grads.losses) three ways with mlx_llm.gradcheck: against
jax.grad of the library's own loss function and against central differences, on tiny inputs."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mlx_llm.gradcheck import ANALYTIC_VS_AUTODIFF, check_grads, quick_jit
from mlx_llm.kernels.loss import chunked_token_nll_lse
from mlx_llm.objectives import diffusion, grads
from mlx_llm.objectives.loss import masked_cross_entropy, sequence_log_likelihood
from mlx_llm.ops import token_nll
from mlx_llm.post import dpo, ppo, reward, rl

RNG = np.random.default_rng(7)
B, T, V, D = 2, 5, 6, 4
LOGITS = 2.0 * RNG.standard_normal((B, T, V))
TARGETS = RNG.integers(0, V, (B, T))
MASK = np.array([[1, 0, 1, 1, 0], [0, 1, 1, 0, 1]])
REL = 1e-9  # the acceptance bound of analytic against jax.grad


def checked(f, params, analytic, *args, **kw):
    """check_grads (the hand gradient compiled once, not op by op), asserted to pass and to agree with jax.grad to
    ``REL``; returns the report."""
    report = check_grads(f, params, *args, analytic=quick_jit(analytic), **kw)
    report.assert_ok()
    assert report.max_rel(ANALYTIC_VS_AUTODIFF) <= REL
    return report


# ----- the next-token loss, z-loss and the chunked loss ------------------------------------------------------
def z_loss_mean(logits, weight):
    """The training step's loss per target (train.step.summed_loss_and_aux / n): CE + (W/n) Σ b ℓ²."""
    b = jnp.asarray(MASK, logits.dtype)
    return masked_cross_entropy(logits, TARGETS, MASK) + weight * jnp.sum(
        b * jax.nn.logsumexp(logits, axis=-1) ** 2) / jnp.sum(b)


@pytest.mark.parametrize("weight", [0.0, 0.3])
def test_cross_entropy_and_z_loss(weight):
    report = checked(lambda p: z_loss_mean(p["logits"], weight), {"logits": LOGITS},
                     lambda p: {"logits": grads.lm_loss_and_backward(p["logits"], TARGETS, MASK, weight)[1]})
    assert report.value == pytest.approx(float(grads.lm_loss_and_backward(LOGITS, TARGETS, MASK, weight)[0]),
                                         rel=1e-14)
    g_z = grads.z_loss_backward(LOGITS, MASK, weight)
    assert np.all(np.asarray(g_z)[MASK == 0] == 0.0)  # masked positions: no z-loss either


@pytest.mark.parametrize("chunk", [3, 4])
def test_chunked_loss_equals_the_dense_one_by_hand_and_through_its_custom_vjp(chunk):
    """Through kernels.loss's custom_vjp (so its backward is checked against central differences too)."""
    params = {"r": RNG.standard_normal((B, T, D)), "u": RNG.standard_normal((D, V))}
    b = jnp.asarray(MASK, jnp.float64)

    def chunked(p):
        nll, lse = chunked_token_nll_lse(p["r"], p["u"], jnp.asarray(TARGETS), chunk=chunk)
        return jnp.sum(b * (nll + 0.1 * lse**2)) / jnp.sum(b)

    def hand(p):
        _, g_r, g_u = grads.chunked_lm_loss_and_backward(p["r"], p["u"], TARGETS, MASK, chunk=chunk, z_loss=0.1)
        return {"r": g_r, "u": g_u}

    report = checked(chunked, params, hand)
    dense_loss, dense_g = grads.lm_loss_and_backward(params["r"] @ params["u"], TARGETS, MASK, 0.1)
    assert report.value == pytest.approx(float(dense_loss), rel=1e-13)
    np.testing.assert_allclose(hand(params)["u"], params["r"].reshape(-1, D).T @ dense_g.reshape(-1, V), atol=1e-14)


def test_sequence_log_likelihood():
    g_b = np.array([0.7, -1.3])
    checked(lambda p: jnp.sum(g_b * sequence_log_likelihood(p["logits"], TARGETS, MASK)), {"logits": LOGITS},
            lambda p: {"logits": grads.sequence_log_likelihood_backward(p["logits"], TARGETS, MASK, g_b)})


def test_masked_diffusion_nelbo():
    mask_id = V - 1
    tokens = RNG.integers(0, V - 1, (B, T))  # the clean sequence never holds MASK
    masked = np.array([[1, 1, 0, 1, 0], [0, 1, 1, 1, 1]], bool)
    t_b, maskable = np.array([0.4, 0.9]), np.ones((B, T))

    def loss(p):
        return jnp.sum(diffusion.nelbo_from_logits(p["logits"], tokens, masked, t_b, mask_id)) / maskable.sum()

    hand = lambda p: {"logits": grads.nelbo_loss_and_backward(p["logits"], tokens, masked, t_b, maskable,  # noqa: E731
                                                              mask_id)[1]}
    checked(loss, {"logits": LOGITS}, hand)
    g = np.asarray(hand({"logits": LOGITS})["logits"])
    assert np.all(g[..., mask_id] == 0.0) and np.all(g[~masked] == 0.0)  # MASK never predicted; unmasked free


# ----- preference and RL objectives --------------------------------------------------------------------------
def test_bradley_terry():
    params = {"chosen": RNG.standard_normal(4), "rejected": RNG.standard_normal(4)}
    checked(lambda p: jnp.sum(reward.bt_loss(p["chosen"], p["rejected"])), params,
            lambda p: dict(zip(("chosen", "rejected"), grads.bt_loss_backward(p["chosen"], p["rejected"]))))
    np.testing.assert_array_equal(grads.bt_loss_backward(params["chosen"], params["rejected"]),
                                  reward.bt_grads(params["chosen"], params["rejected"]))


def test_reward_head():
    last, head, g_b = RNG.standard_normal((3, D)), RNG.standard_normal(D), RNG.standard_normal(3)
    checked(lambda p: jnp.sum(g_b * (p["last"] @ p["head"])), {"last": last, "head": head},
            lambda p: dict(zip(("last", "head"), grads.reward_head_backward(p["last"], p["head"], g_b))))


def test_dpo():
    params = {name: RNG.standard_normal(4) - 3.0 for name in ("lp_chosen", "lp_rejected", "ref_chosen",
                                                              "ref_rejected")}
    checked(lambda p: jnp.sum(dpo.dpo_loss(**p, beta=0.5)), params,
            lambda p: grads.dpo_loss_backward(**p, beta=0.5))


@pytest.mark.parametrize("output", ["objective", "expected_reward", "kl"])
def test_kl_leash_closed_form(output):
    params = {"pi_ref": np.array([0.5, 0.3, 0.2]), "rewards": np.array([1.0, 0.2, -0.5])}
    checked(lambda p: rl.leash(p["pi_ref"], p["rewards"], 0.7)[output], params,
            lambda p: {k: v for k, v in grads.leash_backward(p["pi_ref"], p["rewards"], 0.7)[output].items()
                       if k != "beta"})


def test_kl_leash_beta_derivatives_by_central_differences():
    """β is a Python number in ``leash`` (validated), so its derivative is checked by differences here."""
    pi_ref, r, beta, h = np.array([0.5, 0.3, 0.2]), np.array([1.0, 0.2, -0.5]), 0.7, 1e-4
    by_hand = grads.leash_backward(pi_ref, r, beta)
    for output in ("objective", "expected_reward", "kl"):
        at = [float(rl.leash(pi_ref, r, beta + s * h)[output]) for s in (2, 1, -1, -2)]
        fd = (8 * (at[1] - at[2]) - (at[0] - at[3])) / (12 * h)
        assert float(by_hand[output]["beta"]) == pytest.approx(fd, rel=1e-9, abs=1e-11), output
    assert float(by_hand["objective"]["beta"]) == pytest.approx(-float(rl.leash(pi_ref, r, beta)["kl"]), rel=1e-14)


def test_group_baseline_loss():
    """A REINFORCE surrogate: its gradient holds the advantages fixed (stop_gradient), so it is not the derivative
    of its value; analytic against jax.grad on the real loss, and three ways with the advantages as fixed inputs."""
    logp, logp_ref, r = RNG.standard_normal((2, 3)), RNG.standard_normal((2, 3)), RNG.standard_normal((2, 3))
    params = {"logp": logp, "logp_ref": logp_ref, "r": r}
    hand = lambda p: dict(zip(("logp", "logp_ref", "r"), grads.leashed_loss_backward(  # noqa: E731
        p["logp"], p["logp_ref"], p["r"], 0.3)))
    report = checked(lambda p: rl.leashed_loss(p["logp"], p["logp_ref"], p["r"], 0.3)[0], params, hand,
                     central=False)
    assert all(set(comps) == {ANALYTIC_VS_AUTODIFF} for comps in report.leaves.values())
    adv = rl.group_advantages(rl.shaped_rewards(r, logp, logp_ref, 0.3))
    checked(lambda p: rl.policy_loss(p["logp"], adv), {"logp": logp}, lambda p: {"logp": hand(params)["logp"]})


def test_ppo_clipped_surrogate_and_value_loss():
    """Ratios inside and outside [1 − ε, 1 + ε] with both signs of A; values inside and outside ±ε_V."""
    old_logp = np.log(np.full(8, 0.3))
    logp = old_logp + np.array([0.05, -0.05, 0.5, -0.5, 0.5, -0.5, 0.1, -0.12])
    adv = np.array([1.0, -1.0, 1.0, 1.0, -1.0, -1.0, 0.4, -0.7])
    old_values, returns = np.zeros(8), np.array([1.0, -1.0, 0.3, -0.2, 2.0, 0.1, -0.5, 0.05])
    values = np.array([0.1, -0.1, 0.5, -0.6, 0.9, 0.4, -0.3, 0.35])
    weights = RNG.uniform(0.5, 1.5, 8)

    def loss(p):
        terms = ppo.token_losses(p["logp"], old_logp, adv, p["values"], old_values, returns, clip=0.2, value_clip=0.2)
        return jnp.sum(weights * (terms["policy_loss"] + 0.5 * terms["value_loss"]))

    def hand(p):
        g_logp, g_values = grads.ppo_backward(p["logp"], old_logp, adv, p["values"], old_values, returns, clip=0.2,
                                              value_clip=0.2, g_policy=weights, g_value=0.5 * weights)
        return {"logp": g_logp, "values": g_values}

    checked(loss, {"logp": logp, "values": values}, hand)
    g = hand({"logp": logp, "values": values})
    assert np.count_nonzero(np.asarray(g["logp"]) == 0.0) == 2 and np.count_nonzero(np.asarray(g["values"]) == 0) == 2


def test_gae_dependence_on_values_and_rewards():
    mask = np.array([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]])
    rewards, values = RNG.standard_normal((B, T)), RNG.standard_normal((B, T))
    g_adv, g_ret = RNG.standard_normal((B, T)), RNG.standard_normal((B, T))

    def loss(p):
        adv, ret = ppo.gae(p["rewards"], p["values"], jnp.asarray(mask), gamma=0.9, lam=0.8)
        return jnp.sum(g_adv * adv + g_ret * ret)

    hand = lambda p: dict(zip(("rewards", "values"), grads.gae_backward(  # noqa: E731
        p["rewards"], p["values"], mask, g_adv, g_ret, gamma=0.9, lam=0.8)))
    checked(loss, {"rewards": rewards, "values": values}, hand)
    assert np.all(np.asarray(hand({"rewards": rewards, "values": values})["rewards"])[mask == 0] == 0.0)


def test_token_nll_is_what_the_losses_differentiate():
    """The dense next-token hand gradient is M20 §11's (b/n)(p − 1[v = y]) on every row (a sanity anchor)."""
    g = grads.lm_loss_and_backward(LOGITS, TARGETS, MASK)[1]
    np.testing.assert_allclose(np.asarray(g).sum(-1), 0.0, atol=1e-15)
    assert float(grads.lm_loss_and_backward(LOGITS, TARGETS, MASK)[0]) == pytest.approx(
        float(np.sum(MASK * np.asarray(token_nll(LOGITS, TARGETS))) / MASK.sum()), rel=1e-14)
    assert math.isfinite(float(g.sum()))
