"""Run-directory reliability (issue 13): the run lock, damaged checkpoints and their recovery, extending a run."""

import json
import os
import re
import shutil
import signal
import textwrap
from pathlib import Path

import jax
import pytest

from mlx_llm.errors import CheckpointError, ConfigError
from mlx_llm.runs.load import load_params
from mlx_llm.runs.record import open_run
from mlx_llm.runs.rundir import LOCK_FILE, check_run_dir, locked_run_dir, run_lock
from mlx_llm.train.checkpoint import MANIFEST_FILE, Checkpoints
from mlx_llm.runs.pretrain import train_run
from helpers import TINY, assert_trees_equal, cli_in_process, finished_tiny_run, python, snapshot, spec_for, tiny_train

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, corpus_dir):
    """A finished 6-step tiny run with checkpoints 3 and 6 (copied by each test that changes it)."""
    return finished_tiny_run(tmp_path_factory.mktemp("finished") / "run", corpus_dir)


def copy_run(finished, to):
    shutil.copytree(finished, to)
    return to


def params_of(out, step=None):
    return jax.device_get(load_params(out, step))


def metric_rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def cli_ok(*args):
    proc = cli_in_process(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def cli_refused(root, *args):
    """The command exits 2 with one line on stderr and changes no file under ``root``."""
    before = snapshot(root)
    proc = cli_in_process(*args)
    err = proc.stderr.strip()
    assert proc.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, (proc.returncode, err)
    assert snapshot(root) == before
    return err


# ----- the run lock ----------------------------------------------------------------------------------------------
HOLDER = textwrap.dedent("""
    import contextlib, sys, time
    from mlx_llm.runs.rundir import run_lock
    with contextlib.ExitStack() as stack:
        for d in sys.argv[1:]:
            stack.enter_context(run_lock(d))
        print("held", flush=True)
        time.sleep(120)
""")


@pytest.mark.slow
def test_a_second_process_is_refused_while_the_first_holds_the_lock(tmp_path, finished, corpus_dir):
    """A real second process holds the locks of a finished run (as a resumed run would) and of a new directory
    (as a new run would, having just created it): train / train --resume / sft / dpo / rl / reward there are
    refused naming its pid and host, and change nothing. SIGKILL frees the lock: no stale lock is left."""
    out, new = copy_run(finished, tmp_path / "run"), tmp_path / "new"
    holder = python("-c", HOLDER, out, new, popen=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        who = rf"is locked by pid {holder.pid} on host \S+ \(since "
        assert json.loads((out / LOCK_FILE).read_text())["pid"] == holder.pid
        for command in (["train"], ["sft"], ["dpo"], ["rl"], ["reward"]):
            err = cli_refused(tmp_path, *command, "--resume", "--out", out)
            assert f"{str(out)!r}" in err and re.search(who, err), err
        err = cli_refused(tmp_path, "train", "--data", corpus_dir, "--out", new, "--tokenizer", "byte",
                          "--steps", 2, "--warmup-steps", 1, "--cache-dir", tmp_path / "cache")
        assert re.search(who, err), err
        assert [p.name for p in new.iterdir()] == [LOCK_FILE]  # the holder's lock file, nothing of the refused run
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with run_lock(out):  # the kernel released the killed holder's lock
        pass


@pytest.mark.slow
def test_lock_is_held_for_the_whole_run_and_released_after(tmp_path, corpus_dir):
    out, refusals = tmp_path / "run", []

    def log(*_):  # called while the run trains: the directory must be locked against any other run
        for attempt in (lambda: check_run_dir(out, resume=True), lambda: run_lock(out).__enter__()):
            with pytest.raises(CheckpointError, match="is locked by pid") as exc:
                attempt()
            refusals.append(str(exc.value))

    train_run(out, TINY, tiny_train(), spec_for(corpus_dir), show_progress=False,
              cache_dir=tmp_path / "cache", sample_tokens=4, log=log)
    assert refusals and all(f"pid {os.getpid()}" in r for r in refusals)
    with run_lock(out):  # released at the end of the run
        pass
    with pytest.raises(RuntimeError):  # and on an exception
        with run_lock(out):
            raise RuntimeError
    with run_lock(out):
        pass


def test_two_new_runs_racing_for_one_directory(tmp_path):
    """Both pass ``check_run_dir`` before either writes; the lock (taken as the directory is created) and the
    check under it refuse the second, whether the first still holds the lock or has already written its run."""
    d = tmp_path / "new"
    check_run_dir(d, resume=False)
    check_run_dir(d, resume=False)
    with locked_run_dir(d, resume=False):
        assert d.is_dir()
        with pytest.raises(CheckpointError, match="is locked by pid"):
            with locked_run_dir(d, resume=False):
                pass
        (d / "config.json").write_text("{}")  # the first run writes its files
    with pytest.raises(CheckpointError, match="already holds a run; pass --resume"):
        with locked_run_dir(d, resume=False):
            pass
    check_run_dir(tmp_path / "other", resume=False)
    assert not (tmp_path / "other").exists()  # checks create nothing


# ----- damaged checkpoints ---------------------------------------------------------------------------------------
def as_old_run(out: Path) -> Path:
    """``out`` as a version before checksum manifests wrote it: no manifests, no ``checksums`` in run.json."""
    for manifest in (out / "checkpoints").glob(f"*/{MANIFEST_FILE}"):
        manifest.unlink()
    record = json.loads((out / "run.json").read_text())
    del record["checksums"]
    (out / "run.json").write_text(json.dumps(record))
    return out


def largest_file(step_dir: Path) -> Path:
    return max((p for p in step_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def truncate(step_dir):
    path = largest_file(step_dir)
    os.truncate(path, path.stat().st_size // 2)  # orbax: an error
    return r"\S+ has \d+ bytes, \d+ were written \(truncated\)"


def delete_metadata(step_dir):
    (step_dir / "default" / "_METADATA").unlink()  # orbax: restores anyway, from the target's structure
    return r"default/_METADATA is missing"


def flip_bytes(step_dir):
    path = largest_file(step_dir)
    data = bytearray(path.read_bytes())
    data[100:140] = bytes(b ^ 0xFF for b in data[100:140])  # orbax: restores wrong numbers without a word
    path.write_bytes(bytes(data))
    return r"the bytes of \S+ changed after it was written \(sha256 differs\)"


@pytest.mark.slow
@pytest.mark.parametrize("damage", [truncate, delete_metadata, flip_bytes])
def test_damaged_latest_checkpoint_is_named_with_the_previous_intact_one(tmp_path, finished, damage):
    out = copy_run(finished, tmp_path / "run")
    problem = damage(out / "checkpoints" / "6")
    with pytest.raises(CheckpointError, match=rf"checkpoint 6 is damaged \({out}/checkpoints/6: {problem}\); "
                                              rf"nothing was deleted; the previous intact checkpoint is step 3: "
                                              rf"continue from it with `mlx-llm train --out {out} --resume "
                                              rf"--from-step 3`, or give `--step 3` to eval / generate"):
        params_of(out)
    assert_trees_equal(params_of(out, 3), params_of(finished, 3))


@pytest.mark.slow
def test_no_intact_checkpoint_and_checkpoints_without_a_manifest(tmp_path, finished):
    out = copy_run(finished, tmp_path / "run")
    flip_bytes(out / "checkpoints" / "3")
    truncate(out / "checkpoints" / "6")
    with pytest.raises(CheckpointError, match=r"checkpoint 6 is damaged .*there is no earlier intact checkpoint"):
        params_of(out)
    # a checkpoint written before manifests existed is restored unchecked; orbax's own error still reads the same
    old = as_old_run(copy_run(finished, tmp_path / "old"))
    assert_trees_equal(params_of(old), params_of(finished))
    truncate(old / "checkpoints" / "6")
    with pytest.raises(CheckpointError, match=r"checkpoint 6 is damaged \(.*orbax cannot restore it .*the "
                                              r"previous intact checkpoint is step 3"):
        params_of(old)


@pytest.mark.slow
def test_resume_from_the_previous_good_step(tmp_path, finished):
    """Silent damage to the latest checkpoint: resume and eval refuse and change nothing; eval --step 3 works;
    train --resume --from-step 3 sets the damaged step aside (not deleted) and retrains to the very same run."""
    out = copy_run(finished, tmp_path / "run")
    flip_bytes(out / "checkpoints" / "6")
    damaged = {p.relative_to(out / "checkpoints" / "6"): p.read_bytes()
               for p in (out / "checkpoints" / "6").rglob("*") if p.is_file()}
    cache = ("--cache-dir", finished.parent / "cache")
    for args in (["train", "--resume", "--out", out, *cache], ["eval", "--run", out, *cache],
                 ["generate", "--run", out, "--prompt", "def "]):
        err = cli_refused(tmp_path, *args)
        assert f"checkpoint 6 is damaged ({out}/checkpoints/6: the bytes of" in err, err
        assert "--from-step 3" in err and "--step 3" in err
    assert "step 3: val loss" in cli_ok("eval", "--run", out, "--step", 3, *cache).stdout
    proc = cli_ok("train", "--resume", "--out", out, "--from-step", 3, "--no-progress", "--sample-tokens", 8, *cache)
    aside = [p for p in (out / "checkpoints").iterdir() if p.name.startswith("6.corrupt-")]
    assert len(aside) == 1 and f"set aside {aside[0]}" in proc.stdout
    assert {p.relative_to(aside[0]): p.read_bytes() for p in aside[0].rglob("*") if p.is_file()} == damaged
    assert Checkpoints(out).all_steps() == [3, 6]
    assert_trees_equal(params_of(out), params_of(finished))  # deterministic: the same step 6 as before the damage
    assert (out / "metrics.jsonl").read_text() == (finished / "metrics.jsonl").read_text()


@pytest.mark.slow
def test_resume_refusals_change_nothing(tmp_path, finished):
    out = copy_run(finished, tmp_path / "run")
    cases = [(["train", "--resume", "--out", out, "--steps", 4], r"--steps 4 would shorten .* it was set to 6 "
                                                                  r"steps; on --resume --steps may only extend"),
             (["train", "--resume", "--out", out, "--from-step", 4], r"has no checkpoint 4; its checkpoints are "
                                                                     r"\[3, 6\]"),
             (["train", "--out", tmp_path / "new", "--from-step", 3], r"--from-step 3 .* needs --resume"),
             (["train", "--resume", "--out", out, "--lr", 0.5], r"exactly as it was configured.*only .*--steps.* may "
                                                               r"change")]
    for args, message in cases:
        assert re.search(message, cli_refused(tmp_path, *args))
    # a checkpoint without a manifest that orbax cannot restore: found under the run's lock, after which nothing
    # else is written (the resume's changes are recorded only once the state is restored)
    old = as_old_run(copy_run(finished, tmp_path / "old"))
    truncate(old / "checkpoints" / "6")
    before = {k: v for k, v in snapshot(old).items() if k != LOCK_FILE}
    proc = cli_in_process("train", "--resume", "--out", old, "--steps", 22, "--no-progress")
    assert proc.returncode == 2 and "orbax cannot restore it" in proc.stderr, proc.stderr
    assert {k: v for k, v in snapshot(old).items() if k != LOCK_FILE} == before  # run.lock: the holder's pid
    with pytest.raises(ConfigError, match=r"may change only \[.*'steps'.*\] of its train config, not \['lr'\]"):
        train_run(out, None, None, None, resume=True, changes={"lr": 0.1}, show_progress=False)
    assert not (tmp_path / "new").exists()


# ----- extending a finished run ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_extending_a_finished_run(tmp_path, finished):
    """--resume --steps 9 on a 6-step run: steps 1–6 untouched, 7–9 at the final lr (peak · final_lr_fraction,
    the schedule's value after its end), summary / plot / sample rewritten, and the extended run itself resumes
    bit for bit (the schedule's total, 6, is recorded in run.json)."""
    ext = copy_run(finished, tmp_path / "ext")
    plot_before = (ext / "loss.png").read_bytes()
    cache = ("--cache-dir", finished.parent / "cache")
    cli_ok("train", "--resume", "--out", ext, "--steps", 9, "--no-progress", "--sample-tokens", 8, *cache)
    tcfg = open_run(ext).tcfg
    assert tcfg == tiny_train(steps=9) and open_run(ext).record.schedule_steps == 6
    rows, old = metric_rows(ext), metric_rows(finished)
    assert rows[:len(old)] == old
    train = {r["step"]: r for r in rows if "loss" in r}
    assert sorted(train) == list(range(1, 10))
    assert [train[s]["lr"] for s in (7, 8, 9)] == pytest.approx([1e-2 * 0.1] * 3, rel=1e-12)
    assert train[6]["lr"] > train[7]["lr"]  # the cosine ended above its floor at step 6; nothing is re-raised
    assert [r["step"] for r in rows if "val_loss" in r] == [3, 6, 9]
    summary = json.loads((ext / "summary.json").read_text())
    assert summary["steps"] == 9 and summary["steps_this_session"] == 3
    assert summary["val_loss"] == rows[-1]["val_loss"]
    assert (ext / "sample.txt").read_text() == summary["sample"]
    assert (ext / "loss.png").read_bytes() != plot_before
    assert Checkpoints(ext).all_steps() == [6, 9]
    # the extended run, cut back to step 6 and resumed without --steps, gives the same step 9
    cut = copy_run(ext, tmp_path / "cut")
    shutil.rmtree(cut / "checkpoints" / "9")
    cli_ok("train", "--resume", "--out", cut, "--no-progress", "--sample-tokens", 8, *cache)
    assert_trees_equal(params_of(cut), params_of(ext))
    assert (cut / "metrics.jsonl").read_text() == (ext / "metrics.jsonl").read_text()
    # --steps equal to the recorded total is a plain resume: a finished run is left as it was
    cli_ok("train", "--resume", "--out", ext, "--steps", 9, "--no-progress", "--sample-tokens", 8, *cache)
    assert Checkpoints(ext).all_steps() == [6, 9] and metric_rows(ext) == rows
