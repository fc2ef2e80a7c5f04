"""experiments/common.py: results carry their provenance, the timing helpers call what they time as often as
asked, and every script under experiments/ imports as a package module (``python -m experiments.NAME``) without
running its main and without editing the import path."""

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
    with pytest.raises(SystemExit, match="holds a run of other settings"):
        common.train_for_steps(tmp_path / "run", TINY, tiny_train(lr=2e-2), None, 6)
    assert len(calls) == 1
