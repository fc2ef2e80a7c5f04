"""The CPU scaling-law sweep (experiments/scaling_sweep.py, U19 §8): its grid design, and one ``--quick`` run end
to end in a subprocess (training 15 tiny models, both fits, the plots), then a rerun that must train nothing."""

import csv
import dataclasses
import importlib
import json
import math
from pathlib import Path

import numpy as np
import pytest

from mlx_llm.errors import ConfigError
from mlx_llm.scaling.accounting import train_flops_per_token
from mlx_llm.scaling.laws import isoflop_fit
from mlx_llm.data import tokenizer as tok_lib
from helpers import python

REPO = Path(__file__).resolve().parents[1]
REQUIRED = ("name", "budget", "d_model", "n_layers", "N", "N_total", "D", "C", "steps", "batch_size", "seq_len", "loss",
            "val_bpb", "wall_seconds")
PLOTS = ("loss_vs_compute.png", "isoflop.png", "fitted_surface.png")
PARAMS = ("E", "A", "B", "alpha", "beta")


sweep_mod = importlib.import_module("experiments.scaling_sweep")  # the repository root is on sys.path (python -m)


# ----- the grid, without training ------------------------------------------------------------------------------
@pytest.mark.parametrize("setting", [sweep_mod.FULL, sweep_mod.QUICK], ids=["full", "quick"])
def test_grid_is_isoflop_shaped(setting):
    """≥ 3 budgets spanning 30×, each with ≥ 5 distinct sizes whose exact C = F·D is half a step from it."""
    points = sweep_mod.grid(setting, setting.vocab_size)
    budgets = setting.budgets()
    assert len(budgets) >= 3 and budgets[-1] / budgets[0] == pytest.approx(30.0, rel=1e-12)
    for budget in budgets:
        group = [p for p in points if p["budget"] == budget]
        sizes = {p["cfg"].param_count() for p in group}
        assert len(group) >= 5 and len(sizes) == len(group)
        for p in group:
            C = sweep_mod.training_compute(p["cfg"], p["tcfg"])
            assert C == train_flops_per_token(p["cfg"], setting.seq_len) * p["tcfg"].steps * p["tcfg"].batch_size \
                * p["tcfg"].seq_len
            # Whole steps: within half a step of the budget (≤ 1.1% for the full grid's ≥ 45-step runs).
            assert abs(C / budget - 1) <= 0.5 / p["tcfg"].steps + 1e-12
            if setting is sweep_mod.FULL:
                assert p["tcfg"].steps >= 45
    names = [p["name"] for p in points]
    assert len(set(names)) == len(names) >= 15


def test_learning_rate_rule():
    assert sweep_mod.peak_lr(64) == pytest.approx(4e-3)
    assert sweep_mod.peak_lr(16) == pytest.approx(8e-3)
    assert sweep_mod.peak_lr(256) == pytest.approx(2e-3)
    assert [sweep_mod.warmup(s) for s in (2, 30, 500, 5000)] == [2, 3, 50, 100]


def test_budgets_in_exact_flops_keep_the_steps():
    """Restated in exact FLOPs (module docstring), the default grids take about as many steps as when C was
    6·N_total·D (base budgets 3.5e10 and 6e8): within 1%, each run within −8% to +20% (quick: −7% to +2%)."""
    for setting, old_base, total, lo, hi in ((sweep_mod.FULL, 3.5e10, 18072, 0.92, 1.20),
                                             (sweep_mod.QUICK, 6e8, 3411, 0.92, 1.03)):
        old = dataclasses.replace(setting, base_budget=old_base).budgets()
        points = sweep_mod.grid(setting, setting.vocab_size)
        budget_index = {b: k for k, b in enumerate(setting.budgets())}
        old_steps = np.array([max(2, round(old[budget_index[p["budget"]]] / (6.0 * p["cfg"].param_count())
                                           / (p["tcfg"].batch_size * p["tcfg"].seq_len))) for p in points])
        new_steps = np.array([p["tcfg"].steps for p in points])
        assert old_steps.sum() == total and abs(new_steps.sum() / total - 1) < 0.01
        assert lo <= (new_steps / old_steps).min() and (new_steps / old_steps).max() <= hi


def test_isoflop_groups_runs_by_their_budget():
    """Approach 2 puts each run in its own budget's group, though 6·N_total·D of the d16-L1 runs lies more than
    0.1 decade below their exact C (F/(6·N_total) = 0.79), where ``isoflop_fit`` on the raw D drops them."""
    setting = sweep_mod.FULL
    points = sweep_mod.grid(setting, setting.vocab_size)
    N = np.array([float(p["cfg"].param_count()) for p in points])
    D = np.array([float(p["tcfg"].steps * p["tcfg"].batch_size * p["tcfg"].seq_len) for p in points])
    C = np.array([float(f"{sweep_mod.training_compute(p['cfg'], p['tcfg']):.6g}") for p in points])
    budget = np.array([float(f"{p['budget']:.6g}") for p in points])
    vertex = {b: np.log(N[budget == b]).mean() for b in set(budget.tolist())}  # a valley inside every budget
    loss = 3.0 + 0.1 * (np.log(N) - np.array([vertex[b] for b in budget])) ** 2
    runs = {"N": N, "D": D, "C": C, "loss": loss, "budget": budget}
    iso = sweep_mod.isoflop_by_budget(runs, setting.budgets())
    assert iso["skipped_budgets"] == [] and len(iso["N_opt"]) == 4
    np.testing.assert_allclose(np.log(iso["N_opt"]), [vertex[float(f"{b:.6g}")] for b in setting.budgets()],
                               rtol=1e-9)
    ratio = sweep_mod.flops_ratio(runs)
    np.testing.assert_allclose(iso["D_opt"], np.array(iso["C"]) / (6 * np.array(iso["N_opt"])
                                                                   * ratio(np.array(iso["N_opt"]))))
    raw = isoflop_fit(N, D, loss, budgets=setting.budgets())
    assert raw["n_runs"].sum() < len(points)  # grouped by 6·N·D, some runs fall outside every budget


# ----- one quick sweep end to end ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def quick_out(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep")
    # the suite's fast-compile XLA flags (conftest.py): the quick sweep is compile-bound (15 train steps, 5 evals)
    command = ["-m", "experiments.scaling_sweep", "--quick", "--out", out / "sweep", "--cache-dir", out / "cache"]
    proc = python(*command, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def _rows(out):
    return _read_csv(out / "sweep" / "sweep.csv")


def _read_csv(path):
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


def _huber_objective(params, N, D, L, delta=1e-3):
    """Hoffmann et al.'s Approach 3 objective, Σ Huber_δ(log L̂(N, D) − log L), in NumPy."""
    r = np.log(params["E"] + params["A"] / N ** params["alpha"] + params["B"] / D ** params["beta"]) - np.log(L)
    return float(np.sum(np.where(np.abs(r) <= delta, 0.5 * r * r, delta * (np.abs(r) - 0.5 * delta))))


@pytest.mark.slow
def test_csv_rows(quick_out):
    rows = _rows(quick_out)
    assert len(rows) >= 15 and set(REQUIRED) <= set(rows[0])
    num = {k: np.array([float(r[k]) for r in rows]) for k in REQUIRED if k != "name"}
    assert all(np.all(np.isfinite(v)) for v in num.values())
    assert np.all(num["N"] > 0) and np.all(num["N"] < num["N_total"]) and np.all(num["wall_seconds"] > 0)
    np.testing.assert_array_equal(num["D"], num["steps"] * num["batch_size"] * num["seq_len"])
    # C is the exact training compute: the grid point's FLOPs a token (the library's count) times D.
    vocab = tok_lib.load(quick_out / "sweep" / tok_lib.TOKENIZER_FILE).vocab_size
    points = {p["name"]: p for p in sweep_mod.grid(sweep_mod.QUICK, vocab)}
    flops = np.array([train_flops_per_token(points[r["name"]]["cfg"], int(r["seq_len"])) for r in rows])
    np.testing.assert_allclose(num["C"], flops * num["D"], rtol=1e-5)
    np.testing.assert_array_equal(num["steps"], [points[r["name"]]["tcfg"].steps for r in rows])
    assert num["budget"].max() / num["budget"].min() == pytest.approx(30.0, rel=1e-5)
    assert np.all(np.abs(num["C"] / num["budget"] - 1) <= 0.5 / num["steps"] + 1e-5)
    # Losses are below the uniform guess ln V (each run learned something) and above zero.
    assert np.all(num["loss"] > 0) and np.all(num["loss"] < math.log(sweep_mod.QUICK.vocab_size))
    # Every run is scored on the same val windows, so loss / bits-per-byte = ln 2 · bytes / targets is one number.
    ratio = num["loss"] / num["val_bpb"]
    np.testing.assert_allclose(ratio, ratio[0], rtol=2e-5)


@pytest.mark.slow
def test_fit_json(quick_out):
    fit = json.loads((quick_out / "sweep" / "fit.json").read_text())
    a3 = fit["approach3"]
    values = [a3[k] for k in PARAMS]
    assert all(math.isfinite(v) and v >= 0 for v in values) and a3["A"] > 0 and a3["B"] > 0
    assert a3["N_opt_exponent"] == pytest.approx(a3["beta"] / (a3["alpha"] + a3["beta"]), rel=1e-12)
    assert a3["N_opt_exponent"] + a3["D_opt_exponent"] == pytest.approx(1.0, abs=1e-12)
    for k in PARAMS:
        lo, hi = a3["ci95"][k]
        assert lo <= hi
    # The stored objective is Hoffmann's Huber loss of the stored parameters on the CSV's runs.
    rows = _rows(quick_out)
    N, D, L = (np.array([float(r[k]) for r in rows]) for k in ("N_total", "D", "loss"))
    assert _huber_objective(a3, N, D, L) == pytest.approx(a3["objective"], rel=1e-6, abs=1e-12)
    a2 = fit["approach2"]
    assert "N_opt_exponent" in a2 and "D_opt_exponent" in a2
    if a2["N_opt_exponent"] is not None:  # D_opt: the tokens N_opt reads at exact C, so a + b = 1 only if F ∝ N
        runs = sweep_mod.load_sweep(quick_out / "sweep" / "sweep.csv")
        N_opt, C_opt = np.array(a2["N_opt"]), np.array(a2["C"])
        np.testing.assert_allclose(a2["D_opt"], C_opt / (6 * N_opt * sweep_mod.flops_ratio(runs)(N_opt)), rtol=1e-9)
        assert a2["D_opt_exponent"] == pytest.approx(np.polyfit(np.log(C_opt), np.log(a2["D_opt"]), 1)[0])
    else:
        assert "budgets" in a2["error"]


@pytest.mark.slow
def test_plots(quick_out):
    for name in PLOTS:
        data = (quick_out / "sweep" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


@pytest.mark.slow
def test_rerun_trains_nothing(quick_out):
    before = (quick_out / "sweep" / "sweep.csv").read_text()
    lines = []
    sweep_mod.sweep(quick_out / "sweep", sweep_mod.QUICK, quick_out / "cache", log=lines.append)
    assert (quick_out / "sweep" / "sweep.csv").read_text() == before
    assert sum("already in sweep.csv, skipped" in line for line in lines) == len(_rows(quick_out)) >= 15


@pytest.mark.slow
def test_other_grid_refused(quick_out):
    with pytest.raises(ConfigError, match="another grid"):
        sweep_mod.sweep(quick_out / "sweep", sweep_mod.FULL, quick_out / "cache")


# ----- the committed results of one full default sweep -----------------------------------------------------------
RESULTS = REPO / "experiments" / "results"


def _committed_setting():
    """The grid of the committed sweep (its setting.json) and whether it counts C as exact FLOPs: that sweep ran
    before the exact accounting, with C = 6·N_total·D and budgets from 3.5e10, until it is rerun."""
    saved = json.loads((RESULTS / "setting.json").read_text())
    exact = saved.get("flops") == "train_flops_per_token"
    fields = {k: v for k, v in json.loads(json.dumps(dataclasses.asdict(sweep_mod.FULL))).items()
              if k not in ("base_budget", "flops")}
    assert {k: saved.get(k) for k in fields} == fields  # the default grid, but perhaps its base budget
    return dataclasses.replace(sweep_mod.FULL, base_budget=saved["base_budget"]), exact


def test_committed_sweep_csv():
    rows = _read_csv(RESULTS / "sweep.csv")
    assert len(rows) >= 15 and set(REQUIRED) <= set(rows[0])
    num = {k: np.array([float(r[k]) for r in rows]) for k in REQUIRED if k != "name"}
    assert all(np.all(np.isfinite(v)) for v in num.values())
    np.testing.assert_array_equal(num["D"], num["steps"] * num["batch_size"] * num["seq_len"])
    setting, exact = _committed_setting()
    budgets = setting.budgets()
    expected = {p["name"]: p for p in sweep_mod.grid(setting, setting.vocab_size)}
    assert {r["name"] for r in rows} == set(expected)  # exactly the default grid
    for r in rows:
        p = expected[r["name"]]
        n_total, tokens_per_step = p["cfg"].param_count(), p["tcfg"].batch_size * p["tcfg"].seq_len
        if exact:  # sized and counted as the grid does now
            steps, C = p["tcfg"].steps, sweep_mod.training_compute(p["cfg"], p["tcfg"])
        else:  # the old sizing: D = C_k / (6·N_total) in whole steps (at least 2), C = 6·N_total·D
            steps = max(2, round(p["budget"] / (6.0 * n_total) / tokens_per_step))
            C = 6.0 * n_total * steps * tokens_per_step
        assert (int(r["N_total"]), int(r["steps"])) == (n_total, steps)
        assert float(r["C"]) == pytest.approx(C, rel=1e-5)
        assert float(r["budget"]) == pytest.approx(p["budget"], rel=1e-5)
    for budget in budgets:  # every budget of the grid has a valley inside its sizes
        pick = np.isclose(num["budget"], budget, rtol=1e-5)
        losses = num["loss"][pick][np.argsort(num["N_total"][pick])]
        assert pick.sum() >= 5 and losses.argmin() not in (0, len(losses) - 1)


def test_committed_fits_match_the_csv():
    """fit.json is what the two approaches give on sweep.csv: Approach 2 recomputed exactly (by the sweep's grouping
    by budget too); Approach 3's stored objective is the Huber loss at its parameters, and no 1% move of one
    parameter lowers it."""
    fit = json.loads((RESULTS / "fit.json").read_text())
    rows = _read_csv(RESULTS / "sweep.csv")
    N, D, L = (np.array([float(r[k]) for r in rows]) for k in ("N_total", "D", "loss"))
    budgets = _committed_setting()[0].budgets()
    a2 = fit["approach2"]
    iso = sweep_mod.isoflop_by_budget(sweep_mod.load_sweep(RESULTS / "sweep.csv"), budgets)
    if not _committed_setting()[1]:  # C = 6·N_total·D: grouping by 6ND and by budget are one grouping
        raw = isoflop_fit(N, D, L, budgets=budgets)
        assert raw["a"] == pytest.approx(a2["N_opt_exponent"], rel=1e-9)
    assert iso["N_opt_exponent"] == pytest.approx(a2["N_opt_exponent"], rel=1e-9)
    np.testing.assert_allclose(iso["N_opt"], a2["N_opt"], rtol=1e-9)
    assert 0.3 < a2["N_opt_exponent"] < 0.7  # Hoffmann et al. report 0.49 for their Approach 2
    a3 = fit["approach3"]
    best = _huber_objective(a3, N, D, L)
    assert best == pytest.approx(a3["objective"], rel=1e-6)
    for k in PARAMS:
        for step in (0.99, 1.01):
            assert _huber_objective({**a3, k: a3[k] * step}, N, D, L) > best
    assert a3["converged"] and a3["n_starts"] == 4500
    for k in PARAMS:
        lo, hi = a3["ci95"][k]
        assert lo <= a3[k] <= hi


def test_committed_plots():
    for name in PLOTS:
        data = (RESULTS / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and 5000 < len(data) < 200_000
