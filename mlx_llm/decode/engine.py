"""The inference engine: continuous batching over a paged KV cache (DESIGN §8: the engine owns the cache).

Requests arrive at any time, each with its own settings as data (``Request``: temperature, top-k, top-p, max
tokens, stop token ids and strings, seed, n replies); ``step()`` advances every running reply and returns what
each one produced. Under the hood:

- **Rows and pages.** The decode state has ``max_seqs`` rows (plus one scratch row that padding points to). Full
  attention layers keep keys and values in one pool of fixed-size pages (``cache.PagedKVCache``), each reply a
  list of pages; sliding-window layers a ring and Mamba layers a state slot in the reply's row. One call computes
  on R rows of the state (gathered by row index, written back afterwards), so R and the tokens per row T are the
  only shapes: both come from fixed buckets, compiled by ``warm_up`` and never again (``compiles``).
- **One rule for prefill, chunked prefill and decode.** A reply knows how many of its tokens are computed and how
  many it needs (all of them: prompt and reply so far). Each step feeds every running reply its next uncomputed
  tokens under a token budget: replies that need one token (decoding) first, then prompt chunks. A call that
  computes a reply's last needed token samples its next one.
- **Several decode steps per dispatch.** When every running reply is decoding and nobody waits, one call runs
  ``decode_steps`` steps on the device, each row stopping at a stop id or its token limit there.
- **Preemption by recompute.** When pages run out, the most recently admitted reply gives its pages back and
  waits at the front of the queue with everything it has generated; it recomputes that prefix when it returns.
- **Prefix caching** (``pages.PageTable``): full pages are named by a hash chain over their tokens; a new reply
  shares the registered pages that start its tokens (only where every layer's state lives in pages: a Mamba or
  sliding-window layer's state is per row, so a hybrid model recomputes prefixes).
- **n replies share their prompt.** A request's first reply computes the prompt but its last token, then the
  other n − 1 fork off it: they share its full pages, copy its partial page and its per-row state, and each
  computes the last prompt token and draws its own first token. A GRPO group prefills its prompt once.
- **Sampling that does not depend on the batch**: token t of reply r is drawn with ``fold_in(fold_in(key(seed),
  r), t)`` (``sampling.reply_keys``), and every row's draw uses its own key only.

Every token carries log p (the model, temperature 1), log q (the distribution it was drawn from) and the log of
the mass of p_τ that top-k and top-p kept (``sampling.choose_keyed``).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import numbers
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from mlx_llm.config import ModelConfig
from mlx_llm.decode import cache as cache_lib
from mlx_llm.decode.pages import PageTable, page_keys
from mlx_llm.decode.sampling import SamplingRows, choose_keyed, reply_keys
from mlx_llm.decode.state import DecodeState, _layers_of, forward_cached, init_cache, require_causal, unstack_layers
from mlx_llm.decode.step import last_valid, tokens_only
from mlx_llm.errors import InputError
from mlx_llm.model import MIXERS, Params, resolved
from mlx_llm.ops import SEED_MAX, token_nll


@dataclasses.dataclass(frozen=True)
class Request:
    """One request: a prompt of token ids and how to continue it (every setting is data, none recompiles).

    temperature 0 is greedy; top_k 0 and top_p 1 cut nothing. ``stop_ids``: a reply ends after emitting one of
    them (kept as its last token); ``stop``: strings that end a reply (the engine needs a ``detokenize``); the
    reply's text stops before the string. ``n`` replies share the prompt; ``seed`` fixes every draw of every
    reply. ``logprobs``: return each token's log p, log q and log kept mass; ``top_logprobs``: also the k most
    likely tokens of each step under the model (id, log p), at most the engine's ``max_top_logprobs``.
    ``min_tokens``: the stop ids cannot be drawn (they are masked out of q), and stop strings are not matched,
    before the reply has that many tokens."""

    prompt: tuple
    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    stop_ids: tuple = ()
    stop: tuple = ()
    seed: int = 0
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    min_tokens: int = 0


@dataclasses.dataclass
class Reply:
    """One reply so far. ``finish_reason``: None while running, "stop" (a stop id or string), "length" or "abort"
    (``Engine.abort``). ``times``: the host clock when each token was known (time to first token, inter-token
    latency). ``top``: per token, the request's ``top_logprobs`` most likely (id, log p) of its step."""

    tokens: list = dataclasses.field(default_factory=list)
    logp: list = dataclasses.field(default_factory=list)
    logq: list = dataclasses.field(default_factory=list)
    log_mass: list = dataclasses.field(default_factory=list)
    times: list = dataclasses.field(default_factory=list)
    top: list = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    text: str | None = None


@dataclasses.dataclass
class Completion:
    """A request and its n replies; ``submitted``: the host clock at ``submit``."""

    id: int
    request: Request
    replies: list
    submitted: float

    @property
    def done(self) -> bool:
        return all(r.finish_reason is not None for r in self.replies)


class _Seq:
    """One reply on the host: its tokens (prompt, then reply), how many are computed, its row and pages."""

    def __init__(self, completion: Completion, reply: int, order: int):
        self.completion, self.reply, self.order = completion, reply, order
        self.request = completion.request
        self.tokens = list(self.request.prompt)
        self.computed, self.row, self.pages, self.keys = 0, None, [], []
        self.children: list[_Seq] = []  # the other replies, until they fork off this one
        self.text_seen = 0
        self.text_floor = 0  # stop strings are looked for from here on (the text once min_tokens is reached)

    @property
    def out(self) -> Reply:
        return self.completion.replies[self.reply]

    @property
    def target(self) -> int:
        """How many tokens it needs computed: all, or the prompt but its last token before its replies fork."""
        return len(self.request.prompt) - 1 if self.children else len(self.tokens)


def _buckets(top: int, low: int = 1) -> tuple:
    out, b = [], low
    while b < top:
        out.append(b)
        b *= 2
    return tuple(out) + (top,)


def _fit(buckets, n: int) -> int:
    return next(b for b in buckets if b >= n)


def _dispatch(params, layers, stores, blank, rows_R, lengths_R, table_RN, tokens_RT, n_new_R, emit_R, sampling,
              seeds_R2, reply_R, t_R, stop_RS, left_R, min_R, *, cfg, kernels, page_size, steps, top):
    """``steps`` calls on R rows of the state: the first feeds ``tokens_RT`` (row r's first ``n_new_R[r]`` real),
    the others each row's previous token; a row samples where ``emit_R`` (its chunk ends its needed tokens), never
    a stop id before its reply has ``min_R`` tokens, and stops at a stop id or its last allowed token. Returns
    ((tokens, log q, log p, log mass, emitted) each (R, steps), and with ``top`` > 0 the ``top`` most likely ids
    and their log p, each (R, steps, top); the stores)."""
    sub = {k: s.take_rows(rows_R) for k, s in stores.items()}
    fresh_R = lengths_R == 0  # a row starting a sequence: its per-row state is the initial one
    for kind, b in blank.items():
        sub[kind] = jax.tree.map(lambda a, z: jnp.where(fresh_R.reshape((1, -1) + (1,) * (a.ndim - 2)), z, a),
                                 sub[kind], b)
    state = DecodeState(stores=sub, lengths=lengths_R, max_len=table_RN.shape[1] * page_size, page_table=table_RN)

    def one(carry, i):
        state, tokens_RT, n_new_R, active_R, left_R = carry
        logits_RTV, state = forward_cached(params, tokens_RT, state, cfg, n_new_B=n_new_R, layers=layers,
                                           kernels=kernels)
        last_RV = tokens_only(last_valid(logits_RTV, jnp.maximum(n_new_R, 1)), cfg)
        early_R = t_R + i < min_R  # min_tokens: no stop id yet
        ban_RV = early_R[:, None] & jnp.any(jnp.arange(last_RV.shape[-1])[None, :, None] == stop_RS[:, None, :], -1)
        tok_R, logq_R, mass_R = choose_keyed(reply_keys(seeds_R2, reply_R, t_R + i), last_RV, sampling, ban_RV)
        # log p as the trainer scores it: ops.token_nll over the model's whole vocabulary (padding ids included) and
        # over the call's whole (R, T, V) block of logits, as the trainer's (B, T, V): XLA:CPU's reductions over V
        # can round differently for another shape (one row (R, V) moved bfloat16 log p by an ulp)
        last_R1 = jnp.maximum(n_new_R, 1)[:, None] - 1
        targets_RT = jnp.where(jnp.arange(logits_RTV.shape[1])[None, :] == last_R1, tok_R[:, None], 0)
        logp_R = -jnp.take_along_axis(token_nll(logits_RTV, targets_RT), last_R1, axis=1)[:, 0]
        left_R = left_R - active_R.astype(jnp.int32)
        stopped_R = jnp.any(tok_R[:, None] == stop_RS, axis=-1) | (left_R <= 0)
        out = (tok_R, logq_R, logp_R, mass_R, active_R)
        if top:  # the model's most likely tokens (log p at temperature 1, over the whole vocabulary)
            raw_RV = last_valid(logits_RTV, jnp.maximum(n_new_R, 1))
            lp_RV = jax.nn.log_softmax(raw_RV.astype(jnp.promote_types(raw_RV.dtype, jnp.float32)), axis=-1)
            top_val_RK, top_id_RK = jax.lax.top_k(jnp.where(jnp.isneginf(last_RV), -jnp.inf, lp_RV), top)
            out += (top_id_RK.astype(jnp.int32), top_val_RK)
        active_R = active_R & ~stopped_R
        return (state, tok_R[:, None], active_R.astype(jnp.int32), active_R, left_R), out

    carry = (state, tokens_RT, n_new_R, emit_R, left_R)
    carry, out = one(carry, 0)
    if steps > 1:
        carry, rest = jax.lax.scan(one, carry, jnp.arange(1, steps))
        out = tuple(jnp.concatenate([a[:, None], jnp.moveaxis(b, 0, 1)], axis=1) for a, b in zip(out, rest))
    else:
        out = tuple(a[:, None] for a in out)
    stores = {k: s.put_rows(rows_R, carry[0].stores[k]) for k, s in stores.items()}
    return out, stores


def _fork(stores, src_R, dst_R, src_P, dst_P):
    return {k: s.fork(src_R, dst_R, src_P, dst_P) for k, s in stores.items()}


_dispatch_jit = jax.jit(_dispatch, static_argnames=("cfg", "kernels", "page_size", "steps", "top"),
                        donate_argnames="stores")
_fork_jit = jax.jit(_fork, donate_argnames="stores")
_unstack_jit = jax.jit(unstack_layers, static_argnums=1)  # one program for every slice, not one dispatch each


def compiles() -> int:
    """Programs the engine has compiled so far in this process (its calls and its forks, every bucket)."""
    return _dispatch_jit._cache_size() + _fork_jit._cache_size()


def _positive(name, value, low=1):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise InputError(f"{name} = {value!r} is invalid: it must be an integer ≥ {low}")
    return int(value)


class Engine:
    """Continuous batching over ``params`` (the module docstring). ``submit`` requests, then ``step`` (or ``run``).

    max_seqs: replies decoded at once. max_len: positions per reply (prompt + reply; default the model's
    ``max_seq_len``). page_size, pages: the pool (default: every row at max_len, plus the padding page).
    token_budget: tokens computed per step (decoding rows first, then prompt chunks of at most the largest
    ``chunk_buckets`` entry). decode_steps: decode steps per dispatch while nobody waits. prefix_caching: None
    (where every layer's state is paged), True (refuse a model where it is not) or False. max_stop_ids: the
    longest ``stop_ids`` a request may give. detokenize: token ids → text, for stop strings and ``Reply.text``.
    unroll_layers: as ``generate``'s (True: per-layer weights, faster steps; False scans the stacked weights: faster
    compiles). Either way the residual stream is rounded where the trainer's scan rounds it, so a token's log p is
    the trainer's bit for bit at equal shapes.
    width_buckets: the page-table widths (in pages) a call may have: a call's rows read the narrowest that holds
    their pages, so attention over pages costs what the longest row of the call holds, not ``max_len``
    (default: 64 positions × 4^k, and ⌈max_len / page_size⌉ always). row_buckets: the row counts a call may have
    (default the powers of two below max_seqs; max_seqs always): fewer buckets, fewer programs, more padded rows.
    max_top_logprobs: the most ``top_logprobs`` a request may ask for (every call then returns that many, for
    every row; 0: none, the cheapest program)."""

    def __init__(self, params: Params, cfg: ModelConfig, *, max_seqs: int = 8, max_len: int | None = None,
                 page_size: int = 16, pages: int | None = None, token_budget: int = 256, chunk_buckets=None,
                 decode_steps: int = 8, prefix_caching: bool | None = None, max_stop_ids: int = 8,
                 detokenize: Callable[[list], str] | None = None, unroll_layers: bool = True, width_buckets=None,
                 row_buckets=None, kernels=None, max_top_logprobs: int = 0):
        require_causal(cfg)
        self.params, self.cfg, self.kernels = params, cfg, resolved(kernels)
        self.max_seqs = _positive("max_seqs", max_seqs)
        self.page_size = _positive("page_size", page_size)
        self.max_len = _positive("max_len", cfg.max_seq_len if max_len is None else max_len, 2)
        if self.max_len > cfg.max_seq_len:
            raise InputError(f"max_len = {self.max_len} is invalid: the model has max_seq_len = {cfg.max_seq_len}")
        self.n_pages = -(-self.max_len // self.page_size)
        count = _positive("pages", self.max_seqs * self.n_pages + 1 if pages is None else pages, 2)
        self.token_budget = _positive("token_budget", token_budget, self.max_seqs)
        self.decode_steps = _positive("decode_steps", decode_steps)
        self.max_stop_ids = _positive("max_stop_ids", max_stop_ids)
        self.max_top_logprobs = _positive("max_top_logprobs", max_top_logprobs, 0)
        if chunk_buckets is None:
            chunk_buckets = _buckets(min(self.token_budget, 512), 16)
        if not chunk_buckets or any(isinstance(c, bool) or not isinstance(c, numbers.Integral) or c < 2
                                    for c in chunk_buckets):
            raise InputError(f"chunk_buckets = {chunk_buckets!r} is invalid: it must list integers ≥ 2")
        self.chunk_buckets = tuple(sorted({int(c) for c in chunk_buckets}))
        if row_buckets is None:
            row_buckets = _buckets(self.max_seqs)
        if any(isinstance(r, bool) or not isinstance(r, numbers.Integral) or not 1 <= r <= self.max_seqs
               for r in row_buckets):
            raise InputError(f"row_buckets = {row_buckets!r} is invalid: it must list integers in [1, max_seqs = "
                             f"{self.max_seqs}]")
        self.row_buckets = tuple(sorted({int(r) for r in row_buckets} | {self.max_seqs}))
        if width_buckets is None:
            width_buckets, w = [], -(-64 // self.page_size)
            while w < self.n_pages:
                width_buckets.append(w)
                w *= 4
        if any(isinstance(w, bool) or not isinstance(w, numbers.Integral) or w < 1 for w in width_buckets):
            raise InputError(f"width_buckets = {width_buckets!r} is invalid: it must list integers ≥ 1 (pages)")
        self.detokenize = detokenize
        dtype = params["embed"].dtype
        state = init_cache(cfg, self.max_seqs + 1, self.n_pages * self.page_size, dtype,
                           pages=cache_lib.Pages(count, self.page_size))
        # placed as the calls return them (replicated over the parameters' mesh, when they have one), so the first
        # call compiles the program every later call uses
        placed = getattr(params["embed"], "sharding", None)
        self.stores = jax.device_put(state.stores, jax.sharding.NamedSharding(placed.mesh, jax.sharding.PartitionSpec())
                                     if isinstance(placed, jax.sharding.NamedSharding) else jax.devices()[0])
        self.paged = any(isinstance(s, cache_lib.PagedKVCache) for s in self.stores.values())
        # a model with no paged layer reads no page table: one width, one compile per shape
        self.width_buckets = tuple(sorted({int(w) for w in width_buckets if w < self.n_pages} | {self.n_pages})) \
            if self.paged else (self.n_pages,)
        per_row = [k for k, s in state.stores.items() if not isinstance(s, cache_lib.PagedKVCache)]
        if prefix_caching and per_row:
            raise InputError(f"prefix_caching = True is invalid for this model: its {', '.join(per_row)} layers "
                             "keep their state per row, not in pages, so a cached prefix would lack it")
        self.table = PageTable(cache_lib.Pages(count, self.page_size),
                               caching=bool(self.paged and not per_row and prefix_caching is not False))
        self.blank = {k: {r: cache_lib.allocate(MIXERS[k].state_spec(cfg, k), len(_layers_of(cfg, k)), r,
                                                self.max_len, dtype) for r in self.row_buckets} for k in per_row}
        self.layers = _unstack_jit(params, cfg) if unroll_layers else None
        self.scratch = self.max_seqs
        self.free_rows = list(range(self.max_seqs))
        self.waiting: collections.deque[list[_Seq]] = collections.deque()
        self.running: list[_Seq] = []
        self.completions: dict[int, Completion] = {}  # the requests not yet done (a long-lived engine keeps no others)
        self._ids, self._order = itertools.count(), itertools.count()
        self.preemptions = 0
        self.tokens_computed = 0  # positions fed through the model (prompt chunks, recomputes and decode steps)

    # ----- requests ---------------------------------------------------------------------------------
    def check(self, request: Request) -> Request:
        """The request, validated against this engine and model (one ``InputError`` naming the bad value)."""
        if not isinstance(request, Request):
            raise InputError(f"a request must be an engine.Request; got {type(request).__name__}")
        prompt = tuple(request.prompt)
        v = self.cfg.vocab_used or self.cfg.vocab_size
        if not prompt or any(isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < v
                             for t in prompt):
            raise InputError(f"prompt is invalid: it must be a non-empty list of token ids in [0, {v})")
        max_tokens = _positive("max_tokens", request.max_tokens)
        if len(prompt) + max_tokens > self.max_len:
            raise InputError(f"a prompt of {len(prompt)} tokens plus max_tokens = {max_tokens} needs "
                             f"{len(prompt) + max_tokens} positions, more than this engine's max_len = {self.max_len}")
        t = request.temperature
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not 0 <= t < float("inf"):
            raise InputError(f"temperature = {t!r} is invalid: it must be a number ≥ 0 (0 is greedy)")
        if isinstance(request.top_k, bool) or not isinstance(request.top_k, numbers.Integral) or request.top_k < 0:
            raise InputError(f"top_k = {request.top_k!r} is invalid: it must be an integer ≥ 0 (0 cuts nothing)")
        p = request.top_p
        if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0 < p <= 1:
            raise InputError(f"top_p = {p!r} is invalid: it must be a number in (0, 1] (1 cuts nothing)")
        stop_ids = tuple(request.stop_ids)
        if len(stop_ids) > self.max_stop_ids or any(
                isinstance(s, bool) or not isinstance(s, numbers.Integral) or not 0 <= s < self.cfg.vocab_size
                for s in stop_ids):
            raise InputError(f"stop_ids = {list(stop_ids)!r} is invalid: at most {self.max_stop_ids} token ids in "
                             f"[0, {self.cfg.vocab_size})")
        stop = tuple(request.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise InputError(f"stop = {list(stop)!r} is invalid: it must be non-empty strings")
        if stop and self.detokenize is None:
            raise InputError("stop strings need a tokenizer: build the engine with detokenize=…")
        if isinstance(request.seed, bool) or not isinstance(request.seed, numbers.Integral) or \
                not 0 <= request.seed <= SEED_MAX:
            raise InputError(f"seed = {request.seed!r} is invalid: it must be an integer in [0, {SEED_MAX}]")
        top = _positive("top_logprobs", request.top_logprobs, 0)
        if top > self.max_top_logprobs:
            raise InputError(f"top_logprobs = {top} is invalid: this engine returns at most max_top_logprobs = "
                             f"{self.max_top_logprobs}")
        min_tokens = _positive("min_tokens", request.min_tokens, 0)
        if min_tokens > max_tokens:
            raise InputError(f"min_tokens = {min_tokens} is invalid: it must be at most max_tokens = {max_tokens}")
        n = _positive("n", request.n)
        if n > self.max_seqs:
            raise InputError(f"n = {n} is invalid: this engine decodes at most max_seqs = {self.max_seqs} replies")
        worst = self.pages_needed(len(prompt), max_tokens, n)
        if self.paged and worst > self.table.pages.count - 1:
            raise InputError(f"the request may need {worst} pages (n = {n} replies of up to {len(prompt) + max_tokens}"
                             f" positions) but the pool has {self.table.pages.count - 1}")
        return dataclasses.replace(request, prompt=prompt, stop_ids=stop_ids, stop=stop, temperature=float(t),
                                   top_k=int(request.top_k), top_p=float(p), max_tokens=max_tokens, n=n,
                                   seed=int(request.seed), top_logprobs=top, min_tokens=min_tokens,
                                   logprobs=bool(request.logprobs or top))

    def pages_needed(self, prompt: int, max_tokens: int, n: int = 1) -> int:
        """The most pages a request can hold at once: its replies share the prompt's full pages but the last
        token's, and each feeds at most prompt + max_tokens − 1 positions (its last token is never fed)."""
        shared = (prompt - 1) // self.page_size
        return shared + n * (-(-(prompt + max_tokens - 1) // self.page_size) - shared)

    def submit(self, request: Request) -> Completion:
        """Queue a request (validated now, before anything is queued); its ``Completion`` fills as it runs."""
        request = self.check(request)
        done = Completion(next(self._ids), request, [Reply() for _ in range(request.n)], time.perf_counter())
        self.completions[done.id] = done
        order = next(self._order)
        group = [_Seq(done, r, order) for r in range(request.n)]
        group[0].children = group[1:]
        self.waiting.append(group)
        return done

    def run(self, requests) -> list[Completion]:
        """Every request through the engine; their completions, in order."""
        out = [self.submit(r) for r in requests]
        while self.waiting or self.running:
            self.step()
        return out

    def abort(self, completion: Completion) -> None:
        """Stop a request now: its replies end with finish_reason "abort" (the tokens so far kept), its rows and
        pages are free at once. A request already done is left as it is."""
        for group in [g for g in self.waiting if g[0].completion is completion]:
            self.waiting.remove(group)
        for seq in [s for s in self.running if s.completion is completion]:
            for kid in seq.children:  # replies not yet forked off the prompt hold a row only
                self.free_rows.append(kid.row)
                kid.row = None
            seq.children = []
            self._finish(seq)
        for reply in completion.replies:
            if reply.finish_reason is None:
                reply.finish_reason = "abort"
        self.completions.pop(completion.id, None)

    @property
    def prefix_hit_rate(self) -> float:
        """Pages found in the prefix cache over pages looked up (0 when none was looked up)."""
        return self.table.hits / self.table.lookups if self.table.lookups else 0.0

    # ----- pages --------------------------------------------------------------------------------------
    def _preempt(self, seq: _Seq) -> None:
        """Give back its pages and row(s); it waits at the front of the queue and recomputes its tokens later."""
        for page in seq.pages:
            self.table.release(page)
        group = [seq, *seq.children]
        for s in group:
            self.free_rows.append(s.row)
            s.row, s.pages, s.keys, s.computed = None, [], [], 0
        self.running.remove(seq)
        self.waiting.appendleft(group)
        self.preemptions += 1

    def _room(self, n: int, seq: _Seq) -> bool:
        """``n`` pages available, preempting replies admitted after ``seq`` (latest first); False when even
        that is not enough (``seq`` is then preempted itself)."""
        while self.table.available < n:
            victim = max(self.running, key=lambda s: (s.order, s.reply))
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _cover(self, seq: _Seq, positions: int, *, preempt: bool = True) -> bool:
        """Pages for its first ``positions`` positions."""
        if not self.paged:
            return True
        need = -(-positions // self.page_size) - len(seq.pages)
        if need <= 0:
            return True
        if not preempt and self.table.available < need:
            return False
        if not self._room(need, seq):
            return False
        seq.pages += [self.table.allocate() for _ in range(need)]
        return True

    def _register(self, seq: _Seq) -> None:
        """Record its newly full computed pages in the prefix cache."""
        full = seq.computed // self.page_size
        if not self.table.caching or full <= len(seq.keys):
            return
        new = page_keys(seq.tokens[len(seq.keys) * self.page_size:full * self.page_size], self.page_size,
                        seq.keys[-1] if seq.keys else b"")
        for i, key in enumerate(new, start=len(seq.keys)):
            self.table.register(seq.pages[i], key)
        seq.keys += new

    # ----- scheduling ---------------------------------------------------------------------------------
    def _admit(self) -> None:
        """Start waiting requests in order while rows and the pages of their prompt are free, with a page to spare
        for each running reply."""
        while self.waiting:
            group = self.waiting[0]
            lead = group[0]
            if len(group) > len(self.free_rows):
                return
            keys = page_keys(lead.tokens, self.page_size) if self.table.caching else []
            usable = keys[:max(lead.target - 1, 0) // self.page_size]  # leave a token to compute
            hits = self.table.lookup(usable)
            need = -(-max(lead.target, 1) // self.page_size) - len(hits)
            # headroom: a page stays free for each running reply's next one, so admitting a prompt does not at once
            # preempt the replies already decoding (129 preemptions on bench_engine's stream without it)
            if self.paged and self.table.available < need + len(self.running) and self.running:
                self.table.lookups -= len(usable)
                self.table.hits -= len(hits)
                return
            self.waiting.popleft()
            for page in hits:
                self.table.share(page)
            lead.pages, lead.keys, lead.computed = list(hits), keys[:len(hits)], len(hits) * self.page_size
            for s in group:
                s.row = self.free_rows.pop(0)
            self.running.append(lead)
            if lead.children and lead.computed >= lead.target:
                self._fork(lead)

    def _fork(self, lead: _Seq) -> None:
        """Its other replies start from its state: its full pages shared, its partial page and row state copied."""
        kids, full = lead.children, lead.computed // self.page_size
        partial = self.paged and lead.computed % self.page_size != 0
        if partial and not self._room(len(kids), lead):
            return  # the lead itself was preempted: the group waits
        lead.children = []
        src_p, dst_p = [], []
        for kid in kids:
            kid.pages = list(lead.pages[:full])
            for page in kid.pages:
                self.table.share(page)
            if partial:
                kid.pages.append(self.table.allocate())
                src_p.append(lead.pages[full])
                dst_p.append(kid.pages[-1])
            kid.computed, kid.keys = lead.computed, list(lead.keys)
            self.running.append(kid)
        r = _fit(self.row_buckets, len(kids))
        pad = lambda xs, fill: np.asarray(xs + [fill] * (r - len(xs)), np.int32)
        pad_p = cache_lib.PADDING_PAGE
        self.stores = _fork_jit(self.stores, pad([lead.row] * len(kids), self.scratch),
                                pad([k.row for k in kids], self.scratch), pad(src_p, pad_p), pad(dst_p, pad_p))

    def _plan(self) -> list:
        """(reply, tokens to feed) for this step: decoding replies first, then prompt chunks, within the budget."""
        budget, work = self.token_budget, []
        ordered = sorted(self.running, key=lambda s: (s.order, s.reply))
        for seq in ordered:
            if seq.target - seq.computed == 1:
                work.append((seq, 1))
                budget -= 1
        for seq in ordered:
            need = seq.target - seq.computed
            if need > 1 and budget > 0:
                work.append((seq, min(need, budget, self.chunk_buckets[-1])))
                budget -= work[-1][1]
        kept = []
        for seq, n in work:
            if seq in self.running and self._cover(seq, seq.computed + n):
                kept.append((seq, n))
        return [(s, n) for s, n in kept if s in self.running]

    def step(self) -> list:
        """One scheduling step: admit, plan, compute, sample. Returns (completion, reply index, new tokens) for
        every reply that produced tokens."""
        self._admit()
        work = self._plan()
        if not work:
            if self.waiting and not self.running:
                raise RuntimeError("the engine cannot admit its next request (the pool is too small for it)")
            return []
        steps = 1
        decoding = all(n == 1 for _, n in work) and not self.waiting and self.decode_steps > 1
        if decoding:
            last = lambda s: len(s.request.prompt) + s.request.max_tokens - 1
            if all(self._cover(s, min(s.computed + self.decode_steps, last(s)), preempt=False) for s, _ in work):
                steps = self.decode_steps
        # one call per (decoding or chunk, page-table width): a long row does not widen the short rows' tables
        # (the reference attention reads every row at its call's width; an extra call costs one read of the weights)
        groups: dict = {}
        for seq, n in work:
            groups.setdefault((n > 1, _fit(self.width_buckets, len(seq.pages))), []).append((seq, n))
        launched = [(g, self._launch(g, 1 if chunks else steps)) for (chunks, _), g in sorted(groups.items())]
        events = []
        for group, out in launched:
            events += self._book(group, [np.asarray(a) for a in out])
        return events

    def _launch(self, group, steps: int):
        """One call for ``group`` (its rows feed T tokens at most and read tables of one width): returns its device
        outputs."""
        r = _fit(self.row_buckets, len(group))
        t = 1 if steps > 1 or all(n == 1 for _, n in group) else _fit(self.chunk_buckets, max(n for _, n in group))
        rows = np.full((r,), self.scratch, np.int32)
        lengths, n_new, emit = np.zeros((r,), np.int32), np.zeros((r,), np.int32), np.zeros((r,), bool)
        table = np.full((r, _fit(self.width_buckets, max(len(s.pages) for s, _ in group))), cache_lib.PADDING_PAGE,
                        np.int32)
        tokens = np.zeros((r, t), np.int32)
        temp, top_k, top_p = np.zeros((r,)), np.zeros((r,), np.int32), np.ones((r,))
        seeds, reply, pos = np.zeros((r, 2), np.uint32), np.zeros((r,), np.int32), np.zeros((r,), np.int32)
        stop, left, least = np.full((r, self.max_stop_ids), -1, np.int32), np.zeros((r,), np.int32), \
            np.zeros((r,), np.int32)
        for i, (seq, n) in enumerate(group):
            q = seq.request
            rows[i], lengths[i], n_new[i] = seq.row, seq.computed, n
            emit[i] = seq.computed + n == len(seq.tokens) and not seq.children
            table[i, :len(seq.pages)] = seq.pages
            tokens[i, :n] = seq.tokens[seq.computed:seq.computed + n]
            temp[i], top_k[i], top_p[i] = q.temperature, q.top_k, q.top_p
            seeds[i] = (q.seed >> 32, q.seed & 0xFFFFFFFF)  # ops.seed_key_data's words
            reply[i], pos[i] = seq.reply, len(seq.out.tokens)
            stop[i, :len(q.stop_ids)] = q.stop_ids
            left[i], least[i] = q.max_tokens - len(seq.out.tokens), q.min_tokens
        blank = {k: b[r] for k, b in self.blank.items()}
        sampling = SamplingRows(temperature=jnp.asarray(temp, float), top_k=jnp.asarray(top_k),
                                top_p=jnp.asarray(top_p, float))
        out, self.stores = _dispatch_jit(self.params, self.layers, self.stores, blank, rows, lengths, table, tokens,
                                         n_new, emit, sampling, seeds, reply, pos, stop, left, least, cfg=self.cfg,
                                         kernels=self.kernels, page_size=self.page_size, steps=steps,
                                         top=self.max_top_logprobs)
        return out

    def _book(self, group, out) -> list:
        """Append what each row of ``group`` emitted; finish replies that stopped; fork finished prompts."""
        tokens, logq, logp, mass, emitted = out[:5]
        top_ids, top_lp = out[5:] if len(out) > 5 else (None, None)
        now, events = time.perf_counter(), []
        for i, (seq, n) in enumerate(group):
            seq.computed += n
            self.tokens_computed += n
            new = []
            for j in range(tokens.shape[1]):
                if not emitted[i, j]:
                    break
                if j > 0:
                    seq.computed += 1
                    self.tokens_computed += 1
                new.append(int(tokens[i, j]))
                top = None if top_ids is None else (top_ids[i, j], top_lp[i, j])
                self._emit(seq, int(tokens[i, j]), logp[i, j], logq[i, j], mass[i, j], now, top)
                if seq.out.finish_reason is not None:
                    break
            self._register(seq)
            if seq.children and seq.computed >= seq.target:
                self._fork(seq)
            if new:
                events.append((seq.completion, seq.reply, new))
            if seq.out.finish_reason is not None:
                self._finish(seq)
        return events

    def _emit(self, seq: _Seq, token: int, logp, logq, mass, now: float, top=None) -> None:
        q, out = seq.request, seq.out
        seq.tokens.append(token)
        out.tokens.append(token)
        out.times.append(now)
        if q.logprobs:
            out.logp.append(float(logp))
            out.logq.append(float(logq))
            out.log_mass.append(float(mass))
        if q.top_logprobs:
            # the token's own entry carries its log p exactly (the trainer's score, as ``logp``)
            out.top.append([(int(t), float(logp) if int(t) == token else float(v))
                            for t, v in zip(top[0][:q.top_logprobs], top[1][:q.top_logprobs])])
        if token in q.stop_ids:
            out.finish_reason = "stop"
        elif len(out.tokens) >= q.max_tokens:
            out.finish_reason = "length"
        if self.detokenize is not None:
            out.text = self.detokenize(out.tokens)
            longest = max((len(s) for s in q.stop), default=0)
            if len(out.tokens) < q.min_tokens:  # min_tokens: stop strings count in the text after that many tokens
                seq.text_floor = len(out.text)
            start = max(seq.text_seen - longest, seq.text_floor)
            window = out.text[start:]
            cuts = [window.find(s) for s in q.stop if s in window]
            if cuts:
                out.text = out.text[:start + min(cuts)]
                out.finish_reason = "stop"
            seq.text_seen = len(out.text)

    def _finish(self, seq: _Seq) -> None:
        for page in seq.pages:
            self.table.release(page)
        self.free_rows.append(seq.row)
        seq.pages, seq.row = [], None
        self.running.remove(seq)
        if seq.completion.done:
            self.completions.pop(seq.completion.id, None)

    def shapes(self) -> list:
        """Every (rows, tokens per row, steps, page-table width) a call can have: decode calls of one token per row
        (one step, or ``decode_steps``) at any width; prompt-chunk calls where the budget lets that many rows
        (each chunk ≥ 2 tokens) carry a chunk of that bucket, at widths that hold such a chunk."""
        out = [(r, 1, s, w) for r in self.row_buckets for s in dict.fromkeys((1, self.decode_steps))
               for w in self.width_buckets]
        prev_r = dict(zip(self.row_buckets, (0,) + self.row_buckets))
        prev_t = dict(zip(self.chunk_buckets, (1,) + self.chunk_buckets))
        for r in self.row_buckets:
            for t in self.chunk_buckets:
                shortest = prev_t[t] + 1  # the call's longest chunk is at least this long
                if 2 * prev_r[r] + shortest > self.token_budget or shortest > self.max_len:
                    continue
                out += [(r, t, 1, w) for w in self.width_buckets if w * self.page_size >= shortest]
        return out

    def warm_up(self) -> int:
        """Compile every shape ``shapes`` lists, and every fork, by running each once on the scratch row; returns
        the programs compiled. A steady stream compiles nothing after this."""
        before = compiles()
        for r, t, steps, w in self.shapes():
            z = np.zeros((r,), np.int32)
            sampling = SamplingRows(temperature=jnp.zeros((r,), float), top_k=jnp.asarray(z),
                                    top_p=jnp.ones((r,), float))
            _, self.stores = _dispatch_jit(
                self.params, self.layers, self.stores, {k: b[r] for k, b in self.blank.items()},
                np.full((r,), self.scratch, np.int32), z, np.zeros((r, w), np.int32),
                np.zeros((r, t), np.int32), z, np.zeros((r,), bool), sampling, np.zeros((r, 2), np.uint32), z, z,
                np.full((r, self.max_stop_ids), -1, np.int32), z, z, cfg=self.cfg, kernels=self.kernels,
                page_size=self.page_size, steps=steps, top=self.max_top_logprobs)
        for r in self.row_buckets:
            s, z = np.full((r,), self.scratch, np.int32), np.zeros((r,), np.int32)
            self.stores = _fork_jit(self.stores, s, s, z, z)
        return compiles() - before


def complete(params: Params, cfg: ModelConfig, requests, *, max_seqs: int = 64, page_size: int = 16,
             detokenize: Callable[[list], str] | None = None, kernels=None, unroll_layers: bool = True) -> list:
    """Every request of ``requests`` through one engine sized to them; their ``Completion`` objects, in order.

    The samplers of the project (``generate``, ``chat``, ``eval-task``, the lm-eval harness, RL and PPO rollouts,
    reply sampling for pairs) call this: rows for up to ``max_seqs`` replies at once (the next power of two that
    holds them all, when fewer), positions for the longest prompt plus its ``max_tokens``, and a pool that holds
    every row at that length (so nothing is preempted). The engine's buckets keep the programs few: a later call
    with the same model and sizes compiles nothing."""
    requests = list(requests)
    return sized_engine(params, cfg, requests, max_seqs=max_seqs, page_size=page_size, detokenize=detokenize,
                        kernels=kernels, unroll_layers=unroll_layers).run(requests) if requests else []


def sized_engine(params: Params, cfg: ModelConfig, requests, *, max_seqs: int = 64, page_size: int = 16,
                 detokenize: Callable[[list], str] | None = None, kernels=None, unroll_layers: bool = True) -> Engine:
    """The engine ``complete`` runs ``requests`` on (not yet submitted)."""
    requests = list(requests)
    if not requests or any(not isinstance(r, Request) for r in requests):
        raise InputError("complete() takes a non-empty list of engine.Request")
    replies = sum(_positive("n", r.n) for r in requests)
    longest = max(len(tuple(r.prompt)) + _positive("max_tokens", r.max_tokens) for r in requests)
    if longest > cfg.max_seq_len:
        raise InputError(f"a prompt plus its max_tokens needs {longest} positions, more than the model's "
                         f"max_seq_len = {cfg.max_seq_len}")
    rows = _fit(_buckets(_positive("max_seqs", max_seqs)), min(replies, max_seqs))
    page_size = _positive("page_size", page_size)
    max_len = min(-(-longest // page_size) * page_size, cfg.max_seq_len)
    prompt = _fit(_buckets(max_len, 16), min(max(len(tuple(r.prompt)) for r in requests), max_len))
    stop_ids = max(len(tuple(r.stop_ids)) for r in requests)
    # few programs (each costs seconds of XLA compile): two row counts, one prompt-chunk length, and a budget
    # that prefills a full batch of prompts in one call
    engine = Engine(params, cfg, max_seqs=rows, max_len=max_len, page_size=page_size,
                    max_stop_ids=max(8, stop_ids), detokenize=detokenize, kernels=kernels,
                    unroll_layers=unroll_layers, row_buckets=(max(rows // 8, 1),), chunk_buckets=(max(prompt, 2),),
                    token_budget=max(rows, min(rows * prompt, 8192)))
    return engine
