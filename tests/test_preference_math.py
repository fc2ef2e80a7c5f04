"""The preference objectives' equations against the seeds (U19 §11 reward model, §12 KL leash, §13 DPO), DPO's
gradient three ways, and response log-probabilities of ragged batches."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mlx_llm import forward, init_params
from mlx_llm.errors import ConfigError, DataError
from mlx_llm.ops import log_softmax
from mlx_llm.post import dpo, pairs, reward, rl
from mlx_llm.data.chat import ChatTemplate
from mlx_llm.data.tokenizer import ByteTokenizer
from helpers import tiny_cfg

CFG = tiny_cfg(vocab_size=263, n_heads=2, n_kv_heads=1, d_head=8, max_seq_len=48)
TOK, TEMPLATE = ByteTokenizer(), ChatTemplate()
FORWARD = jax.jit(forward, static_argnums=2)
INIT = jax.jit(lambda cfg, key: init_params(cfg, key, dtype=jnp.float64), static_argnums=0)


def f64(x):
    return jnp.asarray(x, jnp.float64)


# ----- U19 §11: Bradley–Terry -------------------------------------------------------------------------------
def test_bradley_terry_seed_numbers():
    r_c, r_r = f64(1.5), f64(0.5)
    assert round(float(reward.preference_probability(r_c, r_r)), 4) == 0.7311
    assert round(float(reward.bt_loss(r_c, r_r)), 4) == 0.3133
    g_c, g_r = reward.bt_grads(r_c, r_r)
    auto = jax.grad(lambda r: reward.bt_loss(r[0], r[1]))(jnp.stack([r_c, r_r]))
    np.testing.assert_allclose(np.asarray(auto), [float(g_c), float(g_r)], rtol=1e-14)
    h = 1e-6
    fd = (reward.bt_loss(r_c + h, r_r) - reward.bt_loss(r_c - h, r_r)) / (2 * h)
    np.testing.assert_allclose(float(fd), float(g_c), rtol=1e-8)
    new_c, new_r = r_c - 1.0 * g_c, r_r - 1.0 * g_r  # one gradient step of size 1
    assert (round(float(new_c), 4), round(float(new_r), 4)) == (1.7689, 0.2311)
    assert round(float(new_c - new_r), 4) == 1.5379
    assert round(float(reward.preference_probability(new_c, new_r)), 3) == 0.823
    for c in (-3.0, 0.25, 100.0):  # a constant added to every reward changes nothing
        np.testing.assert_allclose(float(reward.bt_loss(r_c + c, r_r + c)), float(reward.bt_loss(r_c, r_r)), rtol=1e-14)
        np.testing.assert_allclose(float(reward.preference_probability(r_c + c, r_r + c)), 0.7310585786300049,
                                   rtol=1e-14)


# ----- U19 §12: the leash -----------------------------------------------------------------------------------
PI_REF, R = [0.5, 0.3, 0.2], [0.0, 1.0, 2.0]


def test_leash_closed_form_seed_numbers():
    out = rl.leash(f64(PI_REF), f64(R), 1.0)
    np.testing.assert_array_equal(np.round(np.asarray(out["pi"]), 4), [0.1790, 0.2919, 0.5291])
    assert round(float(out["expected_reward"]), 4) == 1.3501
    assert round(float(out["kl"]), 4) == 0.3228
    assert round(float(out["objective"]), 4) == 1.0272
    np.testing.assert_allclose(float(out["objective"]), float(out["expected_reward"] - out["kl"]), rtol=1e-14)
    np.testing.assert_array_equal(np.round(np.asarray(rl.leash(f64(PI_REF), f64(R), 0.5)["pi"]), 3),
                                  [0.037, 0.163, 0.801])
    np.testing.assert_array_equal(np.round(np.asarray(rl.leash(f64(PI_REF), f64(R), 10.0)["pi"]), 3),
                                  [0.465, 0.308, 0.227])


@pytest.mark.parametrize("beta", [1.0, 0.5, 10.0])
def test_on_policy_trainer_converges_to_the_closed_form(beta):
    """The RL update (k1-shaped reward, leave-one-out group advantages) on the 3-answer bandit: π_θ ends at π*.
    At π* the shaped reward r − β log(π*/π_ref) = β ln Z is the same for every answer, so the advantages vanish
    and the iterates stop moving: the agreement is far inside the sampling error of one step's 16 draws."""
    trace = np.asarray(rl.train_bandit(PI_REF, R, beta, k=16, steps=3000, lr=0.05, seed=1))
    want = np.asarray(rl.leash(f64(PI_REF), f64(R), beta)["pi"])
    assert np.abs(trace[0] - want).max() > 0.01  # it starts away from π* (π_ref after one step)
    np.testing.assert_allclose(trace[-1], want, atol=2e-3)
    np.testing.assert_allclose(trace[-500:].mean(0), want, atol=2e-3)


def test_leash_with_a_zero_reference_probability_is_finite():
    """U19 §12: "One possible answer has reference probability exactly 0 … What does π* give it?" π* ∝ π_ref e^{r/β}
    gives it 0 whatever its reward, and the KL counts it as 0·log 0 = 0: KL = Σ_{π>0} π log(π/π_ref)."""
    pi_ref, r = f64([0.5, 0.5, 0.0]), f64([0.0, 1.0, 5.0])
    for beta in (0.5, 1.0, 4.0):
        out = rl.leash(pi_ref, r, beta)
        pi = np.asarray(out["pi"])
        assert pi[2] == 0.0 and all(np.isfinite(float(v)) for v in out.values() if np.ndim(v) == 0)
        want = np.exp(np.array([0.0, 1.0]) / beta) / np.exp(np.array([0.0, 1.0]) / beta).sum()
        np.testing.assert_allclose(pi[:2], want, rtol=1e-14)
        np.testing.assert_allclose(float(out["kl"]), float(np.sum(want * np.log(want / 0.5))), rtol=1e-13)
        np.testing.assert_allclose(float(out["objective"]), float(out["expected_reward"] - beta * out["kl"]),
                                   rtol=1e-13)
    trace = np.asarray(rl.train_bandit([0.5, 0.5, 0.0], [0.0, 1.0, 5.0], 1.0, k=16, steps=1500, lr=0.05, seed=1))
    assert np.isfinite(trace).all() and (trace[:, 2] == 0).all()  # never sampled, never given mass
    np.testing.assert_allclose(trace[-1], np.asarray(rl.leash(pi_ref, r, 1.0)["pi"]), atol=3e-3)


def test_group_advantages_are_leave_one_out():
    r = f64([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    np.testing.assert_allclose(np.asarray(rl.group_advantages(r)), [[2 / 3, -2 / 3, -2 / 3, 2 / 3], [0, 0, 0, 0]],
                               rtol=1e-14, atol=1e-15)
    with pytest.raises(ConfigError, match=r"k = 1 is invalid: .* k must be an integer ≥ 2"):
        rl.check_group(1)
    for bad in (0.0, -1.0, float("inf"), float("nan"), True):
        with pytest.raises(ConfigError, match=r"beta = .* is invalid: it must be a finite number > 0"):
            rl.leash(f64(PI_REF), f64(R), bad)


# ----- U19 §13: DPO -----------------------------------------------------------------------------------------
def test_dpo_seed_numbers():
    lp = np.log(f64([0.3, 0.1, 0.2, 0.2]))
    m = dpo.margin(*lp, 0.1)
    assert round(float(m), 4) == 0.1099
    assert round(float(dpo.dpo_loss(*lp, 0.1)), 4) == 0.6397
    assert round(float(dpo.pair_weight(m, 0.1)), 4) == 0.0473
    ref = np.log(f64([0.2, 0.2, 0.2, 0.2]))
    np.testing.assert_allclose(float(dpo.dpo_loss(*ref, 0.1)), np.log(2.0), rtol=1e-15)
    halved = np.log(f64([0.15, 0.05, 0.2, 0.2]))
    np.testing.assert_allclose(float(dpo.dpo_loss(*halved, 0.1)), float(dpo.dpo_loss(*lp, 0.1)), rtol=1e-14)


def _pair_batch():
    records = [{"prompt": [{"role": "user", "content": q}], "chosen": {"role": "assistant", "content": c},
                "rejected": {"role": "assistant", "content": r}}
               for q, c, r in (("What is 2 + 2?", "4", "5"), ("Name it", "print", "printf"), ("hi", "hello there", "no"))]
    data = pairs.PairData.build(records[:1], records, TOK, TEMPLATE, 40)
    (batch, n), = data.val_batches(3)  # in the records' order
    assert n == 3
    return jax.tree.map(jnp.asarray, batch), records


@pytest.mark.slow
def test_dpo_gradient_is_weighted_difference_of_log_prob_gradients():
    """∇_θ L = −β σ(−m) (∇ℓ_θ(y⁺) − ∇ℓ_θ(y⁻)): jax.grad against the formula (with jax.grad of ℓ), and a central
    difference along a random direction."""
    batch, _ = _pair_batch()
    params = INIT(CFG, jax.random.key(0))
    beta = 0.5
    ref_c, ref_r = f64([-20.0]), f64([-3.0])  # the frozen reference's ℓ: constants of θ
    one = jax.tree.map(lambda a: a[:1], batch)

    def loss(p):
        lp_c, lp_r = dpo.pair_logprobs(p, CFG, one)
        return dpo.dpo_loss(lp_c, lp_r, ref_c, ref_r, beta)[0]

    direction = jax.tree.map(lambda a: jnp.asarray(np.random.default_rng(a.size).standard_normal(a.shape)), params)
    h = 1e-5

    @jax.jit
    def three_ways(params):  # one compilation for all of it
        lp_c, lp_r = dpo.pair_logprobs(params, CFG, one)
        w = dpo.pair_weight(dpo.margin(lp_c, lp_r, ref_c, ref_r, beta), beta)[0]
        grad_lp = jax.grad(lambda p, seqs: pairs.response_logprobs(p, CFG, seqs)[0])
        formula = jax.tree.map(lambda a, b: -w * (a - b), grad_lp(params, one["chosen"]), grad_lp(params, one["rejected"]))
        loss_at = lambda s: loss(jax.tree.map(lambda p, d: p + s * d, params, direction))  # noqa: E731
        return jax.grad(loss)(params), formula, (loss_at(h) - loss_at(-h)) / (2 * h)

    auto, formula, fd = three_ways(params)
    for a, b in zip(jax.tree.leaves(auto), jax.tree.leaves(formula)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-9, atol=1e-13)
    along = sum(float(jnp.sum(a * d)) for a, d in zip(jax.tree.leaves(auto), jax.tree.leaves(direction)))
    np.testing.assert_allclose(float(fd), along, rtol=1e-6)


def test_response_logprobs_of_ragged_batches_sum_reply_tokens():
    """Each sequence's ℓ equals the sum of log p over its reply tokens from ``forward`` on that conversation
    alone (prompt tokens excluded), whatever the padding around it."""
    batch, records = _pair_batch()
    params = INIT(CFG, jax.random.key(2))
    lp_c, lp_r = dpo.pair_logprobs(params, CFG, batch)
    for side, got in (("chosen", lp_c), ("rejected", lp_r)):
        for b, rec in enumerate(records):
            ids, target = TEMPLATE.encode(rec["prompt"] + [rec[side]], TOK)
            logp = np.asarray(log_softmax(FORWARD(params, jnp.asarray(ids[None, :-1]), CFG)))[0]
            want = sum(logp[t - 1, ids[t]] for t in range(1, len(ids)) if target[t])
            n_reply = len(TOK.encode(rec[side]["content"])) + 1  # content and end marker
            assert target.sum() == n_reply
            np.testing.assert_allclose(float(got[b]), want, rtol=1e-12)
    assert len({int(n) for n in batch["chosen"]["length"]}) == 3  # genuinely ragged


@pytest.mark.slow
def test_reward_is_read_at_the_last_reply_token():
    batch, _ = _pair_batch()
    params = INIT(CFG, jax.random.key(3))
    head = jnp.asarray(np.random.default_rng(0).standard_normal(CFG.d_model))
    r = reward.sequence_rewards(params, head, CFG, batch["chosen"])
    for b in range(3):
        n = int(batch["chosen"]["length"][b])
        alone = {"ids": batch["chosen"]["ids"][b:b + 1, :n], "length": jnp.asarray([n])}
        np.testing.assert_allclose(float(reward.sequence_rewards(params, head, CFG, alone)[0]), float(r[b]),
                                   rtol=1e-12)
    assert int(batch["chosen"]["ids"][0, int(batch["chosen"]["length"][0]) - 1]) == TOK.token_id(TEMPLATE.end)


# ----- pairs --------------------------------------------------------------------------------------------------
def test_corruptions_are_plausible_and_wrong():
    rng = np.random.default_rng(0)
    for answer in ("0", "7", "10", "-5", "-100", "999", "1234"):
        for _ in range(20):
            bad = pairs.corrupt_integer(answer, rng)
            assert bad != answer and len(bad.lstrip("-")) == len(answer.lstrip("-"))
            assert sum(a != b for a, b in zip(bad.lstrip("-"), answer.lstrip("-"))) == 1
            assert str(int(bad)) == bad  # canonical
    names = ["abs", "all", "any", "ascii"]
    assert pairs.corruption("name_function", "all", rng, names) in ("abs", "any")
    assert pairs.corruption("name_function", "abs", rng, names) == "all"
    tp = pairs.task_pairs("addition2", "train", n=30, seed=0)
    assert len(tp) == 30 and all(p["chosen"]["content"] != p["rejected"]["content"] for p in tp)


def test_malformed_pair_files_are_refused_with_file_and_line(tmp_path):
    good = {"prompt": [{"role": "user", "content": "q"}], "chosen": {"role": "assistant", "content": "a"},
            "rejected": {"role": "assistant", "content": "b"}}
    cases = [
        ("{not json", r"bad.jsonl:2: not JSON"),
        (json.dumps({**good, "extra": 1}), r"bad.jsonl:2: expected an object with exactly 'prompt', 'chosen' and"),
        (json.dumps({**good, "chosen": {"role": "user", "content": "a"}}), r":2: chosen must be one message with role"),
        (json.dumps({**good, "rejected": {"role": "assistant", "content": "a"}}), r":2: chosen and rejected are the same"),
        (json.dumps({**good, "prompt": [{"role": "assistant", "content": "x"}]}), r":2: the prompt ends with an assist"),
        (json.dumps({**good, "prompt": []}), r":2: messages must be a non-empty list"),
        (json.dumps({**good, "chosen": {"role": "assistant", "content": " "}}), r":2: message 0 \(assistant\) has empty"),
    ]
    for line, message in cases:
        path = tmp_path / "bad.jsonl"
        path.write_text(json.dumps(good) + "\n" + line + "\n")
        with pytest.raises(DataError, match=message):
            pairs.read_pairs(path)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match=r"empty.jsonl: no preference pairs"):
        pairs.read_pairs(tmp_path / "empty.jsonl")
    with pytest.raises(DataError, match=r"missing.jsonl: no such file"):
        pairs.read_pairs(tmp_path / "missing.jsonl")
    with pytest.raises(DataError, match=r"pairs of up to 7 tokens do not fit seq_len = 6"):
        pairs.PairData.build([good], [good], TOK, TEMPLATE, 6)
