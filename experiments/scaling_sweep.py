"""A CPU scaling-law sweep (U19 §8): the command line over ``mlx_llm.runs.sweep.run_sweep`` and
``mlx_llm.scaling.sweep.fit_sweep``, with the plots.

The grid (Hoffmann et al. 2022, Approach 2's design; ``FULL``): a ladder of eight model sizes and four compute
budgets C_k = 3.3e10·30^{k/3} exact training FLOPs (3.3e10 to 9.9e11), each training five consecutive sizes of the
ladder, the window shifting towards larger models as the budget grows (the compute-optimal N grows with C); the
batch grows with the budget (4, 8, 8, 16 sequences of 128 tokens: with one fixed batch the smallest budget's
larger models got fewer than 100 updates and lost to the smallest model whatever its size). Each point takes the
whole number of steps whose exact training FLOPs (``train_flops_per_token`` × D) are nearest C_k. Models: heads
of width 16 below d = 64, else 32; SwiGLU width ≈ 8d/3; a 512-token BPE on the Python standard library (the
compute-optimal models of these budgets hold ~20k–100k parameters, so the tables must stay small).

Parametrization and learning rate: μP (``model.parametrization = "mup"``, base width 8 = the smallest model, base
head width 16), one peak learning rate for every size, ``LR`` = 5e-2, the best of a scan at the smallest model and
budget (``--lr-scan``: eight rates from 3e-3 to 2e-1, one seed each, one sweep per rate under ``--out``); linear warmup over min(100, max(2,
steps/10)) steps, then cosine to 10% (AdamW β = (0.9, 0.95), weight decay 0.1, clipping at 1.0). Until μP, the
sweep used SP with η = 4e-3·(64/d)^½, a hand rule; under μP the rate tuned at the smallest width transfers.

Outputs in ``--out``: ``sweep.json`` (the spec), ``sweep.csv`` (one row per run), ``runs/<name>`` (ordinary run
directories), ``fit.json`` (Approach 3 with bootstrap intervals, Approach 2, and the held-out mode: both refitted
without the largest budget, predicting its runs' losses and its compute-optimal N and loss with bootstrap
intervals, against what it measured; ``scaling.sweep.fit_sweep``) and three plots. Rerunning the command on the
same ``--out`` continues where it stopped (``run_sweep``); another grid there is refused by field name. SIGTERM or
Ctrl-C stops the whole sweep, the point in training checkpointed at a step boundary, and prints the command that
continues it (status 0; 130 when interrupted outside a point's training loop); a full disk stops it in one line
(status 1).

    python -m experiments.scaling_sweep                 # the full sweep: 20 runs, 8 min on 2 idle CPU cores
    python -m experiments.scaling_sweep --quick         # CI: 15 tiny runs on the stdlib's json package
    python -m experiments.scaling_sweep --ray           # the points as tasks of a local Ray cluster
    python -m experiments.scaling_sweep --ray auto --ray-gpus-per-task 1   # on a running cluster, a GPU a run
    python -m experiments.scaling_sweep --fit-only --out runs/sweep-full   # refit and replot a finished sweep
    python -m experiments.scaling_sweep --lr-scan --out runs/lr-scan        # the scan that chose LR
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import time
from pathlib import Path

import numpy as np

from experiments import common
from mlx_llm.config import ModelConfig, TrainConfig
from mlx_llm.data import text as text_lib
from mlx_llm.errors import CheckpointWriteError, MLXLLMError
from mlx_llm.runs.configs import DataSpec
from mlx_llm.runs.sweep import SPEC_FILE, TABLE_FILE, SweepSpec, SweepStopped, import_ray, read_table, run_sweep
from mlx_llm.scaling.sweep import fit_sweep, flops_ratio, runs_of

LR = 5e-2  # the best of --lr-scan at the smallest model and budget (docs/scaling-laws.md)
LR_SCAN = (3e-3, 6e-3, 1e-2, 2e-2, 3e-2, 5e-2, 1e-1, 2e-1)
FULL_LADDER = ((8, 1), (16, 1), (16, 2), (24, 2), (32, 2), (48, 2), (64, 2), (80, 3))
QUICK_LADDER = ((16, 1), (20, 1), (24, 1), (28, 1), (36, 1))
COARSE_GRID = {"a": [0.0, 5.0, 10.0], "b": [0.0, 5.0, 10.0], "e": [-1.0, 0.0, 1.0], "alpha": [0.5, 1.0],
               "beta": [0.5, 1.0]}  # Approach 3 from 108 starts, one polished (CI speed)


def size(d_model: int, n_layers: int) -> dict:
    """Heads of width 16 below d = 64, else 32 (full multi-head attention); SwiGLU width ≈ 8d/3 (M20 §2)."""
    d_head = 16 if d_model < 64 else 32
    n_heads = max(1, d_model // d_head)
    return {"d_model": d_model, "n_layers": n_layers, "n_heads": n_heads, "n_kv_heads": n_heads, "d_head": d_head,
            "d_ff": (8 * d_model // 3 + 15) // 16 * 16}


def spec(ladder, windows, base_budget: float, batch_sizes, seq_len: int, vocab_size: int, eval_tokens: int,
         data_path: str | None, lr: float) -> SweepSpec:
    """A μP IsoFLOP sweep: budgets base·30^{k/(n−1)}, one ``lr`` for every size, base width = the smallest."""
    first = size(*ladder[0])
    model = ModelConfig(vocab_size=vocab_size, max_seq_len=seq_len, parametrization="mup",
                        mup_base_width=first["d_model"], mup_base_head_width=16, **first)
    n = len(windows)
    train = TrainConfig(seq_len=seq_len, lr=lr, warmup_steps=100, eval_tokens=eval_tokens, log_interval=50,
                        checkpoint_interval=10**6, keep_checkpoints=1)
    return SweepSpec(model=model, sizes=tuple(size(*s) for s in ladder), windows=windows,
                     budgets=tuple(base_budget * 30.0 ** (k / (n - 1)) for k in range(n)), batch_sizes=batch_sizes,
                     train=train, data=DataSpec(path=data_path, vocab_size=vocab_size))


FULL = spec(FULL_LADDER, ((0, 1, 2, 3, 4), (0, 1, 2, 3, 4), (2, 3, 4, 5, 6), (3, 4, 5, 6, 7)), 3.3e10, (4, 8, 8, 16),
            128, 512, 65536, None, LR)
QUICK = spec(QUICK_LADDER, ((0, 1, 2, 3, 4),) * 3, 4.2e8, (8, 8, 8), 32, 320, 256,
             str(text_lib.stdlib_root() / "json"), 8e-3)
BOOTSTRAP = {"full": 200, "quick": 108}  # quick: as many replicates as the coarse grid has starts (one program)


def lr_scan_spec(full: SweepSpec, lr: float) -> SweepSpec:
    """The smallest model at the smallest budget (its own batch), at peak learning rate ``lr``."""
    return dataclasses.replace(full, sizes=full.sizes[:1], windows=None, budgets=full.budgets[:1],
                               batch_sizes=full.batch_sizes[:1], train=dataclasses.replace(full.train, lr=lr))


# ----- plots -------------------------------------------------------------------------------------------------------
def write_outputs(out: Path, runs: dict, result: dict, dpi: int = 90) -> list[Path]:
    """fit.json (with provenance) and the three plots: loss against compute, the IsoFLOP curves, the fitted
    surface."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mlx_llm.scaling.laws import chinchilla_loss, compute_optimal

    common.save_result("fit", {k: v for k, v in result.items() if k != "params"}, out)
    params, iso = result["params"], result["approach2"]
    budgets = sorted(set(runs["budget"].tolist()))
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
    held = result.get("held_out", {}).get("approach3", {}).get("compute_optimal")
    if held and "loss_ci" in held:
        c = result["held_out"]["budget"]
        ax.errorbar([c], [held["loss_predicted"]], yerr=[[held["loss_predicted"] - held["loss_ci"][0]],
                                                         [held["loss_ci"][1] - held["loss_predicted"]]],
                    fmt="bs", ms=6, capsize=3, label="held out: predicted optimum (95% CI)")
    ax.set(xscale="log", xlabel="training compute C (exact FLOPs: train_flops_per_token × D)",
           ylabel="val loss (nats/token)", title="loss vs compute")
    ax.legend(fontsize=8)
    _save(fig, paths[0], dpi)

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for j, budget in enumerate(budgets):
        pick = np.isclose(runs["budget"], budget, rtol=1e-9)
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
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


# ----- the command -------------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="output directory (default runs/sweep-<time>)")
    ap.add_argument("--quick", action="store_true", help="tiny CI grid: about a minute")
    ap.add_argument("--fit-only", action="store_true", help="refit and replot the rows already in --out")
    ap.add_argument("--lr-scan", action="store_true", help="train the smallest model at the smallest budget at "
                    "each learning rate of LR_SCAN (one sweep each under --out) and print the table")
    ap.add_argument("--cache-dir", type=Path, default=None, help="token cache (default ~/.cache/mlx_llm)")
    ap.add_argument("--bootstrap", type=int, default=None, help="bootstrap replicates of the fits")
    ap.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                    help="run the points as Ray tasks, on the cluster at ADDRESS (e.g. auto, ray://host:10001) or, "
                         "without one, on a local cluster started here (pip install 'mlx_llm[sweep]')")
    ap.add_argument("--ray-cpus-per-task", type=float, default=1.0, metavar="N", help="CPUs a Ray task holds (1)")
    ap.add_argument("--ray-gpus-per-task", type=float, default=0.0, metavar="N", help="GPUs a Ray task holds (0)")
    return ap.parse_args(argv)


def sweep(args: argparse.Namespace, out: Path, grid: SweepSpec):
    """``run_sweep``, locally or, with ``--ray``, on the Ray cluster this connects to (and leaves afterwards)."""
    again = getattr(args, "continue_with", None)
    if args.ray is None:
        return run_sweep(grid, out, cache_dir=args.cache_dir, continue_with=again)
    ray = import_ray()
    ray.init(address=args.ray or None)
    try:
        return run_sweep(grid, out, runner="ray", cache_dir=args.cache_dir, continue_with=again,
                         ray_options={"num_cpus": args.ray_cpus_per_task, "num_gpus": args.ray_gpus_per_task})
    finally:
        ray.shutdown()


def lr_scan(args, out: Path, grid: SweepSpec) -> int:
    """One sweep per rate of ``LR_SCAN`` (the smallest model at the smallest budget), then
    ``<out>/sweep_lr_scan.json``: the rows and the best rate."""
    rows = []
    for lr in LR_SCAN:
        row = read_table(out / f"lr={lr:g}" / TABLE_FILE) or None
        if row is None:
            table = sweep(args, out / f"lr={lr:g}", lr_scan_spec(grid, lr))
            row = table.to_dict("records") if hasattr(table, "to_dict") else table
        print(f"lr {lr:g}: val loss {row[0]['loss']:.4f} ({row[0]['name']}, {row[0]['steps']} steps)")
        rows.append({k: row[0][k] for k in ("name", "lr", "steps", "loss", "val_bpb")})
    best = min(rows, key=lambda r: r["loss"])
    common.save_result("sweep_lr_scan", {"rows": rows, "best_lr": best["lr"], "seeds": 1}, out)
    print(f"best: lr {best['lr']:g}")
    return 0


def continue_command(argv: list[str], out: Path) -> str:
    """This command again, with ``--out`` named (the default directory is stamped with the time it started)."""
    given = any(a == "--out" or a.startswith("--out=") for a in argv)
    return shlex.join(["python", "-m", "experiments.scaling_sweep", *argv, *([] if given else ["--out", str(out)])])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    args = parse_args(argv)
    grid, kind = (QUICK, "quick") if args.quick else (FULL, "full")
    out = args.out or common.REPO / "runs" / time.strftime("sweep-%Y%m%d-%H%M%S")
    args.continue_with = continue_command(argv, out)
    t0 = time.perf_counter()
    try:
        if args.lr_scan:
            return lr_scan(args, out, grid)
        if args.fit_only:
            if not (out / SPEC_FILE).is_file():
                raise MLXLLMError(f"{out} holds no {SPEC_FILE}: --fit-only refits a sweep run_sweep wrote")
            table = read_table(out / TABLE_FILE)
        else:
            table = sweep(args, out, grid)
    except SweepStopped as stop:  # as `mlx-llm train` stops: its checkpoint, the command that continues
        print(f"stopped: {stop}", file=sys.stderr)
        return 0 if stop.clean else 130
    except MLXLLMError as exc:  # Ray missing, another grid in --out, failed points, a full disk: one line
        print(f"error: {exc}", file=sys.stderr)
        return 1 if isinstance(exc, CheckpointWriteError) else 2
    bootstrap = BOOTSTRAP[kind] if args.bootstrap is None else args.bootstrap
    result = fit_sweep(table, bootstrap=bootstrap, grid=COARSE_GRID if args.quick else None)
    runs = runs_of(table)
    write_outputs(out, runs, result)
    a3, a2 = result["approach3"], result["approach2"]
    print(f"Approach 3: E = {a3['E']:.4f}, A = {a3['A']:.4g}, B = {a3['B']:.4g}, alpha = {a3['alpha']:.4f}, "
          f"beta = {a3['beta']:.4f}; N* ∝ C^{a3['N_opt_exponent']:.3f}, D* ∝ C^{a3['D_opt_exponent']:.3f}")
    print("Approach 2: " + (f"N_opt ∝ C^{a2['N_opt_exponent']:.3f}, D_opt ∝ C^{a2['D_opt_exponent']:.3f}"
                            if a2["N_opt_exponent"] is not None else a2["error"]))
    if "held_out" in result:
        print("held out: " + json.dumps(summarize_held_out(result["held_out"])))
    print(f"{len(runs['N'])} runs in {out}; {time.perf_counter() - t0:.1f} s")
    return 0


def summarize_held_out(held: dict) -> dict:
    """The held-out block in a few numbers: per approach, predicted vs measured compute-optimal N and loss."""
    out = {"budget": held["budget"]}
    a3 = held["approach3"]
    opt = a3.get("compute_optimal") or {}
    out["approach3"] = {"run_loss_mean_abs_error": a3["loss_error"]["mean_abs"],
                        **{k: opt.get(k) for k in ("N_predicted", "N_ci", "N_measured", "loss_predicted", "loss_ci",
                                                   "loss_measured")}}
    a2 = held["approach2"]
    out["approach2"] = a2.get("error") or {k: a2.get(k) for k in ("N_predicted", "N_ci", "N_measured",
                                                                   "loss_predicted", "loss_ci", "loss_measured")}
    return out


if __name__ == "__main__":
    sys.exit(main())
