"""Masked diffusion (objectives/diffusion.py, decode/diffusion.py): M20 §19's marginal, the estimator against
its exact integral, the bound against the sampler's exact log-probability, no target leakage, the samplers, and
bad input. Float64, a tiny bidirectional model over 3 real tokens + MASK, shared compiled functions."""

import jax

jax.config.update("jax_enable_x64", True)

import dataclasses  # noqa: E402
import functools  # noqa: E402
import itertools  # noqa: E402
import math  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from mlx_llm import ModelConfig, init_params  # noqa: E402
from mlx_llm.decode import diffusion as sampler  # noqa: E402
from mlx_llm.errors import ConfigError, InputError  # noqa: E402
from mlx_llm.objectives import diffusion  # noqa: E402
from mlx_llm.data.tokenizer import DIFFUSION_SPECIAL_TOKENS, ByteTokenizer  # noqa: E402

MASK = 3
CFG = ModelConfig(vocab_size=4, d_model=8, n_layers=2, n_heads=2, n_kv_heads=1, d_head=4, d_ff=8, max_seq_len=8,
                  causal=False)
N = 3  # sequence length of the enumeration tests


@functools.lru_cache(maxsize=None)
def params():
    p = init_params(CFG, jax.random.key(0), jnp.float64)
    return jax.tree.map(lambda a: a * 3.0, p)  # sharper predictions: the masks really change them


@jax.jit
def _logp(p, z_BT):
    from mlx_llm.model import forward

    return diffusion.denoiser_log_probs(forward(p, z_BT, CFG), MASK)


def log_prob_fn(x):
    """masked (N,) bool → log p_θ(x_i | z_M) (N,) for the clean x."""
    x = np.asarray(x)

    def fn(masked):
        z = np.where(masked, MASK, x)[None]
        lp = np.asarray(_logp(params(), jnp.asarray(z)))[0]
        return lp[np.arange(len(x)), x]

    return fn


# ----- 1. M20 §19's marginal ------------------------------------------------------------------------------------
def test_m20_s19_marginal_over_hidden_trajectories():
    r = np.array([0.18, 0.42, 0.12, 0.28])
    k = diffusion.bit_flip_kernel(2, 0.2)
    assert k[0].tolist() == pytest.approx([0.64, 0.16, 0.16, 0.04], abs=1e-15)
    got = diffusion.marginal(r, [k])
    assert np.round(got, 4).tolist() == [0.2128, 0.3472, 0.1672, 0.2728]
    brute = np.zeros(4)  # every path z1 → z0: 4 × 4 products of p(z1) K(z0 | z1)
    for z1, z0 in itertools.product(range(4), range(4)):
        h = bin(z1 ^ z0).count("1")
        brute[z0] += r[z1] * 0.8 ** (2 - h) * 0.2 ** h
    assert np.max(np.abs(got - brute)) <= 1e-15
    assert got[0] == pytest.approx(0.18 * 0.64 + 0.42 * 0.16 + 0.12 * 0.16 + 0.28 * 0.04, abs=1e-15)
    with pytest.raises(InputError, match="not a probability vector"):
        diffusion.marginal([0.5, 0.6], [])
    with pytest.raises(InputError, match="not a row-stochastic"):
        diffusion.marginal(r, [np.eye(3)])


# ----- 2. the estimator is unbiased for its definition --------------------------------------------------------
@jax.jit
def _nelbo_draws(p, x_BT, key):
    return diffusion.nelbo_terms(p, x_BT, key, CFG, mask_id=MASK, antithetic=True)[0]


@pytest.mark.slow
def test_monte_carlo_nelbo_matches_exact_integral():
    x = np.array([0, 2, 1])
    exact = diffusion.exact_nelbo(log_prob_fn(x), x)
    batch = 4096
    draws = np.concatenate([np.asarray(_nelbo_draws(params(), jnp.asarray(np.tile(x, (batch, 1))),
                                                    jax.random.key(s))) for s in range(8)])
    mean, se = draws.mean(), draws.std() / math.sqrt(draws.size)
    assert abs(mean - exact) <= 4 * se + 1e-9, (mean, exact, se)
    assert se < 0.05 * exact  # the test has power: a 10 % bias would show


# ----- 3. the bound is a bound --------------------------------------------------------------------------------
def exact_sampler_log_prob(x, steps: int) -> float:
    """log of the ancestral sampler's probability of producing x from all-MASK in S steps, summing over every
    trajectory: each position's reveal step r_i ∈ {S, …, 1}; going from t_k to t_{k−1}, a still-masked position
    is revealed with probability 1/k and then takes x_i with probability p_θ(x_i | z_{t_k})."""
    n, total = len(x), 0.0
    fn = log_prob_fn(x)
    cache = {}
    for reveal in itertools.product(range(1, steps + 1), repeat=n):
        prob = 1.0
        for k in range(steps, 0, -1):
            masked = np.array([r <= k for r in reveal])  # still MASK at t_k
            if not masked.any():
                break
            key = tuple(masked)
            if key not in cache:
                cache[key] = np.exp(fn(masked))
            for i in np.flatnonzero(masked):
                prob *= (1.0 / k) * cache[key][i] if reveal[i] == k else 1.0 - 1.0 / k
        total += prob
    return math.log(total)


@pytest.mark.parametrize("x", [(0, 1, 2), (2, 2, 0), (1, 0, 0)])
def test_discrete_elbo_is_below_exact_log_prob(x):
    x = np.array(x)
    for steps in (1, 2, 3, 5):
        log_p = exact_sampler_log_prob(x, steps)
        elbo = -diffusion.exact_nelbo(log_prob_fn(x), x, steps=steps)
        if steps == 1:  # one step reveals every position at once: the bound is exact
            assert abs(elbo - log_p) <= 1e-12
        else:
            assert elbo <= log_p + 1e-12 and log_p - elbo > 1e-6, (steps, elbo, log_p)


def test_discrete_elbo_tends_to_continuous():
    x = np.array([0, 2, 1])
    cont = diffusion.exact_nelbo(log_prob_fn(x), x)
    gaps = [abs(diffusion.exact_nelbo(log_prob_fn(x), x, steps=s) - cont) for s in (2, 8, 32, 128, 1024)]
    assert all(a > b for a, b in zip(gaps, gaps[1:])), gaps
    assert gaps[-1] < 1e-2 * cont and gaps[-1] < gaps[0] / 50


def test_sampler_output_log_prob_is_consistent_with_sampling():
    """The enumerated probabilities over all 27 outputs sum to 1 (they describe the sampler), and samples of the
    jitted sampler follow them (chi-square style check on the most likely outputs)."""
    steps = 2
    outs = [np.array(o) for o in itertools.product(range(3), repeat=N)]
    probs = np.array([math.exp(exact_sampler_log_prob(o, steps)) for o in outs])
    assert abs(probs.sum() - 1.0) <= 1e-12
    got = np.asarray(sampler.sample(params(), CFG, np.zeros((4000, 0), np.int32), N, steps=steps, mask_id=MASK,
                                    temperature=1.0, seed=3))
    freq = np.array([np.mean(np.all(got == o, axis=1)) for o in outs])
    se = np.sqrt(probs * (1 - probs) / got.shape[0])
    assert np.all(np.abs(freq - probs) <= 5 * se + 1e-3), np.c_[freq, probs]


# ----- 4. no leakage ------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_prediction_at_a_masked_position_does_not_depend_on_its_clean_token():
    """Gradient of log p_θ(x_i | z_t) at a masked i with respect to the one-hot of x_i (entering through the
    corruption z = m·MASK + (1 − m)·x): exactly zero; for an unmasked j, the prediction at i does depend on x_j."""
    from mlx_llm.model import logits_from_hidden, run_stack, Context
    from mlx_llm.ops import document_mask

    x = jnp.array([[0, 2, 1, 1]])
    masked = jnp.array([[True, False, True, False]])
    p = params()

    def logp_at(onehot_x, i):
        onehot_z = jnp.where(masked[..., None], jax.nn.one_hot(MASK, 4, dtype=onehot_x.dtype), onehot_x)
        h = onehot_z @ p["embed"]
        ctx = Context(jnp.arange(4)[None], document_mask(None, 1, 4))
        logits = logits_from_hidden(run_stack(h, p, CFG, ctx)[0], p, CFG)
        return diffusion.denoiser_log_probs(logits, MASK)[0, i, x[0, i]]

    onehot = jax.nn.one_hot(x, 4, dtype=jnp.float64)
    g = jax.grad(logp_at)(onehot, 2)
    assert np.all(np.asarray(g[0, 2]) == 0.0) and np.all(np.asarray(g[0, 0]) == 0.0)  # masked positions
    assert np.max(np.abs(np.asarray(g[0, 1]))) > 1e-4  # a visible neighbour matters
    assert abs(float(logp_at(onehot, 2)) - float(_logp(p, jnp.where(masked, MASK, x))[0, 2, 1])) <= 1e-12


def test_masked_nll_carries_unmasked_positions_and_excludes_mask():
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((1, 3, 4)))
    nll = diffusion.masked_nll(logits, jnp.array([[0, 1, 2]]), jnp.array([[True, False, True]]), MASK)
    lp = jax.nn.log_softmax(logits[..., :3])
    assert float(nll[0, 1]) == 0.0
    assert abs(float(nll[0, 0]) + float(lp[0, 0, 0])) <= 1e-12 and abs(float(nll[0, 2]) + float(lp[0, 2, 2])) <= 1e-12


# ----- 5. samplers ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind, steps, block", [("ancestral", 5, None), ("ancestral", 2, None), ("remask", 6, 3),
                                                ("remask", 3, None)])
def test_samplers_fill_every_position_and_keep_the_prompt(kind, steps, block):
    prompt = np.array([[0, 1], [2, 2]])
    out = np.asarray(sampler.sample(params(), CFG, prompt, 6, steps=steps, mask_id=MASK, sampler=kind,
                                    block_length=block, seed=1))
    assert out.shape == (2, 8) and not np.any(out == MASK)
    assert np.array_equal(out[:, :2], prompt)
    again = np.asarray(sampler.sample(params(), CFG, prompt, 6, steps=steps, mask_id=MASK, sampler=kind,
                                      block_length=block, seed=1))
    assert np.array_equal(out, again)


def test_remask_schedule_and_greedy_single_step():
    block, counts = sampler.reveal_schedule(6, 4, 3)
    assert block == 3 and counts.tolist() == [2, 1, 2, 1]
    # one ancestral step, greedy: every position takes the argmax of p_θ(· | all MASK)
    out = np.asarray(sampler.sample(params(), CFG, np.zeros((1, 0), np.int32), 4, steps=1, mask_id=MASK,
                                    temperature=None))
    want = np.argmax(np.asarray(_logp(params(), jnp.full((1, 4), MASK)))[0], axis=-1)
    assert np.array_equal(out[0], want)


# ----- 6. bad input ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, error, message", [
    (dict(steps=0), ConfigError, r"steps = 0 is invalid: a diffusion sampler needs at least 1 step"),
    (dict(length=7), InputError, r"prompt length 2 \+ length 7 = 9 is longer than max_seq_len = 8"),
    (dict(mask_id=None), ConfigError, r"needs a MASK token id"),
    (dict(mask_id=4), ConfigError, r"mask_id = 4 is not a token id of the model"),
    (dict(sampler="greedy"), ConfigError, r"sampler = 'greedy' is invalid"),
    (dict(sampler="remask", block_length=4), ConfigError, r"block_length = 4 is invalid"),
    (dict(sampler="remask", steps=3, block_length=3), ConfigError, r"steps = 3 cannot be split evenly over 2"),
    (dict(prompt=[[0, MASK]]), InputError, r"prompt\[0, 1\] is the MASK id 3"),
    (dict(prompt=[[0, 9]]), InputError, r"prompt\[0, 1\] = 9 is not a valid token id"),
    (dict(temperature=0.0), ConfigError, r"temperature = 0.0 is invalid"),
])
def test_bad_sampler_input(kwargs, error, message):
    args = dict(prompt=[[0, 1]], length=6, steps=4, mask_id=MASK)
    args.update(kwargs)
    prompt, length = args.pop("prompt"), args.pop("length")
    with pytest.raises(error, match=message):
        sampler.sample(params(), CFG, np.array(prompt), length, **args)


def test_causal_and_bidirectional_models_refuse_each_others_decoders():
    from mlx_llm import generate

    with pytest.raises(InputError, match=r"bidirectional \(causal = false\): it has no KV cache"):
        generate(params(), CFG, np.array([[0, 1]]), 2)
    with pytest.raises(ConfigError, match=r"causal \(causal = true\): it is not a diffusion denoiser"):
        sampler.sample(params(), dataclasses.replace(CFG, causal=True), np.array([[0]]), 2, steps=2, mask_id=MASK)
    with pytest.raises(ConfigError, match=r"causal = false cannot be used with Mamba or sliding-window layers"):
        dataclasses.replace(CFG, mixer_pattern=("mamba",), ffn_pattern=("none",))


def test_tokenizer_mask_token():
    assert ByteTokenizer().mask_id is None  # AR tokenizers keep their ids
    tok = ByteTokenizer(DIFFUSION_SPECIAL_TOKENS)
    assert tok.mask_id == 256 + len(DIFFUSION_SPECIAL_TOKENS) - 1 and tok.vocab_size == tok.mask_id + 1
    assert tok.decode(tok.encode("<|mask|>", parse_special=True)) == "<|mask|>"
