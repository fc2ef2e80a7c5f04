"""Run directories and orbax checkpoints.

A run directory holds ``config.json``, ``train_config.json``, ``run.json`` (the run record, runs/record.py), ``tokenizer.json``,
``checkpoints/<step>/`` (orbax, the last ``keep`` kept), ``metrics.jsonl``, ``loss.png`` and ``sample.txt``.
Orbax writes each checkpoint to a temporary directory and renames it when complete, so a run killed while
writing leaves the previous checkpoint loadable.

Reliability (issue 13):

- ``run.lock``: a process training in a run directory holds an ``fcntl.flock`` on it (``run_lock``); a second run
  there is refused. The kernel drops the lock when the process ends, however it ends: no stale lock.
- ``checkpoints/<step>/mlx_llm_sha256.json``: the size and sha256 of every file of the step, written after orbax
  has finished it and checked before every restore. Orbax itself notices a truncated or missing array file but
  restores flipped bytes silently and rebuilds a deleted ``_METADATA`` from the target; the manifest catches all
  of these. A damaged checkpoint raises ``CheckpointError`` naming it and the previous intact one; nothing is
  deleted. Checkpoints written without a manifest (older versions) are restored unchecked.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Iterator

import jax
import orbax.checkpoint as ocp

from mlx_llm.config import write_json_atomic
from mlx_llm.errors import CheckpointError
from mlx_llm.runs.record import CHECKPOINT_DIR, CONFIG_FILE

MANIFEST_FILE = "mlx_llm_sha256.json"  # inside each checkpoints/<step>/
LOCK_FILE = "run.lock"


class Checkpoints:
    """Save / restore a state pytree every k steps in ``run_dir/checkpoints``; keeps the last ``keep``. Each saved
    step gets a checksum manifest; ``restore`` verifies it first."""

    def __init__(self, run_dir: str | os.PathLike, keep: int = 2):
        self.directory = Path(run_dir).absolute() / CHECKPOINT_DIR
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=False)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    def save(self, step: int, state: Any) -> None:
        self._manager.save(step, args=ocp.args.StandardSave(state), force=True)
        self._manager.wait_until_finished()
        if jax.process_index() == 0:  # one writer; orbax has committed every process's files by now
            write_json_atomic(self.step_dir(step) / MANIFEST_FILE, {"files": _file_digests(self.step_dir(step))})

    def damage(self, step: int) -> str | None:
        """What is wrong with checkpoint ``step`` by its manifest; None when intact (or written without one)."""
        step_dir = self.step_dir(step)
        if not (step_dir / MANIFEST_FILE).is_file():
            return None if step_dir.is_dir() else "its directory is missing"
        try:
            listed = json.loads((step_dir / MANIFEST_FILE).read_text(encoding="utf-8"))["files"]
            return next(filter(None, (_file_damage(step_dir, rel, want) for rel, want in listed.items())), None)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            return f"its checksum manifest {MANIFEST_FILE} cannot be read ({exc})"

    def last_intact_before(self, step: int) -> int | None:
        return next((s for s in reversed(self.all_steps()) if s < step and self.damage(s) is None), None)

    def check_intact(self, step: int) -> None:
        """Raise the damaged-checkpoint error if ``step`` does not match its manifest."""
        problem = self.damage(step)
        if problem is not None:
            raise self._damaged(step, problem)

    def _damaged(self, step: int, problem: str) -> CheckpointError:
        good, run = self.last_intact_before(step), self.directory.parent
        if good is None:
            then = "there is no earlier intact checkpoint to continue from"
        else:
            then = (f"the previous intact checkpoint is step {good}: continue from it with `mlx-llm train --out {run} "
                    f"--resume --from-step {good}`, or give `--step {good}` to eval / generate (a post-training "
                    f"run: rename {self.step_dir(step).name} to {step}.corrupt and --resume)")
        return CheckpointError(f"checkpoint {step} is damaged ({self.step_dir(step)}: {problem}); nothing was "
                               f"deleted; {then}")

    def restore(self, abstract_state: Any, step: int | None = None) -> Any:
        """Restore into the structure, shapes, dtypes and shardings of ``abstract_state``, after checking the
        step against its manifest."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint in {self.directory}: nothing to resume or evaluate")
        if step not in self.all_steps():
            raise CheckpointError(f"no checkpoint {step} in {self.directory}: its checkpoints are {self.all_steps()}")
        self.check_intact(step)
        verified = (self.step_dir(step) / MANIFEST_FILE).is_file()
        try:
            return self._manager.restore(step, args=ocp.args.StandardRestore(abstract_state))
        except Exception as exc:  # tensorstore reports unreadable array files as a bare Exception
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if not verified:  # no manifest: damage and a config mismatch look alike
                raise self._damaged(step, f"orbax cannot restore it ({first[:300]}): it is damaged or does not "
                                          f"match this model and optimizer") from None
            if not isinstance(exc, (ValueError, KeyError, FileNotFoundError)):
                raise
            raise CheckpointError(f"checkpoint {step} in {self.directory} cannot be restored into this model "
                                  f"and optimizer: {first}") from None

    def set_aside_after(self, step: int) -> list[Path]:
        """Rename every checkpoint after ``step`` to ``<s>.corrupt-<time>`` (damaged) or ``<s>.superseded-<time>``
        so a run continuing from ``step`` can write those steps again. Orbax ignores the renamed directories
        (never lists, restores or garbage-collects them); nothing is deleted."""
        stamp, moved = time.strftime("%Y%m%dT%H%M%S"), []
        for s in [s for s in self.all_steps() if s > step]:
            kind = "superseded" if self.damage(s) is None else "corrupt"
            target = self.directory / f"{s}.{kind}-{stamp}"
            self.step_dir(s).rename(target)
            moved.append(target)
        self._manager.reload()
        return moved

    def close(self) -> None:
        self._manager.close()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _file_digests(step_dir: Path) -> dict:
    return {p.relative_to(step_dir).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
            for p in sorted(step_dir.rglob("*")) if p.is_file() and p.name != MANIFEST_FILE}


def _file_damage(step_dir: Path, rel: str, want: dict) -> str | None:
    path = step_dir / rel
    if not path.is_file():
        return f"{rel} is missing"
    size = path.stat().st_size
    if size != want["bytes"]:
        return f"{rel} has {size} bytes, {want['bytes']} were written" + (" (truncated)" if size < want["bytes"] else "")
    if _sha256(path) != want["sha256"]:
        return f"the bytes of {rel} changed after it was written (sha256 differs)"
    return None


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs (with shardings) of a pytree, the restore target orbax needs."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None)),
                        tree)


# ----- run directory checks ---------------------------------------------------------------------------------
def check_run_dir(run_dir: Path, resume: bool) -> None:
    """Never overwrite a run: a directory holding one needs ``resume``; any other non-empty one is refused; one
    another process trains in (its lock held) is refused either way. Checks only: ``locked_run_dir`` holds."""
    check_unlocked(run_dir)
    _check_run_dir_contents(run_dir, resume)


def _check_run_dir_contents(run_dir: Path, resume: bool) -> None:
    has_run = (run_dir / CONFIG_FILE).is_file()
    if resume and not has_run:
        raise CheckpointError(f"--resume given but {str(run_dir)!r} holds no run (no {CONFIG_FILE}); drop --resume "
                              f"to start a new run there")
    if not resume and has_run:
        raise CheckpointError(f"{str(run_dir)!r} already holds a run; pass --resume to continue it or choose "
                              f"another --out")
    if not resume and run_dir.exists() and any(p.name != LOCK_FILE for p in run_dir.iterdir()):
        raise CheckpointError(f"{str(run_dir)!r} exists and is not empty; choose a new --out directory")


@contextlib.contextmanager
def locked_run_dir(run_dir: Path, resume: bool):
    """Hold ``run_dir``'s lock for the rest of a run (``checkpoint.run_lock``; a new run's directory is created
    here, just before its first file is written) and check its contents again under the lock: another run may
    have started there since ``check_run_dir`` (of two new runs racing for one directory, the second finds the
    first's lock or its run and is refused). In a multi-process run, process 0 holds it for all the processes."""
    if jax.process_index() != 0:
        yield
        return
    with run_lock(run_dir):
        _check_run_dir_contents(run_dir, resume)
        yield


# ----- the run lock -------------------------------------------------------------------------------------------
LOCK_WAIT_SECONDS = 0.25  # rides out another process's momentary probe (check_unlocked), never a real holder


@contextlib.contextmanager
def run_lock(run_dir: str | os.PathLike) -> Iterator[Path]:
    """Hold ``run_dir``'s lock for a run's life, creating the directory if needed (a new run takes the lock as
    it creates its directory). An ``fcntl.flock`` on ``run_dir/run.lock``: released when the block exits, on an
    exception too, and by the kernel when the process ends however it ends, so a crash leaves no stale lock. A
    second holder, in another process or this one, is refused with a CheckpointError naming the first one's pid
    and host (written into the file). The file stays: deleting it would race with a process about to lock it."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if not _flock(fd, fcntl.LOCK_EX, LOCK_WAIT_SECONDS):
            raise CheckpointError(_locked_message(run_dir, fd))
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        yield run_dir
    finally:
        os.close(fd)  # drops the lock


def check_unlocked(run_dir: str | os.PathLike) -> None:
    """Refuse at once a run directory whose lock another run holds, so a refused run fails before its slow
    preparations. A probe: takes and drops a shared lock, creates and changes nothing (``run_lock`` holds). In a
    multi-process run only process 0 checks: it may already hold the lock for all of them."""
    if jax.process_index() != 0:
        return
    try:
        fd = os.open(Path(run_dir) / LOCK_FILE, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError):
        return
    try:
        if not _flock(fd, fcntl.LOCK_SH, 0.0):
            raise CheckpointError(_locked_message(Path(run_dir), fd))
    finally:
        os.close(fd)


def _flock(fd: int, kind: int, wait: float) -> bool:
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, kind | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)


def _locked_message(run_dir: Path, fd: int) -> str:
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
        who = f" by pid {holder['pid']} on host {holder['host']} (since {holder['since']})"
    except (OSError, ValueError, KeyError, TypeError):
        who = ""
    return (f"run directory {str(run_dir)!r} is locked{who}: another process is training in it ({run_dir / LOCK_FILE}); "
            f"wait for it to finish or stop it, or choose another --out")
