"""The scaling sweep's sizing by the library's compute formula, and its points as Ray tasks
(experiments/scaling_sweep.py --ray): a two-point grid swept one run after another and on a local Ray cluster
must give the same CSV rows, timings aside, since training is deterministic given the configs."""

import csv
import dataclasses
import importlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from mlx_llm.scaling.accounting import steps_for_flops, train_flops_per_token
from helpers import python

REPO = Path(__file__).resolve().parents[1]
sweep_mod = importlib.import_module("experiments.scaling_sweep")  # the repository root is on sys.path (python -m)
TIMING = ("wall_seconds", "tokens_per_second")
# Two points, the smallest sweep there is (budgets() needs two budgets): QUICK's one-layer d = 16 model on its
# slice of the stdlib at 3e7 FLOPs (2 steps of 8 sequences) and 30× that (15 steps of 32), no bootstrap.
TWO = {"ladder": ((16, 1),), "windows": ((0,), (0,)), "base_budget": 3e7, "batch_sizes": (8, 32), "bootstrap": 0}
# The suite's XLA flags (conftest.py: fast compiles of the compile-bound quick runs), the same in the subprocess and
# the Ray workers, which inherit this process's environment when ray.init starts the local cluster.
ENV = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}


# ----- sizing ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("setting", [sweep_mod.FULL, sweep_mod.QUICK], ids=["full", "quick"])
def test_steps_are_steps_for_flops(setting):
    """Every point takes steps_for_flops(cfg, T, B, C_k) steps, and F is 6·N_mm + 12·L·T·h·d_h by hand."""
    for p in sweep_mod.grid(setting, setting.vocab_size):
        cfg, tcfg = p["cfg"], p["tcfg"]
        T, B = setting.seq_len, tcfg.batch_size
        assert tcfg.steps == steps_for_flops(cfg, T, B, p["budget"])
        per_layer = 2 * cfg.d_model * cfg.n_heads * cfg.d_head + 2 * cfg.d_model * cfg.n_kv_heads * cfg.d_head \
            + 3 * cfg.d_model * cfg.d_ff  # W_Q, W_O; W_K, W_V; gate, up, down
        n_mm = cfg.n_layers * per_layer + cfg.d_model * cfg.vocab_size  # + the unembedding (the lookup is free)
        flops = 6 * n_mm + 12 * cfg.n_layers * T * cfg.n_heads * cfg.d_head
        assert train_flops_per_token(cfg, T) == flops
        assert tcfg.steps == max(1, round(p["budget"] / (flops * B * T)))
        assert sweep_mod.training_compute(cfg, tcfg) == flops * tcfg.steps * B * T


def test_one_point_by_hand():
    """C0-d8-L1 of the default grid: d = 8, one layer, one head of 16, d_ff 32, V = 512, T = 128, 4 sequences.
    N_mm = 4·8·16 + 3·8·32 + 8·512 = 5 376; F = 6·5 376 + 12·128·16 = 56 832 FLOPs a token;
    steps = 3.3e10 / (56 832 · 4 · 128) = 1 134.1 → 1 134 (under C = 6·N_total·D, 9 496 parameters and 3.5e10:
    1 200)."""
    point = next(p for p in sweep_mod.grid(sweep_mod.FULL, 512) if p["name"] == "C0-d8-L1")
    cfg = point["cfg"]
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.d_head, cfg.d_ff, cfg.vocab_size) == (8, 1, 1, 16, 32, 512)
    assert train_flops_per_token(cfg, 128) == 6 * 5376 + 12 * 128 * 16 == 56832
    assert point["budget"] == 3.3e10 and point["tcfg"].steps == 1134


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
def _read_csv(path):
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


def _untimed(rows):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def _sequential(out: Path, cache: Path) -> None:
    """The sequential path in a fresh interpreter, as the command runs it (these tests' process has float64 on)."""
    code = ("import dataclasses, sys; from pathlib import Path; from experiments import scaling_sweep as s; "
            f"s.sweep(Path(sys.argv[1]), dataclasses.replace(s.QUICK, **{TWO!r}), Path(sys.argv[2]))")
    proc = python("-c", code, out, cache)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture
def ray_cluster(monkeypatch, tmp_path):
    """A local two-CPU Ray cluster, its temporary files under tmp_path when the unix sockets' paths (about 65
    characters below it, 107 at most) fit, else in a fresh directory of /tmp."""
    ray = pytest.importorskip("ray")
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(REPO)  # the driver's working directory is on the workers' sys.path: `experiments` imports
    temp = tmp_path / "ray" if len(str(tmp_path / "ray")) <= 40 else Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=str(temp))
    yield ray
    ray.shutdown()
    if not temp.is_relative_to(tmp_path):
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow
def test_ray_sweep_matches_the_sequential_one(ray_cluster, tmp_path):
    setting = dataclasses.replace(sweep_mod.QUICK, **TWO)
    cache = tmp_path / "cache"
    _sequential(tmp_path / "seq", cache)
    expected = _read_csv(tmp_path / "seq" / "sweep.csv")
    assert [r["name"] for r in expected] == ["C0-d16-L1", "C1-d16-L1"]

    lines = []
    csv_path = sweep_mod.sweep(tmp_path / "ray", setting, cache, log=lines.append,
                               ray_resources={"num_cpus": 1, "num_gpus": 0})
    rows = _read_csv(csv_path)
    assert list(rows[0]) == list(sweep_mod.COLUMNS) and _untimed(rows) == _untimed(expected)  # losses exactly
    assert all(float(r[k]) > 0 for r in rows for k in TIMING)
    assert (tmp_path / "ray" / "runs" / "C1-d16-L1" / "summary.json").is_file()

    # Finished points are skipped; a failed one is one line, and the others' rows are kept.
    sweep_mod.sweep(tmp_path / "ray", setting, cache, log=lines.append, ray_resources={"num_cpus": 1})
    assert sum("already in sweep.csv, skipped" in line for line in lines) == 2 and _read_csv(csv_path) == rows
    (tmp_path / "broken" / "runs").mkdir(parents=True)
    (tmp_path / "broken" / "runs" / "C0-d16-L1").write_text("a file where the run directory goes")
    lines.clear()
    with pytest.raises(sweep_mod.SweepError, match=r"1 of 2 points failed \(C0-d16-L1\)"):
        sweep_mod.sweep(tmp_path / "broken", setting, cache, log=lines.append, ray_resources={"num_cpus": 1})
    failed = [line for line in lines if "failed" in line]
    assert len(failed) == 1 and failed[0].startswith("[1/2] C0-d16-L1: failed: ") and "\n" not in failed[0]
    assert _untimed(_read_csv(tmp_path / "broken" / "sweep.csv")) == _untimed(expected[1:])
