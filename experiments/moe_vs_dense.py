"""Dense against mixture of experts at equal active parameters, trained for the same wall time on the default
corpus (M20 §15, U19 §3), and the balancing offsets' effect on expert load.

Four runs, each a normal `mlx-llm train` run directory under --out, with the main job's training settings:
- dense: experiments/configs/dense.json (the main job's model before the knobs, `recipes.BASE_MODEL`: 869,504 parameters);
- moe:   experiments/configs/moe.json (8 experts of width 176, top 2, sigmoid router, offset rate u = 0.01:
         873,600 active, 2,495,616 stored parameters);
  each model's step count is set by the library's time budget (``fit_time_budget``: the step timed on the run's
  first batch after compiling, as `mlx-llm train --time-budget` does) so that its training loop lasts
  --seconds: the same wall time for both;
- balance-u, balance-u0: the MoE with its u and with u = 0 (offsets frozen at 0), --balance-steps steps each at
  batch --balance-batch, identical otherwise: the load-balancing rule's effect.
The four runs repeat for each seed (``--seeds K``: seeds 0 … K − 1 under OUT/seed<S>; a seed fixes the initial
parameters and the batch order), and each comparison — MoE against dense in val bits/byte, u against u = 0 in
load imbalance and val bits/byte — is the mean over seeds with its 95 % interval and the paired t-test's p-value
(``experiments.common.seed_statistics``).
Prints val bits/byte, tokens/s and load imbalance (max/mean expert load, 1 = even) side by side, writes
results.json and load_imbalance.png (imbalance per step of seed 0, u > 0 against u = 0) into --out, and the results
to experiments/results/moe_vs_dense.json (``--save``).

    python -m experiments.moe_vs_dense --out runs/moe_vs_dense [--seconds 120 --balance-steps 300 --seeds 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np

from experiments import common
from experiments.common import CONFIGS
from mlx_llm import ModelConfig
from mlx_llm.recipes import ADAMW_TRAIN, MAIN_JOB_VOCAB
from mlx_llm.runs.configs import DataSpec
from mlx_llm.runs.pretrain import METRICS_FILE, train_run


def imbalance_curve(run_dir: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines() if line]
    return [(r["step"], float(np.mean(r["load_imbalance"]))) for r in rows if "load_imbalance" in r]


def run_result(run_dir: Path, cfg: ModelConfig, batch: int, summary: dict) -> dict:
    """One run's row of results.json: its size, val bits/byte, throughput and expert-load imbalance."""
    n, curve = summary["steps"], imbalance_curve(run_dir)
    return {"steps": n, "batch_size": batch, "offset_rate": cfg.offset_rate, "params": cfg.param_count(),
            "active_params": cfg.active_param_count(), "val_bpb": summary["val_bpb"],
            "tokens_per_second": summary["tokens_per_second"], "train_seconds": summary["train_seconds"],
            "final_imbalance": curve[-1][1] if curve else None,
            "mean_imbalance_last_half": float(np.mean([v for s, v in curve if s > n / 2])) if curve else None,
            "imbalance_curve": curve}


def one_seed(out: Path, dense: ModelConfig, moe: ModelConfig, base, spec, args) -> dict:
    """The four runs of one seed (``base.seed``) under ``out``."""
    results = {}
    for name, cfg in (("dense", dense), ("moe", moe)):  # the same wall time each
        summary = common.train_for_seconds(out / name, cfg, base, spec, args.seconds, cache_dir=args.cache_dir,
                                           label=f"{out.name} {name}")
        results[name] = run_result(out / name, cfg, base.batch_size, summary)
    n, batch = args.balance_steps, args.balance_batch
    for name, cfg in (("balance-u", moe), ("balance-u0", dataclasses.replace(moe, offset_rate=0.0))):
        tcfg = dataclasses.replace(base, steps=n, eval_interval=n, checkpoint_interval=n, batch_size=batch)
        summary = train_run(out / name, cfg, tcfg, spec, cache_dir=args.cache_dir, show_progress=False,
                            log=lambda *a: None)
        results[name] = run_result(out / name, cfg, batch, summary)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seconds", type=float, default=120.0, help="training-loop wall time per model")
    ap.add_argument("--balance-steps", type=int, default=300)
    ap.add_argument("--balance-batch", type=int, default=8)
    ap.add_argument("--data", help="corpus (default: the Python standard library)")
    ap.add_argument("--cache-dir", type=Path)
    common.add_seeds_argument(ap)
    common.add_save_argument(ap, "moe_vs_dense")
    args = ap.parse_args(argv)
    seeds = common.check_seeds(args.seeds)
    dense = ModelConfig.from_json(CONFIGS / "dense.json")
    moe = ModelConfig.from_json(CONFIGS / "moe.json")
    base = dataclasses.replace(ADAMW_TRAIN, log_interval=5)
    spec = DataSpec(path=args.data, vocab_size=MAIN_JOB_VOCAB)
    per_seed = {seed: one_seed(args.out / f"seed{seed}", dense, moe, dataclasses.replace(base, seed=seed), spec, args)
                for seed in range(seeds)}
    rows = [{**r, "arm": name, "seed": seed} for seed, res in per_seed.items() for name, r in res.items()]
    size = [r for r in rows if r["arm"] in ("dense", "moe")]
    balance = [r for r in rows if r["arm"].startswith("balance")]
    statistics = {"val_bpb": common.seed_statistics(size, "val_bpb", baseline="dense"),
                  "balance_imbalance": common.seed_statistics(balance, "mean_imbalance_last_half",
                                                              baseline="balance-u0"),
                  "balance_val_bpb": common.seed_statistics(balance, "val_bpb", baseline="balance-u0")}
    results = {"seeds": seeds, "seconds": args.seconds, "per_seed": per_seed, "statistics": statistics,
               "arguments": common.arguments(args)}
    common.save_result("results", results, args.out)
    common.save_from_args(args, results)
    print(f"{'run':16s} {'steps':>6s} {'active':>9s} {'stored':>9s} {'val bpb':>8s} {'tok/s':>8s} {'train s':>8s} "
          f"{'imbalance (last half)':>22s}")
    for seed, res in per_seed.items():
        for name, r in res.items():
            imb = "—" if r["mean_imbalance_last_half"] is None else f"{r['mean_imbalance_last_half']:.3f}"
            print(f"{name + f' s{seed}':16s} {r['steps']:6d} {r['active_params']:9,d} {r['params']:9,d} "
                  f"{r['val_bpb']:8.4f} {r['tokens_per_second']:8,.0f} {r['train_seconds']:8.1f} {imb:>22s}")
    for title, st in (("val bits/byte, equal wall time", statistics["val_bpb"]),
                      ("load imbalance, last half, equal steps", statistics["balance_imbalance"]),
                      ("val bits/byte of the balancing runs", statistics["balance_val_bpb"])):
        print(f"{title}, over seeds 0–{seeds - 1}:")
        for line in common.seed_lines(st):
            print("  " + line)
    plot(per_seed[0], args.out / "load_imbalance.png")
    return 0


def plot(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    u = results["balance-u"]["offset_rate"]
    for name, label in (("balance-u", f"offset rate u = {u:g}"), ("balance-u0", "u = 0 (no balancing)")):
        if results[name]["imbalance_curve"]:
            ax.plot(*zip(*results[name]["imbalance_curve"]), label=label, lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("max / mean expert load (mean over layers)")
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
