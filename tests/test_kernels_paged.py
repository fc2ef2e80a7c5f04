"""The paged KV cache: attention over pages (kernels/paged_attention.py) against the contiguous reference, the GPU
kernel in interpret mode, the TPU kernel compiled for a TPU topology, and a paged decode state
(decode/cache.PagedKVCache) that gives the contiguous cache's logits through prefill, chunks and steps, across page
boundaries, for every model kind that has full attention."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_llm import ModelConfig
from mlx_llm.decode.cache import Pages
from mlx_llm.decode.state import assign_pages, forward_cached, init_cache
from mlx_llm.errors import InputError
from mlx_llm.kernels import Kernels
from mlx_llm.kernels.paged_attention import paged_attention, paged_path, reference
from mlx_llm.ops import attention
from test_generate import random_params

RNG = np.random.default_rng(0)
DENSE = ModelConfig(vocab_size=13, d_model=12, n_layers=2, n_heads=4, n_kv_heads=2, d_head=4, d_ff=20, max_seq_len=32)
HYBRID = dataclasses.replace(DENSE, n_layers=4, mixer_pattern=("attn", "mamba", "local", "attn"),
                             ffn_pattern=("swiglu", "moe"), sliding_window=3, ssm_state=3, n_experts=4,
                             moe_top_k=2, moe_d_ff=8)


def pool(b, n, size, g, k, count=None):
    """A random pool and a page table: row b's n pages, distinct, never the padding page."""
    count = count or b * n + 3
    kv = jnp.asarray(RNG.standard_normal((count, size, 2 * g, k)))
    table = jnp.asarray(RNG.permutation(np.arange(1, count))[:b * n].reshape(b, n), jnp.int32)
    return kv, table


def contiguous(kv, table):
    rows = np.asarray(kv)[np.asarray(table)]  # (B, n, page, 2G, K)
    b, n, page, c, k = rows.shape
    rows = rows.reshape(b, n * page, c, k)
    return jnp.asarray(rows[..., 0::2, :]), jnp.asarray(rows[..., 1::2, :])


@pytest.mark.parametrize("t", [1, 3])
def test_reference_over_pages_is_attention_over_the_gathered_prefix(t):
    kv, table = pool(3, 4, 5, 2, 4)
    q = jnp.asarray(RNG.standard_normal((3, t, 6, 4)))
    lengths, n_new = jnp.asarray([0, 7, 16]), jnp.asarray([t, t - 1, 1])
    k, v = contiguous(kv, table)
    pos = lengths[:, None] + jnp.arange(t)[None]
    s = jnp.arange(k.shape[1])
    mask = (s <= pos[:, :, None]) & (s < (lengths + n_new)[:, None, None])
    want = attention(q, k, v, mask, 30.0)
    got = reference(q, kv, table, lengths, n_new, 30.0)
    real = np.arange(t)[None, :] < np.asarray(n_new)[:, None]
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], rtol=1e-13, atol=1e-13)


def test_gpu_kernel_in_interpret_mode_equals_the_reference():
    kernels = Kernels(attention_impl="pallas_gpu", interpret=True).resolve("gpu")
    assert paged_path(kernels, 1) == "paged_gpu" and paged_path(kernels, 2) == "reference"
    kv, table = pool(3, 8, 4, 2, 16)
    q = jnp.asarray(RNG.standard_normal((3, 1, 4, 16)), jnp.float32)
    kv = kv.astype(jnp.float32)
    lengths, n_new = jnp.asarray([0, 9, 31], jnp.int32), jnp.asarray([1, 1, 1], jnp.int32)
    with jax.enable_x64(False):  # as a real run traces (the Triton kernel's index arithmetic is int32)
        got = paged_attention(q, kv, table, lengths, n_new, kernels=kernels)
    np.testing.assert_allclose(got, reference(q, kv, table, lengths, n_new), rtol=2e-5, atol=2e-6)


@pytest.mark.slow
def test_tpu_kernel_compiles_for_a_tpu_topology():
    """The ragged paged attention Mosaic kernel, for decoding and chunked prefill, compiled by libtpu for one v5e
    chip (no TPU needed; the Pallas TPU interpreter of this jax cannot run it, so the CPU decodes by the
    reference: ``paged_path``)."""
    pytest.importorskip("libtpu")
    from jax.sharding import SingleDeviceSharding

    from mlx_llm.train.preflight import tpu_target, without_cpu_flags

    kernels = Kernels(attention_impl="splash").resolve("tpu")
    assert paged_path(kernels, 4) == "ragged_tpu" and paged_path(Kernels(attention_impl="splash", interpret=True)
                                                                 .resolve("cpu"), 1) == "reference"
    with jax.enable_x64(False), without_cpu_flags():
        device = tpu_target("tpu:v5e-1").devices[0]
        on = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(device))
    # Mosaic's lowering asks the default device for its TPU generation
    with jax.enable_x64(False), without_cpu_flags(), jax.default_device(device):
        for t in (1, 16):
            fn = jax.jit(lambda q, kv, table, n, m: paged_attention(q, kv, table, n, m, kernels=kernels, cap=50.0))
            compiled = fn.lower(on((8, t, 8, 128), jnp.bfloat16), on((64, 16, 4, 128), jnp.bfloat16),
                                on((8, 8), jnp.int32), on((8,), jnp.int32), on((8,), jnp.int32)).compile()
            assert "tpu_custom_call" in compiled.as_text()


# ----- a paged decode state ---------------------------------------------------------------------------------
def paged_state(cfg, b, max_len, size, dtype):
    n = -(-max_len // size)
    count = b * n + 2
    state = init_cache(cfg, b, max_len, dtype, pages=Pages(count, size))
    table = RNG.permutation(np.arange(1, count))[:b * n].reshape(b, n)
    return assign_pages(state, table)


def run(params, cfg, state, tokens, chunks):
    """Prefill in ``chunks`` (each row's real tokens per chunk), then the remaining tokens one at a time."""
    out, at = [], 0
    for width, real in chunks:
        logits, state = forward_cached(params, tokens[:, at:at + width], state, cfg, n_new_B=np.asarray(real))
        out.append(np.asarray(logits))
        at += width
    return out, state


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [DENSE, HYBRID], ids=["dense", "hybrid"])
@settings(max_examples=3, deadline=None, derandomize=True, database=None)
@given(size=st.sampled_from([1, 3, 4, 8]), first=st.integers(1, 7), data=st.data())
def test_a_paged_state_gives_the_contiguous_logits(cfg, size, first, data):
    params = random_params(cfg, 3)
    b, max_len = 3, 20
    tokens = jnp.asarray(RNG.integers(0, cfg.vocab_size, (b, max_len)), jnp.int32)
    ragged = data.draw(st.lists(st.integers(0, first), min_size=b, max_size=b))
    chunks = [(first, [first] * b), (first, ragged), (1, [1] * b), (1, [1, 0, 1]), (2, [2, 2, 1])]
    want, _ = run(params, cfg, init_cache(cfg, b, max_len, jnp.float64), tokens, chunks)
    got, state = run(params, cfg, paged_state(cfg, b, max_len, size, jnp.float64), tokens, chunks)
    for w, g, (width, real) in zip(want, got, chunks):
        mask = np.arange(width)[None, :] < np.asarray(real)[:, None]
        np.testing.assert_allclose(g[mask], w[mask], rtol=1e-12, atol=1e-12)
    assert state.page_table is not None


def test_assign_pages_refuses_bad_tables():
    state = init_cache(DENSE, 2, 8, pages=Pages(5, 4))
    assert state.page_table.shape == (2, 2) and int(state.page_table.max()) == 0
    with pytest.raises(InputError, match=r"page ids must be in \[0, 5\)"):
        assign_pages(state, [[1, 2], [3, 5]])
    with pytest.raises(InputError, match="integers of shape"):
        assign_pages(state, [[1, 2, 3]])
    with pytest.raises(InputError, match=r"Pages.count = 1 is invalid"):
        Pages(1, 4)
    with pytest.raises(InputError, match="no paged layers"):
        assign_pages(init_cache(DENSE, 2, 8), [[1, 2], [3, 4]])


@pytest.mark.parametrize("cfg", [DENSE, HYBRID], ids=["dense", "hybrid"])
def test_accounting_counts_the_pool(cfg):
    """``scaling.accounting`` counts what a paged state allocates: the pool of the full-attention layers (the rings
    and the Mamba states beside it are per sequence), and ⌈n/page⌉ pages per sequence of n positions."""
    from mlx_llm.decode.cache import PagedKVCache
    from mlx_llm.scaling.accounting import pages_needed, paged_kv_bytes

    state = jax.eval_shape(lambda: init_cache(cfg, 3, 20, jnp.bfloat16, pages=Pages(9, 4)))
    pool = [s for s in state.stores.values() if isinstance(s, PagedKVCache)]
    assert len(pool) == 1 and paged_kv_bytes(cfg, 9, 4, jnp.bfloat16) == pool[0].kv.size * 2
    assert paged_kv_bytes(cfg, 9, 4, "float32") == 2 * 2 * 9 * 4 * 2 * 4 * 4  # 2 full-attention layers either way
    assert pages_needed([0, 1, 4, 5, 12], 4) == 0 + 1 + 1 + 2 + 3
