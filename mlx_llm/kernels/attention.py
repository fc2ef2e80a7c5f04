"""Self-attention over the positions of a window (training, evaluation, prefill), one call for every backend.

``attention(q, k, v, segment_ids, causal=…, kernels=…)`` computes M20 §6's GQA attention — S_j = Q̃_j K̃_g(j)ᵀ/√d_h
with the causal (or bidirectional, M20 §19) mask restricted to each packed document, A_j = softmax(S_j),
O_j = A_j V_g(j) — by the implementation ``kernels.attention_impl`` names (``Kernels`` in ``kernels/__init__``):

- "xla": the reference, ``ops.causal_attention`` / ``ops.attention`` over a boolean (B, T, T) mask;
- "flash": ``kernels.flash`` (pure JAX, blockwise, O(T·block) memory);
- "splash": TPU Pallas splash attention (Mosaic), one MQA kernel per key/value head so K/V are never repeated;
- "pallas_gpu": the Triton Pallas ``mha`` (it has no grouped form: K/V are repeated to the query heads).

Nothing outside "xla" builds a (B, T, T) mask: segment ids go down to the kernel. The Pallas kernels need the
length to be a multiple of their block, so the window is padded with positions of a segment id no real
position has (−1: they read only each other and are sliced away). A Mosaic kernel cannot be split by XLA's
SPMD partitioner, so under a mesh (``jax.sharding.get_abstract_mesh``, set by the train step) splash runs
inside ``jax.shard_map``: rows split over the batch axes, heads over ``tensor`` when they divide.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from mlx_llm.kernels import Kernels, attention_path
from mlx_llm.kernels.flash import flash_attention
from mlx_llm.ops import attention as masked_attention, causal_attention, causal_mask, document_mask, window_band

PAD_SEGMENT = -1  # segment id of the positions a kernel's block padding adds
SPLASH_BLOCK = 512  # splash's block over queries and keys on TPU (a multiple of 128, the lane width)
GPU_BLOCK = 64  # the Triton kernel's block


def attention(q_BTHK, k_BTGK, v_BTGK, segment_ids_BT=None, *, causal: bool = True, kernels: Kernels,
              mask_BTS=None, window: int | None = None, cap: float | None = None, window_now=None):
    """O (B, T, H, K) of M20 §6 by ``kernels.attention_impl`` (resolved: no "auto"). ``mask_BTS`` is the
    reference path's boolean mask when the caller already built it (shared by every layer of one forward).
    ``window`` W (causal only): each query reads itself and the W − 1 positions before it (sliding-window
    attention); flash and splash skip the blocks outside the band, so the cost is O(T·W). ``window_now`` (a traced
    int ≤ W, training's window warmup) narrows the band to that many positions; the loops still visit W's
    blocks. ``cap`` c: scores soft-capped to c·tanh(s/c) before the mask and softmax (Gemma 2). A feature a path
    cannot honour sends the layer to "flash" (``attention_path``): the Triton ``mha`` of "pallas_gpu" has neither
    window nor cap, splash has no traced window; the path recorded for such a layer is flash's."""
    impl = attention_path(kernels, q_BTHK.shape[1], window, cap=cap, growing_window=window_now is not None)
    if impl == "xla":
        if mask_BTS is None:
            b, t = q_BTHK.shape[:2]
            mask_BTS = (causal_mask if causal else document_mask)(segment_ids_BT, b, t)
        mask_BTS = window_band(mask_BTS, window if window_now is None else window_now)
        if causal:
            return causal_attention(q_BTHK, k_BTGK, v_BTGK, mask_BTS, cap=cap)
        return masked_attention(q_BTHK, k_BTGK, v_BTGK, mask_BTS, cap)
    if impl == "flash":
        return flash_attention(q_BTHK, k_BTGK, v_BTGK, segment_ids_BT, causal=causal, window=window, cap=cap,
                               window_now=window_now)
    if impl == "splash":
        call = functools.partial(_splash, window=window, cap=cap)
        return _sharded(call, q_BTHK, k_BTGK, v_BTGK, segment_ids_BT, causal, kernels.interpret)
    if impl == "pallas_gpu":
        return _pallas_gpu(q_BTHK, k_BTGK, v_BTGK, segment_ids_BT, causal, kernels.interpret)
    raise ValueError(f"attention_impl = {impl!r} is not resolved: call Kernels.resolve() first")


def _padded(block: int, q_BTHK, k_BTGK, v_BTGK, segment_ids_BT):
    """The window padded to a multiple of ``block`` with ``PAD_SEGMENT`` positions; segment ids made explicit."""
    b, t = q_BTHK.shape[:2]
    if segment_ids_BT is None:
        segment_ids_BT = jnp.zeros((b, t), jnp.int32)
    pad = -t % block
    if pad:
        widen = lambda a: jnp.pad(a, ((0, 0), (0, pad), (0, 0), (0, 0)))  # noqa: E731
        q_BTHK, k_BTGK, v_BTGK = widen(q_BTHK), widen(k_BTGK), widen(v_BTGK)
        segment_ids_BT = jnp.pad(segment_ids_BT, ((0, 0), (0, pad)), constant_values=PAD_SEGMENT)
    return q_BTHK, k_BTGK, v_BTGK, segment_ids_BT.astype(jnp.int32)


def _sharded(kernel, q_BTHK, k_BTGK, v_BTGK, segment_ids_BT, causal, interpret):
    """``kernel`` under ``jax.shard_map`` when a mesh is set (rows over the batch axes that divide B, heads over
    ``tensor`` when it divides the key/value heads), else called directly."""
    mesh = jax.sharding.get_abstract_mesh()
    call = functools.partial(kernel, causal=causal, interpret=interpret)
    if mesh.empty or math.prod(mesh.shape.values()) == 1:
        return call(q_BTHK, k_BTGK, v_BTGK, segment_ids_BT)
    b, g = q_BTHK.shape[0], k_BTGK.shape[2]
    rows = tuple(a for a in ("data", "fsdp") if mesh.shape.get(a, 1) > 1)
    if b % math.prod(mesh.shape[a] for a in rows):
        rows = ()
    heads = "tensor" if mesh.shape.get("tensor", 1) > 1 and g % mesh.shape["tensor"] == 0 else None
    qkv = P(rows or None, None, heads, None)
    if segment_ids_BT is None:
        segment_ids_BT = jnp.zeros(q_BTHK.shape[:2], jnp.int32)
    return jax.shard_map(call, in_specs=(qkv, qkv, qkv, P(rows or None, None)), out_specs=qkv,
                         check_vma=False)(q_BTHK, k_BTGK, v_BTGK, segment_ids_BT)


def _block_for(t: int, block: int) -> int:
    """The kernel block for a window of t positions: ``block``, or t rounded up to a multiple of 128 (the TPU
    lane width) when the window is shorter."""
    return min(block, -(-t // 128) * 128)


@functools.lru_cache(maxsize=32)
def _splash_kernel(t: int, r: int, causal: bool, block: int, interpret: bool, window: int | None = None,
                   cap: float | None = None):
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    one = sa.CausalMask((t, t)) if causal else sa.FullMask((t, t))
    if window is not None:  # keys q − (W − 1) … q: splash skips every block outside the band
        one = sa.LocalMask((t, t), window_size=(window - 1, 0), offset=0)
    sizes = dict.fromkeys(("block_q", "block_kv", "block_kv_compute", "block_q_dkv", "block_kv_dkv",
                           "block_kv_dkv_compute", "block_q_dq", "block_kv_dq"), block)
    # The kernel holds its mask metadata as arrays and is cached: build them as constants even when the first call
    # comes from inside a trace, or a later trace would reuse that trace's values (an escaped tracer).
    with jax.ensure_compile_time_eval():
        return sa.make_splash_mqa_single_device(sa.MultiHeadMask([one] * r), block_sizes=sa.BlockSizes(**sizes),
                                                interpret=interpret, attn_logits_soft_cap=cap)


def _splash(q_BTHK, k_BTGK, v_BTGK, segment_ids_BT, *, causal: bool, interpret: bool, window: int | None = None,
            cap: float | None = None):
    """Splash attention (MQA form) per (row, key/value head): the R query heads of a group against its one key
    and value head. Splash does not scale the scores, so Q̃ is divided by √d_h first (in float32); its
    ``attn_logits_soft_cap`` then caps those scaled scores, c·tanh(s/c), as the other paths do."""
    from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

    b, t, h, kd = q_BTHK.shape
    g = k_BTGK.shape[2]
    block = _block_for(t, SPLASH_BLOCK)
    q_BTHK = (q_BTHK.astype(jnp.float32) / math.sqrt(kd)).astype(q_BTHK.dtype)
    q_BTHK, k_BTGK, v_BTGK, seg_BT = _padded(block, q_BTHK, k_BTGK, v_BTGK, segment_ids_BT)
    tp = q_BTHK.shape[1]
    kernel = _splash_kernel(tp, h // g, causal, block, interpret, window, cap)
    q_BGRTK = q_BTHK.reshape(b, tp, g, h // g, kd).transpose(0, 2, 3, 1, 4)
    k_BGTK, v_BGTK = k_BTGK.transpose(0, 2, 1, 3), v_BTGK.transpose(0, 2, 1, 3)
    per_head = jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=SegmentIds(q=s, kv=s)),
                        in_axes=(0, 0, 0, None))
    o_BGRTK = jax.vmap(per_head)(q_BGRTK, k_BGTK, v_BGTK, seg_BT)
    return o_BGRTK.transpose(0, 3, 1, 2, 4).reshape(b, tp, h, kd)[:, :t]


def _pallas_gpu(q_BTHK, k_BTGK, v_BTGK, segment_ids_BT, causal: bool, interpret: bool):
    """The Triton Pallas ``mha`` (GPU): (B, T, H, K) with segment ids; K/V repeated to the H query heads."""
    from jax.experimental.pallas.ops.gpu.attention import BlockSizes, mha

    b, t, h, kd = q_BTHK.shape
    r = h // k_BTGK.shape[2]
    block = min(GPU_BLOCK, -(-t // 16) * 16)
    q_BTHK, k_BTGK, v_BTGK, seg_BT = _padded(block, q_BTHK, k_BTGK, v_BTGK, segment_ids_BT)
    k_BTHK, v_BTHK = jnp.repeat(k_BTGK, r, axis=2), jnp.repeat(v_BTGK, r, axis=2)
    sizes = BlockSizes(block_q=block, block_k=block, block_q_dkv=block, block_kv_dkv=block, block_q_dq=block,
                       block_kv_dq=block)
    o_BTHK = mha(q_BTHK, k_BTHK, v_BTHK, seg_BT, sm_scale=1.0 / math.sqrt(kd), causal=causal, block_sizes=sizes,
                 interpret=interpret)
    return o_BTHK[:, :t]
