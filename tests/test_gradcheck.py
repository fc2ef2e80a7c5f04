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
