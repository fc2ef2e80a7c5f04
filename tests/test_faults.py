"""Faults during training (issue 25): SIGTERM / SIGINT stop a run at a step boundary with its checkpoint written
there, a full disk during a checkpoint write stops it in one line, a checkpoint whose manifest is gone is refused
unless trusted. Each leaves no traceback and a run that resumes exactly."""

import errno
import json
import os
import shutil
import signal
import textwrap
import time
from pathlib import Path

import pytest
from orbax.checkpoint._src.handlers import base_pytree_checkpoint_handler as orbax_pytree

from mlx_llm.train import checkpoint as ckpt_lib
from mlx_llm.train import loop as loop_lib
from mlx_llm.runs.rundir import LOCK_FILE
from mlx_llm.train.checkpoint import MANIFEST_FILE, Checkpoints
from helpers import TINY, cli_in_process, python, snapshot

REPO = Path(__file__).resolve().parents[1]
STEPS, INTERVAL = 24, 8  # checkpoints at 8, 16, 24; a stop lands between them


def train_args(corpus_dir, model, out, cache):
    return ["train", "--data", corpus_dir, "--extensions", ".py", "--val-percent", "20", "--tokenizer", "byte",
            "--config", model, "--out", out, "--steps", STEPS, "--warmup-steps", 2, "--batch-size", 4, "--seq-len",
            32, "--eval-interval", INTERVAL, "--eval-tokens", 256, "--checkpoint-interval", INTERVAL,
            "--keep-checkpoints", 5, "--log-interval", 1, "--sample-tokens", 4, "--cache-dir", cache,
            "--no-progress"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, corpus_dir):
    """The model file, the token cache and an uninterrupted run of the faults' configuration (in this process)."""
    root = tmp_path_factory.mktemp("faults")
    TINY.to_json(root / "model.json")
    proc = cli_in_process(*train_args(corpus_dir, root / "model.json", root / "reference", root / "cache"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"corpus": corpus_dir, "model": root / "model.json", "cache": root / "cache", "ref": root / "reference"}


def args_for(setup, out):
    return train_args(setup["corpus"], setup["model"], out, setup["cache"])


def losses(out):
    return [(r["step"], r["loss"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if "loss" in r]


def resume_matches_reference(setup, out):
    """``train --resume`` finishes the run, and its metrics.jsonl is the uninterrupted run's, byte for byte."""
    proc = cli_in_process("train", "--resume", "--out", out, "--cache-dir", setup["cache"], "--no-progress",
                          "--sample-tokens", 4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert losses(out) == losses(setup["ref"])
    assert (out / "metrics.jsonl").read_text() == (setup["ref"] / "metrics.jsonl").read_text()


def one_line(stderr: str) -> str:
    """The one line mlx-llm wrote on stderr (jax's and libtpu's start-up lines aside)."""
    assert "Traceback" not in stderr, stderr[-3000:]
    ours = [line for line in stderr.splitlines() if line.startswith("mlx-llm ")]
    assert len(ours) == 1, stderr[-3000:]
    return ours[0]


# ----- SIGTERM / SIGINT ------------------------------------------------------------------------------------------
# The run in a subprocess, as the test process runs (float64 enabled), each readback slowed down so that the signal
# lands in the middle of the run.
PACED = textwrap.dedent("""
    import sys, time
    import jax
    jax.config.update("jax_enable_x64", True)
    from mlx_llm.train import loop
    read_back = loop.read_back
    loop.read_back = lambda *a, **k: (time.sleep(0.05), read_back(*a, **k))[1]
    from mlx_llm.cli import run
    run()
""")


def paced_run(out, setup, lines: int = 3, shared_cache: bool = True):
    """The paced run in a subprocess, returned once its metrics.jsonl has ``lines`` lines (still running)."""
    proc = python("-c", PACED, *args_for(setup, out), shared_cache=shared_cache, popen=True)
    deadline = time.time() + 300
    while proc.poll() is None and time.time() < deadline:
        if (out / "metrics.jsonl").is_file() and len((out / "metrics.jsonl").read_text().splitlines()) >= lines:
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before the signal: " + proc.stderr.read()[-3000:]
    return proc


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_checkpoints_at_the_step_boundary(tmp_path, setup, sig):
    """SIGTERM / SIGINT after a few steps: the step finishes, a checkpoint is written at it (between the
    intervals), one line names it and the resume command, exit 0; --resume then gives the uninterrupted run."""
    out = tmp_path / "run"
    # the session's shared compilation cache off: the command's own default place is under test
    proc = paced_run(out, setup, shared_cache=False)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    line = one_line(stderr)
    stopped = Checkpoints(out).all_steps()[-1]
    assert 3 <= stopped < INTERVAL and Checkpoints(out).damage(stopped) is None
    assert line == (f"mlx-llm train: stopped by {sig.name} at step {stopped} of {STEPS}; checkpoint {stopped} is in "
                    f"{out}/checkpoints/{stopped}; continue with `mlx-llm train --out {out} --resume`")
    assert losses(out) == losses(setup["ref"])[:stopped]
    assert any((setup["cache"] / "jax").iterdir())  # the compilation cache, under --cache-dir by default
    resume_matches_reference(setup, out)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_two_signals_in_quick_succession_end_quietly(tmp_path, setup, sig):
    """Two signals 20 ms apart, as a double Ctrl-C: the first asks for a stop at the step boundary; the second
    either lands before that stop (interrupt: exit 130, "interrupted; the last checkpoint is kept") or during its
    checkpoint write (held until the write is done, then the same). One line, no traceback, every checkpoint
    intact, and the run resumes to the uninterrupted one."""
    out = tmp_path / "run"
    proc = paced_run(out, setup)
    proc.send_signal(sig)
    time.sleep(0.02)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=300)
    line = one_line(stderr)
    if proc.returncode == 130:
        assert line == "mlx-llm train: interrupted; the last checkpoint is kept (continue with --resume)"
    else:  # the run had already stopped, with its checkpoint, when the second signal came
        assert proc.returncode == 0 and line.startswith(f"mlx-llm train: stopped by {sig.name} at step "), stderr
    assert all(Checkpoints(out).damage(s) is None for s in Checkpoints(out).all_steps())
    if Checkpoints(out).all_steps():
        resume_matches_reference(setup, out)


@pytest.mark.slow
def test_a_signal_after_the_stop_message_ends_quietly(tmp_path, setup):
    """Ctrl-C, then Ctrl-C again as soon as the stop line is printed: the command is returning. The second signal
    is either ignored (once the command has returned, the process only exits: exit 0) or, before that, reads as
    an interrupt (exit 130 and the interrupted line after the stop line); never a traceback, and the stop's
    checkpoint is whole either way, so the run resumes to the uninterrupted one."""
    out = tmp_path / "run"
    proc = paced_run(out, setup)
    proc.send_signal(signal.SIGINT)
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if "stopped by SIGINT" in line:
            proc.send_signal(signal.SIGINT)
            break
    rest = proc.stderr.read()
    proc.wait(timeout=300)
    stderr = "".join(seen) + rest
    assert "Traceback" not in stderr, stderr[-3000:]
    ours = [line for line in stderr.splitlines() if line.startswith("mlx-llm ")]
    assert ours[0].startswith("mlx-llm train: stopped by SIGINT at step "), stderr[-3000:]
    if proc.returncode == 130:
        assert ours[1:] == ["mlx-llm train: interrupted; the last checkpoint is kept (continue with --resume)"]
    else:
        assert proc.returncode == 0 and len(ours) == 1, stderr[-3000:]
    assert all(Checkpoints(out).damage(s) is None for s in Checkpoints(out).all_steps())
    resume_matches_reference(setup, out)


@pytest.fixture
def stray_signals():
    """SIGINT and SIGTERM in this (pytest) process go to a recorder for the test's length, restored after it: a
    signal the run under test did not catch is a failed assertion here, never a KeyboardInterrupt that takes the
    pytest worker down with it (and the whole xdist session after it)."""
    strays, previous = [], {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for sig in previous:
        signal.signal(sig, lambda signum, frame: strays.append(signal.Signals(signum).name))
    yield strays
    for sig, handler in previous.items():
        signal.signal(sig, handler)
    assert strays == [], f"signals reached the test process outside the run: {strays}"


def signal_while_writing(monkeypatch, strays, sig, every: bool = False):
    """orbax's background write of the first checkpoint (``every``: of each one) sends ``sig`` to this process,
    then takes 0.3 s more: the signal arrives while a checkpoint is being written. Sent only while the training
    loop's own handler (``loop.StopSignals``) is installed; a write after the command returned is recorded in
    ``strays`` (the ``stray_signals`` fixture) instead: a write outliving its command is a defect, not a signal."""
    original, calls = orbax_pytree.BasePyTreeCheckpointHandler._write_metadata_file, []

    async def write(self, *args, **kwargs):
        calls.append(1)
        if every or len(calls) == 1:
            if isinstance(getattr(signal.getsignal(sig), "__self__", None), loop_lib.StopSignals):
                os.kill(os.getpid(), sig)
            else:
                strays.append(f"a checkpoint write outside the run ({sig.name} not sent)")
            time.sleep(0.3)
        return await original(self, *args, **kwargs)

    monkeypatch.setattr(orbax_pytree.BasePyTreeCheckpointHandler, "_write_metadata_file", write)


@pytest.mark.slow
def test_ctrl_c_during_a_checkpoint_write(tmp_path, setup, monkeypatch, stray_signals):
    """SIGINT while checkpoint 8 is written: the write completes (with its manifest), the run stops at the next
    boundary with the usual line, exit 0, no orbax traceback; the resume is exact. A second signal, during the
    stop's own checkpoint write, interrupts at once: one line, status 130, still no traceback."""
    out = tmp_path / "run"
    signal_while_writing(monkeypatch, stray_signals, signal.SIGINT)
    proc = cli_in_process(*args_for(setup, out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    stopped = Checkpoints(out).all_steps()[-1]
    assert one_line(proc.stderr).startswith(f"mlx-llm train: stopped by SIGINT at step {stopped} of {STEPS}; ")
    assert INTERVAL <= stopped < STEPS
    assert all(Checkpoints(out).damage(s) is None for s in Checkpoints(out).all_steps())
    resume_matches_reference(setup, out)
    monkeypatch.undo()
    signal_while_writing(monkeypatch, stray_signals, signal.SIGINT, every=True)
    proc = cli_in_process(*args_for(setup, tmp_path / "twice"))
    assert proc.returncode == 130
    assert one_line(proc.stderr) == ("mlx-llm train: interrupted; the last checkpoint is kept (continue with "
                                     "--resume)")
    assert all(Checkpoints(tmp_path / "twice").damage(s) is None for s in Checkpoints(tmp_path / "twice").all_steps())


# ----- a full disk -----------------------------------------------------------------------------------------------
def full_disk_in_orbax(monkeypatch):
    """orbax's write of checkpoint 16 (the second) fails as on a full disk."""
    original, calls = orbax_pytree.BasePyTreeCheckpointHandler._write_metadata_file, []

    async def write(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return await original(self, *args, **kwargs)

    monkeypatch.setattr(orbax_pytree.BasePyTreeCheckpointHandler, "_write_metadata_file", write)


def full_disk_in_manifest(monkeypatch):
    """The checksum manifest of checkpoint 16 cannot be written: the disk is full."""
    original = ckpt_lib._write_manifest

    def write(step_dir, *args, **kwargs):
        if step_dir.name.split(".")[0] == "16":
            raise OSError(errno.ENOSPC, "No space left on device", str(step_dir / MANIFEST_FILE))
        original(step_dir, *args, **kwargs)

    monkeypatch.setattr(ckpt_lib, "_write_manifest", write)


@pytest.mark.slow
@pytest.mark.parametrize("fault", [full_disk_in_orbax, full_disk_in_manifest])
def test_a_full_disk_during_a_checkpoint_write(tmp_path, setup, monkeypatch, fault):
    """One line naming the step, the directory and the space needed, exit 1; checkpoint 8 intact, nothing of 16
    left where a resume would look; --resume then continues exactly."""
    out = tmp_path / "run"
    fault(monkeypatch)
    proc = cli_in_process(*args_for(setup, out))
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = one_line(proc.stderr)
    assert line.startswith(f"mlx-llm train: error: no space left on device writing checkpoint 16 to "
                           f"{out}/checkpoints: it needs about ")
    assert " kB (the train state)" in line and "checkpoint 8 is intact" in line
    assert line.endswith(f"continue with `mlx-llm train --out {out} --resume`")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["8"]  # no orbax temporary directory either
    assert Checkpoints(out).damage(8) is None
    monkeypatch.undo()
    resume_matches_reference(setup, out)


# ----- a deleted manifest ----------------------------------------------------------------------------------------
def refused(root, *args) -> str:
    """The command exits 2 with one line and changes no file under ``root``."""
    before = snapshot(root)
    proc = cli_in_process(*args)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert snapshot(root) == before
    return one_line(proc.stderr)


@pytest.mark.slow
def test_a_checkpoint_without_its_manifest_is_refused_unless_trusted(tmp_path, setup):
    """A run that writes manifests (its run.json says so, or an earlier step has one) refuses a step whose
    manifest is gone, naming the step and --trust-unverified; with the flag the run resumes and extends exactly
    as from the verified checkpoint."""
    out = tmp_path / "run"
    shutil.copytree(setup["ref"], out)
    (out / "checkpoints" / str(STEPS) / MANIFEST_FILE).unlink()
    cache = ("--cache-dir", setup["cache"])
    for args in (["train", "--resume", "--out", out, "--steps", STEPS + 2, *cache], ["eval", "--run", out, *cache]):
        line = refused(tmp_path, *args)
        assert f"checkpoint {STEPS} cannot be verified ({out}/checkpoints/{STEPS}: it has no checksum manifest" in line
        assert "pass --trust-unverified" in line and f"--from-step {STEPS - INTERVAL}" in line
    for args in (["eval", "--run", out, *cache], ["generate", "--run", out, "--prompt", "def", "--max-new-tokens", 2]):
        read = cli_in_process(*args, "--trust-unverified")  # a command that only reads the run trusts it too
        assert read.returncode == 0, read.stderr[-3000:]
    record = json.loads((out / "run.json").read_text())
    assert record["checksums"] is True
    del record["checksums"]  # as a version that did not record it: the earlier steps' manifests still tell
    (out / "run.json").write_text(json.dumps(record))
    assert "--trust-unverified" in refused(tmp_path, "train", "--resume", "--out", out, "--steps", STEPS + 2, *cache)
    assert Checkpoints(out, trust_unverified=True).damage(STEPS) is None
    trusted = cli_in_process("train", "--resume", "--out", out, "--steps", STEPS + 2, "--trust-unverified",
                             "--no-progress", "--sample-tokens", 4, *cache)
    assert trusted.returncode == 0, trusted.stderr[-3000:]
    verified = tmp_path / "verified"
    shutil.copytree(setup["ref"], verified)
    proc = cli_in_process("train", "--resume", "--out", verified, "--steps", STEPS + 2, "--no-progress",
                          "--sample-tokens", 4, *cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "metrics.jsonl").read_text() == (verified / "metrics.jsonl").read_text()
    assert Checkpoints(out).damage(STEPS + 2) is None  # the new checkpoint has its manifest again


@pytest.mark.slow
def test_a_post_training_run_stops_the_same_way(tmp_path, base_run, monkeypatch, stray_signals):
    """Every post-training command trains in the same loop: SIGTERM stops an SFT run at a step boundary with its
    checkpoint, names `mlx-llm sft ... --resume`, exits 0; the resumed run is the uninterrupted one. Its
    checkpoint without the manifest is refused as in pretraining (when restored, under the run's lock: only the
    lock's holder line changes) and restored with --trust-unverified."""
    common = ["--base", base_run, "--task", "arithmetic", "--train-examples", 64, "--eval-examples", 4, "--steps", 12,
              "--batch-size", 4, "--seq-len", 64, "--warmup-steps", 2, "--checkpoint-interval", 3,
              "--eval-interval", 12, "--log-interval", 1, "--no-progress"]
    ref, out = tmp_path / "reference", tmp_path / "run"
    assert cli_in_process("sft", "--out", ref, *common).returncode == 0
    signal_while_writing(monkeypatch, stray_signals, signal.SIGTERM)
    proc = cli_in_process("sft", "--out", out, *common)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stopped = Checkpoints(out).all_steps()[-1]
    line = one_line(proc.stderr)
    assert 3 <= stopped < 12 and line.startswith(f"mlx-llm sft: stopped by SIGTERM at step {stopped} of 12; ")
    assert line.endswith(f"continue with `mlx-llm sft --out {out} --resume`")
    monkeypatch.undo()
    (out / "checkpoints" / str(stopped) / MANIFEST_FILE).unlink()
    before = {k: v for k, v in snapshot(out).items() if k != LOCK_FILE}
    proc = cli_in_process("sft", "--resume", "--out", out, "--no-progress")
    assert proc.returncode == 2 and f"checkpoint {stopped} cannot be verified" in one_line(proc.stderr)
    assert "pass --trust-unverified" in proc.stderr
    assert {k: v for k, v in snapshot(out).items() if k != LOCK_FILE} == before
    proc = cli_in_process("sft", "--resume", "--out", out, "--trust-unverified", "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "metrics.jsonl").read_text() == (ref / "metrics.jsonl").read_text()
