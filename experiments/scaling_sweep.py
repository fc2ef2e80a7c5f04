"""A CPU scaling-law sweep (U19 §8): train an IsoFLOP grid of small MiniLLMs, then fit L(N, D) both ways.

The grid (Hoffmann et al. 2022, Approach 2's design): a ladder of model sizes and n compute budgets
C_k = C_1·30^{k/(n−1)} spanning 30× (the default: four, 3.5e10 to 1.05e12 FLOPs). Each budget trains five
consecutive sizes of the ladder, the window shifting towards larger models as the budget grows (the
compute-optimal N grows with C); every run reads D = C_k / (6N) tokens, so the runs of a budget share its
compute. The batch grows with the budget (4, 8, 8, 16 sequences of 128 tokens): with one fixed batch the
smallest budget's larger models got fewer than 100 updates and lost to the smallest model whatever its size,
so that budget showed no valley (a 16-sequence pilot at 3.5e10: losses rising monotonically with N).

- C = 6·N_total·D with N_total the whole parameter count, embeddings included (Hoffmann et al.'s convention):
  at this scale the embedding and unembedding tables are a large share of every model and of its compute
  (the unembedding matmul is 2·V·d FLOPs a token), so the non-embedding N of Kaplan et al. 2020 would make the
  small models' runs cost several times their nominal budget. Both fits use N_total. The CSV still lists the
  non-embedding count as ``N`` and the whole count as ``N_total``. D counts every token position a training
  step processes: steps × batch × seq_len.
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
provenance of the fit) and three plots are written; experiments/results/ holds a copy of one full sweep's outputs.

    python -m experiments.scaling_sweep                 # the full sweep: 19 min on 2 shared CPU cores
    python -m experiments.scaling_sweep --quick         # CI: tiny models, few steps; compile-bound, ~1.5 min
                                                        # with XLA_FLAGS=--xla_backend_optimization_level=0
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

import numpy as np

from experiments import common
from mlx_llm.train import data as data_lib
from mlx_llm.train import tokenizer as tok_lib
from mlx_llm.runs.record import CONFIG_FILE, RunRecord, write_run
from mlx_llm.config import ModelConfig, TrainConfig
from mlx_llm.errors import ConfigError
from mlx_llm.runs.configs import DataSpec
from mlx_llm.train.run import train_loop

COLUMNS = ("name", "budget", "d_model", "n_layers", "n_heads", "d_ff", "N", "N_total", "D", "C", "steps",
           "batch_size", "seq_len", "lr", "warmup_steps", "loss", "val_bpb", "val_ppl", "wall_seconds",
           "tokens_per_second")


@dataclasses.dataclass(frozen=True)
class Setting:
    """Everything that defines a sweep besides its output directory."""

    ladder: tuple[tuple[int, int], ...]  # (d_model, n_layers), by increasing N
    windows: tuple[tuple[int, ...], ...]  # ladder indices trained at each budget
    base_budget: float  # C_1, FLOPs (6·N_total·D)
    batch_sizes: tuple[int, ...]  # sequences per step at each budget
    seq_len: int
    vocab_size: int
    eval_tokens: int
    data_path: str | None  # None: the standard library
    bootstrap: int
    coarse_fit: bool = False  # Approach 3 from 108 starts (one polished) instead of Hoffmann's 4 500 (CI speed)

    def budgets(self) -> list[float]:
        return [self.base_budget * 30.0 ** (k / (len(self.windows) - 1)) for k in range(len(self.windows))]


FULL = Setting(ladder=((8, 1), (16, 1), (16, 2), (24, 2), (32, 2), (48, 2), (64, 2), (80, 3)),
               windows=((0, 1, 2, 3, 4), (0, 1, 2, 3, 4), (2, 3, 4, 5, 6), (3, 4, 5, 6, 7)), base_budget=3.5e10,
               batch_sizes=(4, 8, 8, 16), seq_len=128, vocab_size=512, eval_tokens=65536, data_path=None, bootstrap=200)
# CI: five one-layer models on a small slice of the stdlib (its json package), 10 to ~900 steps each; the
# bootstrap has as many replicates as the coarse grid has starts, so it reuses the fit's compiled program.
QUICK = Setting(ladder=((16, 1), (20, 1), (24, 1), (28, 1), (36, 1)), windows=((0, 1, 2, 3, 4),) * 3,
                base_budget=6e8, batch_sizes=(8, 8, 8), seq_len=32, vocab_size=320, eval_tokens=256,
                data_path=str(data_lib.stdlib_root() / "json"), bootstrap=108, coarse_fit=True)
COARSE_GRID = {"a": [0.0, 5.0, 10.0], "b": [0.0, 5.0, 10.0], "e": [-1.0, 0.0, 1.0], "alpha": [0.5, 1.0],
               "beta": [0.5, 1.0]}
GRID_FIELDS = ("ladder", "windows", "base_budget", "batch_sizes", "seq_len", "vocab_size", "eval_tokens", "data_path")


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
    """One dict per point: name, budget, model and train configs; D = C_k / (6·N_total) in whole steps."""
    points = []
    for k, (budget, window, batch) in enumerate(zip(setting.budgets(), setting.windows, setting.batch_sizes)):
        tokens_per_step = batch * setting.seq_len
        for i in window:
            d, L = setting.ladder[i]
            cfg = model_config(d, L, vocab_size, setting.seq_len)
            steps = max(2, round(budget / (6.0 * cfg.param_count()) / tokens_per_step))
            tcfg = TrainConfig(batch_size=batch, seq_len=setting.seq_len, steps=steps,
                               lr=peak_lr(d), warmup_steps=warmup(steps), eval_interval=steps,
                               eval_tokens=setting.eval_tokens, checkpoint_interval=steps, keep_checkpoints=1,
                               log_interval=min(50, steps))
            points.append({"name": f"C{k}-d{d}-L{L}", "budget": budget, "cfg": cfg, "tcfg": tcfg})
    return points


# ----- corpus and runs ----------------------------------------------------------------------------------------
def prepare_corpus(out: Path, spec: DataSpec, cache_dir, log=print):
    """Read the corpus; train the BPE once (kept as ``<out>/tokenizer.json``); encode through the token cache."""
    text = data_lib.read_corpus(spec.path, extensions=spec.extensions, val_percent=spec.val_percent)
    tok_file = out / tok_lib.TOKENIZER_FILE
    if tok_file.is_file():
        tok = tok_lib.load(tok_file)
    else:
        t0 = time.perf_counter()
        tok = tok_lib.train_bpe((d.text for d in text.train), spec.vocab_size)
        tok.save(out)
        log(f"BPE vocabulary of {tok.vocab_size} trained in {time.perf_counter() - t0:.1f} s")
    corpus = data_lib.encode_corpus(text, tok, cache_dir)
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


def run_point(out: Path, point: dict, spec: DataSpec, tok, corpus, log=print) -> dict:
    """Train one point (resuming a half-finished run directory) and return its CSV row."""
    cfg, tcfg = point["cfg"], point["tcfg"]
    run_dir = out / "runs" / point["name"]
    resume = (run_dir / CONFIG_FILE).is_file()
    if not resume:
        write_run(run_dir, cfg, tcfg, RunRecord(kind="pretrain", data=spec))
        tok.save(run_dir)
    t0 = time.perf_counter()
    summary = train_loop(run_dir, cfg, tcfg, corpus, resume=resume, show_progress=False, log=log)["summary"]
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    N, D = cfg.non_embedding_param_count(), tcfg.steps * tcfg.batch_size * tcfg.seq_len
    return {"name": point["name"], "budget": f"{point['budget']:.6g}", "d_model": cfg.d_model,
            "n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "d_ff": cfg.d_ff, "N": N, "N_total": cfg.param_count(),
            "D": D, "C": f"{6.0 * cfg.param_count() * D:.6g}", "steps": tcfg.steps, "batch_size": tcfg.batch_size,
            "seq_len": tcfg.seq_len, "lr": f"{tcfg.lr:.6g}", "warmup_steps": tcfg.warmup_steps,
            "loss": f"{summary['val_loss']:.6f}", "val_bpb": f"{summary['val_bpb']:.6f}",
            "val_ppl": f"{summary['val_ppl']:.4f}", "wall_seconds": f"{time.perf_counter() - t0:.2f}",
            "tokens_per_second": f"{summary['tokens_per_second'] or 0:.1f}"}


def sweep(out: Path, setting: Setting, cache_dir=None, log=print) -> Path:
    """Train every point not yet in ``<out>/sweep.csv``; returns the CSV path."""
    out.mkdir(parents=True, exist_ok=True)
    check_setting(out / "setting.json", setting)
    csv_path = out / "sweep.csv"
    done = {r["name"] for r in read_rows(csv_path)}
    spec = DataSpec(path=setting.data_path, tokenizer="bpe", vocab_size=setting.vocab_size)
    tok, corpus = prepare_corpus(out, spec, cache_dir, log)
    points = grid(setting, tok.vocab_size)
    for j, point in enumerate(points):
        if point["name"] in done:
            log(f"[{j + 1}/{len(points)}] {point['name']}: already in {csv_path.name}, skipped")
            continue
        row = run_point(out, point, spec, tok, corpus, log=lambda *a: None)
        append_row(csv_path, row)
        log(f"[{j + 1}/{len(points)}] {row['name']}: N = {row['N']}, D = {row['D']}, steps {row['steps']}, "
            f"loss {row['loss']}, {row['val_bpb']} bits/byte, {row['wall_seconds']} s")
    return csv_path


# ----- fits and plots -----------------------------------------------------------------------------------------
def load_sweep(csv_path: Path) -> dict:
    rows = read_rows(csv_path)
    """The runs as arrays; ``N`` here is N_total, the count the grid's budgets and both fits use."""
    out = {k: np.array([float(r[k]) for r in rows]) for k in ("N_total", "D", "C", "loss", "budget")}
    out["N"] = out.pop("N_total")
    out["name"] = [r["name"] for r in rows]
    return out


def fit_sweep(runs: dict, bootstrap: int, budgets, grid=None) -> dict:
    """Approach 3 (``fit_chinchilla``, with bootstrap) and Approach 2 (``isoflop_fit``) on the sweep's runs."""
    from mlx_llm.errors import MLXLLMError
    from mlx_llm.scaling.laws import fit_chinchilla, isoflop_fit, optimal_exponents

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
        iso = isoflop_fit(runs["N"], runs["D"], runs["loss"], budgets=budgets)
        approach2 = {"N_opt_exponent": iso["a"], "D_opt_exponent": iso["b"], "N_coef": iso["N_coef"],
                     "D_coef": iso["D_coef"]} | {k: iso[k].tolist() for k in ("C", "N_opt", "D_opt", "loss_opt")}
        approach2["skipped_budgets"] = iso["skipped"]
    except MLXLLMError as exc:  # fewer than two budgets with a valley inside their sizes
        approach2 = {"N_opt_exponent": None, "D_opt_exponent": None, "error": str(exc)}
    notes = "N = N_total (all parameters, embeddings included); C = 6·N_total·D; loss = final val loss (nats/token)"
    return {"approach3": approach3, "approach2": approach2, "params": fit["params"], "notes": notes}


def write_outputs(out: Path, runs: dict, result: dict, budgets, dpi: int = 90) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mlx_llm.scaling.laws import chinchilla_loss, compute_optimal, loss_at_budget

    common.save_result("fit", {k: v for k, v in result.items() if k != "params"}, out)
    params, iso = result["params"], result["approach2"]
    paths = [out / "loss_vs_compute.png", out / "isoflop.png", out / "fitted_surface.png"]
    C_axis = np.geomspace(runs["C"].min() / 2, runs["C"].max() * 2, 100)
    colour = plt.cm.viridis((np.log(runs["N"]) - np.log(runs["N"]).min()) / max(np.ptp(np.log(runs["N"])), 1e-9))

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    ax.scatter(runs["C"], runs["loss"], c=colour, s=28, label="runs (colour: log N)")
    ax.plot(C_axis, loss_at_budget(C_axis, compute_optimal(C_axis, params)[0], params), "k-",
            label="Approach 3 frontier L(N*(C), D*(C))")
    if iso.get("C"):
        ax.plot(iso["C"], iso["loss_opt"], "r*", ms=12, label="Approach 2 parabola minima")
    ax.set(xscale="log", xlabel="training compute C = 6ND (FLOPs, N = all parameters)", ylabel="val loss (nats/token)",
           title="loss vs compute")
    ax.legend(fontsize=8)
    _save(fig, paths[0], dpi)

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for j, budget in enumerate(budgets):
        pick = np.abs(np.log10(runs["C"] / budget)) < 0.1
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
    n_opt, d_opt = compute_optimal(C_axis, params)
    ax.plot(n_opt, d_opt, "r-", lw=1.5, label="compute-optimal N*, D* (Approach 3)")
    for budget in budgets:
        ax.plot(Ng[0], budget / (6 * Ng[0]), ":", color="grey", lw=0.8)
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="output directory (default runs/sweep-<time>)")
    ap.add_argument("--quick", action="store_true", help="tiny CI grid: about a minute")
    ap.add_argument("--fit-only", action="store_true", help="refit and replot the rows already in --out")
    ap.add_argument("--cache-dir", type=Path, default=None, help="token cache (default ~/.cache/mlx_llm)")
    ap.add_argument("--bootstrap", type=int, default=None, help="bootstrap replicates of the Approach 3 fit")
    args = ap.parse_args(argv)
    setting = QUICK if args.quick else FULL
    out = args.out or common.REPO / "runs" / time.strftime("sweep-%Y%m%d-%H%M%S")
    t0 = time.perf_counter()
    csv_path = out / "sweep.csv" if args.fit_only else sweep(out, setting, args.cache_dir)
    runs = load_sweep(csv_path)
    result = fit_sweep(runs, setting.bootstrap if args.bootstrap is None else args.bootstrap, setting.budgets(),
                       COARSE_GRID if setting.coarse_fit else None)
    write_outputs(out, runs, result, setting.budgets())
    a3, a2 = result["approach3"], result["approach2"]
    print(f"Approach 3: E = {a3['E']:.4f}, A = {a3['A']:.4g}, B = {a3['B']:.4g}, alpha = {a3['alpha']:.4f}, "
          f"beta = {a3['beta']:.4f}; N* ∝ C^{a3['N_opt_exponent']:.3f}, D* ∝ C^{a3['D_opt_exponent']:.3f}")
    print("Approach 2: " + (f"N_opt ∝ C^{a2['N_opt_exponent']:.3f}, D_opt ∝ C^{a2['D_opt_exponent']:.3f}"
                            if a2["N_opt_exponent"] is not None else a2["error"]))
    print(f"{len(runs['N'])} runs in {out}; {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
