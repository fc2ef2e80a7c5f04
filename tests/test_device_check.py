"""experiments/device_check.py (issue 40): ``--quick`` runs every part at toy sizes on the CPU and writes the results
file with every part present; a part that raises, crashes, hangs past its limit or is skipped is recorded with its
reason and the next part still runs; a spent budget skips parts without starting them."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from experiments import common, device_check
from helpers import snapshot

from conftest import FAST_COMPILE  # the quick run is compile-bound: the session's fast-compile flags, all of them


@pytest.fixture
def cpu_children(monkeypatch):
    """The children see only the CPU (no TPU probing through the installed libtpu) and compile unoptimised code with
    the elemental emitters (with only the optimisation level lowered, the quick run took 48 s instead of 29 s)."""
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("XLA_FLAGS", FAST_COMPILE)
    monkeypatch.delenv(device_check.FAULT_ENV, raising=False)


def read(out, name="device_cpu_quick"):
    return json.loads((out / f"{name}.json").read_text())


@pytest.mark.slow
def test_quick_run_measures_every_part_on_the_cpu(tmp_path, cpu_children, capsys):
    assert device_check.main(["--quick", "--out", str(tmp_path)]) == 0
    data = read(tmp_path)
    assert data["order"] == list(device_check.PARTS) and data["complete"] and data["quick"]
    assert data["provenance"]["devices"] == {"platform": "cpu", "kind": "cpu", "count": 1}
    parts = data["parts"]
    assert all(parts[p]["status"] == "ok" and parts[p]["result"]["summary"] for p in device_check.PARTS), parts

    env = parts["environment"]["result"]
    assert set(env["peak_flops"]) == {"bf16", "fp32", "fp32_highest"} and min(env["peak_flops"].values()) > 0
    for name in ("training_124m", "training_1b"):
        r = parts[name]["result"]
        assert 0 < r["mfu"] and 0 < r["mfu_vs_environment_peak"] and math.isfinite(r["loss"])
        assert r["memory"]["predicted_bytes"] > 0 and r["memory"]["measured_peak_bytes"] is None  # no CPU stats
    assert parts["training_1b"]["result"]["train"]["remat"] == "full"

    att = parts["attention"]["result"]
    for path in ("flash", "pallas_gpu", "flash window 32"):  # float32 against the float32 reference
        assert att["checks"][path]["status"] == "ok" and max(att["checks"][path]["errors"].values()) < 1e-5
    assert att["checks"]["cudnn"]["status"] == "skipped" and "CUDA GPU" in att["checks"]["cudnn"]["reason"]
    assert att["checks"]["pallas_gpu window 32"]["status"] == "skipped"
    full, windowed = att["rows"]
    assert windowed["window"] == 32 and windowed["flops"] < full["flops"]
    assert all(full["variants"][p]["seconds"] > 0 for p in ("xla", "flash", "pallas_gpu"))

    moe = parts["moe"]["result"]["variants"]
    assert set(moe) == {"dense SwiGLU", "MoE (block-sorted)", "MoE (ragged_dot)"}
    assert moe["dense SwiGLU"]["of_dense"] == 1.0 and all(v["active_flops_per_second"] > 0 for v in moe.values())
    rows = parts["decode"]["result"]["rows"]
    assert [r["batch"] for r in rows] == [1, 4] and all(r["tokens_per_second"] > 0 < r["fraction_of_bound"]
                                                        for r in rows)
    job = parts["main_job"]["result"]
    assert job["steps"] == 4 and 0 < job["val_bpb"] < 9 and job["wall_seconds"] > 0
    shown = capsys.readouterr().out
    assert all(f"\n{p:<14} ok" in shown for p in device_check.PARTS)  # the table


@pytest.mark.slow
def test_failed_parts_are_recorded_and_the_next_part_runs(tmp_path, cpu_children, monkeypatch):
    monkeypatch.setenv(device_check.FAULT_ENV,
                       "environment:raise,training_124m:crash,training_1b:hang,attention:skip")
    code = device_check.main(["--quick", "--only", "environment,training,attention,decode", "--out", str(tmp_path),
                              "--time-limit", "training_1b=3"])
    assert code == 1  # a part failed; the run went on
    parts = read(tmp_path)["parts"]
    assert list(parts) == ["environment", "training_124m", "training_1b", "attention", "decode"]
    assert parts["environment"]["status"] == "failed" and "fault injected" in parts["environment"]["reason"]
    assert any("RuntimeError" in line for line in parts["environment"]["output_tail"])  # its traceback kept
    assert parts["training_124m"]["status"] == "failed" and "exit code 3" in parts["training_124m"]["reason"]
    hung = parts["training_1b"]
    assert hung["status"] == "failed" and hung["timed_out"] and "limit of 3 s" in hung["reason"]
    assert 3 <= hung["seconds"] < 30
    assert parts["attention"]["status"] == "skipped" and "fault injected" in parts["attention"]["reason"]
    assert parts["decode"]["status"] == "ok" and parts["decode"]["result"]["rows"][0]["tokens_per_second"] > 0


def test_a_spent_budget_skips_parts_without_starting_them(tmp_path, cpu_children):
    assert device_check.main(["--quick", "--only", "environment,moe", "--budget", "1", "--out", str(tmp_path)]) == 0
    data = read(tmp_path, "device_unknown_quick")  # no child ran, so no device kind is known
    assert data["provenance"]["devices"] == device_check.NO_DEVICES  # and the parent did not start a backend
    assert [r["status"] for r in data["parts"].values()] == ["skipped", "skipped"]
    assert all("budget of 1 s was spent" in r["reason"] for r in data["parts"].values())


def test_part_selection_and_limits():
    assert device_check.selected("training,moe") == ["training_124m", "training_1b", "moe"]
    assert device_check.selected(None) == list(device_check.PARTS)
    with pytest.raises(SystemExit, match="unknown part"):
        device_check.selected("environment,gpu")
    args = device_check.parse_args(["--time-limit", "moe=12.5"])
    assert device_check.limits(args)["moe"] == 12.5 and device_check.limits(args)["decode"] == 150
    assert sum(device_check.ESTIMATES.values()) < device_check.BUDGET < 8 * 60


def test_markdown_table_of_a_results_file(tmp_path, cpu_children, capsys):
    device_check.main(["--quick", "--only", "moe", "--budget", "1", "--out", str(tmp_path)])
    capsys.readouterr()
    assert device_check.main(["--markdown", str(tmp_path / "device_unknown_quick.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("no device reached, jax 0.10.2") and lines[0].endswith(", quick")
    assert lines[2] == "| part | status | seconds | estimate | result |"
    assert lines[4] == "| moe | skipped | 0 |  | the run's budget of 1 s was spent |"


def test_a_failing_accelerator_kernel_falls_back_to_flash(monkeypatch):
    """The training part measures the step again with flash when the backend's attention kernel fails (a GPU
    window is too rare to lose the MFU to one kernel), and keeps the kernel's error."""
    from experiments import device_parts
    from mlx_llm.config import TrainConfig

    tcfg = TrainConfig(attention_impl="pallas_gpu", interpret_kernels=True)  # resolves to pallas_gpu on the CPU
    monkeypatch.setattr(device_parts, "training_setup", lambda part, quick: (None, tcfg, 8, 1))
    seen = []

    def measure(cfg, tcfg, n, rounds, earlier):
        seen.append(tcfg.attention_impl)
        if tcfg.attention_impl == "pallas_gpu":
            raise RuntimeError("Triton compilation failed\nmore")
        return {"summary": "measured"}

    monkeypatch.setattr(device_parts, "measure_training", measure)
    out = device_parts.training_124m(True, {})
    assert seen == ["pallas_gpu", "flash"]
    assert out["summary"] == "measured [flash: pallas_gpu failed]"
    assert out["fallback"] == {"attention_impl": "pallas_gpu", "error": "RuntimeError: Triton compilation failed"}


def test_moe_part_keeps_block_against_dense_when_ragged_dot_fails(monkeypatch):
    from experiments import device_parts

    def compare(*, ragged=True, **sizes):
        if ragged:
            raise ValueError("ragged_dot is not supported")
        row = {"active_flops_per_second": 2e12, "of_dense": 1.0}
        return {"variants": {"dense SwiGLU": row, "MoE (block-sorted)": {**row, "of_dense": 0.5}}}

    monkeypatch.setattr(device_parts.bench_moe, "compare", compare)
    out = device_parts.moe(True, {})
    assert out["ragged_dot_error"] == "ValueError: ragged_dot is not supported"
    assert out["summary"] == "dense 2 TFLOP/s; block 0.50x, ragged_dot failed (ValueError: ragged_dot is not supported)"


def test_the_main_job_is_compared_with_the_cpu_run_of_record():
    """The CPU's bits/byte comes from the main job's own seed in main_job_seeds.json (README's 1.313); on the CPU,
    with the same val set, nothing is listed as a cause of difference, and a different val set is named."""
    from experiments import device_parts
    from mlx_llm.recipes import MAIN_JOB_TRAIN

    ref = device_parts.cpu_reference()
    assert round(ref["val_bpb"], 4) == 1.3127 and ref["val_bytes"] == 378_072
    assert device_parts.differences({"val_bytes": 378_072}, ref, MAIN_JOB_TRAIN) == []
    why = device_parts.differences({"val_bytes": 1000}, ref, MAIN_JOB_TRAIN)
    assert why == ["a different val set: 1000 bytes, not 378072 (another Python's standard library)"]


# ----- issue 51: flags checked before running, Ctrl-C ------------------------------------------------------------
def _bad_markdown(tmp_path, kind):
    path = tmp_path / "results.json"
    if kind == "not json":
        path.write_text("{half")
    elif kind == "not a results file":
        path.write_text(json.dumps({"parts": {}}))
    return path


@pytest.mark.parametrize("argv, message", [
    (["--only", ","], "--only ',' names no part"),
    (["--only", ""], "--only '' names no part"),
    (["--only", "environment,gpu"], "--only: unknown part(s) ['gpu']"),
    (["--budget", "-1"], "--budget -1: give the run's seconds, a positive number"),
    (["--budget", "0"], "--budget 0: give the run's seconds"),
    (["--budget", "nan"], "--budget nan: give the run's seconds"),
    (["--time-limit", "moe=0"], "--time-limit 'moe=0': give PART=SECONDS"),
], ids=["comma", "empty", "unknown", "negative budget", "zero budget", "nan budget", "zero limit"])
def test_a_bad_flag_is_refused_in_one_line_and_nothing_runs_or_is_written(argv, message, tmp_path, capsys):
    """``--budget -1`` and ``--only ,`` wrote ``"complete": true`` with nothing measured."""
    before = snapshot(tmp_path)
    assert device_check.main(["--quick", "--out", str(tmp_path / "out"), *argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"device_check: error: {message}")
    assert captured.err.count("\n") == 1 and captured.out == ""
    assert snapshot(tmp_path) == before and not (tmp_path / "out").exists()


def test_an_unwritable_out_is_refused_before_running(tmp_path, capsys):
    """It gave a raw traceback (NotADirectoryError) after the first part had run."""
    (tmp_path / "file").write_text("x")
    before = snapshot(tmp_path)
    assert device_check.main(["--quick", "--only", "moe", "--out", str(tmp_path / "file" / "out")]) == 2
    err = capsys.readouterr().err
    assert err == (f"device_check: error: --out {tmp_path / 'file' / 'out'}: cannot write the results there: "
                   f"{tmp_path / 'file'} is not a directory\n")
    assert snapshot(tmp_path) == before
    assert device_check.unwritable(tmp_path / "new" / "deeper") is None and not (tmp_path / "new").exists()


@pytest.mark.parametrize("kind, message", [("missing", "cannot read it: No such file"), ("not json", "not JSON"),
                                           ("not a results file", "not a device check results file (KeyError")])
def test_a_bad_markdown_file_is_refused_in_one_line(kind, message, tmp_path, capsys):
    path = _bad_markdown(tmp_path, kind)
    before = snapshot(tmp_path)
    assert device_check.main(["--markdown", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"device_check: error: --markdown {path}: {message}")
    assert captured.err.count("\n") == 1 and captured.out == "" and snapshot(tmp_path) == before


def test_ctrl_c_kills_the_running_part_and_writes_the_results_marked_incomplete(tmp_path):
    """SIGINT gave a raw KeyboardInterrupt traceback and left the file saying nothing of the interruption."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", device_check.FAULT_ENV: "environment:skip,moe:hang"}
    proc = subprocess.Popen([sys.executable, "-m", "experiments.device_check", "--quick", "--only", "environment,moe",
                             "--out", str(tmp_path)], cwd=common.REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if line.startswith("== moe (limit"):
                break
        time.sleep(0.3)  # the child is started and hanging
        start = time.perf_counter()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == device_check.INTERRUPTED
        assert time.perf_counter() - start < 30  # the hanging child was killed, not waited for
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read()
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("device_check: interrupted (SIGINT) during moe; wrote the results so far, marked "
                          "incomplete, to ")
    data = read(tmp_path, "device_unknown_quick")  # no child reached a backend
    assert data["complete"] is False and data["interrupted"] == "SIGINT during moe"
    assert [r["status"] for r in data["parts"].values()] == ["skipped", "failed"]
    moe = data["parts"]["moe"]
    assert moe["interrupted"] is True and moe["reason"].startswith("interrupted (SIGINT) after ")
