"""FlashAttention-2 (Dao 2023, "FlashAttention-2: Faster Attention with Better Parallelism and Work
Partitioning", Algorithms 1 and 2) in pure JAX: M20 §6's GQA attention S_j = Q̃_j K̃_g(j)ᵀ/√d_h + M,
A_j = softmax_row(S_j), O_j = A_j V_g(j), computed one (query block, key block) tile at a time, so memory is
O(T·block): no (T, S) score tensor and no (B, T, T) mask exists, forward or backward.

The mask M is built per tile from segment ids (packed documents never read each other, M20 §2) and
positions (causal: key ≤ query; bidirectional for the denoiser, M20 §19). Under the causal mask query block
i reads key blocks 0 … i only and, in the backward, key block j receives from query blocks j … n−1, so the
loops have block-dependent trip counts and the work is n(n+1)/2 tiles, not n².

Extra shape letters (DESIGN §3 plus): U query blocks, W key blocks, C positions of a query block (c_q),
E keys of a key block (c_k), M = R·C rows of a query block: the R query heads of key/value head g stacked,
as in ``ops.attention``, so K/V are never repeated per query head.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from mlx_llm.errors import InputError

_ROW_ALIGN = 8  # short windows round their block up to a multiple of this (the f32 sublane count)


def _accum_dtype(dtype) -> jnp.dtype:
    """The dtype of scores and softmax statistics, as in ``ops.attention``: float32, or float64 for float64."""
    return jnp.promote_types(dtype, jnp.float32)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The static tiling of one call (hashable: it is a non-differentiable argument of the custom VJP)."""

    t: int  # real positions; t … tp − 1 are padding
    tp: int
    cq: int
    ck: int
    causal: bool
    window: int | None = None  # sliding window W (causal only): query q reads keys q − W + 1 … q
    cap: float | None = None  # soft cap c of the scores: c·tanh(s/c)

    @property
    def nq(self) -> int:
        return self.tp // self.cq

    @property
    def nk(self) -> int:
        return self.tp // self.ck

    def key_block_end(self, i):
        """One past the last key block query block i reads: key block j holds keys j·c_k … and is read iff
        j·c_k ≤ (i+1)·c_q − 1, the block's last query."""
        if not self.causal:
            return self.nk
        return jnp.minimum(self.nk, ((i + 1) * self.cq + self.ck - 1) // self.ck)

    def key_block_start(self, i):
        """The first key block query block i reads: with a window, the one holding key i·c_q − W + 1."""
        if self.window is None:
            return 0
        return jnp.maximum(0, i * self.cq - self.window + 1) // self.ck

    def query_block_start(self, j):
        """The first query block that reads key block j (the converse of ``key_block_end``)."""
        return (j * self.ck) // self.cq if self.causal else 0

    def query_block_end(self, j):
        """One past the last query block that reads key block j: with a window, the last query that reads the
        block's last key (j+1)·c_k − 1 is (j+1)·c_k + W − 2."""
        if self.window is None:
            return self.nq
        return jnp.minimum(self.nq, ((j + 1) * self.ck + self.window - 2) // self.cq + 1)


def _plan(t: int, block_q: int, block_k: int, causal: bool, window: int | None = None,
          cap: float | None = None) -> _Plan:
    """Blocks of at most ``block_q`` / ``block_k`` positions; a window shorter than a block uses one block of
    t rounded up to ``_ROW_ALIGN``. The window is padded to a multiple of both blocks."""
    short = -(-t // _ROW_ALIGN) * _ROW_ALIGN
    cq, ck = min(block_q, short), min(block_k, short)
    step = math.lcm(cq, ck)
    return _Plan(t=t, tp=-(-t // step) * step, cq=cq, ck=ck, causal=causal, window=window, cap=cap)


def _tile_mask(plan: _Plan, i, j, seg_q_BC, seg_k_BE, win) -> jax.Array:
    """M of tile (i, j) as booleans (True = may read). Padding keys are readable by padding queries only, so
    every row, real or padding, reads at least one key (itself) and its softmax is defined. ``win``: the window
    in force (a traced int ≤ ``plan.window``: the window warmup), read only when the plan has a window."""
    q_pos_C = i * plan.cq + jnp.arange(plan.cq)
    k_pos_E = j * plan.ck + jnp.arange(plan.ck)
    allowed_CE = (q_pos_C[:, None] < plan.t) == (k_pos_E[None, :] < plan.t)
    if plan.causal:
        allowed_CE &= k_pos_E[None, :] <= q_pos_C[:, None]
    if plan.window is not None:  # padding rows keep reading themselves (the window holds the diagonal)
        allowed_CE &= q_pos_C[:, None] - k_pos_E[None, :] < win
    return allowed_CE & (seg_q_BC[:, :, None] == seg_k_BE[:, None, :])


def _tile_raw(q_BGMK, k_BGEK) -> jax.Array:
    """Q Kᵀ/√d_h on one tile, in the accumulation dtype (before any cap or mask)."""
    acc = _accum_dtype(q_BGMK.dtype)
    scale = 1.0 / jnp.sqrt(jnp.asarray(q_BGMK.shape[-1], acc))
    return jnp.einsum("bgmk,bgek->bgme", q_BGMK, k_BGEK, preferred_element_type=acc) * scale


def _tile_scores(plan: _Plan, q_BGMK, k_BGEK, mask_BCE) -> jax.Array:
    """S = Q Kᵀ/√d_h on one tile in the accumulation dtype (soft-capped to c·tanh(S/c) under ``plan.cap``);
    masked scores are −∞ so exp gives exactly 0."""
    b, g, m, kd = q_BGMK.shape
    s_BGME = _tile_raw(q_BGMK, k_BGEK)
    if plan.cap is not None:
        s_BGME = plan.cap * jnp.tanh(s_BGME / plan.cap)
    s_BGRCE = s_BGME.reshape(b, g, m // plan.cq, plan.cq, -1)
    s_BGRCE = jnp.where(mask_BCE[:, None, None], s_BGRCE, -jnp.inf)
    return s_BGRCE.reshape(b, g, m, -1)


def _at(x, i):
    return lax.dynamic_index_in_dim(x, i, axis=0, keepdims=False)


def _query_block_forward(plan: _Plan, k_WBGEK, v_WBGEK, seg_k_WBE, win, i, q_BGMK, seg_q_BC):
    """FA-2 Algorithm 1 for query block i: online softmax over key blocks with running max m, running sum l
    and unnormalised output; returns O (input dtype) and the log-sum-exp L = m + log l (accumulation dtype)."""
    acc = _accum_dtype(q_BGMK.dtype)

    def step(j, carry):
        m_BGM, l_BGM, o_BGMK = carry
        v_BGEK = _at(v_WBGEK, j)
        s_BGME = _tile_scores(plan, q_BGMK, _at(k_WBGEK, j),
                              _tile_mask(plan, i, j, seg_q_BC, _at(seg_k_WBE, j), win))
        m_new_BGM = jnp.maximum(m_BGM, s_BGME.max(axis=-1))
        p_BGME = jnp.exp(s_BGME - m_new_BGM[..., None])
        alpha_BGM = jnp.exp(m_BGM - m_new_BGM)  # rescales what was summed under the old maximum
        pv_BGMK = jnp.einsum("bgme,bgek->bgmk", p_BGME.astype(v_BGEK.dtype), v_BGEK, preferred_element_type=acc)
        return m_new_BGM, alpha_BGM * l_BGM + p_BGME.sum(axis=-1), alpha_BGM[..., None] * o_BGMK + pv_BGMK

    # A finite start for m keeps m − m_new finite while a row has seen only masked keys.
    init = (jnp.full(q_BGMK.shape[:-1], jnp.finfo(acc).min, acc), jnp.zeros(q_BGMK.shape[:-1], acc),
            jnp.zeros(q_BGMK.shape, acc))
    m_BGM, l_BGM, o_BGMK = lax.fori_loop(plan.key_block_start(i), plan.key_block_end(i), step, init)
    return (o_BGMK / l_BGM[..., None]).astype(q_BGMK.dtype), m_BGM + jnp.log(l_BGM)


def _forward(plan: _Plan, q_UBGMK, k_WBGEK, v_WBGEK, seg_q_UBC, seg_k_WBE, win):
    block = functools.partial(_query_block_forward, plan, k_WBGEK, v_WBGEK, seg_k_WBE, win)
    return lax.map(lambda xs: block(*xs), (jnp.arange(plan.nq), q_UBGMK, seg_q_UBC))


def _key_block_backward(plan: _Plan, fixed, dq_UBGMK, xs):
    """FA-2 Algorithm 2 for key block j: recompute P = exp(S − L) of each query block that reads it,
    dV += Pᵀ dO, dP = dO Vᵀ, dS = P ⊙ (dP − D), dK += dSᵀ Q/√d_h, and add dS K/√d_h into dQ. Under a soft cap
    S = c·tanh(S₀/c), so dS₀ = dS ⊙ (1 − tanh²(S₀/c))."""
    q_UBGMK, do_UBGMK, lse_UBGM, d_UBGM, seg_q_UBC, win = fixed
    j, k_BGEK, v_BGEK, seg_k_BE = xs
    acc = _accum_dtype(q_UBGMK.dtype)
    scale = 1.0 / jnp.sqrt(jnp.asarray(q_UBGMK.shape[-1], acc))

    def step(i, carry):
        dk_BGEK, dv_BGEK, dq_UBGMK = carry
        q_BGMK, do_BGMK = _at(q_UBGMK, i), _at(do_UBGMK, i)
        s_BGME = _tile_scores(plan, q_BGMK, k_BGEK, _tile_mask(plan, i, j, _at(seg_q_UBC, i), seg_k_BE, win))
        p_BGME = jnp.exp(s_BGME - _at(lse_UBGM, i)[..., None])
        dv_BGEK += jnp.einsum("bgme,bgmk->bgek", p_BGME.astype(do_BGMK.dtype), do_BGMK, preferred_element_type=acc)
        dp_BGME = jnp.einsum("bgmk,bgek->bgme", do_BGMK, v_BGEK, preferred_element_type=acc)
        ds_BGME = p_BGME * (dp_BGME - _at(d_UBGM, i)[..., None]) * scale
        if plan.cap is not None:  # masked entries have P = 0, and the factor is finite everywhere
            ds_BGME = ds_BGME * (1 - jnp.square(jnp.tanh(_tile_raw(q_BGMK, k_BGEK) / plan.cap)))
        ds_BGME = ds_BGME.astype(q_BGMK.dtype)
        dk_BGEK += jnp.einsum("bgme,bgmk->bgek", ds_BGME, q_BGMK, preferred_element_type=acc)
        dq_BGMK = _at(dq_UBGMK, i) + jnp.einsum("bgme,bgek->bgmk", ds_BGME, k_BGEK, preferred_element_type=acc)
        return dk_BGEK, dv_BGEK, lax.dynamic_update_index_in_dim(dq_UBGMK, dq_BGMK, i, axis=0)

    zeros = jnp.zeros(k_BGEK.shape, acc)
    dk_BGEK, dv_BGEK, dq_UBGMK = lax.fori_loop(plan.query_block_start(j), plan.query_block_end(j), step,
                                               (zeros, zeros, dq_UBGMK))
    return dq_UBGMK, (dk_BGEK.astype(k_BGEK.dtype), dv_BGEK.astype(v_BGEK.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(plan: _Plan, q_UBGMK, k_WBGEK, v_WBGEK, seg_q_UBC, seg_k_WBE, win):
    return _forward(plan, q_UBGMK, k_WBGEK, v_WBGEK, seg_q_UBC, seg_k_WBE, win)[0]


def _flash_fwd(plan: _Plan, q_UBGMK, k_WBGEK, v_WBGEK, seg_q_UBC, seg_k_WBE, win):
    o_UBGMK, lse_UBGM = _forward(plan, q_UBGMK, k_WBGEK, v_WBGEK, seg_q_UBC, seg_k_WBE, win)
    return o_UBGMK, (q_UBGMK, k_WBGEK, v_WBGEK, seg_q_UBC, seg_k_WBE, win, o_UBGMK, lse_UBGM)


def _flash_bwd(plan: _Plan, residuals, do_UBGMK):
    q_UBGMK, k_WBGEK, v_WBGEK, seg_q_UBC, seg_k_WBE, win, o_UBGMK, lse_UBGM = residuals
    acc = _accum_dtype(q_UBGMK.dtype)
    d_UBGM = jnp.sum(do_UBGMK.astype(acc) * o_UBGMK.astype(acc), axis=-1)  # D = rowsum(dO ⊙ O)
    fixed = (q_UBGMK, do_UBGMK.astype(q_UBGMK.dtype), lse_UBGM, d_UBGM, seg_q_UBC, win)
    dq_UBGMK, (dk_WBGEK, dv_WBGEK) = lax.scan(
        functools.partial(_key_block_backward, plan, fixed), jnp.zeros(q_UBGMK.shape, acc),
        (jnp.arange(plan.nk), k_WBGEK, v_WBGEK, seg_k_WBE))
    return dq_UBGMK.astype(q_UBGMK.dtype), dk_WBGEK, dv_WBGEK, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _query_blocks(x_BTHK, g: int, cq: int) -> jax.Array:
    """(B, T, H, K) → (U, B, G, M, K), row m = r·C + c of block u being head g·R + r at position u·C + c."""
    b, t, h, kd = x_BTHK.shape
    x = x_BTHK.reshape(b, t // cq, cq, g, h // g, kd).transpose(1, 0, 3, 4, 2, 5)
    return x.reshape(t // cq, b, g, (h // g) * cq, kd)


def _from_query_blocks(o_UBGMK, cq: int) -> jax.Array:
    u, b, g, m, kd = o_UBGMK.shape
    o = o_UBGMK.reshape(u, b, g, m // cq, cq, kd).transpose(1, 0, 4, 2, 3, 5)
    return o.reshape(b, u * cq, g * (m // cq), kd)


def _key_blocks(x_BTGK, ck: int) -> jax.Array:
    b, t, g, kd = x_BTGK.shape
    return x_BTGK.reshape(b, t // ck, ck, g, kd).transpose(1, 0, 3, 2, 4)


def _check(q_BTHK, k_BSGK, v_BSGK, segment_ids_BT, block_q, block_k) -> None:
    if q_BTHK.ndim != 4 or k_BSGK.ndim != 4 or k_BSGK.shape != v_BSGK.shape:
        raise InputError(f"flash_attention needs q (B, T, H, K) and k, v (B, S, G, K) of one shape; got q "
                         f"{q_BTHK.shape}, k {k_BSGK.shape}, v {v_BSGK.shape}")
    (b, t, h, kd), (bk, s, g, kk) = q_BTHK.shape, k_BSGK.shape
    if (bk, s, kk) != (b, t, kd) or h % g:
        raise InputError(f"flash_attention is self-attention with GQA: k, v must be (B={b}, S=T={t}, G, K={kd}) "
                         f"with G dividing H={h}; got {k_BSGK.shape}")
    if segment_ids_BT is not None and segment_ids_BT.shape != (b, t):
        raise InputError(f"segment_ids must be (B, T) = {(b, t)}; got {segment_ids_BT.shape}")
    if min(block_q, block_k) < 1:
        raise InputError(f"block_q and block_k must be >= 1; got {block_q}, {block_k}")


def flash_attention(q_BTHK, k_BSGK, v_BSGK, segment_ids_BT=None, *, causal: bool = True, block_q: int = 128,
                    block_k: int = 128, window: int | None = None, cap: float | None = None,
                    window_now=None) -> jax.Array:
    """O (B, T, H, K) of M20 §6 self-attention (S = T) equal to ``ops.attention`` under ``ops.causal_mask``
    (``causal``) or ``ops.document_mask`` (not ``causal``) of ``segment_ids_BT`` (None: one document per row),
    in values and gradients, computed FlashAttention-2 style in O(T·block) memory.

    Scores, softmax statistics and accumulators are in ``promote_types(q.dtype, float32)``; products of
    bf16 inputs take bf16 operands with float32 accumulation; the output has q's dtype. T need not be a
    multiple of the blocks: the window is padded internally and the padding is never read by real positions.
    ``window`` W (causal): query q reads keys q − W + 1 … q only, and the loops visit only the tiles that band
    touches (about T·(W + block) score entries instead of T²/2). ``window_now`` (a traced int in [1, W]: the
    window warmup of training) narrows the band inside the tiles of W's. ``cap`` c: scores c·tanh(S/c).
    """
    _check(q_BTHK, k_BSGK, v_BSGK, segment_ids_BT, block_q, block_k)
    if window is not None and (not causal or window < 1):
        raise InputError(f"flash_attention: window = {window!r} needs causal attention and W >= 1")
    b, t, h, kd = q_BTHK.shape
    g = k_BSGK.shape[2]
    if window_now is not None and window is None:
        raise InputError("flash_attention: window_now narrows a sliding window: give window W as well")
    plan = _plan(t, block_q, block_k, causal, window, cap)
    win = jnp.asarray((window or 0) if window_now is None else window_now, jnp.int32)
    seg_BT = jnp.zeros((b, t), jnp.int32) if segment_ids_BT is None else segment_ids_BT.astype(jnp.int32)
    pad = plan.tp - t
    widen = lambda a: jnp.pad(a, ((0, 0), (0, pad)) + ((0, 0),) * (a.ndim - 2))  # noqa: E731
    q_BTHK, k_BSGK, v_BSGK, seg_BT = widen(q_BTHK), widen(k_BSGK), widen(v_BSGK), widen(seg_BT)
    o_UBGMK = _flash(plan, _query_blocks(q_BTHK, g, plan.cq), _key_blocks(k_BSGK, plan.ck),
                     _key_blocks(v_BSGK, plan.ck), seg_BT.reshape(b, plan.nq, plan.cq).transpose(1, 0, 2),
                     seg_BT.reshape(b, plan.nk, plan.ck).transpose(1, 0, 2), win)
    return _from_query_blocks(o_UBGMK, plan.cq)[:, :t]
