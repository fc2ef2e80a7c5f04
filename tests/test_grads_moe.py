"""M20 §15: the hand-derived MoE backward (mlx_llm.objectives.grads) against jax.vjp / jax.grad and central
differences, for a fixed selected expert set."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

jax.config.update("jax_enable_x64", True)

import mlx_llm  # noqa: E402
from mlx_llm import ops  # noqa: E402
from mlx_llm.layers import moe  # noqa: E402
from mlx_llm.objectives import grads  # noqa: E402
from mlx_llm.gradcheck import assert_close, quick_jit as jit  # noqa: E402

REL = 1e-10  # analytic against jax.vjp, norm-relative (mlx_llm.gradcheck.assert_close)

FD_STEP, FD_GAP = 1e-6, 1e-7
X, D, M, B, T = 4, 6, 5, 2, 3
MOE_KEYS = ("ffn_norm", "router", "router_offset", "expert_gate", "expert_up", "expert_down",
            "shared_gate", "shared_up", "shared_down")
EXPERT_KEYS = ("expert_gate", "expert_up", "expert_down")


def assert_grads_close(got, want, rel=REL):
    assert_close(got[0], want[0], rel, "G_Z")
    assert sorted(got[1]) == sorted(want[1])
    for name in want[1]:
        assert_close(got[1][name], want[1][name], rel, name)


def rand(seed, shape, scale=1.0):
    """Float64 test inputs from NumPy (eager jax.random would compile a kernel per shape)."""
    return jnp.asarray(scale * np.random.default_rng(seed).standard_normal(shape))


def branch_out(z_BTD, layer, cfg):
    """``moe.branch``'s output H (its aux, the expert load, is not differentiable)."""
    return moe.branch(z_BTD, layer, cfg)[0]


def make_cfg(router, n_shared, top_k):
    return mlx_llm.ModelConfig(vocab_size=7, d_model=D, n_layers=1, n_heads=2, n_kv_heads=1, d_head=4,
                               max_seq_len=16, ffn_pattern=("moe",), n_experts=X, moe_top_k=top_k, moe_d_ff=M,
                               n_shared_experts=n_shared, router=router)


@functools.lru_cache(maxsize=None)
def base_layer(n_shared):
    """The MoE keys of layer 0 of ``init_params`` (S = 1; S = 0 drops the shared keys), non-unit norm gains."""
    init = jit(lambda key: mlx_llm.init_params(make_cfg("sigmoid", 1, 1), key, jnp.float64)["blocks"])
    layer = {name: a[0] for name, a in init(jax.random.key(0)).items() if name in MOE_KEYS}
    layer["ffn_norm"] = layer["ffn_norm"] + rand(1, (D,), 0.3)
    return {name: a for name, a in layer.items() if n_shared or not name.startswith("shared_")}


def moe_case(router, n_shared, top_k, *, router_scale=1.0, unused=None):
    """(cfg, layer, z, g): nonzero offsets; expert ``unused`` gets an offset so low that no row selects it."""
    layer = dict(base_layer(min(n_shared, 1)))
    offsets = np.array(rand(2, (X,), 0.3))
    if unused is not None:
        offsets[unused] = -100.0
    layer["router_offset"] = jnp.asarray(offsets)
    layer["router"] = router_scale * layer["router"]
    return make_cfg(router, n_shared, top_k), layer, rand(3, (B, T, D)), rand(4, (B, T, D))


ROUTERS = ("sigmoid", "softmax")
UNUSED = X - 1  # the last expert: the dispatch's padding blocks are clamped to it
# Separated logits and an unused expert for central differences; S = 1, k = 2 is also a jax.vjp case.
FD_CASE = {"router_scale": 3.0, "unused": UNUSED}
# name → (moe_case arguments, the branch jax.vjp differentiates)
CASES = {f"{r}-S{s}-k{k}": ((r, s, k), FD_CASE if (s, k) == (1, 2) else {})
         for r in ROUTERS for s in (0, 1) for k in (1, 2)}


@functools.lru_cache(maxsize=None)
def analytic_and_vjp():
    """(cases, name → (moe_branch_backward, jax.vjp of the branch, jax.grad of ⟨G, moe.branch⟩ w.r.t. the
    layer)) for every case, in ONE compilation (~2 s each if separate)."""
    cases = {name: moe_case(*args, **kw) for name, (args, kw) in CASES.items()}

    @jit
    def run(arrays):
        out = {}
        for name, (layer, z, g) in arrays.items():
            cfg = cases[name][0]
            got = grads.moe_branch_backward(z, layer, cfg, g)
            want = jax.vjp(lambda z, layer: branch_out(z, layer, cfg), z, layer)[1](g)
            grad = jax.grad(lambda layer: jnp.sum(g * branch_out(z, layer, cfg)))(layer)
            out[name] = got, want, grad
        return out

    return cases, run({name: case[1:] for name, case in cases.items()})


# ----- 1. the router weights' backward against jax.vjp of route ---------------------------------------

@pytest.mark.parametrize("router, top_k, eps", [("sigmoid", 2, 1e-9), ("sigmoid", 3, 0.5), ("softmax", 2, 1e-9),
                                                ("softmax", 3, 1e-9)])
def test_router_weights_backward_matches_vjp(router, top_k, eps):
    logits, offsets, g_w = rand(10, (5, X), 2.0), rand(11, (X,), 0.3), rand(12, (5, top_k))

    @jit
    def both(logits, g_w):
        ids, _ = moe.route(logits, offsets, top_k, router=router, eps=eps)
        _, pullback = jax.vjp(lambda r: moe.route(r, offsets, top_k, router=router, eps=eps)[1], logits)
        got = grads.router_weights_backward(logits, ids, g_w, router=router, eps=eps)
        return ids, got, pullback(g_w)[0]

    ids, got, want = both(logits, g_w)
    assert_close(got, want, what=f"{router} eps={eps}")
    unselected = np.ones((5, X), bool)
    np.put_along_axis(unselected, np.asarray(ids), False, axis=-1)
    assert np.all(np.asarray(got)[unselected] == 0.0) and np.all(np.asarray(want)[unselected] == 0.0)


# ----- 2. the whole branch against jax.vjp of moe.branch ----------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("n_shared", [0, 1])
@pytest.mark.parametrize("router", ROUTERS)
def test_moe_branch_backward_matches_vjp(router, n_shared, top_k):
    cases, results = analytic_and_vjp()
    got, want, _ = results[f"{router}-S{n_shared}-k{top_k}"]
    assert sorted(got[1]) == sorted(cases[f"{router}-S{n_shared}-k{top_k}"][1])  # every key of the layer
    assert_grads_close(got, want)


def test_router_offset_gradient_is_exactly_zero():
    """b only chooses the set (stop_gradient): zero by jax.grad of the real moe.branch, by jax.vjp and
    analytically, in every case."""
    for name, (got, want, grad) in analytic_and_vjp()[1].items():
        for who, tree in (("analytic", got[1]), ("jax.vjp", want[1]), ("jax.grad", grad)):
            assert np.all(np.asarray(tree["router_offset"]) == 0.0), (name, who)


# ----- 3. central differences on every scalar, the selection held (M20 §11, §15) ------------------------

@functools.lru_cache(maxsize=None)
def central_differences():
    """router → (θ = (Z, layer) flattened and its unravel, central differences of ⟨G, moe.branch⟩ for every
    scalar of θ, the selected ids at θ and at every θ ± h·e_i); both routers in one compilation."""
    cases = {r: analytic_and_vjp()[0][f"{r}-S1-k2"] for r in ROUTERS}
    flat = {r: ravel_pytree((z, layer)) for r, (_, layer, z, _) in cases.items()}

    def ids_of(cfg, unravel, th):
        z, layer = unravel(th)
        y = ops.rms_norm(z, layer["ffn_norm"], cfg.norm_eps).reshape(B * T, D)
        return moe.route(y @ layer["router"], layer["router_offset"], cfg.moe_top_k, router=cfg.router,
                         eps=cfg.router_eps)[0]

    @jit
    def run(thetas):
        out = {}
        for r, theta in thetas.items():
            (cfg, _, _, g), unravel = cases[r], flat[r][1]
            steps = FD_STEP * jnp.eye(theta.size)
            loss = jax.vmap(lambda th: jnp.sum(g * branch_out(*unravel(th), cfg)))
            fd = (loss(theta + steps) - loss(theta - steps)) / (2 * FD_STEP)
            moved = jax.vmap(functools.partial(ids_of, cfg, unravel))(jnp.concatenate([theta + steps,
                                                                                       theta - steps]))
            out[r] = fd, ids_of(cfg, unravel, theta), moved
        return out

    results = run({r: theta for r, (theta, _) in flat.items()})
    return {r: (flat[r][1], *(np.asarray(a) for a in results[r])) for r in ROUTERS}


@pytest.mark.parametrize("router", ROUTERS)
def test_central_differences_on_every_scalar_with_an_unselected_expert(router):
    unravel, fd, ids, ids_moved = central_differences()[router]
    assert np.all(ids_moved == ids[None]), "a perturbation of θ changed the selected set"
    assert UNUSED not in ids and len(np.unique(ids)) == X - 1  # every other expert is used
    got, want, _ = analytic_and_vjp()[1][f"{router}-S1-k2"]
    analytic = np.asarray(ravel_pytree(got)[0])
    assert fd.shape == analytic.shape == (B * T * D + D + D * X + X + 3 * (X + 1) * D * M,)
    gap = np.max(np.abs(analytic - fd))
    assert gap <= FD_GAP, f"max |analytic − central difference| = {gap:.3e}"
    assert np.count_nonzero(analytic) >= analytic.size - X - 3 * D * M - D  # all but b, expert 3, router col 3
    fd_layer = unravel(jnp.asarray(fd))[1]
    assert np.all(fd_layer["router_offset"] == 0.0)
    for tree, who in ((got[1], "analytic"), (want[1], "jax.vjp"), (fd_layer, "central differences")):
        for name in EXPERT_KEYS:
            assert np.all(np.asarray(tree[name][UNUSED]) == 0.0), (who, name)
        assert np.all(np.asarray(tree["router"][:, UNUSED]) == 0.0), (who, "router column")
