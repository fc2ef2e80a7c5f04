"""Logits → token rules (M20 §13, U19 §4–§5): greedy, temperature, top-k, top-p, renormalise, draw; beam steps.

Every rule is a pure function of a logits array (last axis = vocabulary), in at least float32 (float64 in
tests). The decoding distribution is built in the order of U19 §5 — temperature → top-k → top-p →
renormalise — and is returned as log q, with −inf for excluded tokens:

    q(v | x_<t) = 1[v ∈ K] exp(λ_v/τ) / Σ_{u ∈ K} exp(λ_u/τ)          (M20 §13)

Greedy (argmax) is its own rule, never temperature 0 (M20 §13). Ties at a cut are kept together: top-k keeps
every token whose logit equals the k-th largest, top-p every token as probable as the last one it needs, so
the kept set is a function of the values alone, never of token order.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from mlx_llm.errors import ConfigError


# ----- settings ------------------------------------------------------------------------------------
def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
    """How the next token is chosen; hashable, so it is a static argument of the jitted decoder.

    ``temperature=None`` and no beam: greedy. ``beam_width``: beam search (deterministic, so no sampling
    settings). ``length_penalty`` α ranks beams by (Σ log p)/len^α (0 = raw sum; beams only).
    """

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    beam_width: int | None = None
    length_penalty: float | None = None

    def __post_init__(self) -> None:
        t, k, p = self.temperature, self.top_k, self.top_p
        if t is not None and not (_is_real(t) and math.isfinite(t) and t > 0):
            raise ConfigError(
                f"temperature = {t!r} is invalid: it must be a finite number > 0; for argmax decoding leave it "
                f"unset (greedy is its own rule, not temperature 0, M20 §13)")
        if k is not None and not (_is_int(k) and k >= 1):
            raise ConfigError(f"top_k = {k!r} is invalid: it must be an integer ≥ 1 (or unset for no top-k cut)")
        if p is not None and not (_is_real(p) and 0 < p <= 1):
            raise ConfigError(f"top_p = {p!r} is invalid: it must be a number in (0, 1] (or unset for no top-p cut)")
        self._check_beam()
        if t is None and self.beam_width is None and (k is not None or p is not None):
            raise ConfigError(
                f"top_k = {k!r} / top_p = {p!r} cut the sampling distribution, but temperature is unset, which means "
                f"greedy decoding; pass a temperature (1.0 samples from the model's own distribution)")
        if t is not None:  # normalise so equal settings hash equally
            object.__setattr__(self, "temperature", float(t))
        if p is not None:
            object.__setattr__(self, "top_p", float(p))
        if k is not None:
            object.__setattr__(self, "top_k", int(k))

    def _check_beam(self) -> None:
        w, a = self.beam_width, self.length_penalty
        if w is not None and not (_is_int(w) and w >= 1):
            raise ConfigError(f"beam_width = {w!r} is invalid: it must be an integer ≥ 1 (1 is greedy)")
        if a is not None and not (_is_real(a) and math.isfinite(a)):
            raise ConfigError(f"length_penalty = {a!r} is invalid: it must be a finite number (0 = no normalisation)")
        if a is not None and w is None:
            raise ConfigError(f"length_penalty = {a!r} only applies to beam search; set beam_width too")
        if w is not None:
            given = {n: v for n, v in (("temperature", self.temperature), ("top_k", self.top_k),
                                       ("top_p", self.top_p)) if v is not None}
            if given:
                raise ConfigError(
                    f"beam search (beam_width = {w}) is deterministic and cannot be combined with sampling settings "
                    f"{given}; use either beam_width or temperature/top_k/top_p")
            object.__setattr__(self, "beam_width", int(w))
            object.__setattr__(self, "length_penalty", float(a or 0.0))

    @property
    def mode(self) -> str:
        """'beam', 'greedy' or 'sample'."""
        if self.beam_width is not None:
            return "beam"
        return "greedy" if self.temperature is None else "sample"

    def check_vocab(self, vocab_size: int) -> "DecodeSettings":
        """Settings that depend on V: top-k cannot keep more tokens than exist."""
        if self.top_k is not None and self.top_k > vocab_size:
            raise ConfigError(
                f"top_k = {self.top_k} is larger than the vocabulary (V = {vocab_size}); use 1 … {vocab_size}")
        return self


# ----- the rules, each a pure function of logits ---------------------------------------------------
def _acc(x: jax.Array) -> jax.Array:
    x = jnp.asarray(x)
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def greedy(logits_BV: jax.Array) -> jax.Array:
    """M20 §13: pick a maximum-probability token (the first one when several tie)."""
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)


def apply_temperature(logits_BV: jax.Array, temperature: float) -> jax.Array:
    """U19 §4: λ/τ — every probability ratio e^{gap} becomes e^{gap/τ}; the order never changes."""
    return _acc(logits_BV) / temperature


def top_k_mask(logits_BV: jax.Array, k: int) -> jax.Array:
    """U19 §5 top-k: True for the k largest logits (and anything tied with the k-th), False elsewhere."""
    kth_B1 = jax.lax.top_k(logits_BV, k)[0][..., k - 1 : k]
    return logits_BV >= kth_B1


def top_p_mask(logits_BV: jax.Array, p: float) -> jax.Array:
    """U19 §5 nucleus: the fewest top tokens whose probability mass reaches p (plus ties of the last one).

    Sorted descending, token i is needed iff the mass strictly before it is < p. The comparison allows a
    few ulps of rounding, so a mass that reaches p exactly on paper (0.5 + 0.25 = 0.75) also does here.
    p = 1 keeps every token.
    """
    if p >= 1.0:
        return jnp.ones(logits_BV.shape, bool)
    probs_BV = jax.nn.softmax(_acc(logits_BV), axis=-1)
    sorted_BV = -jnp.sort(-probs_BV, axis=-1)
    before_BV = jnp.cumsum(sorted_BV, axis=-1) - sorted_BV
    tol = 8 * jnp.finfo(probs_BV.dtype).eps
    n_B1 = jnp.maximum(jnp.sum(before_BV < p - tol, axis=-1, keepdims=True), 1)  # the top token is always kept
    cut_B1 = jnp.take_along_axis(sorted_BV, n_B1 - 1, axis=-1)
    return probs_BV >= cut_B1


def renormalise(logits_BV: jax.Array, keep_BV: jax.Array) -> jax.Array:
    """U19 §5: q_i = p_i / Σ_{j∈S} p_j on the kept set S, 0 elsewhere — returned as log q (−inf off S)."""
    masked_BV = jnp.where(keep_BV, _acc(logits_BV), -jnp.inf)
    return jax.nn.log_softmax(masked_BV, axis=-1)


@flax.struct.dataclass
class SamplingRows:
    """Sampling settings as data, one value per row (or one for all rows: scalars broadcast), so one compiled
    decoder serves every setting and every mix of settings in a batch.

    temperature: τ > 0 samples, 0 is greedy (argmax, its own rule, M20 §13). top_k: k ≥ 1 keeps the k largest
    logits, 0 cuts nothing. top_p: the nucleus mass in (0, 1]; 1 cuts nothing. Built from validated
    ``DecodeSettings`` by ``of``; the arrays are in the default float width (float64 under x64), so a setting
    means the same number as the Python float it came from.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array

    @classmethod
    def of(cls, settings) -> "SamplingRows":
        """The rows of one ``DecodeSettings`` (scalars, shared by every row) or of a sequence of them (one row
        each). Beam search's settings are greedy here (a deterministic search)."""
        many = not isinstance(settings, DecodeSettings)
        rows = list(settings) if many else [settings]
        t = [s.temperature if s.mode == "sample" else 0.0 for s in rows]
        k = [s.top_k or 0 if s.mode == "sample" else 0 for s in rows]
        p = [s.top_p if s.mode == "sample" and s.top_p is not None else 1.0 for s in rows]
        pick = (lambda x: x) if many else (lambda x: x[0])
        return cls(temperature=jnp.asarray(pick(t), float), top_k=jnp.asarray(pick(k), jnp.int32),
                   top_p=jnp.asarray(pick(p), float))


def _per_row(x: jax.Array, like_BV: jax.Array) -> jax.Array:
    """A row setting (scalar or one per row) against a (…, V) logits array: (…, 1)."""
    return jnp.broadcast_to(jnp.asarray(x), like_BV.shape[:-1])[..., None]


def top_k_rows(logits_BV: jax.Array, k_B) -> jax.Array:
    """``top_k_mask`` with k per row (0: keep every token): the k-th largest value read off a sorted copy."""
    k_B1 = _per_row(k_B, logits_BV)
    sorted_BV = -jnp.sort(-logits_BV, axis=-1)
    kth_B1 = jnp.take_along_axis(sorted_BV, jnp.maximum(k_B1, 1) - 1, axis=-1)
    return (logits_BV >= kth_B1) | (k_B1 == 0)


def top_p_rows(logits_BV: jax.Array, p_B) -> jax.Array:
    """``top_p_mask`` with p per row (p ≥ 1 keeps every token)."""
    p_B1 = _per_row(p_B, logits_BV)
    probs_BV = jax.nn.softmax(_acc(logits_BV), axis=-1)
    sorted_BV = -jnp.sort(-probs_BV, axis=-1)
    before_BV = jnp.cumsum(sorted_BV, axis=-1) - sorted_BV
    tol = 8 * jnp.finfo(probs_BV.dtype).eps
    n_B1 = jnp.maximum(jnp.sum(before_BV < p_B1 - tol, axis=-1, keepdims=True), 1)
    cut_B1 = jnp.take_along_axis(sorted_BV, n_B1 - 1, axis=-1)
    return (probs_BV >= cut_B1) | (p_B1 >= 1.0)


def rows_logprobs(logits_BV: jax.Array, rows: SamplingRows) -> jax.Array:
    """log q of each row's decoding distribution: temperature → top-k → top-p → renormalise (U19 §5, M20 §13);
    a greedy row (τ = 0) puts all mass on its argmax (log q = 0 there). The cuts cost a sort of the vocabulary,
    so they run only when some row asks for one, and a batch of greedy rows builds no sampling distribution."""
    acc_BV = _acc(logits_BV)
    t_B1 = _per_row(rows.temperature, acc_BV)
    greedy_B1 = t_B1 == 0
    hot_BV = jnp.where(jax.nn.one_hot(greedy(logits_BV), logits_BV.shape[-1], dtype=bool), 0.0,
                       -jnp.inf).astype(acc_BV.dtype)

    def sampled():
        scaled_BV = acc_BV / jnp.where(greedy_B1, 1.0, t_B1).astype(acc_BV.dtype)
        everything_BV = jnp.ones(scaled_BV.shape, bool)
        keep_BV = jax.lax.cond(jnp.any(jnp.asarray(rows.top_k) > 0), lambda: top_k_rows(scaled_BV, rows.top_k),
                               lambda: everything_BV)
        keep_BV = jax.lax.cond(jnp.any(jnp.asarray(rows.top_p) < 1.0),
                               lambda: keep_BV & top_p_rows(jnp.where(keep_BV, scaled_BV, -jnp.inf), rows.top_p),
                               lambda: keep_BV)
        return renormalise(scaled_BV, keep_BV)

    # an all-greedy batch (generate's default, a greedy benchmark) skips the distribution it would not use
    sampled_BV = jax.lax.cond(jnp.all(greedy_B1), lambda: hot_BV, sampled)
    return jnp.where(greedy_B1, hot_BV, sampled_BV)


def choose_rows(key: jax.Array, logits_BV: jax.Array, rows: SamplingRows):
    """The next token per row and its log q: argmax for a greedy row, a draw from q for a sampling row (one draw
    over the whole batch with ``key``, made only when some row samples)."""
    logq_BV = rows_logprobs(logits_BV, rows)
    greedy_B = _per_row(rows.temperature, logits_BV)[..., 0] == 0
    argmax_B = greedy(logits_BV)
    drawn_B = jax.lax.cond(jnp.all(greedy_B), lambda: argmax_B, lambda: draw(key, logq_BV))
    tok_B = jnp.where(greedy_B, argmax_B, drawn_B)
    return tok_B, jnp.take_along_axis(logq_BV, tok_B[..., None], axis=-1)[..., 0]


def reply_keys(seeds_R2, reply_R, t_R) -> jax.Array:
    """The PRNG key of each row's next token (DESIGN §8): ``fold_in(fold_in(key(seed), reply), t)`` from the row's
    request seed (its two uint32 words, ``ops.seed_key_data``), its index among the request's n replies and the
    index t of the token in its reply — never from the batch the row happens to share."""
    def one(seed_2, reply, t):
        key = jax.random.wrap_key_data(seed_2, impl="threefry2x32")
        return jax.random.fold_in(jax.random.fold_in(key, reply), t)

    return jax.vmap(one)(jnp.asarray(seeds_R2, jnp.uint32), jnp.asarray(reply_R, jnp.int32), jnp.asarray(t_R, jnp.int32))


def prompt_seed(seed: int, i: int) -> int:
    """The request seed of prompt ``i`` of a batch sampled with ``seed``: a hash of (seed, i) in [0, 2**63), so the
    prompts of one call draw independent noise (the key rule of ``reply_keys`` reads the request seed, the reply
    index and t only) and a prompt's reply does not depend on the batch it was sent in, only on (seed, i)."""
    state = np.random.SeedSequence([int(seed), int(i)]).generate_state(2, np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


def choose_keyed(keys_R, logits_BV: jax.Array, rows: SamplingRows, ban_BV: jax.Array | None = None):
    """``choose_rows`` with one key per row (``reply_keys``): row b's draw reads its own key only, so its token does
    not depend on the other rows of the batch. Returns (tokens, log q, log of the kept mass): the mass of
    p_τ (the model at the row's temperature; 1 for a greedy row) that the row's top-k and top-p keep, so
    log q = log p_τ − log mass on every kept token. ``ban_BV`` (True: never drawn) takes tokens out of q before
    top-k and top-p (the engine's ``min_tokens``); the kept mass is then of the unbanned p_τ."""
    free_BV = logits_BV if ban_BV is None else jnp.where(ban_BV, -jnp.inf, logits_BV)
    logq_BV = rows_logprobs(free_BV, rows)
    greedy_B = _per_row(rows.temperature, logits_BV)[..., 0] == 0
    argmax_B = greedy(free_BV)
    one = lambda key, logq_V: jax.random.categorical(key, logq_V).astype(jnp.int32)
    drawn_B = jax.lax.cond(jnp.all(greedy_B), lambda: argmax_B, lambda: jax.vmap(one)(keys_R, logq_BV))
    tok_B = jnp.where(greedy_B, argmax_B, drawn_B)
    logq_B = jnp.take_along_axis(logq_BV, tok_B[:, None], axis=-1)[:, 0]
    t_B1 = jnp.where(greedy_B, 1.0, _per_row(rows.temperature, logits_BV)[..., 0])[:, None]
    logpt_BV = jax.nn.log_softmax(_acc(logits_BV) / t_B1.astype(logq_BV.dtype), axis=-1)
    logpt_B = jnp.take_along_axis(logpt_BV, tok_B[:, None], axis=-1)[:, 0]
    return tok_B, logq_B, logpt_B - logq_B  # greedy: log q = 0, the kept mass is p(argmax)


def decoding_logprobs(logits_BV: jax.Array, settings: DecodeSettings) -> jax.Array:
    """log q of the decoding distribution: temperature → top-k → top-p → renormalise (U19 §5, M20 §13).

    Greedy (and beam search, a deterministic search) put all mass on the argmax: log q = 0 there. The rules of
    ``rows_logprobs`` with one setting for every row.
    """
    return rows_logprobs(logits_BV, SamplingRows.of(settings))


def draw(key: jax.Array, logq_BV: jax.Array) -> jax.Array:
    """Draw one token per row from q (given as log q) with a JAX PRNG key."""
    return jax.random.categorical(key, logq_BV, axis=-1).astype(jnp.int32)


def choose(key: jax.Array, logits_BV: jax.Array, settings: DecodeSettings):
    """The next token per row and its log q: argmax for greedy, a draw from q when sampling (``choose_rows``)."""
    return choose_rows(key, logits_BV, SamplingRows.of(settings))


# ----- beam search: one selection step ------------------------------------------------------------
def beam_rank(score, length, alpha: float):
    """Beam ranking score (Σ log p)/len^α (α = 0: the raw log-probability; Wu et al. 2016 normalise by length)."""
    if alpha == 0.0:
        return score
    return score / jnp.maximum(length, 1).astype(score.dtype) ** alpha


def beam_step(score_BW, length_BW, finished_BW, logp_BWV, *, eos_id, pad_id: int, alpha: float):
    """One step of standard beam search over W beams per row.

    Alive beams propose every extension (score + log p(v)); a finished beam proposes only itself, keeping its
    score and length (it emits ``pad_id``). The W best proposals by ``beam_rank`` survive.
    Returns (parent_BW, token_BW, score_BW, length_BW, finished_BW) of the survivors.
    """
    b, w, v = logp_BWV.shape
    alive_BW1 = ~finished_BW[..., None]
    stay_V = jnp.arange(v) == pad_id
    cand_BWV = jnp.where(alive_BW1, score_BW[..., None] + logp_BWV, jnp.where(stay_V, score_BW[..., None], -jnp.inf))
    cand_len_BWV = jnp.broadcast_to((length_BW + (~finished_BW).astype(length_BW.dtype))[..., None], (b, w, v))
    _, flat_BW = jax.lax.top_k(beam_rank(cand_BWV, cand_len_BWV, alpha).reshape(b, w * v), w)
    parent_BW, token_BW = flat_BW // v, (flat_BW % v).astype(jnp.int32)
    was_done_BW = jnp.take_along_axis(finished_BW, parent_BW, axis=1)
    new_score_BW = jnp.take_along_axis(cand_BWV.reshape(b, w * v), flat_BW, axis=1)
    new_len_BW = jnp.take_along_axis(cand_len_BWV.reshape(b, w * v), flat_BW, axis=1)
    done_BW = was_done_BW if eos_id is None else was_done_BW | (token_BW == eos_id)
    return parent_BW, token_BW, new_score_BW, new_len_BW, done_BW
