"""A CPU scaling-law sweep (U19 §8): train an IsoFLOP grid of small MiniLLMs, then fit L(N, D) both ways.

The grid (Hoffmann et al. 2022, Approach 2's design): a ladder of model sizes and n compute budgets
C_k = C_1·30^{k/(n−1)} spanning 30× (the default: four, 3.3e10 to 9.9e11 FLOPs). Each budget trains five
consecutive sizes of the ladder, the window shifting towards larger models as the budget grows (the
compute-optimal N grows with C); every run takes the whole number of steps whose training FLOPs are nearest
C_k (``accounting.steps_for_flops``), so the runs of a budget share its compute. The batch grows with the budget
(4, 8, 8, 16 sequences of 128 tokens): with one fixed batch the smallest budget's larger models got fewer than
100 updates and lost to the smallest model whatever its size, so that budget showed no valley (a 16-sequence
pilot at 3.5e10 FLOPs counted as 6·N_total·D: losses rising monotonically with N).

- C is the exact training compute a run spends: C = F·D, F = ``train_flops_per_token(cfg, T)`` =
  6·N_mm + 12·L·T·h·d_h (the weights a token multiplies, unembedding included and the embedding gather not, plus
  the full T×T attention scores and mixes), the library's count of what a step computes. It is the same function
  as ``mlx-llm train --target-flops``, so a point is one definition of compute on every machine. Until this
  changed the sweep used C = 6·N_total·D (Hoffmann et al.'s convention, embeddings included); at this scale the
  tables are a large share of every model and F/(6·N_total) is 0.79–1.03 across the default grid (0.69–0.75 in
  ``--quick``) and differs between neighbouring sizes (d16-L1 0.79, d16-L2 1.00), so 6·N_total·D overstated
  some runs' compute by up to 27% (quick: 33–45%) and understated others' by 2.5%, tilting each IsoFLOP curve.
- The budgets are stated in that unit: the old default C_1 = 3.5e10 (6·N_total·D) is 3.34e10 exact FLOPs at the
  geometric mean of F/(6·N_total) over the 20 runs (0.953), rounded to 3.3e10: 17 989 steps in all instead of
  18 072, the runs of the smallest F/(6·N_total) taking up to 19% more steps and the others up to 8% fewer.
  ``--quick``: 6e8 → 4.2e8 (mean ratio 0.705), 3 408 steps instead of 3 411.
- N is the whole parameter count N_total (embeddings included) in both fits, the variable of the law; D counts
  every token position a training step processes: steps × batch × seq_len. The CSV lists the non-embedding
  count as ``N``, the whole one as ``N_total``, and C as defined above. Approach 2 groups the runs by their
  ``budget`` column (each in its own), not by 6·N·D, which lies up to 0.1 decade from C here; its D_opt are the
  tokens the optimal size reads at C. The plots put runs at their exact C and map the laws' 6·N·D (Approach 3's
  frontier, IsoFLOP lines) onto it with the runs' F/(6·N_total), interpolated in log N.
- The vocabulary is a 512-token BPE: the compute-optimal models of these budgets hold ~20k–100k parameters
  (20 tokens per parameter, U19 §8), and with 2048 tokens even a d = 16 model would hold 65k in its tables.
- Learning rate (documented rule): peak η = 4e-3·(64/d_model)^½ — wider models take smaller steps, as in the
  μP-style width scaling of Yang et al. 2022 softened to a square root — with a linear warmup over
  min(100, max(2, steps/10)) steps, then cosine to 10% (``TrainConfig`` defaults for the rest: AdamW
  β = (0.9, 0.95), weight decay 0.1, clipping at 1.0).
- Data: the default corpus (the Python standard library), one BPE vocabulary trained once on its train split,
  saved as ``<out>/tokenizer.json`` and shared by every run through the token cache.
- The loss is the final validation loss (nats/token) on a fixed slice of the val split (the same windows for
  every run), with its bits per byte.

Each point trains in ``<out>/runs/<name>`` with ``train_loop`` and appends one row to ``<out>/sweep.csv``;
rerunning the command skips points whose row exists and resumes a half-finished one, so an interrupted sweep
continues where it stopped. Then ``fit.json`` (Approach 3 with bootstrap intervals, Approach 2, and the
provenance of the fit) and three plots are written; experiments/results/ holds a copy of one full sweep's outputs
(run before the exact accounting: its C is 6·N_total·D and its budgets start at 3.5e10).

With ``--ray`` the points run as Ray tasks (one run each, ``--ray-cpus-per-task``, ``--ray-gpus-per-task``),
on the cluster at ADDRESS or on a local one: the driver trains the tokenizer and fills the token cache, each
task re-reads both and trains its point with the same function as the sequential path, and the driver writes
the rows in grid order (a failed point is reported in one line; the others' rows are kept). On a cluster of
several machines ``--out`` and ``--cache-dir`` must be on a filesystem they share, and the repository importable
(the driver's working directory is on the workers' path). Ray is the ``sweep`` extra: pip install 'mlx_llm[sweep]'.

    python -m experiments.scaling_sweep                 # the full sweep: 19 min on 2 shared CPU cores
    python -m experiments.scaling_sweep --quick         # CI: tiny models, few steps; compile-bound, ~1.5 min
                                                        # with XLA_FLAGS=--xla_backend_optimization_level=0
    python -m experiments.scaling_sweep --ray           # the same points as tasks of a local Ray cluster
    python -m experiments.scaling_sweep --ray auto --ray-gpus-per-task 1   # on a running cluster, a GPU a run
    python -m experiments.scaling_sweep --fit-only --out runs/sweep-full   # refit and replot a finished sweep
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Iterator

import numpy as np

from experiments import common
from mlx_llm.data import text as text_lib
from mlx_llm.data import encoding as encoding_lib
from mlx_llm.data import tokenizer as tok_lib
from mlx_llm.runs.record import CONFIG_FILE, RunRecord, write_run
from mlx_llm.config import ModelConfig, TrainConfig
from mlx_llm.errors import ConfigError, DataError, MLXLLMError
from mlx_llm.runs.configs import DataSpec
from mlx_llm.scaling.accounting import steps_for_flops, train_flops_per_token
from mlx_llm.runs.resume import open_resume
from mlx_llm.train.lm import train_loop

COLUMNS = ("name", "budget", "d_model", "n_layers", "n_heads", "d_ff", "N", "N_total", "D", "C", "steps",
           "batch_size", "seq_len", "lr", "warmup_steps", "loss", "val_bpb", "val_ppl", "wall_seconds",
           "tokens_per_second")


@dataclasses.dataclass(frozen=True)
class Setting:
    """Everything that defines a sweep besides its output directory."""

    ladder: tuple[tuple[int, int], ...]  # (d_model, n_layers), by increasing N
    windows: tuple[tuple[int, ...], ...]  # ladder indices trained at each budget
    base_budget: float  # C_1, exact training FLOPs (train_flops_per_token × D)
    batch_sizes: tuple[int, ...]  # sequences per step at each budget
    seq_len: int
    vocab_size: int
    eval_tokens: int
    data_path: str | None  # None: the standard library
    bootstrap: int
    coarse_fit: bool = False  # Approach 3 from 108 starts (one polished) instead of Hoffmann's 4 500 (CI speed)
    # What the budgets count: a grid field, so a directory swept when C was 6·N_total·D (no such field) is refused.
    flops: str = "train_flops_per_token"

    def budgets(self) -> list[float]:
        return [self.base_budget * 30.0 ** (k / (len(self.windows) - 1)) for k in range(len(self.windows))]


FULL = Setting(ladder=((8, 1), (16, 1), (16, 2), (24, 2), (32, 2), (48, 2), (64, 2), (80, 3)),
               windows=((0, 1, 2, 3, 4), (0, 1, 2, 3, 4), (2, 3, 4, 5, 6), (3, 4, 5, 6, 7)), base_budget=3.3e10,
               batch_sizes=(4, 8, 8, 16), seq_len=128, vocab_size=512, eval_tokens=65536, data_path=None, bootstrap=200)
# CI: five one-layer models on a small slice of the stdlib (its json package), 10 to ~880 steps each; the
# bootstrap has as many replicates as the coarse grid has starts, so it reuses the fit's compiled program.
QUICK = Setting(ladder=((16, 1), (20, 1), (24, 1), (28, 1), (36, 1)), windows=((0, 1, 2, 3, 4),) * 3,
                base_budget=4.2e8, batch_sizes=(8, 8, 8), seq_len=32, vocab_size=320, eval_tokens=256,
                data_path=str(text_lib.stdlib_root() / "json"), bootstrap=108, coarse_fit=True)
COARSE_GRID = {"a": [0.0, 5.0, 10.0], "b": [0.0, 5.0, 10.0], "e": [-1.0, 0.0, 1.0], "alpha": [0.5, 1.0],
               "beta": [0.5, 1.0]}
GRID_FIELDS = ("ladder", "windows", "base_budget", "batch_sizes", "seq_len", "vocab_size", "eval_tokens", "data_path",
               "flops")


# ----- the grid ---------------------------------------------------------------------------------------------
def model_config(d_model: int, n_layers: int, vocab_size: int, seq_len: int) -> ModelConfig:
    """Heads of width 16 below d = 64, else 32 (full multi-head attention); SwiGLU width ≈ 8d/3 (M20 §2)."""
    d_head = 16 if d_model < 64 else 32
    n_heads = max(1, d_model // d_head)
    return ModelConfig(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                       n_kv_heads=n_heads, d_head=d_head, d_ff=(8 * d_model // 3 + 15) // 16 * 16,
                       max_seq_len=seq_len)


def peak_lr(d_model: int) -> float:
    """η = 4e-3·(64/d)^½ (module docstring)."""
    return 4e-3 * math.sqrt(64.0 / d_model)


def warmup(steps: int) -> int:
    return min(100, max(2, steps // 10), steps)


def grid(setting: Setting, vocab_size: int) -> list[dict]:
    """One dict per point: name, budget, model and train configs; the steps are ``steps_for_flops``'s (the whole
    steps whose exact training FLOPs are nearest C_k), the library's sizing, so a point means the same everywhere."""
    points = []
    for k, (budget, window, batch) in enumerate(zip(setting.budgets(), setting.windows, setting.batch_sizes)):
        for i in window:
            d, L = setting.ladder[i]
            cfg = model_config(d, L, vocab_size, setting.seq_len)
            steps = steps_for_flops(cfg, setting.seq_len, batch, budget)
            tcfg = TrainConfig(batch_size=batch, seq_len=setting.seq_len, steps=steps,
                               lr=peak_lr(d), warmup_steps=warmup(steps), eval_interval=steps,
                               eval_tokens=setting.eval_tokens, checkpoint_interval=steps, keep_checkpoints=1,
                               log_interval=min(50, steps))
            points.append({"name": f"C{k}-d{d}-L{L}", "budget": budget, "cfg": cfg, "tcfg": tcfg})
    return points


# ----- corpus and runs ----------------------------------------------------------------------------------------
def prepare_corpus(out: Path, spec: DataSpec, cache_dir, log=print):
    """Read the corpus; train the BPE once (kept as ``<out>/tokenizer.json``); encode through the token cache."""
    text = text_lib.read_corpus(spec.path, extensions=spec.extensions, val_percent=spec.val_percent)
    tok_file = out / tok_lib.TOKENIZER_FILE
    if tok_file.is_file():
        tok = tok_lib.load(tok_file)
    else:
        t0 = time.perf_counter()
        tok = tok_lib.train_bpe((d.text for d in text.train), spec.vocab_size)
        tok.save(out)
        log(f"BPE vocabulary of {tok.vocab_size} trained in {time.perf_counter() - t0:.1f} s")
    corpus = encoding_lib.encode_corpus(text, tok, cache_dir)
    log(f"corpus: {corpus.stats.describe()}; train {corpus.train.n_tokens:,} tokens, val "
        f"{corpus.val.n_tokens:,} ({'cached' if corpus.cache_hit else f'encoded in {corpus.encode_seconds:.1f} s'})")
    return tok, corpus


def check_setting(path: Path, setting: Setting) -> None:
    """Write the grid's defining fields, or, resuming, refuse a directory swept with another grid."""
    asked = json.loads(json.dumps({k: getattr(setting, k) for k in GRID_FIELDS}))
    if path.is_file():
        saved = {k: v for k, v in json.loads(path.read_text()).items() if k in GRID_FIELDS}
        if saved != asked:
            diff = {k: (asked[k], saved.get(k)) for k in GRID_FIELDS if asked[k] != saved.get(k)}
            raise ConfigError(f"{str(path.parent)!r} holds a sweep with another grid (field: (asked, saved) = "
                              f"{diff}); rerun with its own settings or choose another --out")
        return
    path.write_text(json.dumps(dataclasses.asdict(setting), indent=2) + "\n")


def read_rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


def append_row(path: Path, row: dict) -> None:
    new = not path.is_file()
    with path.open("a", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS)
        if new:
            writer.writeheader()
        writer.writerow(row)


def training_compute(cfg: ModelConfig, tcfg: TrainConfig) -> float:
    """C of a run, the CSV's ``C``: exact training FLOPs, ``train_flops_per_token`` × the D tokens it reads."""
    return train_flops_per_token(cfg, tcfg.seq_len) * tcfg.steps * tcfg.batch_size * tcfg.seq_len


def run_point(out: Path, point: dict, spec: DataSpec, tok, corpus, log=print) -> dict:
    """Train one point (resuming a half-finished run directory) and return its CSV row."""
    cfg, tcfg = point["cfg"], point["tcfg"]
    run_dir = out / "runs" / point["name"]
    resume = (run_dir / CONFIG_FILE).is_file()
    if not resume:
        write_run(run_dir, cfg, tcfg, RunRecord(kind="pretrain", data=spec))
        tok.save(run_dir)
    t0 = time.perf_counter()
    summary = train_loop(run_dir, cfg, tcfg, corpus, plan=open_resume(run_dir).plan if resume else None, show_progress=False, log=log)["summary"]
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    N, D = cfg.non_embedding_param_count(), tcfg.steps * tcfg.batch_size * tcfg.seq_len
    return {"name": point["name"], "budget": f"{point['budget']:.6g}", "d_model": cfg.d_model,
            "n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "d_ff": cfg.d_ff, "N": N, "N_total": cfg.param_count(),
            "D": D, "C": f"{training_compute(cfg, tcfg):.6g}", "steps": tcfg.steps, "batch_size": tcfg.batch_size,
            "seq_len": tcfg.seq_len, "lr": f"{tcfg.lr:.6g}", "warmup_steps": tcfg.warmup_steps,
            "loss": f"{summary['val_loss']:.6f}", "val_bpb": f"{summary['val_bpb']:.6f}",
            "val_ppl": f"{summary['val_ppl']:.4f}", "wall_seconds": f"{time.perf_counter() - t0:.2f}",
            "tokens_per_second": f"{summary['tokens_per_second'] or 0:.1f}"}


def _quiet(*args) -> None:
    """The log of a training run inside the sweep: the sweep prints one line per point instead."""


class SweepError(MLXLLMError):
    """Points of a Ray sweep failed; the rows of the others are written."""


def sweep(out: Path, setting: Setting, cache_dir=None, log=print, ray_resources: dict | None = None) -> Path:
    """Train every point not yet in ``<out>/sweep.csv``; returns the CSV path.

    Without ``ray_resources`` one after another in this process; with them (Ray task options such as
    ``{"num_cpus": 1, "num_gpus": 0}``, ``ray.init`` already called) as one Ray task a point. Either way this
    process prepares the tokenizer and token cache first and writes the rows, in grid order, as they come. A
    failed Ray point is logged in one line and the others go on; ``SweepError`` then names the failed points."""
    out.mkdir(parents=True, exist_ok=True)
    check_setting(out / "setting.json", setting)
    csv_path = out / "sweep.csv"
    done = {r["name"] for r in read_rows(csv_path)}
    spec = DataSpec(path=setting.data_path, tokenizer="bpe", vocab_size=setting.vocab_size)
    tok, corpus = prepare_corpus(out, spec, cache_dir, log)
    points = grid(setting, tok.vocab_size)
    todo = []
    for j, point in enumerate(points):
        if point["name"] in done:
            log(f"[{j + 1}/{len(points)}] {point['name']}: already in {csv_path.name}, skipped")
        else:
            todo.append(j)
    if ray_resources is None:
        results = ((j, run_point(out, points[j], spec, tok, corpus, log=_quiet)) for j in todo)
    else:
        results = ray_results(points, todo, out, spec, corpus.cache_path.parent, ray_resources)
    failed = []
    for j, row in results:
        if isinstance(row, BaseException):
            failed.append(points[j]["name"])
            log(f"[{j + 1}/{len(points)}] {points[j]['name']}: failed: {_one_line(row)}")
            continue
        append_row(csv_path, row)
        log(f"[{j + 1}/{len(points)}] {row['name']}: N = {row['N']}, D = {row['D']}, steps {row['steps']}, "
            f"loss {row['loss']}, {row['val_bpb']} bits/byte, {row['wall_seconds']} s")
    if failed:
        raise SweepError(f"{len(failed)} of {len(todo)} points failed ({', '.join(failed)}); the other rows are in "
                         f"{csv_path}, and rerunning the command retries only these")
    return csv_path


# ----- Ray: one task a point ----------------------------------------------------------------------------------
def import_ray():
    """Ray, imported only when asked for: it is an optional extra."""
    try:
        import ray
    except ImportError:
        raise ConfigError("--ray needs Ray, which is not installed: pip install 'mlx_llm[sweep]'") from None
    return ray


def train_task(out: str, point: dict, spec: DataSpec, cache_dir: str) -> dict:
    """One point as a self-contained Ray task (maybe on another machine): re-read the tokenizer and the token
    cache the driver prepared (from the shared ``out`` and ``cache_dir``), then train and score the point with
    ``run_point``, exactly as the sequential path does; returns its CSV row."""
    out = Path(out)
    if not (out / tok_lib.TOKENIZER_FILE).is_file():
        raise DataError(f"{str(out / tok_lib.TOKENIZER_FILE)!r} does not exist on this Ray worker: --out must be "
                        f"on a filesystem the driver and the workers share")
    tok, corpus = prepare_corpus(out, spec, cache_dir, log=_quiet)
    return run_point(out, point, spec, tok, corpus, log=_quiet)


def ray_results(points: list[dict], todo: list[int], out: Path, spec: DataSpec, cache_dir: Path,
                resources: dict) -> Iterator[tuple[int, dict | BaseException]]:
    """Submit one task a point of ``todo`` and yield (index, row or the task's error) in grid order, each as
    soon as it and the points before it have finished, so an interrupted driver keeps every finished prefix."""
    ray = import_ray()
    from experiments import scaling_sweep  # by module name, so workers import it even when this file is __main__

    task = ray.remote(scaling_sweep.train_task).options(**resources)
    refs = {task.remote(str(out.resolve()), points[j], spec, str(Path(cache_dir).resolve())): j for j in todo}
    pending, finished = list(refs), {}
    for j in todo:
        while j not in finished:
            ready, pending = ray.wait(pending, num_returns=1)
            finished[refs[ready[0]]] = _ray_get(ray, ready[0])
        yield j, finished.pop(j)


def _ray_get(ray, ref) -> dict | BaseException:
    """A task's row, or the exception it raised (unwrapped from Ray's ``RayTaskError``)."""
    try:
        return ray.get(ref)
    except Exception as exc:  # the task's own error, a dead worker, a cancelled task: reported, not raised
        cause = getattr(exc, "cause", None)
        return cause if isinstance(cause, BaseException) else exc


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


# ----- fits and plots -----------------------------------------------------------------------------------------
def load_sweep(csv_path: Path) -> dict:
    """The runs as arrays; ``N`` here is N_total, the count both fits use; ``C`` the CSV's (exact FLOPs)."""
    rows = read_rows(csv_path)
    out = {k: np.array([float(r[k]) for r in rows]) for k in ("N_total", "D", "C", "loss", "budget")}
    out["N"] = out.pop("N_total")
    out["name"] = [r["name"] for r in rows]
    return out


def fit_sweep(runs: dict, bootstrap: int, budgets, grid=None) -> dict:
    """Approach 3 (``fit_chinchilla``, with bootstrap) and Approach 2 (``isoflop_fit``) on the sweep's runs."""
    from mlx_llm.scaling.laws import fit_chinchilla, optimal_exponents

    fit = fit_chinchilla(runs["N"], runs["D"], runs["loss"], bootstrap=bootstrap, seed=0, grid=grid,
                         polish_top=3 if grid is None else 1)
    a, b = optimal_exponents(fit["params"])
    if bootstrap:
        alpha_s, beta_s = fit["samples"]["alpha"], fit["samples"]["beta"]
        samples = np.stack([beta_s / (alpha_s + beta_s), alpha_s / (alpha_s + beta_s)], axis=1)
    approach3 = {k: fit[k] for k in ("E", "A", "B", "alpha", "beta", "objective", "grad_max", "converged",
                                     "n_runs", "n_starts", "n_at_best")}
    approach3 |= {"N_opt_exponent": a, "D_opt_exponent": b, "bootstrap": bootstrap}
    if bootstrap:
        approach3["ci95"] = {k: list(v) for k, v in fit["ci"].items()}
        approach3["ci95"] |= {"N_opt_exponent": list(np.nanpercentile(samples[:, 0], [2.5, 97.5])),
                              "D_opt_exponent": list(np.nanpercentile(samples[:, 1], [2.5, 97.5]))}
    try:
        approach2 = isoflop_by_budget(runs, budgets)
    except MLXLLMError as exc:  # fewer than two budgets with a valley inside their sizes
        approach2 = {"N_opt_exponent": None, "D_opt_exponent": None, "error": str(exc)}
    notes = ("N = N_total (all parameters, embeddings included); C = exact training FLOPs = train_flops_per_token"
             " × D (Approach 3's frontier itself is in the law's C = 6ND); loss = final val loss (nats/token)")
    return {"approach3": approach3, "approach2": approach2, "params": fit["params"], "notes": notes}


def flops_ratio(runs: dict):
    """N ↦ F/(6N): the runs' exact FLOPs a token over 6·N_total (C/(6·N·D) of the CSV; 1 for a sweep of the old
    C = 6·N_total·D), interpolated in log N between the ladder's sizes and held beyond them. It maps the laws'
    C = 6ND (Approach 3's frontier, IsoFLOP lines) onto the runs' exact compute."""
    log_n, first = np.unique(np.log(runs["N"]), return_index=True)
    ratio = (runs["C"] / (6.0 * runs["N"] * runs["D"]))[first]
    return lambda N: np.interp(np.log(N), log_n, ratio)


def isoflop_by_budget(runs: dict, budgets) -> dict:
    """Approach 2 (``isoflop_fit``) with each run in its own budget's group: the fit groups by 6·N·D, 0.1 decade
    from the exact C for some of these models, so it is given D' = budget/(6N), which puts 6·N·D' on the budget;
    its parabola vertex N_opt(C) reads N and the loss only. D_opt are then the tokens the N_opt model reads at C,
    C/(6·N_opt·``flops_ratio``(N_opt)), and D_opt ∝ C^b is fitted to them (a + b = 1 only where F ∝ N)."""
    from mlx_llm.scaling.laws import isoflop_fit

    iso = isoflop_fit(runs["N"], runs["budget"] / (6.0 * runs["N"]), runs["loss"], budgets=budgets)
    d_opt = iso["C"] / (6.0 * iso["N_opt"] * flops_ratio(runs)(iso["N_opt"]))
    b, log_kd = np.polyfit(np.log(iso["C"]), np.log(d_opt), 1)
    return {"N_opt_exponent": iso["a"], "D_opt_exponent": float(b), "N_coef": iso["N_coef"],
            "D_coef": float(np.exp(log_kd)), "C": iso["C"].tolist(), "N_opt": iso["N_opt"].tolist(),
            "D_opt": d_opt.tolist(), "loss_opt": iso["loss_opt"].tolist(), "skipped_budgets": iso["skipped"]}


def write_outputs(out: Path, runs: dict, result: dict, budgets, dpi: int = 90) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mlx_llm.scaling.laws import chinchilla_loss, compute_optimal

    common.save_result("fit", {k: v for k, v in result.items() if k != "params"}, out)
    params, iso = result["params"], result["approach2"]
    paths = [out / "loss_vs_compute.png", out / "isoflop.png", out / "fitted_surface.png"]
    C_axis = np.geomspace(runs["C"].min() / 2, runs["C"].max() * 2, 100)
    ratio = flops_ratio(runs)
    colour = plt.cm.viridis((np.log(runs["N"]) - np.log(runs["N"]).min()) / max(np.ptp(np.log(runs["N"])), 1e-9))

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    ax.scatter(runs["C"], runs["loss"], c=colour, s=28, label="runs (colour: log N)")
    n_star, d_star = compute_optimal(C_axis, params)  # the law's C = 6ND, placed at the exact C of (N*, D*)
    ax.plot(C_axis * ratio(n_star), chinchilla_loss(n_star, d_star, params), "k-",
            label="Approach 3 frontier L(N*(C), D*(C))")
    if iso.get("C"):
        ax.plot(iso["C"], iso["loss_opt"], "r*", ms=12, label="Approach 2 parabola minima")
    ax.set(xscale="log", xlabel="training compute C (exact FLOPs: train_flops_per_token × D)",
           ylabel="val loss (nats/token)", title="loss vs compute")
    ax.legend(fontsize=8)
    _save(fig, paths[0], dpi)

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for j, budget in enumerate(budgets):
        pick = np.isclose(runs["budget"], budget, rtol=1e-5)  # the CSV's budget: 6 significant digits
        col = plt.cm.plasma(j / max(len(budgets), 2))
        ax.plot(runs["N"][pick], runs["loss"][pick], "o", color=col, label=f"C = {budget:.2g}")
        if pick.sum() >= 3:
            x = np.log(runs["N"][pick])
            coef = np.polyfit(x, runs["loss"][pick], 2)
            xs = np.linspace(x.min(), x.max(), 50)
            ax.plot(np.exp(xs), np.polyval(coef, xs), "-", color=col, lw=1)
    if iso.get("N_opt"):
        ax.plot(iso["N_opt"], iso["loss_opt"], "k*", ms=12, label="minima (Approach 2)")
    ax.set(xscale="log", xlabel="parameters N (embeddings included)", ylabel="val loss (nats/token)",
           title="IsoFLOP curves and parabola fits")
    ax.legend(fontsize=8)
    _save(fig, paths[1], dpi)

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    Ng, Dg = np.meshgrid(np.geomspace(runs["N"].min() / 2, runs["N"].max() * 2, 80),
                         np.geomspace(runs["D"].min() / 2, runs["D"].max() * 2, 80))
    cs = ax.contour(Ng, Dg, chinchilla_loss(Ng, Dg, params), levels=12, cmap="viridis", linewidths=0.8)
    ax.clabel(cs, fontsize=7, fmt="%.2f")
    sc = ax.scatter(runs["N"], runs["D"], c=runs["loss"], cmap="viridis", edgecolor="k", s=30, zorder=3)
    fig.colorbar(sc, ax=ax, label="observed val loss")
    ax.plot(n_star, d_star, "r-", lw=1.5, label="compute-optimal N*, D* (Approach 3)")
    for budget in budgets:  # D = C / F(N), F = 6N·flops_ratio(N): through the runs of each budget
        ax.plot(Ng[0], budget / (6 * Ng[0] * ratio(Ng[0])), ":", color="grey", lw=0.8)
    ax.set(xscale="log", yscale="log", xlim=(Ng.min(), Ng.max()), ylim=(Dg.min(), Dg.max()),
           xlabel="parameters N (embeddings included)", ylabel="training tokens D",
           title="fitted L(N, D): contours, runs, IsoFLOP lines (dotted)")
    ax.legend(fontsize=8, loc="upper right")
    _save(fig, paths[2], dpi)
    return paths


def _save(fig, path: Path, dpi: int) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    fig.clf()
    import matplotlib.pyplot as plt

    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="output directory (default runs/sweep-<time>)")
    ap.add_argument("--quick", action="store_true", help="tiny CI grid: about a minute")
    ap.add_argument("--fit-only", action="store_true", help="refit and replot the rows already in --out")
    ap.add_argument("--cache-dir", type=Path, default=None, help="token cache (default ~/.cache/mlx_llm)")
    ap.add_argument("--bootstrap", type=int, default=None, help="bootstrap replicates of the Approach 3 fit")
    ap.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                    help="run the points as Ray tasks, on the cluster at ADDRESS (e.g. auto, ray://host:10001) or, "
                         "without one, on a local cluster started here (pip install 'mlx_llm[sweep]')")
    ap.add_argument("--ray-cpus-per-task", type=float, default=1.0, metavar="N", help="CPUs a Ray task holds (1)")
    ap.add_argument("--ray-gpus-per-task", type=float, default=0.0, metavar="N", help="GPUs a Ray task holds (0)")
    return ap.parse_args(argv)


def run_sweep(args: argparse.Namespace, out: Path, setting: Setting) -> Path:
    """The sweep, sequential or, with ``--ray``, on the Ray cluster this connects to (and leaves afterwards)."""
    if args.ray is None:
        return sweep(out, setting, args.cache_dir)
    ray = import_ray()
    ray.init(address=args.ray or None)
    try:
        return sweep(out, setting, args.cache_dir,
                     ray_resources={"num_cpus": args.ray_cpus_per_task, "num_gpus": args.ray_gpus_per_task})
    finally:
        ray.shutdown()


def main(argv=None) -> int:
    args = parse_args(argv)
    setting = QUICK if args.quick else FULL
    out = args.out or common.REPO / "runs" / time.strftime("sweep-%Y%m%d-%H%M%S")
    t0 = time.perf_counter()
    try:
        csv_path = out / "sweep.csv" if args.fit_only else run_sweep(args, out, setting)
    except MLXLLMError as exc:  # Ray missing, another grid in --out, failed Ray points: one line, as the CLI does
        print(f"error: {exc}", file=sys.stderr)
        return 2
    runs = load_sweep(csv_path)
    # Refitting, the budgets are the CSV's own (a sweep of another grid, such as one sized by 6·N_total·D).
    budgets = sorted(set(runs["budget"].tolist())) if args.fit_only else setting.budgets()
    result = fit_sweep(runs, setting.bootstrap if args.bootstrap is None else args.bootstrap, budgets,
                       COARSE_GRID if setting.coarse_fit else None)
    write_outputs(out, runs, result, budgets)
    a3, a2 = result["approach3"], result["approach2"]
    print(f"Approach 3: E = {a3['E']:.4f}, A = {a3['A']:.4g}, B = {a3['B']:.4g}, alpha = {a3['alpha']:.4f}, "
          f"beta = {a3['beta']:.4f}; N* ∝ C^{a3['N_opt_exponent']:.3f}, D* ∝ C^{a3['D_opt_exponent']:.3f}")
    print("Approach 2: " + (f"N_opt ∝ C^{a2['N_opt_exponent']:.3f}, D_opt ∝ C^{a2['D_opt_exponent']:.3f}"
                            if a2["N_opt_exponent"] is not None else a2["error"]))
    print(f"{len(runs['N'])} runs in {out}; {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
