"""The chunked loss (kernels/loss.py) equals token_nll(Λ = R U) in value and gradient (M20 §8, §10, §11),
and its compiled forward + backward never holds a (B·T, V) array."""

import json
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mlx_llm import ModelConfig, init_params
from mlx_llm.errors import InputError
from mlx_llm.kernels.loss import choose_chunk, chunked_token_nll
from mlx_llm.model import hidden_states, logits_from_hidden, unembed_matrix
from mlx_llm.ops import token_nll
from mlx_llm.ops import dense, rms_norm
from helpers import python

B, T, D, V = 2, 5, 6, 11  # B·T = 10 rows
TOL = {jnp.float64: dict(rtol=1e-12, atol=1e-12), jnp.float32: dict(rtol=1e-5, atol=1e-6)}


def reference_nll(r_BTD, u_DV, targets_BT):
    """The path the train step takes today: full logits in ≥ float32, then token_nll."""
    acc = jnp.promote_types(r_BTD.dtype, jnp.float32)
    return token_nll(dense(r_BTD, u_DV, preferred_element_type=acc), targets_BT)


def problem(dtype, seed=0):
    """r, U, targets, a cotangent and a mask, drawn with NumPy (no random-number programs to compile)."""
    rng = np.random.default_rng(seed)
    r_BTD = jnp.asarray(rng.standard_normal((B, T, D)), dtype)
    u_DV = jnp.asarray(2.0 * rng.standard_normal((D, V)), dtype)  # wide logits: a peaked softmax
    targets_BT = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
    g_BT = jnp.asarray(rng.standard_normal((B, T)), jnp.promote_types(dtype, jnp.float32))
    mask_BT = jnp.asarray(rng.random((B, T)) < 0.7)
    return r_BTD, u_DV, targets_BT, g_BT, mask_BT


def value_vjp_and_masked_grad(nll_fn):
    """nll, (dr, dU) for a random cotangent on nll_BT, and ∇ of Σ b·nll as the train step forms it."""

    @jax.jit
    def run(r_BTD, u_DV, targets_BT, g_BT, mask_BT):
        nll_BT, vjp = jax.vjp(lambda r, u: nll_fn(r, u, targets_BT), r_BTD, u_DV)
        masked = lambda r, u: jnp.sum(mask_BT.astype(nll_BT.dtype) * nll_fn(r, u, targets_BT))  # noqa: E731
        return nll_BT, vjp(g_BT), jax.grad(masked, argnums=(0, 1))(r_BTD, u_DV)

    return run


def assert_trees_close(actual, expected, **tol):
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(e, np.float64), **tol)


REFERENCE = value_vjp_and_masked_grad(reference_nll)


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32])
@pytest.mark.parametrize("chunk", [1, 7, B * T, 16])  # one row; not a divisor of B·T; all rows; more than all
def test_values_and_gradients_equal_the_full_logits(dtype, chunk):
    args = problem(dtype)
    chunked = value_vjp_and_masked_grad(lambda r, u, y: chunked_token_nll(r, u, y, chunk=chunk))
    got, want = chunked(*args), REFERENCE(*args)
    assert_trees_close(got, want, **TOL[dtype])
    assert float(jnp.max(jnp.abs(want[1][1]))) > 0.1  # the comparison is of gradients that are not ~0


def test_tied_embeddings_gradient_flows_through_the_transpose():
    r_BTD, _, targets_BT, g_BT, _ = problem(jnp.float64)
    embed_VD = jnp.asarray(np.random.default_rng(7).standard_normal((V, D)))

    def grads(nll_fn):
        loss = lambda r, e: jnp.sum(g_BT * nll_fn(r, e.T, targets_BT))  # noqa: E731
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(r_BTD, embed_VD)

    got = grads(lambda r, u, y: chunked_token_nll(r, u, y, chunk=3))
    assert_trees_close(got, grads(reference_nll), **TOL[jnp.float64])


def test_bfloat16_inputs_match_the_float32_reference():
    """bf16 R and U, products accumulated in f32. The loss is f32 and agrees with the f32 reference on the same
    (upcast) values to f32 rounding, since bf16 × bf16 products are exact in f32. The gradients leave in bf16,
    so they carry its rounding: within 2⁻⁷ of the gradient's largest entry, and within 2⁻⁷ of the bf16
    full-logits path too (the same arithmetic, chunked)."""
    r16, u16, targets_BT, g_BT, mask_BT = problem(jnp.bfloat16)
    chunked = value_vjp_and_masked_grad(lambda r, u, y: chunked_token_nll(r, u, y, chunk=4))
    got = chunked(r16, u16, targets_BT, g_BT, mask_BT)
    want32 = REFERENCE(r16.astype(jnp.float32), u16.astype(jnp.float32), targets_BT, g_BT, mask_BT)
    want16 = REFERENCE(r16, u16, targets_BT, g_BT, mask_BT)
    assert got[0].dtype == jnp.float32 and got[1][0].dtype == got[1][1].dtype == jnp.bfloat16
    np.testing.assert_allclose(got[0], want32[0], rtol=1e-5, atol=1e-5)
    for want in (want32, want16):
        for a, e in zip(jax.tree.leaves(got[1:]), jax.tree.leaves(want[1:])):
            e = np.asarray(e, np.float64)
            np.testing.assert_allclose(np.asarray(a, np.float64), e, rtol=0, atol=2**-7 * np.abs(e).max())


@pytest.mark.slow
@pytest.mark.parametrize("tie", [False, True])
def test_whole_model_loss_and_every_parameter_gradient(tie):
    cfg = ModelConfig(vocab_size=13, d_model=8, n_layers=2, n_heads=2, n_kv_heads=1, d_head=4, d_ff=12,
                      max_seq_len=8, tie_embeddings=tie)
    # init_params' layout with NumPy draws: compiling its jax.random programs would take most of this file's time
    rng = np.random.default_rng(3)
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0), dtype=jnp.float64))
    params = jax.tree.map(lambda s: jnp.asarray(0.5 * rng.standard_normal(s.shape)), shapes)
    tokens_BT, targets_BT = (jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 6))) for _ in range(2))
    b_BT = jnp.asarray(rng.random((2, 6)) < 0.8, jnp.float64)

    def full(p):
        h_BTD = hidden_states(p, tokens_BT, cfg)
        return jnp.sum(b_BT * token_nll(logits_from_hidden(h_BTD, p, cfg), targets_BT))

    def chunked(p):
        r_BTD = rms_norm(hidden_states(p, tokens_BT, cfg), p["final_norm"], cfg.norm_eps)
        return jnp.sum(b_BT * chunked_token_nll(r_BTD, unembed_matrix(p, cfg), targets_BT, chunk=5))

    got, want = (jax.jit(jax.value_and_grad(f))(params) for f in (chunked, full))
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert_trees_close(got, want, rtol=1e-10, atol=1e-12)


def test_targets_have_no_cotangent():
    r_BTD, u_DV, targets_BT, g_BT, _ = problem(jnp.float64)
    _, vjp = jax.vjp(lambda r, u, y: chunked_token_nll(r, u, y, chunk=4), r_BTD, u_DV, targets_BT)
    assert vjp(g_BT)[2].dtype == jax.dtypes.float0


def compiled_temp_bytes(nll_fn, n_rows, d, vocab):
    """Scratch memory XLA plans for ∇_{r,U} Σ nll at these shapes (compiled, never run)."""
    r = jax.ShapeDtypeStruct((n_rows // 2, 2, d), jnp.float32)
    u = jax.ShapeDtypeStruct((d, vocab), jnp.float32)
    y = jax.ShapeDtypeStruct((n_rows // 2, 2), jnp.int32)
    grad = jax.grad(lambda r, u, y: jnp.sum(nll_fn(r, u, y)), argnums=(0, 1))
    return jax.jit(grad).lower(r, u, y).compile().memory_analysis().temp_size_in_bytes


def test_compiled_memory_stays_below_one_logits_array():
    n_rows, d, vocab = 2048, 32, 8192
    logits_bytes = n_rows * vocab * 4  # one (B·T, V) float32 array: 64 MiB
    chunk = choose_chunk(n_rows, vocab, target_bytes=4 * 2**20)  # 128 rows: a 4 MiB tile
    chunked = compiled_temp_bytes(lambda r, u, y: chunked_token_nll(r, u, y, chunk=chunk), n_rows, d, vocab)
    full = compiled_temp_bytes(reference_nll, n_rows, d, vocab)
    assert chunk == 128
    assert chunked < logits_bytes / 4, (chunked, logits_bytes)
    assert full > logits_bytes, (full, logits_bytes)


@pytest.mark.parametrize("n_rows, vocab, target, expected", [
    (8192, 128256, 256 * 2**20, 512),  # budget 523 rows → 16 even chunks of 512, no padding
    (4096, 32768, 256 * 2**20, 2048),
    (10, 11, 256 * 2**20, 10),         # everything fits: one chunk of all rows
    (100, 2**30, 256 * 2**20, 1),      # not even one row fits the budget: one row
    (1000, 1000, 4 * 20_000, 16),      # budget 20 → rounded to 16 rows: 63 chunks of 16
    (1000, 1000, 4 * 6_000, 6),        # a budget under 8 rows is used as it is
])
def test_choose_chunk(n_rows, vocab, target, expected):
    chunk = choose_chunk(n_rows, vocab, target)
    assert chunk == expected
    assert 1 <= chunk <= n_rows
    assert chunk * vocab * 4 <= max(target, vocab * 4)
    assert chunk % 8 == 0 or chunk == n_rows or chunk < 8


def test_choose_chunk_bounds_over_a_grid():
    for n_rows in (1, 7, 8, 9, 63, 1000, 4097):
        for vocab in (1, 50, 32768, 128256):
            for target in (1, 2**20, 256 * 2**20):
                chunk = choose_chunk(n_rows, vocab, target)
                assert 1 <= chunk <= n_rows
                assert chunk == 1 or chunk * vocab * 4 <= target
                assert chunk % 8 == 0 or chunk == n_rows or chunk < 8


SHARDED = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from mlx_llm.kernels.loss import chunked_token_nll
    from mlx_llm.ops import token_nll

    mesh = Mesh(np.array(jax.devices()), ("data",))
    rng = np.random.default_rng(0)
    rows, cols = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    r = jax.device_put(jnp.asarray(rng.standard_normal((4, 16, 8)), jnp.float32), rows)
    u = jax.device_put(jnp.asarray(rng.standard_normal((8, 64)), jnp.float32), cols)
    y = jax.device_put(jnp.asarray(rng.integers(0, 64, (4, 16)), jnp.int32), rows)

    def grad_of(nll_fn):
        return jax.jit(jax.value_and_grad(lambda r, u: jnp.sum(nll_fn(r, u)), argnums=(0, 1)))

    chunked = grad_of(lambda r, u: chunked_token_nll(r, u, y, chunk=8))  # 8 chunks of the 64 rows
    full = grad_of(lambda r, u: token_nll(jnp.matmul(r, u), y))
    hlo = chunked.lower(r, u).compile().as_text()
    got, want = chunked(r, u), full(r, u)
    err = max(float(jnp.abs(a - b).max() / jnp.abs(b).max()) for a, b in zip(jax.tree.leaves(got),
                                                                         jax.tree.leaves(want)))
    print(json.dumps({"all_gathers": hlo.count("all-gather-start") + hlo.count("all-gather("), "err": err,
                      "devices": len(got[1][0].sharding.device_set)}))
""")


@pytest.mark.slow
def test_batch_sharded_rows_are_not_gathered():
    """2 simulated devices, R split over the batch: every chunk takes rows from both devices, so the loop over
    chunks runs on each device's own rows (no all-gather of R), and the result equals the full-logits loss."""
    proc = python("-c", SHARDED, devices=2, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["all_gathers"] == 0 and result["devices"] == 2 and result["err"] <= 1e-5, result


def test_bad_input_is_rejected():
    r_BTD, u_DV, targets_BT, _, _ = problem(jnp.float64)
    with pytest.raises(InputError, match="chunk"):
        chunked_token_nll(r_BTD, u_DV, targets_BT, chunk=0)
    with pytest.raises(InputError, match="do not match"):
        chunked_token_nll(r_BTD, u_DV.T, targets_BT, chunk=4)
    with pytest.raises(InputError, match="leading shape"):
        chunked_token_nll(r_BTD, u_DV, targets_BT[:, :2], chunk=4)
    with pytest.raises(InputError, match="positive"):
        choose_chunk(0, V)
