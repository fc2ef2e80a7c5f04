"""The inference engine (decode/engine.py): the same greedy tokens as ``generate`` through every scheduling path
(page boundaries, chunked prefill, preemption, prefix hits, n > 1, several steps per dispatch), replies that do
not depend on the batch, no compile after warm-up, and one-line refusals of bad requests."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_llm import ModelConfig
from mlx_llm.decode import engine as engine_lib
from mlx_llm.decode.engine import Engine, Request
from mlx_llm.decode.generate import generate
from mlx_llm.decode.pages import PageTable, page_keys
from mlx_llm.decode.cache import Pages
from mlx_llm.errors import InputError
from test_generate import random_params

V, PROMPT, NEW = 29, 12, 6
DENSE = ModelConfig(vocab_size=V, d_model=12, n_layers=2, n_heads=4, n_kv_heads=2, d_head=4, d_ff=20, max_seq_len=32)
KINDS = {  # every kind that decodes: dense + GQA; sliding window + MoE; Mamba-1; hybrid local/global + Mamba + MoE
    "dense_gqa": DENSE,
    "window_moe": dataclasses.replace(DENSE, mixer_pattern=("local",), sliding_window=3, ffn_pattern=("moe",),
                                      n_experts=4, moe_top_k=2, moe_d_ff=8),
    "mamba": dataclasses.replace(DENSE, mixer_pattern=("mamba",), ssm_state=3),
    "hybrid": dataclasses.replace(DENSE, n_layers=4, mixer_pattern=("attn", "mamba", "local", "attn"),
                                  ffn_pattern=("swiglu", "moe"), sliding_window=3, ssm_state=3, n_experts=4,
                                  moe_top_k=2, moe_d_ff=8),
}
PAGE = {"dense_gqa": 2, "window_moe": 3, "mamba": 4, "hybrid": 3}
_ENGINES: dict = {}


def _engine(kind: str, **kw) -> Engine:
    """One engine per model kind for the module (compiles are the cost); its pool holds one worst-case request,
    so three running replies preempt each other."""
    key = (kind, tuple(sorted(kw.items())))
    if key not in _ENGINES:
        cfg = KINDS[kind]
        size = kw.pop("page_size", PAGE[kind])
        shared = (PROMPT - 1) // size
        worst = shared + 2 * (-(-(PROMPT + NEW - 1) // size) - shared)  # Engine.pages_needed(PROMPT, NEW, 2)
        _ENGINES[key] = Engine(random_params(cfg, 0), cfg, max_seqs=3, max_len=PROMPT + NEW, page_size=size,
                               pages=worst + 1, token_budget=5, chunk_buckets=(4,), decode_steps=2,
                               unroll_layers=False, width_buckets=(2, 4), **kw)
    return _ENGINES[key]


def _reference(params, cfg, prompts, eos):
    """``generate``'s greedy tokens of each prompt (one batch, right-padded to PROMPT: one compile per kind)."""
    rows = prompts + [[0]] * (8 - len(prompts))
    padded = np.asarray([p + [0] * (PROMPT - len(p)) for p in rows], np.int32)
    out = generate(params, cfg, padded, NEW, prompt_lengths=np.asarray([len(p) for p in rows]), eos_id=eos)
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    return [tokens[i, :lengths[i]].tolist() for i in range(len(prompts))]


@st.composite
def streams(draw):
    """Requests (some sharing a prefix, some with n = 2) and an arrival order: submit or step, interleaved."""
    stems = [draw(st.lists(st.integers(0, V - 1), min_size=1, max_size=8)) for _ in range(2)]
    requests = []
    for _ in range(draw(st.integers(2, 5))):
        stem = draw(st.sampled_from(stems + [[]]))
        tail = draw(st.lists(st.integers(0, V - 1), min_size=0 if stem else 1, max_size=PROMPT - len(stem)))
        requests.append(((stem + tail)[:PROMPT], draw(st.integers(1, 2)), draw(st.integers(1, NEW))))
    steps_between = draw(st.lists(st.integers(0, 3), min_size=len(requests), max_size=len(requests)))
    return requests, steps_between, draw(st.integers(0, V - 1))


def _check_stream(kind, data):
    eng = _engine(kind)
    requests, steps_between, eos = data
    replies = []
    for (prompt, n, max_tokens), wait in zip(requests, steps_between):
        replies.append(eng.submit(Request(tuple(prompt), max_tokens=max_tokens, n=n, stop_ids=(eos,))))
        for _ in range(wait):
            eng.step()
    while eng.waiting or eng.running:
        eng.step()
    want = _reference(eng.params, eng.cfg, [p for p, _, _ in requests], eos)
    for (prompt, n, max_tokens), done, ref in zip(requests, replies, want):
        assert len(done.replies) == n
        for reply in done.replies:
            assert reply.tokens == ref[:max_tokens], (prompt, reply.tokens, ref)
            assert reply.finish_reason == ("stop" if reply.tokens[-1] == eos else "length")
    assert eng.table.available == eng.table.pages.count - 1  # every page given back
    assert sorted(eng.free_rows) == list(range(eng.max_seqs))
    assert not eng.completions  # and no finished request is kept


@pytest.mark.slow
@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(streams())
def test_engine_gives_generates_greedy_tokens_dense(data):
    _check_stream("dense_gqa", data)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["window_moe", "mamba", "hybrid"])
# two streams per kind (each kind's cache and state through sharing, preemption and forks; the scheduling itself
# gets four on the dense kind above): the compiles of a kind are most of its cost (the suite's time budget)
@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=streams())
def test_engine_gives_generates_greedy_tokens(kind, data):
    _check_stream(kind, data)


@pytest.mark.slow
def test_no_compile_after_warm_up():
    """A stream of new lengths, n, settings and stop ids after ``warm_up`` compiles nothing (every shape is a
    bucket, every setting data); a second warm-up compiles nothing either."""
    eng = _engine("dense_gqa")
    eng.warm_up()
    before = engine_lib.compiles()
    rng = np.random.default_rng(0)
    for i in range(6):
        prompt = tuple(int(t) for t in rng.integers(0, V, size=int(rng.integers(1, PROMPT + 1))))
        eng.submit(Request(prompt, max_tokens=int(rng.integers(1, NEW + 1)), n=1 + i % 2, seed=i,
                           temperature=[0.0, 0.7, 1.3][i % 3], top_k=[0, 5][i % 2], top_p=[1.0, 0.8][i % 2],
                           stop_ids=tuple(int(t) for t in rng.integers(0, V, size=i % 3)), logprobs=i % 2 == 0))
        eng.step()
    while eng.waiting or eng.running:
        eng.step()
    assert engine_lib.compiles() == before
    assert eng.warm_up() == 0


def _q_of(params, cfg, prompt, temperature, top_k, top_p):
    """The exact decoding distribution after ``prompt`` (the trainer's forward, then sampling's cut)."""
    from mlx_llm.decode.sampling import SamplingRows, rows_logprobs
    from mlx_llm.model import forward

    logits_V = forward(params, jnp.asarray([prompt]), cfg)[0, -1]
    rows = SamplingRows(temperature=jnp.asarray([temperature]), top_k=jnp.asarray([top_k]),
                        top_p=jnp.asarray([top_p]))
    return np.asarray(jax.nn.log_softmax(logits_V)), np.asarray(rows_logprobs(logits_V[None], rows)[0])


@pytest.mark.slow
def test_sampled_first_tokens_follow_q_and_carry_their_log_probs():
    """400 seeded first tokens (50 requests × n = 8) against the exact q (temperature, top-k, top-p): a chi-square
    test that fails on a wrong cut, temperature or key reuse; every token's log p, log q and log kept mass equal
    the trainer's forward to float tolerance."""
    from scipy import stats

    cfg = DENSE
    eng = Engine(random_params(cfg, 3), cfg, max_seqs=8, max_len=16, page_size=4, token_budget=16,
                 chunk_buckets=(8,), decode_steps=1, unroll_layers=False)
    prompt, t, k, p = (3, 1, 4, 1, 5), 0.8, 6, 0.9
    logp_V, logq_V = _q_of(eng.params, cfg, prompt, t, k, p)
    done = eng.run([Request(prompt, max_tokens=1, temperature=t, top_k=k, top_p=p, seed=s, n=8, logprobs=True)
                    for s in range(50)])
    tokens = np.asarray([r.tokens[0] for c in done for r in c.replies])
    kept = np.flatnonzero(np.isfinite(logq_V))
    assert 2 <= len(kept) <= k and set(tokens) <= set(kept)
    counts = np.asarray([np.sum(tokens == v) for v in kept])
    assert stats.chisquare(counts, np.exp(logq_V[kept]) * len(tokens)).pvalue > 1e-3
    assert len({tuple(r.tokens) for r in done[0].replies}) > 1  # the n replies draw with their own keys
    log_mass = np.log(np.sum(np.exp(jax.nn.log_softmax(np.asarray(logp_V) / t))[kept]))
    for reply in (r for c in done for r in c.replies):
        tok = reply.tokens[0]
        np.testing.assert_allclose([reply.logp[0], reply.logq[0], reply.log_mass[0]],
                                   [logp_V[tok], logq_V[tok], log_mass], rtol=0, atol=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_reply_is_the_same_alone_and_among_63_others(temperature):
    """The same request and seed gives the same reply alone and in a batch of 64 replies of other lengths,
    admitted before and after it (its draws read its own key; its rows' shapes change, its tokens do not)."""
    cfg = dataclasses.replace(DENSE, max_seq_len=40)
    eng = Engine(random_params(cfg, 4), cfg, max_seqs=64, max_len=40, page_size=4, token_budget=128,
                 chunk_buckets=(8, 32), decode_steps=4, unroll_layers=False)
    mine = Request((5, 9, 2, 7, 7, 1, 20), max_tokens=12, temperature=temperature, top_p=0.95, seed=1234,
                   logprobs=True)
    alone = eng.run([mine])[0].replies[0]
    rng = np.random.default_rng(5)
    others = [Request(tuple(int(x) for x in rng.integers(0, V, size=int(rng.integers(1, 28)))),
                      max_tokens=int(rng.integers(1, 13)), temperature=float(rng.choice([0.0, 1.0])), seed=i,
                      logprobs=True) for i in range(63)]
    done = [eng.submit(r) for r in others[:30] + [mine] + others[30:]]
    busiest = 0
    while eng.waiting or eng.running:
        eng.step()
        busiest = max(busiest, len(eng.running))
    assert busiest == 64
    among = done[30].replies[0]
    assert among.tokens == alone.tokens and len(alone.tokens) == 12
    np.testing.assert_allclose(among.logp, alone.logp, rtol=0, atol=1e-9)
    np.testing.assert_allclose(among.logq, alone.logq, rtol=0, atol=1e-9)


def _detok(ids):
    return "".join(chr(ord("a") + t % 26) for t in ids)


def test_stop_strings_cut_the_text_across_token_boundaries():
    cfg = DENSE
    eng = Engine(random_params(cfg, 0), cfg, max_seqs=2, max_len=16, page_size=4, token_budget=16,
                 chunk_buckets=(8,), decode_steps=2, unroll_layers=False, detokenize=_detok)
    prompt = (1, 2, 3)
    free = eng.run([Request(prompt, max_tokens=8)])[0].replies[0]
    assert free.text == _detok(free.tokens) and free.finish_reason == "length"
    stop = free.text[3:5]  # spans tokens 3 and 4: the reply ends at token 4, its text before the string
    first = free.text.find(stop)
    cut = eng.run([Request(prompt, max_tokens=8, stop=(stop, "never"))])[0].replies[0]
    assert cut.finish_reason == "stop"
    assert cut.tokens == free.tokens[:first + 2] and cut.text == free.text[:first]


@pytest.mark.parametrize("change, message", [
    (dict(prompt=()), "prompt is invalid"),
    (dict(prompt=(1, V)), "prompt is invalid"),
    (dict(max_tokens=0), "max_tokens = 0 is invalid"),
    (dict(max_tokens=PROMPT + NEW), "more than this engine's max_len = 18"),
    (dict(temperature=-0.5), "temperature = -0.5 is invalid"),
    (dict(temperature=float("nan")), "temperature = nan is invalid"),
    (dict(top_k=-1), "top_k = -1 is invalid"),
    (dict(top_p=0.0), "top_p = 0.0 is invalid"),
    (dict(top_p=1.5), "top_p = 1.5 is invalid"),
    (dict(stop_ids=(V + 3,)), "stop_ids = [32] is invalid"),
    (dict(stop=("x",)), "stop strings need a tokenizer"),
    (dict(seed=-1), "seed = -1 is invalid"),
    (dict(n=4), "n = 4 is invalid: this engine decodes at most max_seqs = 3"),
    (dict(n=0), "n = 0 is invalid"),
])
def test_bad_requests_are_refused_in_one_line_before_anything_is_queued(change, message):
    eng = _engine("dense_gqa")
    before = len(eng.completions)
    with pytest.raises(InputError, match=message.replace("[", r"\[").replace("]", r"\]")) as err:
        eng.submit(dataclasses.replace(Request((1, 2, 3), max_tokens=2), **change))
    assert "\n" not in str(err.value)
    assert len(eng.completions) == before and not eng.waiting


def test_engine_settings_are_checked():
    params = random_params(DENSE, 0)
    with pytest.raises(InputError, match="max_len = 64 is invalid: the model has max_seq_len = 32"):
        Engine(params, DENSE, max_len=64)
    with pytest.raises(InputError, match="token_budget = 2 is invalid: it must be an integer ≥ 4"):
        Engine(params, DENSE, max_seqs=4, token_budget=2)
    with pytest.raises(InputError, match="chunk_buckets = \\(1,\\) is invalid"):
        Engine(params, DENSE, chunk_buckets=(1,))
    with pytest.raises(InputError, match="width_buckets = \\(0, 4\\) is invalid"):
        Engine(params, DENSE, width_buckets=(0, 4))
    hybrid = KINDS["hybrid"]
    with pytest.raises(InputError, match="prefix_caching = True is invalid for this model: its mamba, local layers"):
        Engine(random_params(hybrid, 0), hybrid, prefix_caching=True)
    eng = Engine(params, DENSE, max_seqs=2, max_len=16, page_size=4, pages=4)
    with pytest.raises(InputError, match="the request may need 4 pages .* but the pool has 3"):
        eng.submit(Request((1,) * 10, max_tokens=6))


def test_page_table_shares_caches_and_evicts_least_recently_used():
    keys = page_keys([1, 2, 3, 4, 5], 2)
    assert len(keys) == 2 and keys[0] == page_keys([1, 2], 2)[0]
    assert page_keys([9, 2, 3, 4], 2)[1] != keys[1]  # the same page's tokens after another prefix: another key
    table = PageTable(Pages(4, 2), caching=True)
    a, b, c = table.allocate(), table.allocate(), table.allocate()
    assert sorted([a, b, c]) == [1, 2, 3] and table.available == 0  # page 0 is the padding page
    table.register(a, keys[0])
    table.register(b, keys[1])
    assert table.lookup(keys) == [a, b] and table.lookup([keys[1]]) == [b]
    table.share(a)
    for page in (a, a, b, c):
        table.release(page)
    assert table.refs.tolist() == [0, 0, 0, 0] and table.available == 3
    table.share(b)  # a hit on b: it leaves the LRU list
    table.release(b)  # … and joins it again, now the most recent
    assert table.allocate() == c  # a never-registered free page first
    assert table.allocate() == a  # then the least recently used cached page, its key forgotten
    assert table.lookup(keys) == [] and table.lookup([keys[1]]) == [b]
    with pytest.raises(RuntimeError, match="exhausted"):
        table.allocate(), table.allocate()
    assert (table.hits, table.lookups) == (4, 6)


def test_replies_forked_off_a_partial_page_equal_a_lone_reply():
    """n = 2 replies fork off the prompt's first 5 of 6 tokens computed (pages of 4: one full page shared, the
    partial one copied); each computes the last prompt token itself and gives the lone reply's greedy tokens."""
    cfg = DENSE
    eng = Engine(random_params(cfg, 0), cfg, max_seqs=2, max_len=16, page_size=4, token_budget=16,
                 chunk_buckets=(8,), decode_steps=2, unroll_layers=False, detokenize=_detok)
    prompt = (7, 3, 11, 2, 9, 4)
    lone = eng.run([Request(prompt, max_tokens=8)])[0].replies[0]
    both = eng.run([Request(prompt, max_tokens=8, n=2)])[0].replies
    assert [r.tokens for r in both] == [lone.tokens] * 2
    assert eng.prefix_hit_rate > 0  # the second request found the first's full page


@pytest.mark.slow
def test_abort_ends_a_request_at_once_and_frees_its_rows_and_pages():
    """A running request (n = 2, forked), a waiting one and a finished one: abort frees what each holds, the
    others run on and give their greedy tokens."""
    eng = Engine(random_params(DENSE, 0), DENSE, max_seqs=3, max_len=16, page_size=4, token_budget=16,
                 chunk_buckets=(8,), decode_steps=2, unroll_layers=False)
    lone = eng.run([Request((5, 6, 7), max_tokens=8)])[0].replies[0]
    running = eng.submit(Request((1, 2, 3, 4, 5), max_tokens=8, n=2))
    other = eng.submit(Request((5, 6, 7), max_tokens=8))
    waiting = eng.submit(Request((9, 9), max_tokens=8, n=2))  # no rows left for it
    eng.step()
    eng.step()
    assert len(waiting.replies[0].tokens) == 0 and len(running.replies[0].tokens) > 0
    eng.abort(running)
    eng.abort(waiting)
    assert [r.finish_reason for r in running.replies + waiting.replies] == ["abort"] * 4
    done = len(running.replies[0].tokens)
    while eng.waiting or eng.running:
        eng.step()
    assert len(running.replies[0].tokens) == done  # nothing more after the abort
    assert other.replies[0].tokens == lone.tokens
    eng.abort(other)  # a finished request is left as it is
    assert other.replies[0].finish_reason == "length"
    assert eng.table.available == eng.table.pages.count - 1 and sorted(eng.free_rows) == [0, 1, 2]
    assert not eng.completions


@pytest.mark.slow
def test_min_tokens_keeps_the_stop_ids_out_until_then_and_top_logprobs_list_the_models_best():
    cfg = DENSE
    params = random_params(cfg, 0)
    eng = Engine(params, cfg, max_seqs=2, max_len=16, page_size=4, token_budget=16, chunk_buckets=(8,),
                 decode_steps=2, unroll_layers=False, max_top_logprobs=4, detokenize=_detok)
    prompt = (3, 1, 4, 1, 5)
    free = eng.run([Request(prompt, max_tokens=8, top_logprobs=4)])[0].replies[0]
    first = free.tokens[0]
    # greedy: each step's best is the token itself, with its log p exactly; then the next most likely, in order
    for k, top in enumerate(free.top):
        assert len(top) == 4 and top[0] == (free.tokens[k], free.logp[k])
        assert [v for _, v in top] == sorted([v for _, v in top], reverse=True)
    # the first token as a stop id ends the reply at once; with min_tokens = 3 it cannot be drawn before the third
    # token (the second best comes instead), and the stop strings wait too
    stopped = eng.run([Request(prompt, max_tokens=8, stop_ids=(first,))])[0].replies[0]
    assert stopped.tokens == [first] and stopped.finish_reason == "stop"
    held = eng.run([Request(prompt, max_tokens=8, stop_ids=(first,), min_tokens=3, top_logprobs=2)])[0].replies[0]
    assert held.tokens[0] == free.top[0][1][0] and first not in held.tokens[:3]
    # top log-probs are the model's, not the banned q's
    assert [t for t, _ in held.top[0]] == [t for t, _ in free.top[0][:2]]
    np.testing.assert_allclose([v for _, v in held.top[0]], [v for _, v in free.top[0][:2]], rtol=1e-12)
    assert held.logq[0] == 0 and held.log_mass[0] == pytest.approx(held.logp[0], abs=1e-5)  # greedy: mass = p(token)
    stop = _detok([first])  # the reply's first character: found only in the text after min_tokens
    text = eng.run([Request(prompt, max_tokens=8, stop=(stop,), min_tokens=2)])[0].replies[0]
    at = free.text.find(stop, 1)
    assert text.text == (free.text if at < 0 else free.text[:at])
    with pytest.raises(InputError, match="top_logprobs = 5 is invalid: this engine returns at most max_top_logprobs"):
        eng.submit(Request(prompt, max_tokens=8, top_logprobs=5))
    with pytest.raises(InputError, match="min_tokens = 9 is invalid: it must be at most max_tokens = 8"):
        eng.submit(Request(prompt, max_tokens=8, min_tokens=9))


def test_the_docs_tables_are_rendered_from_the_results_file():
    """docs/engine.md holds the ``render`` of the bench_engine, logprob_contract, bench_paged and bench_rollout
    results (experiments/results/) verbatim (a number typed by hand, or a results file rewritten without the page, fails)."""
    from pathlib import Path

    from experiments import bench_engine, common

    from experiments import bench_paged, bench_rollout, logprob_contract

    page = (Path(__file__).resolve().parents[1] / "docs" / "engine.md").read_text()
    assert bench_engine.render(common.load_result("bench_engine")) in page
    assert logprob_contract.render(common.load_result("logprob_contract")) in page
    assert bench_rollout.render(common.load_result("bench_rollout")) in page
    assert bench_paged.render(common.load_result("bench_paged")) in page


@pytest.mark.slow
def test_the_samplers_reply_through_the_engine_as_generate_and_batch_free():
    """``eval.replies.sample_replies`` (eval-task, RL and PPO rollouts, pairs) runs on ``engine.complete``: greedy
    replies are ``generate``'s tokens; a prompt's n seeded replies come out prompt by prompt, differ from each
    other, carry log q, and are the same in another batch (prompt i is seeded ``prompt_seed(seed, i)``)."""
    from mlx_llm.data.chat import ChatTemplate
    from mlx_llm.data.tokenizer import ByteTokenizer
    from mlx_llm.eval.replies import sample_replies

    tok, template = ByteTokenizer(), ChatTemplate()
    cfg = dataclasses.replace(DENSE, vocab_size=tok.vocab_size, max_seq_len=48)
    params = random_params(cfg, 7)
    prompts = [[{"role": "user", "content": text}] for text in ("1+2", "hello there", "x")]
    encoded = [template.encode(m, tok, generation_prompt=True)[0] for m in prompts]
    padded = np.zeros((3, max(map(len, encoded))), np.int32)
    for i, ids in enumerate(encoded):
        padded[i, :len(ids)] = ids
    out = generate(params, cfg, padded, 6, eos_id=tok.token_id(template.end), pad_id=tok.pad_id,
                   prompt_lengths=np.asarray([len(e) for e in encoded]))
    greedy = sample_replies(params, cfg, tok, template, prompts, 6, batch_size=4)
    for i, (reply, _) in enumerate(greedy):
        assert reply.tolist() == np.asarray(out.tokens)[i, :int(out.lengths[i])].tolist()
    sampled = sample_replies(params, cfg, tok, template, prompts, 6, temperature=1.0, seed=11, n=2, batch_size=4,
                             with_logq=True)
    assert len(sampled) == 6
    assert sampled[2][0].tolist() != sampled[3][0].tolist()  # prompt 1's two replies: two draws
    assert all(len(logq) == len(reply) and np.all(logq < 0) for reply, _, logq in sampled)
    fewer = sample_replies(params, cfg, tok, template, prompts[:2], 6, temperature=1.0, seed=11, n=2, batch_size=4,
                           with_logq=True)
    for (reply, _, logq), other in zip(sampled[:4], fewer):
        assert reply.tolist() == other[0].tolist()
        np.testing.assert_allclose(logq, other[2], rtol=0, atol=1e-6)


def test_complete_sizes_one_engine_and_refuses_bad_work_in_one_line():
    params = random_params(DENSE, 0)
    assert engine_lib.complete(params, DENSE, []) == []
    with pytest.raises(InputError, match="more than the model's max_seq_len = 32"):
        engine_lib.complete(params, DENSE, [Request((1,) * 30, max_tokens=3)])
    with pytest.raises(InputError, match="complete\\(\\) takes a non-empty list of engine.Request"):
        engine_lib.complete(params, DENSE, [(1, 2)])
    with pytest.raises(InputError, match="row_buckets = \\(9,\\) is invalid"):
        Engine(params, DENSE, max_seqs=4, row_buckets=(9,))
    from mlx_llm.decode.sampling import prompt_seed
    seeds = [prompt_seed(s, i) for s in (0, 1) for i in range(100)]
    assert len(set(seeds)) == 200 and all(0 <= s < 2**63 for s in seeds) and prompt_seed(0, 5) == seeds[5]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dense_gqa", "hybrid"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("unroll", [True, False])
def test_log_p_is_the_trainers_score_bit_for_bit_at_equal_shapes(kind, dtype, unroll):
    """Prompts computed in one chunk of T tokens (a page table of T positions): the first reply token's log p is
    the trainer's scoring of the same B × T inputs (``ppo.token_logprobs_and_values``, RL's rollout scoring) bit
    for bit, in float32 and in bfloat16, the layers unrolled or scanned (the unrolled stack rounds the residual
    stream where the trainer's scan does; log p is taken over the call's whole (R, T, V) logits, as the trainer's)
    for a dense stack; a hybrid of period 4 (Mamba, sliding window, MoE), whose chunks run other paths than the
    trainer's, to 1e-5."""
    from mlx_llm.post import ppo

    cfg = dataclasses.replace(KINDS[kind], vocab_size=256)  # a vocabulary wide enough for XLA to tile its sums
    params = jax.tree.map(lambda a: a.astype(dtype), random_params(cfg, 3))
    rng = np.random.default_rng(1)
    prompts = [tuple(int(t) for t in rng.integers(0, 256, 16)) for _ in range(4)]
    eng = Engine(params, cfg, max_seqs=4, max_len=20, page_size=4, token_budget=64, chunk_buckets=(16,),
                 width_buckets=(4,), row_buckets=(4,), decode_steps=1, unroll_layers=unroll)
    done = eng.run([Request(p, max_tokens=1, temperature=1.0, seed=i, logprobs=True) for i, p in enumerate(prompts)])
    seqs = jnp.asarray([list(p) + d.replies[0].tokens for p, d in zip(prompts, done)], jnp.int32)
    score = jax.jit(lambda s: ppo.token_logprobs_and_values(params, None, cfg, {"ids": s})[0])
    trainer = np.asarray(score(seqs))[:, -1]
    engine = np.asarray([d.replies[0].logp[0] for d in done], trainer.dtype)
    if kind == "dense_gqa":
        np.testing.assert_array_equal(engine, trainer)
    else:  # a sliding-window chunk reads the ring, a Mamba chunk runs from the slot's state: other sums, an ulp off
        np.testing.assert_allclose(engine, trainer, rtol=0, atol=1e-5)
