"""Scaling laws (U19 §8): the Chinchilla parametric law, the compute-optimal split, and two ways to fit it.

L(N, D) = E + A/N^α + B/D^β with C ≈ 6ND (Hoffmann et al. 2022, "Training Compute-Optimal Large Language
Models"). ``fit_chinchilla`` is their Approach 3 (Huber loss on log L, L-BFGS from a grid of starts);
``isoflop_fit`` is their Approach 2 (a parabola per compute budget, then power laws through the minima).

The fits run in float64 under a scoped ``jax.enable_x64(True)`` whatever the global setting; nothing
here changes ``jax.config``.
"""

from __future__ import annotations

import csv
import itertools
import math
import os
import sys
from functools import partial
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import scipy.optimize

from mlx_llm.scaling.accounting import training_flops
from mlx_llm.errors import DataError, InputError


class ChinchillaParams(NamedTuple):
    """The five constants of L(N, D) = E + A/N^α + B/D^β."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float


# Hoffmann et al. 2022, §3.3 (Approach 3), the constants U19 §8 quotes.
CHINCHILLA = ChinchillaParams(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)

# Hoffmann et al.'s grid of L-BFGS starts (Appendix D.2): α, β ∈ {0, 0.5, …, 2}, e ∈ {-1, -0.5, …, 1},
# a, b ∈ {0, 5, …, 25}: 5·5·5·6·6 = 4 500 starts.
HOFFMANN_GRID = {
    "a": np.arange(0.0, 25.1, 5.0), "b": np.arange(0.0, 25.1, 5.0), "e": np.arange(-1.0, 1.01, 0.5),
    "alpha": np.arange(0.0, 2.01, 0.5), "beta": np.arange(0.0, 2.01, 0.5),
}
_ORDER = ("a", "b", "e", "alpha", "beta")  # layout of the parameter vector x


def _positive(name: str, x) -> np.ndarray:
    arr = np.asarray(x, dtype=np.float64)
    if arr.size == 0 or not np.all(np.isfinite(arr) & (arr > 0)):
        raise InputError(f"{name} must be finite numbers > 0; got {x!r}")
    return arr


def _scalar_out(x):
    return float(x) if np.ndim(x) == 0 else x


# ----- the law and its compute-optimal split ---------------------------------------------------------

def chinchilla_loss(N, D, params: ChinchillaParams = CHINCHILLA):
    """L(N, D) = E + A/N^α + B/D^β (U19 §8). Gopher (280B, 300B): 1.9933; Chinchilla (70B, 1.4T): 1.9366."""
    N, D = _positive("N", N), _positive("D", D)
    E, A, B, alpha, beta = params
    return _scalar_out(E + A / N**alpha + B / D**beta)


def loss_at_budget(C, N, params: ChinchillaParams = CHINCHILLA):
    """The loss of an N-parameter model that spends budget C, so reads D = C/(6N) tokens (U19 §8)."""
    C, N = _positive("C", C), _positive("N", N)
    return chinchilla_loss(N, C / (6.0 * N), params)


def optimal_exponents(params: ChinchillaParams = CHINCHILLA) -> tuple[float, float]:
    """N* ∝ C^{β/(α+β)}, D* ∝ C^{α/(α+β)} (U19 §8 proof): 0.45 and 0.55 for Hoffmann's constants."""
    s = params.alpha + params.beta
    return params.beta / s, params.alpha / s


def compute_optimal(C, params: ChinchillaParams = CHINCHILLA):
    """The split minimising L at 6ND = C, in closed form (Hoffmann et al. 2022, eq. 4):

    N* = G (C/6)^{β/(α+β)}, D* = G⁻¹ (C/6)^{α/(α+β)}, G = (αA / βB)^{1/(α+β)}.
    At Chinchilla's budget 5.88e23: N* ≈ 32.5B, D* ≈ 3.0T, L ≈ 1.9300.
    """
    C = _positive("C", C)
    _, A, B, alpha, beta = params
    G = (alpha * A / (beta * B)) ** (1.0 / (alpha + beta))
    a, b = optimal_exponents(params)
    return _scalar_out(G * (C / 6.0) ** a), _scalar_out((C / 6.0) ** b / G)


def fixed_ratio_split(C, tokens_per_param: float = 20.0):
    """The rule of thumb D = rN (U19 §8): C = 6rN², so N = (C/6r)^{1/2}. C = 1e23 → N ≈ 28.9B, D ≈ 577B."""
    C, r = _positive("C", C), float(_positive("tokens_per_param", tokens_per_param))
    N = np.sqrt(C / (6.0 * r))
    return _scalar_out(N), _scalar_out(r * N)


# ----- Approach 3: Huber on log L, L-BFGS from a grid -----------------------------------------------

def huber(r, delta):
    """Huber_δ(r) = r²/2 for |r| ≤ δ, δ(|r| − δ/2) beyond (Hoffmann et al. 2022, eq. 3)."""
    abs_r = jnp.abs(r)
    return jnp.where(abs_r <= delta, 0.5 * r * r, delta * (abs_r - 0.5 * delta))


def chinchilla_objective(x, logs_3R, weights_R, delta):
    """Σ_runs w·Huber_δ(LSE(a − α log N, b − β log D, e) − log L), x = (a, b, e, α, β) (Approach 3).

    ``logs_3R`` stacks log N, log D, log L. LSE of the three terms is log(A/N^α + B/D^β + E) with
    A = e^a, B = e^b, E = e^e; the maximum is taken out before exponentiating.
    """
    a, b, e, alpha, beta = x[0], x[1], x[2], x[3], x[4]
    log_n, log_d, log_l = logs_3R
    u, v = a - alpha * log_n, b - beta * log_d
    top = jax.lax.stop_gradient(jnp.maximum(jnp.maximum(u, v), e))
    pred = top + jnp.log(jnp.exp(u - top) + jnp.exp(v - top) + jnp.exp(e - top))
    return jnp.sum(weights_R * huber(pred - log_l, delta))


_value_and_grad = jax.value_and_grad(chinchilla_objective)


def _lbfgs_direction(g, S, Y, rho):
    """−H·g by the two-loop recursion over the stored pairs (oldest first; empty slots have ρ = 0)."""
    def back(q, pair):
        s, y, r = pair
        a = r * jnp.dot(s, q)
        return q - a * y, a

    q, alphas = jax.lax.scan(back, g, (S, Y, rho), reverse=True)
    yy, g_norm = jnp.dot(Y[-1], Y[-1]), jnp.sqrt(jnp.dot(g, g))
    # H₀ = (sᵀy / yᵀy)·I from the newest pair; with no pair yet, a unit-length steepest-descent step.
    gamma = jnp.where(rho[-1] > 0, jnp.dot(S[-1], Y[-1]) / jnp.where(yy > 0, yy, 1.0),
                      1.0 / jnp.where(g_norm > 0, g_norm, 1.0))

    def forward(r, pair):
        s, y, rho_i, a = pair
        return r + s * (a - rho_i * jnp.dot(y, r)), None

    r, _ = jax.lax.scan(forward, gamma * q, (S, Y, rho, alphas))
    return -r


def _lbfgs_step(state, fun):
    """One L-BFGS iteration with exactly one evaluation: try x + t·p; accept on Armijo (and t → min(1, 2t)),
    else stay and quarter t. One evaluation per iteration keeps a vmapped batch of starts in lockstep
    (a line search's inner loop would run as long as the slowest start)."""
    x, f, g, S, Y, rho, t = state
    p = _lbfgs_direction(g, S, Y, rho)
    g_norm = jnp.sqrt(jnp.dot(g, g))
    p = jnp.where(jnp.dot(g, p) < 0, p, -g / jnp.where(g_norm > 0, g_norm, 1.0))  # not downhill: reset
    x_new = x + t * p
    f_new, g_new = fun(x_new)
    ok = jnp.isfinite(f_new) & jnp.all(jnp.isfinite(g_new)) & (f_new <= f + 1e-4 * t * jnp.dot(g, p))
    s, y = x_new - x, g_new - g
    sy = jnp.dot(s, y)
    keep = ok & (sy > 1e-10 * jnp.sqrt(jnp.dot(s, s) * jnp.dot(y, y)))  # curvature condition

    def push(buf, row):
        return jnp.where(keep, jnp.roll(buf, -1, axis=0).at[-1].set(row), buf)

    S, Y, rho = push(S, s), push(Y, y), push(rho, 1.0 / jnp.where(keep, sy, 1.0))
    x, f, g = jnp.where(ok, x_new, x), jnp.where(ok, f_new, f), jnp.where(ok, g_new, g)
    return x, f, g, S, Y, rho, jnp.where(ok, jnp.minimum(1.0, 2.0 * t), 0.25 * t)


def _lbfgs(x0, logs_3R, weights_R, delta, iters: int, memory: int):
    def fun(x):
        return _value_and_grad(x, logs_3R, weights_R, delta)

    f0, g0 = fun(x0)
    k = x0.shape[0]
    state = (x0, f0, g0, jnp.zeros((memory, k)), jnp.zeros((memory, k)), jnp.zeros(memory), jnp.ones(()))
    state, _ = jax.lax.scan(lambda s, _: (_lbfgs_step(s, fun), None), state, None, length=iters)
    return state[0], state[1]


@partial(jax.jit, static_argnames=("iters", "memory"))
def _lbfgs_batch(x0_S5, logs_3R, weights_SR, delta, iters: int, memory: int = 10):
    """L-BFGS from every row of ``x0_S5``, each with its own run weights (a grid of starts shares ones;
    bootstrap replicates differ), in one vmapped, fixed-length scan. One shape serves both uses, so a
    bootstrap with as many replicates as there are grid starts reuses the compiled program."""
    run = jax.vmap(_lbfgs, in_axes=(0, None, 0, None, None, None))
    return run(x0_S5, logs_3R, weights_SR, delta, iters, memory)


_jit_value_and_grad = jax.jit(_value_and_grad)


def _polish(x0, logs_3R, weights_R, delta):
    """Finish one start with SciPy's L-BFGS-B (its own line search and stopping test) on the JAX gradient."""
    def fun(x):
        value, grad = _jit_value_and_grad(jnp.asarray(x), logs_3R, weights_R, delta)
        return float(value), np.asarray(grad, dtype=np.float64)

    return scipy.optimize.minimize(fun, np.asarray(x0), jac=True, method="L-BFGS-B",
                                   options={"maxiter": 2000, "ftol": 1e-15, "gtol": 1e-12})


def _grid_starts(grid) -> np.ndarray:
    grid = HOFFMANN_GRID if grid is None else grid
    missing = [k for k in _ORDER if k not in grid]
    if missing:
        raise InputError(f"grid must give start values for all of {list(_ORDER)}; missing {missing}")
    return np.array(list(itertools.product(*(np.atleast_1d(grid[k]) for k in _ORDER))), dtype=np.float64)


def _run_data(N, D, loss):
    N, D, loss = _positive("N", N), _positive("D", D), _positive("loss", loss)
    if not (N.ndim == 1 and N.shape == D.shape == loss.shape and N.size >= 5):
        raise InputError(f"N, D, loss must be 1-D of one length >= 5 (five unknowns); got shapes "
                         f"{N.shape}, {D.shape}, {loss.shape}")
    return jnp.asarray(np.log(np.stack([N, D, loss])))


def _exp(x: float) -> float:
    """e^x, or inf where it leaves the float range (a bootstrap replicate whose resampled runs do not pin the
    parameter down: L-BFGS walks a and α off together when the replicate holds too few distinct sizes)."""
    return math.exp(x) if x < _LOG_FLOAT_MAX else math.inf


_LOG_FLOAT_MAX = math.log(sys.float_info.max)


def _named(x) -> dict:
    a, b, e, alpha, beta = (float(v) for v in x)
    return {"E": _exp(e), "A": _exp(a), "B": _exp(b), "alpha": alpha, "beta": beta}


def percentile_interval(values, ci: float) -> tuple[float, float]:
    """The central ``ci`` percentile interval of ``values`` (linear interpolation). Where values are infinite
    (an unbounded replicate) the ends are taken at the nearest sample outward (lower / higher), so the interval
    widens to inf instead of interpolating inf − inf into nan."""
    tail = 50.0 * (1.0 - ci)
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:  # no replicate gave a number
        return (math.nan, math.nan)
    if np.all(np.isfinite(v)):
        return tuple(float(q) for q in np.percentile(v, [tail, 100.0 - tail]))
    return (float(np.percentile(v, tail, method="lower")), float(np.percentile(v, 100.0 - tail, method="higher")))


def _multistart(starts, logs_3R, weights_R, delta, iters: int, polish_top: int):
    """Batched L-BFGS from every start, then SciPy L-BFGS-B on the ``polish_top`` best distinct endpoints.
    Returns the best SciPy result and how many starts ended within 1e-9 (relative) of the best value."""
    weights_SR = jnp.broadcast_to(weights_R, (len(starts), weights_R.shape[0]))
    xs, fs = (np.asarray(v) for v in _lbfgs_batch(jnp.asarray(starts), logs_3R, weights_SR, delta, iters=iters))
    fs = np.where(np.isfinite(fs), fs, np.inf)
    order = np.argsort(fs)
    _, first = np.unique(np.round(xs[order], 6), axis=0, return_index=True)
    polished = [_polish(xs[i], logs_3R, weights_R, delta) for i in order[np.sort(first)][:polish_top]]
    return min(polished, key=lambda r: r.fun), int(np.sum(fs <= fs[order[0]] * (1 + 1e-9)))


def fit_chinchilla(N, D, loss, *, delta: float = 1e-3, bootstrap: int = 0, seed: int = 0, grid=None,
                   iters: int = 200, polish_top: int = 3, ci: float = 0.95, holdout=None) -> dict:
    """Hoffmann et al.'s Approach 3: minimise Σ Huber_δ(LSE(a − α log N, b − β log D, e) − log L).

    L-BFGS runs from every point of ``grid`` (default ``HOFFMANN_GRID``, 4 500 starts) as one vmapped batch
    of ``iters`` iterations (one evaluation each, see ``_lbfgs_step``); the ``polish_top`` best distinct
    results are finished with SciPy's L-BFGS-B and the best is kept. A = e^a, B = e^b, E = e^e.

    ``bootstrap`` > 0 resamples the runs with replacement that many times, refits each replicate with the
    batched L-BFGS from the full-data optimum, and adds percentile intervals ``ci`` (level) per parameter.
    Returns E, A, B, alpha, beta, ``params`` (a ``ChinchillaParams``), ``objective``, ``grad_max`` (largest
    |∂objective/∂x| at the result), ``converged`` (SciPy's verdict, or ``grad_max`` below 1e-6·δ·n_runs:
    one part in a million of the slope every run's Huber term can give per unit of its log-features),
    ``n_starts``, ``n_at_best`` (starts within 1e-9 of the best objective before polishing) and, with
    bootstrap, ``ci`` and ``samples`` (dicts keyed by parameter name).

    Held-out mode: ``holdout`` gives each run's compute budget; the runs of the largest budget are left out, the law
    is fitted (and bootstrapped) on the others, and ``held_out`` (``predict_held_out``) holds what it predicts for
    them — each run's loss, and the budget's compute-optimal N and loss — with intervals from the bootstrap
    replicates, against what was measured.
    """
    if holdout is not None:
        fit_rows, held_rows, budget = _split_largest(holdout, N)
        N, D, loss = (np.asarray(x, dtype=np.float64) for x in (N, D, loss))
        out = fit_chinchilla(N[fit_rows], D[fit_rows], loss[fit_rows], delta=delta, bootstrap=bootstrap, seed=seed,
                             grid=grid, iters=iters, polish_top=polish_top, ci=ci)
        out["held_out"] = predict_held_out(out, N[held_rows], D[held_rows], loss[held_rows], budget, ci=ci)
        return out
    if not (isinstance(delta, (int, float)) and delta > 0):
        raise InputError(f"delta = {delta!r} is invalid: the Huber threshold must be > 0")
    if isinstance(bootstrap, bool) or not isinstance(bootstrap, int) or bootstrap < 0:
        raise InputError(f"bootstrap = {bootstrap!r} is invalid: it must be an integer >= 0")
    if not 0 < ci < 1:
        raise InputError(f"ci = {ci!r} is invalid: the interval level must be in (0, 1)")
    with jax.enable_x64(True):
        logs_3R = _run_data(N, D, loss)
        n_runs = logs_3R.shape[1]
        ones_R = jnp.ones(n_runs)
        starts = _grid_starts(grid)
        best, n_at_best = _multistart(starts, logs_3R, ones_R, delta, iters, polish_top)
        grad_max = float(np.max(np.abs(best.jac)))
        out = _named(best.x) | {
            "objective": float(best.fun), "grad_max": grad_max, "n_runs": int(n_runs),
            "converged": bool(best.success) or grad_max <= 1e-6 * delta * n_runs,
            "n_starts": len(starts), "n_at_best": n_at_best,
        }
        out["params"] = ChinchillaParams(*(out[k] for k in ChinchillaParams._fields))
        if bootstrap:
            out |= _bootstrap(best.x, logs_3R, delta, bootstrap, seed, iters, ci)
    return out


def _bootstrap(x_best, logs_3R, delta, n_rep: int, seed: int, iters: int, ci: float) -> dict:
    """Resampling runs with replacement = multinomial run weights. All replicates are refitted in one
    batched L-BFGS run from the full-data optimum (a local refit, not the whole grid)."""
    n_runs = logs_3R.shape[1]
    weights = np.random.default_rng(seed).multinomial(n_runs, np.full(n_runs, 1.0 / n_runs), size=n_rep)
    x0 = jnp.broadcast_to(jnp.asarray(x_best), (n_rep, len(_ORDER)))
    xs, _ = _lbfgs_batch(x0, logs_3R, jnp.asarray(weights, dtype=jnp.float64), delta, iters=iters)
    named = [_named(x) for x in np.asarray(xs)]
    samples = {k: np.array([d[k] for d in named]) for k in ChinchillaParams._fields}
    intervals = {k: percentile_interval(v, ci) for k, v in samples.items()}
    return {"ci": intervals, "samples": samples,
            "unbounded": {k: int(np.sum(~np.isfinite(v))) for k, v in samples.items() if not np.all(np.isfinite(v))}}


# ----- held out: fit on the smaller budgets, predict the largest ----------------------------------------------

def _split_largest(budget, N):
    """(rows fitted, rows held out, the held-out budget): the runs of the largest budget are held out."""
    budget = _positive("holdout (each run's budget)", budget)
    if budget.shape != np.shape(N):
        raise InputError(f"holdout gives one budget per run: got {budget.shape[0] if budget.ndim else 0} budgets for "
                         f"{np.size(N)} runs")
    top = budget.max()
    held = np.isclose(budget, top, rtol=1e-9)
    if held.all():
        raise InputError(f"holdout: every run is of budget {top:.4g}; the held-out mode fits the smaller budgets and "
                         f"predicts the largest, so it needs at least two budgets")
    return ~held, held, float(top)


def _interval(values, ci: float):
    """``percentile_interval`` of the replicates' values that are not nan."""
    v = np.asarray(values, dtype=np.float64)
    return list(percentile_interval(v[~np.isnan(v)], ci))


def _power_term(A, x, alpha):
    """A / x^α as e^(log A − α log x): a replicate that walked log A and α off together (both huge) keeps its
    finite value, where A / x**α would overflow x**α to inf and give 0."""
    return np.exp(np.log(A) - alpha * np.log(x))


def predict_held_out(fit: dict, N, D, loss, budget: float, *, ci: float = 0.95, spread: float = 4.0,
                     points: int = 2001) -> dict:
    """What ``fit`` (a ``fit_chinchilla`` result, with or without bootstrap ``samples``) predicts for held-out runs
    of one compute budget, against what they measured:

    - ``runs``: each run's L̂(N, D), its interval over the bootstrap replicates and the measured loss; ``loss_error``
      the mean and largest |L̂ − L| and the mean (L̂ − L)/L;
    - ``compute_optimal``: the law's minimum along the held-out runs' IsoFLOP line (log D linear in log N through
      the runs, which is exactly how their D falls with N at one compute, whatever FLOPs-per-token rule sized
      them), over N from their smallest / ``spread`` to their largest × ``spread``: N* and L*, with intervals;
      against the vertex of the parabola through the runs' losses in log N (Approach 2's estimate of the measured
      optimum; None when the runs show no valley). ``N_ratio`` = N*/N_measured, ``loss_error`` = L* − L_measured,
      and whether the interval covers the measurement.
    """
    N, D, loss = _positive("N", N), _positive("D", D), _positive("loss", loss)
    if not (N.ndim == 1 and N.shape == D.shape == loss.shape):
        raise InputError(f"N, D, loss must be 1-D of one length; got shapes {N.shape}, {D.shape}, {loss.shape}")
    names = ChinchillaParams._fields
    point = np.array([[fit[k] for k in names]])
    samples = fit.get("samples")
    table = point if not samples else np.concatenate([point, np.stack([samples[k] for k in names], axis=1)])
    E, A, B, alpha, beta = (table[:, i:i + 1] for i in range(5))  # (1 + replicates, 1)
    with np.errstate(over="ignore"):  # an unbounded replicate's term is inf (interval ends at inf), not a warning
        per_run = E + _power_term(A, N, alpha) + _power_term(B, D, beta)  # (1 + replicates, runs)
    out = {"budget": float(budget), "n_runs": int(N.size), "bootstrap": int(len(table) - 1),
           "runs": {"N": N.tolist(), "D": D.tolist(), "loss": loss.tolist(), "predicted": per_run[0].tolist()},
           "loss_error": {"mean_abs": float(np.mean(np.abs(per_run[0] - loss))),
                          "max_abs": float(np.max(np.abs(per_run[0] - loss))),
                          "mean_rel": float(np.mean((per_run[0] - loss) / loss))}}
    if len(table) > 1:
        out["runs"]["ci"] = [_interval(per_run[1:, j], ci) for j in range(N.size)]
    if len(np.unique(N)) < 2:
        out["compute_optimal"] = None
        return out
    slope, icept = np.polyfit(np.log(N), np.log(D), 1)
    log_n = np.linspace(np.log(N.min() / spread), np.log(N.max() * spread), points)
    with np.errstate(over="ignore"):
        curve = E + np.exp(np.log(A) - alpha * log_n) + np.exp(np.log(B) - beta * (icept + slope * log_n))
    best = np.argmin(curve, axis=1)
    n_star, l_star = np.exp(log_n[best]), curve[np.arange(len(table)), best]
    opt = {"N_predicted": float(n_star[0]), "loss_predicted": float(l_star[0]),
           "at_edge": bool(best[0] in (0, points - 1))}
    if len(table) > 1:
        opt |= {"N_ci": _interval(n_star[1:], ci), "loss_ci": _interval(l_star[1:], ci)}
    vertex = _parabola_minimum(np.log(N), loss)
    if vertex is not None:
        n_meas, l_meas = float(np.exp(vertex[0])), float(vertex[1])
        opt |= {"N_measured": n_meas, "loss_measured": l_meas, "N_ratio": opt["N_predicted"] / n_meas,
                "loss_error": opt["loss_predicted"] - l_meas}
        if len(table) > 1:
            opt |= {"N_covered": opt["N_ci"][0] <= n_meas <= opt["N_ci"][1],
                    "loss_covered": opt["loss_ci"][0] <= l_meas <= opt["loss_ci"][1]}
    out["compute_optimal"] = opt
    return out


# ----- Approach 2: IsoFLOP parabolas ------------------------------------------------------------------

def _budget_groups(C, budgets, tol_dex: float):
    """(budget, run indices) pairs: nearest given budget within ``tol_dex`` decades, or, without budgets,
    runs whose sorted log10 C are within ``tol_dex`` of a neighbour (budget = their geometric mean)."""
    log_c = np.log10(C)
    if budgets is not None:
        log_b = np.log10(_positive("budgets", budgets))
        nearest = np.argmin(np.abs(log_c[:, None] - log_b[None, :]), axis=1)
        near = np.abs(log_c - log_b[nearest]) <= tol_dex
        return [(10.0 ** lb, np.flatnonzero(near & (nearest == j))) for j, lb in enumerate(log_b)]
    order = np.argsort(log_c)
    cuts = np.flatnonzero(np.diff(log_c[order]) > tol_dex) + 1
    return [(10.0 ** log_c[idx].mean(), idx) for idx in np.split(order, cuts)]


def _parabola_minimum(log_n, loss):
    """Vertex of loss ≈ c₂x² + c₁x + c₀ in x = log N, or None when not convex or outside the sampled x."""
    if len(np.unique(log_n)) < 3:
        return None
    centre = log_n.mean()
    c2, c1, c0 = np.polyfit(log_n - centre, loss, 2)
    if not c2 > 0:
        return None
    x = -c1 / (2.0 * c2)
    if not log_n.min() - centre <= x <= log_n.max() - centre:
        return None
    return x + centre, c0 - c1 * c1 / (4.0 * c2)


def _vertices(N, loss, groups):
    """(used, skipped): (budget, run indices, vertex) of every group, split by whether its parabola has a vertex
    inside its sizes."""
    used, skipped = [], []
    for budget, idx in groups:
        vertex = _parabola_minimum(np.log(N[idx]), loss[idx]) if len(idx) else None
        (used if vertex else skipped).append((budget, idx, vertex))
    return used, skipped


def _power_laws(used):
    """N_opt = k_N·C^a, D_opt = k_D·C^b (D_opt = C/(6 N_opt)) and log L_opt linear in log C, through the vertices."""
    C_k = np.array([b for b, _, _ in used])
    N_opt = np.exp([v[0] for _, _, v in used])
    loss_opt = np.array([v[1] for _, _, v in used])
    a, log_kn = np.polyfit(np.log(C_k), np.log(N_opt), 1)
    b, log_kd = np.polyfit(np.log(C_k), np.log(C_k / (6.0 * N_opt)), 1)
    g, log_kl = np.polyfit(np.log(C_k), np.log(loss_opt), 1)
    return C_k, N_opt, loss_opt, (a, log_kn, b, log_kd, g, log_kl)


def isoflop_fit(N, D, loss, *, budgets=None, tol_dex: float = 0.1, holdout: bool = False, bootstrap: int = 0,
                seed: int = 0, ci: float = 0.95) -> dict:
    """Hoffmann et al.'s Approach 2: per compute budget (C = 6ND), fit a parabola of loss against log N;
    its vertex is N_opt(C), and D_opt = C/(6 N_opt). Then fit N_opt = k_N·C^a and D_opt = k_D·C^b by
    least squares in log space (a + b = 1 by construction).

    Runs are grouped by ``budgets`` (nominal C, nearest within ``tol_dex`` decades) or, without them, by
    gaps wider than ``tol_dex`` in sorted log10 C. A budget is skipped, and listed under ``skipped``, when
    it has fewer than three distinct sizes, is not convex, or its vertex lies outside the sizes it sampled.

    Held-out mode (``holdout``): the largest budget's runs are left out of the power laws, which are fitted on the
    usable budgets below it (at least two), and ``held_out`` compares what they predict at that budget with its own
    parabola's vertex: N_opt = k_N·C^a, and the optimal loss from log L_opt linear in log C through the fitted
    vertices (two constants: all a handful of budgets can pin down). ``bootstrap`` > 0 resamples the runs of every
    fitted budget with replacement (``seed``) and refits, for ``ci`` percentile intervals of both predictions
    (replicates in which fewer than two budgets keep a vertex are dropped and counted).
    """
    N, D, loss = _positive("N", N), _positive("D", D), _positive("loss", loss)
    if not (N.ndim == 1 and N.shape == D.shape == loss.shape):
        raise InputError(f"N, D, loss must be 1-D of one length; got shapes {N.shape}, {D.shape}, {loss.shape}")
    if isinstance(bootstrap, bool) or not isinstance(bootstrap, int) or bootstrap < 0:
        raise InputError(f"bootstrap = {bootstrap!r} is invalid: it must be an integer >= 0")
    C = training_flops(N, D)
    groups = _budget_groups(np.atleast_1d(C), budgets, tol_dex)
    held = None
    if holdout:
        largest = max(range(len(groups)), key=lambda j: groups[j][0])
        held = groups.pop(largest)
    used, skipped = _vertices(N, loss, groups)
    if len(used) < 2:
        raise InputError(f"isoflop_fit needs at least two usable compute budgets{' below the held-out one' if holdout else ''}; "
                         f"got {len(used)} (skipped budgets: {[f'{b:.3g}' for b, _, _ in skipped]})")
    C_k, N_opt, loss_opt, (a, log_kn, b, log_kd, _, _) = _power_laws(used)
    out = {"a": float(a), "b": float(b), "N_coef": float(np.exp(log_kn)), "D_coef": float(np.exp(log_kd)),
           "C": C_k, "N_opt": N_opt, "D_opt": C_k / (6.0 * N_opt), "loss_opt": loss_opt,
           "n_runs": np.array([len(i) for _, i, _ in used]), "skipped": [b for b, _, _ in skipped]}
    if holdout:
        out["held_out"] = _isoflop_held_out(N, loss, used, held, bootstrap, seed, ci)
    return out


def _isoflop_held_out(N, loss, used, held, bootstrap: int, seed: int, ci: float) -> dict:
    budget, idx = held
    *_, (a, log_kn, _, _, g, log_kl) = _power_laws(used)
    log_c = math.log(budget)
    out = {"budget": float(budget), "n_runs": int(len(idx)), "N_predicted": float(np.exp(log_kn + a * log_c)),
           "loss_predicted": float(np.exp(log_kl + g * log_c)), "fitted_budgets": [float(b) for b, _, _ in used]}
    if bootstrap:
        rng = np.random.default_rng(seed)
        preds = []
        for _ in range(bootstrap):
            resampled = [(b, rng.choice(i, size=len(i), replace=True)) for b, i, _ in used]
            rep, _ = _vertices(N, loss, resampled)
            if len(rep) >= 2:
                *_, (ra, rkn, _, _, rg, rkl) = _power_laws(rep)
                preds.append((np.exp(rkn + ra * log_c), np.exp(rkl + rg * log_c)))
        preds = np.array(preds)
        out |= {"bootstrap": bootstrap, "replicates_dropped": bootstrap - len(preds)}
        if len(preds):
            out |= {"N_ci": _interval(preds[:, 0], ci), "loss_ci": _interval(preds[:, 1], ci)}
    vertex = _parabola_minimum(np.log(N[idx]), loss[idx]) if len(idx) else None
    if vertex is not None:
        n_meas, l_meas = float(np.exp(vertex[0])), float(vertex[1])
        out |= {"N_measured": n_meas, "loss_measured": l_meas, "N_ratio": out["N_predicted"] / n_meas,
                "loss_error": out["loss_predicted"] - l_meas}
        if "N_ci" in out:
            out |= {"N_covered": out["N_ci"][0] <= n_meas <= out["N_ci"][1],
                    "loss_covered": out["loss_ci"][0] <= l_meas <= out["loss_ci"][1]}
    return out


# ----- data -------------------------------------------------------------------------------------------

def load_chinchilla_runs(path: str | os.PathLike, drop_highest: int = 5) -> dict:
    """The runs Besiroglu et al. (2024) extracted from Hoffmann et al.'s Figure 4 (columns ``Model Size``,
    ``Training FLOP``, ``loss``): N, C, D = C/(6N) and loss, without the ``drop_highest`` highest losses
    (their practice: 245 → 240 runs)."""
    path = Path(path)
    try:
        with path.open(newline="", encoding="utf-8") as fh:
            rows = list(csv.DictReader(fh))
    except FileNotFoundError:
        raise DataError(f"runs file {str(path)!r} does not exist") from None
    except OSError as exc:
        raise DataError(f"runs file {str(path)!r} cannot be read: {exc}") from None
    try:
        N, C, loss = (np.array([float(r[k]) for r in rows]) for k in ("Model Size", "Training FLOP", "loss"))
    except (KeyError, ValueError) as exc:
        raise DataError(f"runs file {str(path)!r} needs numeric columns 'Model Size', 'Training FLOP', "
                        f"'loss': {exc!r}") from None
    if not 0 <= drop_highest < len(loss):
        raise InputError(f"drop_highest = {drop_highest!r} must be in [0, {len(loss)}) for {str(path)!r}")
    keep = np.sort(np.argsort(loss, kind="stable")[: len(loss) - drop_highest])
    return {"N": N[keep], "C": C[keep], "D": C[keep] / (6.0 * N[keep]), "loss": loss[keep]}
