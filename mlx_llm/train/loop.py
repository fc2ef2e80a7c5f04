"""The one training loop of every run kind (pretraining, SFT, reward model, DPO, RL): ``fit``.

A run kind supplies a ``Job``: its compiled update (``step.make_update`` of its objective, placed on the mesh),
its batch source, its evaluator and what it logs. The loop owns the rest, the same for every kind: the restore
on resume (the latest checkpoint, or ``from_step``), the step loop, readback of metrics every ``log_interval``
steps (and before every evaluation or checkpoint, so no host round-trip sits between two steps unless the batch
source itself needs the parameters, as RL's rollouts do), the divergence check (a checkpoint is written only
after every step before it was checked finite, so a diverged run keeps its last good checkpoint), the
evaluation and checkpoint cadence, ``max_seconds`` and the progress bar.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any, Callable

import jax

from mlx_llm.config import ModelConfig, TrainConfig
from mlx_llm.errors import CheckpointError
from mlx_llm.runs.record import RUN_FILE
from mlx_llm.settings import write_text_atomic
from mlx_llm.train import trackers as trackers_lib
from mlx_llm.train import watch
from mlx_llm.train.checkpoint import Checkpoints, abstract_like
from mlx_llm.train.metrics import (METRICS_FILE, TrainingDiverged, append_metrics, expert_load_metrics,
                                   progress_bar, truncate_metrics)
from mlx_llm.train.parallel import is_main_process, sync


PROFILE_DIR, HLO_DIR = "profile", "hlo"


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


@dataclasses.dataclass
class Cadence:
    """What happens after step ``done`` (1-based) of a run of ``tcfg.steps``, and whether it ends there."""

    done: int
    final: bool
    evaluate: bool
    checkpoint: bool
    readback: bool

    @classmethod
    def after(cls, done: int, tcfg: TrainConfig, out_of_time: bool, every_step: bool) -> "Cadence":
        final = done == tcfg.steps or out_of_time
        evaluate = done % tcfg.eval_interval == 0 or final
        checkpoint = done % tcfg.checkpoint_interval == 0 or final
        return cls(done, final, evaluate, checkpoint,
                   every_step or evaluate or checkpoint or done % tcfg.log_interval == 0)


def restore(state, run_dir: Path, ckpts: Checkpoints, *, resume: bool, from_step: int | None, log) -> tuple:
    """(state, last checkpoint step): the state restored on resume (the latest checkpoint, or ``from_step``,
    the later ones set aside, never deleted), else as given."""
    last = ckpts.latest_step() if from_step is None else from_step
    if resume and last is not None:
        state = ckpts.restore(abstract_like(state), last)
        if from_step is not None:
            for path in ckpts.set_aside_after(from_step) if is_main_process() else ():
                log(f"set aside {path} (nothing deleted)")
            sync("set aside")
        log(f"resumed {run_dir} from step {last}")
    if int(state.data_step) != int(state.step):
        raise CheckpointError(f"checkpoint {last} is inconsistent: data cursor {int(state.data_step)} != step "
                              f"{int(state.step)}")
    return state, last if resume else None


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
            where = (f"step {last_ckpt} in {run_dir / 'checkpoints'}" if last_ckpt is not None
                     else "none was written yet")
            raise TrainingDiverged(f"training diverged: loss = {row['loss']}, grad norm = {row['grad_norm']} at step "
                                   f"{row['step']} (lr {row['lr']:.3g}; not finite: {bad}); the last good "
                                   f"checkpoint is kept ({where}); lower --lr or raise --warmup-steps")
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


def _hparams(run_dir: Path, cfg: ModelConfig, tcfg: TrainConfig) -> dict:
    """The trackers' hyperparameters: the model and train configs and the run record (kind, data, settings)."""
    record = json.loads((run_dir / RUN_FILE).read_text(encoding="utf-8")) if (run_dir / RUN_FILE).is_file() else {}
    return {"model": cfg.to_dict(), "train": tcfg.to_dict(),
            **{k: record[k] for k in ("kind", "data", "base", "lora", "settings") if record.get(k) is not None}}


def open_trackers(run_dir: Path, cfg: ModelConfig, tcfg: TrainConfig, options, resume: bool) -> trackers_lib.Trackers:
    """The run's trackers (``options.tracker``), process 0's only: the others get the no-op tracker."""
    names = options.tracker if options is not None and is_main_process() else ()
    return trackers_lib.Trackers.open(run_dir, names, config=_hparams(run_dir, cfg, tcfg) if names else {},
                                      resume=resume, name=run_dir.name)


def dump_hlo(run_dir: Path, job: Job, options) -> None:
    """``--dump-hlo``: the compiled step's HLO text in RUN/hlo/step.txt (process 0)."""
    if options is None or not options.dump_hlo or job.hlo_text is None or not is_main_process():
        return
    (run_dir / HLO_DIR).mkdir(exist_ok=True)
    write_text_atomic(run_dir / HLO_DIR / "step.txt", job.hlo_text())


def fit(run_dir: Path, cfg: ModelConfig, tcfg: TrainConfig, job: Job, state, *, resume: bool, show_progress: bool,
        log=print, from_step: int | None = None, max_seconds: float | None = None,
        on_restored: Callable[[], None] | None = None, options=None) -> dict:
    """Train ``state`` (placed on the mesh) to ``tcfg.steps`` with ``job`` in ``run_dir``; returns {"state",
    "summary", "last" (the last step's row), "eval" (the last evaluation)}. ``max_seconds`` ends the run early
    (evaluation and checkpoint included) after the step that reaches that much loop time: equal-time runs.
    ``on_restored`` runs once the state is restored, before the first step: a resume records what it changed
    there, so a resume whose checkpoint cannot be restored changes nothing in the run. ``options``
    (``runs.configs.RunOptions``): trackers, the profiler and the HLO dump."""
    ckpts = Checkpoints(run_dir, tcfg.keep_checkpoints)
    state, last_ckpt = restore(state, run_dir, ckpts, resume=resume, from_step=from_step, log=log)
    if on_restored is not None:
        on_restored()
    dump_hlo(run_dir, job, options)
    with open_trackers(run_dir, cfg, tcfg, options, resume) as trackers:
        profile = Profile(run_dir, options.profile_range() if options is not None else None)
        try:
            return _steps(run_dir, cfg, tcfg, job, state, ckpts, last_ckpt, show_progress, max_seconds, trackers,
                          profile)
        finally:
            profile.stop()  # the state given here was donated to the first step: nothing of it to wait for
            ckpts.close()


def _steps(run_dir: Path, cfg: ModelConfig, tcfg: TrainConfig, job: Job, state, ckpts, last_ckpt, show_progress,
           max_seconds, trackers, profile) -> dict:
    """``fit``'s loop from the restored state."""
    metrics_path = run_dir / METRICS_FILE
    truncate_metrics(metrics_path, int(state.step))
    start = done = int(state.step)
    bar = progress_bar(show_progress, start, tcfg.steps)
    pending, last, result = [], {}, {}
    t0 = last_time = time.perf_counter()
    train_seconds, last_step = 0.0, start
    for s in range(start, tcfg.steps):
        with profile.step(s):
            batch, host = job.batches(s, state)
            state, m = job.update(state, batch, job.frozen)
        profile.after(s, state)
        pending.append((s, m, host))
        cad = Cadence.after(s + 1, tcfg, max_seconds is not None and time.perf_counter() - t0 >= max_seconds,
                            job.readback_every_step)
        done = cad.done
        if not cad.readback:
            continue
        rows = read_back(pending, cfg, run_dir, last_ckpt, tcfg.watch_interval)
        append_metrics(metrics_path, rows)
        trackers.log(rows)
        now = time.perf_counter()
        train_seconds += now - last_time
        last = rows[-1]
        bar.set_postfix(**_postfix(last, done - last_step, now - last_time, job))
        bar.update(done - last_step)
        if cad.evaluate:
            result = job.evaluate(state)
            if result:
                append_metrics(metrics_path, [{"step": done, **result}])
                trackers.log([{"step": done, **result}])
                bar.write(f"step {done}: {job.describe(result)}")
        if cad.checkpoint:
            ckpts.save(done, state)
            last_ckpt = done
        last_time, last_step = time.perf_counter(), done
        if cad.final:
            break
    bar.close()
    if not result:  # nothing left to train (a resumed finished run): evaluate the restored state
        result = job.evaluate(state)
    steps_run = done - start
    summary = {"steps": int(state.step), "steps_this_session": steps_run, "wall_seconds": time.perf_counter() - t0,
               "train_seconds": train_seconds,
               "steps_per_second": steps_run / train_seconds if train_seconds else None, **result}
    if job.tokens_per_step:
        summary["tokens_per_second"] = steps_run * job.tokens_per_step / train_seconds if train_seconds else None
        summary["flops_per_token"] = job.flops_per_token
    return {"state": state, "summary": summary, "last": last, "eval": result}
