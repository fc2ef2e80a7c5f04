"""generate(): greedy and sampling against a no-cache reference loop, ragged batches, EOS, reproducibility,
log q / log p bookkeeping, beam search against exhaustive enumeration, and input validation."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mlx_llm import ModelConfig, examples, forward, init_params
from mlx_llm.errors import ConfigError, InputError
from mlx_llm.decode.generate import _sample_jit, generate
from mlx_llm.decode.sampling import DecodeSettings, decoding_logprobs

full = jax.jit(forward, static_argnames="cfg")

CFG = ModelConfig(vocab_size=13, d_model=12, n_layers=2, n_heads=4, n_kv_heads=2, d_head=4, d_ff=20, max_seq_len=16)
TINY = ModelConfig(vocab_size=4, d_model=8, n_layers=2, n_heads=2, n_kv_heads=1, d_head=4, d_ff=8, max_seq_len=8)
ROWS = [[3, 1, 4, 1, 5, 9, 2], [6, 5, 3], [5, 8, 9, 7, 9]]
WIDTH = 7


def random_params(cfg, seed):
    """init_params' layout with NumPy N(0, 1/d) draws (jax.random would compile once per weight shape)."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    draw = lambda path, s: jnp.asarray(1 + 0.2 * rng.standard_normal(s.shape) if "norm" in str(path[-1])
                                       else 1.5 * rng.standard_normal(s.shape) / np.sqrt(cfg.d_model))
    return jax.tree_util.tree_map_with_path(draw, shapes)


@pytest.fixture(scope="module")
def params():
    return random_params(CFG, 1)


@pytest.fixture(scope="module")
def ragged():
    prompt = np.array([r + [0] * (WIDTH - len(r)) for r in ROWS])
    return prompt, np.array([len(r) for r in ROWS])


def reference_scores(params, cfg, row, continuation, settings=DecodeSettings()):
    """No cache: rerun the full forward on the whole prefix for every token (one padded shape, M20 §13)."""
    seq = list(row) + list(continuation)
    logits = full(params, jnp.asarray([seq + [0] * (cfg.max_seq_len - len(seq))]), cfg)[0]
    rows = logits[len(row) - 1 : len(seq) - 1]
    idx = jnp.asarray(continuation)[:, None]
    logp = jnp.take_along_axis(jax.nn.log_softmax(rows), idx, axis=-1).sum()
    logq = jnp.take_along_axis(decoding_logprobs(rows, settings), idx, axis=-1).sum()
    return float(logp), float(logq), np.asarray(jnp.argmax(rows, -1))


def reference_greedy(params, cfg, row, n):
    seq = list(row)
    for _ in range(n):
        logits = full(params, jnp.asarray([seq + [0] * (cfg.max_seq_len - len(seq))]), cfg)[0, len(seq) - 1]
        seq.append(int(jnp.argmax(logits)))
    return seq[len(row):]


# ----- greedy and ragged batches -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def greedy_run(params, ragged):
    return generate(params, CFG, ragged[0], 6, prompt_lengths=ragged[1])


def test_greedy_equals_no_cache_loop(params, greedy_run):
    for b, row in enumerate(ROWS):
        expected = reference_greedy(params, CFG, row, 6)
        np.testing.assert_array_equal(greedy_run.tokens[b], expected)
        logp, _, _ = reference_scores(params, CFG, row, expected)
        np.testing.assert_allclose(greedy_run.logp[b], logp, rtol=1e-12)
    np.testing.assert_array_equal(greedy_run.lengths, [6, 6, 6])
    np.testing.assert_array_equal(greedy_run.logq, 0.0)  # argmax puts all of q on the chosen token


def test_layer_scan_decode_equals_unrolled(params, ragged, greedy_run):
    scanned = generate(params, CFG, ragged[0], 6, prompt_lengths=ragged[1], unroll_layers=False)
    np.testing.assert_array_equal(scanned.tokens, greedy_run.tokens)
    np.testing.assert_allclose(scanned.logp, greedy_run.logp, rtol=1e-12)


@pytest.mark.slow
def test_ragged_batch_equals_each_prompt_alone(params, ragged, greedy_run):
    for b, row in enumerate(ROWS):
        alone = generate(params, CFG, ragged[0][b : b + 1], 6, prompt_lengths=[len(row)])
        np.testing.assert_array_equal(alone.tokens[0], greedy_run.tokens[b])
        np.testing.assert_allclose(alone.logp[0], greedy_run.logp[b], rtol=1e-12)


@pytest.mark.slow
def test_eos_stops_a_row_and_pads(params, ragged, greedy_run):
    eos = int(greedy_run.tokens[0, 2])
    out = generate(params, CFG, ragged[0], 6, prompt_lengths=ragged[1], eos_id=eos, pad_id=11)
    for b, row in enumerate(ROWS):
        free = list(np.asarray(greedy_run.tokens[b]))
        n = free.index(eos) + 1 if eos in free else 6
        np.testing.assert_array_equal(out.tokens[b], free[:n] + [11] * (6 - n))
        assert int(out.lengths[b]) == n
        np.testing.assert_allclose(out.logp[b], reference_scores(params, CFG, row, free[:n])[0], rtol=1e-12)
    assert int(out.lengths[0]) == 3


# ----- sampling ----------------------------------------------------------------------------------------
SAMPLE = dict(temperature=0.9, top_k=6, top_p=0.9)


@pytest.mark.slow
def test_sampling_reproducible_and_scored(params, ragged):
    a = generate(params, CFG, ragged[0], 6, prompt_lengths=ragged[1], seed=3, **SAMPLE)
    b = generate(params, CFG, ragged[0], 6, prompt_lengths=ragged[1], seed=3, **SAMPLE)
    c = generate(params, CFG, ragged[0], 6, prompt_lengths=ragged[1], seed=4, **SAMPLE)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert (np.asarray(a.tokens) != np.asarray(c.tokens)).any()
    settings = DecodeSettings(**SAMPLE)
    for r, row in enumerate(ROWS):
        logp, logq, _ = reference_scores(params, CFG, row, list(np.asarray(a.tokens[r])), settings)
        np.testing.assert_allclose([a.logp[r], a.logq[r]], [logp, logq], rtol=1e-10)
        assert logq > logp  # q concentrates on the tokens it can draw


@pytest.mark.slow
def test_sampling_with_eos_stops_scoring(params, ragged):
    # Step t draws with fold_in(key, t) and per-element noise, so stopping one row leaves the others' draws as
    # they were: with EOS each row is the EOS-free run cut after its first EOS, then padding.
    kw = dict(prompt_lengths=ragged[1], seed=3, **SAMPLE)
    free = np.asarray(generate(params, CFG, ragged[0], 6, **kw).tokens)
    eos = int(free[0, 2])
    out = generate(params, CFG, ragged[0], 6, eos_id=eos, pad_id=0, **kw)
    settings = DecodeSettings(**SAMPLE)
    for r, row in enumerate(ROWS):
        toks = list(free[r])
        n = toks.index(eos) + 1 if eos in toks else 6
        np.testing.assert_array_equal(out.tokens[r], toks[:n] + [0] * (6 - n))
        assert int(out.lengths[r]) == n
        logp, logq, _ = reference_scores(params, CFG, row, toks[:n], settings)
        np.testing.assert_allclose([out.logp[r], out.logq[r]], [logp, logq], rtol=1e-10)
    assert int(out.lengths[0]) <= 3


def test_m20_13_top2_never_draws_eos():
    cfg, p, tokens, _ = examples.running_example()
    out = generate(jax.tree.map(jnp.asarray, p), cfg, np.repeat(tokens, 200, axis=0), 1, temperature=0.5, top_k=2)
    toks = np.asarray(out.tokens[:, 0])
    assert set(toks) == {examples.A, examples.B}  # EOS (p = 0.183502) is outside the top-2 set
    np.testing.assert_allclose(np.exp(out.logq), np.where(toks == examples.A, 0.563116, 0.436884), atol=1e-6)
    logits = forward(jax.tree.map(jnp.asarray, p), tokens, cfg)[0, -1]
    np.testing.assert_allclose(out.logp, jax.nn.log_softmax(logits)[toks], rtol=1e-12)


def test_compiled_once_per_settings(params, ragged):
    generate(params, CFG, ragged[0], 6, prompt_lengths=ragged[1], seed=5, **SAMPLE)
    before = _sample_jit._cache_size()
    generate(params, CFG, ragged[0], 6, prompt_lengths=ragged[1], seed=6, **SAMPLE)  # a new seed is not a new program
    assert _sample_jit._cache_size() == before


# ----- beam search ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    return random_params(TINY, 7), [0, 1]


def enumerate_best(params, prompt, n, eos=None, alpha=0.0):
    """Exhaustive search over all V^n continuations (truncated after EOS), scored by Σ log p / len^α."""
    seqs = np.array(list(itertools.product(range(TINY.vocab_size), repeat=n)))
    batch = np.concatenate([np.tile(prompt, (len(seqs), 1)), seqs], axis=1)
    logp = jax.nn.log_softmax(full(params, jnp.asarray(batch), TINY)[:, len(prompt) - 1 : -1])
    tok_logp = np.take_along_axis(np.asarray(logp), seqs[..., None], axis=-1)[..., 0]
    best = {}
    for s, lp in zip(seqs, tok_logp):
        m = list(s).index(eos) + 1 if eos is not None and eos in s else n
        score = lp[:m].sum()
        best[tuple(s[:m])] = (score / m**alpha, score)
    key = max(best, key=lambda k: best[k][0])
    return list(key), best[key][1]


@pytest.mark.slow
@pytest.mark.parametrize("eos, alpha", [(None, 0.0), (3, 0.0), (3, 1.0)])
def test_beam_of_width_v_to_the_n_is_exact(tiny, eos, alpha):
    params, prompt = tiny
    n = 3
    out = generate(params, TINY, np.array([prompt]), n, beam_width=TINY.vocab_size**n, eos_id=eos,
                   length_penalty=alpha)
    tokens, score = enumerate_best(params, prompt, n, eos, alpha)
    m = len(tokens)
    np.testing.assert_array_equal(out.tokens[0], tokens + [0] * (n - m))
    assert int(out.lengths[0]) == m
    np.testing.assert_allclose(out.logp[0], score, rtol=1e-12)
    assert float(out.logq[0]) == 0.0


@pytest.mark.slow
def test_beam_width_one_is_greedy(tiny):
    params, prompt = tiny
    kw = dict(prompt_lengths=[2, 1], eos_id=3)
    beam = generate(params, TINY, np.array([prompt, [3, 0]]), 5, beam_width=1, **kw)
    greedy = generate(params, TINY, np.array([prompt, [3, 0]]), 5, **kw)
    np.testing.assert_array_equal(beam.tokens, greedy.tokens)
    np.testing.assert_array_equal(beam.lengths, greedy.lengths)
    np.testing.assert_allclose(beam.logp, greedy.logp, rtol=1e-12)
    assert sorted(np.asarray(greedy.lengths).tolist()) == [1, 5]  # one row stops at EOS, one runs to the end


def test_wider_beam_is_never_worse(tiny):
    params, prompt = tiny
    kw = dict(prompt_lengths=[2, 1], eos_id=3)
    scores = [np.asarray(generate(params, TINY, np.array([prompt, [3, 0]]), 5, beam_width=w, **kw).logp)
              for w in (1, 6)]
    assert (scores[0] <= scores[1] + 1e-12).all() and (scores[0] < scores[1] - 1e-6).any()


# ----- bad input ------------------------------------------------------------------------------------------
BAD = [
    (dict(temperature=0.0), ConfigError, r"temperature = 0.0 is invalid.*greedy is its own rule"),
    (dict(temperature=-1.0), ConfigError, r"temperature = -1.0 is invalid: it must be a finite number > 0"),
    (dict(temperature=1.0, top_p=0.0), ConfigError, r"top_p = 0.0 is invalid: it must be a number in \(0, 1\]"),
    (dict(temperature=1.0, top_p=1.01), ConfigError, r"top_p = 1.01 is invalid"),
    (dict(temperature=1.0, top_k=0), ConfigError, r"top_k = 0 is invalid: it must be an integer ≥ 1"),
    (dict(temperature=1.0, top_k=14), ConfigError, r"top_k = 14 is larger than the vocabulary \(V = 13\)"),
    (dict(beam_width=3, temperature=0.8), ConfigError, r"beam search \(beam_width = 3\) is deterministic"),
    (dict(max_new_tokens=0), InputError, r"max_new_tokens = 0 is invalid: it must be an integer ≥ 1"),
    (dict(max_new_tokens=10), InputError,
     r"a prompt of 7 tokens plus max_new_tokens = 10 needs 17 positions, more than max_seq_len = 16"),
    (dict(prompt=[[1, 2, 13]]), InputError, r"prompt_BT\[0, 2\] = 13 is not a valid token id.*\[0, 13\)"),
    (dict(prompt=[[1, -1]]), InputError, r"prompt_BT\[0, 1\] = -1 is not a valid token id"),
    (dict(prompt=[1, 2, 3]), InputError, r"prompt_BT must have shape \(batch, length\)"),
    (dict(prompt=[[0.5, 1.0]]), InputError, r"prompt_BT must be integer token ids"),
    (dict(prompt_lengths=[7, 0, 5]), InputError, r"prompt_lengths = \[7, 0, 5\] is invalid: each must be in \[1, 7\]"),
    (dict(prompt_lengths=[7, 3, 8]), InputError, r"prompt_lengths = \[7, 3, 8\] is invalid"),
    (dict(prompt_lengths=[7, 3]), InputError, r"prompt_lengths must be 3 integers, one per prompt row"),
    (dict(eos_id=13), InputError, r"eos_id = 13 is invalid: it must be a token id in \[0, 13\) or None"),
    (dict(pad_id=-1), InputError, r"pad_id = -1 is invalid: it must be a token id in \[0, 13\)"),
    (dict(length_penalty=0.6), ConfigError, r"length_penalty = 0.6 only applies to beam search"),
]


@pytest.mark.parametrize("kw, err, match", BAD)
def test_bad_input_is_rejected_before_any_work(params, ragged, kw, err, match):
    kw = dict(kw)
    lengths = kw.pop("prompt_lengths", None if "prompt" in kw else ragged[1])
    prompt = kw.pop("prompt", ragged[0])
    n = kw.pop("max_new_tokens", 2)
    with pytest.raises(err, match=match):
        generate(params, CFG, prompt, n, prompt_lengths=lengths, **kw)
