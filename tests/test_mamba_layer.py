"""The Mamba-1 mixer (mlx_llm.layers.mamba): M20 §19's scalar case, parallel = sequential scan, the branch
against an independent NumPy float64 reference, packed documents, decode = full sequence, gradients against
central differences, and the published initialisation. Float64, tiny shapes, shared compiled functions."""

import jax

jax.config.update("jax_enable_x64", True)

import functools  # noqa: E402
import math  # noqa: E402
import types  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.flatten_util import ravel_pytree  # noqa: E402

import numpy_mamba_reference as ref  # noqa: E402  (tests/ is on sys.path under pytest's default import mode)
from mlx_llm.layers import mamba  # noqa: E402

CFG = types.SimpleNamespace(d_model=6, ssm_state=3, ssm_conv=4, ssm_inner=8, ssm_dt_rank=2, norm_eps=1e-6,
                            n_layers=2)
D, I, N, W, R = 6, 8, 3, 4, 2
B, T = 2, 9
TOL = 1e-10
# Tiny graphs run a handful of times: XLA's optimisation passes cost more than they save.
jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0,
                                                   "xla_llvm_disable_expensive_passes": True})
# Packed rows: documents of lengths (4, 3, 2) and (2, 6, 1); ids need not be sorted, only contiguous.
SEGMENTS = np.array([[0, 0, 0, 0, 1, 1, 1, 2, 2], [5, 5, 7, 7, 7, 7, 7, 7, 3]])


def rand(seed, shape, scale=1.0):
    return jnp.asarray(scale * np.random.default_rng(seed).standard_normal(shape))


def numpy_normal(seed, dtype=np.float64):
    """A ``normal(shape, std)`` over a NumPy stream that records its calls (no jax.random compile)."""
    rng = np.random.default_rng(seed)

    def normal(shape, std):
        normal.calls.append(shape)
        return jnp.asarray((std * rng.standard_normal(shape)).astype(dtype))

    normal.calls = []
    return normal


@functools.lru_cache(maxsize=None)
def layer0():
    """Layer 0 of ``init`` with every fixed-at-init key perturbed (norm gain, conv bias, D, A, and Δ moved to
    O(1) so the state really carries the past), so a wrong use of any of them shows."""
    p = {k: v[0] for k, v in mamba.init(CFG, numpy_normal(0), 2, jnp.float64).items()}
    p["ssm_norm"] = p["ssm_norm"] + rand(1, (D,), 0.3)
    p["conv_b"] = rand(2, (I,), 0.3)
    p["D"] = p["D"] + rand(3, (I,), 0.3)
    p["A_log"] = p["A_log"] + rand(4, (I, N), 0.2)
    p["dt_bias"] = rand(5, (I,), 0.5)
    return p


_branch = jit(lambda h, layer, seg: mamba.branch(h, layer, CFG, types.SimpleNamespace(segment_ids_BT=seg)))
_advance = jit(lambda h, layer, conv, ssm, n: mamba.advance(h, layer, CFG, conv, ssm, n))
_selective = jit(mamba.selective_scan)
_sequential = jit(mamba.sequential_scan)


def branch(h, seg=None):
    return np.asarray(_branch(jnp.asarray(h), layer0(), None if seg is None else jnp.asarray(seg)))


def max_err(got, want):
    return float(np.max(np.abs(np.asarray(got) - np.asarray(want))))


# ----- M20 §19 and the scans -----------------------------------------------------------------------------
def test_m20_s19_scalar_case():
    """Ā = 0.5, B̄ = C = 1, D = 0, s_{−1} = 0, inputs (1, 0, −1) → states and outputs (1, 0.5, −0.75)."""
    s, y = mamba.recurrence(0.5, 1.0, 1.0, jnp.array([1.0, 0.0, -1.0]), 0.0)
    assert np.array_equal(np.asarray(s), [1.0, 0.5, -0.75])
    assert np.array_equal(np.asarray(y), [1.0, 0.5, -0.75])
    s_par = mamba.selective_scan(jnp.full((1, 3, 1, 1), 0.5), jnp.array([1.0, 0.0, -1.0]).reshape(1, 3, 1, 1))
    assert np.array_equal(np.asarray(s_par).ravel(), [1.0, 0.5, -0.75])


@pytest.mark.parametrize("case", ["plain", "resets", "resets_and_s0"])
def test_associative_scan_equals_sequential(case):
    rng = np.random.default_rng(10)
    t = 13  # not a power of two: the associative scan's odd/even split is exercised
    dA = jnp.asarray(rng.uniform(0.3, 1.0, (B, t, 3, 2)))
    dBx = jnp.asarray(rng.standard_normal((B, t, 3, 2)))
    reset = jnp.asarray(rng.random((B, t)) < 0.3) if case != "plain" else None
    s0 = jnp.asarray(rng.standard_normal((B, 3, 2))) if case == "resets_and_s0" else None
    par, seq = _selective(dA, dBx, reset, s0), _sequential(dA, dBx, reset, s0)
    err = max_err(par, seq)
    assert err <= 1e-12, err
    if reset is not None:  # a reset really drops the past: the state there is exactly B̄x at that position
        r = np.asarray(reset)
        assert np.array_equal(np.asarray(seq)[r], np.asarray(dBx)[r])
        assert max_err(seq, _sequential(dA, dBx, None, s0)) > 1e-2


def _scan_inputs(seed, t=11):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.uniform(0.05, 1.5, (B, t, 5))), rand(seed + 1, (B, t, 5)), rand(seed + 2, (B, t, 3)),
            rand(seed + 3, (B, t, 3)), -jnp.asarray(rng.uniform(0.2, 2.0, (5, 3))),
            jnp.asarray(rng.random((B, t)) < 0.25), rand(seed + 4, (B, 5, 3)))


def _via_associative(dt, x, b, c, a, reset, s0):
    s = mamba.selective_scan(*mamba.discretise(dt, x, b, a), reset, s0)
    return jnp.einsum("btin,btn->bti", s, c), s[:, -1]


def _scan_loss(scan, *args):
    y, s_last = scan(*args)  # a loss that weighs every output and the last state differently
    return jnp.sum(jnp.sin(y) * jnp.arange(y.size).reshape(y.shape) / y.size) + jnp.sum(s_last ** 3)


_fused_value_and_grad = jit(jax.value_and_grad(functools.partial(_scan_loss, mamba.fused_scan),
                                               argnums=(0, 1, 2, 3, 4, 6)))
_assoc_value_and_grad = jit(jax.value_and_grad(functools.partial(_scan_loss, _via_associative),
                                               argnums=(0, 1, 2, 3, 4, 6)))


def test_fused_scan_equals_associative_scan_values_and_gradients():
    """The fused scan (one pass, hand-written backward) against autodiff through the associative scan: outputs,
    last state and the gradients of every input (Δ, x, B, C, A, s_{−1}), with resets, float64."""
    args = _scan_inputs(30)
    y, s_last = jit(mamba.fused_scan)(*args)
    y_ref, s_ref = _via_associative(*args)
    assert max_err(y, y_ref) <= 1e-12 and max_err(s_last, s_ref) <= 1e-12
    (v, grads), (v_ref, grads_ref) = _fused_value_and_grad(*args), _assoc_value_and_grad(*args)
    assert abs(float(v - v_ref)) <= 1e-12
    for name, g, g_ref in zip(("dt", "x", "B", "C", "A", "s0"), grads, grads_ref):
        scale = float(np.max(np.abs(np.asarray(g_ref))))
        assert scale > 1e-3, name  # every input really matters
        assert max_err(g, g_ref) <= 1e-12 * max(1.0, scale), (name, max_err(g, g_ref))


def test_zero_step_is_the_identity():
    """Δ = 0 gives Ā = 1, B̄x = 0: the state passes through unchanged (``advance`` pads with it)."""
    dt, x, b, c, a, _, s0 = _scan_inputs(31)
    dt = dt.at[:, 4:].set(0.0)
    _, s_last = mamba.fused_scan(dt, x, b, c, a, None, s0)
    _, s_at_3 = mamba.fused_scan(dt[:, :4], x[:, :4], b[:, :4], c[:, :4], a, None, s0)
    assert max_err(s_last, s_at_3) <= 1e-14


@pytest.mark.parametrize("packed", [False, True])
def test_branch_is_the_same_under_either_scan(packed):
    h = rand(32, (B, T, D))
    seg = jnp.asarray(SEGMENTS) if packed else None
    assoc_cfg = types.SimpleNamespace(**vars(CFG), ssm_scan="associative")
    got = jit(lambda h, layer, seg: mamba.branch(h, layer, assoc_cfg, types.SimpleNamespace(segment_ids_BT=seg)))(
        h, layer0(), seg)
    assert max_err(got, branch(h, seg)) <= 1e-12
    with pytest.raises(ValueError, match=r"scan = 'parallel' is invalid: valid scans are \['fused', 'associative', 'chunked', 'auto'\]"):
        mamba.mix(h, layer0(), "parallel")


# ----- the branch against NumPy, packed documents -----------------------------------------------------------
@pytest.mark.parametrize("packed", [False, True])
def test_branch_matches_numpy_reference(packed):
    h = rand(20, (B, T, D))
    seg = SEGMENTS if packed else None
    got = branch(h, seg)
    want = ref.branch(h, layer0(), CFG.norm_eps, seg)
    err = max_err(got, want)
    assert err <= TOL, err
    assert max_err(got, h) > 1e-2  # the mixer contributes


def test_packed_documents_equal_each_document_alone():
    h = np.asarray(rand(21, (B, T, D)))
    packed = branch(h, SEGMENTS)
    docs = [(b, s, e) for b in range(B) for s, e in _runs(SEGMENTS[b])]
    alone_rows = np.array(rand(22, (len(docs), T, D)))  # causal: whatever follows a document is irrelevant
    for k, (b, s, e) in enumerate(docs):
        alone_rows[k, : e - s] = h[b, s:e]
    errs = []
    for k in range(0, len(docs), B):  # run alone, B rows per call (the same compiled shape)
        out = branch(alone_rows[k:k + B], np.zeros((B, T), int))
        for j, (b, s, e) in enumerate(docs[k:k + B]):
            errs.append(max_err(packed[b, s:e], out[j, : e - s]))
    assert max(errs) <= 1e-12, errs
    assert max_err(branch(h, np.zeros((B, T), int)), packed) > 1e-3  # the boundaries matter


def _runs(ids):
    starts = [0] + [t for t in range(1, len(ids)) if ids[t] != ids[t - 1]] + [len(ids)]
    return list(zip(starts[:-1], starts[1:]))


# ----- decoding ------------------------------------------------------------------------------------------------
def decode_in_chunks(h, chunks):
    """``advance`` over h (B, T, D) in chunks given as lists of per-row real counts; returns the outputs at
    real positions of each row (concatenated) and the final state."""
    conv, ssm = mamba.init_state(CFG, h.shape[0], jnp.float64)
    done = np.zeros(h.shape[0], int)
    outs = [[] for _ in range(h.shape[0])]
    for n_new in chunks:
        n_new = np.asarray(n_new)
        width = int(n_new.max())
        chunk = np.array(rand(int(done.sum()) + 100, (h.shape[0], width, D), 10.0))  # loud padding
        for b in range(h.shape[0]):
            chunk[b, : n_new[b]] = h[b, done[b]: done[b] + n_new[b]]
        out, conv, ssm = _advance(jnp.asarray(chunk), layer0(), conv, ssm, jnp.asarray(n_new))
        for b in range(h.shape[0]):
            outs[b].append(np.asarray(out)[b, : n_new[b]])
        done += n_new
    return [np.concatenate(o) for o in outs], (conv, ssm)


@pytest.mark.parametrize("chunks", [[[1, 1]] * T, [[5, 5], [2, 2], [1, 1], [1, 1]]], ids=["tokens", "chunks"])
def test_decode_equals_full_sequence(chunks):
    h = np.asarray(rand(30, (B, T, D)))
    full = branch(h)
    outs, _ = decode_in_chunks(h, chunks)
    err = max(max_err(outs[b], full[b]) for b in range(B))
    assert err <= TOL, err


def test_ragged_batch_equals_each_row_alone():
    """Row 0 gets 9 tokens as 5+2+1+1, row 1 gets 6 as 3+2+0+1 (padding in every chunk but the second)."""
    h = np.asarray(rand(31, (B, T, D)))
    outs, _ = decode_in_chunks(h, [[5, 3], [2, 2], [1, 0], [1, 1]])
    assert [len(o) for o in outs] == [9, 6]
    full = branch(h)  # each row alone: the branch never mixes rows, and is causal
    err = max(max_err(outs[0], full[0]), max_err(outs[1], full[1, :6]))
    assert err <= TOL, err


def test_padding_leaves_state_unchanged():
    conv, ssm = rand(32, (B, W - 1, I)), rand(33, (B, I, N))
    h = rand(34, (B, 2, D), 10.0)
    _, conv2, ssm2 = _advance(h, layer0(), conv, ssm, jnp.array([0, 1]))
    assert np.array_equal(conv2[0], conv[0]) and np.array_equal(ssm2[0], ssm[0])
    assert max_err(conv2[1], conv[1]) > 1e-3 and max_err(ssm2[1], ssm[1]) > 1e-3  # a real token moves it
    assert np.array_equal(conv2[1], jnp.concatenate([conv[1, 1:], conv2[1, -1:]]))  # the window slides by one


# ----- gradients -----------------------------------------------------------------------------------------------
def test_grad_matches_central_differences():
    """d/dθ Σ G ⊙ branch(H; θ) for every parameter and H, packed (so the resets are differentiated too)."""
    t, step = 5, 1e-6
    h, g = rand(40, (B, t, D)), rand(41, (B, t, D))
    seg = jnp.array([[0, 0, 1, 1, 1], [0, 0, 0, 0, 0]])
    flat, unravel = ravel_pytree((layer0(), h))

    def f(v):
        layer, hh = unravel(v)
        return jnp.sum(g * mamba.branch(hh, layer, CFG, types.SimpleNamespace(segment_ids_BT=seg)))

    grad = np.asarray(jit(jax.grad(f))(flat))
    eye = np.eye(flat.size) * step
    fs = np.asarray(jit(jax.vmap(f))(jnp.concatenate([flat + eye, flat - eye])))
    fd = (fs[: flat.size] - fs[flat.size:]) / (2 * step)
    got, want = unravel(jnp.asarray(grad)), unravel(jnp.asarray(fd))
    rels = {}
    for name, w in {**want[0], "h": want[1]}.items():
        gg = got[1] if name == "h" else got[0][name]
        rels[name] = max_err(gg, w) / float(np.max(np.abs(w)))
    assert max(rels.values()) <= 1e-6, rels


# ----- initialisation ------------------------------------------------------------------------------------------
SHAPES = {"ssm_norm": (D,), "in_x": (D, I), "in_z": (D, I), "conv_w": (W, I), "conv_b": (I,), "w_dt": (I, R),
          "w_B": (I, N), "w_C": (I, N), "dt_proj": (R, I), "dt_bias": (I,), "A_log": (I, N), "D": (I,),
          "out_proj": (I, D)}


def test_init_as_published():
    L = 3
    normal = numpy_normal(7)
    p = mamba.init(CFG, normal, L, jnp.float64)
    assert len(normal.calls) == mamba.DRAWS
    assert {k: v.shape for k, v in p.items()} == {k: (L, *s) for k, s in SHAPES.items()}
    n1 = np.arange(1, N + 1, dtype=np.float64)
    assert np.array_equal(p["A_log"], np.broadcast_to(np.log(n1), (L, I, N)))
    a = -np.exp(np.asarray(p["A_log"]))
    assert np.all(np.abs(a + n1) <= 2 * np.finfo(np.float64).eps * n1)  # A = −(n+1) to the last bit or two
    assert np.all(np.asarray(p["D"]) == 1) and np.all(np.asarray(p["conv_b"]) == 0)
    assert np.all(np.asarray(p["ssm_norm"]) == 1)
    dt = np.logaddexp(0.0, np.asarray(p["dt_bias"]))
    assert np.all((dt >= 1e-3) & (dt <= 1e-1)), dt
    assert dt.min() < 1e-2 < dt.max()  # spread over the range, not a constant


def test_init_scales_and_dt_transform():
    """With a ``normal`` that returns std·1, every key holds exactly its standard deviation, and z = 1 gives
    Δ = exp(log 1e-3 + Φ(1)·log 100)."""
    p = mamba.init(CFG, lambda shape, std: jnp.full(shape, std), 1, jnp.float64)
    std = {"in_x": 1 / math.sqrt(D), "in_z": 1 / math.sqrt(D), "conv_w": 1 / math.sqrt(W),
           "w_dt": 1 / math.sqrt(I), "w_B": 1 / math.sqrt(I), "w_C": 1 / math.sqrt(I), "dt_proj": 1 / math.sqrt(R),
           "out_proj": 1 / math.sqrt(I) / math.sqrt(2 * CFG.n_layers)}
    for name, s in std.items():
        assert np.allclose(p[name], s, rtol=1e-15, atol=0), name
    phi1 = 0.5 * (1 + math.erf(1 / math.sqrt(2)))
    want = math.exp(math.log(1e-3) + phi1 * math.log(100.0))
    assert np.allclose(np.logaddexp(0.0, np.asarray(p["dt_bias"])), want, rtol=1e-13, atol=0)
    p32 = mamba.init(CFG, numpy_normal(8, np.float32), 1, jnp.float32)
    assert {v.dtype for v in p32.values()} == {jnp.dtype(jnp.float32)}
    conv, ssm = mamba.init_state(CFG, 2, jnp.bfloat16)
    assert conv.shape == (2, W - 1, I) and conv.dtype == jnp.bfloat16
    assert ssm.shape == (2, I, N) and ssm.dtype == jnp.float32 and not np.any(np.asarray(ssm))
