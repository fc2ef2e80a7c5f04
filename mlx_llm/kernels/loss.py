"""The chunked loss: per-token cross-entropy of Λ = R U without ever holding the (B·T, V) logits.

M20 §8 gives the logits Λ = R U, M20 §10 the per-token loss −log p(x_t | x_<t) = logsumexp(Λ_t) − Λ_{t, x_t}.
For a large vocabulary the float32 logits and their gradient are the biggest arrays of a training step
(2 · B·T · V · 4 bytes), although every row of the loss needs only its own row of Λ. ``chunked_token_nll``
walks the flattened B·T rows in chunks of ``chunk`` rows: the forward keeps, per row, only the log-sum-exp ℓ;
the backward recomputes each chunk's logits and uses (M20 §11)

    ∂nll_t / ∂Λ_t = softmax(Λ_t) − onehot(x_t) = exp(Λ_t − ℓ_t) − onehot(x_t)

so dR = (g ⊙ (P − Y)) Uᵀ per chunk and dU = Σ_chunks Rᵀ (g ⊙ (P − Y)), accumulated in float32 (float64 in
tests). What is live at any time is one (chunk, V) tile, never (B·T, V). Chunk k takes every n_chunks-th
row from k on, so that under batch sharding every chunk holds rows of every device. The products use the same
dtypes as ``ops.dense`` and its JAX transpose (inputs in their own dtype, float32 accumulation), so a bfloat16
run does the same arithmetic through either path.

No vocabulary tile: each chunk still spans all V columns (``choose_chunk`` sizes the rows so that is small).

With a soft cap c (Gemma 2's final-logit soft-capping) the logits are Λ = c·tanh(R U/c), and the backward
multiplies the logits' gradient by ∂Λ/∂(RU) = 1 − (Λ/c)² before the two products.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from mlx_llm.errors import InputError

_ROWS = (((0,), (0,)), ((), ()))  # contract the row axis of both operands: Rᵀ G
_COLS = (((1,), (1,)), ((), ()))  # contract the vocabulary axis of both operands: G Uᵀ


def _acc_dtype(r_dtype) -> jnp.dtype:
    return jnp.promote_types(r_dtype, jnp.float32)


def _chunk_logits(r_cD, u_DV, cap=None):
    """Λ_c = R_c U for one chunk of rows, accumulated in ≥ float32 like ``model.logits_from_hidden`` (c·tanh(·/c)
    of it under a soft cap c)."""
    logits_cV = jnp.matmul(r_cD, u_DV, preferred_element_type=_acc_dtype(r_cD.dtype))
    return logits_cV if cap is None else cap * jnp.tanh(logits_cV / cap)


def _chunk_nll_lse(r_cD, u_DV, y_c, cap=None):
    """(nll_c, ℓ_c) of one chunk: ℓ = m + log Σ exp(Λ − m) with the row maximum m shifted out (M20 §9)."""
    logits_cV = _chunk_logits(r_cD, u_DV, cap)
    m_c = jnp.max(logits_cV, axis=-1)
    lse_c = m_c + jnp.log(jnp.sum(jnp.exp(logits_cV - m_c[:, None]), axis=-1))
    picked_c = jnp.take_along_axis(logits_cV, y_c[:, None], axis=-1)[:, 0]
    return lse_c - picked_c, lse_c


def _forward(r_CcD, u_DV, y_Cc, cap=None):
    """Per-chunk loop of the forward; returns (nll_Cc, lse_Cc)."""
    return jax.lax.map(lambda xs: _chunk_nll_lse(xs[0], u_DV, xs[1], cap), (r_CcD, y_Cc))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _blocked_nll(r_CcD, u_DV, y_Cc, cap=None):
    return _forward(r_CcD, u_DV, y_Cc, cap)


def _blocked_fwd(r_CcD, u_DV, y_Cc, cap=None):
    nll_Cc, lse_Cc = _forward(r_CcD, u_DV, y_Cc, cap)
    return (nll_Cc, lse_Cc), (r_CcD, u_DV, y_Cc, lse_Cc)  # the residuals: no logits


def _chunk_dlogits(r_cD, u_DV, y_c, lse_c, g_c, g_lse_c, cap=None):
    """g ⊙ (softmax(Λ_c) − onehot(x)) + g_ℓ ⊙ softmax(Λ_c) for one chunk (∂ℓ/∂Λ = softmax: the z-loss's path),
    from the recomputed logits and the saved ℓ (M20 §11); under a soft cap, × (1 − (Λ/c)²), the gradient with
    respect to the uncapped R U."""
    logits_cV = _chunk_logits(r_cD, u_DV, cap)
    p_cV = jnp.exp(logits_cV - lse_c[:, None])
    onehot_cV = y_c[:, None] == jnp.arange(u_DV.shape[1], dtype=y_c.dtype)[None, :]
    g_cV = p_cV * (g_c + g_lse_c)[:, None] - onehot_cV.astype(p_cV.dtype) * g_c[:, None]
    return g_cV if cap is None else g_cV * (1 - jnp.square(logits_cV / cap))


def _blocked_bwd(cap, res, cotangents):
    r_CcD, u_DV, y_Cc, lse_Cc = res
    g_Cc, g_lse_Cc = cotangents
    acc = _acc_dtype(r_CcD.dtype)

    def step(du_DV, xs):
        r_cD, y_c, lse_c, g_c, g_lse_c = xs
        dlogits_cV = _chunk_dlogits(r_cD, u_DV, y_c, lse_c, g_c.astype(acc), g_lse_c.astype(acc), cap)
        # mixed-dtype products, as JAX transposes dense(…, preferred_element_type=acc): no upcast copy of U
        dr_cD = jax.lax.dot_general(dlogits_cV, u_DV, _COLS, preferred_element_type=acc).astype(r_cD.dtype)
        du_DV = du_DV + jax.lax.dot_general(r_cD, dlogits_cV, _ROWS, preferred_element_type=acc)
        return du_DV, dr_cD

    du_DV, dr_CcD = jax.lax.scan(step, jnp.zeros(u_DV.shape, acc), (r_CcD, y_Cc, lse_Cc, g_Cc, g_lse_Cc))
    return dr_CcD, du_DV.astype(u_DV.dtype), None  # integer targets have no cotangent


_blocked_nll.defvjp(_blocked_fwd, _blocked_bwd)


def _check(r_BTD, u_DV, targets_BT, chunk) -> None:
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise InputError(f"chunk must be a positive number of rows; got {chunk!r}")
    if u_DV.ndim != 2 or r_BTD.shape[-1] != u_DV.shape[0]:
        raise InputError(f"r (…, D) and U (D, V) do not match: r has shape {r_BTD.shape}, U has {u_DV.shape}")
    if tuple(targets_BT.shape) != tuple(r_BTD.shape[:-1]):
        raise InputError(f"targets must have r's leading shape {r_BTD.shape[:-1]}; got {targets_BT.shape}")
    if not jnp.issubdtype(targets_BT.dtype, jnp.integer):
        raise InputError(f"targets must be integer token ids; got dtype {targets_BT.dtype}")


def chunked_token_nll(r_BTD: jax.Array, u_DV: jax.Array, targets_BT: jax.Array, *, chunk: int) -> jax.Array:
    """Per-token surprise logsumexp(Λ_t) − Λ_{t, x_t} with Λ = R U (M20 §8, §10), ``chunk`` rows at a time.

    Equals ``token_nll(dense(r, U, preferred_element_type=acc), targets)`` (acc = promote(r.dtype, float32))
    in value and gradient (w.r.t. r and U; U may be ``embed.T``), while only (chunk, V) tiles of the logits
    ever exist, forward or backward. The flattened B·T rows are padded up to a whole number of chunks (the
    padded rows get a zero cotangent, so they add nothing to dU) and dealt to the chunks in turn.
    """
    return chunked_token_nll_lse(r_BTD, u_DV, targets_BT, chunk=chunk)[0]


def chunked_token_nll_lse(r_BTD: jax.Array, u_DV: jax.Array, targets_BT: jax.Array, *,
                          chunk: int, cap: float | None = None) -> tuple[jax.Array, jax.Array]:
    """(nll, ℓ) of ``chunked_token_nll``, with ℓ_t = logsumexp(Λ_t) differentiable too (PaLM's z-loss
    penalises ℓ²): both from the same chunks, the backward adding ∂/∂ℓ · softmax(Λ_t) to each chunk's logits
    gradient. ``cap`` c: the logits are c·tanh(R U/c) (``ModelConfig.logit_softcap``)."""
    _check(r_BTD, u_DV, targets_BT, chunk)
    lead, d = r_BTD.shape[:-1], r_BTD.shape[-1]
    r_ND = r_BTD.reshape(-1, d)
    y_N = targets_BT.reshape(-1).astype(jnp.int32)
    n = r_ND.shape[0]
    chunk = min(chunk, max(n, 1))  # a chunk longer than the input would only add padding
    n_chunks = -(-n // chunk)
    pad = n_chunks * chunk - n
    # Chunk k holds rows k, k + n_chunks, k + 2·n_chunks, …: with the rows split over devices (batch sharding)
    # every chunk then spans all devices, so the loop over chunks runs on each device's own rows. Contiguous
    # chunks would make the loop walk across devices and XLA gather R onto every device.
    r_CcD = jnp.pad(r_ND, ((0, pad), (0, 0))).reshape(chunk, n_chunks, d).transpose(1, 0, 2)
    y_Cc = jnp.pad(y_N, (0, pad)).reshape(chunk, n_chunks).T
    nll_Cc, lse_Cc = _blocked_nll(r_CcD, u_DV, y_Cc, cap)
    return tuple(a.T.reshape(-1)[:n].reshape(lead) for a in (nll_Cc, lse_Cc))


def choose_chunk(n_rows: int, vocab: int, target_bytes: int = 256 * 2**20) -> int:
    """Rows per chunk whose (chunk, V) float32 tile is about ``target_bytes`` (for ``--loss-chunk auto``).

    At least 1 and at most ``n_rows``. Above 8 rows it is a multiple of 8, and the rows are spread evenly over
    the chunks that the budget needs, so the last chunk pads as little as possible.
    """
    if n_rows < 1 or vocab < 1 or target_bytes < 1:
        raise InputError(f"choose_chunk needs positive sizes; got n_rows={n_rows}, vocab={vocab}, "
                         f"target_bytes={target_bytes}")
    budget = max(1, target_bytes // (4 * vocab))
    if budget >= n_rows:
        return n_rows
    if budget < 8:
        return budget
    n_chunks = -(-n_rows // (budget // 8 * 8))
    even = -(-n_rows // n_chunks)
    return min(n_rows, -(-even // 8) * 8)
