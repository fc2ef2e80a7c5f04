"""The fits of a scaling sweep's table (``runs.sweep.run_sweep``'s rows, or the CSV it writes): Approach 3
(``laws.fit_chinchilla``, bootstrap intervals) and Approach 2 (``laws.isoflop_fit``, each run in its own budget's
group), each also held out — fitted on every budget but the largest and scored on that one.

Units: ``N`` is the whole parameter count N_total (embeddings included), the variable of the law; ``D`` every
token position a training step processes (steps × batch × seq_len); ``C`` the exact training FLOPs of a run
(``accounting.train_flops_per_token`` × D), ``budget`` the compute budget the run was sized for. The laws' own
C = 6ND is mapped onto the runs' exact C by ``flops_ratio``.
"""

from __future__ import annotations

import numpy as np

from mlx_llm.errors import InputError, MLXLLMError
from mlx_llm.scaling.laws import fit_chinchilla, isoflop_fit, optimal_exponents

NUMERIC = ("N_total", "D", "C", "loss", "budget")


def runs_of(table) -> dict:
    """The runs of a sweep table (a list of records, a pandas DataFrame, or rows read from its CSV) as float
    arrays ``N`` (= N_total), ``D``, ``C``, ``loss``, ``budget``, plus ``name`` and ``budget_unit``."""
    rows = table.to_dict("records") if hasattr(table, "to_dict") else list(table)
    if not rows:
        raise InputError("the sweep table has no rows: there is nothing to fit")
    missing = [k for k in (*NUMERIC, "name") if k not in rows[0]]
    if missing:
        raise InputError(f"the sweep table lacks column(s) {missing}: give run_sweep's rows or its sweep.csv")
    out = {k: np.array([float(r[k]) for r in rows]) for k in NUMERIC}
    out["N"] = out.pop("N_total")
    out["name"] = [r["name"] for r in rows]
    out["budget_unit"] = {r.get("budget_unit", "flops") for r in rows}
    return out


def flops_ratio(runs: dict):
    """N ↦ F/(6N): the runs' exact FLOPs a token over 6·N_total (C/(6·N·D)), interpolated in log N between the
    sizes and held beyond them. It maps the laws' C = 6ND (Approach 3's frontier, IsoFLOP lines) onto the runs'
    exact compute."""
    log_n, first = np.unique(np.log(runs["N"]), return_index=True)
    ratio = (runs["C"] / (6.0 * runs["N"] * runs["D"]))[first]
    return lambda N: np.interp(np.log(N), log_n, ratio)


def isoflop_by_budget(runs: dict, budgets, *, holdout: bool = False, bootstrap: int = 0, seed: int = 0) -> dict:
    """Approach 2 (``isoflop_fit``) with each run in its own budget's group: the fit groups by 6·N·D, which lies
    up to 0.1 decade from the exact C at these sizes, so it is given D' = budget/(6N), which puts 6·N·D' on the
    budget; its parabola vertex N_opt(C) reads N and the loss only. D_opt are then the tokens the N_opt model reads
    at C, C/(6·N_opt·``flops_ratio``(N_opt)), and D_opt ∝ C^b is fitted to them (a + b = 1 only where F ∝ N).
    ``holdout``: the largest budget held out (``isoflop_fit``'s held-out mode, ``bootstrap`` replicates)."""
    iso = isoflop_fit(runs["N"], runs["budget"] / (6.0 * runs["N"]), runs["loss"], budgets=budgets,
                      holdout=holdout, bootstrap=bootstrap, seed=seed)
    d_opt = iso["C"] / (6.0 * iso["N_opt"] * flops_ratio(runs)(iso["N_opt"]))
    b, log_kd = np.polyfit(np.log(iso["C"]), np.log(d_opt), 1)
    out = {"N_opt_exponent": iso["a"], "D_opt_exponent": float(b), "N_coef": iso["N_coef"],
           "D_coef": float(np.exp(log_kd)), "C": iso["C"].tolist(), "N_opt": iso["N_opt"].tolist(),
           "D_opt": d_opt.tolist(), "loss_opt": iso["loss_opt"].tolist(), "skipped_budgets": iso["skipped"]}
    if holdout:
        out["held_out"] = iso["held_out"]
    return out


def _approach3(fit: dict, bootstrap: int) -> dict:
    a, b = optimal_exponents(fit["params"])
    out = {k: fit[k] for k in ("E", "A", "B", "alpha", "beta", "objective", "grad_max", "converged", "n_runs",
                               "n_starts", "n_at_best")}
    out |= {"N_opt_exponent": a, "D_opt_exponent": b, "bootstrap": bootstrap}
    if bootstrap:
        alpha_s, beta_s = fit["samples"]["alpha"], fit["samples"]["beta"]
        samples = np.stack([beta_s / (alpha_s + beta_s), alpha_s / (alpha_s + beta_s)], axis=1)
        out["ci95"] = {k: list(v) for k, v in fit["ci"].items()}
        out["unbounded"] = fit["unbounded"]  # replicates whose A, B or E left the float range (interval end: inf)
        out["ci95"] |= {"N_opt_exponent": list(np.nanpercentile(samples[:, 0], [2.5, 97.5])),
                        "D_opt_exponent": list(np.nanpercentile(samples[:, 1], [2.5, 97.5]))}
    return out


def fit_sweep(table, *, bootstrap: int = 200, grid=None, seed: int = 0, holdout: bool = True) -> dict:
    """Both approaches on a sweep's runs: ``approach3`` (``fit_chinchilla`` from ``grid``, default Hoffmann's 4 500
    starts with 3 polished, else 1; ``bootstrap`` replicates), ``approach2`` (``isoflop_by_budget``; its ``error``
    when fewer than two budgets show a valley) and, with ``holdout`` and at least three budgets, ``held_out``:
    both refitted without the largest budget and scored on it (``laws.predict_held_out`` and ``isoflop_fit``'s
    held-out mode: each run's predicted loss, the budget's compute-optimal N and loss, bootstrap intervals, the
    errors against what was measured). ``params`` holds Approach 3's ``ChinchillaParams`` (for plotting)."""
    runs = runs_of(table)
    if runs["budget_unit"] != {"flops"}:
        raise InputError(f"fit_sweep fits IsoFLOP sweeps (budgets in training FLOPs); this table's budgets are "
                         f"{sorted(runs['budget_unit'])}")
    budgets = sorted(set(runs["budget"].tolist()))
    polish = 3 if grid is None else 1
    fit = fit_chinchilla(runs["N"], runs["D"], runs["loss"], bootstrap=bootstrap, seed=seed, grid=grid,
                         polish_top=polish)
    try:
        approach2 = isoflop_by_budget(runs, budgets)
    except MLXLLMError as exc:  # fewer than two budgets with a valley inside their sizes
        approach2 = {"N_opt_exponent": None, "D_opt_exponent": None, "error": str(exc)}
    out = {"approach3": _approach3(fit, bootstrap), "approach2": approach2, "params": fit["params"],
           "notes": "N = N_total (all parameters, embeddings included); C = exact training FLOPs = "
                    "train_flops_per_token × D (Approach 3's frontier itself is in the law's C = 6ND); loss = final "
                    "val loss (nats/token)"}
    if holdout and len(budgets) >= 3:
        out["held_out"] = held_out(runs, budgets, bootstrap=bootstrap, grid=grid, seed=seed)
    return out


def held_out(runs: dict, budgets, *, bootstrap: int, grid=None, seed: int = 0) -> dict:
    """Both approaches fitted on every budget but the largest and scored on it: ``approach3`` (the law refitted
    on the smaller budgets, its fitted constants, ``n_fitted`` the runs it was fitted on, and ``predict_held_out``'s
    predictions, ``n_runs`` the held-out runs) and ``approach2``
    (``isoflop_fit``'s held-out mode; its ``error`` when fewer than two smaller budgets show a valley)."""
    fit = fit_chinchilla(runs["N"], runs["D"], runs["loss"], bootstrap=bootstrap, seed=seed, grid=grid,
                         polish_top=3 if grid is None else 1, holdout=runs["budget"])
    a3 = {k: fit[k] for k in ("E", "A", "B", "alpha", "beta", "converged")} | {"n_fitted": fit["n_runs"]} \
        | fit["held_out"]
    try:
        a2 = isoflop_by_budget(runs, budgets, holdout=True, bootstrap=bootstrap, seed=seed)["held_out"]
    except MLXLLMError as exc:
        a2 = {"error": str(exc)}
    return {"budget": float(max(budgets)), "approach3": a3, "approach2": a2}
