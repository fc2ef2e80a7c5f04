"""Losses and the five ways to report them (M20 §10, U19 §2).

All in at least float32 (float64 in tests), with max-shifted log-sum-exp (M20 §9).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from mlx_llm.errors import InputError
from mlx_llm.ops import token_nll


def check_loss_mask(mask_BT) -> None:
    """Reject an all-zero loss mask (M20 §10: the mean over no target is undefined)."""
    if isinstance(mask_BT, jax.core.Tracer):
        return  # traced: an empty mask gives 0/0 = NaN, which the training loop reports
    if not np.any(np.asarray(mask_BT)):
        raise InputError("the loss mask selects no target (sum of mask = 0): the mean loss is undefined (M20 §10)")


def _masked(b_BT, nll_BT):
    """b_t · nll_t, with a masked-out position (b_t = 0) giving exactly 0: where its target has probability 0 (a −∞
    logit, U19 §9's prompt token that the model never writes) nll_t = ∞, and 0 · ∞ would be NaN. ``where`` also
    sends that position a zero cotangent, so the gradient is finite too."""
    return jnp.where(b_BT != 0, b_BT * nll_BT, 0.0)


def masked_cross_entropy(logits_BTV: jax.Array, targets_BT: jax.Array, mask_BT: jax.Array) -> jax.Array:
    """M20 §10: L = −(1/n) Σ_t b_t log p(x_t | x_<t), n = Σ b_t over the whole batch (token-averaged).

    An all-zero mask raises ``InputError`` (the mean is undefined, M20 §10). A masked-out position adds exactly 0,
    in value and gradient, even where its target has probability 0 (``_masked``).
    """
    check_loss_mask(mask_BT)
    nll_BT = token_nll(logits_BTV, targets_BT)
    b_BT = jnp.asarray(mask_BT).astype(nll_BT.dtype)
    return jnp.sum(_masked(b_BT, nll_BT)) / jnp.sum(b_BT)


def sequence_log_likelihood(logits_BTV: jax.Array, targets_BT: jax.Array, mask_BT: jax.Array) -> jax.Array:
    """Per-sequence Σ_t b_t log p(x_t | x_<t) (M20 §10 chain rule; DPO's ℓ_θ(y | c), M20 §16), shape (B,); masked-out
    positions add exactly 0 (``_masked``)."""
    nll_BT = token_nll(logits_BTV, targets_BT)
    return -jnp.sum(_masked(jnp.asarray(mask_BT).astype(nll_BT.dtype), nll_BT), axis=-1)


def mtp_targets(targets_BT, mask_BT, segment_ids_BT, k: int):
    """The targets and loss mask of multi-token-prediction depth k (DeepSeek-V3's module k, ``model.mtp_hidden``):
    row t predicts x_{t+k+1} = ``targets[t+k]``, counted where that target is counted at its own position (mask
    at t + k), lies inside the window (t + k < T) and in row t's document (same segment id: packed documents
    never predict across a boundary). Returns (targets_k, mask_k), both (B, T); k = 0 gives the inputs back."""
    if k == 0:
        return targets_BT, mask_BT
    b, t = targets_BT.shape
    shift = lambda a: jnp.pad(a[:, k:], ((0, 0), (0, min(k, t))))[:, :t]  # noqa: E731
    keep_BT = jnp.arange(t)[None, :] + k < t
    if segment_ids_BT is not None:
        keep_BT = keep_BT & (shift(segment_ids_BT) == segment_ids_BT)
    mask_k = jnp.where(keep_BT, shift(jnp.asarray(mask_BT)), 0).astype(jnp.asarray(mask_BT).dtype)
    return shift(targets_BT), mask_k


def perplexity(loss_nats):
    """e^L: the die with this many faces (U19 §2)."""
    return jnp.exp(loss_nats)


def bits_per_token(loss_nats):
    """L / ln 2 (U19 §2)."""
    return loss_nats / math.log(2.0)


def bits_per_byte(total_nll_nats, n_bytes):
    """Total surprise of a text in bits divided by its UTF-8 byte count: comparable across tokenizers (for the
    diffusion NELBO, an upper bound on the NLL, an upper bound on the code length)."""
    if not n_bytes > 0:
        raise InputError(f"n_bytes = {n_bytes!r} is invalid: bits per byte needs a positive byte count")
    return total_nll_nats / (math.log(2.0) * n_bytes)
