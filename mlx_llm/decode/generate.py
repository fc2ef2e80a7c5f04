"""Generation (M20 §13–§14, U19 §1, §4–§6): prefill the KV cache, then a ``lax.scan`` decode loop.

``generate`` validates everything at the boundary, then runs one jitted function over the public steps of
``decode/step.py``: ``fill`` (``prefill``'s body) of the (right-padded) prompts, the first token chosen from
each row's last valid logits (``sample``), and a scan of ``advance`` (``step``'s body) over the remaining steps
that feeds the last token back (one cached position per step, M20 §14). cfg and the lengths are static; the sampling settings are data
(``SamplingRows``), so every temperature, top-k and top-p shares one compile. Beam search, a search over W
beams rather than one token per row, keeps its own loop (its settings static).

Sampling and greedy carry (cache, last tokens, done flags, running log q and log p); the PRNG key of step t
is ``fold_in(seed_key_data(seed), t)``, so a seed fixes the whole continuation. A row that emitted ``eos_id`` is
done: it emits ``pad_id`` from then on and its cache, length and scores stop changing.

Beam search keeps W beams per prompt (batch B·W) and reorders the cache by each survivor's parent every
step (a gather of the whole cache: the price of standard beam search).
"""

from __future__ import annotations

import numbers

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from mlx_llm.decode import step as step_lib
from mlx_llm.decode.state import DecodeState, forward_cached, init_cache, reorder_rows, require_causal, unstack_layers
from mlx_llm.config import ModelConfig
from mlx_llm.errors import InputError
from mlx_llm.model import Params, check_tokens, resolved
from mlx_llm.ops import SEED_MAX, seed_key_data
from mlx_llm.decode.sampling import DecodeSettings, SamplingRows, beam_rank, beam_step


@flax.struct.dataclass
class GenerationResult:
    """tokens (B, N): the continuation, ``pad_id`` after EOS. lengths (B,): tokens generated, EOS included.

    logq / logp (B,): log-probability of each continuation under the decoding distribution q and under the
    model p (M20 §13: a sampled continuation's probability under the decoder is the product of its q terms).
    Greedy and beam search are deterministic, so their log q is 0.

    token_logq / token_logp (B, N): the same per generated token (0 after EOS); their row sums are logq / logp.
    Sampling and greedy only (None for beam search, whose beams are reordered every step). RL weighs each
    sampled token by π/q with them (post/estimator.py).
    """

    tokens: jax.Array
    lengths: jax.Array
    logq: jax.Array
    logp: jax.Array
    token_logq: jax.Array | None = None
    token_logp: jax.Array | None = None


@flax.struct.dataclass
class _Rows:
    done: jax.Array
    length: jax.Array
    logq: jax.Array
    logp: jax.Array


def _prefill(params, prompt_BT, lengths_B, cfg, max_new_tokens, kernels):
    """The prompts into an empty cache of prompt + ``max_new_tokens`` slots (``step.fill``)."""
    cache = init_cache(cfg, prompt_BT.shape[0], prompt_BT.shape[1] + max_new_tokens, params["embed"].dtype)
    return step_lib.fill(params, cache, prompt_BT, lengths_B, cfg=cfg, kernels=kernels)


# ----- sampling and greedy -------------------------------------------------------------------------
def _finish(picked: step_lib.Picked, rows: _Rows, eos_id, pad_id):
    """Book each row's chosen token: finished rows emit pad_id and score 0; a row that emits EOS is done.
    Returns the tokens, the rows and the step's (log q, log p) of each row."""
    active_B = ~rows.done
    tok_B = jnp.where(active_B, picked.tokens, pad_id)
    done_B = rows.done if eos_id is None else rows.done | (active_B & (tok_B == eos_id))
    lq_B, lp_B = jnp.where(active_B, picked.logq, 0.0), jnp.where(active_B, picked.logp, 0.0)
    rows = _Rows(done=done_B, length=rows.length + active_B.astype(jnp.int32), logq=rows.logq + lq_B,
                 logp=rows.logp + lp_B)
    return tok_B, rows, (lq_B, lp_B)


def _sample(params, prompt_BT, lengths_B, key, sampling, *, cfg, max_new_tokens, eos_id, pad_id, unroll_layers,
            kernels):
    logits_BV, cache = _prefill(params, prompt_BT, lengths_B, cfg, max_new_tokens, kernels)
    layers = unstack_layers(params, cfg) if unroll_layers else None
    acc = jnp.promote_types(logits_BV.dtype, jnp.float32)
    b = prompt_BT.shape[0]
    rows = _Rows(done=jnp.zeros((b,), bool), length=jnp.zeros((b,), jnp.int32),
                 logq=jnp.zeros((b,), acc), logp=jnp.zeros((b,), acc))
    picked = step_lib.sample(jax.random.fold_in(key, 0), logits_BV, sampling)
    tok_B, rows, first = _finish(picked, rows, eos_id, pad_id)

    def body(carry, t):
        cache, tok_B, rows = carry
        picked, cache = step_lib.advance(params, cache, tok_B, ~rows.done, sampling, jax.random.fold_in(key, t),
                                         cfg=cfg, layers=layers, kernels=kernels)
        tok_B, rows, scores = _finish(picked, rows, eos_id, pad_id)
        return (cache, tok_B, rows), (tok_B, *scores)

    (_, _, rows), per_step = jax.lax.scan(body, (cache, tok_B, rows), jnp.arange(1, max_new_tokens))
    tokens_BN, logq_BN, logp_BN = (jnp.concatenate([a[:, None], b_NB.T], axis=1)
                                   for a, b_NB in zip((tok_B, *first), per_step))
    return GenerationResult(tokens=tokens_BN, lengths=rows.length, logq=rows.logq, logp=rows.logp,
                            token_logq=logq_BN, token_logp=logp_BN)


# ----- beam search ---------------------------------------------------------------------------------
@flax.struct.dataclass
class _Beams:
    """W beams per prompt: Σ log p, tokens generated (EOS included), finished flags, the tokens so far."""

    score: jax.Array
    length: jax.Array
    finished: jax.Array
    tokens: jax.Array


def _reorder(cache: DecodeState, parent_BW) -> DecodeState:
    """Each surviving beam takes over its parent's cache (rows flattened as b·W + beam)."""
    b, w = parent_BW.shape
    src = (jnp.arange(b)[:, None] * w + parent_BW).reshape(-1)
    return reorder_rows(cache, src)


def _beam_select(t, logits_BWV, beams: _Beams, settings, eos_id, pad_id):
    """Step t of beam search: the W best proposals survive; their parents and new tokens are returned."""
    logp_BWV = jax.nn.log_softmax(logits_BWV.astype(beams.score.dtype), axis=-1)
    parent, tok, score, length, done = beam_step(beams.score, beams.length, beams.finished, logp_BWV,
                                                 eos_id=eos_id, pad_id=pad_id, alpha=settings.length_penalty)
    tokens = jnp.take_along_axis(beams.tokens, parent[..., None], axis=1)
    tokens = jax.lax.dynamic_update_slice_in_dim(tokens, tok[..., None], t, axis=2)
    return parent, tok, _Beams(score=score, length=length, finished=done, tokens=tokens)


def _beam(params, prompt_BT, lengths_B, *, cfg, settings, max_new_tokens, eos_id, pad_id, unroll_layers, kernels):
    w = settings.beam_width
    logits_BV, cache = _prefill(params, prompt_BT, lengths_B, cfg, max_new_tokens, kernels)
    layers = unstack_layers(params, cfg) if unroll_layers else None
    b, v = logits_BV.shape
    cache = reorder_rows(cache, jnp.repeat(jnp.arange(b), w))  # every prompt's state, W times
    acc = jnp.promote_types(logits_BV.dtype, jnp.float32)
    # All W beams start as the same prompt; only beam 0 may expand, so the first step has no duplicates.
    beams = _Beams(score=jnp.where(jnp.arange(w) == 0, 0.0, -jnp.inf).astype(acc) * jnp.ones((b, 1), acc),
                   length=jnp.zeros((b, w), jnp.int32), finished=jnp.zeros((b, w), bool),
                   tokens=jnp.full((b, w, max_new_tokens), pad_id, jnp.int32))
    first_BWV = jnp.broadcast_to(logits_BV[:, None], (b, w, v))
    parent, tok, beams = _beam_select(0, first_BWV, beams, settings, eos_id, pad_id)

    def step(carry, t):
        cache, parent, tok, beams = carry
        cache = _reorder(cache, parent)
        # a beam's cache advances only while it is alive (a just-emitted EOS is not fed back)
        n_new = (~beams.finished).reshape(-1).astype(jnp.int32)
        logits_R1V, cache = forward_cached(params, tok.reshape(-1, 1), cache, cfg, n_new_B=n_new, layers=layers,
                                           kernels=kernels)
        parent, tok, beams = _beam_select(t, step_lib.tokens_only(logits_R1V.reshape(b, w, v), cfg), beams,
                                          settings, eos_id, pad_id)
        return (cache, parent, tok, beams), None

    (_, _, _, beams), _ = jax.lax.scan(step, (cache, parent, tok, beams), jnp.arange(1, max_new_tokens))
    best_B1 = jnp.argmax(beam_rank(beams.score, beams.length, settings.length_penalty), axis=1)[:, None]
    pick = lambda x: jnp.take_along_axis(x, best_B1, axis=1)[:, 0]
    return GenerationResult(tokens=jnp.take_along_axis(beams.tokens, best_B1[..., None], axis=1)[:, 0],
                            lengths=pick(beams.length), logq=jnp.zeros((b,), acc), logp=pick(beams.score))


_STATIC = ("cfg", "max_new_tokens", "eos_id", "pad_id", "unroll_layers", "kernels")
_sample_jit = jax.jit(_sample, static_argnames=_STATIC)  # the sampling settings are data: one compile serves all
_beam_jit = jax.jit(_beam, static_argnames=(*_STATIC, "settings"))


# ----- the public entry point ----------------------------------------------------------------------
def _check_id(name, value, cfg: ModelConfig, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or not 0 <= value < cfg.vocab_size:
        raise InputError(f"{name} = {value!r} is invalid: it must be a token id in [0, {cfg.vocab_size})"
                         + (" or None" if allow_none else ""))


def _check_request(cfg: ModelConfig, prompt_BT, max_new_tokens, prompt_lengths, eos_id, pad_id, seed):
    """Validate everything before any tracing; return (prompt cut to its longest row, lengths int32)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens = {max_new_tokens!r} is invalid: it must be an integer ≥ 1")
    check_tokens(prompt_BT, cfg, name="prompt_BT")
    prompt = np.asarray(prompt_BT)
    b, t = prompt.shape
    if b < 1 or t < 1:
        raise InputError(f"prompt_BT has shape {prompt.shape}: it needs at least one row and one token (e.g. BOS)")
    lengths = np.full((b,), t) if prompt_lengths is None else np.asarray(prompt_lengths)
    if lengths.shape != (b,) or not np.issubdtype(lengths.dtype, np.integer):
        raise InputError(f"prompt_lengths must be {b} integers, one per prompt row; got {np.asarray(prompt_lengths)!r}")
    if (lengths < 1).any() or (lengths > t).any():
        raise InputError(f"prompt_lengths = {lengths.tolist()} is invalid: each must be in [1, {t}] "
                         f"(the prompt rows are right-padded to width {t})")
    longest = int(lengths.max())
    if longest + max_new_tokens > cfg.max_seq_len:
        raise InputError(f"a prompt of {longest} tokens plus max_new_tokens = {max_new_tokens} needs "
                         f"{longest + max_new_tokens} positions, more than max_seq_len = {cfg.max_seq_len}")
    _check_id("eos_id", eos_id, cfg, allow_none=True)
    _check_id("pad_id", pad_id, cfg, allow_none=False)
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed <= SEED_MAX:
        raise InputError(f"seed = {seed!r} is invalid: it must be an integer in [0, {SEED_MAX}]")
    return jnp.asarray(prompt[:, :longest], jnp.int32), jnp.asarray(lengths, jnp.int32)


def check_generation(cfg: ModelConfig, prompt_BT, max_new_tokens, *, temperature=None, top_k=None, top_p=None,
                     beam_width=None, length_penalty=None, eos_id=None, pad_id: int = 0, seed: int = 0,
                     prompt_lengths=None):
    """``generate``'s checks, before any work (the engine's callers give the same errors): returns (settings, the
    prompt cut to its longest row, lengths). ``ConfigError`` for invalid settings, ``InputError`` for prompts/ids."""
    require_causal(cfg)
    settings = DecodeSettings(temperature=temperature, top_k=top_k, top_p=top_p, beam_width=beam_width,
                              length_penalty=length_penalty).check_vocab(cfg.vocab_size)
    return (settings, *_check_request(cfg, prompt_BT, max_new_tokens, prompt_lengths, eos_id, pad_id, seed))


def generate(params: Params, cfg: ModelConfig, prompt_BT, max_new_tokens: int, *, temperature=None, top_k=None,
             top_p=None, beam_width=None, length_penalty=None, eos_id=None, pad_id: int = 0, seed: int = 0,
             prompt_lengths=None, unroll_layers: bool = True, kernels=None) -> GenerationResult:
    """Continue each prompt by up to ``max_new_tokens`` tokens (M20 §13: select, append, repeat; stop on EOS).

    temperature=None is greedy; with a temperature the next token is drawn from q (temperature → top-k →
    top-p → renormalise, U19 §5); beam_width=W runs beam search (``length_penalty`` α ranks by Σlog p/len^α).
    Prompts of different lengths share a batch: right-pad them in ``prompt_BT`` and give ``prompt_lengths``.
    Raises ``ConfigError`` for invalid settings and ``InputError`` for invalid prompts or ids, before any work.

    ``unroll_layers`` (default True): decode steps run the blocks over per-layer weight arrays sliced once
    per call, instead of scanning the stacked weights (whose per-layer slices XLA copies every step; see
    ``forward_cached``). The prefill always scans. Results are identical; False compiles faster for deep models.
    ``kernels``: the execution paths (default the reference ones): the prompt's attention and every MoE layer.
    """
    settings, prompt, lengths = check_generation(cfg, prompt_BT, max_new_tokens, temperature=temperature,
                                                 top_k=top_k, top_p=top_p, beam_width=beam_width,
                                                 length_penalty=length_penalty, eos_id=eos_id, pad_id=pad_id,
                                                 seed=seed, prompt_lengths=prompt_lengths)
    static = dict(cfg=cfg, max_new_tokens=int(max_new_tokens), eos_id=None if eos_id is None else int(eos_id),
                  pad_id=int(pad_id), unroll_layers=bool(unroll_layers), kernels=resolved(kernels))
    if settings.mode == "beam":
        return _beam_jit(params, prompt, lengths, settings=settings, **static)
    return _sample_jit(params, prompt, lengths, seed_key_data(seed), SamplingRows.of(settings), **static)
