"""The scaling sweep as a library call (mlx_llm.runs.sweep: SweepSpec, run_sweep; mlx_llm.scaling.sweep: its fits)
and its command line (experiments/scaling_sweep.py, U19 §8): the grids' design without training; a small sweep
whose points are ordinary runs, run twice (the second trains nothing), killed in the middle and finished, and
refused under another spec by field name; stopped by a signal (the whole sweep, its point checkpointed), by a
full disk (one line), and its files damaged (one line each); one ``--quick`` sweep end to end with its fits (held
out too) and plots; the committed results of the full sweep."""

import dataclasses
import importlib
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mlx_llm.config import SEED_MAX, ModelConfig, TrainConfig
from mlx_llm.data import text as text_lib
from mlx_llm.errors import CheckpointWriteError, ConfigError, DataError, InputError
from mlx_llm.runs import sweep as sweep_lib
from mlx_llm.runs.configs import DataSpec
from mlx_llm.runs.sweep import (COLUMNS, TIMING, SweepSpec, SweepStopped, points, read_table, run_sweep,
                                training_compute)
from mlx_llm.runs.sweep_table import load_table, write_table
from mlx_llm.scaling.accounting import steps_for_flops, train_flops_per_token
from mlx_llm.scaling.laws import isoflop_fit
from mlx_llm.scaling.sweep import fit_sweep, flops_ratio, isoflop_by_budget, runs_of
from helpers import python, snapshot

REPO = Path(__file__).resolve().parents[1]
PLOTS = ("loss_vs_compute.png", "isoflop.png", "fitted_surface.png")
PARAMS = ("E", "A", "B", "alpha", "beta")
sweep_mod = importlib.import_module("experiments.scaling_sweep")  # the repository root is on sys.path (python -m)

# Two one-layer sizes × two budgets on the stdlib's json package (a 320-token BPE): 7 and 4 steps at 1e8 FLOPs,
# 21 and 13 at 3e8.
SMALL = SweepSpec(
    model=ModelConfig(vocab_size=320, d_model=16, n_layers=1, n_heads=1, n_kv_heads=1, d_head=16, d_ff=48,
                      max_seq_len=32),
    sizes=({"d_model": 16, "d_ff": 48}, {"d_model": 24, "d_ff": 64}), budgets=(1e8, 3e8),
    train=TrainConfig(batch_size=8, seq_len=32, lr=4e-3, warmup_steps=100, eval_tokens=256, log_interval=50,
                      checkpoint_interval=10, keep_checkpoints=1),
    data=DataSpec(path=str(text_lib.stdlib_root() / "json"), vocab_size=320))
SMALL_NAMES = ["C0-d16-L1-s0", "C0-d24-L1-s0", "C1-d16-L1-s0", "C1-d24-L1-s0"]


def _untimed(table) -> list[dict]:
    rows = table.to_dict("records") if hasattr(table, "to_dict") else table
    return [{k: v for k, v in r.items() if k not in (*TIMING, "run")} for r in rows]


# ----- specs and grids, without training --------------------------------------------------------------------------
def test_small_grid_is_sized_by_the_library():
    pts = points(SMALL, 320)
    assert [p.name for p in pts] == SMALL_NAMES
    for p in pts:
        assert p.tcfg.steps == steps_for_flops(p.cfg, 32, 8, p.budget)
        assert p.tcfg.warmup_steps == min(100, max(2, p.tcfg.steps // 10), p.tcfg.steps)
        assert p.tcfg.eval_interval == p.tcfg.steps and p.tcfg.checkpoint_interval == min(10, p.tcfg.steps)
        assert abs(training_compute(p.cfg, p.tcfg) / p.budget - 1) <= 0.5 / p.tcfg.steps + 1e-12
    assert [p.tcfg.steps for p in pts] == [7, 4, 21, 13]
    lrs = dataclasses.replace(SMALL, lrs=(1e-2, 5e-3), seeds=(3, 4), windows=((1,), (0, 1)), batch_sizes=(4, 16))
    pts = points(lrs, 320)
    assert [(p.name, p.tcfg.lr, p.tcfg.seed, p.tcfg.batch_size) for p in pts] == [
        ("C0-d24-L1-s3", 5e-3, 3, 4), ("C0-d24-L1-s4", 5e-3, 4, 4), ("C1-d16-L1-s3", 1e-2, 3, 16),
        ("C1-d16-L1-s4", 1e-2, 4, 16), ("C1-d24-L1-s3", 5e-3, 3, 16), ("C1-d24-L1-s4", 5e-3, 4, 16)]
    ratio = points(dataclasses.replace(SMALL, budgets=(), tokens_per_param=(20.0,)), 320)
    assert [p.name for p in ratio] == ["R0-d16-L1-s0", "R0-d24-L1-s0"]
    assert ratio[0].tcfg.steps == round(20 * ratio[0].cfg.param_count() / 256)


@pytest.mark.parametrize("fields,message", [
    ({"budgets": ()}, "exactly one of budgets"),
    ({"tokens_per_param": (20.0,)}, "exactly one of budgets"),
    ({"budgets": (1e8, -1.0)}, "budgets = \\[100000000.0, -1.0\\] is invalid"),
    ({"windows": ((0, 1),)}, "windows has 1 entries: give one per budget \\(2\\)"),
    ({"windows": ((0, 2), (1,))}, "windows\\[0\\] = \\[0, 2\\] is invalid"),
    ({"lrs": (1e-3,)}, "lrs has 1 entries: give one per size \\(2\\)"),
    ({"seeds": (1, 1)}, "seeds = \\[1, 1\\] is invalid"),
    ({"sizes": ({"d_modle": 16},)}, "unknown ModelConfig field\\(s\\) \\['d_modle'\\]"),
    ({"sizes": ({"n_kv_heads": 2},)}, "n_heads = 1 is not divisible by n_kv_heads = 2"),
    ({"param_count": "some"}, "param_count = 'some' is invalid"),
])
def test_bad_specs_are_refused(fields, message):
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(SMALL, **fields)


def test_spec_round_trips_through_json():
    full = sweep_mod.FULL
    assert SweepSpec.from_dict(json.loads(json.dumps(full.to_dict()))) == full


@pytest.mark.parametrize("grid", [sweep_mod.FULL, sweep_mod.QUICK], ids=["full", "quick"])
def test_experiment_grids_are_isoflop_shaped(grid):
    """≥ 3 budgets spanning 30×, each with ≥ 5 distinct sizes whose exact C = F·D is half a step from it; μP with
    the smallest model as its base and one learning rate."""
    pts = points(grid, grid.data.vocab_size)
    assert len(grid.budgets) >= 3 and grid.budgets[-1] / grid.budgets[0] == pytest.approx(30.0, rel=1e-12)
    for k, budget in enumerate(grid.budgets):
        group = [p for p in pts if p.budget_index == k]
        assert len(group) >= 5 and len({p.cfg.param_count() for p in group}) == len(group)
        for p in group:
            assert abs(training_compute(p.cfg, p.tcfg) / budget - 1) <= 0.5 / p.tcfg.steps + 1e-12
            assert p.cfg.parametrization == "mup" and p.cfg.mup_base_width == grid.sizes[0]["d_model"]
            assert p.tcfg.lr == grid.train.lr
            if grid is sweep_mod.FULL:
                assert p.tcfg.steps >= 45
    assert len({p.name for p in pts}) == len(pts) >= 15


def test_one_full_point_by_hand():
    """C0-d8-L1-s0 of the full grid: d = 8, one layer, one head of 16, d_ff 32, V = 512, T = 128, 4 sequences.
    N_mm = 4·8·16 + 3·8·32 + 8·512 = 5 376; F = 6·5 376 + 12·128·16 = 56 832 FLOPs a token;
    steps = 3.3e10 / (56 832 · 4 · 128) = 1 134.1 → 1 134."""
    point = next(p for p in points(sweep_mod.FULL, 512) if p.name == "C0-d8-L1-s0")
    cfg = point.cfg
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.d_head, cfg.d_ff, cfg.vocab_size) == (8, 1, 1, 16, 32, 512)
    assert train_flops_per_token(cfg, 128) == 6 * 5376 + 12 * 128 * 16 == 56832
    assert point.budget == 3.3e10 and point.tcfg.steps == 1134 and point.tcfg.warmup_steps == 100


def test_isoflop_groups_runs_by_their_budget():
    """Approach 2 puts each run in its own budget's group, though 6·N_total·D of the d16-L1 runs lies more than
    0.1 decade below their exact C (F/(6·N_total) = 0.79), where ``isoflop_fit`` on the raw D drops them."""
    pts = points(sweep_mod.FULL, 512)
    N = np.array([float(p.cfg.param_count()) for p in pts])
    D = np.array([float(p.tcfg.steps * p.tcfg.batch_size * p.tcfg.seq_len) for p in pts])
    C = np.array([training_compute(p.cfg, p.tcfg) for p in pts])
    budget = np.array([p.budget for p in pts])
    vertex = {b: np.log(N[budget == b]).mean() for b in set(budget.tolist())}  # a valley inside every budget
    loss = 3.0 + 0.1 * (np.log(N) - np.array([vertex[b] for b in budget])) ** 2
    runs = {"N": N, "D": D, "C": C, "loss": loss, "budget": budget}
    iso = isoflop_by_budget(runs, sweep_mod.FULL.budgets)
    assert iso["skipped_budgets"] == [] and len(iso["N_opt"]) == 4
    np.testing.assert_allclose(np.log(iso["N_opt"]), [vertex[b] for b in sweep_mod.FULL.budgets], rtol=1e-9)
    ratio = flops_ratio(runs)
    np.testing.assert_allclose(iso["D_opt"], np.array(iso["C"]) / (6 * np.array(iso["N_opt"])
                                                                   * ratio(np.array(iso["N_opt"]))))
    raw = isoflop_fit(N, D, loss, budgets=sweep_mod.FULL.budgets)
    assert raw["n_runs"].sum() < len(pts)  # grouped by 6·N·D, some runs fall outside every budget


def test_fit_sweep_refuses_what_it_cannot_fit():
    with pytest.raises(InputError, match="no rows"):
        fit_sweep([])
    with pytest.raises(InputError, match="lacks column\\(s\\) \\['D'"):
        fit_sweep([{"name": "x", "N_total": 1, "C": 1, "loss": 1, "budget": 1}])


def test_unknown_runner_and_missing_ray_write_nothing(monkeypatch, tmp_path):
    with pytest.raises(ConfigError, match="runner = 'slurm' is invalid"):
        run_sweep(SMALL, tmp_path / "a", runner="slurm")
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(ConfigError, match="pip install 'mlx_llm\\[sweep\\]'"):
        run_sweep(SMALL, tmp_path / "a", runner="ray")
    assert not (tmp_path / "a").exists()


# ----- a small sweep, run in fresh interpreters (as a notebook or the command runs it; this process has x64 on) -----
SWEEP = ("import json, sys; from pathlib import Path; from mlx_llm.runs.sweep import SweepSpec, run_sweep; "
         "run_sweep(SweepSpec.from_dict(json.loads(sys.argv[3])), Path(sys.argv[1]), cache_dir=Path(sys.argv[2]))")


def _sweep_in_subprocess(out: Path, cache: Path):
    proc = python("-c", SWEEP, out, cache, json.dumps(SMALL.to_dict()))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    proc = _sweep_in_subprocess(root / "a", root / "cache")
    return root, proc.stdout


@pytest.mark.slow
def test_points_are_ordinary_runs(small):
    from mlx_llm.eval.compare import metric_of
    from mlx_llm.eval.val import evaluate_run
    from mlx_llm.runs.record import open_run

    root, stdout = small
    rows = read_table(root / "a" / "sweep.csv")
    assert [r["name"] for r in rows] == SMALL_NAMES and list(rows[0]) == list(COLUMNS)
    assert sum(f"[{i}/4] " in stdout for i in range(1, 5)) == 4
    for r, p in zip(rows, points(SMALL, 320)):
        run = open_run(r["run"])
        assert run.kind == "pretrain" and run.cfg == p.cfg and run.tcfg == p.tcfg
        assert metric_of(run, "val_loss") == pytest.approx(r["loss"], rel=1e-12)  # what compare reads
        assert r["D"] == p.tcfg.steps * 8 * 32 and r["C"] == training_compute(p.cfg, p.tcfg)
        assert math.isfinite(r["loss"]) and r["wall_seconds"] > 0
    for size in ("d16", "d24"):  # each size learned more with the larger budget
        assert next(r["loss"] for r in rows if r["name"] == f"C1-{size}-L1-s0") < \
            next(r["loss"] for r in rows if r["name"] == f"C0-{size}-L1-s0")
    ratio = np.array([r["loss"] / r["val_bpb"] for r in rows])  # the same val windows for every run
    np.testing.assert_allclose(ratio, ratio[0], rtol=2e-5)
    step, result = evaluate_run(rows[0]["run"], cache_dir=root / "cache")  # mlx-llm eval's path
    assert step == 7 and math.isfinite(result.loss)


@pytest.mark.slow
def test_second_run_trains_nothing(small):
    root, _ = small
    before, lines = snapshot(root / "a"), []
    table = run_sweep(SMALL, root / "a", cache_dir=root / "cache", log=lines.append)
    assert snapshot(root / "a") == before
    assert sum("in sweep.csv, skipped" in line for line in lines) == 4 and not any("N = " in x for x in lines)
    assert _untimed(table) == _untimed(read_table(root / "a" / "sweep.csv"))


@pytest.mark.slow
def test_another_spec_is_refused_by_name_and_writes_nothing(small):
    root, _ = small
    before = snapshot(root / "a")
    other = dataclasses.replace(SMALL, train=dataclasses.replace(SMALL.train, lr=1e-3), budgets=(1e8, 1e9))
    with pytest.raises(ConfigError, match="another spec: budgets, train.lr differ"):
        run_sweep(other, root / "a", cache_dir=root / "cache")
    assert snapshot(root / "a") == before
    (root / "b").mkdir()
    (root / "b" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="is not empty and holds no sweep.json"):
        run_sweep(SMALL, root / "b")
    assert snapshot(root / "b") == {"notes.txt": snapshot(root / "b")["notes.txt"]}


@pytest.mark.slow
def test_a_killed_sweep_finishes_the_rest(small):
    """A sweep killed (SIGKILL) once its first row is written, then run again: the finished point is not touched,
    the rest are trained (a half-trained one resumed from its checkpoint), and the table equals the uninterrupted
    sweep's, losses bit for bit."""
    root, _ = small
    out = root / "killed"
    proc = python("-c", SWEEP, out, root / "cache", json.dumps(SMALL.to_dict()), popen=True, start_new_session=True)
    deadline = time.monotonic() + 300
    while len(read_table(out / "sweep.csv")) < 1 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done = read_table(out / "sweep.csv")
    assert 1 <= len(done) < 4, "the sweep was not stopped in the middle"
    first = snapshot(out / "runs" / done[0]["name"])
    rerun = _sweep_in_subprocess(out, root / "cache")
    assert f"{done[0]['name']}: in sweep.csv, skipped" in rerun.stdout
    assert snapshot(out / "runs" / done[0]["name"]) == first
    assert _untimed(read_table(out / "sweep.csv")) == _untimed(read_table(root / "a" / "sweep.csv"))


# ----- what a spec accepts, and what a refused sweep leaves -------------------------------------------------------
@pytest.mark.parametrize("fields,message", [
    ({"budgets": (1e8, math.inf)}, "budgets = \\[100000000.0, inf\\] is invalid: each must be a finite number > 0"),
    ({"budgets": (), "tokens_per_param": (math.inf,)}, "tokens_per_param = \\[inf\\] is invalid"),
    ({"lrs": (1e-3, math.inf)}, "lrs = \\[0.001, inf\\] is invalid"),
    ({"lrs": (True, 1e-3)}, "lrs = \\[True, 0.001\\] is invalid"),
    ({"seeds": (0, 2**64)}, f"seeds = \\[0, {2**64}\\] is invalid: integers in \\[0, {SEED_MAX}\\]"),
    ({"seeds": (-1,)}, "seeds = \\[-1\\] is invalid"),
    ({"batch_sizes": (8, 2**31)}, f"batch_sizes = \\[8, {2**31}\\] is invalid"),
    ({"sizes": ("d_model",)}, "sizes\\[0\\] = 'd_model' is invalid: each size is a mapping"),
    ({"windows": 5}, "windows = 5 is invalid"),
])
def test_every_field_is_checked_at_construction(fields, message):
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(SMALL, **fields)


def test_the_largest_seed_is_a_sweep_seed_and_a_bad_dict_is_one_line():
    assert points(dataclasses.replace(SMALL, seeds=(SEED_MAX,)), 320)[0].tcfg.seed == SEED_MAX
    with pytest.raises(ConfigError, match="unknown field\\(s\\) \\['budget'\\]"):
        SweepSpec.from_dict({**SMALL.to_dict(), "budget": 1e8})
    with pytest.raises(ConfigError, match="a sweep spec is a JSON object; got list"):
        SweepSpec.from_dict([])


def test_a_refused_sweep_writes_nothing(tmp_path):
    """A spec refused once its data is opened (here: no such corpus) leaves no directory, and in an empty one it
    was given nothing: the corrected spec then starts there as a new sweep (before, sweep.json stayed behind and
    the corrected spec was refused as "another spec")."""
    bad = dataclasses.replace(SMALL, data=dataclasses.replace(SMALL.data, path=str(tmp_path / "missing")))
    with pytest.raises(DataError):
        run_sweep(bad, tmp_path / "new", progress=False)
    assert not (tmp_path / "new").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError):
        run_sweep(bad, tmp_path / "empty", progress=False)
    assert list((tmp_path / "empty").iterdir()) == []
    assert sweep_lib.check_spec(tmp_path / "empty", SMALL) is False  # the corrected spec is a new sweep there


@pytest.mark.parametrize("text,message", [
    ("[" * 100_000 + "]" * 100_000, "sweep.json:1: nested too deeply"),
    ("[1, 2]", "holds a sweep of another spec: the whole spec differ"),
    ('{"model": 1', "sweep.json:1: not valid JSON"),
])
def test_a_damaged_sweep_json_is_one_line_and_changes_nothing(tmp_path, text, message):
    (tmp_path / "sweep.json").write_text(text)
    before = snapshot(tmp_path)
    with pytest.raises(ConfigError, match=message) as err:
        run_sweep(SMALL, tmp_path, progress=False)
    assert "\n" not in str(err.value) and snapshot(tmp_path) == before


def _rows(n: int) -> list[dict]:
    """``n`` rows of the small grid, with made-up measurements."""
    out = []
    for k, p in enumerate(points(SMALL, 320)[:n]):
        out.append({"name": p.name, "budget": p.budget, "budget_unit": p.budget_unit, "budget_index": p.budget_index,
                    "size_index": p.size_index, "seed": p.seed, "d_model": p.cfg.d_model, "n_layers": 1,
                    "n_heads": 1, "d_ff": p.cfg.d_ff, "N": 1000 + k, "N_total": 2000 + k, "D": 256 * p.tcfg.steps,
                    "C": training_compute(p.cfg, p.tcfg), "steps": p.tcfg.steps, "batch_size": 8, "seq_len": 32,
                    "lr": 4e-3, "warmup_steps": 2, "loss": 5.0 - k / 3, "val_bpb": None if k else 2.0 / 3,
                    "val_ppl": math.exp(5.0 - k / 3), "wall_seconds": 0.1 * k, "tokens_per_second": 1e4 / 3,
                    "run": f"/runs/{p.name}"})
    return out


def test_the_table_round_trips_and_a_cut_row_never_counts(tmp_path):
    """Rows come back exactly; a last row cut short (a kill while a version that appended in place wrote it) is
    refused by read_table and dropped by run_sweep's reader (before, it counted as a finished point)."""
    path = tmp_path / "sweep.csv"
    write_table(path, _rows(3))
    assert read_table(path) == _rows(3) and not list(tmp_path.glob(".sweep.csv.tmp*"))
    text = path.read_text()
    for cut in (text[:-1], text[:len(text) - 40]):  # the line end gone; the row cut inside a cell
        path.write_text(cut)
        with pytest.raises(DataError, match="its last line was cut short"):
            read_table(path)
        said = []
        assert load_table(path, said.append) == _rows(2)
        assert read_table(path) == _rows(2) and len(said) == 1 and "dropped" in said[0]


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.replace("4.666666666666667", "abc", 1), ":3: column loss holds 'abc', not a number"),
    (lambda t: t.replace("flops,1,0,", "flops,1.5,0,", 1), ":4: column budget_index holds '1.5', not an integer"),
    (lambda t: t.replace("name,", "nom,", 1), ":1: the header is not a sweep table's"),
    (lambda t: t.replace(",/runs/C0-d24-L1-s0", "", 1), ":3: 24 cells where a row has 25"),
    (lambda t: t.replace("flops", '"flops', 1), "not a CSV table|cells where a row has"),
])
def test_a_damaged_table_is_one_line(tmp_path, edit, message):
    path = tmp_path / "sweep.csv"
    write_table(path, _rows(3))
    path.write_text(edit(path.read_text()))
    with pytest.raises(DataError, match=message) as err:
        read_table(path)
    assert "\n" not in str(err.value)


def test_a_damaged_summary_is_one_line(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    point = points(SMALL, 320)[0]
    run = tmp_path / "runs" / point.name
    run.mkdir(parents=True)
    (run / "summary.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(DataError, match="summary.json:1: nested too deeply.*remove .* to train it again"):
        sweep_lib.train_point(tmp_path, point, SMALL.data)
    (run / "summary.json").write_text('{"val_loss": "low"}')
    with pytest.raises(DataError, match="\\['val_loss', 'val_ppl'\\] missing or not numbers"):
        sweep_lib.train_point(tmp_path, point, SMALL.data)


def test_a_full_disk_stops_the_sweep_in_one_line(tmp_path, monkeypatch):
    """The second point's checkpoint write finds the disk full: the sweep stops there (before, every remaining
    point failed the same way, each with its tracebacks), in one line naming the point and how to continue the
    sweep (not `mlx-llm train`); the first point's row is written."""
    calls, rows = [], {r["name"]: r for r in _rows(4)}

    def fake_point(out, point, data, cache_dir=None):
        calls.append(point.name)
        if len(calls) == 2:
            try:
                raise OSError(28, "No space left on device")
            except OSError:
                raise CheckpointWriteError("no space left on device writing checkpoint 4 to somewhere") from None
        return rows[point.name]

    monkeypatch.setattr(sweep_lib, "train_point", fake_point)
    with pytest.raises(CheckpointWriteError) as err:
        run_sweep(SMALL, tmp_path / "s", progress=False, cache_dir=tmp_path / "cache",
                  continue_with="python -m experiments.scaling_sweep --out s")
    line = str(err.value)
    assert calls == SMALL_NAMES[:2] and "\n" not in line and "mlx-llm train" not in line
    assert line.startswith("no space left on device while point C0-d24-L1-s0 trained (it had no checkpoint, so "
                           "none was kept); ")
    assert line.endswith("free some space, then continue with `python -m experiments.scaling_sweep --out s`")
    assert [r["name"] for r in read_table(tmp_path / "s" / "sweep.csv")] == SMALL_NAMES[:1]


def test_the_command_says_how_to_continue(monkeypatch, tmp_path, capsys):
    """experiments/scaling_sweep.py: a stop prints the command that continues (with --out named, the default
    directory being stamped with its start time) and exits as `mlx-llm train` does: 0 after a checkpoint, 130
    when interrupted; a full disk is one line and status 1."""
    assert sweep_mod.continue_command(["--quick"], tmp_path) == \
        f"python -m experiments.scaling_sweep --quick --out {tmp_path}"
    assert sweep_mod.continue_command(["--out", "x y"], tmp_path) == "python -m experiments.scaling_sweep --out 'x y'"
    for error, code in ((SweepStopped("stopped by SIGTERM at step 3", "SIGTERM", clean=True), 0),
                        (SweepStopped("interrupted", "SIGINT", clean=False), 130),
                        (CheckpointWriteError("no space left on device"), 1)):
        def stopped(*args, error=error, **kwargs):
            assert kwargs["continue_with"] == f"python -m experiments.scaling_sweep --quick --out {tmp_path}"
            raise error

        monkeypatch.setattr(sweep_mod, "run_sweep", stopped)
        assert sweep_mod.main(["--quick", "--out", str(tmp_path)]) == code
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and str(error) in err


# A sweep whose process gets SIGTERM (or SIGINT) at a chosen moment: at checkpoint save number N, or before point
# number N is compiled (outside the training loop).
SIGNALLED = SWEEP.replace("run_sweep(", """import os, signal
from mlx_llm.runs import pretrain
from mlx_llm.runs.sweep import SweepStopped
from mlx_llm.train import checkpoint
how, n, sig, count = sys.argv[4], int(sys.argv[5]), getattr(signal, sys.argv[6]), []
def counted(original):
    def call(*args, **kwargs):
        count.append(1)
        if len(count) == n:
            os.kill(os.getpid(), sig)
        return original(*args, **kwargs)
    return call
if how == "save":
    checkpoint.Checkpoints.save = counted(checkpoint.Checkpoints.save)
else:
    pretrain.check_fits = counted(pretrain.check_fits)
try:
    run_sweep(""", 1).replace("cache_dir=Path(sys.argv[2]))", """cache_dir=Path(sys.argv[2]))
except SweepStopped as stop:
    print(f"STOPPED clean={stop.clean}: {stop}")""")


@pytest.mark.slow
@pytest.mark.parametrize("how,n,sig,rows,expected", [
    ("save", 3, "SIGTERM", 2, "stopped by SIGTERM at step 10 of 21 of point C1-d16-L1-s0; its checkpoint 10 is kept"),
    ("save", 1, "SIGTERM", 1, "stopped by SIGTERM as point C0-d16-L1-s0 finished"),
    ("fits", 2, "SIGINT", 1, "interrupted while point C0-d24-L1-s0 was prepared or trained"),
])
def test_a_signal_stops_the_whole_sweep(small, how, n, sig, rows, expected):
    """SIGTERM while point 3 trains: it checkpoints at the next step boundary and the sweep stops (before, only
    the point stopped, counted as failed, and the sweep trained the rest); SIGTERM during a point's last step:
    that point finishes and is the last; Ctrl-C while point 2 compiles: interrupted at once, not a traceback.
    Each names the command that continues; run again, the sweep finishes with the uninterrupted table."""
    root, _ = small
    out = root / f"signalled-{how}-{n}"
    proc = python("-c", SIGNALLED, out, root / "cache", json.dumps(SMALL.to_dict()), how, n, sig)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]
    stopped = [line for line in proc.stdout.splitlines() if line.startswith("STOPPED")]
    assert len(stopped) == 1 and f"clean={how != 'fits'}: {expected}" in stopped[0], proc.stdout[-3000:]
    assert stopped[0].endswith(f"continue with `run_sweep with the same spec on {out}`")
    done = read_table(out / "sweep.csv")
    assert [r["name"] for r in done] == SMALL_NAMES[:rows]
    assert not (out / "runs" / SMALL_NAMES[3]).exists()  # nothing after the stop was started
    _sweep_in_subprocess(out, root / "cache")
    assert _untimed(read_table(out / "sweep.csv")) == _untimed(read_table(root / "a" / "sweep.csv"))


# ----- one quick sweep by the command, end to end --------------------------------------------------------------------
@pytest.fixture(scope="module")
def quick_out(tmp_path_factory):
    out = tmp_path_factory.mktemp("quick")
    proc = python("-m", "experiments.scaling_sweep", "--quick", "--out", out / "sweep", "--cache-dir", out / "cache",
                  timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out / "sweep", proc.stdout


def _huber_objective(params, N, D, L, delta=1e-3):
    """Hoffmann et al.'s Approach 3 objective, Σ Huber_δ(log L̂(N, D) − log L), in NumPy."""
    r = np.log(params["E"] + params["A"] / N ** params["alpha"] + params["B"] / D ** params["beta"]) - np.log(L)
    return float(np.sum(np.where(np.abs(r) <= delta, 0.5 * r * r, delta * (np.abs(r) - 0.5 * delta))))


@pytest.mark.slow
def test_quick_sweep_fits_and_plots(quick_out):
    out, stdout = quick_out
    rows = read_table(out / "sweep.csv")
    assert len(rows) == 15 and {r["name"] for r in rows} == {p.name for p in points(sweep_mod.QUICK, 320)}
    fit = json.loads((out / "fit.json").read_text())
    a3 = fit["approach3"]
    assert all(math.isfinite(a3[k]) and a3[k] >= 0 for k in PARAMS) and a3["n_runs"] == 15
    assert a3["N_opt_exponent"] + a3["D_opt_exponent"] == pytest.approx(1.0, abs=1e-12)
    runs = runs_of(rows)
    assert _huber_objective(a3, runs["N"], runs["D"], runs["loss"]) == pytest.approx(a3["objective"], rel=1e-6)
    held = fit["held_out"]
    assert held["budget"] == pytest.approx(max(sweep_mod.QUICK.budgets))
    h3 = held["approach3"]
    assert (h3["n_fitted"], h3["n_runs"]) == (10, 5)
    assert h3["runs"]["loss"] == [r["loss"] for r in rows if r["budget_index"] == 2]
    assert len(h3["runs"]["ci"]) == 5 and h3["bootstrap"] == 108
    law = [h3["E"] + h3["A"] / n ** h3["alpha"] + h3["B"] / d ** h3["beta"]
           for n, d in zip(h3["runs"]["N"], h3["runs"]["D"])]
    np.testing.assert_allclose(h3["runs"]["predicted"], law, rtol=1e-12)
    assert "N_predicted" in (h3["compute_optimal"] or {"N_predicted": 0}) and "approach2" in held
    assert "held out: " in stdout
    for name in PLOTS:
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


@pytest.mark.slow
def test_quick_rerun_trains_nothing(quick_out):
    out, _ = quick_out
    before, lines = snapshot(out / "runs"), []
    run_sweep(sweep_mod.QUICK, out, cache_dir=out.parent / "cache", log=lines.append)
    assert snapshot(out / "runs") == before and sum("skipped" in x for x in lines) == 15


# ----- the committed results of one full sweep -------------------------------------------------------------------------
RESULTS = REPO / "experiments" / "results"


def test_committed_sweep_is_the_full_grid():
    """sweep.json is the full grid's spec; sweep.csv holds every one of its 20 points, in grid order (the local
    runner trains them one after another), four budgets, each row sized as the grid sizes it."""
    assert SweepSpec.from_dict(json.loads((RESULTS / "sweep.json").read_text())) == sweep_mod.FULL
    rows = read_table(RESULTS / "sweep.csv")
    grid = points(sweep_mod.FULL, 512)
    assert [r["name"] for r in rows] == [p.name for p in grid] and len(rows) == 20
    assert len({r["budget"] for r in rows}) == 4
    expected = {p.name: p for p in grid}
    for r in rows:
        p = expected[r["name"]]
        assert (r["N_total"], r["steps"], r["lr"]) == (p.cfg.param_count(), p.tcfg.steps, sweep_mod.LR)
        assert r["C"] == pytest.approx(training_compute(p.cfg, p.tcfg), rel=1e-12)
        assert math.isfinite(r["loss"]) and 0 < r["loss"] < math.log(512)


def test_committed_fits_match_the_csv():
    """fit.json is what the two approaches give on sweep.csv: Approach 2 (and its held-out mode) recomputed exactly;
    Approach 3's stored objective is the Huber loss at its parameters, and no 1% move of one parameter lowers it;
    the held-out predictions are the held-out law's on the largest budget's runs."""
    fit = json.loads((RESULTS / "fit.json").read_text())
    table = read_table(RESULTS / "sweep.csv")
    runs = runs_of(table)
    budgets = sorted(set(runs["budget"].tolist()))
    iso = isoflop_by_budget(runs, budgets)
    a2 = fit["approach2"]
    assert iso["N_opt_exponent"] == pytest.approx(a2["N_opt_exponent"], rel=1e-9)
    np.testing.assert_allclose(iso["N_opt"], a2["N_opt"], rtol=1e-9)
    a3 = fit["approach3"]
    best = _huber_objective(a3, runs["N"], runs["D"], runs["loss"])
    assert best == pytest.approx(a3["objective"], rel=1e-6)
    for k in PARAMS:
        for step in (0.99, 1.01):
            assert _huber_objective({**a3, k: a3[k] * step}, runs["N"], runs["D"], runs["loss"]) > best
        lo, hi = a3["ci95"][k]
        assert lo <= a3[k] <= hi
    assert a3["converged"] and a3["n_starts"] == 4500
    held = fit["held_out"]
    assert held["budget"] == pytest.approx(max(budgets), rel=1e-12)
    h3 = held["approach3"]
    top = runs["budget"] == runs["budget"].max()
    assert (h3["n_fitted"], h3["n_runs"]) == (int((~top).sum()), int(top.sum()))
    np.testing.assert_allclose(h3["runs"]["loss"], runs["loss"][top])
    law = h3["E"] + h3["A"] / runs["N"][top] ** h3["alpha"] + h3["B"] / runs["D"][top] ** h3["beta"]
    np.testing.assert_allclose(h3["runs"]["predicted"], law, rtol=1e-12)
    if "error" not in held["approach2"]:
        again = isoflop_by_budget(runs, budgets, holdout=True, bootstrap=0)["held_out"]
        for k in ("N_predicted", "loss_predicted", "N_measured", "loss_measured"):
            assert held["approach2"].get(k) == pytest.approx(again.get(k), rel=1e-9), k


def test_committed_plots():
    for name in PLOTS:
        data = (RESULTS / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and 5000 < len(data) < 200_000
