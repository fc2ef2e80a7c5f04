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
                               unroll_layers=False, **kw)
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


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(streams())
def test_engine_gives_generates_greedy_tokens_dense(data):
    _check_stream("dense_gqa", data)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["window_moe", "mamba", "hybrid"])
@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=streams())
def test_engine_gives_generates_greedy_tokens(kind, data):
    _check_stream(kind, data)
