"""Run directories: the lock a training run holds, the checks before a run writes anything, and what a user is
told to do next (the resume command, how to recover from a damaged checkpoint).

- ``run.lock``: a process training in a run directory holds an ``fcntl.flock`` on it (``run_lock``); a second run
  there is refused. The kernel drops the lock when the process ends, however it ends: no stale lock.
- ``check_run_dir``: a directory holding a run needs ``--resume``; any other non-empty one is refused.
- ``hints(run)``: the ``train.checkpoint.RunHints`` of a run (its record's ``checksums``, its resume command), so
  the checkpoint machinery below never reads ``run.json`` nor names a command.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Iterator

import jax

from mlx_llm.errors import CheckpointError, MLXLLMError
from mlx_llm.runs.record import CONFIG_FILE, Run, RunRecord, open_run
from mlx_llm.errors import CheckpointWriteError
from mlx_llm.train.checkpoint import Checkpoints, RunHints, disk_full
from mlx_llm.train.loop import RunInfo, TrainingStopped

LOCK_FILE = "run.lock"
COMMANDS = {"pretrain": "train"}  # the command that resumes a run of each kind (the others: the kind's name)


def resume_command(run_dir: Path, kind: str | None = None) -> str:
    """The command that continues the run in ``run_dir`` (``mlx-llm train``, ``mlx-llm sft``, …)."""
    if kind is None:
        try:
            kind = open_run(run_dir).kind
        except CheckpointError:
            kind = "pretrain"
    return f"mlx-llm {COMMANDS.get(kind, kind)} --out {run_dir} --resume"


def _recover(run_dir: Path, damaged: int, good: int) -> str:
    return (f"continue from it with `mlx-llm train --out {run_dir} --resume --from-step {good}`, or give `--step "
            f"{good}` to eval / generate (a post-training run: rename {damaged} to {damaged}.corrupt and --resume)")


def hints(run: Run | Path | str, kind: str | None = None) -> RunHints:
    """The checkpoint hints of a run (an opened ``Run``, or a directory whose record is read if it has one)."""
    if not isinstance(run, Run):
        path = Path(run)
        try:
            run = open_run(path) if (path / CONFIG_FILE).is_file() else None
        except CheckpointError:
            run = None
        if run is None:
            return RunHints(resume=resume_command(path, kind or "pretrain"), recover=_recover)
    return RunHints(checksums=run.record.checksums, resume=resume_command(run.path, kind or run.kind),
                    recover=_recover)


def run_info(run: Run | Path | str, kind: str, cfg, tcfg, record: RunRecord | None = None) -> RunInfo:
    """What the training loop is told of a run (``train.loop.RunInfo``): an opened ``Run`` (a resume), or a new
    run's directory and the ``record`` just written (its checkpoints carry manifests)."""
    if isinstance(run, Run):
        path, record = run.path, run.record
    else:
        path, record = Path(run), record.replace(checksums=True)
    hparams = {"model": cfg.to_dict(), "train": tcfg.to_dict(),
               **{k: v for k, v in record.to_dict().items() if k in ("kind", "data", "base", "lora", "settings")
                  and v is not None}}
    return RunInfo(RunHints(checksums=record.checksums, resume=resume_command(path, kind), recover=_recover), hparams)


def checkpoints(run: Run | Path | str, **kw) -> Checkpoints:
    """The ``Checkpoints`` of a run directory, with its hints."""
    return Checkpoints(run.path if isinstance(run, Run) else run, hints=hints(run), **kw)



# ----- new directories, whole or not at all -----------------------------------------------------------------
def check_new_dir(path: Path, what: str) -> None:
    """``path`` must not exist, or be an empty directory: nothing is ever overwritten."""
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise CheckpointError(f"{what} {str(path)!r} exists and is not empty; choose a new directory")


PARTIAL = ".mlx-partial-"  # a new directory's temporary sibling: .mlx-partial-<pid>-<digest of the name>


def _partial_name(path: Path, pid: int) -> str:
    """A short temporary name (a long target name stays within NAME_MAX)."""
    return f"{PARTIAL}{pid}-{hashlib.sha1(path.name.encode()).hexdigest()[:12]}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_partials(path: Path) -> list[Path]:
    """Remove the temporary directories that a killed writer of ``path`` left beside it (their process is gone);
    returns them."""
    digest = _partial_name(path, 0).rpartition("-")[2]
    removed = []
    for tmp in path.parent.glob(f"{PARTIAL}*-{digest}") if path.parent.is_dir() else ():
        pid = tmp.name[len(PARTIAL):].partition("-")[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
    return removed


def check_space(path: Path, needed: int) -> None:
    """Refuse, before anything is written, a new directory ``path`` whose files need more bytes than the disk has
    free there (a write that fails half-way is cleaned up too; this says so first, in one line)."""
    parent = next((p for p in [path.parent, *path.parent.parents] if p.exists()), Path("/"))
    free = shutil.disk_usage(parent).free
    if needed > free:
        raise CheckpointWriteError(f"{path} needs about {needed / 1e6:,.1f} MB and {parent} has {free / 1e6:,.1f} MB "
                                   f"free: nothing was written; free some space and run the same command again")


@contextlib.contextmanager
def new_dir(path: Path, needed: int = 0):
    """Yield a temporary sibling of ``path`` to fill; on success it becomes ``path``, on failure (or Ctrl-C) it is
    removed, so a failed write leaves nothing behind; one a killed process left is removed by the next writer. A
    full disk is one ``CheckpointWriteError`` line: before anything is written when ``needed`` (bytes) does not
    fit (``check_space``), else when the write fails."""
    path = Path(path).absolute()
    remove_stale_partials(path)
    check_space(path, needed)
    tmp = path.with_name(_partial_name(path, os.getpid()))
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if path.exists():
            path.rmdir()  # empty (checked before): rename needs it gone
        os.rename(tmp, path)
    except Exception as exc:
        if disk_full(exc):
            raise CheckpointWriteError(f"no space left on device writing {path}: nothing was written there; free "
                                       f"some space and run the same command again") from None
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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
    """Hold ``run_dir``'s lock for the rest of a run (``run_lock``; a new run's directory is created
    here, just before its first file is written) and check its contents again under the lock: another run may
    have started there since ``check_run_dir`` (of two new runs racing for one directory, the second finds the
    first's lock or its run and is refused). In a multi-process run, process 0 holds it for all the processes.

    A new run that fails before its first checkpoint leaves nothing behind (``_undo_new_run``): the same command
    with the mistake fixed (a lower --lr after a divergence, say) then runs as if the first had never been tried,
    into the same --out and without --resume. A stop (SIGTERM, Ctrl-C) is not a failure: the run stays, to be
    resumed."""
    if jax.process_index() != 0:
        yield
        return
    existed, lock_existed = run_dir.exists(), (run_dir / LOCK_FILE).exists()
    with run_lock(run_dir):
        _check_run_dir_contents(run_dir, resume)
        try:
            yield
        except BaseException as exc:
            if not resume and not isinstance(exc, (TrainingStopped, KeyboardInterrupt)):
                _undo_new_run(run_dir, existed, lock_existed, exc)
            raise


def _undo_new_run(run_dir: Path, existed: bool, lock_existed: bool, exc: BaseException) -> None:
    """Remove what a new run wrote when it failed before its first checkpoint (the directory itself, or what this
    run added to the empty directory it was given), and say so in the error's message."""
    if Checkpoints.steps_in(run_dir):
        return
    if not existed:
        shutil.rmtree(run_dir, ignore_errors=True)
    else:
        for child in list(run_dir.iterdir()):
            if child.name == LOCK_FILE and lock_existed:
                continue
            shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink(missing_ok=True)
    if isinstance(exc, MLXLLMError) and exc.args:
        exc.args = (f"{exc.args[0]}; the run had no checkpoint, so nothing of it was kept: the same command runs "
                    f"afresh into {run_dir}",) + exc.args[1:]


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
