"""Sliding-window attention ("local" mixer layers): every attention path honours the window in values and
gradients, the window really limits what a query reads, and cached decoding through the ring buffer of W slots
equals the full forward far beyond W positions (prefill, one-token steps, chunks longer than W)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mlx_llm.config import ModelConfig
from mlx_llm.decode.state import forward_cached, init_cache
from mlx_llm.errors import ConfigError
from mlx_llm.kernels import Kernels
from mlx_llm.kernels.flash import flash_attention
from mlx_llm.model import forward, init_params
from mlx_llm.ops import attention, causal_mask, window_band
from mlx_llm.scaling import accounting

W = 5


def _cfg(pattern=("local",), **kw):
    base = dict(vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_head=8, d_ff=64, max_seq_len=64,
                mixer_pattern=pattern, sliding_window=W)
    return ModelConfig(**{**base, **kw})


def _params(cfg):
    p = init_params(cfg, jax.random.PRNGKey(0), jnp.float64)
    leaves, tree = jax.tree.flatten(p)
    keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))  # non-zero biases, non-unit gains
    return jax.tree.unflatten(tree, [a + 0.05 * jax.random.normal(k, a.shape, a.dtype) for a, k in zip(leaves, keys)])


TOKENS = np.random.RandomState(0).randint(0, 50, (2, 40))


def test_window_band_reads_exactly_the_last_w_positions():
    m = np.asarray(window_band(causal_mask(None, 1, 9), 3))[0]
    want = np.array([[0 <= i - j < 3 for j in range(9)] for i in range(9)])
    np.testing.assert_array_equal(m, want)


@pytest.mark.parametrize("window", [1, 3, 8, 17, 40])
@pytest.mark.parametrize("blocks", [(8, 8), (16, 8), (8, 16)])
def test_flash_window_equals_masked_reference_values_and_grads(window, blocks):
    rng = np.random.RandomState(window)
    q = jnp.asarray(rng.randn(2, 37, 4, 8))
    k, v = jnp.asarray(rng.randn(2, 37, 2, 8)), jnp.asarray(rng.randn(2, 37, 2, 8))
    seg = jnp.asarray(np.repeat([[0] * 20 + [1] * 17], 2, axis=0))
    mask = window_band(causal_mask(seg, 2, 37), window)
    f_ref = lambda q, k, v: jnp.sum(jnp.sin(attention(q, k, v, mask)))  # noqa: E731
    f_fl = lambda q, k, v: jnp.sum(jnp.sin(flash_attention(q, k, v, seg, window=window, block_q=blocks[0],  # noqa
                                                           block_k=blocks[1])))
    np.testing.assert_allclose(f_fl(q, k, v), f_ref(q, k, v), rtol=1e-12)
    for a, b in zip(jax.grad(f_fl, (0, 1, 2))(q, k, v), jax.grad(f_ref, (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(a, b, atol=1e-12)


@pytest.mark.parametrize("pattern", [("local",), ("local", "attn")])
@pytest.mark.parametrize("impl", ["flash", "splash", "pallas_gpu"])
def test_every_attention_path_honours_the_window(pattern, impl):
    """(The Triton kernel has no window: its local layers run flash; it traces with x64 off, as in
    test_kernels_attention.)"""
    cfg = _cfg(pattern, qkv_bias=True, qk_norm=True)
    with jax.enable_x64(impl != "pallas_gpu"):
        p = _params(cfg)
        ref = forward(p, TOKENS, cfg)
        out = forward(p, TOKENS, cfg, kernels=Kernels(attention_impl=impl, interpret=True).resolve("cpu"))
    tol = 1e-12 if impl == "flash" else 1e-5  # splash runs in float32, the Triton kernel's test in float32
    np.testing.assert_allclose(out, ref, atol=tol)


def test_the_window_limits_what_a_query_reads():
    cfg = _cfg(n_layers=1)
    p = _params(cfg)
    changed = TOKENS.copy()
    changed[:, 10] = (changed[:, 10] + 1) % 50
    a, b = forward(p, TOKENS, cfg), forward(p, changed, cfg)
    diff = np.abs(np.asarray(a - b)).max(axis=(0, 2))
    assert (diff[:10] == 0).all() and (diff[10:10 + W] > 1e-6).all() and (diff[10 + W:] == 0).all()
    wide = forward(p, TOKENS, dataclasses.replace(cfg, sliding_window=64))
    assert np.abs(np.asarray(wide - a)).max() > 1e-3  # W = 5 is not full attention


_STEP = jax.jit(lambda p, tokens, cache, cfg, fresh: forward_cached(p, tokens, cache, cfg, fresh=fresh),
                static_argnums=(3, 4))


def _decode(p, cfg, chunks):
    cache, outs, t = init_cache(cfg, 2, 64, jnp.float64), [], 0
    for i, n in enumerate(chunks):
        logits, cache = _STEP(p, jnp.asarray(TOKENS[:, t:t + n]), cache, cfg, i == 0)
        outs.append(logits)
        t += n
    return jnp.concatenate(outs, axis=1), cache


@pytest.mark.slow
@pytest.mark.parametrize("pattern", [("local",), ("local", "attn"), ("attn", "local", "mamba", "local")])
@pytest.mark.parametrize("chunks", [[12] + [3] * 9 + [1], [1] * 40, [7, 33]])
def test_ring_buffer_decoding_equals_the_full_forward_beyond_w(pattern, chunks):
    cfg = _cfg(pattern, n_layers=len(pattern) * (2 if len(pattern) < 4 else 1))
    p = _params(cfg)
    out, cache = _decode(p, cfg, chunks)
    np.testing.assert_allclose(out, forward(p, TOKENS, cfg), atol=1e-12)
    n_local = sum(k == "local" for k in (cfg.layer_kinds(l)[0] for l in range(cfg.n_layers)))
    assert cache.k_ring.shape == (n_local, 2, W, 2, 8)  # W slots, whatever the 40 positions


def test_ring_rows_of_different_lengths():
    cfg = _cfg()
    p = _params(cfg)
    cache = init_cache(cfg, 2, 64, jnp.float64)
    _, cache = forward_cached(p, TOKENS[:, :9], cache, cfg, n_new_B=np.array([9, 4]))
    logits, cache = forward_cached(p, TOKENS[:, 9:12], cache, cfg)
    row0 = forward(p, TOKENS[:1, :12], cfg)[0, 9:]
    row1 = forward(p, np.concatenate([TOKENS[1:, :4], TOKENS[1:, 9:12]], axis=1), cfg)[0, 4:]
    np.testing.assert_allclose(logits[0], row0, atol=1e-12)
    np.testing.assert_allclose(logits[1], row1, atol=1e-12)


def test_decode_state_bytes_stop_growing_past_the_window():
    cfg = _cfg(("local", "attn"), d_head=8)
    per = 2 * 2 * 8 * 8  # K and V, 2 heads of 8, float64 bytes
    grow = [accounting.decode_state_bytes(cfg, t, dtype="float64") for t in (1, W, 2 * W, 100)]
    assert grow == [per * (1 + 1), per * (W + W), per * (W + 2 * W), per * (W + 100)]
    local = _cfg(("local",))
    assert accounting.decode_state_bytes(local, 10_000) == accounting.decode_state_bytes(local, W)


def test_flops_count_the_window():
    cfg = _cfg()
    full = dataclasses.replace(cfg, mixer_pattern=("attn",))
    t = 64
    extra = accounting.train_flops_per_token(full, t, causal=True) - accounting.train_flops_per_token(
        cfg, t, causal=True)
    keys_full, keys_local = (t + 1) / 2, (W * (W + 1) / 2 + (t - W) * W) / t
    assert extra == pytest.approx(12 * 2 * (keys_full - keys_local) * 4 * 8)


def test_local_layers_need_a_window_and_causality():
    with pytest.raises(ConfigError, match="sliding_window is not set"):
        ModelConfig(vocab_size=8, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1, d_head=4, d_ff=8, max_seq_len=8,
                    mixer_pattern=("local",))
    with pytest.raises(ConfigError, match="causal = false"):
        _cfg(causal=False)
    with pytest.raises(ConfigError, match="sliding_window = 0"):
        _cfg(sliding_window=0)
