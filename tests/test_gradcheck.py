"""mlx_llm.gradcheck: the public three-way checker catches what it should, names the leaf, refuses bad input, and
leaves the caller's x64 setting alone."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mlx_llm.errors import InputError
from mlx_llm.gradcheck import (ANALYTIC_VS_AUTODIFF, AUTODIFF_VS_CENTRAL, U, GradReport, check_grads, leaf_paths)

RNG = np.random.default_rng(0)
# A small tree with a nested dict, a list, a large leaf (random directions) and an integer leaf (never checked).
PARAMS = {"w": RNG.standard_normal((4, 12)), "b": {"bias": RNG.standard_normal(12)},
          "gains": [RNG.standard_normal(3), RNG.standard_normal(12)], "count": np.arange(3)}
X = RNG.standard_normal((5, 4))


def loss(p, x):
    h = jnp.tanh(x @ p["w"] + p["b"]["bias"])
    return jnp.sum((h * p["gains"][1]) ** 2) + jnp.sum(jnp.sin(p["gains"][0]))


def analytic(p, x):
    """The hand gradient of ``loss``: h = tanh(a), ∂/∂a = 2 h g² (1 − h²)."""
    h = jnp.tanh(x @ p["w"] + p["b"]["bias"])
    g_a = 2 * h * p["gains"][1] ** 2 * (1 - h**2)
    return {"w": x.T @ g_a, "b": {"bias": g_a.sum(0)},
            "gains": [jnp.cos(p["gains"][0]), jnp.sum(2 * h**2 * p["gains"][1], axis=0)],
            "count": jnp.zeros(3)}


def nudged(path_keys, index, rel=1e-4):
    """``analytic`` with one element of one leaf changed by a relative ``rel``."""
    def wrong(p, x):
        g = analytic(p, x)
        holder = g
        for key in path_keys[:-1]:
            holder = holder[key]
        holder[path_keys[-1]] = holder[path_keys[-1]].at[index].multiply(1 + rel)
        return g
    return wrong


def test_a_correct_analytic_gradient_passes_three_ways():
    report = check_grads(loss, PARAMS, X, analytic=analytic)
    report.assert_ok()
    assert sorted(report.leaves) == ["b/bias", "gains/0", "gains/1", "w"]  # the integer leaf is not a gradient
    for comps in report.leaves.values():
        assert set(comps) == {AUTODIFF_VS_CENTRAL, ANALYTIC_VS_AUTODIFF}
        assert comps[ANALYTIC_VS_AUTODIFF].max_rel < 1e-13
        assert comps[AUTODIFF_VS_CENTRAL].max_rel < 1e-8 and comps[AUTODIFF_VS_CENTRAL].max_abs > 0
    assert isinstance(report.leaves["w"][AUTODIFF_VS_CENTRAL].worst_index, str)  # 48 > 4·8: random directions
    assert isinstance(report.leaves["gains/0"][AUTODIFF_VS_CENTRAL].worst_index, tuple)  # every coordinate
    text = str(report)
    assert "gains/1" in text and "analytic~autodiff" in text and "FAIL" not in text


@pytest.mark.parametrize("path, index", [(("w",), (2, 7)), (("b", "bias"), (5,)), (("gains", 0), (1,))],
                         ids=["w", "b/bias", "gains/0"])
def test_an_analytic_gradient_wrong_in_one_element_by_1e_4_fails_and_is_named(path, index):
    report = check_grads(loss, PARAMS, X, analytic=nudged(path, index))
    name = "/".join(str(k) for k in path)
    assert not report.ok
    worst_path, comparison, rel = report.worst()
    assert (worst_path, comparison) == (name, ANALYTIC_VS_AUTODIFF)
    comp = report.leaves[name][ANALYTIC_VS_AUTODIFF]
    assert comp.worst_index == index and not comp.ok and 10 * comp.tol < rel <= 1e-4
    assert all(c.ok for p, comps in report.leaves.items() for c in comps.values() if p != name)
    with pytest.raises(AssertionError, match=f"worst {name} \\(analytic~autodiff"):
        report.assert_ok()


def _sin_sum(with_bug: bool):
    """Σ w ⊙ sin(x) with a custom_vjp whose backward is right, or wrong by 1e-4 relative in element 2 of x."""
    @jax.custom_vjp
    def f(x, w):
        return jnp.sum(w * jnp.sin(x))

    def fwd(x, w):
        return f(x, w), (x, w)

    def bwd(res, g):
        x, w = res
        g_x = g * w * jnp.cos(x)
        return (g_x.at[2].multiply(1 + 1e-4) if with_bug else g_x), g * jnp.sin(x)

    f.defvjp(fwd, bwd)
    return lambda p: f(p["x"], p["w"]) + jnp.sum(p["x"] ** 2)


def test_a_custom_vjp_with_a_bug_fails_and_is_named():
    params = {"x": RNG.standard_normal(6), "w": RNG.standard_normal(6)}
    check_grads(_sin_sum(False), params).assert_ok()
    report = check_grads(_sin_sum(True), params)
    assert not report.ok
    assert report.worst()[:2] == ("x", AUTODIFF_VS_CENTRAL)
    assert report.leaves["x"][AUTODIFF_VS_CENTRAL].worst_index == (2,)
    assert report.leaves["w"][AUTODIFF_VS_CENTRAL].ok


def test_the_step_follows_the_documented_rule_and_eps_overrides_it():
    report = check_grads(loss, PARAMS, X, leaves=["w", "gains/0"])
    assert sorted(report.leaves) == ["gains/0", "w"]
    assert U * (1 + abs(report.value)) <= report.noise < 1e3 * U * (1 + abs(report.value))
    for path, leaf in (("w", PARAMS["w"]), ("gains/0", PARAMS["gains"][0])):
        rule = report.noise ** (1 / 3) * (1 + math.sqrt(np.mean(leaf**2)))
        assert report.steps[path] == pytest.approx(rule, rel=1e-12)
    assert set(check_grads(loss, PARAMS, X, eps=1e-4, leaves="gains").steps.values()) == {1e-4}


def test_float32_inputs_are_checked_in_float64_and_x64_is_restored():
    f32 = jax.tree.map(lambda a: a.astype(np.float32) if a.dtype == np.float64 else a, PARAMS)
    with jax.enable_x64(False):
        report = check_grads(loss, f32, X.astype(np.float32), analytic=analytic)
        assert not jax.config.read("jax_enable_x64")
        assert jnp.ones(1).dtype == jnp.float32
    report.assert_ok()
    assert report.noise < 1e-12  # float64's round-off, not float32's
    assert report.max_rel() < 1e-13


def test_bad_input_is_refused_with_the_path():
    with pytest.raises(InputError, match="must return a scalar; it returned shape \\(5, 12\\)"):
        check_grads(lambda p, x: x @ p["w"], PARAMS, X)
    with pytest.raises(InputError, match="'count' has dtype int"):
        check_grads(loss, PARAMS, X, leaves=["w", "count"])
    with pytest.raises(InputError, match="no leaf at path 'wq'"):
        check_grads(loss, PARAMS, X, leaves=["wq"])
    missing = lambda p, x: {k: v for k, v in analytic(p, x).items() if k != "b"}  # noqa: E731
    with pytest.raises(InputError, match="structure differs from params': it lacks 'b/bias'"):
        check_grads(loss, PARAMS, X, analytic=missing)
    wrong_shape = lambda p, x: {**analytic(p, x), "w": jnp.zeros((12, 4))}  # noqa: E731
    with pytest.raises(InputError, match="analytic gradient of 'w' has shape \\(12, 4\\)"):
        check_grads(loss, PARAMS, X, analytic=wrong_shape)
    with pytest.raises(InputError, match="directions = 0"):
        check_grads(loss, PARAMS, X, directions=0)


def test_leaf_paths_and_an_empty_report():
    assert leaf_paths(PARAMS) == ["b/bias", "count", "gains/0", "gains/1", "w"]
    report = GradReport({}, 1.0, U, {})
    assert report.ok and report.max_rel() == 0.0


# ----- issue 51: the checker keeps its promise -------------------------------------------------------------------
W8 = {"w": np.linspace(0.1, 1, 8)}
U32 = float(np.finfo(np.float32).eps)


def test_a_float32_function_is_checked_to_float32s_digits():
    """The issue's example: ε_f was measured with float64 ulps that never move a float32 input (FAILED, relative
    error 4e-3 against a tolerance of 1e-9)."""
    report = check_grads(lambda p: jnp.mean(p["w"].astype(jnp.float32) ** 2), W8)
    report.assert_ok()
    assert report.precision == "float32" and "(float32 arithmetic): ok" in str(report)
    assert U32 * (1 + abs(report.value)) <= report.noise < 1e3 * U32 * (1 + abs(report.value))
    comp = report.leaves["w"][AUTODIFF_VS_CENTRAL]
    assert comp.max_rel < 1e-4 and comp.tol < 1e-2  # float32's digits, not float64's, and not none
    assert check_grads(lambda p: jnp.mean(p["w"] ** 2), W8).precision == "float64"


def _float32_square(rel: float):
    """Σ x² computed in float32 by a custom_vjp whose backward is wrong by ``rel`` in element 2."""
    @jax.custom_vjp
    def f(x):
        return jnp.sum(x**2)

    f.defvjp(lambda x: (f(x), x), lambda x, g: ((g * 2 * x).at[2].multiply(1 + rel),))
    return lambda p: f(p["w"].astype(jnp.float32))


def test_a_wrong_float32_gradient_still_fails():
    check_grads(_float32_square(0.0), W8).assert_ok()
    report = check_grads(_float32_square(1e-2), W8)
    assert report.precision == "float32" and not report.ok
    assert report.worst()[:2] == ("w", AUTODIFF_VS_CENTRAL)
    assert report.leaves["w"][AUTODIFF_VS_CENTRAL].worst_index == (2,)
    f32 = lambda p: jnp.mean(p["w"].astype(jnp.float32) ** 2)  # noqa: E731
    wrong = check_grads(f32, W8, analytic=lambda p: {"w": (2 * p["w"] / 8).at[5].multiply(1 + 1e-3)})
    assert not wrong.ok and wrong.worst()[:2] == ("w", ANALYTIC_VS_AUTODIFF)
    assert wrong.leaves["w"][ANALYTIC_VS_AUTODIFF].worst_index == (5,)


def test_a_bfloat16_function_passes_at_bfloat16s_precision_and_a_gross_error_fails():
    f16 = lambda p: jnp.mean(p["w"].astype(jnp.bfloat16) ** 2)  # noqa: E731
    report = check_grads(f16, W8, analytic=lambda p: {"w": 2 * p["w"] / 8})
    report.assert_ok()
    assert report.precision == "bfloat16" and "(bfloat16 arithmetic)" in str(report)
    assert report.noise >= float(jnp.finfo(jnp.bfloat16).eps) * (1 + abs(report.value))
    # docs/gradients.md: the differences keep under one digit here, the analytic comparison about 5 %
    assert 1 < report.leaves["w"][AUTODIFF_VS_CENTRAL].tol < 2
    assert 0.02 < report.leaves["w"][ANALYTIC_VS_AUTODIFF].tol < 0.1
    wrong = check_grads(f16, W8, analytic=lambda p: {"w": (2 * p["w"] / 8).at[6].multiply(1.5)})
    assert not wrong.ok and wrong.leaves["w"][ANALYTIC_VS_AUTODIFF].worst_index == (6,)


def test_the_precision_is_read_through_calls_and_loops_and_only_from_theta():
    x = np.linspace(-1, 1, 8)

    def scanned(p):  # the float32 arithmetic is inside a jitted function inside a scan
        step = jax.jit(lambda c, w: (c + jnp.sin(w.astype(jnp.float32)).astype(jnp.float64), None))
        return jax.lax.scan(step, 0.0, p["w"])[0]

    assert check_grads(scanned, W8).precision == "float32"
    # float32 arithmetic on an argument only (no θ in it) leaves the check in float64
    report = check_grads(lambda p, x: jnp.sum(p["w"] * jnp.cos(x.astype(jnp.float32)).astype(jnp.float64)), W8, x)
    assert report.precision == "float64" and report.noise < 1e-12

    def beside(p):  # float32 from θ that reaches the result only through an index and a stop_gradient
        w32 = p["w"].astype(jnp.float32)
        picked = p["w"][jnp.argmax(w32)]
        return jnp.sum(p["w"] ** 2) + picked + jax.lax.stop_gradient(jnp.sum(w32)).astype(jnp.float64)

    assert check_grads(beside, W8).precision == "float64"


@pytest.mark.parametrize("centre", [0.0, 0.25])
def test_the_kink_rule_holds_for_abs_at_and_near_its_kink(centre):
    """JAX takes |x|'s derivative at 0 as +1, the differences see 0 (it FAILED: error 1 against a tolerance of
    1e-9); at every offset within ±2h of the kink the tolerance widens by the third differences, with a margin of
    two, and away from it a wrong derivative still fails."""
    at_kink = check_grads(lambda p: jnp.sum(jnp.abs(p["x"] - centre)), {"x": centre + np.array([0.0, 1.0, -2.0])})
    at_kink.assert_ok()
    assert at_kink.leaves["x"][AUTODIFF_VS_CENTRAL].max_abs == pytest.approx(1.0)  # judged, not skipped
    h = 1e-3
    offsets = np.array([0.0, 0.05, 0.3, 0.5, 2 / 3, 0.9, 1.0, 1.3, 1.7, 1.99, -0.5, -1.5, 3.0, -4.0])
    near = check_grads(lambda p: jnp.sum(jnp.abs(p["x"] - centre)), {"x": centre + offsets * h}, eps=h)
    assert near.ok and near.leaves["x"][AUTODIFF_VS_CENTRAL].severity <= 0.5 + 1e-6

    @jax.custom_vjp
    def double(x):  # |x| with twice its derivative
        return jnp.abs(x)

    double.defvjp(lambda x: (jnp.abs(x), x), lambda x, g: (2 * g * jnp.sign(x),))
    wrong = check_grads(lambda p: jnp.sum(double(p["x"] - centre)), {"x": centre + offsets * h}, eps=h)
    comp = wrong.leaves["x"][AUTODIFF_VS_CENTRAL]
    assert not comp.ok and comp.worst_index in {(12,), (13,)}  # the two offsets beyond 2h


def test_worst_ranks_a_nan_first():
    """A NaN error was never the max (NaN compares false), so worst() named a passing or lesser leaf."""
    def f(p):
        return jnp.sum(jnp.sqrt(p["a"])) + jnp.sum(p["b"] ** 2)

    def hand(p):
        return {"a": 0.5 / jnp.sqrt(p["a"]), "b": (2 * p["b"]).at[1].multiply(1.01)}

    report = check_grads(f, {"a": np.array([0.0, 1.0]), "b": np.array([1.0, 2.0, 3.0])}, analytic=hand)
    assert not report.ok and report.worst()[0] == "a" and math.isnan(report.worst()[2])
    assert not report.leaves["b"][ANALYTIC_VS_AUTODIFF].ok  # still measured against b's own scale
    assert report.leaves["b"][ANALYTIC_VS_AUTODIFF].max_rel == pytest.approx(0.01 * 4 / 6, rel=1e-6)
    assert math.isnan(report.max_rel(AUTODIFF_VS_CENTRAL))
    assert all(not c.ok for c in report.leaves["a"].values())


def test_a_tree_with_nothing_to_check_is_refused():
    square = lambda p: jnp.sum(jnp.asarray(p["x"], float) ** 2)  # noqa: E731
    with pytest.raises(InputError, match=r"params hold no floating element to check \(its leaves: \['x: int"):
        check_grads(square, {"x": np.arange(3)})
    with pytest.raises(InputError, match="its leaves: none"):
        check_grads(lambda p: 0.0, {})
    with pytest.raises(InputError, match="the leaves under 'e' hold no floating element"):
        check_grads(lambda p: jnp.sum(p["w"] ** 2), {"w": np.ones(2), "e": np.zeros((0, 3))}, leaves="e")
    with pytest.raises(InputError, match="central=False without analytic compares nothing"):
        check_grads(loss, PARAMS, X, central=False)


@pytest.mark.parametrize("kwargs, message", [
    ({"seed": "a"}, "seed = 'a' is invalid: it must be a non-negative integer"),
    ({"seed": -1}, "seed = -1 is invalid"),
    ({"seed": True}, "seed = True is invalid"),
    ({"leaves": 3}, "leaves = 3 is invalid: it must be None"),
    ({"leaves": []}, r"leaves = \[\] is invalid"),
    ({"leaves": ["w", 0]}, r"leaves = \['w', 0\] is invalid"),
    ({"central": "no"}, "central = 'no' is invalid: it must be True or False"),
    ({"eps": True}, "eps = True is invalid"),
    ({"analytic": 3}, "analytic = 3 is invalid: it must be None or a function"),
], ids=lambda v: str(v)[:20])
def test_every_bad_argument_is_an_input_error_naming_it(kwargs, message):
    with pytest.raises(InputError, match=message):
        check_grads(loss, PARAMS, X, **kwargs)


@pytest.mark.parametrize("f, message", [
    (lambda p, x: (loss(p, x), 1.0), "f must return one scalar array; it returned a tuple"),
    (lambda p, x: {"loss": loss(p, x)}, "f must return one scalar array; it returned a dict"),
    (lambda p, x: jnp.sum(p["count"]), "f must return a floating scalar; it returned dtype int"),
    ("loss", "f = 'loss' is invalid: it must be a function"),
], ids=["tuple", "dict", "integer", "not callable"])
def test_an_f_that_returns_anything_but_a_floating_scalar_is_refused(f, message):
    with pytest.raises(InputError, match=message):
        check_grads(f, PARAMS, X)
