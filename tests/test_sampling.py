"""Decoding rules one by one (M20 §13, U19 §1, §4, §5): the seeds' numbers, edge cases, the sampler's χ² fit,
beam steps and the validation of settings. float64 (conftest) unless a test says otherwise."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mlx_llm import examples, forward
from mlx_llm.errors import ConfigError
from mlx_llm.decode.sampling import (DecodeSettings, apply_temperature, beam_rank, beam_step, choose,
                                     decoding_logprobs, draw, greedy, renormalise, top_k_mask, top_p_mask)

HOT = [0.40, 0.25, 0.15, 0.10, 0.06, 0.04]  # U19 §5 "Every morning I drink hot …"
COLOURS = [0.20, 0.18, 0.17, 0.16, 0.15, 0.14]  # "My favourite colour is …"
CAPITAL = [0.90, 0.04, 0.03, 0.02, 0.01]  # "The capital of India is New …"
SCORES_U19_4 = [2.0, 1.0, 0.0, -1.0]  # chai, coffee, water, the


def q_of(logits, **kw):
    """The decoding distribution q for one logits row."""
    return np.exp(np.asarray(decoding_logprobs(jnp.asarray(logits)[None], DecodeSettings(**kw))[0]))


def kept(probs, **kw):
    return int(np.sum(q_of(np.log(probs), temperature=1.0, **kw) > 0))


# ----- M20 §13 and U19 §1 -----------------------------------------------------------------------------
def test_m20_running_example_top2_tau_half():
    cfg, params, tokens, _ = examples.running_example()
    logits = forward(jax.tree.map(jnp.asarray, params), jnp.asarray(tokens), cfg)[0, -1]
    np.testing.assert_allclose(q_of(logits, temperature=0.5, top_k=2), [0, 0.563116, 0.436884, 0], atol=1e-6)
    assert q_of(logits, temperature=0.5, top_k=2)[examples.EOS] == 0.0  # EOS excluded on this step …
    np.testing.assert_allclose(jax.nn.softmax(logits)[examples.EOS], 0.183502, atol=1e-6)  # … though p(EOS) > 0


def test_u19_1_softmax_of_scores():
    np.testing.assert_allclose(q_of([3.0, 2, 1, -1, 0], temperature=1.0), [0.636, 0.234, 0.086, 0.012, 0.032],
                               atol=5e-4)


def test_tau_one_full_vocab_is_the_model():
    logits = np.array([0.3, -1.2, 2.5, 0.0, 0.7])
    np.testing.assert_allclose(q_of(logits, temperature=1.0), jax.nn.softmax(logits), rtol=1e-13)


# ----- U19 §4 temperature -----------------------------------------------------------------------------
@pytest.mark.parametrize("t, expected", [(1.0, [0.644, 0.237, 0.087, 0.032]), (0.5, [0.865, 0.117, 0.016, 0.002]),
                                         (2.0, [0.455, 0.276, 0.167, 0.102]), (10.0, [0.289, 0.261, 0.236, 0.214])])
def test_u19_4_temperature(t, expected):
    np.testing.assert_allclose(q_of(SCORES_U19_4, temperature=t), expected, atol=5e-4)


def test_u19_4_cold_limit_and_ratios():
    q = q_of(SCORES_U19_4, temperature=0.1)
    np.testing.assert_allclose(q[0], 1 / (1 + math.exp(-10) + math.exp(-20) + math.exp(-30)), rtol=1e-13)
    assert round(q[0], 5) == 0.99995
    for t, ratio in [(1.0, 2.718), (0.5, 7.389), (2.0, 1.649)]:  # chai/coffee = e^{gap/T}
        q = q_of(SCORES_U19_4, temperature=t)
        assert abs(q[0] / q[1] - ratio) < 5e-4
    logits = apply_temperature(jnp.asarray([SCORES_U19_4]), 0.5)
    np.testing.assert_allclose(logits, [[4.0, 2.0, 0.0, -2.0]])  # dividing by 0.5 doubles the scores


# ----- U19 §5 top-k / top-p ---------------------------------------------------------------------------
def test_u19_5_hot_drinks():
    np.testing.assert_allclose(q_of(np.log(HOT), temperature=1.0, top_k=3), [0.5, 0.3125, 0.1875, 0, 0, 0],
                               rtol=1e-12, atol=1e-15)
    assert kept(HOT, top_p=0.75) == 3
    np.testing.assert_allclose(q_of(np.log(HOT), temperature=1.0, top_p=0.75), [0.5, 0.3125, 0.1875, 0, 0, 0],
                               rtol=1e-12, atol=1e-15)
    q = q_of(np.log(HOT), temperature=1.0, top_k=3)
    np.testing.assert_allclose(q[0] / q[1], 1.6, rtol=1e-12)  # kept tokens keep their relative odds


def test_u19_5_flat_and_peaked_lists():
    assert kept(COLOURS, top_p=0.75) == 5
    assert kept(COLOURS, top_k=3) == 3
    np.testing.assert_allclose(1 - sum(COLOURS[:3]), 0.45, atol=1e-12)  # top-3 throws away 0.45
    assert kept(CAPITAL, top_p=0.75) == 1
    assert kept(CAPITAL, top_p=0.95) == 3
    q = q_of(np.log(CAPITAL), temperature=1.0, top_k=3)
    assert (q[1:3] > 0).all() and q[3:].sum() == 0  # York and Zealand still in the draw


def test_top_p_adapts_to_temperature_top_k_does_not():
    logits = np.log(CAPITAL)
    assert int(np.sum(q_of(logits, temperature=5.0, top_p=0.75) > 0)) > 1  # heat lets more tokens pass
    for t in (0.3, 1.0, 5.0):
        assert int(np.sum(q_of(logits, temperature=t, top_k=3) > 0)) == 3


def test_order_temperature_top_k_then_top_p():
    # After top-3 the hot list is (0.5, 0.3125, 0.1875): mass before milk is 0.8125 ≥ 0.7, so top-p keeps 2.
    # Top-p on the uncut list would keep 3 (mass before milk 0.65 < 0.7): the order is observable.
    q = q_of(np.log(HOT), temperature=1.0, top_k=3, top_p=0.7)
    np.testing.assert_allclose(q, [0.5 / 0.8125, 0.3125 / 0.8125, 0, 0, 0, 0], rtol=1e-12, atol=1e-15)
    assert kept(HOT, top_p=0.7) == 3


def test_top_p_exact_reach_ties_and_p_one():
    for dtype in (jnp.float32, jnp.float64):
        logits = jnp.log(jnp.asarray([[0.5, 0.25, 0.15, 0.10]], dtype))
        np.testing.assert_array_equal(top_p_mask(logits, 0.75), [[True, True, False, False]])  # 0.5+0.25 reaches
    ties = jnp.log(jnp.asarray([[0.3, 0.4, 0.3]]))
    np.testing.assert_array_equal(top_p_mask(ties, 0.5), [[True, True, True]])  # the tie at the cut stays together
    np.testing.assert_array_equal(top_p_mask(ties[:, ::-1], 0.5), [[True, True, True]])
    np.testing.assert_array_equal(top_p_mask(jnp.log(jnp.asarray([CAPITAL])), 1.0), [[True] * 5])
    tiny = jnp.asarray([[0.0, -800.0, -900.0]])  # underflowing tail probabilities
    np.testing.assert_array_equal(top_p_mask(tiny, 1e-9), [[True, False, False]])


def test_top_k_ties_and_greedy():
    np.testing.assert_array_equal(top_k_mask(jnp.asarray([[1.0, 0.0, 1.0, -2.0]]), 1), [[True, False, True, False]])
    np.testing.assert_array_equal(top_k_mask(jnp.asarray([[0.1, 0.5, 0.3]]), 2), [[False, True, True]])
    np.testing.assert_array_equal(greedy(jnp.asarray([[0.1, 0.5, 0.5], [2.0, 0.0, 1.0]])), [1, 0])  # first of ties


def test_renormalise_is_conditional_probability():
    logits = jnp.log(jnp.asarray([HOT]))
    keep = jnp.asarray([[True, False, True, False, True, False]])
    q = np.exp(renormalise(logits, keep))[0]
    np.testing.assert_allclose(q, np.where(keep[0], HOT, 0) / (0.40 + 0.15 + 0.06), rtol=1e-12, atol=1e-15)


def test_greedy_distribution_is_point_mass():
    logq = decoding_logprobs(jnp.asarray([[0.2, 1.5, -0.3]]), DecodeSettings())
    np.testing.assert_array_equal(np.exp(logq), [[0.0, 1.0, 0.0]])


# ----- drawing ----------------------------------------------------------------------------------------
def test_draw_matches_q_chi_square():
    logits = jnp.asarray([1.2, 0.4, -0.3, 0.9, -2.0, 0.0, -0.7, 0.1])
    settings = DecodeSettings(temperature=0.8, top_k=6, top_p=0.9)
    q = np.exp(np.asarray(decoding_logprobs(logits[None], settings)[0]))
    n = 40_000
    toks, logq = choose(jax.random.PRNGKey(7), jnp.broadcast_to(logits, (n, 8)), settings)
    counts = np.bincount(np.asarray(toks), minlength=8)
    assert counts[q == 0].sum() == 0  # excluded tokens are never drawn
    support = q > 0
    assert support.sum() == 5  # top-6, then the nucleus drops the sixth
    import scipy.stats  # imported by the test that needs it: it costs a second at collection

    assert scipy.stats.chisquare(counts[support], n * q[support]).pvalue > 1e-3
    np.testing.assert_allclose(np.asarray(logq), np.log(q[np.asarray(toks)]), rtol=1e-12)


def test_draw_reproducible_by_key():
    logq = jnp.log(jnp.full((64, 5), 0.2))
    a, b = draw(jax.random.PRNGKey(1), logq), draw(jax.random.PRNGKey(1), logq)
    c = draw(jax.random.PRNGKey(2), logq)
    np.testing.assert_array_equal(a, b)
    assert (np.asarray(a) != np.asarray(c)).any()


# ----- beam steps -------------------------------------------------------------------------------------
def test_beam_step_keeps_finished_score_and_ranks():
    # Row of 2 beams, V = 3, EOS = 2, pad = 0. Beam 0 alive (score −1), beam 1 finished (score −1.2).
    logp = jnp.log(jnp.asarray([[[0.5, 0.2, 0.3], [0.1, 0.1, 0.8]]]))
    out = beam_step(jnp.asarray([[-1.0, -1.2]]), jnp.asarray([[2, 1]]), jnp.asarray([[False, True]]), logp,
                    eos_id=2, pad_id=0, alpha=0.0)
    parent, token, score, length, done = (np.asarray(x)[0] for x in out)
    # candidates: −1+ln.5 = −1.693, −1.2 (finished, stays), −1+ln.3 = −2.204 (EOS), −1+ln.2 = −2.609
    np.testing.assert_array_equal(parent, [1, 0])
    np.testing.assert_array_equal(token, [0, 0])
    np.testing.assert_allclose(score, [-1.2, -1 + math.log(0.5)], rtol=1e-12)
    np.testing.assert_array_equal(length, [1, 3])
    np.testing.assert_array_equal(done, [True, False])
    # α = 1 ranks by score/len: −1.693/3 = −0.564 and (EOS) −2.204/3 = −0.735 now beat the short −1.2/1
    out = beam_step(jnp.asarray([[-1.0, -1.2]]), jnp.asarray([[2, 1]]), jnp.asarray([[False, True]]), logp,
                    eos_id=2, pad_id=0, alpha=1.0)
    parent, token, score, length, done = (np.asarray(x)[0] for x in out)
    np.testing.assert_array_equal(parent, [0, 0])
    np.testing.assert_array_equal(token, [0, 2])
    np.testing.assert_allclose(score, [-1 + math.log(0.5), -1 + math.log(0.3)], rtol=1e-12)
    np.testing.assert_array_equal(done, [False, True])
    np.testing.assert_allclose(beam_rank(jnp.asarray(-1.5), jnp.asarray(3), 1.0), -0.5)


# ----- settings validation ----------------------------------------------------------------------------
@pytest.mark.parametrize("kw, match", [
    (dict(temperature=0), "temperature = 0 is invalid.*greedy is its own rule"),
    (dict(temperature=-0.5), "temperature = -0.5 is invalid"),
    (dict(temperature=float("nan")), "temperature = nan is invalid"),
    (dict(temperature=float("inf")), "temperature = inf is invalid"),
    (dict(temperature=True), "temperature = True is invalid"),
    (dict(temperature=1.0, top_p=0.0), r"top_p = 0.0 is invalid: it must be a number in \(0, 1\]"),
    (dict(temperature=1.0, top_p=1.5), r"top_p = 1.5 is invalid"),
    (dict(temperature=1.0, top_k=0), "top_k = 0 is invalid: it must be an integer ≥ 1"),
    (dict(temperature=1.0, top_k=2.5), "top_k = 2.5 is invalid"),
    (dict(top_k=3), "temperature is unset, which means greedy"),
    (dict(beam_width=2, temperature=0.7), "beam search .* cannot be combined with sampling settings"),
    (dict(beam_width=2, top_p=0.9), "beam search .*'top_p': 0.9"),
    (dict(beam_width=0), "beam_width = 0 is invalid"),
    (dict(length_penalty=0.6), "length_penalty = 0.6 only applies to beam search"),
    (dict(beam_width=2, length_penalty=float("nan")), "length_penalty = nan is invalid"),
])
def test_invalid_settings(kw, match):
    with pytest.raises(ConfigError, match=match):
        DecodeSettings(**kw)


def test_top_k_larger_than_vocab():
    with pytest.raises(ConfigError, match=r"top_k = 9 is larger than the vocabulary \(V = 8\)"):
        DecodeSettings(temperature=1.0, top_k=9).check_vocab(8)
    assert DecodeSettings(temperature=1.0, top_k=8).check_vocab(8).top_k == 8


def test_settings_hash_and_modes():
    assert DecodeSettings(temperature=1) == DecodeSettings(temperature=1.0)
    assert hash(DecodeSettings(temperature=1)) == hash(DecodeSettings(temperature=1.0))
    assert DecodeSettings().mode == "greedy"
    assert DecodeSettings(temperature=0.7, top_p=np.float32(0.9)).mode == "sample"
    assert DecodeSettings(beam_width=np.int64(3)).length_penalty == 0.0
