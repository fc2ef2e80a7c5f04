"""The equations of ops.py on their own: RoPE (U19 §7), RMSNorm, GQA attention against a per-head reference."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mlx_llm.ops import attention, causal_attention, causal_mask, rms_norm, rope, rope_frequencies, softmax


def test_rope_frequencies_u19():
    np.testing.assert_allclose(rope_frequencies(8, 10000.0, jnp.float64), [1, 0.1, 0.01, 0.001], rtol=1e-15)


def _score(m, n, scale=1.0):
    ones = jnp.array([1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]).reshape(1, 1, 1, 8)  # every pair (1, 0)
    q = rope(ones, jnp.array([[m]]), 10000.0, scale)
    k = rope(ones, jnp.array([[n]]), 10000.0, scale)
    return float(jnp.sum(q * k))


def test_rope_gap_two_score_u19():
    expected = math.cos(2) + math.cos(0.2) + math.cos(0.02) + math.cos(0.002)
    for m in (5, 1005):
        assert abs(_score(m, m - 2) - expected) < 1e-12
        assert round(_score(m, m - 2), 3) == 2.564  # U19 §7


def test_position_interpolation():
    x = jax.random.normal(jax.random.key(0), (1, 1, 2, 8), jnp.float64)
    np.testing.assert_allclose(rope(x, jnp.array([[6000]]), 10000.0, 0.25), rope(x, jnp.array([[1500]]), 10000.0),
                               atol=1e-11)  # U19 §7: 6000 acts as 1500
    assert not np.allclose(rope(x, jnp.array([[6000]]), 10000.0), rope(x, jnp.array([[1500]]), 10000.0))


def test_rope_is_rotation_and_values_norm_preserved():
    x = jax.random.normal(jax.random.key(1), (2, 5, 3, 6), jnp.float64)
    pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
    y = rope(x, pos, 10000.0)
    np.testing.assert_allclose(jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x, axis=-1), rtol=1e-13)
    np.testing.assert_allclose(y[:, 0], x[:, 0], rtol=0, atol=0)  # position 0 is the identity


def test_rms_norm_definition():
    h = jnp.array([[3.0, -4.0]])
    rho = math.sqrt((9 + 16) / 2 + 1e-6)
    np.testing.assert_allclose(rms_norm(h, jnp.array([2.0, 0.5]), 1e-6), [[2 * 3 / rho, 0.5 * -4 / rho]], rtol=1e-15)


def test_rms_norm_bf16_computes_in_float32():
    h = jnp.array([[300.0, -400.0, 500.0, 1.0]], jnp.bfloat16)
    out = rms_norm(h, jnp.ones(4, jnp.bfloat16), 1e-6)
    assert out.dtype == jnp.bfloat16
    ref = rms_norm(h.astype(jnp.float32), jnp.ones(4), 1e-6)
    np.testing.assert_allclose(out.astype(jnp.float32), ref, rtol=1e-2)


def test_softmax_shift_invariant_and_overflow_safe():
    x = jnp.array([1000.0, 1001.0, 999.0])
    np.testing.assert_allclose(softmax(x), softmax(x - 1000.0), rtol=1e-15)
    assert np.isfinite(np.asarray(softmax(x))).all()


def test_gqa_attention_matches_per_head_reference():
    """g(j) = ⌊j / (h_q/h_kv)⌋ (M20 §6): query heads 0,1,2 read kv head 0; 3,4,5 read kv head 1."""
    kq, kk, kv = jax.random.split(jax.random.key(2), 3)
    b, t, h, g, d = 2, 5, 6, 2, 4
    q = jax.random.normal(kq, (b, t, h, d), jnp.float64)
    k = jax.random.normal(kk, (b, t, g, d), jnp.float64)
    v = jax.random.normal(kv, (b, t, g, d), jnp.float64)
    seg = jnp.array([[0, 0, 0, 1, 1], [0, 0, 0, 0, 0]])
    mask = causal_mask(seg, b, t)
    out = attention(q, k, v, mask)
    for j in range(h):
        gj = j // (h // g)
        s = jnp.einsum("btk,bsk->bts", q[:, :, j], k[:, :, gj]) / math.sqrt(d)
        s = jnp.where(mask, s, -jnp.inf)
        np.testing.assert_allclose(out[:, :, j], jax.nn.softmax(s, axis=-1) @ v[:, :, gj], atol=1e-13)


def test_causal_mask_with_segments():
    m = np.asarray(causal_mask(jnp.array([[0, 0, 1]]), 1, 3))[0]
    np.testing.assert_array_equal(m, [[1, 0, 0], [1, 1, 0], [0, 0, 1]])


@pytest.mark.slow
@pytest.mark.parametrize("t, block", [(12, 2), (13, 4), (16, 64), (9, 3)])
def test_block_causal_attention_equals_full(t, block):
    """Skipping the key blocks the causal mask removes changes nothing (segments included)."""
    kq, kk, kv = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(kq, (2, t, 4, 4), jnp.float64)
    k = jax.random.normal(kk, (2, t, 2, 4), jnp.float64)
    v = jax.random.normal(kv, (2, t, 2, 4), jnp.float64)
    seg = jnp.asarray(np.repeat([[0, 1, 1, 2]], 2, 0).repeat(4, 1)[:, :t])
    mask = causal_mask(seg, 2, t)
    np.testing.assert_allclose(causal_attention(q, k, v, mask, block), attention(q, k, v, mask), rtol=0, atol=1e-14)
