"""The estimator of on-policy RL (post/estimator.py, objectives/preference.py): Schulman's KL estimators and their
expected gradients in closed form, the group baselines, the asymmetric clip, GSPO's sequence ratio, importance
weights, loss aggregation, the first update's gradient of every algorithm checked three ways, the settings'
refusals, and rollouts whose log-probabilities agree with the trainer's (ratio 1 on-policy at temperature 1, the
kept mass with top-p)."""

import itertools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mlx_llm import init_params
from mlx_llm.config import TrainConfig
from mlx_llm.data.chat import ChatTemplate
from mlx_llm.data.tokenizer import ByteTokenizer
from mlx_llm.decode.sampling import top_p_mask
from mlx_llm.errors import ConfigError
from mlx_llm.gradcheck import check_grads, quick_jit
from mlx_llm.model import forward
from mlx_llm.objectives import preference as pref
from mlx_llm.post import bandit, estimator, prologue, rl
from mlx_llm.runs.configs import CLIPPED, KL_PLACEMENTS, RL_ALGORITHMS, EstimatorConfig, RLConfig
from helpers import TINY, cli_in_process, snapshot

RNG = np.random.default_rng(3)
f64 = lambda x: jnp.asarray(x, jnp.float64)  # noqa: E731


# ----- the KL estimators ---------------------------------------------------------------------------------------
def test_kl_estimators_their_means_and_the_gradients_they_give_as_loss_terms():
    """Schulman (2020), exact over a 4-token π = softmax θ: E_π[k1] = E_π[k3] = KL(π ‖ π_ref) (unbiased), E_π[k2] ≠ KL;
    as loss terms differentiated through log π(y) at samples y ∼ π, E_π[∇k1] = 0, E_π[∇k2] = ∇KL(π ‖ π_ref) and
    E_π[∇k3] = ∇KL(π_ref ‖ π) = π − π_ref."""
    theta, ref = f64([0.3, -1.0, 0.8, 0.1]), jax.nn.log_softmax(f64([0.0, 0.5, -0.2, 0.4]))
    pi, pi_ref = jax.nn.softmax(theta), jnp.exp(ref)
    kl = float(jnp.sum(pi * (jnp.log(pi) - ref)))
    for kind in ("k1", "k3"):
        assert float(jnp.sum(pi * pref.kl_estimate(jnp.log(pi), ref, kind))) == pytest.approx(kl, rel=1e-13)
    assert abs(float(jnp.sum(pi * pref.kl_estimate(jnp.log(pi), ref, "k2"))) - kl) > 1e-3
    x = 0.4  # the values at log π_ref − log π = x
    np.testing.assert_allclose([float(pref.kl_estimate(0.0, x, k)) for k in ("k1", "k2", "k3")],
                               [-x, x * x / 2, np.exp(x) - 1 - x], rtol=1e-14)

    def expected_grad(kind):  # Σ_y π(y) ∇_θ k(log π_θ(y), log π_ref(y)), π(y) held as the sampling weight
        return jax.grad(lambda t: jnp.sum(jax.lax.stop_gradient(pi) * pref.kl_estimate(
            jax.nn.log_softmax(t), ref, kind)))(theta)

    reverse = jax.grad(lambda t: jnp.sum(jax.nn.softmax(t) * (jax.nn.log_softmax(t) - ref)))(theta)
    np.testing.assert_allclose(expected_grad("k1"), 0.0, atol=1e-15)
    np.testing.assert_allclose(expected_grad("k2"), reverse, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(expected_grad("k3"), pi - pi_ref, rtol=1e-12, atol=1e-15)
    assert np.abs(np.asarray(reverse - (pi - pi_ref))).max() > 1e-2  # the two KLs' gradients differ here


def test_group_baselines_and_the_std_division():
    r = f64([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0], [3.0, 0.0, 1.0, 0.0]])
    loo, mean = pref.group_advantages(r, "loo"), pref.group_advantages(r, "mean")
    np.testing.assert_allclose(mean, loo * 3 / 4, rtol=1e-14, atol=1e-15)  # (k − 1)/k × leave-one-out
    np.testing.assert_allclose(mean[0], [0.5, -0.5, -0.5, 0.5], rtol=1e-14)
    scaled = pref.group_advantages(r, "mean", scale=True)
    std = np.std(np.asarray(r), axis=1, ddof=1, keepdims=True)
    np.testing.assert_allclose(scaled, np.asarray(mean) / (std + pref.STD_EPS), rtol=1e-14)
    for adv in (loo, mean, scaled):
        np.testing.assert_array_equal(np.asarray(adv)[1], 0.0)  # a group of equal rewards teaches nothing


def test_the_asymmetric_clip_stops_pushing_past_its_own_side():
    """DAPO's clip-higher: with A > 0 a ratio above 1 + ε_high gets no gradient, with A < 0 one below 1 − ε_low;
    between them the unclipped −ρA is the loss; without a clip it is −ρA everywhere."""
    def grad(ratio, adv, low=0.2, high=0.28):
        return float(jax.grad(lambda lr: pref.clipped_surrogate(lr, adv, low, high)[0])(jnp.log(ratio)))

    assert grad(1.3, 1.0) == 0.0 and grad(0.7, -1.0) == 0.0
    assert grad(1.25, 1.0) == pytest.approx(-1.25, rel=1e-12)  # inside the higher side: 1.25 < 1.28
    assert grad(0.75, 1.0) == pytest.approx(-0.75, rel=1e-12) and grad(1.3, -1.0) == pytest.approx(1.3, rel=1e-12)
    assert grad(1.3, 1.0, None, None) == pytest.approx(-1.3, rel=1e-12)
    value, clipped = pref.clipped_surrogate(jnp.log(f64([1.3, 0.7, 1.1])), f64([1.0, -1.0, 1.0]), 0.2, 0.28)
    np.testing.assert_allclose(value, [-1.28, 0.8, -1.1], rtol=1e-13)
    np.testing.assert_array_equal(clipped, [1.0, 1.0, 0.0])


def test_gspo_ratio_is_the_replys_length_normalised_ratio_with_token_gradients():
    """log s = mean over the reply's tokens of log ρ_t on every token; the reply's token mean of s·A has the
    gradient of s·A itself (GSPO-token at sequence aggregation is GSPO)."""
    logp, old = f64(RNG.normal(size=(2, 4))), f64(RNG.normal(size=(2, 4)))
    mask = f64([[1, 1, 1, 0], [0, 1, 1, 1]])
    value = pref.sequence_log_ratio(logp - old, mask)
    want = np.sum(np.asarray(mask * (logp - old)), 1) / 3
    np.testing.assert_allclose(value, np.broadcast_to(want[:, None], (2, 4)), rtol=1e-13)
    adv = f64([0.7, -1.2])

    def token_mean(lp):
        s = jnp.exp(pref.sequence_log_ratio(lp - old, mask))
        return jnp.sum(mask * s * adv[:, None] / 3)

    def whole(lp):
        return jnp.sum(jnp.exp(jnp.sum(mask * (lp - old), 1) / 3) * adv)

    np.testing.assert_allclose(jax.grad(token_mean)(logp), jax.grad(whole)(logp), rtol=1e-12, atol=1e-15)


def test_importance_weights_truncated_and_masked_per_token_and_per_reply():
    log_w = np.log([[0.5, 3.0, 1.5, 9.0], [2.5, 0.2, 1.0, 1.0]])
    logp, logq, mask = f64(log_w), f64(np.zeros((2, 4))), f64([[1, 1, 1, 0], [1, 1, 0, 0]])
    w = lambda kind, level: np.asarray(pref.importance_weights(logp, logq, mask, kind, 2.0, level))  # noqa: E731
    np.testing.assert_allclose(w("tis", "token"), [[0.5, 2.0, 1.5, 0], [2.0, 0.2, 0, 0]], rtol=1e-13)
    np.testing.assert_allclose(w("mis", "token"), [[0.5, 0.0, 1.5, 0], [0.0, 0.2, 0, 0]], rtol=1e-13)
    np.testing.assert_allclose(w("tis", "sequence"), [[2.0, 2.0, 2.0, 0], [0.5, 0.5, 0, 0]], rtol=1e-13)
    np.testing.assert_allclose(w("mis", "sequence"), [[0, 0, 0, 0], [0.5, 0.5, 0, 0]], rtol=1e-13)
    np.testing.assert_array_equal(w("none", "token"), mask)
    assert float(jnp.sum(jax.grad(lambda lp: jnp.sum(pref.importance_weights(lp, logq, mask, "tis", 2.0,
                                                                            "token")))(logp) ** 2)) == 0.0


def test_loss_aggregations():
    """token: Σ ℓ / (reply tokens); sequence: the mean over replies of each reply's token mean; seq-mean-token-sum:
    the mean over replies of each reply's token sum. A row without reply tokens counts as no reply."""
    ell = f64(RNG.normal(size=(3, 4)))
    mask = f64([[1, 1, 1, 0], [0, 1, 0, 0], [0, 0, 0, 0]])
    m, e = np.asarray(mask), np.asarray(ell)
    want = {"token": (m * e).sum() / 4, "sequence": ((m * e)[:2].sum(1) / m[:2].sum(1)).mean(),
            "seq-mean-token-sum": (m * e)[:2].sum(1).mean()}
    for how, value in want.items():
        weights, count = pref.aggregation_weights(mask, how)
        assert float(jnp.sum(weights * ell) / count) == pytest.approx(value, rel=1e-13), how


# ----- the estimator: rollout and the first update's gradient -----------------------------------------------------
P, K, T = 2, 3, 4
MASK = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 0, 0]], np.float64)
REWARD = np.array([1.0, 0.0, 1.0, 0.0, 0.0, 0.0])


def rollout_inputs(seed=0):
    rng = np.random.default_rng(seed)
    logp, ref = np.log(rng.uniform(0.1, 0.9, (P * K, T))), np.log(rng.uniform(0.1, 0.9, (P * K, T)))
    return MASK * logp, MASK * ref, MASK * (logp + 0.05 * rng.normal(size=(P * K, T)))


def settings(algorithm, kl, **kw):
    beta = {} if kl == "none" else {"beta": 0.3}
    return EstimatorConfig(algorithm=algorithm, kl=kl, k=K, **beta, **kw)


def test_rollout_advantages_of_each_algorithm():
    logp, ref, logq = rollout_inputs()
    reply_kl = np.sum(MASK * (logp - ref), 1)
    for algorithm in ("group", "grpo", "dr_grpo", "dapo", "gspo"):
        for kl in ("reward-k1", "loss-k3"):
            s = settings(algorithm, kl)
            batch, metrics = estimator.rollout(s, f64(REWARD), f64(logp), f64(ref), f64(logq), f64(MASK))
            shaped = REWARD - 0.3 * reply_kl if kl == "reward-k1" else REWARD
            r = shaped.reshape(P, K)
            if algorithm == "group":
                adv = r - (r.sum(1, keepdims=True) - r) / (K - 1)
            else:
                adv = r - r.mean(1, keepdims=True)
                if algorithm != "dr_grpo":
                    adv = adv / (r.std(1, ddof=1, keepdims=True) + pref.STD_EPS)
            np.testing.assert_allclose(batch["adv"], adv.reshape(-1, 1) * MASK, rtol=1e-12, atol=1e-14)
            assert float(metrics["kl"]) == pytest.approx(reply_kl.mean(), rel=1e-13)
    s = settings("ppo", "reward-k1", gae_lambda=0.9)
    values = f64(RNG.normal(size=(P * K, T)))
    batch, _ = estimator.rollout(s, f64(REWARD), f64(logp), f64(ref), f64(logq), f64(MASK), values)
    adv, ret = pref.gae(pref.token_rewards(f64(REWARD), f64(logp), f64(ref), f64(MASK), 0.3), values, f64(MASK),
                        lam=0.9)
    np.testing.assert_allclose(batch["adv"], adv, rtol=1e-13)
    np.testing.assert_allclose(batch["ret"], ret, rtol=1e-13)


def test_rollout_ratio_metrics_and_dynamic_sampling():
    """is_ratio_mean / is_ratio_max / logprob_gap over the reply tokens; dynamic sampling takes the groups whose
    rewards are all equal out of the mask (the second group here)."""
    logp, ref, logq = rollout_inputs()
    s = settings("dapo", "none")
    keep = estimator.spread_groups(f64(REWARD), K)
    np.testing.assert_array_equal(keep, [True] * 3 + [False] * 3)
    batch, metrics = estimator.rollout(s, f64(REWARD), f64(logp), f64(ref), f64(logq), f64(MASK), keep_B=keep)
    ratio = np.exp(logp - logq)[MASK > 0]
    assert float(metrics["is_ratio_mean"]) == pytest.approx(ratio.mean(), rel=1e-13)
    assert float(metrics["is_ratio_max"]) == pytest.approx(ratio.max(), rel=1e-13)
    assert float(metrics["logprob_gap"]) == pytest.approx(np.abs(np.log(ratio)).mean(), rel=1e-12)
    np.testing.assert_array_equal(batch["mask"], MASK * np.repeat([1.0, 0.0], 3)[:, None])


@pytest.mark.parametrize("algorithm, kl, importance", [
    *[(a, kl, "none") for a in RL_ALGORITHMS if a != "ppo" for kl in ("reward-k1", "loss-k1", "loss-k2", "loss-k3")],
    ("grpo", "loss-k3", "tis"), ("dapo", "none", "mis"), ("gspo", "none", "tis"), ("group", "reward-k1", "tis")])
def test_first_update_gradient_is_the_weighted_advantage_plus_the_kl_term(algorithm, kl, importance):
    """At the rollout's own parameters (ρ = 1) the loss's gradient with respect to log π_θ of each reply token is
    a_t · w_t · (−A_t + β ∂k/∂log π): REINFORCE with the algorithm's advantage, the importance weight w and the
    KL term's derivative (k1: 1, k2: log π − log π_ref, k3: 1 − π_ref/π), a_t the aggregation weight / count.
    Three ways: the advantages and weights are the rollout's constants, and inside the clip (and for GSPO's
    s = e^{mean log ρ}, whose token derivatives are s/|y|) the loss's value has exactly this gradient. (GSPO's
    clip, 1 − 3e-4 … 1 + 4e-4, is narrower than a finite difference's step in ρ: jax.grad against the hand
    gradient only.)"""
    logp, ref, logq = rollout_inputs(1)
    extra = {} if importance == "none" else {"importance": importance, "is_cap": 1.02}
    s = settings(algorithm, kl, **extra)
    batch, _ = estimator.rollout(s, f64(REWARD), f64(logp), f64(ref), f64(logq), f64(MASK))
    weights, count = pref.aggregation_weights(f64(MASK), s.loss_aggregation)
    dk = {"k1": np.ones_like(logp), "k2": logp - ref, "k3": 1 - np.exp(ref - logp)}

    def hand(params):
        d = -np.asarray(batch["adv"])
        if kl.startswith("loss-"):
            d = d + 0.3 * dk[kl[-2:]]
        return {"logp": np.asarray(weights) * np.asarray(batch["is_weight"]) * d / float(count)}

    def loss(params):
        total, n, _ = estimator.loss(s, params["logp"], batch)
        return total / n

    report = check_grads(loss, {"logp": f64(logp)}, analytic=quick_jit(hand), central=algorithm != "gspo")
    report.assert_ok()
    if importance != "none":
        assert float(jnp.min(batch["is_weight"][MASK > 0])) < 1.02 < float(np.exp(logp - logq)[MASK > 0].max())


def test_ppo_loss_is_the_clipped_surrogate_plus_the_value_loss():
    """The estimator's ppo loss at token aggregation equals ``token_losses`` (policy + c_V · value) averaged over
    the reply tokens: the terms the PPO tests check, through the one interface."""
    logp, ref, logq = rollout_inputs(2)
    s = settings("ppo", "reward-k1")
    values = f64(RNG.normal(size=(P * K, T)))
    batch, _ = estimator.rollout(s, f64(REWARD), f64(logp), f64(ref), f64(logq), f64(MASK), values)
    new_logp, new_values = f64(logp + 0.1 * RNG.normal(size=logp.shape)), values + 0.3
    total, count, sums = estimator.loss(s, new_logp, batch, new_values)
    terms = pref.token_losses(new_logp, batch["old_logp"], batch["adv"], new_values, batch["old_value"],
                              batch["ret"], clip=0.2, value_clip=0.2)
    m = MASK
    want = np.sum(m * np.asarray(terms["policy_loss"] + 0.5 * terms["value_loss"])) / m.sum()
    assert float(total / count) == pytest.approx(want, rel=1e-12)
    assert float(sums["clip_fraction"] / count) == pytest.approx(np.sum(m * terms["clip_fraction"]) / m.sum())


# ----- settings ---------------------------------------------------------------------------------------------------
def test_each_algorithms_defaults_and_round_trip():
    rows = {a: RLConfig(task="arithmetic", algorithm=a, k=2) for a in RL_ALGORITHMS}
    got = {a: (s.kl, s.beta, s.clip_low, s.clip_high, s.epochs, s.minibatches, s.loss_aggregation,
               s.dynamic_sampling) for a, s in rows.items()}
    assert got == {"group": ("reward-k1", 0.05, None, None, None, None, "seq-mean-token-sum", False),
                   "grpo": ("loss-k3", 0.05, 0.2, 0.2, 1, 1, "sequence", False),
                   "dr_grpo": ("none", None, 0.2, 0.2, 1, 1, "seq-mean-token-sum", False),
                   "dapo": ("none", None, 0.2, 0.28, 1, 1, "token", True),
                   "gspo": ("none", None, 3e-4, 4e-4, 1, 1, "sequence", False),
                   "ppo": ("reward-k1", 0.05, 0.2, 0.2, 4, 4, "token", False)}
    for s in rows.values():
        assert RLConfig.from_dict(s.to_dict()) == s and s.estimator() == EstimatorConfig(
            **{k: v for k, v in s.to_dict().items() if k in EstimatorConfig.__dataclass_fields__})
    assert rows["dapo"].sampling_rounds == 3 and rows["grpo"].sampling_rounds is None
    s = RLConfig(task="arithmetic", importance="tis")
    assert (s.is_cap, s.is_level, s.temperature) == (2.0, "token", 1.0)
    assert set(CLIPPED) == set(RL_ALGORITHMS) - {"group"} and len(KL_PLACEMENTS) == 5


@pytest.mark.parametrize("fields, message", [
    (dict(algorithm="group", clip_high=0.28), r"\['clip_high'\] apply to the clipped algorithms"),
    (dict(algorithm="group", minibatches=2), r"\['minibatches'\] apply to the clipped algorithms"),
    (dict(algorithm="dapo", gae_lambda=0.9), r"\['gae_lambda'\] apply to algorithm 'ppo' only, not 'dapo'"),
    (dict(algorithm="ppo", dynamic_sampling=True), r"ppo has no groups"),
    (dict(algorithm="grpo", kl="none", beta=0.1), r"beta = 0.1 weighs a KL term, and kl = 'none' has none"),
    (dict(algorithm="gspo", loss_aggregation="token"), r"cannot be honoured by gspo: its ratio is a reply's"),
    (dict(algorithm="grpo", clip=0.2, clip_high=0.28), r"clip = 0.2 sets both sides of the clip"),
    (dict(algorithm="dapo", clip_low=1.0), r"clip_low = 1.0 is invalid: it must be in \(0, 1\)"),
    (dict(algorithm="dapo", clip_high=0.0), r"clip_high = 0.0 is invalid: it must be a finite number > 0"),
    (dict(kl="k3"), r"kl = 'k3' is invalid: valid values are \['reward-k1', 'loss-k1', 'loss-k2', 'loss-k3', 'none'\]"),
    (dict(loss_aggregation="mean"), r"loss_aggregation = 'mean' is invalid"),
    (dict(sampling_rounds=2), r"sampling_rounds = 2 applies with dynamic sampling"),
    (dict(algorithm="dapo", sampling_rounds=0), r"sampling_rounds = 0 is invalid: it must be an integer >= 1"),
    (dict(is_cap=2.0), r"\['is_cap'\] apply with --importance tis or mis, not 'none'"),
    (dict(importance="tis", is_cap=0.0), r"is_cap = 0.0 is invalid: it must be a finite number > 0"),
    (dict(importance="tis", is_level="step"), r"is_level = 'step' is invalid"),
    (dict(importance="all"), r"importance = 'all' is invalid"),
    (dict(temperature=0.0), r"temperature = 0.0 is invalid: it must be a finite number > 0"),
    (dict(top_p=0.0), r"top_p = 0.0 is invalid: it must be a finite number > 0"),
    (dict(top_k=0), r"top_k = 0 is invalid: it must be an integer >= 1"),
    (dict(algorithm="dr_grpo", k=1), r"k = 1 is invalid: group-relative advantages"),
    (dict(dynamic_sampling="yes"), r"dynamic_sampling = 'yes' must be true or false"),
])
def test_settings_an_algorithm_cannot_honour_are_refused_by_name(fields, message):
    with pytest.raises(ConfigError, match=message):
        RLConfig(task="arithmetic", **fields)


@pytest.mark.parametrize("flags, message", [
    (["--algorithm", "grpo", "--value-clip", "0.1"], "RLConfig ['value_clip'] apply to algorithm 'ppo' only"),
    (["--algorithm", "dapo", "--beta", "0.1"], "RLConfig.beta = 0.1 weighs a KL term, and kl = 'none' has none"),
    (["--is-cap", "3"], "RLConfig ['is_cap'] apply with --importance tis or mis"),
])
def test_cli_refuses_in_one_line_and_writes_nothing(tmp_path, flags, message):
    before = snapshot(tmp_path)
    proc = cli_in_process("rl", "--base", tmp_path / "base", "--task", "arithmetic", *flags, "--out", tmp_path / "o")
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert message in proc.stderr and snapshot(tmp_path) == before


# ----- rollouts whose log-probabilities agree with the trainer's -------------------------------------------------
@pytest.fixture(scope="module")
def tiny_policy():
    """A random tiny byte model as a base: the sampler and the scorer need its shapes, not its skill."""
    tok = ByteTokenizer()
    params = init_params(TINY, jax.random.key(0))
    tcfg = TrainConfig(batch_size=4, seq_len=64, steps=1, warmup_steps=0)
    return prologue.Base(Path("."), TINY, tcfg, params, 0, tok, ChatTemplate())


def scored_rollout(base, **sampler):
    """Step 1's rollout of 4 prompts × 2 replies from ``base`` (the policy is the reference): the sampled batch
    (with the decoder's log q) and the scorer's update batch and metrics."""
    s = RLConfig(task="arithmetic", k=2, n_train=8, **sampler)
    frozen = {"reference": base.params}
    sampled, _ = rl.Sampler(base, base.tcfg, s, frozen, None)(1, base.params)
    scored, metrics = rl.make_scorer(base.cfg, s.estimator(), None)(base.params, frozen,
                                                                    jax.tree.map(jnp.asarray, sampled))
    return sampled, jax.tree.map(np.asarray, scored), {name: float(v) for name, v in metrics.items()}


def test_on_policy_at_temperature_one_the_ratio_is_one_to_round_off(tiny_policy):
    """The decoder's log q of every sampled token (the cached decode path, float32) and the trainer's log π_old
    (the training forward over the whole sequence) agree to float32 round-off: π/q = 1."""
    _, batch, metrics = scored_rollout(tiny_policy)
    assert abs(metrics["is_ratio_mean"] - 1) < 2e-6 and abs(metrics["is_ratio_max"] - 1) < 1e-5, metrics
    assert metrics["logprob_gap"] < 2e-6 and batch["mask"].sum() == 8 * 8  # 8 replies × 8 tokens


def test_with_top_p_the_ratio_of_each_token_is_its_kept_mass(tiny_policy):
    """Top-p renormalises π over the kept set S: q = π/M on S, so π/q = M = Σ_{v ∈ S} π(v) at every sampled
    position, and is_ratio_mean is the mean kept mass — computed here from the trainer's own logits."""
    base = tiny_policy
    sampled, batch, metrics = scored_rollout(base, top_p=0.3)
    logits = forward(base.params, jnp.asarray(batch["ids"][:, :-1]), base.cfg).astype(jnp.float32)
    kept = np.asarray(jnp.sum(jnp.where(top_p_mask(logits, 0.3), jax.nn.softmax(logits, axis=-1), 0.0), axis=-1))
    mask = batch["mask"] > 0
    np.testing.assert_allclose(np.exp(batch["old_logp"] - sampled["logq"])[mask], kept[mask], rtol=2e-5)
    assert metrics["is_ratio_mean"] == pytest.approx(float(kept[mask].mean()), rel=2e-5)
    assert metrics["is_ratio_max"] == pytest.approx(float(kept[mask].max()), rel=2e-5)
    assert 0.3 <= metrics["is_ratio_mean"] < 0.9  # a real cut, not π itself
