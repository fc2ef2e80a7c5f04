"""The one training loop of every run kind (pretraining, SFT, reward model, DPO, RL): ``fit``.

A run kind supplies a ``Job``: its compiled update (``step.make_update`` of its objective, placed on the mesh),
its batch source, its evaluator and what it logs. The loop owns the rest, the same for every kind: the restore
on resume (the latest checkpoint, or ``from_step``), the step loop, readback of metrics every ``log_interval``
steps (and before every evaluation or checkpoint, so no host round-trip sits between two steps unless the batch
source itself needs the parameters, as RL's rollouts do), the divergence check (a checkpoint is written only
after every step before it was checked finite, so a diverged run keeps its last good checkpoint), the
evaluation and checkpoint cadence, ``max_seconds`` and the progress bar.

Goodput: checkpoints are written asynchronously (train/checkpoint.py), every ``checkpoint_interval``
steps and, with ``--checkpoint-minutes M``, also once M minutes have passed since the last one. SIGTERM and SIGINT
(Ctrl-C) stop the run at the next step boundary: the step in flight finishes, its metrics are written, a
checkpoint is written at that step, and ``fit`` raises ``TrainingStopped`` naming the step and the command that
continues the run (the CLI prints it and exits 0). A second signal interrupts at once (KeyboardInterrupt).

The loop never reads ``run.json`` nor names a command: the run layer gives it a ``ResumePlan`` (what to restore)
and a ``RunInfo`` (the checkpoint hints, the trackers' hyper-parameters).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from mlx_llm.config import ModelConfig, TrainConfig
from mlx_llm.errors import CheckpointError, MLXLLMError
from mlx_llm.settings import write_text_atomic
from mlx_llm.train import trackers as trackers_lib
from mlx_llm.train import watch
from mlx_llm.train.checkpoint import Checkpoints, RunHints, abstract_like
from mlx_llm.train.metrics import (METRICS_FILE, TrainingDiverged, append_metrics, expert_load_metrics, progress_bar,
                                   truncate_metrics)
from mlx_llm.train.parallel import is_main_process, sync


PROFILE_DIR, HLO_DIR = "profile", "hlo"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
clock = time.monotonic  # what --checkpoint-minutes measures (tests replace it)


def _describe(result: dict) -> str:
    return ", ".join(f"{k} {v:.4g}" for k, v in result.items() if isinstance(v, float))


@dataclasses.dataclass
class Job:
    """What one run kind gives ``fit``.

    ``update(state, device batch, frozen) → (state, metrics)``: the compiled step; ``batches(step, state) →
    (device batch, host metrics)``: the step's batch, a function of (seed, step) and, for on-policy data, of the
    state's parameters; ``evaluate(state) → {name: float}``: held-out metrics; ``describe(result)``: the
    progress bar's line for an evaluation; ``tokens_per_step`` and ``flops_per_token`` (when known) give the
    throughput columns; ``readback_every_step``: the batch source reads the parameters anyway (RL), so every
    step's metrics are read back at once; ``hlo_text()``: the compiled step's HLO (``--dump-hlo``).
    """

    update: Callable
    batches: Callable
    evaluate: Callable
    frozen: Any = None
    describe: Callable = _describe
    tokens_per_step: int | None = None
    flops_per_token: float | None = None
    readback_every_step: bool = False
    hlo_text: Callable[[], str] | None = None


@dataclasses.dataclass(frozen=True)
class ResumePlan:
    """What a resumed run restores, chosen and checked by the run layer (runs/resume.py) before anything is
    written; ``fit`` calls ``on_restored`` once the state is restored, before the first step (a resume records what
    it changed there, so a resume whose checkpoint cannot be restored changes nothing in the run)."""

    step: int | None  # the checkpoint to restore (None: none was written yet, the run starts over)
    from_step: bool = False  # chosen with --from-step: the checkpoints after it are set aside, never deleted
    schedule_steps: int | None = None  # the total the schedule is defined over (an extended run's first steps)
    on_restored: Callable[[], None] | None = None


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """What the run layer tells the loop of its run: the checkpoints' hints (manifests, the resume command) and
    the trackers' hyper-parameters."""

    hints: RunHints = RunHints()
    hparams: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Cadence:
    """What happens after step ``done`` (1-based) of a run of ``tcfg.steps``, and whether it ends there."""

    done: int
    final: bool
    evaluate: bool
    checkpoint: bool
    readback: bool

    @classmethod
    def after(cls, done: int, tcfg: TrainConfig, out_of_time: bool, every_step: bool,
              due: bool = False) -> "Cadence":
        """``due``: a time-based checkpoint is due (``--checkpoint-minutes``)."""
        final = done == tcfg.steps or out_of_time
        evaluate = done % tcfg.eval_interval == 0 or final
        checkpoint = done % tcfg.checkpoint_interval == 0 or final or due
        return cls(done, final, evaluate, checkpoint,
                   every_step or evaluate or checkpoint or done % tcfg.log_interval == 0)


class TrainingStopped(MLXLLMError):
    """A run stopped by SIGTERM / SIGINT at a step boundary, its checkpoint written there; the message names the
    step and the command that continues the run."""

    def __init__(self, message: str, signal_name: str, step: int):
        super().__init__(message)
        self.signal_name, self.step = signal_name, step


class StopSignals:
    """SIGTERM and SIGINT while ``fit`` runs: the first one only records its name (``received``), and the loop
    stops at the next step boundary; a second one raises KeyboardInterrupt at once, except inside a checkpoint
    write (``critical``): there it is held until the write is done, so orbax is never interrupted half-way (which
    left its threads hung or printing tracebacks). Installed from the main thread only (Python delivers signals
    there); the previous handlers are restored on exit."""

    def __init__(self):
        self.received: str | None = None
        self._previous: dict = {}
        self._critical, self._held = 0, False

    @contextlib.contextmanager
    def critical(self):
        """Within: a second signal is held; it raises KeyboardInterrupt when the block ends normally."""
        self._critical += 1
        try:
            yield
        finally:
            self._critical -= 1
        if self._critical == 0 and self._held:
            self._held = False
            raise KeyboardInterrupt

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
        return self

    def _handle(self, signum, frame) -> None:
        notice = getattr(self._previous.get(signum), "stop_noticed", None)
        if notice is not None:  # an outer handler that keeps its own note of a stop (a sweep: runs/sweep.py)
            notice(signal.Signals(signum).name)
        if self.received is None:
            self.received = signal.Signals(signum).name
        elif self._critical:
            self._held = True
        else:
            raise KeyboardInterrupt

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def any_process(flag: bool) -> bool:
    """``flag`` in any process (with several, an all-gather: call it where every process calls it)."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(np.max(multihost_utils.process_allgather(np.int32(flag))))


def restore(state, run_dir: Path, ckpts: Checkpoints, plan: ResumePlan | None, log) -> tuple:
    """(state, last checkpoint step): the plan's checkpoint restored (the later ones set aside, never deleted, when
    it was chosen with --from-step), else the state as given."""
    if plan is None or plan.step is None:
        return state, None
    state = ckpts.restore(abstract_like(state), plan.step)
    if plan.from_step:
        for path in ckpts.set_aside_after(plan.step) if is_main_process() else ():
            log(f"set aside {path} (nothing deleted)")
        sync("set aside")
    log(f"resumed {run_dir} from step {plan.step}")
    if int(state.data_step) != int(state.step):
        raise CheckpointError(f"checkpoint {plan.step} is inconsistent: data cursor {int(state.data_step)} != step "
                              f"{int(state.step)}")
    return state, plan.step


def read_back(pending: list, cfg: ModelConfig, run_dir: Path, last_ckpt, watch_interval: int = 0) -> list[dict]:
    """The pending steps' metrics as rows (one host sync); the first non-finite one stops the run. Every
    ``watch_interval``-th step's row also holds the per-layer RMS diagnostics (train/watch.py)."""
    rows = []
    for step, m, host in jax.device_get(pending):
        load, stats = m.pop("expert_load", None), m.pop("watch", None)
        watched = watch.as_row(stats) if stats is not None and (step + 1) % watch_interval == 0 else {}
        row = {"step": step + 1, **{k: float(v) for k, v in m.items()},
               **(expert_load_metrics(load, cfg) if load is not None else {}), **watched, **host}
        bad = [k for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)]
        if bad:
            kept = (f"the last good checkpoint is kept (step {last_ckpt} in {run_dir / 'checkpoints'})"
                    if last_ckpt is not None else "no checkpoint had been written yet")
            raise TrainingDiverged(f"training diverged: loss = {row['loss']}, grad norm = {row['grad_norm']} at step "
                                   f"{row['step']} (lr {row['lr']:.3g}; not finite: {bad}); {kept}; lower --lr or "
                                   f"raise --warmup-steps")
        rows.append(row)
    pending.clear()
    return rows


def _postfix(row: dict, n_steps: int, seconds: float, job: Job) -> dict:
    out = {"loss": f"{row['loss']:.3f}"}
    if job.tokens_per_step:
        tok_s = n_steps * job.tokens_per_step / seconds
        out["tok_s"] = f"{tok_s:,.0f}"
        if job.flops_per_token:
            out["flops"] = f"{tok_s * job.flops_per_token / 1e9:.1f}G"
    else:
        out["step_s"] = f"{n_steps / seconds:.2f}"
    if "load_imbalance" in row:
        out["imbalance"] = f"{max(row['load_imbalance']):.2f}"
    return out


class Profile:
    """``--profile-steps START:N``: a ``jax.profiler`` trace of steps START … START + N − 1 (1-based) into
    RUN/profile/, each step under a ``StepTraceAnnotation``; the trace stops once the last traced step's
    results exist (or when the run ends first). Off (None), it does nothing."""

    def __init__(self, run_dir: Path, steps: tuple[int, int] | None):
        self.dir, self.steps, self.active = run_dir / PROFILE_DIR, steps, False

    def step(self, s: int):
        """The context of step index ``s`` (0-based): the trace starts before the first traced one."""
        if self.steps is None or not self.steps[0] <= s + 1 < self.steps[0] + self.steps[1]:
            return contextlib.nullcontext()
        if not self.active:
            self.dir.mkdir(exist_ok=True)
            jax.profiler.start_trace(str(self.dir))
            self.active = True
        return jax.profiler.StepTraceAnnotation("train", step_num=s + 1)

    def after(self, s: int, state) -> None:
        if self.active and s + 1 == sum(self.steps) - 1:
            self.stop(state)

    def stop(self, state=None) -> None:
        """End the trace once ``state`` (the last traced step's result) exists; without it (the run ended early,
        or failed) at once."""
        if self.active:
            if state is not None:
                jax.block_until_ready(state)
            jax.profiler.stop_trace()
            self.active = False


def open_trackers(run_dir: Path, info: RunInfo, options, resume: bool) -> trackers_lib.Trackers:
    """The run's trackers (``options.tracker``), process 0's only: the others get the no-op tracker."""
    names = options.tracker if options is not None and is_main_process() else ()
    return trackers_lib.Trackers.open(run_dir, names, config=info.hparams if names else {}, resume=resume,
                                      name=run_dir.name)


def dump_hlo(run_dir: Path, job: Job, options) -> None:
    """``--dump-hlo``: the compiled step's HLO text in RUN/hlo/step.txt (process 0)."""
    if options is None or not options.dump_hlo or job.hlo_text is None or not is_main_process():
        return
    (run_dir / HLO_DIR).mkdir(exist_ok=True)
    write_text_atomic(run_dir / HLO_DIR / "step.txt", job.hlo_text())


def fit(run_dir: Path, cfg: ModelConfig, tcfg: TrainConfig, job: Job, state, *, plan: ResumePlan | None = None,
        info: RunInfo = RunInfo(), show_progress: bool, log=print, max_seconds: float | None = None,
        options=None) -> dict:
    """Train ``state`` (placed on the mesh) to ``tcfg.steps`` with ``job`` in ``run_dir``; returns {"state",
    "summary", "last" (the last step's row), "eval" (the last evaluation)}. ``plan``: what a resumed run restores
    (None: a new run); ``info``: what the run layer knows of the run. ``max_seconds`` ends the run early
    (evaluation and checkpoint included) after the step that reaches that much loop time: equal-time runs.
    ``options`` (``runs.configs.RunOptions``): trackers, the profiler, the HLO dump, time-based checkpoints and
    whether an unverified checkpoint may be restored. SIGTERM / SIGINT raise ``TrainingStopped`` once the run's
    checkpoint at the step boundary is written (the module docstring)."""
    trust = bool(options is not None and options.trust_unverified)
    ckpts = Checkpoints(run_dir, tcfg.keep_checkpoints, asynchronous=True, trust_unverified=trust, hints=info.hints)
    with StopSignals() as signals:
        try:
            state, last_ckpt = restore(state, run_dir, ckpts, plan, log)
            if plan is not None and plan.on_restored is not None:
                plan.on_restored()
            dump_hlo(run_dir, job, options)
            with open_trackers(run_dir, info, options, plan is not None) as trackers:
                profile = Profile(run_dir, options.profile_range() if options is not None else None)
                try:
                    session = _Session(run_dir, cfg, tcfg, job, ckpts, trackers, profile, signals, last_ckpt)
                    return session.run(state, show_progress, max_seconds,
                                       options.checkpoint_minutes if options is not None else None)
                except TrainingStopped as exc:
                    stopped = exc  # not a failure: the trackers end as after a finished session
                finally:
                    profile.stop()  # the state given here was donated to the first step: nothing of it to wait for
            raise stopped
        finally:
            with signals.critical():  # the save in flight finishes (its manifest) before any interrupt lands
                ckpts.close()


class _Session:
    """``fit``'s loop from the restored state: the steps, their readback, evaluations, checkpoints and a stop."""

    def __init__(self, run_dir: Path, cfg: ModelConfig, tcfg: TrainConfig, job: Job, ckpts: Checkpoints, trackers,
                 profile: Profile, signals: StopSignals, last_ckpt: int | None):
        self.run_dir, self.cfg, self.tcfg, self.job, self.ckpts = run_dir, cfg, tcfg, job, ckpts
        self.trackers, self.profile, self.signals, self.last_ckpt = trackers, profile, signals, last_ckpt
        self.metrics_path = run_dir / METRICS_FILE
        self.pending, self.last, self.result = [], {}, {}
        self.train_seconds = self.checkpoint_seconds = 0.0

    def run(self, state, show_progress: bool, max_seconds: float | None, checkpoint_minutes: float | None) -> dict:
        tcfg, job = self.tcfg, self.job
        truncate_metrics(self.metrics_path, int(state.step))
        start = done = self.last_step = int(state.step)
        self.bar = progress_bar(show_progress, start, tcfg.steps)
        t0 = self.last_time = time.perf_counter()
        self.saved_at = clock()
        for s in range(start, tcfg.steps):
            if self._stop_asked():
                self._stop(state, s)
            with self.profile.step(s):
                batch, host = job.batches(s, state)
                state, m = job.update(state, batch, job.frozen)
            self.profile.after(s, state)
            self.pending.append((s, m, host))
            done = s + 1
            out_of_time = max_seconds is not None and time.perf_counter() - t0 >= max_seconds
            cad = Cadence.after(done, tcfg, out_of_time, job.readback_every_step)
            if checkpoint_minutes is not None and not cad.checkpoint and (cad.readback or jax.process_count() == 1):
                if any_process(clock() - self.saved_at >= 60.0 * checkpoint_minutes):
                    cad = Cadence.after(done, tcfg, out_of_time, job.readback_every_step, due=True)
            if cad.readback:
                self._report(cad, state)
            else:
                with self.signals.critical():
                    self.ckpts.poll()
            if cad.final:
                break
        self.bar.close()
        if not self.result:  # nothing left to train (a resumed finished run): evaluate the restored state
            self.result = job.evaluate(state)
        return {"state": state, "summary": self._summary(state, done - start, time.perf_counter() - t0),
                "last": self.last, "eval": self.result}

    def _report(self, cad: Cadence, state) -> None:
        """Read the pending steps back (metrics, trackers, progress bar), then evaluate and checkpoint as due."""
        rows = read_back(self.pending, self.cfg, self.run_dir, self.last_ckpt, self.tcfg.watch_interval)
        append_metrics(self.metrics_path, rows)
        self.trackers.log(rows)
        now = time.perf_counter()
        self.train_seconds += now - self.last_time
        self.last = rows[-1]
        self.bar.set_postfix(**_postfix(self.last, cad.done - self.last_step, now - self.last_time, self.job))
        self.bar.update(cad.done - self.last_step)
        if cad.evaluate:
            result = self.job.evaluate(state)
            if result:
                self.result = result
                append_metrics(self.metrics_path, [{"step": cad.done, **result}])
                self.trackers.log([{"step": cad.done, **result}])
                self.bar.write(f"step {cad.done}: {self.job.describe(result)}")
        if cad.checkpoint:
            self._save(cad.done, state)
        else:
            with self.signals.critical():
                self.ckpts.poll()
        self.last_time, self.last_step = time.perf_counter(), cad.done

    def _save(self, done: int, state) -> None:
        start = time.perf_counter()
        with self.signals.critical():
            self.ckpts.save(done, state)
        self.last_ckpt, self.saved_at = done, clock()
        self.checkpoint_seconds += time.perf_counter() - start

    def _stop_asked(self) -> bool:
        """A stop signal arrived (in any process: with several, asked only at readback boundaries, where every
        process asks)."""
        if jax.process_count() == 1:
            return self.signals.received is not None
        return not self.pending and any_process(self.signals.received is not None)

    def _stop(self, state, done: int) -> None:
        """End the run at step ``done``: the steps in flight read back, a checkpoint there (none before the first
        step), then ``TrainingStopped``."""
        save = done > 0 and done != self.last_ckpt
        if self.pending:
            self._report(Cadence(done, final=True, evaluate=False, checkpoint=save, readback=True), state)
        elif save:
            self._save(done, state)
        with self.signals.critical():
            self.ckpts.finish()
        self.bar.close()
        name = self.signals.received or "a signal to another process"
        kept = (f"checkpoint {done} is in {self.ckpts.step_dir(done)}" if self.last_ckpt == done else
                "no checkpoint was written yet")
        raise TrainingStopped(f"stopped by {name} at step {done} of {self.tcfg.steps}; {kept}; continue with "
                              f"`{self.ckpts.hints.resume}`", name, done)

    def _summary(self, state, steps_run: int, wall: float) -> dict:
        seconds, job = self.train_seconds, self.job
        summary = {"steps": int(state.step), "steps_this_session": steps_run, "wall_seconds": wall,
                   "train_seconds": seconds, "checkpoint_seconds": self.checkpoint_seconds,
                   "steps_per_second": steps_run / seconds if seconds else None, **self.result}
        if job.tokens_per_step:
            summary["tokens_per_second"] = steps_run * job.tokens_per_step / seconds if seconds else None
            summary["flops_per_token"] = job.flops_per_token
        return summary
