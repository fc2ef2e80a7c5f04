"""KV cache (M20 §14, U19 §6): stored contents, the equivalences cached = full forward, padding, capacity
checks, in-place updates, and the memory formula's worked numbers."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mlx_llm import ModelConfig, examples, forward, init_params
from mlx_llm.decode.state import DecodeState, forward_cached, init_cache, kv_cache_bytes, unstack_layers
from mlx_llm.errors import InputError

cached = jax.jit(forward_cached, static_argnames="cfg")
full = jax.jit(forward, static_argnames="cfg")

CONFIGS = [  # GQA (query heads share K/V heads), L ≥ 2, untied and tied, RoPE scaling
    ModelConfig(vocab_size=13, d_model=12, n_layers=2, n_heads=4, n_kv_heads=2, d_head=4, d_ff=20, max_seq_len=16),
    ModelConfig(vocab_size=9, d_model=8, n_layers=3, n_heads=6, n_kv_heads=3, d_head=2, d_ff=10, max_seq_len=16,
                tie_embeddings=True, rope_scale=0.5),
]
TOL = {jnp.float32: 1e-5, jnp.float64: 1e-12}


def random_params(cfg, seed, dtype):
    """init_params' layout with NumPy draws (jax.random compiles once per weight shape: slow on 2 cores).
    Weights ~ N(0, 1/d), gains ≈ 1 ± 0.2 so the norms are exercised too."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))

    def draw(path, leaf):
        noise = rng.standard_normal(leaf.shape)
        return jnp.asarray(1 + 0.2 * noise if "norm" in str(path[-1]) else noise / np.sqrt(cfg.d_model), dtype)

    return jax.tree_util.tree_map_with_path(draw, shapes)


@functools.lru_cache(maxsize=None)
def model(i, dtype):
    cfg = CONFIGS[i]
    params = random_params(cfg, 10 + i, dtype)
    tokens = jax.random.randint(jax.random.PRNGKey(20 + i), (2, 12), 0, cfg.vocab_size)
    return cfg, params, tokens


# ----- M20 §14 on the running example -----------------------------------------------------------------
@pytest.fixture(scope="module")
def ex():
    cfg, params, tokens, _ = examples.running_example()
    return cfg, jax.tree.map(jnp.asarray, params), jnp.asarray(tokens)


def test_running_example_cache_holds_rotated_keys_unrotated_values(ex):
    cfg, params, tokens = ex
    logits, cache = cached(params, tokens, init_cache(cfg, 1, 8, jnp.float64), cfg)
    np.testing.assert_array_equal(cache.lengths, [3])
    k, v = np.asarray(cache.k[0, 0, :3, 0]), np.asarray(cache.v[0, 0, :3, 0])
    np.testing.assert_allclose(k, [[0.707106, 0], [-0.595009, 0.382051], [-0.662722, 0.246575]], atol=1e-6)  # K̃
    np.testing.assert_allclose(v, [[0.707106, 0], [0, 1.414212], [0.5, 1.0]], atol=1e-6)  # 𝖵, not rotated
    np.testing.assert_array_equal(cache.k[0, 0, 3:], 0)  # slots past the prefix untouched
    np.testing.assert_allclose(jax.nn.softmax(logits[0, -1])[examples.EOS], 0.183502, atol=1e-6)
    assert k.size + v.size == 12 and kv_cache_bytes(cfg, 3, 1, jnp.float32) == 48  # M20 §14: 12 scalars, 48 bytes


def test_next_query_uses_absolute_position_3(ex):
    cfg, params, tokens = ex
    _, cache = cached(params, tokens, init_cache(cfg, 1, 8, jnp.float64), cfg)
    step, cache = cached(params, jnp.asarray([[examples.EOS]]), cache, cfg)
    ref = full(params, jnp.asarray([[0, 1, 2, examples.EOS]]), cfg)[:, 3]
    np.testing.assert_allclose(step[:, 0], ref, rtol=0, atol=1e-13)
    wrong, _ = cached(params, jnp.asarray([[examples.EOS]]), init_cache(cfg, 1, 8, jnp.float64), cfg)
    assert np.abs(np.asarray(wrong[:, 0] - ref)).max() > 1e-3  # position 0 without the prefix is different


# ----- equivalence: full = token by token = prefill + chunks; batch = each alone ---------------------------
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
@pytest.mark.parametrize("i", range(len(CONFIGS)))
def test_full_equals_token_by_token_equals_chunks(i, dtype):
    cfg, params, tokens = model(i, dtype)
    ref = full(params, tokens, cfg)
    cache, steps, layers = init_cache(cfg, 2, 12, dtype), [], unstack_layers(params, cfg)
    for t in range(tokens.shape[1]):  # one token at a time over per-layer weights, as generate's decode steps
        out, cache = cached(params, tokens[:, t : t + 1], cache, cfg, layers=layers)
        steps.append(out)
    np.testing.assert_allclose(jnp.concatenate(steps, 1), ref, rtol=0, atol=TOL[dtype])
    cache, chunks = init_cache(cfg, 2, 12, dtype), []
    for a in (0, 4, 8):  # prefill 4, then two 4-token suffixes (one shape: one compilation), layers scanned
        out, cache = cached(params, tokens[:, a : a + 4], cache, cfg)
        chunks.append(out)
    np.testing.assert_allclose(jnp.concatenate(chunks, 1), ref, rtol=0, atol=TOL[dtype])
    np.testing.assert_array_equal(cache.lengths, [12, 12])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_batch_of_different_lengths_equals_each_alone(dtype):
    cfg, params, _ = model(0, dtype)
    rows = [[3, 1, 4, 1, 5, 9, 2], [6, 5, 3], [5, 8, 9, 7, 9]]
    lengths = [len(r) for r in rows]
    prompt = jnp.asarray([r + [0] * (7 - len(r)) for r in rows])  # right-padded
    logits, cache = cached(params, prompt, init_cache(cfg, 3, 12, dtype), cfg, n_new_B=jnp.asarray(lengths))
    np.testing.assert_array_equal(cache.lengths, lengths)
    nxt = jnp.asarray([[2], [7], [11]])
    step, cache = cached(params, nxt, cache, cfg)
    for b, r in enumerate(rows):
        # each row alone; padding after it cannot change earlier positions (causal), so one shape serves all
        alone = r + [int(nxt[b, 0])] + [0] * (7 - len(r))
        ref = full(params, jnp.asarray([alone]), cfg)[0, : len(r) + 1]
        np.testing.assert_allclose(logits[b, : len(r)], ref[:-1], rtol=0, atol=TOL[dtype])
        np.testing.assert_allclose(step[b, 0], ref[-1], rtol=0, atol=TOL[dtype])
        np.testing.assert_array_equal(cache.k[:, b, len(r) + 1 :], 0)  # padding never written


def test_row_with_no_new_tokens_is_unchanged():
    cfg, params, tokens = model(0, jnp.float64)
    _, cache = cached(params, tokens[:, :5], init_cache(cfg, 2, 12, jnp.float64), cfg)
    _, after = cached(params, tokens[:, 5:8], cache, cfg, n_new_B=jnp.asarray([3, 0]))
    np.testing.assert_array_equal(after.lengths, [8, 5])
    np.testing.assert_array_equal(after.k[:, 1], cache.k[:, 1])
    np.testing.assert_array_equal(after.v[:, 1], cache.v[:, 1])
    assert np.abs(np.asarray(after.k[:, 0] - cache.k[:, 0])).max() > 0


# ----- bad input ----------------------------------------------------------------------------------------
def test_capacity_and_counts_are_checked():
    cfg, params, tokens = model(0, jnp.float64)
    cache = init_cache(cfg, 2, 6, jnp.float64)
    with pytest.raises(InputError, match=r"row 0 would hold 7 positions \(0 cached \+ 7 new\).*max_len = 6"):
        forward_cached(params, tokens[:, :7], cache, cfg)
    with pytest.raises(InputError, match=r"n_new_B = \[4, 5\] is invalid: each count must be in \[0, 4\]"):
        forward_cached(params, tokens[:, :4], cache, cfg, n_new_B=np.array([4, 5]))
    with pytest.raises(InputError, match=r"n_new_B has shape \(3,\)"):
        forward_cached(params, tokens[:, :4], cache, cfg, n_new_B=np.array([4, 4, 4]))
    with pytest.raises(InputError, match=r"tokens\[1, 0\] = 13 is not a valid token id"):
        forward_cached(params, jnp.asarray([[1], [13]]), cache, cfg)
    with pytest.raises(InputError, match="max_len = 0 is invalid"):
        init_cache(cfg, 2, 0)


# ----- efficiency: the update is in place ------------------------------------------------------------------
@pytest.mark.parametrize("unrolled", [False, True])
def test_decode_step_updates_cache_in_place(unrolled):
    cfg = ModelConfig(vocab_size=8, d_model=8, n_layers=4, n_heads=2, n_kv_heads=1, d_head=16, d_ff=8,
                      max_seq_len=2048)
    params = random_params(cfg, 0, jnp.float32)
    cache = init_cache(cfg, 1, 2000, jnp.float32)
    step = jax.jit(forward_cached, static_argnames="cfg", donate_argnames="cache")
    layers = unstack_layers(params, cfg) if unrolled else None
    mem = step.lower(params, jnp.zeros((1, 1), jnp.int32), cache, cfg, layers=layers).compile().memory_analysis()
    cache_bytes = kv_cache_bytes(cfg, 2000, 1, jnp.float32)
    assert mem.alias_size_in_bytes >= cache_bytes  # the new cache is the donated buffer …
    assert mem.temp_size_in_bytes < 0.5 * cache_bytes  # … and no full copy is made inside the layer scan


# ----- U19 §6 memory --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kv_heads, mib", [(32, 2048), (8, 512), (1, 64)])
def test_u19_6_notebook_sizes(kv_heads, mib):
    cfg = ModelConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=kv_heads, d_head=128,
                      d_ff=11008, max_seq_len=4096)
    assert kv_cache_bytes(cfg, 4096, 1, jnp.bfloat16) == mib * 2**20
    if kv_heads == 32:
        assert kv_cache_bytes(cfg, 1, 1, jnp.bfloat16) == 524_288  # 0.5 MiB per token
    cache = jax.eval_shape(lambda: init_cache(cfg, 1, 4096, jnp.bfloat16))
    assert 2 * cache.k.size * cache.k.dtype.itemsize == mib * 2**20  # what init_cache allocates


def test_cache_is_a_pytree():
    cache = init_cache(CONFIGS[0], 2, 5)
    leaves = jax.tree.leaves(cache)
    assert [x.shape for x in leaves] == [(2, 2, 5, 2, 4), (2, 2, 5, 2, 4), (2,)]
    assert isinstance(jax.tree.map(lambda x: x, cache), DecodeState) and cache.max_len == 5
