"""Every estimator's fixed point on tabular bandits (post/bandit.py), against the leash's closed form
π*(y) ∝ π_ref(y) e^{r(y)/β} (U19 §12) and, for the placements that miss it, against the closed form of what they
reach (docs/post-training.md). Each run is 4 seeds of the trainer's own update, the fixed point averaged over the
seeds and the last tenth of the steps (the learning rate decays to 0 by a cosine)."""

import jax.numpy as jnp
import numpy as np
import pytest

from mlx_llm.post import bandit
from mlx_llm.runs.configs import RL_ALGORITHMS, EstimatorConfig

SEEDS = range(4)
PI_REF, R = [0.5, 0.3, 0.2], [0.0, 1.0, 2.0]  # U19 §12's bandit
ONE = bandit.one_token_bandit(3)
SEQ, SEQ_REF, SEQ_R = bandit.sequence_example()
SEQ_BETA = 0.5


def fixed_point(b, ref, r, steps=2000, **settings):
    s = EstimatorConfig(k=8, **settings)
    return bandit.fixed_point(bandit.train(b, ref, r, s, steps=steps, lr=0.05, groups=2, seeds=SEEDS))


def star(b, ref, r, beta):
    return np.asarray(bandit.closed_form(b, ref, r, beta)["pi"])


def test_the_sequence_bandit_enumerates_every_reply():
    """Two tokens and the end token, at most three tokens: 1 + 2 + 12 replies after 7 prefixes; π_θ over them sums
    to 1 for any table, and the per-prefix fixed point of one token with k2 is π* itself."""
    assert SEQ.n_replies == 15 and SEQ.n_prefixes == 7 and SEQ.replies[:3] == ((2,), (0, 2), (1, 2))
    assert all(r[-1] == 2 or len(r) == 3 for r in SEQ.replies) and all(2 not in r[:-1] for r in SEQ.replies)
    conditionals = np.exp(SEQ_REF) / np.exp(SEQ_REF).sum(-1, keepdims=True)
    pi = SEQ.reply_probs(conditionals)
    assert pi.sum() == pytest.approx(1.0, abs=1e-14)
    np.testing.assert_allclose(np.exp(np.asarray(SEQ.reply_logprobs(jnp.asarray(SEQ_REF)))), pi, rtol=1e-13)
    np.testing.assert_allclose(bandit.per_prefix_fixed_point(ONE, np.log(PI_REF), R, 1.0, "k2"),
                               star(ONE, np.log(PI_REF), R, 1.0), rtol=1e-12)
    assert bandit.total_variation(pi, star(SEQ, SEQ_REF, SEQ_R, SEQ_BETA)) > 0.4  # the leash moves a lot


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", RL_ALGORITHMS)
def test_with_the_kl_in_the_reward_every_algorithm_reaches_pi_star(algorithm):
    """With r̃ = r − β Σ_t log π/π_ref every reply's shaped return at π* is β ln Z, so every group baseline (and
    ppo's values) makes the advantages 0 there, whatever divides or clips them: π* is a fixed point, and the
    iterates reach it (measured TV ≤ 1e-4)."""
    got = fixed_point(SEQ, SEQ_REF, SEQ_R, steps=3000, algorithm=algorithm, kl="reward-k1", beta=SEQ_BETA)
    assert bandit.total_variation(got, star(SEQ, SEQ_REF, SEQ_R, SEQ_BETA)) <= 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["k2", "k3"])
def test_a_per_token_kl_term_reaches_its_per_prefix_fixed_point_not_pi_star(kind):
    """The KL as a per-token loss term (the group baseline, the reward alone in the advantage): each token's k is
    differentiated through that token alone, so no later position's KL reaches an earlier choice; the fixed point
    is ``per_prefix_fixed_point`` (k2: π(y|h) ∝ π_ref e^{Q/β}; k3: the forward KL's), measured 0.009 from it and
    0.057 (k2) / 0.086 (k3) from π*."""
    got = fixed_point(SEQ, SEQ_REF, SEQ_R, steps=3000, algorithm="group", kl=f"loss-{kind}", beta=SEQ_BETA)
    want = bandit.per_prefix_fixed_point(SEQ, SEQ_REF, SEQ_R, SEQ_BETA, kind)
    assert bandit.total_variation(got, want) <= 1.5e-2
    assert bandit.total_variation(got, star(SEQ, SEQ_REF, SEQ_R, SEQ_BETA)) >= 0.04


@pytest.mark.slow
def test_one_token_fixed_points_in_closed_form():
    """On one token: k2 in the loss is unbiased (π*); Dr. GRPO's group mean (itself included) scales the reward's
    gradient by (k − 1)/k but not the KL term's, so it reaches π* at β·k/(k − 1); k3 in the loss reaches the
    forward KL's fixed point π = β π_ref / (β + V − r); k1 in the loss has no expected gradient, so nothing
    leashes the policy to π_ref."""
    ref, beta = np.log(PI_REF), 1.0
    assert bandit.total_variation(fixed_point(ONE, ref, R, algorithm="group", kl="loss-k2", beta=beta),
                                  star(ONE, ref, R, beta)) <= 1e-2
    dr = fixed_point(ONE, ref, R, algorithm="dr_grpo", kl="loss-k2", beta=beta)
    assert bandit.total_variation(dr, star(ONE, ref, R, beta * 8 / 7)) <= 1e-2
    assert bandit.total_variation(dr, star(ONE, ref, R, beta)) >= 0.03
    forward = fixed_point(ONE, ref, R, algorithm="group", kl="loss-k3", beta=beta)
    assert bandit.total_variation(forward, bandit.per_prefix_fixed_point(ONE, ref, R, beta, "k3")) <= 1e-2
    assert bandit.total_variation(forward, star(ONE, ref, R, beta)) >= 0.05
    k1 = fixed_point(ONE, ref, R, algorithm="group", kl="loss-k1", beta=beta)
    assert k1[2] > 0.9  # toward the best answer, far past π*(2) = 0.53


@pytest.mark.slow
def test_importance_weights_remove_a_tempered_samplers_bias_but_not_a_truncated_ones():
    """k2 in the loss on one token samples from q = softmax(θ/0.5), not π: uncorrected, the update's fixed point
    is q's (measured TV 0.059 from π*); TIS and MIS with C = 5 weigh each sample by π/q and land on π*. A top-p
    sampler (0.8, on the sequence bandit, the KL in the reward) never draws the replies it cuts, and no weight of
    a drawn reply stands in for them: both end ≥ 0.05 from π*."""
    ref, beta, want = np.log(PI_REF), 1.0, star(ONE, np.log(PI_REF), R, 1.0)
    common = dict(algorithm="group", kl="loss-k2", beta=beta, temperature=0.5)
    assert bandit.total_variation(fixed_point(ONE, ref, R, **common), want) >= 0.04
    for importance in ("tis", "mis"):
        got = fixed_point(ONE, ref, R, importance=importance, is_cap=5.0, **common)
        assert bandit.total_variation(got, want) <= 1e-2, importance
    seq_star = star(SEQ, SEQ_REF, SEQ_R, SEQ_BETA)
    for extra in ({}, dict(importance="tis", is_cap=100.0, is_level="sequence")):
        got = fixed_point(SEQ, SEQ_REF, SEQ_R, steps=3000, algorithm="group", kl="reward-k1", beta=SEQ_BETA,
                          top_p=0.8, **extra)
        assert bandit.total_variation(got, seq_star) >= 0.05, extra
