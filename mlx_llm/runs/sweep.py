"""A scaling sweep as a library call: ``SweepSpec`` (the grid) and ``run_sweep(spec, out_dir)`` (the runs, and the
table of what they measured).

A spec is a base model and a ladder of sizes (``sizes``: ModelConfig fields each size overrides), the compute
budgets (``budgets`` in exact training FLOPs, or ``tokens_per_param`` ratios), which sizes each budget trains
(``windows``, default all), the batch per budget, the peak learning rate per size (``lrs``, default the recipe's),
the seeds, the training recipe (a ``TrainConfig``) and the data (a ``DataSpec``). Every point is an ordinary
pretraining run, trained by the one driver (``runs.pretrain.train_run``) into ``<out>/runs/<name>``, so
``mlx-llm eval``, ``compare`` and ``export`` read it like any other run. Its steps are the library's sizing
(``accounting.steps_for_flops`` / ``steps_for_tokens_per_param``), so a point means the same on every machine;
its warmup is min(recipe's warmup, max(2, steps // 10), steps); it evaluates and checkpoints at its end (and every
``checkpoint_interval`` steps when the recipe's is shorter).

``run_sweep`` writes ``<out>/sweep.json`` (the spec), ``<out>/tokenizer.json`` (a BPE trained once on the train
split, shared by every point through the token cache) and ``<out>/sweep.csv`` (one row per finished point, in the
order they finish). Run again on the same directory it trains only what is missing: a point with a row is skipped,
a point whose run finished but whose row was not written (a kill in between) gets its row from the run's
summary.json, and a half-trained point resumes from its last checkpoint (from its start when it had none). A
different spec is refused, naming the fields that differ. ``runner="ray"`` trains the points as Ray tasks (the
``sweep`` extra), each with the same function as the local runner (``train_point``).
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import json
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from mlx_llm.config import PARAM_COUNTS, ModelConfig, TrainConfig
from mlx_llm.data import tokenizer as tok_lib
from mlx_llm.data.corpora import open_data
from mlx_llm.errors import ConfigError, DataError, MLXLLMError
from mlx_llm.runs.configs import DataSpec
from mlx_llm.runs.pretrain import train_run
from mlx_llm.runs.record import CONFIG_FILE
from mlx_llm.scaling.accounting import steps_for_flops, steps_for_tokens_per_param, train_flops_per_token
from mlx_llm.settings import write_json_atomic
from mlx_llm.train.metrics import SUMMARY_FILE

SPEC_FILE, TABLE_FILE = "sweep.json", "sweep.csv"
RUNNERS = ("local", "ray")
COLUMNS = ("name", "budget", "budget_unit", "budget_index", "size_index", "seed", "d_model", "n_layers", "n_heads",
           "d_ff", "N", "N_total", "D", "C", "steps", "batch_size", "seq_len", "lr", "warmup_steps", "loss", "val_bpb",
           "val_ppl", "wall_seconds", "tokens_per_second", "run")
TIMING = ("wall_seconds", "tokens_per_second")  # the columns that differ between two sweeps of one spec
_INTS = ("budget_index", "size_index", "seed", "d_model", "n_layers", "n_heads", "d_ff", "N", "N_total", "D", "steps",
         "batch_size", "seq_len", "warmup_steps")
_TEXT = ("name", "budget_unit", "run")


def _tuple(value) -> tuple:
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


@dataclasses.dataclass(frozen=True)
class SweepSpec:
    """The grid of a scaling sweep (see the module docstring): ``model`` (the base; its ``vocab_size`` becomes the
    tokenizer's), ``sizes`` (ModelConfig fields per size, smallest model first; empty: the base alone), exactly one
    of ``budgets`` (exact training FLOPs) and ``tokens_per_param`` (with ``param_count``), ``windows`` (per budget,
    the indices of the sizes it trains; None: all), ``batch_sizes`` (per budget; None: the recipe's), ``lrs`` (per
    size; None: the recipe's), ``seeds``, ``train`` (the recipe) and ``data``."""

    model: ModelConfig
    sizes: tuple[dict, ...] = ()
    budgets: tuple[float, ...] = ()
    tokens_per_param: tuple[float, ...] = ()
    param_count: str = "total"
    windows: tuple[tuple[int, ...], ...] | None = None
    batch_sizes: tuple[int, ...] | None = None
    lrs: tuple[float, ...] | None = None
    seeds: tuple[int, ...] = (0,)
    train: TrainConfig = TrainConfig()
    data: DataSpec = DataSpec()

    def __post_init__(self) -> None:
        fix = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        fix("sizes", tuple(dict(s) for s in self.sizes))
        for name in ("budgets", "tokens_per_param", "seeds"):
            fix(name, _tuple(getattr(self, name)))
        for name in ("batch_sizes", "lrs"):
            if getattr(self, name) is not None:
                fix(name, _tuple(getattr(self, name)))
        if self.windows is not None:
            fix("windows", tuple(_tuple(w) for w in self.windows))
        for name, cls in (("model", ModelConfig), ("train", TrainConfig), ("data", DataSpec)):
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"SweepSpec.{name} must be a {cls.__name__}; got {type(getattr(self, name)).__name__}")
        if bool(self.budgets) == bool(self.tokens_per_param):
            raise ConfigError("SweepSpec: give exactly one of budgets (training FLOPs) and tokens_per_param; got "
                              f"budgets = {list(self.budgets)}, tokens_per_param = {list(self.tokens_per_param)}")
        for name in ("budgets", "tokens_per_param"):
            bad = [v for v in getattr(self, name) if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0]
            if bad:
                raise ConfigError(f"SweepSpec.{name} = {list(getattr(self, name))} is invalid: each must be a number > 0")
        if self.param_count not in PARAM_COUNTS:
            raise ConfigError(f"SweepSpec.param_count = {self.param_count!r} is invalid: valid counts are "
                              f"{list(PARAM_COUNTS)}")
        n_budgets, n_sizes = len(self.budget_values), max(1, len(self.sizes))
        for name, length, what in (("windows", n_budgets, "budget"), ("batch_sizes", n_budgets, "budget"),
                                   ("lrs", n_sizes, "size")):
            value = getattr(self, name)
            if value is not None and len(value) != length:
                raise ConfigError(f"SweepSpec.{name} has {len(value)} entries: give one per {what} ({length})")
        for k, window in enumerate(self.windows or ()):
            bad = [i for i in window if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n_sizes]
            if bad or not window or len(set(window)) != len(window):
                raise ConfigError(f"SweepSpec.windows[{k}] = {list(window)} is invalid: distinct size indices in "
                                  f"[0, {n_sizes})")
        for name, minimum in (("batch_sizes", 1), ("seeds", 0)):
            bad = [v for v in getattr(self, name) or () if isinstance(v, bool) or not isinstance(v, int) or v < minimum]
            if bad:
                raise ConfigError(f"SweepSpec.{name} = {list(getattr(self, name))} is invalid: integers >= {minimum}")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ConfigError(f"SweepSpec.seeds = {list(self.seeds)} is invalid: give distinct seeds")
        if self.lrs is not None and not all(isinstance(v, (int, float)) and v > 0 for v in self.lrs):
            raise ConfigError(f"SweepSpec.lrs = {list(self.lrs)} is invalid: each must be a number > 0")
        for i in range(n_sizes):
            self.size_config(i)  # every size is a valid model (ModelConfig's own message names the field)

    @property
    def budget_values(self) -> tuple[float, ...]:
        return self.budgets or self.tokens_per_param

    @property
    def budget_unit(self) -> str:
        return "flops" if self.budgets else "tokens_per_param"

    def size_config(self, i: int, vocab_size: int | None = None) -> ModelConfig:
        """The model of size ``i`` (the base with its overrides), with ``vocab_size`` when given."""
        fields = dict(self.sizes[i]) if self.sizes else {}
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(ModelConfig)})
        if unknown:
            raise ConfigError(f"SweepSpec.sizes[{i}] sets unknown ModelConfig field(s) {unknown}")
        if vocab_size is not None:
            fields |= {"vocab_size": vocab_size, "vocab_used": None}
        return dataclasses.replace(self.model, **fields)

    def to_dict(self) -> dict:
        """The spec as JSON: what ``sweep.json`` holds and what a rerun is compared with."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out |= {"model": self.model.to_dict(), "train": self.train.to_dict(), "data": self.data.to_dict()}
        return json.loads(json.dumps(out))

    @classmethod
    def from_dict(cls, data: dict) -> "SweepSpec":
        return cls(**{**data, "model": ModelConfig.from_dict(data["model"]), "train": TrainConfig.from_dict(
            data["train"]), "data": DataSpec.from_dict(data["data"])})


@dataclasses.dataclass(frozen=True)
class Point:
    """One run of a sweep: its name (the run directory's), budget (and its index), size index, seed, and the
    model and train configs it trains with."""

    name: str
    budget_index: int
    budget: float
    budget_unit: str
    size_index: int
    seed: int
    cfg: ModelConfig
    tcfg: TrainConfig


def _size_labels(spec: SweepSpec, vocab_size: int) -> list[str]:
    """d{d_model}-L{n_layers} per size, prefixed by the size's index when two sizes share it."""
    cfgs = [spec.size_config(i, vocab_size) for i in range(max(1, len(spec.sizes)))]
    labels = [f"d{c.d_model}-L{c.n_layers}" for c in cfgs]
    return labels if len(set(labels)) == len(labels) else [f"n{i}-{lab}" for i, lab in enumerate(labels)]


def points(spec: SweepSpec, vocab_size: int) -> list[Point]:
    """Every run of the sweep, budget by budget (sizes in window order, then seeds), with its steps from the
    library's sizing (module docstring)."""
    out = []
    labels = _size_labels(spec, vocab_size)
    prefix = "C" if spec.budgets else "R"
    rec = spec.train
    for k, budget in enumerate(spec.budget_values):
        batch = spec.batch_sizes[k] if spec.batch_sizes else rec.batch_size
        for i in (spec.windows[k] if spec.windows else range(len(labels))):
            cfg = spec.size_config(i, vocab_size)
            if spec.budgets:
                steps = steps_for_flops(cfg, rec.seq_len, batch, budget)
            else:
                steps = steps_for_tokens_per_param(cfg, rec.seq_len, batch, budget, spec.param_count)
            for seed in spec.seeds:
                tcfg = dataclasses.replace(
                    rec, batch_size=batch, steps=steps, seed=seed, lr=spec.lrs[i] if spec.lrs else rec.lr,
                    warmup_steps=min(rec.warmup_steps, max(2, steps // 10), steps), eval_interval=steps,
                    checkpoint_interval=min(rec.checkpoint_interval, steps), log_interval=min(rec.log_interval, steps))
                out.append(Point(f"{prefix}{k}-{labels[i]}-s{seed}", k, float(budget), spec.budget_unit, i, seed, cfg,
                                 tcfg))
    return out


def training_compute(cfg: ModelConfig, tcfg: TrainConfig) -> float:
    """C of a run: exact training FLOPs, ``train_flops_per_token`` × the D tokens it reads."""
    return train_flops_per_token(cfg, tcfg.seq_len) * tcfg.steps * tcfg.batch_size * tcfg.seq_len


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


def train_point(out, point: Point, data: DataSpec, cache_dir=None) -> dict:
    """Train one point into ``<out>/runs/<name>`` (resuming a half-trained run; a finished one is only read) and
    return its table row. The same function runs locally and as a Ray task (maybe on another machine: ``out``
    and ``cache_dir`` must then be on a filesystem both share)."""
    out = Path(out)
    if not (out / tok_lib.TOKENIZER_FILE).is_file():
        raise DataError(f"{str(out / tok_lib.TOKENIZER_FILE)!r} does not exist here: the sweep's directory must be "
                        f"on a filesystem the driver and this worker share")
    run_dir = out / "runs" / point.name
    summary_path = run_dir / SUMMARY_FILE
    if summary_path.is_file():  # finished, but its row was not written
        summary = json.loads(summary_path.read_text())
        return _row(point, summary, run_dir, float(summary.get("wall_seconds", 0.0)))
    if run_dir.is_dir() and not (run_dir / CONFIG_FILE).is_file():  # killed while its first files were written
        shutil.rmtree(run_dir)
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):  # the loop's evaluation lines: the sweep prints one per point
        summary = train_run(run_dir, point.cfg, point.tcfg, point_data(out, data),
                            resume=(run_dir / CONFIG_FILE).is_file(), show_progress=False, cache_dir=cache_dir,
                            sample_tokens=0, log=_quiet)  # no closing sample: a sweep compares losses
    return _row(point, summary, run_dir, time.perf_counter() - t0)


# ----- the table on disk ---------------------------------------------------------------------------------------
def _typed(row: dict) -> dict:
    out = {}
    for k, v in row.items():
        if k in _TEXT:
            out[k] = v
        elif v in ("", "None", None):
            out[k] = None
        else:
            out[k] = int(float(v)) if k in _INTS else float(v)
    return out


def read_table(path) -> list[dict]:
    """The rows of a sweep's CSV, typed (ints, floats, strings)."""
    path = Path(path)
    if not path.is_file():
        return []
    with path.open(newline="") as fh:
        return [_typed(r) for r in csv.DictReader(fh)]


def _append(path: Path, row: dict) -> None:
    new = not path.is_file()
    with path.open("a", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS)
        if new:
            writer.writeheader()
        writer.writerow({k: repr(v) if isinstance(v, float) else v for k, v in row.items()})
        fh.flush()


def as_table(rows: list[dict]):
    """A pandas DataFrame of the rows when pandas is installed, else the list itself."""
    try:
        import pandas
    except ImportError:
        return rows
    return pandas.DataFrame(rows, columns=list(COLUMNS))


# ----- the spec on disk ------------------------------------------------------------------------------------------
def _differences(asked, saved, prefix: str = "") -> list[str]:
    if isinstance(asked, dict) and isinstance(saved, dict):
        return [d for k in sorted(set(asked) | set(saved)) for d in _differences(asked.get(k), saved.get(k),
                                                                                 f"{prefix}{k}.")]
    return [] if asked == saved else [prefix.rstrip(".")]


def check_spec(out: Path, spec: SweepSpec) -> bool:
    """Whether ``out`` already holds this sweep (True), or is new (False); a sweep of another spec is refused,
    naming the fields that differ."""
    path = out / SPEC_FILE
    if not path.is_file():
        if out.is_dir() and any(out.iterdir()):
            raise ConfigError(f"{str(out)!r} is not empty and holds no {SPEC_FILE}: give run_sweep a new directory "
                              f"or one it swept before")
        return False
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path} cannot be read ({exc}): it is not a sweep's spec") from None
    diff = _differences(spec.to_dict(), saved)
    if diff:
        raise ConfigError(f"{str(out)!r} holds a sweep of another spec: {', '.join(diff)} differ(s) from its "
                          f"{SPEC_FILE}; run the same spec to continue it, or give another directory")
    return True


# ----- the sweep -------------------------------------------------------------------------------------------------
class SweepError(MLXLLMError):
    """Points of a sweep failed; the rows of the others are written."""


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


def run_sweep(spec: SweepSpec, out_dir, *, runner: str = "local", progress: bool = True, cache_dir=None,
              ray_options: dict | None = None, log: Callable[[str], Any] | None = None):
    """Train every point of ``spec`` not yet in ``out_dir`` (module docstring) and return the whole table: one row
    per point in grid order (``COLUMNS``: name, budget, N, N_total, D, C, seed, loss (final val loss, nats per
    token), val_bpb, wall_seconds, the run directory, …), as a pandas DataFrame when pandas is installed, else a
    list of dicts. ``runner``: "local" (one run after another in this process) or "ray" (one Ray task per point,
    on the cluster this process is connected to, or a local one started and stopped here; ``ray_options`` are the
    tasks' resources, default ``{"num_cpus": 1}``). ``progress``: one line per point (``log``, default print).
    Points that fail are reported in one line each and raise ``SweepError`` once the others are written."""
    if runner not in RUNNERS:
        raise ConfigError(f"runner = {runner!r} is invalid: valid runners are {list(RUNNERS)}")
    ray = import_ray() if runner == "ray" else None
    out = Path(out_dir)
    say = (log or print) if progress else _quiet
    if check_spec(out, spec):
        say(f"continuing the sweep in {out}")
    else:
        out.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out / SPEC_FILE, spec.to_dict())
    tok = prepare(out, spec, cache_dir, say)
    grid = points(spec, tok.vocab_size)
    table_path = out / TABLE_FILE
    done = {r["name"]: r for r in read_table(table_path)}
    todo = [j for j, p in enumerate(grid) if p.name not in done]
    for j, p in enumerate(grid):
        if p.name in done:
            say(f"[{j + 1}/{len(grid)}] {p.name}: in {TABLE_FILE}, skipped")
    if runner == "local":
        results = ((j, _attempt(train_point, out, grid[j], spec.data, cache_dir)) for j in todo)
    else:
        results = _ray_results(ray, grid, todo, out, spec.data, cache_dir, ray_options or {"num_cpus": 1})
    failed = []
    for j, row in results:
        if isinstance(row, BaseException):
            failed.append(grid[j].name)
            say(f"[{j + 1}/{len(grid)}] {grid[j].name}: failed: {_one_line(row)}")
            continue
        _append(table_path, row)
        done[row["name"]] = row
        say(f"[{j + 1}/{len(grid)}] {row['name']}: N = {row['N_total']:,}, D = {row['D']:,}, {row['steps']} steps, "
            f"loss {row['loss']:.4f}, {row['wall_seconds']:.1f} s")
    if failed:
        raise SweepError(f"{len(failed)} of {len(todo)} points failed ({', '.join(failed)}); the other rows are in "
                         f"{table_path}, and run_sweep on the same directory retries only these")
    return as_table([done[p.name] for p in grid])


def _attempt(fn, *args):
    """``fn(*args)``, or the error it raised (a failed point is reported and the sweep goes on)."""
    try:
        return fn(*args)
    except (MLXLLMError, OSError, FloatingPointError, ValueError) as exc:
        return exc


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


# ----- Ray: one task a point ---------------------------------------------------------------------------------------
def import_ray():
    """Ray, imported only when asked for: it is an optional extra."""
    try:
        import ray
    except ImportError:
        raise ConfigError("runner 'ray' needs Ray, which is not installed: pip install 'mlx_llm[sweep]'") from None
    return ray


def _ray_results(ray, grid: list[Point], todo: list[int], out: Path, data: DataSpec, cache_dir,
                 options: dict) -> Iterator[tuple[int, dict | BaseException]]:
    """One task a point of ``todo`` on the cluster this process is connected to (else on a local one, shut down
    afterwards); yields (index, row or the task's error) in grid order, each as soon as it and the points before it
    have finished, so an interrupted driver keeps every finished prefix."""
    started = not ray.is_initialized()
    if started:
        ray.init()
    try:
        task = ray.remote(train_point).options(**options)
        cache = None if cache_dir is None else str(Path(cache_dir).resolve())
        refs = {task.remote(str(out.resolve()), grid[j], data, cache): j for j in todo}
        pending, finished = list(refs), {}
        for j in todo:
            while j not in finished:
                ready, pending = ray.wait(pending, num_returns=1)
                finished[refs[ready[0]]] = _ray_get(ray, ready[0])
            yield j, finished.pop(j)
    finally:
        if started:
            ray.shutdown()


def _ray_get(ray, ref) -> dict | BaseException:
    """A task's row, or the exception it raised (unwrapped from Ray's ``RayTaskError``)."""
    try:
        return ray.get(ref)
    except Exception as exc:  # the task's own error, a dead worker, a cancelled task: reported, not raised
        cause = getattr(exc, "cause", None)
        return cause if isinstance(cause, BaseException) else exc
