"""The public decoding steps (M20 §13–§14): ``prefill`` a batch of prompts, ``step`` every row by one token.

Everything that produces tokens is a loop over these two: ``generate`` scans ``step`` inside one jitted call, and a
Python loop (a benchmark, an engine) calls the jitted ``step`` once per token with the state donated, so the
cache is updated in place. Sampling settings are data (``SamplingRows``: a temperature, top-k and top-p per row,
or one for all), never static arguments: one compile serves every setting and every mix of them in a batch.

- ``prefill(params, state, tokens_BT, n_new_B, cfg=…)``: the first ``n_new_B[b]`` tokens of row b into its state;
  returns the logits (B, V) of each row's last real token — what the next token is chosen from — and the state.
  ``prefill`` is ``fill`` jitted with the state donated.
- ``sample(key, logits_BV, rows)``: each row's next token, its log q (the distribution it was drawn from, after
  temperature, top-k and top-p) and its log p (the model, temperature 1).
- ``step(params, state, tokens_B, active_B, rows, key, cfg=…)``: feed each active row its last token, then
  ``sample``; an inactive row neither advances nor changes (its outputs are meaningless). ``step`` is ``advance``
  jitted with the state donated; ``generate`` scans ``advance`` itself inside its own jitted call.

Logits rows of a padded vocabulary (ids ≥ ``cfg.vocab_used``) are −∞ in what ``prefill`` and ``step`` return, so
no token the tokenizer lacks is ever chosen and log q, log p are over the real tokens only.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from mlx_llm.config import ModelConfig
from mlx_llm.decode.sampling import SamplingRows, choose_rows
from mlx_llm.decode.state import DecodeState, forward_cached
from mlx_llm.kernels import attention_path
from mlx_llm.model import Params, resolved


class Picked(NamedTuple):
    """One step's choice per row: the token (B,), its log q and its log p (B,), in at least float32."""

    tokens: jax.Array
    logq: jax.Array
    logp: jax.Array


def tokens_only(logits_BxV, cfg: ModelConfig):
    """Logits with the padding rows of a padded vocabulary (ids ≥ ``cfg.vocab_used``) at −∞."""
    if cfg.vocab_used is None:
        return logits_BxV
    return jnp.where(jnp.arange(cfg.vocab_size) < cfg.vocab_used, logits_BxV, -jnp.inf)


def last_valid(logits_BTV, n_B):
    """The logits row of each row's last real token (M20 §2: row t−1 predicts x_t)."""
    return jnp.take_along_axis(logits_BTV, (n_B - 1)[:, None, None], axis=1)[:, 0]


def fill(params: Params, state: DecodeState, tokens_BT, n_new_B, *, cfg: ModelConfig, kernels=None,
         first: bool = True):
    """Prompt tokens (row b's first ``n_new_B[b]`` real, right padding after them) into ``state``.

    ``first`` (the state is empty): their attention is self-attention over the prompt, so a kernel path other than
    the reference runs it as such; the reference reads the cache (the decode steps always do). ``first=False``
    continues each row's prefix (a prompt fed in chunks): every path reads the cache. Returns (logits (B, V) of
    each row's last real token, the state). ``prefill`` is this, jitted with the state donated."""
    kernels = resolved(kernels)
    fresh = first and attention_path(kernels, tokens_BT.shape[1]) != "xla"
    logits_BTV, state = forward_cached(params, tokens_BT, state, cfg, n_new_B=n_new_B, kernels=kernels, fresh=fresh)
    return tokens_only(last_valid(logits_BTV, n_new_B), cfg), state


def sample(key, logits_BV, rows: SamplingRows) -> Picked:
    """Each row's next token by its settings (greedy rows: argmax), with its log q and log p."""
    tok_B, logq_B = choose_rows(key, logits_BV, rows)
    logp_BV = jax.nn.log_softmax(logits_BV.astype(logq_B.dtype), axis=-1)
    return Picked(tok_B, logq_B, jnp.take_along_axis(logp_BV, tok_B[:, None], axis=-1)[:, 0])


def step_logits(params: Params, state: DecodeState, tokens_B, active_B, *, cfg: ModelConfig, layers=None,
                kernels=None):
    """Each active row's last token into its state; (the logits (B, V) it predicts, the state)."""
    logits_B1V, state = forward_cached(params, tokens_B[:, None], state, cfg, n_new_B=active_B.astype(jnp.int32),
                                       layers=layers, kernels=kernels)
    return tokens_only(logits_B1V[:, 0], cfg), state


def advance(params: Params, state: DecodeState, tokens_B, active_B, rows: SamplingRows, key, *, cfg: ModelConfig,
            layers=None, kernels=None):
    """One decoding step of every row: each active row's last token ``tokens_B`` goes into ``state`` and its next
    token is chosen by ``rows`` with ``key``. Returns (``Picked``, the state). ``step`` is this, jitted with the
    state donated (updated in place); ``generate`` scans it. ``layers``: ``decode.state.unstack_layers(params,
    cfg)``, made once outside the loop (XLA:CPU otherwise copies each layer's weights out of the stack on every
    step; ``forward_cached``). ``kernels``: the MoE layers' execution paths (resolved)."""
    logits_BV, state = step_logits(params, state, tokens_B, active_B, cfg=cfg, layers=layers, kernels=kernels)
    return sample(key, logits_BV, rows), state


prefill = jax.jit(fill, static_argnames=("cfg", "kernels", "first"), donate_argnames="state")
step = jax.jit(advance, static_argnames=("cfg", "kernels"), donate_argnames="state")
