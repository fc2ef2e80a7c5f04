"""Unit 19 ("The Maths Inside an LLM", /work/shared/seeds/003_4297aa912ac6597b.txt) number by number, through the
library's public functions: the worked numbers, widgets, "Pause & predict" / "Quick check" answers and practice
problems that no other test file asserts (SEED_INDEX.md lists, section by section, every test of the unit).

Each test is named after its section (``s2`` = §2, ``p7`` = Problem 7) and quotes what the text states. Numbers
are asserted to the digits the text prints. Where a Pause & predict has no printed answer, the docstring says
that the asserted value is the answer worked out from the section's rule. float64 (conftest).
"""

import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.optimize
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_llm import forward, generate, init_params
from mlx_llm.decode.sampling import DecodeSettings, choose, decoding_logprobs, greedy
from mlx_llm.decode.state import init_cache
from mlx_llm.layers.attention import attention_qkv
from mlx_llm.objectives.loss import bits_per_token, masked_cross_entropy, perplexity, sequence_log_likelihood
from mlx_llm.ops import log_softmax, token_nll
from mlx_llm.ops import rope, rope_frequencies, softmax
from mlx_llm.post import dpo, reward, rl
from mlx_llm import lora
from mlx_llm.scaling.accounting import (KVShape, gpt2_block_params, gpt2_params, kv_cache_bytes, kv_rows,
                                        moe_ffn_params)
from mlx_llm.scaling.laws import chinchilla_loss
from helpers import tiny_cfg

step_lib = importlib.import_module("mlx_llm.decode.step")  # generate's steps (for counting its model runs)

MIB, GIB = 2**20, 2**30
BASE = 10_000.0  # RoPE base of U19 §7
LN2 = math.log(2.0)
PROPERTY = settings(max_examples=25, deadline=None)


# ----- helpers: everything below goes through these library calls -----------------------------------------------
def q_of(logits, **kw):
    """The sampler's decoding distribution q for one row of logits (temperature → top-k → top-p → renormalise)."""
    logq = decoding_logprobs(jnp.asarray(logits, jnp.float64)[None], DecodeSettings(**kw))
    return np.exp(np.asarray(logq[0]))


def probs(logits):
    """The model's next-token probabilities: softmax of the scores (ops.softmax)."""
    return np.asarray(softmax(jnp.asarray(logits, jnp.float64)))


def true_token(ps):
    """Logits (1, n, 2) and targets (1, n) such that the model gives the true token (id 0) probability p_t."""
    p = np.asarray(ps, np.float64)
    with np.errstate(divide="ignore"):
        logits = np.log(np.stack([p, 1.0 - p], axis=-1))
    return jnp.asarray(logits[None]), jnp.zeros((1, len(p)), jnp.int32)


def loss_of(ps, mask=None):
    """Cross-entropy loss (nats per token) of a text whose true tokens got the probabilities ``ps``."""
    logits, targets = true_token(ps)
    mask = jnp.ones(targets.shape) if mask is None else jnp.asarray([mask], jnp.float64)
    return float(masked_cross_entropy(logits, targets, mask))


def log_likelihood_of(ps):
    logits, targets = true_token(ps)
    return float(sequence_log_likelihood(logits, targets, jnp.ones(targets.shape))[0])


def surprises(ps):
    logits, targets = true_token(ps)
    return np.asarray(token_nll(logits, targets)[0])


def slow_hand_angle(position, d_head, scale=1.0):
    """The angle (mod 2π) of the slowest RoPE pair after ``position`` steps: rope of the unit vector of that pair
    (rotate_half: coordinates d/2 − 1 and d − 1). With the key at 0, it is the gap angle the pair shows."""
    x = np.zeros((1, 1, 1, d_head))
    x[..., d_head // 2 - 1] = 1.0
    y = np.asarray(rope(jnp.asarray(x), jnp.asarray([[position]]), BASE, scale))[0, 0, 0]
    return float(np.mod(np.arctan2(y[d_head - 1], y[d_head // 2 - 1]), 2 * np.pi))


def rope_score(q, k, m, n, scale=1.0):
    """Per-head scores q̃·k̃ of a query at position m and a key at position n (q, k: (H, K))."""
    qm = rope(jnp.asarray(q)[None, None], jnp.asarray([[m]]), BASE, scale)[0, 0]
    kn = rope(jnp.asarray(k)[None, None], jnp.asarray([[n]]), BASE, scale)[0, 0]
    return np.asarray(jnp.sum(qm * kn, axis=-1))


def f64(x):
    return jnp.asarray(x, jnp.float64)


def random_params(cfg, seed):
    """``init_params``' layout (traced, never run) filled with NumPy N(0, 1/d) draws and unit norm gains: no
    compilation of the initialiser."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0), jnp.float64))
    return jax.tree_util.tree_map_with_path(
        lambda path, s: jnp.ones(s.shape) if "norm" in str(path[-1]) else
        jnp.asarray(rng.standard_normal(s.shape) / math.sqrt(cfg.d_model)), shapes)


def first_layer(cfg, seed):
    return jax.tree.map(lambda a: a[0], random_params(cfg, seed)["blocks"])


def leash(pi_ref, rewards, beta):
    return {k: np.asarray(v) for k, v in rl.leash(f64(pi_ref), f64(rewards), beta).items()}


# ===== §1 The only thing an LLM does ===========================================================================
def test_u19_s1_total_of_exponentials():
    """"e³ ≈ 20.086, e² ≈ 7.389, e¹ ≈ 2.718, e⁻¹ ≈ 0.368, e⁰ = 1, total ≈ 31.561": the score-0 token ("the") gets
    probability 1/total, so total = e^(−log p_the)."""
    logp = np.asarray(log_softmax(f64([3.0, 2.0, 1.0, -1.0, 0.0])))
    assert round(float(np.exp(-logp[4])), 3) == 31.561


def test_u19_s1_adding_5_to_every_score_leaves_probabilities_unchanged():
    """Pause & predict: add 5 to every score, (8, 7, 6, 4, 5). The model does exactly the same: softmax sees only
    the gaps, so the probabilities stay (0.636, 0.234, 0.086, 0.012, 0.032)."""
    printed = [0.636, 0.234, 0.086, 0.012, 0.032]
    for p in (probs([8.0, 7.0, 6.0, 4.0, 5.0]), q_of([8.0, 7.0, 6.0, 4.0, 5.0], temperature=1.0)):
        np.testing.assert_array_equal(np.round(p, 3), printed)
        np.testing.assert_allclose(p, probs([3.0, 2.0, 1.0, -1.0, 0.0]), rtol=1e-14)


@PROPERTY
@given(scores=st.lists(st.floats(-30, 30), min_size=5, max_size=5), shift=st.floats(-100, 100))
def test_u19_s1_shifting_every_score_never_changes_a_probability(scores, shift):
    """"Softmax sees only the gaps between scores" (§1, Problem 1): any common shift leaves p unchanged."""
    z = np.asarray(scores)
    np.testing.assert_allclose(probs(z + shift), probs(z), rtol=1e-11, atol=1e-300)


def test_u19_s1_one_run_of_the_model_per_new_token(monkeypatch):
    """Pause & predict: a question of 40 tokens, a reply of 60 new tokens — the model runs 60 times ("One run of
    the model gives one new token. A reply of 300 tokens is 300 runs"). Each run reads the text so far (the
    prompt, then the cache) and is fed the token the previous run just chose ("it takes its own suggestion, adds
    it to the message, and suggests again"). Counted at run time inside ``generate``'s compiled loop."""
    runs = []
    original = step_lib.forward_cached

    def counting(params, tokens, cache, cfg, **kw):
        jax.debug.callback(lambda t: runs.append(np.asarray(t).copy()), tokens)
        return original(params, tokens, cache, cfg, **kw)

    monkeypatch.setattr(step_lib, "forward_cached", counting)
    cfg = tiny_cfg(n_layers=1, max_seq_len=101)  # a shape no other test compiles: ``generate`` is traced afresh
    params = random_params(cfg, 0)
    question = (np.arange(40) * 7 % cfg.vocab_size)[None]
    out = generate(params, cfg, question, 60)
    jax.effects_barrier()
    reply = np.asarray(out.tokens[0])
    assert len(runs) == 60 == len(reply)
    assert runs[0].shape == (1, 40) and (runs[0] == question).all()  # the first run reads the whole question
    assert [r.shape for r in runs[1:]] == [(1, 1)] * 59
    assert [int(r[0, 0]) for r in runs[1:]] == reply[:-1].tolist()  # run t+1 is fed the token run t wrote


def test_u19_s1_chain_rule_multiplies_the_guesses():
    """"How likely is the whole sentence? Multiply the guesses, each one given everything before it":
    log P(w_2 … w_n | w_1) = Σ_t log P(w_t | w_<t). The left side from one masked (teacher-forced) pass, the
    right side from separate runs of the model on each prefix, "from the start"."""
    cfg = tiny_cfg(n_layers=1)
    params = random_params(cfg, 3)
    text = jnp.asarray([[5, 17, 42, 3]])  # "we drink hot chai"
    run = jax.jit(forward, static_argnums=2)
    one_pass = sequence_log_likelihood(run(params, text[:, :-1], cfg), text[:, 1:], jnp.ones((1, 3)))
    guesses = [float(log_softmax(run(params, text[:, :t], cfg))[0, -1, int(text[0, t])]) for t in range(1, 4)]
    np.testing.assert_allclose(float(one_pass[0]), sum(guesses), rtol=1e-12)
    assert all(g < 0 for g in guesses)


# ===== §2 Scoring a whole sentence =============================================================================
WE_DRINK_HOT_CHAI = [0.5, 0.25, 0.8]  # P(drink | we), P(hot | we drink), P(chai | we drink hot)


def test_u19_s2_we_drink_hot_chai_five_ways():
    """"0.5 × 0.25 × 0.8 = 0.1 … ln0.5 + ln0.25 + ln0.8 ≈ −0.6931 − 1.3863 − 0.2231 = −2.3026 … 0.7675 nats per
    token … e^0.7675 ≈ 2.1544 … (1/0.1)^(1/3) … 0.7675/0.6931 ≈ 1.1073 bits per token" (and the table of five
    ways to report the same thing)."""
    np.testing.assert_array_equal(np.round(-surprises(WE_DRINK_HOT_CHAI), 4), [-0.6931, -1.3863, -0.2231])
    log_likelihood = log_likelihood_of(WE_DRINK_HOT_CHAI)
    assert round(log_likelihood, 4) == -2.3026
    assert round(math.exp(log_likelihood), 12) == 0.1  # the gambler's money: ten paise left of the rupee
    loss = loss_of(WE_DRINK_HOT_CHAI)
    assert round(loss, 4) == 0.7675
    assert round(float(perplexity(loss)), 4) == 2.1544
    np.testing.assert_allclose(float(perplexity(loss)), (1 / math.exp(log_likelihood)) ** (1 / 3), rtol=1e-14)
    assert round(float(bits_per_token(loss)), 4) == 1.1073


def test_u19_s2_why_logarithms_the_product_underflows():
    """"A text of 1 000 tokens, each with probability 0.5, has probability 0.5^1000 ≈ 9.33 × 10⁻³⁰². At 2 000
    tokens a computer's ordinary numbers run out and it says 0. The log is just −693.1": the library sums logs,
    so the log-likelihood and the per-token loss stay exact where the product is 0."""
    ll_1000 = log_likelihood_of([0.5] * 1000)
    assert round(ll_1000, 1) == -693.1
    assert f"{math.exp(ll_1000):.2e}" == "9.33e-302"
    ll_2000 = log_likelihood_of([0.5] * 2000)
    assert math.exp(ll_2000) == 0.0 and np.prod(np.full(2000, 0.5)) == 0.0  # the product itself underflows …
    assert round(ll_2000, 1) == -1386.3  # … the log does not
    assert float(perplexity(loss_of([0.5] * 2000))) == pytest.approx(2.0, rel=1e-13)  # a fair per-token score


def test_u19_s2_widget_one_bad_guess():
    """Widget: "press one bad guess (hot = 0.01): its red bar shoots to 4.61, the money falls to 0.004 and the
    perplexity jumps to 6.30 — one bad guess ruins the average"."""
    bad = [0.5, 0.01, 0.8]
    assert round(float(surprises(bad)[1]), 2) == 4.61
    assert round(math.exp(log_likelihood_of(bad)), 12) == 0.004
    assert round(float(perplexity(loss_of(bad))), 2) == 6.30


def test_u19_s2_widget_no_idea_is_a_fair_die_with_six_faces():
    """Widget: "a model that spreads its money evenly over 6 words gets perplexity exactly 6"."""
    logits = jnp.zeros((1, 4, 6))
    loss = float(masked_cross_entropy(logits, jnp.asarray([[0, 3, 5, 1]]), jnp.ones((1, 4))))
    assert float(perplexity(loss)) == pytest.approx(6.0, rel=1e-15)


def test_u19_s2_surprise_punishes_confidence_in_the_wrong_place():
    """"At p = 0.9 the surprise is only 0.105; at p = 0.01 it is 4.6; at p = 0 it is infinite"."""
    s = surprises([0.9, 0.01, 0.0])
    assert round(float(s[0]), 3) == 0.105 and round(float(s[1]), 1) == 4.6
    assert s[2] == np.inf


def test_u19_s2_pause_predict_better_at_hot():
    """Pause & predict: "hot" now gets 0.5 instead of 0.25, "drink" and "chai" stay at 0.5 and 0.8. (No answer is
    printed; by §2's rule the perplexity is (0.5·0.5·0.8)^(−1/3) = 0.2^(−1/3) ≈ 1.7100, down from 2.1544.)"""
    pp = float(perplexity(loss_of([0.5, 0.5, 0.8])))
    assert round(pp, 4) == 1.7100
    np.testing.assert_allclose(pp, 0.2 ** (-1 / 3), rtol=1e-14)


def test_u19_s2_pause_predict_one_token_of_probability_zero():
    """Pause & predict: 999 excellent guesses and one true word given probability exactly 0. (Answer, from "at
    p = 0 it is infinite"): the average loss is infinite, and so is the perplexity."""
    loss = loss_of([0.999] * 999 + [0.0])
    assert loss == np.inf and float(perplexity(loss)) == np.inf
    assert np.isfinite(loss_of([0.999] * 1000))


def test_u19_s2_uniform_guess_has_perplexity_exactly_V():
    """Quick check and proof: "a loss of ln 50 257 ≈ 10.82 nats per token" is a model that knows nothing: every
    token 1/V, "perplexity 50 257. A fair die with 50 257 faces" — whatever the text."""
    v = 50_257
    logits = jnp.zeros((1, 3, v))
    for targets in ([[0, 1, 2]], [[50_256, 7, 31_337]]):
        loss = float(masked_cross_entropy(logits, jnp.asarray(targets), jnp.ones((1, 3))))
        assert round(loss, 2) == 10.82
        np.testing.assert_allclose(loss, math.log(v), rtol=1e-14)
        assert float(perplexity(loss)) == pytest.approx(v, rel=1e-12)


@PROPERTY
@given(ps=st.lists(st.floats(1e-6, 1.0), min_size=1, max_size=8))
def test_u19_s2_perplexity_is_one_over_the_geometric_mean(ps):
    """Proof: "the perplexity is e^L = (p₁p₂⋯pₙ)^(−1/n)"; bits per token = loss ÷ ln 2."""
    loss = loss_of(ps)
    np.testing.assert_allclose(float(perplexity(loss)), float(np.prod(ps)) ** (-1 / len(ps)), rtol=1e-9)
    np.testing.assert_allclose(float(bits_per_token(loss)), loss / LN2, rtol=1e-15)
    np.testing.assert_allclose(log_likelihood_of(ps), -len(ps) * loss, rtol=1e-12, atol=1e-15)


# ===== §3 Inside the stack =====================================================================================
def test_u19_s3_doubling_the_width_quadruples_the_blocks():
    """Pause & predict and widget: "Drag width d from 768 to 1 536: every floor now holds four times as many
    numbers …, while the violet table only doubles" (blocks 12d² + 13d: roughly 4×)."""
    assert round(gpt2_block_params(1_536) / gpt2_block_params(768), 2) == 4.00  # 3.997: the 13d extras only double
    table = {d: gpt2_params(d, 12, 50_257, 1_024, tied=False) - gpt2_params(d, 12, 50_257, 1_024) for d in (768, 1536)}
    assert table[768] == 38_597_376 and table[1536] == 2 * table[768]


def test_u19_s3_sixteen_experts_store_16x_but_work_2x():
    """Pause & predict: 16 experts, each as big as one dense feed-forward room, top 2 per token. (Answer, by the
    rule "memory follows the total, compute follows the active count"): 16 times the numbers stored, twice the
    work per token."""
    for d in (768, 4_096):
        dense, moe = moe_ffn_params(d, 1, 1), moe_ffn_params(d, 16, 2)
        assert moe.stored == 16 * dense.stored and moe.active == 2 * dense.active


# ===== §4 Greedy and temperature ===============================================================================
def test_u19_s4_model_that_doubles_its_scores_is_undone_by_T2():
    """Pause & predict: "A bug makes the model double all of its scores before the softmax. Which temperature
    gives back exactly the probabilities of the model without the bug?" T = 2."""
    z = np.array([2.0, 1.0, 0.0, -1.0])
    np.testing.assert_allclose(q_of(2 * z, temperature=2.0), q_of(z, temperature=1.0), rtol=1e-14)
    np.testing.assert_array_equal(np.round(q_of(2 * z, temperature=2.0), 3), [0.644, 0.237, 0.087, 0.032])
    assert not np.allclose(q_of(2 * z, temperature=1.0), q_of(z, temperature=1.0))  # the bug itself does change q


@PROPERTY
@given(scores=st.lists(st.floats(-10, 10), min_size=6, max_size=6), factor=st.floats(0.1, 10))
def test_u19_s4_scaling_the_scores_by_c_is_undone_by_T_equal_c(scores, factor):
    """The same, for any factor: dividing by T undoes multiplying by T."""
    z = np.asarray(scores)
    np.testing.assert_allclose(q_of(factor * z, temperature=factor), q_of(z, temperature=1.0), rtol=1e-10)


@PROPERTY
@given(ints=st.lists(st.integers(-1000, 1000), min_size=6, max_size=6, unique=True), t=st.floats(0.2, 100.0))
def test_u19_s4_temperature_bends_every_ratio_and_the_order_never_changes(ints, t):
    """Proof (a): "p_i/p_j = e^{(z_i − z_j)/T}, so the order of the tokens is the same at every T > 0" — "The
    order of the four never changes"."""
    z = np.asarray(ints) / 100.0
    q = q_of(z, temperature=t)
    np.testing.assert_array_equal(np.argsort(q), np.argsort(z))
    i, j = int(np.argmax(z)), int(np.argmin(z))
    np.testing.assert_allclose(q[i] / q[j], math.exp((z[i] - z[j]) / t), rtol=1e-9)


@PROPERTY
@given(ints=st.lists(st.integers(-1000, 1000), min_size=5, max_size=5, unique=True))
def test_u19_s4_temperature_limits(ints):
    """Proof (b), (c): "as T → 0 all the probability goes to the top token (if it is unique); as T → ∞ every token
    gets 1/n"."""
    z = np.asarray(ints) / 100.0
    gap = np.sort(z)[-1] - np.sort(z)[-2]
    cold = q_of(z, temperature=gap / 40)  # every other token is at least e^{-40} behind
    assert cold[np.argmax(z)] >= 1 - 4 * math.exp(-40)
    np.testing.assert_allclose(q_of(z, temperature=1e9), 1 / 5, rtol=1e-6)


def test_u19_s4_T100_with_50000_tokens_writes_near_uniform_noise():
    """Pause & predict: "You set T = 100 for a model with a vocabulary of 50 000 tokens. What will it write?"
    (Answer, from "as T → ∞ every token gets 1/n"): scores that differ by up to 10 differ by at most 0.1 after
    dividing by 100, so every token gets about 1/50 000 — random tokens, nonsense."""
    scores = np.linspace(-5.0, 5.0, 50_000)
    q = q_of(scores, temperature=100.0)
    assert q.max() / q.min() == pytest.approx(math.exp(0.1), rel=1e-12)
    assert np.all(np.abs(q * 50_000 - 1) < 0.06)
    assert q_of(scores, temperature=1.0).max() / q_of(scores, temperature=1.0).min() == pytest.approx(math.exp(10))


# ===== §5 top-k and top-p ======================================================================================
def test_u19_s5_top_k_1_at_T2_always_picks_the_top_token():
    """Pause & predict: "You set top-k to 1 and temperature to 2. What does the sampler do?" Top-k 1 keeps one
    token whatever the temperature: it always writes the top token — greedy."""
    logits = jax.random.normal(jax.random.key(5), (64, 9), jnp.float64) * 3
    s = DecodeSettings(temperature=2.0, top_k=1)
    q = np.exp(np.asarray(decoding_logprobs(logits, s)))
    np.testing.assert_array_equal(q, np.asarray(jax.nn.one_hot(greedy(logits), 9)))
    pick = jax.jit(choose, static_argnums=2)
    for seed in range(5):
        tok, logq = pick(jax.random.key(seed), logits, s)
        np.testing.assert_array_equal(tok, greedy(logits))
        np.testing.assert_array_equal(logq, 0.0)


# ===== §6 The KV cache =========================================================================================
def test_u19_s6_four_kv_heads_halve_the_cache_to_256_MiB():
    """Pause & predict: "grouped-query attention with 8 key-value heads, and its notebook for one long chat is
    512 MiB. The designers switch to 4 key-value heads." The notebook halves to 256 MiB."""
    assert kv_cache_bytes(KVShape(32, 8, 128), 4_096, dtype=2) == 512 * MIB
    assert kv_cache_bytes(KVShape(32, 4, 128), 4_096, dtype=2) == 256 * MIB
    cfg = tiny_cfg(vocab_size=32_000, d_model=4_096, n_layers=32, n_heads=32, n_kv_heads=4, d_head=128, d_ff=11_008,
                   max_seq_len=4_096)
    assert kv_cache_bytes(cfg, 4_096, 1, jnp.bfloat16) == 256 * MIB
    cache = jax.eval_shape(lambda: init_cache(cfg, 1, 4_096, jnp.bfloat16))
    assert 2 * cache.k.size * cache.k.dtype.itemsize == 256 * MIB  # what the decoder allocates


def test_u19_s6_the_cache_is_five_hundred_times_less_work():
    """"For n = 1 000: 500 500 rows. With a cache … 1 000 rows. Five hundred times less" (the ratio (n+1)/2)."""
    assert kv_rows(1_000, cached=False) / kv_rows(1_000, cached=True) == 500.5
    for n in (1, 10, 2_000, 4_096):
        assert kv_rows(n, cached=False) / kv_rows(n, cached=True) == (n + 1) / 2


# ===== §7 Rotary positions =====================================================================================
def test_u19_s7_query_40_key_30_scores_as_query_540_key_530():
    """Pause & predict: "A query at position 40 and a key at position 30 give some score. You move the query to
    position 540 and the key to 530." The score does not change: it sees only the gap 10."""
    kq, kk = jax.random.split(jax.random.key(7))
    q = jax.random.normal(kq, (4, 16), jnp.float64)
    k = jax.random.normal(kk, (4, 16), jnp.float64)
    np.testing.assert_allclose(rope_score(q, k, 540, 530), rope_score(q, k, 40, 30), rtol=1e-11, atol=1e-12)
    assert np.abs(rope_score(q, k, 40, 31) - rope_score(q, k, 40, 30)).max() > 1e-2  # a different gap does change it


@PROPERTY
@given(m=st.integers(0, 10_000), n=st.integers(0, 10_000), shift=st.integers(0, 10_000))
def test_u19_s7_the_score_depends_only_on_the_gap(m, n, shift):
    """Proof: "(R(mθ)q)·(R(nθ)k) = q·(R((n − m)θ)k). It depends on m and n only through n − m"."""
    q = np.linspace(-1.0, 1.0, 16).reshape(2, 8)
    k = np.cos(np.arange(16.0)).reshape(2, 8)
    np.testing.assert_allclose(rope_score(q, k, m + shift, n + shift), rope_score(q, k, m, n), rtol=1e-8, atol=1e-8)


def test_u19_s7_periods_of_the_four_hands():
    """"Each speed has its period … 2π/θ_i: about 6.28, 62.8, 628 and 6 283 positions"."""
    period = 2 * np.pi / np.asarray(rope_frequencies(8, BASE, jnp.float64))
    assert (round(period[0], 2), round(period[1], 1), round(period[2]), round(period[3])) == (6.28, 62.8, 628, 6283)


def test_u19_s7_why_models_break_on_longer_texts():
    """"The slowest pair (θ = 0.001) has then only ever seen the two hands up to 2 048 × 0.001 = 2.048 radians
    apart (about 117°). … words 8 000 positions apart … 8 radians — more than a full turn"; widget: gap 6 000
    runs past the wedge, and with "interpolate ×0.25 the gap now acts like 1 500" and is back inside it."""
    trained = slow_hand_angle(2_048, 8)
    assert round(trained, 3) == 2.048 and round(math.degrees(trained)) == 117
    assert slow_hand_angle(8_000, 8) == pytest.approx(8.0 - 2 * np.pi, abs=1e-9) and 8.0 > 2 * np.pi
    assert slow_hand_angle(6_000, 8) == pytest.approx(6.0, abs=1e-9) and 6.0 > trained  # outside the wedge
    assert slow_hand_angle(6_000, 8, scale=0.25) == pytest.approx(1.5, abs=1e-9) and 1.5 < trained  # inside


def test_u19_s7_position_10000_at_scale_quarter_acts_as_2500():
    """Quick check: "A model trained on 4 096 tokens must read 16 384. With position interpolation, what is the
    scale, and where does position 10 000 land?" Scale 4 096/16 384 = 0.25; position 10 000 acts as 2 500 — in
    ``ops.rope`` and through a model configured with ``rope_scale``."""
    scale = 4_096 / 16_384
    assert scale == 0.25
    x = jax.random.normal(jax.random.key(8), (1, 1, 3, 16), jnp.float64)
    np.testing.assert_allclose(rope(x, jnp.asarray([[10_000]]), BASE, scale), rope(x, jnp.asarray([[2_500]]), BASE),
                               atol=1e-11)
    cfg, plain = tiny_cfg(rope_scale=scale), tiny_cfg()
    layer = first_layer(cfg, 9)
    xs = jax.random.normal(jax.random.key(10), (1, 1, cfg.d_model), jnp.float64)
    q_far, k_far, _ = attention_qkv(xs, layer, cfg, jnp.asarray([[10_000]]))
    q_near, k_near, _ = attention_qkv(xs, layer, plain, jnp.asarray([[2_500]]))
    np.testing.assert_allclose(q_far, q_near, atol=1e-11)
    np.testing.assert_allclose(k_far, k_near, atol=1e-11)


def test_u19_s7_rotary_turns_queries_and_keys_never_values():
    """Trap: "Rotary positions turn the queries and keys only — never the values"."""
    cfg = tiny_cfg()
    layer = first_layer(cfg, 11)
    xs = jax.random.normal(jax.random.key(12), (1, 4, cfg.d_model), jnp.float64)
    q0, k0, v0 = attention_qkv(xs, layer, cfg, jnp.asarray([[0, 1, 2, 3]]))
    q1, k1, v1 = attention_qkv(xs, layer, cfg, jnp.asarray([[100, 101, 102, 103]]))
    np.testing.assert_array_equal(v0, v1)
    assert np.abs(np.asarray(q0 - q1)).max() > 0.1 and np.abs(np.asarray(k0 - k1)).max() > 0.1


# ===== §8 Scaling laws =========================================================================================
def test_u19_s8_ten_times_the_model_same_tokens():
    """Pause & predict: "you make the model 10 times bigger but keep the same number of tokens. What happens to
    the loss?" "Ten times more parameters multiplies the second term by 10^−0.34 ≈ 0.457: it roughly halves",
    while the data term "stays where it was": at Chinchilla's 1.4T tokens the loss falls only from 1.9366."""
    d = 1.4e12
    n_term = lambda n: chinchilla_loss(n, d) - chinchilla_loss(1e300, d)  # A/N^α; 1e300 parameters: A/N^α ≈ 0
    assert round(n_term(700e9) / n_term(70e9), 3) == 0.457
    assert round(chinchilla_loss(70e9, d), 4) == 1.9366
    assert 1.9366 - chinchilla_loss(700e9, d) < 0.05  # a small gain: the data term is the wall
    assert chinchilla_loss(1e300, d) - 1.69 == pytest.approx(410.7 / d**0.28, rel=1e-12)  # the data term alone


# ===== §9 Supervised fine-tuning ===============================================================================
def test_u19_s9_quick_check_sft_loss_0_3081():
    """Quick check: "the user's two tokens get probabilities 0.01 and 0.2; the answer's two tokens get 0.9 and
    0.6. What is the SFT loss (with the mask)?" −(ln 0.9 + ln 0.6)/2 ≈ 0.3081."""
    loss = loss_of([0.01, 0.2, 0.9, 0.6], mask=[0, 0, 1, 1])
    assert round(loss, 4) == 0.3081
    assert loss_of([0.5, 0.5, 0.9, 0.6], mask=[0, 0, 1, 1]) == pytest.approx(loss, rel=1e-15)  # the user's don't count


def test_u19_s9_quick_check_with_the_users_token_at_probability_0():
    """The same quick check with the user's first token at p = 0 (a −∞ logit): the mask drops it, so the loss is
    still −(ln 0.9 + ln 0.6)/2 ≈ 0.3081, finite in value and gradient (0 · ∞ would be NaN), and the masked
    positions get exactly zero gradient; the sequence log-likelihood over the answer is finite too."""
    logits, targets = true_token([0.0, 0.2, 0.9, 0.6])
    mask = jnp.asarray([[0.0, 0.0, 1.0, 1.0]])
    assert np.isneginf(np.asarray(logits)[0, 0, 0])
    loss, grad = jax.value_and_grad(masked_cross_entropy)(logits, targets, mask)
    assert round(float(loss), 4) == 0.3081
    assert float(loss) == pytest.approx(-(math.log(0.9) + math.log(0.6)) / 2, rel=1e-14)
    grad = np.asarray(grad)
    assert np.all(np.isfinite(grad)) and np.all(grad[0, :2] == 0.0) and np.all(grad[0, 2:] != 0.0)
    ll, ll_grad = jax.value_and_grad(lambda lg: sequence_log_likelihood(lg, targets, mask)[0])(logits)
    assert float(ll) == pytest.approx(math.log(0.9) + math.log(0.6), rel=1e-14)
    assert np.all(np.isfinite(np.asarray(ll_grad))) and np.all(np.asarray(ll_grad)[0, :2] == 0.0)


def test_u19_s9_blame_is_masked_prediction_minus_truth():
    """Proof: "the blame on the scores at position t is m_t/Σ_s m_s (q_t − y_t): zero at every masked position"."""
    logits = jax.random.normal(jax.random.key(13), (1, 5, 7), jnp.float64)
    targets = jnp.asarray([[3, 0, 6, 2, 2]])
    mask = jnp.asarray([[0.0, 1.0, 0.0, 1.0, 1.0]])
    grad = np.asarray(jax.grad(lambda lg: masked_cross_entropy(lg, targets, mask))(logits))[0]
    expected = np.asarray(mask[0])[:, None] / 3 * (probs(logits[0]) - np.asarray(jax.nn.one_hot(targets[0], 7)))
    np.testing.assert_allclose(grad, expected, rtol=1e-12, atol=1e-15)
    assert np.all(grad[[0, 2]] == 0.0)


# ===== §10 LoRA ================================================================================================
@PROPERTY
@given(d_in=st.integers(1, 6), d_out=st.integers(1, 6), r=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_u19_s10_rank_of_BA_is_at_most_r(d_in, d_out, r, seed):
    """Proof: "If B is d × r and A is r × d, then rank(BA) ≤ r" (random factors: exactly min(r, d_in, d_out))."""
    rng = np.random.default_rng(seed)
    cfg = lora.LoRAConfig(rank=r, alpha=2.0 * r)
    dw = np.asarray(lora.delta(f64(rng.standard_normal((d_in, r))), f64(rng.standard_normal((r, d_out))), cfg.scale))
    assert np.linalg.matrix_rank(dw) == min(r, d_in, d_out)


def test_u19_s10_best_rank_2_adapter_leaves_the_dropped_singular_values():
    """Pause & predict: "A target change has singular values 6, 3.6, 2.2, 1.3, … and a LoRA of rank 2 is trained as
    well as possible. Which singular values decide the error that is left?" σ₃, σ₄, …: a rank-2 adapter
    (α/r)·A·B fitted to the change by BFGS keeps 6 and 3.6 and leaves ‖E‖_F = √(2.2² + 1.3²) (Eckart–Young)."""
    rng = np.random.default_rng(0)
    u, _ = np.linalg.qr(rng.standard_normal((4, 4)))
    v, _ = np.linalg.qr(rng.standard_normal((4, 4)))
    sigma = np.array([6.0, 3.6, 2.2, 1.3])
    target = u @ np.diag(sigma) @ v.T
    cfg = lora.LoRAConfig(rank=2, alpha=4.0)

    def err2(theta):
        return jnp.sum((jnp.asarray(target) - lora.delta(theta[:8].reshape(4, 2), theta[8:].reshape(2, 4),
                                                          cfg.scale)) ** 2)

    fun = jax.jit(jax.value_and_grad(err2))
    res = scipy.optimize.minimize(lambda t: tuple(np.asarray(x) for x in fun(jnp.asarray(t))),
                                  0.1 * rng.standard_normal(16), jac=True, method="BFGS", options={"gtol": 1e-12})
    assert math.sqrt(res.fun) == pytest.approx(math.sqrt(2.2**2 + 1.3**2), abs=1e-6)
    fitted = np.asarray(lora.delta(res.x[:8].reshape(4, 2), res.x[8:].reshape(2, 4), cfg.scale))
    np.testing.assert_allclose(np.linalg.svd(fitted, compute_uv=False)[:2], [6.0, 3.6], atol=1e-6)


# ===== §11 A reward from human choices =========================================================================
def test_u19_s11_equal_rewards_give_a_coin_toss_ln2():
    """"If the scores were equal, the prediction would be 0.5 and the loss ln 2 ≈ 0.6931: a coin toss"."""
    for r in (0.0, 1.5, -7.0):
        assert float(reward.preference_probability(f64(r), f64(r))) == 0.5
        assert round(float(reward.bt_loss(f64(r), f64(r))), 4) == 0.6931
        np.testing.assert_allclose(float(reward.bt_loss(f64(r), f64(r))), LN2, rtol=1e-15)


def test_u19_s11_a_plus_10_reward_bug_changes_no_preference():
    """Pause & predict: "A reward model gives answer A 1.5 and answer B 0.5. A bug adds 10 to every reward it
    outputs. What is the new chance that A is preferred to B?" Still σ(1) ≈ 0.7311 (loss 0.3133, same nudge)."""
    p = float(reward.preference_probability(f64(11.5), f64(10.5)))
    assert round(p, 4) == 0.7311
    assert p == pytest.approx(float(reward.preference_probability(f64(1.5), f64(0.5))), rel=1e-15)
    assert round(float(reward.bt_loss(f64(11.5), f64(10.5))), 4) == 0.3133
    np.testing.assert_allclose(reward.bt_grads(f64(11.5), f64(10.5)), reward.bt_grads(f64(1.5), f64(0.5)), rtol=1e-14)


def test_u19_s11_the_nudge_is_1_minus_sigma():
    """"the step size times 1 − σ(1) ≈ 0.2689" (and the proof: ∂L/∂r_w = −(1 − σ), ∂L/∂r_l = +(1 − σ))."""
    g_w, g_l = (float(g) for g in reward.bt_grads(f64(1.5), f64(0.5)))
    assert (round(g_w, 4), round(g_l, 4)) == (-0.2689, 0.2689)


def test_u19_s11_quick_check_backwards_order_gets_a_big_nudge():
    """Quick check: "r_w = 0 for the answer the person preferred, r_l = 2 for the other. With step size 1, how much
    does each reward move?" (Answer, by the rule nudge = 1 − σ): 1 − σ(−2) ≈ 0.8808 each, r_w up to 0.8808, r_l
    down to 1.1192 — much more than the 0.2689 of a pair already in the right order."""
    g_w, g_l = (float(g) for g in reward.bt_grads(f64(0.0), f64(2.0)))
    assert (round(-g_w, 4), round(g_l, 4)) == (0.8808, 0.8808)
    assert (round(0.0 - g_w, 4), round(2.0 - g_l, 4)) == (0.8808, 1.1192)


# ===== §12 The leash ===========================================================================================
PI_REF, R = [0.5, 0.3, 0.2], [0.0, 1.0, 2.0]


def test_u19_s12_worked_example_every_string_length():
    """"Z ≈ 2.7933 … β = 0.5: (0.0367, 0.1626, 0.8008) … β = 2: (0.3250, 0.3215, 0.3534). β = 10: (0.4648, 0.3082,
    0.2271) — hugging the old habits"; the table: a longer string (small β) gives more reward and more KL."""
    assert round(math.exp(float(leash(PI_REF, R, 1.0)["objective"])), 4) == 2.7933  # β ln Z with β = 1
    for beta, printed in [(0.5, [0.0367, 0.1626, 0.8008]), (2.0, [0.3250, 0.3215, 0.3534]),
                          (10.0, [0.4648, 0.3082, 0.2271])]:
        np.testing.assert_array_equal(np.round(leash(PI_REF, R, beta)["pi"], 4), printed)
    outs = [leash(PI_REF, R, b) for b in (0.5, 1.0, 2.0, 10.0)]
    assert all(a["kl"] > b["kl"] and a["expected_reward"] > b["expected_reward"] for a, b in zip(outs, outs[1:]))


@PROPERTY
@given(ref=st.lists(st.floats(0.05, 1.0), min_size=4, max_size=4),
       rewards=st.lists(st.integers(-5, 5), min_size=4, max_size=4, unique=True))
def test_u19_s12_leash_limits(ref, rewards):
    """"As β → 0 all the probability goes to the highest-reward answer; as β → ∞, π* becomes π_ref" (and Pause &
    predict: "You make β very small — almost no leash. Where does π* put its probability?")."""
    pi_ref = np.asarray(ref) / np.sum(ref)
    loose = leash(pi_ref, rewards, 0.02)["pi"]  # reward gaps ≥ 1: the runner-up is ≤ e^{−50}·(ref ratio) behind
    best = int(np.argmax(rewards))
    assert np.delete(loose, best).sum() < 1e-18 and loose[best] == pytest.approx(1.0, abs=1e-15)
    short = leash(pi_ref, rewards, 1e8)
    np.testing.assert_allclose(short["pi"], pi_ref, rtol=1e-6)
    assert short["kl"] < 1e-12


def test_u19_s12_quick_check_two_answers():
    """Quick check: "Two answers, reference (0.5, 0.5), rewards (0, ln 3), β = 1. What is π*?" (0.25, 0.75)."""
    np.testing.assert_allclose(leash([0.5, 0.5], [0.0, math.log(3.0)], 1.0)["pi"], [0.25, 0.75], rtol=1e-14)


def test_u19_s12_an_answer_the_reference_never_writes_gets_zero():
    """Pause & predict: "One possible answer has reference probability exactly 0 — the old model would never write
    it — but a huge reward. What does π* give it?" 0: π_ref(y)·e^{r/β} = 0 whatever the reward. The KL stays finite
    and is Σ π log(π/π_ref) over the answers with π > 0: the problem is the three-answer one."""
    out = leash([0.5, 0.3, 0.2, 0.0], [0.0, 1.0, 2.0, 100.0], 1.0)
    assert out["pi"][3] == 0.0
    assert np.isfinite(out["kl"]) and np.isfinite(out["objective"])
    pi, kept = out["pi"], out["pi"] > 0
    np.testing.assert_allclose(out["kl"], np.sum(pi[kept] * np.log(pi[kept] / np.asarray(PI_REF))), rtol=1e-12)
    three = leash(PI_REF, R, 1.0)
    np.testing.assert_allclose(pi[:3], three["pi"], rtol=1e-12)
    for key in ("kl", "expected_reward", "objective"):
        np.testing.assert_allclose(out[key], three[key], rtol=1e-12)


def test_u19_s12_widget_flattering_answer_with_a_buggy_reward():
    """Widget: "a flattering answer D gets reward 6 from the reward model, though people rate it −2. At β = 1 it
    grabs 0.593 of the probability and the true quality falls to −0.638; at β = 5 it gets only 0.028." The widget
    does not print D's reference probability; these three numbers are reproduced with π_ref(D) = 0.01 and the
    other answers' (0.5, 0.3, 0.2) scaled by 0.99."""
    pi_ref = [0.495, 0.297, 0.198, 0.01]
    loose = leash(pi_ref, [0.0, 1.0, 2.0, 6.0], 1.0)["pi"]
    assert round(float(loose[3]), 3) == 0.593
    assert round(float(loose @ np.array([0.0, 1.0, 2.0, -2.0])), 3) == -0.638
    assert round(float(leash(pi_ref, [0.0, 1.0, 2.0, 6.0], 5.0)["pi"][3]), 3) == 0.028


@PROPERTY
@given(pi=st.lists(st.floats(0.01, 1.0), min_size=3, max_size=3), beta=st.floats(0.1, 10.0))
def test_u19_s12_no_policy_beats_beta_ln_Z(pi, beta):
    """Proof: "J ≤ β ln Z, with equality exactly at π = π*". J(π) = E_π[r̃] with the library's shaped reward
    r̃ = r − β(log π − log π_ref) (its expectation under π is r − β·KL); at π* r̃ is the same, β ln Z, for every
    answer."""
    pi = np.asarray(pi) / np.sum(pi)
    log_ref = np.log(np.asarray(PI_REF))

    def objective(p):
        return float(np.sum(p * np.asarray(rl.shaped_rewards(f64(R), f64(np.log(p)), f64(log_ref), beta))))

    best = leash(PI_REF, R, beta)
    assert objective(pi) <= float(best["objective"]) + 1e-12
    np.testing.assert_allclose(objective(best["pi"]), best["objective"], rtol=1e-12)
    np.testing.assert_allclose(rl.shaped_rewards(f64(R), f64(np.log(best["pi"])), f64(log_ref), beta),
                               best["objective"], rtol=1e-12)


# ===== §13 DPO =================================================================================================
@PROPERTY
@given(beta=st.floats(1e-3, 1e3), lp_w=st.floats(-50, 0), lp_l=st.floats(-50, 0))
def test_u19_s13_dpo_loss_is_ln2_at_the_start_whatever_beta(beta, lp_w, lp_l):
    """Quick check: "At the very start of DPO the policy is a copy of the reference. What is the loss on any pair,
    whatever β?" The margin is 0 and the loss ln 2 ≈ 0.6931."""
    w, l = f64(lp_w), f64(lp_l)
    assert float(dpo.margin(w, l, w, l, beta)) == 0.0
    np.testing.assert_allclose(float(dpo.dpo_loss(w, l, w, l, beta)), LN2, rtol=1e-15)
    assert round(float(dpo.dpo_loss(w, l, w, l, beta)), 4) == 0.6931


# ===== Practice problems =======================================================================================
def test_u19_p1_next_token():
    """Problem 1: scores late 2, early 0, full 1, banana −2. "(a) ≈ (0.6572, 0.0889, 0.2418, 0.0120) [total
    ≈ 11.243]. (b) late. (c) still 0.6572" after adding 3 to every score."""
    scores = np.array([2.0, 0.0, 1.0, -2.0])
    np.testing.assert_array_equal(np.round(probs(scores), 4), [0.6572, 0.0889, 0.2418, 0.0120])
    assert round(float(np.exp(-log_softmax(f64(scores))[1])), 3) == 11.243  # "early" (score 0) gets 1/total
    assert int(greedy(f64(scores)[None])[0]) == 0  # late
    assert round(float(probs(scores + 3)[0]), 4) == 0.6572
    np.testing.assert_allclose(probs(scores + 3), probs(scores), rtol=1e-14)


def test_u19_p2_scoring_a_sentence():
    """Problem 2: probabilities 0.5, 0.2, 0.9, 0.4. "(a) 0.036. (b) ≈ −3.3242. (c) ≈ 0.8311. (d) ≈ 2.2957.
    (e) ≈ 1.1990", with ln0.5 + ln0.2 + ln0.9 + ln0.4 ≈ −0.6931 − 1.6094 − 0.1054 − 0.9163."""
    ps = [0.5, 0.2, 0.9, 0.4]
    np.testing.assert_array_equal(np.round(-surprises(ps), 4), [-0.6931, -1.6094, -0.1054, -0.9163])
    ll = log_likelihood_of(ps)
    assert round(math.exp(ll), 12) == 0.036 and round(ll, 4) == -3.3242
    loss = loss_of(ps)
    assert round(loss, 4) == 0.8311
    assert round(float(perplexity(loss)), 4) == 2.2957
    np.testing.assert_allclose(float(perplexity(loss)), (1 / 0.036) ** (1 / 4), rtol=1e-13)
    assert round(float(bits_per_token(loss)), 4) == 1.1990


def test_u19_p3_reverse_engineer_a_perplexity():
    """Problem 3: "A three-token sentence has perplexity exactly 2.5. The model gave the first two true tokens 0.5
    and 0.8. What probability did it give the third?" p₃ = 0.16 (product 2.5⁻³ = 0.064): solved here by root-
    finding on the library's perplexity, and checked: (0.5 × 0.8 × 0.16)^(−1/3) = 2.5."""
    p3 = scipy.optimize.brentq(lambda p: float(perplexity(loss_of([0.5, 0.8, p]))) - 2.5, 0.01, 0.99, xtol=1e-14)
    assert round(p3, 10) == 0.16
    assert float(perplexity(loss_of([0.5, 0.8, 0.16]))) == pytest.approx(2.5, rel=1e-14)
    assert math.exp(log_likelihood_of([0.5, 0.8, 0.16])) == pytest.approx(0.064, rel=1e-14)


def test_u19_p6_temperature():
    """Problem 6: scores (3, 1, 0). "(a) ≈ (0.8438, 0.1142, 0.0420) [total 23.804]. (b) ≈ (0.6285, 0.2312, 0.1402)
    [total 7.130]. (c) T ≈ 2.885" — where the first token is exactly twice as likely as the second (T = 2/ln 2)."""
    z = np.array([3.0, 1.0, 0.0])
    for t, printed, total in [(1.0, [0.8438, 0.1142, 0.0420], 23.804), (2.0, [0.6285, 0.2312, 0.1402], 7.130)]:
        q = q_of(z, temperature=t)
        np.testing.assert_array_equal(np.round(q, 4), printed)
        assert round(1 / q[2], 3) == total  # the score-0 token gets 1/total
    t = scipy.optimize.brentq(lambda t: (lambda q: q[0] / q[1])(q_of(z, temperature=t)) - 2.0, 0.5, 20, xtol=1e-13)
    assert round(t, 3) == 2.885
    np.testing.assert_allclose(t, 2 / LN2, rtol=1e-10)


def test_u19_p7_top_k_and_top_p():
    """Problem 7: list A (0.35, 0.25, 0.20, 0.10, 0.06, 0.04), list B (0.85, 0.07, 0.05, 0.03). "(a) ≈ (0.5833,
    0.4167). (b) 3 tokens, (0.4375, 0.3125, 0.25). (c) 1 token, probability 1. (d) ≈ (0.9239, 0.0761)"."""
    a, b = np.log([0.35, 0.25, 0.20, 0.10, 0.06, 0.04]), np.log([0.85, 0.07, 0.05, 0.03])
    qa = q_of(a, temperature=1.0, top_k=2)
    np.testing.assert_array_equal(np.round(qa, 4), [0.5833, 0.4167, 0, 0, 0, 0])
    qb = q_of(a, temperature=1.0, top_p=0.75)
    assert np.count_nonzero(qb) == 3
    np.testing.assert_allclose(qb, [0.4375, 0.3125, 0.25, 0, 0, 0], rtol=1e-12, atol=1e-300)
    qc = q_of(b, temperature=1.0, top_p=0.8)
    assert np.count_nonzero(qc) == 1 and qc[0] == pytest.approx(1.0, rel=1e-15)
    np.testing.assert_array_equal(np.round(q_of(b, temperature=1.0, top_k=2), 4), [0.9239, 0.0761, 0, 0])


def test_u19_p10_rotary_clocks():
    """Problem 10, d = 16: "(a) 10^(−i/2): 1 … 0.0003162. (b) ≈ 19 869. (c) ≈ 1.295 rad. (d) scale 0.25; ≈ 0.949 rad
    (not 3.795)" — angles read off the slowest hand of ``ops.rope``."""
    theta = np.asarray(rope_frequencies(16, BASE, jnp.float64))
    np.testing.assert_allclose(theta, [1, 0.3162, 0.1, 0.03162, 0.01, 0.003162, 0.001, 0.0003162], rtol=1.6e-4)
    turn = 2 * np.pi / theta[7]
    assert round(turn) == 19_869
    after_turn = slow_hand_angle(turn, 16)
    assert min(after_turn, 2 * np.pi - after_turn) < 1e-9  # back where it started: one full turn
    assert round(slow_hand_angle(4_096, 16), 3) == 1.295
    assert 4_096 / 16_384 == 0.25
    assert round(slow_hand_angle(12_000, 16, scale=0.25), 3) == 0.949
    assert slow_hand_angle(12_000, 16, scale=0.25) < slow_hand_angle(4_096, 16)  # inside the trained range
    assert round(slow_hand_angle(12_000, 16), 3) == 3.795  # without interpolation: far outside


def test_u19_p12_the_loss_mask():
    """Problem 12: user's tokens 0.05, 0.3, 0.6; answer's 0.7, 0.9, 0.95, 0.6. "(a) ≈ 0.2560. (b) ≈ 0.8192. (c) the
    user's first token (2.9957)", with surprises 0.3567, 0.1054, 0.0513, 0.5108 (sum ≈ 1.0242) for the answer."""
    ps, mask = [0.05, 0.3, 0.6, 0.7, 0.9, 0.95, 0.6], [0, 0, 0, 1, 1, 1, 1]
    s = surprises(ps)
    np.testing.assert_array_equal(np.round(s[3:], 4), [0.3567, 0.1054, 0.0513, 0.5108])
    assert round(float(s[3:].sum()), 4) == 1.0242
    assert round(loss_of(ps, mask), 4) == 0.2560
    assert round(loss_of(ps), 4) == 0.8192
    assert int(np.argmax(s)) == 0 and round(float(s[0]), 4) == 2.9957


def test_u19_p13a_lora_product_has_rank_2():
    """Problem 13 (a): B = ((1, 0), (0, 1), (1, 1)), A = ((1, 2, 0), (0, 1, −1)): "rows (1, 2, 0), (0, 1, −1),
    (1, 3, −1); rank 2" (the library writes the product as its first factor times its second)."""
    dw = np.asarray(lora.delta(f64([[1, 0], [0, 1], [1, 1]]), f64([[1, 2, 0], [0, 1, -1]]), 1.0))
    assert dw.tolist() == [[1, 2, 0], [0, 1, -1], [1, 3, -1]]
    assert np.linalg.matrix_rank(dw) == 2


def test_u19_p14_bradley_terry():
    """Problem 14: r_w = 0.8, r_l = 1.2, step size 0.5. "(a) ≈ 0.4013. (b) ≈ 0.9130. (c) r_w ≈ 1.0993, r_l ≈ 0.9007.
    (d) ≈ 0.5495" (nudge ≈ 0.2993, new gap ≈ 0.1987)."""
    r_w, r_l = f64(0.8), f64(1.2)
    assert round(float(reward.preference_probability(r_w, r_l)), 4) == 0.4013
    assert round(float(reward.bt_loss(r_w, r_l)), 4) == 0.9130
    g_w, g_l = reward.bt_grads(r_w, r_l)
    assert round(float(-0.5 * g_w), 4) == 0.2993
    new_w, new_l = r_w - 0.5 * g_w, r_l - 0.5 * g_l
    assert (round(float(new_w), 4), round(float(new_l), 4)) == (1.0993, 0.9007)
    assert round(float(new_w - new_l), 4) == 0.1987
    assert round(float(reward.preference_probability(new_w, new_l)), 4) == 0.5495


def test_u19_p15_the_leash():
    """Problem 15: π_ref = (0.6, 0.3, 0.1), rewards (0, 1, 3). "(a) ≈ (0.1752, 0.2382, 0.5866) [Z ≈ 3.4240].
    (b) ≈ 1.9980, 0.7672, 1.2308 = ln Z. (c) ≈ (0.3889, 0.3206, 0.2905) [Z ≈ 1.5428]; the third answer"."""
    ref, r = [0.6, 0.3, 0.1], [0.0, 1.0, 3.0]
    one, two = leash(ref, r, 1.0), leash(ref, r, 2.0)
    np.testing.assert_array_equal(np.round(one["pi"], 4), [0.1752, 0.2382, 0.5866])
    assert round(math.exp(float(one["objective"])), 4) == 3.4240
    assert round(float(one["expected_reward"]), 4) == 1.9980
    assert round(float(one["kl"]), 4) == 0.7672
    assert round(float(one["objective"]), 4) == 1.2308
    np.testing.assert_allclose(one["objective"], one["expected_reward"] - one["kl"], rtol=1e-14)
    np.testing.assert_array_equal(np.round(two["pi"], 4), [0.3889, 0.3206, 0.2905])
    assert round(math.exp(float(two["objective"]) / 2.0), 4) == 1.5428
    assert int(np.argmax(np.abs(one["pi"] - two["pi"]))) == 2


def test_u19_p16_dpo():
    """Problem 16: β = 0.2, reference 0.1 (preferred) and 0.3 (rejected), policy 0.2 and 0.15. "(a) ≈ 0.6931 and
    ≈ −0.6931. (b) margin ≈ 0.2773, loss ≈ 0.5641. (c) ln 2 ≈ 0.6931. (d) ≈ 0.0862" (σ(−0.2773) ≈ 0.4311)."""
    lp_w, lp_l, ref_w, ref_l = np.log(f64([0.2, 0.15, 0.1, 0.3]))
    zero = f64(0.0)
    assert round(float(dpo.margin(lp_w, zero, ref_w, zero, 1.0)), 4) == 0.6931  # log-ratio of the preferred
    assert round(float(-dpo.margin(zero, lp_l, zero, ref_l, 1.0)), 4) == -0.6931  # log-ratio of the rejected
    m = dpo.margin(lp_w, lp_l, ref_w, ref_l, 0.2)
    assert round(float(m), 4) == 0.2773
    assert round(float(dpo.dpo_loss(lp_w, lp_l, ref_w, ref_l, 0.2)), 4) == 0.5641
    assert round(float(dpo.dpo_loss(ref_w, ref_l, ref_w, ref_l, 0.2)), 4) == 0.6931  # before training: π = π_ref
    assert round(float(dpo.pair_weight(m, 0.2)) / 0.2, 4) == 0.4311
    assert round(float(dpo.pair_weight(m, 0.2)), 4) == 0.0862
