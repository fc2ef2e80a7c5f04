"""A sweep's points as Ray tasks (``run_sweep(..., runner="ray")``, experiments/scaling_sweep.py --ray): a two-point
grid swept one run after another and on a local Ray cluster gives the same table, timings and run paths aside,
since training is deterministic given the configs; finished points are skipped, a failed one is one line."""

import dataclasses
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from mlx_llm.runs.sweep import TIMING, SweepError, read_table, run_sweep
from helpers import python

REPO = Path(__file__).resolve().parents[1]
sweep_mod = __import__("importlib").import_module("experiments.scaling_sweep")
# Two points, the smallest sweep there is: QUICK's one-layer d = 16 model on its slice of the stdlib at 3e7 FLOPs
# (2 steps of 8 sequences) and 30× that (15 steps of 32).
TWO = dataclasses.replace(sweep_mod.QUICK, sizes=sweep_mod.QUICK.sizes[:1], windows=None, budgets=(3e7, 9e8),
                          batch_sizes=(8, 32))
# The suite's XLA flags (conftest.py: fast compiles of the compile-bound quick runs), the same in the subprocess and
# the Ray workers, which inherit this process's environment when ray.init starts the local cluster.
ENV = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}
SWEEP = ("import json, sys; from pathlib import Path; from mlx_llm.runs.sweep import SweepSpec, run_sweep; "
         "run_sweep(SweepSpec.from_dict(json.loads(sys.argv[3])), Path(sys.argv[1]), cache_dir=Path(sys.argv[2]))")


def _untimed(rows):
    return [{k: v for k, v in r.items() if k not in (*TIMING, "run")} for r in rows]


# ----- the command line -------------------------------------------------------------------------------------------
def test_ray_flags():
    args = sweep_mod.parse_args([])
    assert (args.ray, args.ray_cpus_per_task, args.ray_gpus_per_task) == (None, 1.0, 0.0)
    assert sweep_mod.parse_args(["--ray", "--quick"]).ray == ""  # a local cluster
    args = sweep_mod.parse_args(["--ray", "auto", "--ray-cpus-per-task", "2", "--ray-gpus-per-task", "1"])
    assert (args.ray, args.ray_cpus_per_task, args.ray_gpus_per_task) == ("auto", 2.0, 1.0)


def test_ray_missing_is_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    assert sweep_mod.main(["--ray", "--quick", "--out", str(tmp_path / "sweep")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install 'mlx_llm[sweep]'" in err
    assert not (tmp_path / "sweep").exists()  # nothing was started


# ----- sequential and Ray sweeps of one grid --------------------------------------------------------------------
@pytest.fixture
def ray_cluster(monkeypatch, tmp_path):
    """A local two-CPU Ray cluster, its temporary files under tmp_path when the unix sockets' paths (about 65
    characters below it, 107 at most) fit, else in a fresh directory of /tmp."""
    ray = pytest.importorskip("ray")
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    temp = tmp_path / "ray" if len(str(tmp_path / "ray")) <= 40 else Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=str(temp))
    yield ray
    ray.shutdown()
    if not temp.is_relative_to(tmp_path):
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow
def test_ray_sweep_matches_the_sequential_one(ray_cluster, tmp_path):
    cache = tmp_path / "cache"
    proc = python("-c", SWEEP, tmp_path / "seq", cache, json.dumps(TWO.to_dict()))  # as a notebook runs it (no x64)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    expected = read_table(tmp_path / "seq" / "sweep.csv")
    assert [r["name"] for r in expected] == ["C0-d16-L1-s0", "C1-d16-L1-s0"]

    lines = []
    table = run_sweep(TWO, tmp_path / "ray", runner="ray", cache_dir=cache, log=lines.append,
                      ray_options={"num_cpus": 1, "num_gpus": 0})
    rows = table.to_dict("records")
    assert _untimed(rows) == _untimed(expected)  # losses exactly
    assert all(r[k] > 0 for r in rows for k in TIMING)
    assert (tmp_path / "ray" / "runs" / "C1-d16-L1-s0" / "summary.json").is_file()

    # Finished points are skipped; a failed one is one line, and the others' rows are kept.
    run_sweep(TWO, tmp_path / "ray", runner="ray", cache_dir=cache, log=lines.append)
    assert sum("in sweep.csv, skipped" in line for line in lines) == 2
    (tmp_path / "broken" / "runs").mkdir(parents=True)
    for name in ("sweep.json", "tokenizer.json"):  # a sweep of this spec whose first run directory cannot be made
        shutil.copy(tmp_path / "seq" / name, tmp_path / "broken" / name)
    (tmp_path / "broken" / "runs" / "C0-d16-L1-s0").write_text("a file where the run directory goes")
    lines.clear()
    with pytest.raises(SweepError, match=r"1 of 2 points failed \(C0-d16-L1-s0\)"):
        run_sweep(TWO, tmp_path / "broken", runner="ray", cache_dir=cache, log=lines.append)
    failed = [line for line in lines if "failed" in line]
    assert len(failed) == 1 and failed[0].startswith("[1/2] C0-d16-L1-s0: failed: ") and "\n" not in failed[0]
    assert _untimed(read_table(tmp_path / "broken" / "sweep.csv")) == _untimed(expected[1:])
