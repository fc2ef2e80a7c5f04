"""Orbax checkpoints with checksum manifests, written asynchronously.

A run directory's ``checkpoints/<step>/`` are written by orbax to a temporary directory and renamed when complete,
so a run killed while writing leaves the previous checkpoint loadable. This module never reads ``run.json`` nor
names a command: what it needs to know of the run (whether its checkpoints carry manifests, how a user continues
it) comes from the run layer as ``RunHints`` (runs/rundir.py builds them from the run record).

- ``checkpoints/<step>/mlx_llm_sha256.json``: the size and sha256 of every file of the step, written after orbax
  has finished it and checked before every restore. Orbax itself notices a truncated or missing array file but
  restores flipped bytes silently and rebuilds a deleted ``_METADATA`` from the target; the manifest catches all
  of these. A damaged checkpoint raises ``CheckpointError`` naming it and the previous intact one; nothing is
  deleted. A step without a manifest in a run that writes them (``RunHints.checksums``, or an earlier step has
  one) is refused too, unless the caller trusts it (``--trust-unverified``); checkpoints of runs written before
  manifests existed are restored unchecked.
- Asynchronous saves (``asynchronous=True``, the training loop's): orbax copies the state to host memory and
  writes it in a background thread while training goes on. A manifest of the step's array files is written in
  orbax's temporary directory before orbax renames it into place, so no step appears without one; ``finish``
  (before the next save, at ``close``, or once ``poll`` finds the save done) writes the whole manifest once orbax
  has finished, and only then removes checkpoints beyond ``keep``: a failed save never costs a verified one.
- A checkpoint that cannot be written (a full disk, say) raises ``CheckpointWriteError`` naming the step, the
  directory and the space it needs, once what orbax wrote of it is removed.
- orbax's error logs (tracebacks from its threads) are dropped while a ``Checkpoints`` is open, and what a failed
  write leaves running is waited for quietly (train/orbax_quiet.py): every failure reaches the caller as one of
  the errors above, and nothing more is printed.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import errno
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import jax
import orbax.checkpoint as ocp

from mlx_llm.config import write_json_atomic
from mlx_llm.errors import CheckpointError, CheckpointWriteError
from mlx_llm.train.orbax_quiet import Quiet, settle

CHECKPOINT_DIR = "checkpoints"  # a run directory's checkpoints/<step>/
MANIFEST_FILE = "mlx_llm_sha256.json"  # inside each checkpoints/<step>/
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
def _default_recovery(run_dir: Path, damaged: int, good: int) -> str:
    return f"continue from it (checkpoint {good} of {run_dir})"


@dataclasses.dataclass(frozen=True)
class RunHints:
    """What the run layer tells a run's checkpoints: whether every checkpoint carries a manifest (``checksums``,
    the run record's), the command that continues the run (``resume``) and how to continue from an earlier
    intact checkpoint ``good`` when ``damaged`` is damaged (``recover(run_dir, damaged, good)``)."""

    checksums: bool = False
    resume: str = "resume the run"
    recover: Callable[[Path, int, int], str] = _default_recovery


class Checkpoints:
    """Save / restore a state pytree every k steps in ``run_dir/checkpoints``; keeps the last ``keep``. Each saved
    step gets a checksum manifest; ``restore`` verifies it first. ``asynchronous``: orbax writes in the background
    (``save`` returns once the state is copied to host memory); ``trust_unverified``: restore a step that should
    have a manifest but has none (``--trust-unverified``); ``hints``: what the run layer knows of the run
    (``RunHints``)."""

    def __init__(self, run_dir: str | os.PathLike, keep: int = 2, *, asynchronous: bool = False,
                 trust_unverified: bool | None = None, hints: RunHints = RunHints()):
        self.directory = Path(run_dir).absolute() / CHECKPOINT_DIR
        self.hints = hints
        self.keep = keep
        self.trust_unverified = _TRUSTED.get() if trust_unverified is None else trust_unverified
        self._pending: tuple[int, int] | None = None  # (step, bytes) of the save orbax may still be writing
        self._writing: int | None = None  # the step orbax writes now (``_before_commit``)
        # orbax keeps every step: ``_prune`` removes old ones once the newest has its manifest
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None, create=True, enable_async_checkpointing=asynchronous,
            async_options=ocp.AsyncOptions(post_finalization_callback=self._before_commit) if asynchronous else None)
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        self._quiet = Quiet()  # orbax's noise dropped until ``close``

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    @staticmethod
    def steps_in(run_dir) -> list[int]:
        """The finished checkpoints' steps of ``run_dir``, listed without opening orbax or creating anything
        (orbax's temporary and set-aside directories have non-numeric names)."""
        root = Path(run_dir) / CHECKPOINT_DIR
        return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit()) if root.is_dir() else []

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
        settle(self._manager)  # orbax's writes stop before their directories are removed
        if jax.process_index() == 0:
            for path in [*([self.step_dir(step)] if committed else []), *self.directory.glob(f"{step}{ORBAX_TMP}*")]:
                shutil.rmtree(path, ignore_errors=True)
        self._manager.reload()
        earlier = [s for s in self.all_steps() if s < step]
        kept = f"checkpoint {earlier[-1]} is intact" if earlier else "no earlier checkpoint was written"
        then = f"continue with `{self.hints.resume}`"
        if disk_full(exc):
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
        return self.hints.checksums or any((self.step_dir(s) / MANIFEST_FILE).is_file()
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
            then = f"the previous intact checkpoint is step {good}: {self.hints.recover(run, step, good)}"
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
            self._quiet.close()


UNVERIFIED = (f"it has no checksum manifest {MANIFEST_FILE}, though this run writes one for every checkpoint: it "
              f"was deleted, or the run stopped before writing it, so the files cannot be verified")


def disk_full(exc: BaseException | None) -> bool:
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
