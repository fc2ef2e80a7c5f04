"""A scaling sweep as a library call: ``SweepSpec`` (the grid, runs/sweep_spec.py) and ``run_sweep(spec, out_dir)``
(the runs, and the table of what they measured).

Every point of the spec (``points``: its steps, warmup and checkpoints) is an ordinary pretraining run, trained by
the one driver (``runs.pretrain.train_run``) into ``<out>/runs/<name>``, so ``mlx-llm eval``, ``compare`` and
``export`` read it like any other run.

``run_sweep`` writes ``<out>/sweep.json`` (the spec), ``<out>/tokenizer.json`` (a BPE trained once on the train
split, shared by every point through the token cache) and ``<out>/sweep.csv`` (one row per finished point, in the
order they finish; rewritten whole and atomically with each row, runs/sweep_table.py). Run again on the same
directory it trains only what is missing: a point with a row is skipped, a point whose run finished but whose row
was not written (a kill in between) gets its row from the run's summary.json, and a half-trained point resumes
from its last checkpoint (from its start when it had none). A different spec is refused, naming the fields that
differ; a sweep refused or failing before its first point leaves nothing in a directory it created.

Stops: SIGTERM or SIGINT (Ctrl-C) while a point trains stops that point at its next step boundary with a
checkpoint there (the training loop's own stop) and then the whole sweep: ``SweepStopped`` (``clean``) names the
point, the step and ``continue_with``, the command that continues the sweep (one during a point's last step lets
that point finish, the last one started). A signal anywhere else (compiling,
encoding the corpus, between points; a second signal) interrupts at once: ``SweepStopped``, not ``clean``, the
last checkpoint of every point kept. A full disk stops the sweep in one ``CheckpointWriteError`` line; any other
failure of a point is reported in one line and the sweep goes on (``SweepError`` at its end). ``runner="ray"``
trains the points as Ray tasks (the ``sweep`` extra), each with the same function as the local runner
(``train_point``); a stop cancels the tasks in flight.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from mlx_llm.data import tokenizer as tok_lib
from mlx_llm.data.corpora import open_data
from mlx_llm.errors import CheckpointWriteError, ConfigError, DataError, MLXLLMError
from mlx_llm.runs.configs import DataSpec
from mlx_llm.runs.pretrain import train_run
from mlx_llm.runs.record import CONFIG_FILE
from mlx_llm.runs.sweep_spec import Point, SweepSpec, points, training_compute
from mlx_llm.runs.sweep_table import COLUMNS, TIMING, as_table, load_table, read_table, write_table
from mlx_llm.settings import JsonProblem, read_json, write_json_atomic
from mlx_llm.train.checkpoint import Checkpoints, disk_full
from mlx_llm.train.loop import TrainingStopped
from mlx_llm.train.metrics import SUMMARY_FILE

__all__ = ["COLUMNS", "TIMING", "Point", "SweepError", "SweepSpec", "SweepStopped", "as_table", "points",
           "read_table", "run_sweep", "train_point", "training_compute"]

SPEC_FILE, TABLE_FILE = "sweep.json", "sweep.csv"
RUNNERS = ("local", "ray")
SUMMARY_KEYS = ("val_loss", "val_ppl")  # what a point's row needs of its summary.json


def _row(point: Point, summary: dict, run_dir: Path, wall: float) -> dict:
    cfg, tcfg = point.cfg, point.tcfg
    return {"name": point.name, "budget": point.budget, "budget_unit": point.budget_unit,
            "budget_index": point.budget_index, "size_index": point.size_index, "seed": point.seed,
            "d_model": cfg.d_model, "n_layers": cfg.n_layers, "n_heads": cfg.n_heads or 0, "d_ff": cfg.d_ff or 0,
            "N": cfg.non_embedding_param_count(), "N_total": cfg.param_count(),
            "D": tcfg.steps * tcfg.batch_size * tcfg.seq_len, "C": training_compute(cfg, tcfg), "steps": tcfg.steps,
            "batch_size": tcfg.batch_size, "seq_len": tcfg.seq_len, "lr": tcfg.lr, "warmup_steps": tcfg.warmup_steps,
            "loss": summary["val_loss"], "val_bpb": summary.get("val_bpb"), "val_ppl": summary["val_ppl"],
            "wall_seconds": wall, "tokens_per_second": summary.get("tokens_per_second") or 0.0,
            "run": str(run_dir)}


def point_data(out: Path, data: DataSpec) -> DataSpec:
    """A point's data settings: the sweep's, with a BPE vocabulary replaced by the one trained for the sweep."""
    return dataclasses.replace(data, tokenizer=str((out / tok_lib.TOKENIZER_FILE).resolve())) \
        if data.tokenizer == "bpe" else data


def _quiet(*args, **kwargs) -> None:
    return None


def _quiet(*args, **kwargs) -> None:
    return None


def train_point(out, point: Point, data: DataSpec, cache_dir=None) -> dict:
    """Train one point into ``<out>/runs/<name>`` (resuming a half-trained run; a finished one is only read) and
    return its table row. The same function runs locally and as a Ray task (maybe on another machine: ``out``
    and ``cache_dir`` must then be on a filesystem both share)."""
    out = Path(out)
    if not (out / tok_lib.TOKENIZER_FILE).is_file():
        raise DataError(f"{str(out / tok_lib.TOKENIZER_FILE)!r} does not exist here: the sweep's directory must be "
                        f"on a filesystem the driver and this worker share")
    run_dir = out / "runs" / point.name
    if (run_dir / SUMMARY_FILE).is_file():  # finished, but its row was not written
        summary = _read_summary(run_dir / SUMMARY_FILE)
        return _row(point, summary, run_dir, float(summary.get("wall_seconds", 0.0)))
    if run_dir.is_dir() and not (run_dir / CONFIG_FILE).is_file():  # killed while its first files were written
        shutil.rmtree(run_dir)
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):  # the loop's evaluation lines: the sweep prints one per point
        summary = train_run(run_dir, point.cfg, point.tcfg, point_data(out, data),
                            resume=(run_dir / CONFIG_FILE).is_file(), show_progress=False, cache_dir=cache_dir,
                            sample_tokens=0, log=_quiet)  # no closing sample: a sweep compares losses
    return _row(point, summary, run_dir, time.perf_counter() - t0)


def _read_summary(path: Path) -> dict:
    """A finished point's summary.json, read with bounded cost; one ``DataError`` line when it is not usable."""
    try:
        summary = read_json(path)
    except JsonProblem as exc:
        raise DataError(f"{exc}: the point's run is damaged; remove {path.parent} to train it again") from None
    bad = [k for k in SUMMARY_KEYS if not isinstance(summary, dict) or isinstance(summary.get(k), bool)
           or not isinstance(summary.get(k), (int, float))]
    if bad:
        raise DataError(f"{path}: {bad} missing or not numbers: the point's run is damaged; remove {path.parent} "
                        f"to train it again")
    return summary


# ----- the spec on disk ------------------------------------------------------------------------------------------
def _differences(asked, saved, prefix: str = "") -> list[str]:
    if isinstance(asked, dict) and isinstance(saved, dict):
        return [d for k in sorted(set(asked) | set(saved)) for d in _differences(asked.get(k), saved.get(k),
                                                                                 f"{prefix}{k}.")]
    return [] if asked == saved else [prefix.rstrip(".")]


def check_spec(out: Path, spec: SweepSpec) -> bool:
    """Whether ``out`` already holds this sweep (True), or is new (False); a sweep of another spec is refused,
    naming the fields that differ. ``sweep.json`` is read with bounded cost (``settings.read_json``)."""
    path = out / SPEC_FILE
    if not path.is_file():
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ConfigError(f"{str(out)!r} is not empty and holds no {SPEC_FILE}: give run_sweep a new directory "
                              f"or one it swept before")
        return False
    try:
        saved = read_json(path)
    except JsonProblem as exc:
        raise ConfigError(f"{exc}: it is not a sweep's spec") from None
    diff = _differences(spec.to_dict(), saved) if isinstance(saved, dict) else ["the whole spec"]
    if diff:
        raise ConfigError(f"{str(out)!r} holds a sweep of another spec: {', '.join(diff)} differ(s) from its "
                          f"{SPEC_FILE}; run the same spec to continue it, or give another directory")
    return True


# ----- the sweep -------------------------------------------------------------------------------------------------
class SweepError(MLXLLMError):
    """Points of a sweep failed; the rows of the others are written."""


class SweepStopped(MLXLLMError):
    """A sweep stopped by SIGTERM / SIGINT (module docstring): ``clean`` when the point in training stopped at a
    step boundary with its checkpoint (as ``mlx-llm train`` does, status 0), else interrupted (status 130); the
    message names what was kept and the command that continues the sweep."""

    def __init__(self, message: str, signal_name: str, clean: bool):
        super().__init__(message)
        self.signal_name, self.clean = signal_name, clean


def prepare(out: Path, spec: SweepSpec, cache_dir=None, log=print):
    """The sweep's tokenizer (trained once, kept as ``<out>/tokenizer.json``) and its corpus encoded into the token
    cache, so every point (a local run or a Ray task) reads it from there."""
    data = open_data(out, spec.data)
    tok = data.tokenizer
    if not (out / tok_lib.TOKENIZER_FILE).is_file():
        tok.save(out)
    corpus = data.build(cache_dir)
    log(f"corpus: train {corpus.train.n_tokens:,} tokens, val {corpus.val.n_tokens:,} "
        f"({'cached' if corpus.cache_hit else f'encoded in {corpus.encode_seconds:.1f} s'}); vocabulary {tok.vocab_size}")
    return tok


@contextlib.contextmanager
def _opened(out: Path, spec: SweepSpec, say):
    """The sweep's directory for this spec: an existing sweep of it, or a new one (``sweep.json`` written). A new
    sweep that fails or is interrupted before this block ends leaves nothing: the directory it created is removed
    (what it wrote in an empty one it was given)."""
    if check_spec(out, spec):
        say(f"continuing the sweep in {out}")
        yield
        return
    existed = out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out / SPEC_FILE, spec.to_dict())
        yield
    except BaseException:
        for child in ([out] if not existed else list(out.iterdir())):
            shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink(missing_ok=True)
        raise


def run_sweep(spec: SweepSpec, out_dir, *, runner: str = "local", progress: bool = True, cache_dir=None,
              ray_options: dict | None = None, log: Callable[[str], Any] | None = None,
              continue_with: str | None = None):
    """Train every point of ``spec`` not yet in ``out_dir`` (module docstring) and return the whole table: one row
    per point in grid order (``COLUMNS``: name, budget, N, N_total, D, C, seed, loss (final val loss, nats per
    token), val_bpb, wall_seconds, the run directory, …), as a pandas DataFrame when pandas is installed, else a
    list of dicts. ``runner``: "local" (one run after another in this process) or "ray" (one Ray task per point,
    on the cluster this process is connected to, or a local one started and stopped here; ``ray_options`` are the
    tasks' resources, default ``{"num_cpus": 1}``). ``progress``: one line per point (``log``, default print).
    ``continue_with``: the command that continues the sweep, named when it stops (default: run_sweep again).
    Points that fail are reported in one line each and raise ``SweepError`` once the others are written; a stop
    raises ``SweepStopped``, a full disk ``CheckpointWriteError``."""
    if not isinstance(spec, SweepSpec):
        raise ConfigError(f"run_sweep needs a SweepSpec; got {type(spec).__name__}")
    if runner not in RUNNERS:
        raise ConfigError(f"runner = {runner!r} is invalid: valid runners are {list(RUNNERS)}")
    ray = import_ray() if runner == "ray" else None
    out = Path(out_dir)
    say = (log or print) if progress else _quiet
    hint = continue_with or f"run_sweep with the same spec on {out}"
    with _stopping(out, hint) as stops:
        with _opened(out, spec, say):
            tok = prepare(out, spec, cache_dir, say)
            grid = points(spec, tok.vocab_size)
        table_path = out / TABLE_FILE
        rows = load_table(table_path, say)
        done = {r["name"]: r for r in rows}
        todo = [j for j, p in enumerate(grid) if p.name not in done]
        for j, p in enumerate(grid):
            if p.name in done:
                say(f"[{j + 1}/{len(grid)}] {p.name}: in {TABLE_FILE}, skipped")
        if runner == "local":
            results = _local_results(grid, todo, out, spec.data, cache_dir, stops)
        else:
            results = _ray_results(ray, grid, todo, out, spec.data, cache_dir, ray_options or {"num_cpus": 1}, stops)
        failed = []
        with contextlib.closing(results):
            for j, row in results:
                if isinstance(row, BaseException):
                    if isinstance(row, TrainingStopped) or _disk_full(row):
                        stops.point = grid[j]
                        raise row
                    failed.append(grid[j].name)
                    say(f"[{j + 1}/{len(grid)}] {grid[j].name}: failed: {_one_line(row)}")
                    continue
                rows.append(row)
                write_table(table_path, rows)
                done[row["name"]] = row
                say(f"[{j + 1}/{len(grid)}] {row['name']}: N = {row['N_total']:,}, D = {row['D']:,}, "
                    f"{row['steps']} steps, loss {row['loss']:.4f}, {row['wall_seconds']:.1f} s")
        if stops.received and len(done) < len(grid):  # it came as a point finished: the sweep stops here
            raise SweepStopped(f"stopped by {stops.received} as point {stops.point.name} finished (its row is in "
                               f"{table_path}); {len(grid) - len(done)} points are left; continue with `{hint}`",
                               stops.received, clean=True)
    if failed:
        raise SweepError(f"{len(failed)} of {len(todo)} points failed ({', '.join(failed)}); the other rows are in "
                         f"{table_path}, and run_sweep on the same directory retries only these")
    return as_table([done[p.name] for p in grid])


def _local_results(grid: list[Point], todo: list[int], out: Path, data: DataSpec, cache_dir,
                   stops: _Stops) -> Iterator[tuple[int, dict | BaseException]]:
    """The points of ``todo`` trained one after another here, until a stop signal was noted."""
    for j in todo:
        if stops.received:
            return
        stops.point = grid[j]
        yield j, _attempt(train_point, out, grid[j], data, cache_dir)


def _attempt(fn, *args):
    """``fn(*args)``, or the error it raised (a failed point is reported and the sweep goes on, unless it stopped:
    a signal, a full disk)."""
    try:
        return fn(*args)
    except (MLXLLMError, OSError, FloatingPointError, ValueError) as exc:
        return exc


def _disk_full(exc: BaseException) -> bool:
    return disk_full(exc) or "no space left on device" in str(exc).lower()


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


# ----- how a sweep stops -----------------------------------------------------------------------------------------
class _Stops:
    """SIGTERM and SIGINT while a sweep runs (installed from the main thread only; the previous handlers are
    restored). Outside a point's training loop a signal interrupts at once (KeyboardInterrupt); inside it the loop's
    own handler stops the point at a step boundary and notes the signal here too (``stop_noticed``), so a point
    that finished anyway (the signal came during its last step) is the last one the sweep starts. ``point`` is the
    point being trained."""

    def __init__(self):
        self.received: str | None = None
        self.point: Point | None = None
        self._previous: dict = {}

    def __enter__(self) -> "_Stops":
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self) for sig in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __call__(self, signum, frame) -> None:
        self.stop_noticed(signal.Signals(signum).name)
        raise KeyboardInterrupt

    def stop_noticed(self, name: str) -> None:
        self.received = self.received or name

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


@contextlib.contextmanager
def _stopping(out: Path, hint: str):
    """A sweep under ``_Stops``: a point's ``TrainingStopped`` and a KeyboardInterrupt become ``SweepStopped``, a
    full disk one ``CheckpointWriteError`` line, each naming the point and the command that continues."""
    with _Stops() as stops:
        try:
            yield stops
        except TrainingStopped as stop:
            point = stops.point
            kept = f"its checkpoint {stop.step} is kept" if stop.step else "it had no checkpoint yet"
            raise SweepStopped(f"stopped by {stop.signal_name} at step {stop.step} of {point.tcfg.steps} of point "
                               f"{point.name}; {kept}, and the finished points' rows are in {out / TABLE_FILE}; "
                               f"continue with `{hint}`", stop.signal_name, clean=True) from None
        except KeyboardInterrupt:
            point = stops.point
            if point is None:
                kept = "before any point trained (a new sweep's directory is removed)"
            else:
                kept = (f"while point {point.name} was prepared or trained; every point's last checkpoint is kept, "
                        f"and the finished points' rows are in {out / TABLE_FILE}")
            raise SweepStopped(f"interrupted {kept}; continue with `{hint}`", stops.received or "SIGINT",
                               clean=False) from None
        except (MLXLLMError, OSError) as exc:
            if not _disk_full(exc):
                raise
            raise CheckpointWriteError(_disk_full_message(out, stops.point, hint)) from None


def _disk_full_message(out: Path, point: Point | None, hint: str) -> str:
    free = shutil.disk_usage(out).free if out.exists() else 0
    if point is None:
        what = f"no space left on device writing the sweep in {out}"
    else:
        steps = Checkpoints.steps_in(out / "runs" / point.name)
        kept = f"its checkpoint {steps[-1]} is intact" if steps else "it had no checkpoint, so none was kept"
        what = f"no space left on device while point {point.name} trained ({kept})"
    return (f"{what}; {free / 1e6:,.1f} MB are free there; the sweep stopped, and the finished points' rows are in "
            f"{out / TABLE_FILE}; free some space, then continue with `{hint}`")


# ----- Ray: one task a point ---------------------------------------------------------------------------------------
def import_ray():
    """Ray, imported only when asked for: it is an optional extra."""
    try:
        import ray
    except ImportError:
        raise ConfigError("runner 'ray' needs Ray, which is not installed: pip install 'mlx_llm[sweep]'") from None
    return ray


def _ray_results(ray, grid: list[Point], todo: list[int], out: Path, data: DataSpec, cache_dir,
                 options: dict, stops: _Stops) -> Iterator[tuple[int, dict | BaseException]]:
    """One task a point of ``todo`` on the cluster this process is connected to (else on a local one, shut down
    afterwards); yields (index, row or the task's error) in grid order, each as soon as it and the points before it
    have finished, so an interrupted driver keeps every finished prefix. Closed early (a stop), it cancels the
    tasks still in flight (Ray raises KeyboardInterrupt in a running one)."""
    started, pending = not ray.is_initialized(), []
    if started:
        ray.init()
    try:
        task = ray.remote(train_point).options(**options)
        cache = None if cache_dir is None else str(Path(cache_dir).resolve())
        refs = {task.remote(str(out.resolve()), grid[j], data, cache): j for j in todo}
        pending, finished = list(refs), {}
        for j in todo:
            stops.point = grid[j]
            while j not in finished:
                ready, pending = ray.wait(pending, num_returns=1)
                finished[refs[ready[0]]] = _ray_get(ray, ready[0])
            yield j, finished.pop(j)
    finally:
        for ref in pending:
            with contextlib.suppress(Exception):
                ray.cancel(ref)
        if started:
            ray.shutdown()


def _ray_get(ray, ref) -> dict | BaseException:
    """A task's row, or the exception it raised (unwrapped from Ray's ``RayTaskError``)."""
    try:
        return ray.get(ref)
    except Exception as exc:  # the task's own error, a dead worker, a cancelled task: reported, not raised
        cause = getattr(exc, "cause", None)
        return cause if isinstance(cause, BaseException) else exc
