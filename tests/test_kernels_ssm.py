"""The chunked selective scan (mlx_llm.kernels.ssm_scan) against ``mamba.fused_scan``: values and gradients
(float64 ≤ 1e-10, float32 ≤ 1e-5 relative) with document resets, an initial state, T not a multiple of the
chunk, chunk ≥ T and chunk = 1; the mixer with padding; a whole pure-Mamba model; "auto"; and the compiled
memory of the backward pass, which must not grow like the associative scan's (B, T, I, N) tensors."""

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mlx_llm import ModelConfig, init_params
from mlx_llm.kernels import backend_platform
from mlx_llm.kernels.ssm_scan import chunked_scan, resolve_ssm_scan
from mlx_llm.layers import mamba
from mlx_llm.train.step import summed_loss

B, I, N = 2, 5, 3
TOL = {jnp.float64: 1e-10, jnp.float32: 1e-5}
# Tiny graphs run a handful of times: XLA's optimisation passes cost more than they save.
jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0,
                                                   "xla_llvm_disable_expensive_passes": True})


def scan_inputs(t, dtype, seed=0, resets=True, initial=True):
    """(Δ, x, B, C, A, resets, s0) with Δ = O(0.1–1) so the state carries the past over several positions."""
    rng = np.random.default_rng(seed)
    arrays = (np.log1p(np.exp(rng.standard_normal((B, t, I)) - 1.0)), rng.standard_normal((B, t, I)),
              rng.standard_normal((B, t, N)), rng.standard_normal((B, t, N)),
              -np.arange(1.0, N + 1) * np.exp(0.3 * rng.standard_normal((I, N))))
    reset_BT = jnp.asarray(rng.random((B, t)) < 0.15) if resets else None
    s0_BIN = jnp.asarray(rng.standard_normal((B, I, N)), dtype) if initial else None
    return tuple(jnp.asarray(a, dtype) for a in arrays) + (reset_BT, s0_BIN)


def assert_close(got, want, rtol):
    """Elementwise, relative to the largest entry (a gradient's tiny entries carry its rounding in absolute)."""
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        w = np.asarray(w)
        np.testing.assert_allclose(np.asarray(g), w, rtol=rtol, atol=rtol * float(np.max(np.abs(w))))


def value_and_vjp(scan_fn, args, seed=1):
    """(y, s_last) and the gradients of (Δ, x, B, C, A[, s0]) for random cotangents on both outputs."""
    dt, x, b, c, a, reset_BT, s0 = args
    diff = (dt, x, b, c, a) + (() if s0 is None else (s0,))
    out, vjp = jax.vjp(lambda *d: scan_fn(*d[:5], reset_BT, d[5] if len(d) > 5 else None), *diff)
    rng = np.random.default_rng(seed)
    cot = tuple(jnp.asarray(rng.standard_normal(o.shape), o.dtype) for o in out)
    return out, vjp(cot)


CASES = [  # (T, chunk, resets and an initial state?), all against one fused_scan per argument set
    (37, 8, True),    # T not a multiple of the chunk: padded with identity positions
    (37, 1, True),    # chunk = 1: the sequential scan
    (37, 64, True),   # chunk ≥ T: one chunk
    (16, 4, False),   # T a multiple; no resets, zero initial state
]


@jit
def all_cases(args_with, args_without):
    """(fused, chunked) of every case, in one compiled function (one compile instead of one per case)."""
    args = {True: args_with, False: args_without}
    fused = {flag: value_and_vjp(mamba.fused_scan, a) for flag, a in args.items()}
    return [(fused[flag], value_and_vjp(functools.partial(chunked_scan, chunk=k), args[flag]))
            for _, k, flag in CASES]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32])
def test_chunked_equals_fused(dtype):
    """Values and gradients of (Δ, x, B, C, A, s0) for random cotangents on (y, s_last)."""
    results = all_cases(scan_inputs(37, dtype), scan_inputs(16, dtype, resets=False, initial=False))
    for (t, chunk, flag), (want, got) in zip(CASES, results):
        assert got[0][0].dtype == want[0][0].dtype == dtype
        assert got[0][0].shape == (B, t, I) and got[0][1].shape == (B, I, N)
        try:
            assert_close(got, want, TOL[dtype])
        except AssertionError as e:
            raise AssertionError(f"T={t}, chunk={chunk}, resets and s0: {flag}") from e


@jit
def _reset_and_padding_cases(dt, x, b, c, a, s0):
    reset_BT = jnp.zeros(dt.shape[:2], bool).at[:, 5].set(True)
    y, _ = chunked_scan(dt, x, b, c, a, reset_BT, s0, chunk=4)
    y_cut, _ = chunked_scan(dt, x.at[:, :5].set(0.0), b, c, a, reset_BT, None, chunk=4)
    _, s_pad = chunked_scan(jnp.zeros_like(dt), x, b, c, a, None, s0, chunk=4)
    return y[:, 5:], y_cut[:, 5:], s_pad


def test_resets_cut_the_past_and_padding_keeps_the_state():
    """A reset at p makes y_{≥p} independent of everything before p; all padding (Δ = 0) returns s0."""
    dt, x, b, c, a, _, s0 = scan_inputs(12, jnp.float64)
    y, y_cut, s_pad = _reset_and_padding_cases(dt, x, b, c, a, s0)
    np.testing.assert_allclose(y, y_cut, atol=1e-12)
    np.testing.assert_allclose(s_pad, s0, atol=0)
    with pytest.raises(ValueError, match="chunk = 0 is invalid"):
        chunked_scan(dt, x, b, c, a, chunk=0)


# ----- the mixer and the model -------------------------------------------------------------------------------
CFG = types.SimpleNamespace(d_model=4, ssm_state=N, ssm_conv=3, ssm_inner=I, ssm_dt_rank=2, norm_eps=1e-6,
                            n_layers=1)


def mix_layer(seed):
    rng = np.random.default_rng(seed)
    return {k: v[0] for k, v in mamba.init(CFG, lambda s, std: jnp.asarray(std * rng.standard_normal(s)), 1,
                                           jnp.float64).items()}


def test_mix_with_padding_and_initial_state_equals_fused():
    """``advance``'s call: the state before, and rows whose tail is padding (Δ = 0 there)."""
    rng = np.random.default_rng(3)
    x_BTI = jnp.asarray(rng.standard_normal((B, 11, I)))
    s0_BIN = jnp.asarray(rng.standard_normal((B, I, N)))
    real_BT = jnp.arange(11)[None, :] < jnp.array([[11], [6]])
    reset_BT = jnp.zeros((B, 11), bool).at[0, 4].set(True)
    got, want = jit(lambda *a: [mamba.mix(*a[:2], scan, *a[2:]) for scan in ("chunked", "fused")])(
        x_BTI, mix_layer(3), reset_BT, s0_BIN, real_BT)
    assert_close(got, want, 1e-12)


PURE = ModelConfig(vocab_size=11, d_model=8, max_seq_len=32, ssm_state=3, ssm_conv=3, ssm_expand=2, n_layers=2,
                   mixer_pattern=("mamba",), ffn_pattern=("none",), tie_embeddings=True)


def random_params(cfg, seed):
    """Parameters of ``init_params``'s layout drawn N(0, 0.5²) with NumPy (``init_params`` itself is eager
    jax.random, slow on a loaded CPU); O(1) Δ and A so the state carries the past."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0), jnp.float64))
    return jax.tree.map(lambda s: jnp.asarray(0.5 * rng.standard_normal(s.shape)), shapes)


@pytest.mark.slow
def test_model_loss_and_gradients_equal_fused():
    """A packed batch (segment ids restart the state): the summed loss and every parameter's gradient agree."""
    params = random_params(PURE, 0)
    rng = np.random.default_rng(4)
    tokens = jnp.asarray(rng.integers(0, 11, (2, 13)))
    segment_ids = jnp.asarray([[0] * 5 + [1] * 8, [0] * 9 + [1] * 4])
    positions = jnp.asarray([list(range(5)) + list(range(8)), list(range(9)) + list(range(4))])
    batch = dict(tokens=tokens, targets=jnp.roll(tokens, -1, axis=1), mask=jnp.ones((2, 13), bool),
                 positions=positions, segment_ids=segment_ids)

    def loss_and_grad(scan):
        cfg = dataclasses.replace(PURE, ssm_scan=scan)
        return jax.value_and_grad(lambda p: summed_loss(p, batch, cfg, jnp.float64)[0])(params)

    got, want = jit(lambda: [loss_and_grad(scan) for scan in ("chunked", "fused")])()
    assert_close(got, want, 1e-10)


# ----- "auto" and the scan names -----------------------------------------------------------------------------
def test_auto_resolves_per_platform_and_bad_scans_are_named():
    assert resolve_ssm_scan("auto", "cpu") == "fused"
    assert resolve_ssm_scan("auto", "gpu") == resolve_ssm_scan("auto", "tpu") == "chunked"
    assert [resolve_ssm_scan(s, "gpu") for s in ("fused", "associative", "chunked")] == [
        "fused", "associative", "chunked"]
    assert backend_platform() == "cpu"  # conftest: the tests run on XLA:CPU, where "auto" is "fused"
    x_BTI, layer = jnp.ones((1, 3, I)), mix_layer(5)
    jaxpr = {scan: str(jax.make_jaxpr(lambda x: mamba.mix(x, layer, scan))(x_BTI)) for scan in ("auto", "fused")}
    assert jaxpr["auto"] == jaxpr["fused"]
    with pytest.raises(ValueError, match=r"scan = 'parallel' is invalid: valid scans are "
                                         r"\['fused', 'associative', 'chunked', 'auto'\]"):
        mamba.mix(x_BTI, layer, "parallel")


# ----- memory ------------------------------------------------------------------------------------------------
def temp_bytes(scan_fn, t, n_state=32, inner=16):
    """Compiled temporary bytes of forward + backward of Σ sin(y) + Σ s_last, float32, batch 1. (The jit
    options only cut LLVM's passes; buffer assignment, which sets the number, is unchanged.)"""
    shapes = ((1, t, inner),) * 2 + ((1, t, n_state),) * 2 + ((inner, n_state),)
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]

    def loss(*args):
        y, s_last = scan_fn(*args)
        return jnp.sum(jnp.sin(y)) + jnp.sum(s_last)

    grad = jit(jax.grad(loss, argnums=tuple(range(5))))
    return grad.lower(*args).compile().memory_analysis().temp_size_in_bytes


def via_associative(dt, x, b, c, a):
    s_BTIN = mamba.selective_scan(*mamba.discretise(dt, x, b, a))
    return jnp.einsum("btin,btn->bti", s_BTIN, c), s_BTIN[:, -1]


@pytest.mark.slow
def test_backward_memory_grows_far_less_than_the_associative_scans():
    """At T = 1024 the associative scan holds several (B, T, I, N) tensors; the chunked scan one chunk's
    (B, 64, I, N) tensors plus (B, T, I)-sized ones, so from T = 256 to 1024 it grows by less than half of one
    (B, T, I, N) tensor's growth (chunk boundaries: 16 states of B·I·N)."""
    chunked = functools.partial(chunked_scan, chunk=64)
    assoc, chunked_small, chunked_large = (temp_bytes(via_associative, 1024), temp_bytes(chunked, 256),
                                           temp_bytes(chunked, 1024))
    state_bytes_per_position = 16 * 32 * 4  # I·N float32
    assert assoc >= 2 * 1024 * state_bytes_per_position
    assert chunked_large < assoc / 4
    assert chunked_large - chunked_small < 768 * state_bytes_per_position / 2
