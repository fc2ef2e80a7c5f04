"""kernels/flash.py: FlashAttention-2 equals the exact reference (ops.attention under ops.causal_mask /
ops.document_mask) in values and in the gradients of q, k, v, skips the tiles above the causal diagonal, and
needs memory linear in T.

Errors are relative to the largest reference entry: max|flash − ref| / max|ref| per output (o, dq, dk, dv).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mlx_llm import ops
from mlx_llm.errors import InputError
from mlx_llm.kernels.flash import _plan, flash_attention

TOL = {jnp.float64: 1e-12, jnp.float32: 1e-5}
BF16_TOL = 2e-2  # bf16 flash vs the float32 reference of the same (bf16-rounded) inputs


def reference(q, k, v, seg, causal):
    b, t = q.shape[:2]
    return ops.attention(q, k, v, (ops.causal_mask if causal else ops.document_mask)(seg, b, t))


def _with_grads(attn):
    """(q, k, v, seg, ct) ↦ (o, dq, dk, dv) with the cotangent ct, jitted."""
    def run(q, k, v, seg, ct):
        o, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, seg), q, k, v)
        return (o, *vjp(ct))
    return jax.jit(run)


@functools.lru_cache(maxsize=None)
def flash_fn(causal, block_q, block_k):
    return _with_grads(lambda q, k, v, s: flash_attention(q, k, v, s, causal=causal, block_q=block_q,
                                                          block_k=block_k))


@functools.lru_cache(maxsize=None)
def reference_fn(causal):
    return _with_grads(lambda q, k, v, s: reference(q, k, v, s, causal))


def packed_segments(rng, b, t, padded_row=False):
    """Rows of documents of random lengths, a trailing padding segment (id 0) in row 0; with ``padded_row``
    the last row is all padding (a single segment)."""
    rows = []
    for _ in range(b):
        cuts = np.sort(rng.choice(np.arange(1, t - 3), size=3, replace=False))
        row = np.searchsorted(cuts, np.arange(t), side="right") + 1
        rows.append(row)
    seg = np.stack(rows)
    seg[0, t - 3:] = 0
    if padded_row:
        seg[-1] = 0
    return jnp.asarray(seg, jnp.int32)


def inputs(seed, b, t, h, g, kd, dtype):
    """q, k, v and a cotangent, drawn by numpy (no compilation per shape)."""
    rng = np.random.default_rng(seed)
    shapes = [(b, t, h, kd), (b, t, g, kd), (b, t, g, kd), (b, t, h, kd)]
    return tuple(jnp.asarray(rng.standard_normal(s, np.float32)).astype(dtype) for s in shapes)


def with_positions(x, positions, value):
    """x with every entry at ``positions`` (a slice of T) set to ``value`` (numpy: no compilation)."""
    out = np.array(x)
    out[:, positions] = value
    return jnp.asarray(out)


def rel_errors(got, want):
    return [float(jnp.max(jnp.abs(a.astype(jnp.float64) - b.astype(jnp.float64))) / jnp.max(jnp.abs(b)))
            for a, b in zip(got, want)]


# (dtype, B, T, H, G, K, block_q, block_k, causal, segments): R = H/G of 1, 2 and 4, T not a multiple of the
# block, block_q ≠ block_k, a window shorter than one block.
CASES = [
    (jnp.float64, 2, 37, 4, 2, 8, 16, 16, True, "packed"),
    (jnp.float64, 2, 37, 4, 1, 8, 16, 8, False, "padded_row"),
    (jnp.float32, 2, 37, 2, 2, 16, 16, 16, True, "padded_row"),
    (jnp.float32, 1, 64, 4, 2, 8, 16, 16, True, None),  # the shape of the skipping probes below
    (jnp.float32, 1, 64, 4, 2, 8, 16, 16, False, None),
    (jnp.float32, 1, 80, 4, 1, 8, 32, 16, True, "packed"),
    (jnp.float32, 2, 37, 4, 1, 16, 16, 32, False, "padded_row"),
    (jnp.float32, 2, 5, 2, 1, 8, 128, 128, True, "tiny"),
]


def _segments(kind, b, t):
    if kind is None:
        return None
    if kind == "tiny":
        return jnp.asarray([[1, 1, 2, 2, 0]] * b, jnp.int32)
    return packed_segments(np.random.default_rng(t), b, t, padded_row=kind == "padded_row")


@pytest.mark.parametrize("dtype,b,t,h,g,kd,bq,bk,causal,kind", CASES)
def test_values_and_gradients_match_reference(dtype, b, t, h, g, kd, bq, bk, causal, kind):
    q, k, v, ct = inputs(t + h, b, t, h, g, kd, dtype)
    seg = _segments(kind, b, t)
    got = flash_fn(causal, bq, bk)(q, k, v, seg, ct)
    want = reference_fn(causal)(q, k, v, seg, ct)
    assert [x.dtype for x in got] == [dtype] * 4
    errors = rel_errors(got, want)
    assert max(errors) < TOL[dtype], errors


@pytest.mark.parametrize("causal,kind,r", [(True, "padded_row", 2), (False, "packed", 4)])
def test_bfloat16_is_close_to_the_float32_reference(causal, kind, r):
    b, t, g, kd = 2, 37, 1, 16
    q, k, v, ct = inputs(7, b, t, g * r, g, kd, jnp.bfloat16)
    seg = _segments(kind, b, t)
    got = flash_fn(causal, 16, 16)(q, k, v, seg, ct)
    assert [x.dtype for x in got] == [jnp.bfloat16] * 4
    as32 = [x.astype(jnp.float32) for x in (q, k, v, ct)]
    want = reference_fn(causal)(*as32[:3], seg, as32[3])
    bf16_reference = reference_fn(causal)(q, k, v, seg, ct)
    flash_err, xla_err = rel_errors(got, want), rel_errors(bf16_reference, want)
    assert max(flash_err) < BF16_TOL, flash_err
    # bf16 flash should be about as close to float32 as the bf16 reference itself.
    assert all(f < 2 * x + 4e-3 for f, x in zip(flash_err, xla_err)), (flash_err, xla_err)


def test_causal_tiles_are_n_n_plus_1_over_2():
    plan = _plan(64, 16, 8, causal=True)  # 4 query blocks of 16 against 8 key blocks of 8
    forward = sum(int(plan.key_block_end(i)) for i in range(plan.nq))
    backward = sum(plan.nq - plan.query_block_start(j) for j in range(plan.nk))
    assert forward == backward == 2 + 4 + 6 + 8  # of 4 · 8 = 32 tiles
    full = _plan(64, 16, 8, causal=False)
    assert sum(full.key_block_end(i) for i in range(full.nq)) == 32


def test_causal_forward_never_reads_key_blocks_above_the_diagonal():
    """NaN values in key blocks 1…: a tile that were read would give 0·NaN = NaN even though it is masked."""
    q, k, v, ct = inputs(3, 1, 64, 4, 2, 8, jnp.float32)
    v_nan = with_positions(v, slice(16, None), np.nan)
    o = flash_fn(True, 16, 16)(q, k, v_nan, None, ct)[0]
    assert bool(jnp.all(jnp.isfinite(o[:, :16])))
    want = reference(q[:, :16], k[:, :16], v[:, :16], None, True)
    assert max(rel_errors([o[:, :16]], [want])) < 1e-5
    # The same poison reaches every row when every tile is read (bidirectional): the probe can fail.
    o_all = flash_fn(False, 16, 16)(q, k, v_nan, None, ct)[0]
    assert not bool(jnp.any(jnp.isfinite(o_all[:, :16])))


def test_causal_backward_never_sends_early_query_blocks_to_late_key_blocks():
    """NaN cotangents on query blocks 0–2: the last key block receives from query block 3 alone."""
    q, k, v, ct = inputs(4, 1, 64, 4, 2, 8, jnp.float32)
    ct_nan = with_positions(ct, slice(None, 48), np.nan)
    _, _, dk, dv = flash_fn(True, 16, 16)(q, k, v, None, ct_nan)
    assert bool(jnp.all(jnp.isfinite(dk[:, 48:]))) and bool(jnp.all(jnp.isfinite(dv[:, 48:])))
    _, _, dk_want, dv_want = reference_fn(True)(q, k, v, None, with_positions(ct, slice(None, 48), 0.0))
    assert max(rel_errors([dk[:, 48:], dv[:, 48:]], [dk_want[:, 48:], dv_want[:, 48:]])) < 1e-5
    _, _, dk_all, _ = flash_fn(False, 16, 16)(q, k, v, None, ct_nan)
    assert not bool(jnp.any(jnp.isfinite(dk_all[:, 48:])))


def _shapes_in(jaxpr):
    """Every intermediate shape of a jaxpr and of the jaxprs nested in it (loops, custom VJP, pjit)."""
    for eqn in jaxpr.eqns:
        yield from (var.aval.shape for var in eqn.outvars)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    yield from _shapes_in(sub)


def _quadratic_shapes(attn, t):
    q, k, v, ct = inputs(0, 1, t, 4, 2, 8, jnp.float32)
    jaxpr = jax.make_jaxpr(lambda q, k, v, ct: jax.vjp(attn, q, k, v)[1](ct))(q, k, v, ct).jaxpr
    return [s for s in _shapes_in(jaxpr) if sum(n >= t for n in s) >= 2]


def test_no_t_by_t_array_forward_or_backward():
    t = 128
    assert _quadratic_shapes(lambda q, k, v: flash_attention(q, k, v, block_q=16, block_k=16), t) == []
    assert _quadratic_shapes(lambda q, k, v: reference(q, k, v, None, True), t)  # the probe sees (T, T)


def _temp_bytes(attn, t):
    shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    run = jax.jit(lambda q, k, v, ct: jax.vjp(attn, q, k, v)[1](ct))
    compiled = run.lower(shape(1, t, 2, 16), shape(1, t, 1, 16), shape(1, t, 1, 16), shape(1, t, 2, 16)).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_forward_backward_memory_grows_linearly_in_t():
    flash = lambda q, k, v: flash_attention(q, k, v, block_q=64, block_k=64)  # noqa: E731
    xla = lambda q, k, v: reference(q, k, v, None, True)  # noqa: E731
    flash_ratio = _temp_bytes(flash, 1024) / _temp_bytes(flash, 256)
    xla_ratio = _temp_bytes(xla, 1024) / _temp_bytes(xla, 256)
    assert flash_ratio < 6, flash_ratio  # 4× the length: linear is 4, quadratic 16
    assert xla_ratio > 10, xla_ratio


def test_vmap_and_jit_equal_the_unbatched_call():
    q, k, v, _ = inputs(5, 2, 37, 4, 2, 8, jnp.float64)
    seg = packed_segments(np.random.default_rng(1), 2, 37)
    attn = lambda q, k, v, s: flash_attention(q, k, v, s, block_q=16, block_k=16)  # noqa: E731
    batched = jax.jit(jax.vmap(attn))(q[:, None], k[:, None], v[:, None], seg[:, None])[:, 0]
    assert max(rel_errors([batched], [reference(q, k, v, seg, True)])) < 1e-12


def test_bad_shapes_are_refused():
    q, k, v, _ = inputs(0, 1, 16, 3, 2, 8, jnp.float32)
    with pytest.raises(InputError, match="G dividing H"):
        flash_attention(q, k, v)
    q, k, v, _ = inputs(0, 1, 16, 2, 2, 8, jnp.float32)
    with pytest.raises(InputError, match="segment_ids"):
        flash_attention(q, k, v, jnp.zeros((1, 15), jnp.int32))
    with pytest.raises(InputError, match="S=T"):
        flash_attention(q, k[:, :8], v[:, :8])
