"""The public decoding steps (decode/step.py) and per-row sampling settings (decode/sampling.SamplingRows): a
batch mixing settings equals each setting's own rule, one compile serves every setting, and a Python loop of the
jitted ``prefill`` + ``step`` (state donated) is ``generate`` token for token."""

import jax
import jax.numpy as jnp
import numpy as np

from mlx_llm.decode import step as step_lib
from mlx_llm.decode.generate import _sample_jit, generate
from mlx_llm.decode.sampling import DecodeSettings, SamplingRows, choose_rows, decoding_logprobs, rows_logprobs
from mlx_llm.decode.state import init_cache, unstack_layers
from mlx_llm.ops import seed_key_data
from test_generate import CFG, ROWS, WIDTH, random_params

MIXED = [DecodeSettings(), DecodeSettings(temperature=0.7), DecodeSettings(temperature=1.3, top_k=3),
         DecodeSettings(temperature=0.9, top_p=0.6), DecodeSettings(temperature=1.0, top_k=5, top_p=0.8),
         DecodeSettings(temperature=2.0, top_k=1)]


def test_a_batch_of_mixed_settings_equals_each_rule_alone():
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((len(MIXED), 13)) * 2)
    logits = logits.at[3, 4].set(logits[3, 7])  # a tie, kept together by the cuts
    got = np.asarray(rows_logprobs(logits, SamplingRows.of(MIXED)))
    for i, settings in enumerate(MIXED):
        np.testing.assert_array_equal(got[i], np.asarray(decoding_logprobs(logits[i:i + 1], settings))[0])
    kept = np.isfinite(got).sum(axis=1)
    assert kept[0] == 1 and kept[1] == 13 and kept[2] == 3 and kept[5] == 1  # greedy, plain, top-3, top-1
    tok, logq = choose_rows(jax.random.key(3), logits, SamplingRows.of(MIXED))
    assert int(tok[0]) == int(jnp.argmax(logits[0])) and float(logq[0]) == 0.0
    np.testing.assert_array_equal(np.asarray(logq), got[np.arange(len(MIXED)), np.asarray(tok)])


def test_one_compile_serves_every_setting():
    params = random_params(CFG, 1)
    prompt = np.array([r + [0] * (WIDTH - len(r)) for r in ROWS])
    lengths = np.array([len(r) for r in ROWS])
    generate(params, CFG, prompt, 5, prompt_lengths=lengths, temperature=0.7)
    before = _sample_jit._cache_size()
    for kw in ({}, {"temperature": 1.3, "top_k": 3}, {"temperature": 0.5, "top_p": 0.4}):
        generate(params, CFG, prompt, 5, prompt_lengths=lengths, **kw)
    assert _sample_jit._cache_size() == before


def test_a_loop_of_prefill_and_step_is_generate():
    """The jitted public steps called from Python (the state donated) give ``generate``'s tokens and scores, greedy
    and sampled, on a ragged batch."""
    params = random_params(CFG, 2)
    prompt = jnp.asarray([r + [0] * (WIDTH - len(r)) for r in ROWS], jnp.int32)
    lengths = jnp.asarray([len(r) for r in ROWS], jnp.int32)
    n, layers = 6, unstack_layers(params, CFG)
    for settings in (DecodeSettings(), DecodeSettings(temperature=0.8, top_k=6)):
        kw = {} if settings.mode == "greedy" else {"temperature": 0.8, "top_k": 6}
        want = generate(params, CFG, prompt, n, prompt_lengths=lengths, seed=11, **kw)
        key, rows = seed_key_data(11), SamplingRows.of(settings)
        state = init_cache(CFG, 3, WIDTH + n, params["embed"].dtype)
        logits, state = step_lib.prefill(params, state, prompt, lengths, cfg=CFG)
        picked = step_lib.sample(jax.random.fold_in(key, 0), logits, rows)
        out = [picked]
        for t in range(1, n):
            old = state
            picked, state = step_lib.step(params, state, picked.tokens, jnp.ones((3,), bool), rows,
                                          jax.random.fold_in(key, t), cfg=CFG, layers=layers)
            assert jax.tree.leaves(old.stores)[0].is_deleted()  # donated: updated in place
            out.append(picked)
        np.testing.assert_array_equal(np.stack([p.tokens for p in out], 1), want.tokens)
        np.testing.assert_allclose(np.stack([p.logp for p in out], 1), want.token_logp, rtol=1e-12)
        np.testing.assert_allclose(np.stack([p.logq for p in out], 1), want.token_logq, rtol=1e-12)
        assert np.asarray(state.lengths).tolist() == [len(r) + n - 1 for r in ROWS]
