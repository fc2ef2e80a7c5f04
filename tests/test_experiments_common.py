"""experiments/common.py: results carry their provenance, the timing helpers call what they time as often as
asked, and every script under experiments/ imports as a package module (``python -m experiments.NAME``) without
running its main and without editing the import path."""

import dataclasses
import datetime
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.stem for p in (REPO / "experiments").glob("*.py") if p.stem != "__init__")
VERSIONS = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "python")


@pytest.fixture
def common(monkeypatch):
    """experiments.common, imported as `python -m` from the repository root would (the root first on the path)."""
    monkeypatch.syspath_prepend(str(REPO))
    return importlib.import_module("experiments.common")


def test_save_result_writes_payload_and_provenance(common, tmp_path):
    path = common.save_result("demo", {"a": 1, "nested": {"b": [1.5, 2.5]}}, tmp_path)
    assert path == tmp_path / "demo.json"
    data = json.loads(path.read_text())
    assert data["a"] == 1 and data["nested"] == {"b": [1.5, 2.5]}
    prov = data["provenance"]
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    assert prov["commit"] == head.stdout.strip()
    assert isinstance(prov["dirty"], bool) and isinstance(prov["changed"], list)
    assert prov["dirty"] == bool(prov["changed"])
    assert all(isinstance(prov["versions"][k], str) and prov["versions"][k] for k in VERSIONS)
    assert {"torch", "transformers"} <= set(prov["versions"])  # None where not installed
    assert prov["devices"]["count"] >= 1 and prov["devices"]["platform"] and "kind" in prov["devices"]
    assert isinstance(prov["command"], str) and prov["command"].startswith("python")
    assert isinstance(prov["environment"], dict) and "load_average" in prov
    date = datetime.datetime.fromisoformat(prov["date"])
    assert date.utcoffset() == datetime.timedelta(0)


def test_list_payload_round_trip(common, tmp_path):
    rows = [{"x": 1}, {"x": 2}]
    data = json.loads(common.save_result("rows", rows, tmp_path).read_text())
    assert data["rows"] == rows and "provenance" in data
    assert common.load_result("rows", tmp_path) == rows
    (tmp_path / "old.json").write_text(json.dumps(rows))  # a file from before provenance
    assert common.load_result("old", tmp_path) == rows


def test_payload_may_not_bring_its_own_provenance(common, tmp_path):
    with pytest.raises(ValueError, match="provenance"):
        common.save_result("bad", {"provenance": {}}, tmp_path)


def test_command_line_is_the_module_form(common):
    script = str(REPO / "experiments" / "bench_loss.py")
    assert common.command_line([script, "--quick"]) == "python -m experiments.bench_loss --quick"


def test_time_steps_calls_warmup_plus_rounds(common):
    calls = []
    seconds = common.time_steps(lambda x: calls.append(x) or x, 3, warmup=2, rounds=5)
    assert isinstance(seconds, float) and seconds > 0
    assert calls == [3] * 7


def test_interleaved_rounds_take_turns(common):
    order = []
    times = common.interleaved_times({"a": lambda: order.append("a"), "b": lambda: order.append("b")},
                                     warmup=1, rounds=3)
    assert order == ["a", "b"] * 4
    assert all(len(t) == 3 and all(s > 0 for s in t) for t in times.values())
    best = common.time_interleaved({"c": lambda: 0.25}, warmup=0, rounds=2, stat=min, self_timed=True)
    assert best == {"c": 0.25}


def test_carry_keeps_the_state(common):
    step = common.carry(lambda state, inc: (state + inc, state * 10), 1, 2)
    assert [step(), step(), step()] == [10, 30, 50]
    assert step.state() == 7 and step.last() == 50


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_imports_as_a_module(name, monkeypatch):
    """Importing must not run the script (an unguarded main would parse this argv and exit) or touch sys.path."""
    source = (REPO / "experiments" / f"{name}.py").read_text()
    assert "sys.path" not in source
    if "def main(" in source:
        assert 'if __name__ == "__main__":' in source
    monkeypatch.syspath_prepend(str(REPO))
    monkeypatch.setattr(sys, "argv", [name, "--not-an-option-of-any-script"])
    module = importlib.import_module(f"experiments.{name}")
    assert Path(module.__file__).resolve() == REPO / "experiments" / f"{name}.py"


def test_train_for_steps_trains_once_and_reads_back_a_finished_run(common, monkeypatch, tmp_path):
    """Exactly N steps with evaluation at the end; a finished run of the same configs is read back (an equal-steps
    ablation split over several commands shares its baseline), one of other configs is refused."""
    from helpers import TINY, tiny_train
    from mlx_llm.runs import pretrain

    calls = []

    def fake_train_run(run_dir, cfg, tcfg, spec, **kw):
        calls.append(tcfg)
        run_dir.mkdir(parents=True)
        cfg.to_json(run_dir / "config.json")
        tcfg.to_json(run_dir / "train_config.json")
        summary = {"val_bpb": 2.5, "train_seconds": 3.0, "steps_this_session": tcfg.steps}
        (run_dir / "summary.json").write_text(json.dumps(summary))
        return summary

    monkeypatch.setattr(pretrain, "train_run", fake_train_run)
    first = common.train_for_steps(tmp_path / "run", TINY, tiny_train(), None, 6)
    again = common.train_for_steps(tmp_path / "run", TINY, tiny_train(), None, 6)
    assert len(calls) == 1 and calls[0].steps == 6
    assert calls[0].eval_interval == calls[0].checkpoint_interval == common.LONG
    assert first == again == {"val_bpb": 2.5, "train_seconds": 3.0, "steps_this_session": 6, "step_seconds": 0.5}
    # how often it logged does not change what it trained: read back too
    assert common.train_for_steps(tmp_path / "run", TINY, tiny_train(log_interval=7), None, 6) == first
    with pytest.raises(SystemExit, match=r"holds a run of other settings \(lr=0.01; this run wants lr=0.02\)"):
        common.train_for_steps(tmp_path / "run", TINY, tiny_train(lr=2e-2), None, 6)
    with pytest.raises(SystemExit, match=r"holds a run of other settings \(another model\)"):
        common.train_for_steps(tmp_path / "run", dataclasses.replace(TINY, d_model=TINY.d_model * 2), tiny_train(),
                               None, 6)
    assert len(calls) == 1


def test_seeds_run_seed_major_and_give_paired_statistics(common, tmp_path):
    """run_seeds calls every arm of seed 0, then of seed 1 …; seed_statistics holds every run's value, each arm's
    summary and the paired difference from the baseline, equal to SciPy's paired t-test (and Welch's unpaired)."""
    from scipy import stats as sp

    calls = []
    values = {"base": [1.00, 1.10, 0.95], "new": [0.97, 1.06, 0.93]}

    def run(arm, seed):
        calls.append((arm, seed))
        return {"bpb": values[arm][seed]}

    rows = common.run_seeds(["base", "new"], 3, run)
    assert calls == [("base", 0), ("new", 0), ("base", 1), ("new", 1), ("base", 2), ("new", 2)]
    result = common.seed_statistics(rows, "bpb", baseline="base")
    assert result["arms"]["new"]["runs"] == [{"seed": s, "bpb": v} for s, v in enumerate(values["new"])]
    s = result["arms"]["base"]["summary"]
    assert s["n"] == 3 and s["mean"] == pytest.approx(sum(values["base"]) / 3, abs=1e-12)
    assert "vs_baseline" not in result["arms"]["base"]
    d = result["arms"]["new"]["vs_baseline"]
    ref = sp.ttest_rel(values["new"], values["base"])
    assert d["test"] == "paired" and d["p_value"] == pytest.approx(ref.pvalue, rel=1e-9)
    assert d["mean"] == pytest.approx(-0.03, abs=1e-12) and d["significant"] == (ref.pvalue < 0.05)
    welch = common.seed_statistics(rows, "bpb", baseline="base", paired=False)["arms"]["new"]["vs_baseline"]
    assert welch["p_value"] == pytest.approx(sp.ttest_ind(values["new"], values["base"], equal_var=False).pvalue,
                                             rel=1e-9)
    lines = common.seed_lines(result)
    assert lines[0].startswith("base: 1.0167 ± ") and "(n = 3)" in lines[0]
    assert "vs base: -0.0300 [" in lines[1] and ("not significant" in lines[1]) == (ref.pvalue >= 0.05)
    path = common.seed_errorbars(result, tmp_path / "bars.png", "val bits/byte")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("seeds", [1, 0, -3, True, 2.5])
def test_too_few_seeds_are_one_line(common, seeds):
    with pytest.raises(SystemExit, match=f"--seeds {seeds!r} is too few: a mean's interval over seeds needs at least 2"):
        common.check_seeds(seeds)


def test_a_paired_difference_needs_the_same_seeds(common):
    rows = [{"arm": "a", "seed": 0, "m": 1.0}, {"arm": "a", "seed": 1, "m": 2.0},
            {"arm": "b", "seed": 1, "m": 1.5}, {"arm": "b", "seed": 2, "m": 2.5}]
    with pytest.raises(ValueError, match="b and a ran other seeds"):
        common.seed_statistics(rows, "m", baseline="a")


def test_the_ppo_grid_names_every_cell_and_refuses_in_one_line(monkeypatch):
    """experiments/preference.py --ppo-grid EPOCHS:LRS: one method per (epochs, learning rate), named by both."""
    monkeypatch.syspath_prepend(str(REPO))
    preference = importlib.import_module("experiments.preference")
    assert preference.ppo_grid("1,4:1e-4,4e-4") == {"rl_ppo_e1_lr0.0001": (1, 1e-4), "rl_ppo_e1_lr0.0004": (1, 4e-4),
                                                   "rl_ppo_e4_lr0.0001": (4, 1e-4), "rl_ppo_e4_lr0.0004": (4, 4e-4)}
    for spec in ("1,4", "1,a:1e-4", "1:1e-4:2"):
        with pytest.raises(SystemExit, match=f"--ppo-grid '{spec}': give EPOCHS:LRS"):
            preference.ppo_grid(spec)
    for spec in ("0:1e-4", "1,1:1e-4", "2:1.5", "2:1e-4,1e-4"):
        with pytest.raises(SystemExit, match=f"--ppo-grid '{spec}': the epochs must be distinct integers >= 1"):
            preference.ppo_grid(spec)


@pytest.mark.parametrize("name", ["preference_algorithms", "preference_algorithms_wall"])
def test_committed_estimator_comparisons_are_their_seeds_paired(name):
    """Each committed estimator comparison: every estimator's difference from the group trainer is the paired test
    of the per-seed exact matches it stores, over three seeds each."""
    from mlx_llm import stats

    data = json.loads((REPO / "experiments" / "results" / f"{name}.json").read_text())
    group = data["rl_checker"]["heldout_accuracy"]["per_seed"]
    assert len(group) == data["seeds"] == 3
    assert set(data["against_group"]) == {"rl_grpo", "rl_dr_grpo", "rl_dapo", "rl_gspo", "rl_ppo"}
    for method, stored in data["against_group"].items():
        again = stats.paired(data[method]["heldout_accuracy"]["per_seed"], group)
        assert again.mean == pytest.approx(stored["mean"], abs=1e-12), method
        assert again.p_value == pytest.approx(stored["p_value"], rel=1e-9), method
        assert list(again.ci95) == pytest.approx(stored["ci95"], rel=1e-9), method


def test_committed_curves_are_thinned_evenly_with_the_last_step(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    preference = importlib.import_module("experiments.preference")
    points = [(s, s * 0.5) for s in range(1, 1358)]
    results = {"seeds": 3, "rl_checker": {"heldout_accuracy": {}, "curves": [{"accuracy": points, "kl": points[:150]}]}}
    thin = preference.thinned(results)["rl_checker"]["curves"][0]
    assert thin["kl"] == points[:150]  # short curves stay whole
    assert thin["accuracy"][:3] == points[0:14:7] + [points[14]] and thin["accuracy"][-1] == points[-1]
    assert len(thin["accuracy"]) <= preference.CURVE_POINTS and results["rl_checker"]["curves"][0]["accuracy"] == points
    for n in (200, 201, 399, 400, 401, 1000):  # 400 made 201 points when the stride was ceil(n / 200)
        curve = [(s, 0.0) for s in range(n)]
        kept = preference.thinned({"m": {"curves": [{"a": curve}]}})["m"]["curves"][0]["a"]
        assert len(kept) <= preference.CURVE_POINTS and kept[0] == curve[0] and kept[-1] == curve[-1], n
        assert len({b[0] - a[0] for a, b in zip(kept[:-2], kept[1:-1])}) <= 1, n  # evenly spaced but for the last
