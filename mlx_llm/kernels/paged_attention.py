"""Attention over a paged KV cache, one call for every backend (decode and chunked prefill).

The keys and values of one attention layer live in a pool of fixed-size pages, in the layout of the TPU kernel:
``kv_pages`` (P, page_size, 2·G, K), key head g at index 2g and value head g at 2g + 1 (both halves of a position
in one row, so a page is read in one contiguous block). Row b's position s lives in page ``page_table[b, s //
page_size]`` at offset ``s % page_size``; page 0 is the padding page, where unused table entries point and padding
writes go (it is never read as a real position).

``paged_attention(q, kv_pages, page_table, lengths, n_new, kernels=…)`` is M20 §6's GQA attention for T new
queries per row: query t of row b sits at position lengths[b] + t and reads every position s ≤ lengths[b] + t with
s < lengths[b] + n_new[b] (its own row's prefix and the real new tokens before it). The path follows the attention
setting (``paged_path``):

- "reference": gather the row's pages into (B, G, S, K) keys and values and run ``ops.grouped_attention`` with the
  boolean mask (every backend; the oracle of the others, and the CPU path);
- "ragged_tpu": jax's TPU Pallas ``ragged_paged_attention`` (Mosaic; compiled for a TPU topology by the pre-flight
  compiler, as the other TPU kernels are);
- "paged_gpu": jax's GPU Pallas ``paged_attention`` (Triton; one query per row, so decoding only — a call with
  T > 1 goes to the reference; it takes (G, P, page, K) pages, read off the combined pool per call). Tested on the
  CPU in interpret mode.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from mlx_llm.kernels import Kernels
from mlx_llm.ops import grouped_attention

PADDING_PAGE = 0  # the page unused table entries point to; padding writes land here and it is never read
PAGED_PATHS = ("reference", "ragged_tpu", "paged_gpu")


def paged_path(kernels: Kernels, t: int, cap: float | None = None) -> str:
    """The paged-attention path of a resolved ``kernels`` for T = ``t`` new queries per row: the TPU kernel where
    the attention setting is splash on a TPU, the GPU kernel where it is pallas_gpu (one query per row and no soft
    cap, which the Triton kernel applies after its own scaling), else the reference. The Pallas TPU interpreter of
    the pinned jax cannot run the TPU kernel (it lacks the reshape transforms the kernel uses), so splash in
    interpret mode on the CPU decodes through the reference; the kernel itself is compiled for a TPU topology by
    the pre-flight compiler (tests/test_kernels_paged.py)."""
    if kernels.attention_impl == "splash" and kernels.platform == "tpu":
        return "ragged_tpu"
    if kernels.attention_impl == "pallas_gpu" and t == 1 and cap is None:
        return "paged_gpu"
    return "reference"


def split_heads(kv_BSCK):
    """(…, 2G, K) combined heads → keys, values (…, G, K)."""
    return kv_BSCK[..., 0::2, :], kv_BSCK[..., 1::2, :]


def gather(kv_pages_PNCK, page_table_BN):
    """Row b's keys and values, head-major: (B, G, n·page, K) each, read straight out of the pages into the layout
    the attention's products take (``ops.grouped_attention``). Gathering (B, n·page, 2G, K) and splitting and
    transposing it instead copied the block twice more, with strided reads XLA:CPU runs far below the read bandwidth
    (3.6× slower at 32 rows of 512 positions)."""
    b, n = page_table_BN.shape
    _, page, c, k = kv_pages_PNCK.shape
    pages_B1N, key_1G1 = page_table_BN[:, None, :], 2 * jnp.arange(c // 2)[None, :, None]
    heads = lambda channel_1G1: kv_pages_PNCK[pages_B1N, :, channel_1G1].reshape(b, c // 2, n * page, k)  # noqa: E731
    return heads(key_1G1), heads(key_1G1 + 1)


def reference(q_BTHK, kv_pages_PNCK, page_table_BN, lengths_B, n_new_B, cap=None):
    """``ops.grouped_attention`` over each row's gathered pages, with the mask of the module docstring."""
    k_BGSK, v_BGSK = gather(kv_pages_PNCK, page_table_BN)
    t, s = q_BTHK.shape[1], k_BGSK.shape[2]
    positions_BT = lengths_B[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    s_S = jnp.arange(s, dtype=jnp.int32)
    mask_BTS = (s_S <= positions_BT[:, :, None]) & (s_S < (lengths_B + n_new_B)[:, None, None])
    return grouped_attention(q_BTHK, k_BGSK.astype(q_BTHK.dtype), v_BGSK.astype(q_BTHK.dtype), mask_BTS, cap)


def _ragged_tpu(q_BTHK, kv_pages_PNCK, page_table_BN, lengths_B, n_new_B, cap):
    """The TPU kernel over the batch flattened to B·T queries, T per row: with kv length lengths + T, query t reads
    up to position lengths + t (the kernel's causal rule), so the real queries read exactly their prefix and the
    earlier real new tokens; a padding query's output is never used."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    b, t, h, k = q_BTHK.shape
    cu_q_lens = jnp.arange(b + 1, dtype=jnp.int32) * t
    # The kernel looks its tuned block sizes up by the *local* device's TPU generation, which a compile for a TPU
    # topology from a CPU host does not have: give its untuned defaults (v4's, which fit every generation's VMEM).
    call = functools.partial(ragged_paged_attention, sm_scale=1.0 / math.sqrt(k), soft_cap=cap,
                             num_kv_pages_per_block=min(page_table_BN.shape[1], 32), num_queries_per_block=min(b * t, 32))
    args = (q_BTHK.reshape(b * t, h, k), kv_pages_PNCK.astype(q_BTHK.dtype), (lengths_B + t).astype(jnp.int32),
            page_table_BN.astype(jnp.int32), cu_q_lens, jnp.asarray([b], jnp.int32))
    return call(*args).reshape(b, t, h, k)


def _paged_gpu(q_BTHK, kv_pages_PNCK, page_table_BN, lengths_B, n_new_B, interpret: bool):
    """The GPU kernel for one query per row (it scales scores by nothing: Q̃ is divided by √d_h here)."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as gpu_paged

    k_PNGK, v_PNGK = split_heads(kv_pages_PNCK)
    heads_first = lambda a: jnp.moveaxis(a, 2, 0)  # (G, P, page, K)
    q_BHK = q_BTHK[:, 0] / jnp.sqrt(jnp.asarray(q_BTHK.shape[-1], q_BTHK.dtype))
    n = page_table_BN.shape[1]
    split = math.gcd(n, 16)
    out = gpu_paged(q_BHK, heads_first(k_PNGK).astype(q_BHK.dtype), heads_first(v_PNGK).astype(q_BHK.dtype),
                    page_table_BN.astype(jnp.int32), (lengths_B + n_new_B).astype(jnp.int32),
                    pages_per_compute_block=min(8, n) if n % min(8, n) == 0 else 1, k_splits=split,
                    interpret=interpret)
    return out[:, None].astype(q_BTHK.dtype)


def paged_attention(q_BTHK, kv_pages_PNCK, page_table_BN, lengths_B, n_new_B, *, kernels: Kernels,
                    cap: float | None = None):
    """O (B, T, H, K) of T new queries per row over the row's pages (the module docstring), by ``paged_path``."""
    impl = paged_path(kernels, q_BTHK.shape[1], cap)
    if impl == "ragged_tpu":
        return _ragged_tpu(q_BTHK, kv_pages_PNCK, page_table_BN, lengths_B, n_new_B, cap)
    if impl == "paged_gpu":
        return _paged_gpu(q_BTHK, kv_pages_PNCK, page_table_BN, lengths_B, n_new_B, kernels.interpret)
    return reference(q_BTHK, kv_pages_PNCK, page_table_BN, lengths_B, n_new_B, cap)


