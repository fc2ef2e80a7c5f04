"""Run directories and orbax checkpoints.

A run directory holds ``config.json``, ``train_config.json``, ``run.json`` (the run record, runs/record.py),
``tokenizer.json``, ``checkpoints/<step>/`` (orbax, the last ``keep`` kept), ``metrics.jsonl``, ``loss.png`` and
``sample.txt``.
Orbax writes each checkpoint to a temporary directory and renames it when complete, so a run killed while
writing leaves the previous checkpoint loadable.

Reliability (issue 13):

- ``run.lock``: a process training in a run directory holds an ``fcntl.flock`` on it (``run_lock``); a second run
  there is refused. The kernel drops the lock when the process ends, however it ends: no stale lock.
- ``checkpoints/<step>/mlx_llm_sha256.json``: the size and sha256 of every file of the step, written after orbax
  has finished it and checked before every restore. Orbax itself notices a truncated or missing array file but
  restores flipped bytes silently and rebuilds a deleted ``_METADATA`` from the target; the manifest catches all
  of these. A damaged checkpoint raises ``CheckpointError`` naming it and the previous intact one; nothing is
  deleted. A step without a manifest in a run that writes them (its record says so, ``RunRecord.checksums``, or an
  earlier step has one) is refused too, unless the caller trusts it (``--trust-unverified``); checkpoints of runs
  written before manifests existed are restored unchecked.

Goodput (issue 25):

- Asynchronous saves (``asynchronous=True``, the training loop's): orbax copies the state to host memory and
  writes it in a background thread while training goes on. A manifest of the step's array files is written in
  orbax's temporary directory before orbax renames it into place, so no step appears without one; ``finish``
  (before the next save, at ``close``, or once ``poll`` finds the save done) writes the whole manifest once orbax
  has finished, and only then removes checkpoints beyond ``keep``: a failed save never costs a verified one.
- A checkpoint that cannot be written (a full disk, say) raises ``CheckpointWriteError`` naming the step, the
  directory and the space it needs, once what orbax wrote of it is removed.
- orbax's error logs (tracebacks from its threads) are dropped while a ``Checkpoints`` is open: every failure
  reaches the caller as one of the errors above.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any, Iterator

import jax
import orbax.checkpoint as ocp

from mlx_llm.config import write_json_atomic
from mlx_llm.errors import CheckpointError
from mlx_llm.runs.record import CHECKPOINT_DIR, CONFIG_FILE, open_run

MANIFEST_FILE = "mlx_llm_sha256.json"  # inside each checkpoints/<step>/
LOCK_FILE = "run.lock"
ORBAX_TMP = ".orbax-checkpoint-tmp"  # orbax writes checkpoints/<step>.orbax-checkpoint-tmp*, then renames it
ORBAX_LATE_FILES = ("_CHECKPOINT_METADATA", "commit_success.txt")  # what orbax writes after its callback
TRUST_FLAG = "--trust-unverified"
_TRUSTED = contextvars.ContextVar("trust_unverified", default=False)  # set by the commands that only read a run


@contextlib.contextmanager
def trusting_unverified():
    """Within: ``Checkpoints`` made without an explicit ``trust_unverified`` restore manifest-less steps
    (``--trust-unverified`` of eval, generate, chat, eval-task, export, export-merged)."""
    token = _TRUSTED.set(True)
    try:
        yield
    finally:
        _TRUSTED.reset(token)
COMMANDS = {"pretrain": "train"}  # the command that resumes a run of each kind (the others: the kind's name)


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (a full disk, a failed write): the run stops there, its earlier
    checkpoints intact. The CLI exits with status 1."""


def resume_command(run_dir: Path) -> str:
    """The command that continues the run in ``run_dir`` (``mlx-llm train``, ``mlx-llm sft``, …)."""
    try:
        kind = open_run(run_dir).kind
    except CheckpointError:
        kind = "pretrain"
    return f"mlx-llm {COMMANDS.get(kind, kind)} --out {run_dir} --resume"


class Checkpoints:
    """Save / restore a state pytree every k steps in ``run_dir/checkpoints``; keeps the last ``keep``. Each saved
    step gets a checksum manifest; ``restore`` verifies it first. ``asynchronous``: orbax writes in the background
    (``save`` returns once the state is copied to host memory); ``trust_unverified``: restore a step that should
    have a manifest but has none (``--trust-unverified``)."""

    def __init__(self, run_dir: str | os.PathLike, keep: int = 2, *, asynchronous: bool = False,
                 trust_unverified: bool | None = None):
        self.directory = Path(run_dir).absolute() / CHECKPOINT_DIR
        self.keep = keep
        self.trust_unverified = _TRUSTED.get() if trust_unverified is None else trust_unverified
        self._pending: tuple[int, int] | None = None  # (step, bytes) of the save orbax may still be writing
        self._writing: int | None = None  # the step orbax writes now (``_before_commit``)
        self._checksums = _record_checksums(self.directory.parent)
        # orbax keeps every step: ``_prune`` removes old ones once the newest has its manifest
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None, create=True, enable_async_checkpointing=asynchronous,
            async_options=ocp.AsyncOptions(post_finalization_callback=self._before_commit) if asynchronous else None)
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        self._quiet = lambda record: _not_orbax_error(record)  # this object's own filter, removed at ``close``
        logging.getLogger("absl").addFilter(self._quiet)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    def save(self, step: int, state: Any) -> None:
        """Write checkpoint ``step`` (after finishing the previous one); synchronous: with its manifest."""
        self.finish()
        size = sum(int(getattr(a, "nbytes", 0)) for a in jax.tree.leaves(state))
        self._writing = step
        try:
            self._manager.save(step, args=ocp.args.StandardSave(state), force=True)
        except Exception as exc:
            raise self._write_failed(step, size, exc, committed=False) from None
        self._pending = (step, size)
        if not self._manager.is_saving_in_progress():
            self.finish()

    def _before_commit(self) -> None:
        """orbax's post-finalization callback (process 0, in its background thread, every process's files
        written): a manifest in the step's temporary directory before orbax renames it into place, so a step never
        appears without one, however the process ends. orbax then updates two files of its own (the commit time,
        a success note): ``finish`` writes the whole manifest again."""
        found = [p for p in self.directory.glob(f"{self._writing}{ORBAX_TMP}*") if p.is_dir()]
        newest = max(found, key=lambda p: p.stat().st_mtime) if found else self.step_dir(self._writing)
        _write_manifest(newest, skip=ORBAX_LATE_FILES)  # the newest: a killed run may have left an older one

    def poll(self) -> None:
        """Finish a background save that orbax has completed (its manifest now, not at the next save)."""
        if self._pending is not None and not self._manager.is_saving_in_progress():
            self.finish()

    def finish(self) -> None:
        """Wait for the save in flight, then write its manifest (process 0) and remove checkpoints beyond
        ``keep``. A failed write raises ``CheckpointWriteError`` once what it left is removed."""
        if self._pending is None:
            return
        step, size = self._pending
        try:
            self._manager.wait_until_finished()
            while self._manager.is_saving_in_progress():  # a join cut short by Ctrl-C returns early (bpo-45274)
                time.sleep(0.01)
            if jax.process_index() == 0:  # one writer; orbax has committed every process's files by now
                if not self.step_dir(step).is_dir():
                    raise CheckpointError("orbax did not finish writing it")
                _write_manifest(self.step_dir(step))
        except Exception as exc:
            self._pending = None
            raise self._write_failed(step, size, exc) from None
        self._pending = None  # still set after a KeyboardInterrupt while waiting: ``close`` finishes it
        self._prune()

    def _prune(self) -> None:
        if jax.process_index() == 0:
            for s in self.all_steps()[:-self.keep]:
                shutil.rmtree(self.step_dir(s), ignore_errors=True)
        self._manager.reload()

    def _write_failed(self, step: int, size: int, exc: Exception, committed: bool = True) -> CheckpointWriteError:
        """Remove what a failed save of ``step`` left (process 0): orbax's temporary directories of the step, and
        (``committed``: the save began, so the directory is this save's) the step directory orbax committed before
        its manifest failed; the error names the step, the directory and the space needed."""
        if jax.process_index() == 0:
            for path in [*([self.step_dir(step)] if committed else []), *self.directory.glob(f"{step}{ORBAX_TMP}*")]:
                shutil.rmtree(path, ignore_errors=True)
        self._manager.reload()
        earlier = [s for s in self.all_steps() if s < step]
        kept = f"checkpoint {earlier[-1]} is intact" if earlier else "no earlier checkpoint was written"
        then = f"continue with `{resume_command(self.directory.parent)}`"
        if _disk_full(exc):
            free = shutil.disk_usage(self.directory).free if self.directory.exists() else 0
            return CheckpointWriteError(
                f"no space left on device writing checkpoint {step} to {self.directory}: it needs about "
                f"{_size(size)} (the train state), {_size(free)} are free there; the partial checkpoint was "
                f"removed and {kept}; free some space, then {then}")
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        return CheckpointWriteError(f"checkpoint {step} could not be written to {self.directory} ({first}); the "
                                    f"partial checkpoint was removed and {kept}; {then}")

    def damage(self, step: int) -> str | None:
        """What is wrong with checkpoint ``step`` by its manifest; None when intact (or written without one by
        a version that wrote none, or trusted: ``trust_unverified``)."""
        step_dir = self.step_dir(step)
        if not (step_dir / MANIFEST_FILE).is_file():
            if not step_dir.is_dir():
                return "its directory is missing"
            return None if self.trust_unverified or not self._expects_manifest(step) else UNVERIFIED
        try:
            listed = json.loads((step_dir / MANIFEST_FILE).read_text(encoding="utf-8"))["files"]
            return next(filter(None, (_file_damage(step_dir, rel, want) for rel, want in listed.items())), None)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            return f"its checksum manifest {MANIFEST_FILE} cannot be read ({exc})"

    def _expects_manifest(self, step: int) -> bool:
        """The run writes a manifest for every checkpoint: its record says so, or an earlier step has one."""
        return self._checksums or any((self.step_dir(s) / MANIFEST_FILE).is_file()
                                      for s in self.all_steps() if s < step)

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
        if problem == UNVERIFIED:
            return CheckpointError(f"checkpoint {step} cannot be verified ({self.step_dir(step)}: {problem}); "
                                   f"nothing was deleted; pass {TRUST_FLAG} (every command that reads a "
                                   f"run) to restore it unchecked, or {then}")
        return CheckpointError(f"checkpoint {step} is damaged ({self.step_dir(step)}: {problem}); nothing was "
                               f"deleted; {then}")

    def restore(self, abstract_state: Any, step: int | None = None) -> Any:
        """Restore into the structure, shapes, dtypes and shardings of ``abstract_state``, after checking the
        step against its manifest."""
        self.finish()
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
        """Finish the save in flight (its manifest), then close orbax; raises what ``finish`` raises."""
        try:
            self.finish()
        finally:
            self._manager.close()
            logging.getLogger("absl").removeFilter(self._quiet)


UNVERIFIED = (f"it has no checksum manifest {MANIFEST_FILE}, though this run writes one for every checkpoint: it "
              f"was deleted, or the run stopped before writing it, so the files cannot be verified")


def _record_checksums(run_dir: Path) -> bool:
    """Whether the run's record says its checkpoints carry manifests (False without a readable record)."""
    if not (run_dir / CONFIG_FILE).is_file():
        return False
    try:
        return open_run(run_dir).record.checksums
    except CheckpointError:
        return False


def _disk_full(exc: BaseException | None) -> bool:
    """A full disk or quota anywhere in ``exc``'s chain (tensorstore reports it in its message only)."""
    for _ in range(16):  # a chain, not a cycle
        if exc is None:
            return False
        if getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left on device" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _size(n: float) -> str:
    """Bytes in decimal units: 812 B, 1.3 MB."""
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= k:
            return f"{n / k:.1f} {unit}"
    return f"{n:.0f} B"


def _not_orbax_error(record: logging.LogRecord) -> bool:
    """A ``logging`` filter dropping orbax's error logs (they carry tracebacks from its threads): the failures
    they describe reach the caller as exceptions."""
    return record.levelno < logging.ERROR or f"{os.sep}orbax{os.sep}" not in record.pathname


def _write_manifest(step_dir: Path, skip: tuple[str, ...] = ()) -> None:
    write_json_atomic(step_dir / MANIFEST_FILE, {"files": _file_digests(step_dir, skip)})


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _file_digests(step_dir: Path, skip: tuple[str, ...] = ()) -> dict:
    return {p.relative_to(step_dir).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
            for p in sorted(step_dir.rglob("*")) if p.is_file() and p.name not in (MANIFEST_FILE, *skip)}


def _file_damage(step_dir: Path, rel: str, want: dict) -> str | None:
    path = step_dir / rel
    if not path.is_file():
        return f"{rel} is missing"
    size = path.stat().st_size
    if size != want["bytes"]:
        truncated = " (truncated)" if size < want["bytes"] else ""
        return f"{rel} has {size} bytes, {want['bytes']} were written{truncated}"
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
    return (f"run directory {str(run_dir)!r} is locked{who}: another process is training in it "
            f"({run_dir / LOCK_FILE}); "
            f"wait for it to finish or stop it, or choose another --out")
