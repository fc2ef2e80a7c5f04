"""Warmup-stable-decay branches against cosine runs of the same budgets, on the default corpus (issue: the
researcher's workflow; Hägele et al. 2024, "Scaling laws and compute-optimal training beyond fixed training
durations").

One WSD trunk of the largest budget (the main job's model and settings, ``--schedule wsd --decay-fraction F``,
1-sqrt decay) checkpoints at the start of each budget's decay; each budget N is a branch (``mlx-llm train
--branch-from TRUNK --branch-step (1 − F)·N --steps N``) that decays from there. The largest budget's branch
repeats the trunk's own decay, and its parameters are checked bitwise equal to the trunk's. Each budget also gets
its own cosine run (the main job's schedule). Reported per budget: the final val bits/byte on the whole val split
of both, and the optimizer steps each way costs: the branches share the stable trunk, so the WSD family needs
(1 − F)·N_max + F·Σ N steps against Σ N for the cosine runs. Every run is a normal run directory under --out.

The whole family runs once per seed (``--seeds K``, seeds 0 … K − 1 under OUT/seed<S>; the seed fixes the initial
parameters and the batch order of the trunk, its branches and the cosine runs alike), and each budget's
difference wsd − cosine is reported as the mean over seeds with its 95 % interval and the paired t-test's p-value
(``experiments.common.seed_statistics``).

    python -m experiments.wsd_branches --out runs/wsd           # budgets 175, 350, 700, 3 seeds (≈ 40 min on 2 cores)
    python -m experiments.wsd_branches --out runs/wsd --budgets 100,200,400   # ≈ 7 min per seed
    python -m experiments.wsd_branches --out /tmp/w --quick     # tiny budgets (a smoke run)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import jax
import numpy as np

from experiments import common
from mlx_llm.config import wsd_decay_steps
from mlx_llm.recipes import BASE_MODEL, ADAMW_TRAIN, MAIN_JOB_VOCAB
from mlx_llm.runs.branch import Branch
from mlx_llm.runs.configs import DataSpec
from mlx_llm.runs.load import load_params
from mlx_llm.runs.record import open_run
from mlx_llm.runs.pretrain import train_run


def trees_equal(a, b) -> bool:
    """Bitwise equality of two parameter trees."""
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def run(out: Path, tcfg, spec, cache_dir, branch=None) -> dict:
    """One run (or branch) quietly; its summary (read back when the run already finished: a rerun of the script
    adds only what is missing)."""
    if (out / "summary.json").is_file():
        return json.loads((out / "summary.json").read_text())
    summary = train_run(out, None if branch else BASE_MODEL, None if branch else tcfg,
                        None if branch else spec, show_progress=False, cache_dir=cache_dir, sample_tokens=8,
                        log=lambda *a: None, branch=branch)
    print(f"{out.name}: {summary['steps']} steps, val bits/byte {summary['val_bpb']:.4f}, "
          f"{summary['train_seconds']:.0f} s", flush=True)
    return summary


def family(out: Path, base, spec, starts: dict, F: float, cache_dir) -> tuple[list[dict], bool]:
    """The trunk, its branches and the cosine runs of one seed (``base.seed``) under ``out``, ``starts``: the
    step each budget's decay starts at, by budget: a row per budget and whether the largest budget's branch
    equals the trunk bitwise."""
    budgets = sorted(starts)
    top = budgets[-1]
    wsd_cfg = dataclasses.replace(base, steps=top, schedule="wsd", decay_fraction=F)
    trunk = out / f"wsd-{top}"
    run(trunk, wsd_cfg, spec, cache_dir)
    wsd = {n: run(out / f"branch-{n}", None, None, cache_dir, Branch(trunk, starts[n], {"steps": n})) for n in budgets}
    exact = trees_equal(load_params(open_run(trunk)), load_params(open_run(out / f"branch-{top}")))
    cosine = {n: run(out / f"cosine-{n}", dataclasses.replace(base, steps=n, eval_interval=n, checkpoint_interval=n),
                     spec, cache_dir) for n in budgets}
    rows = [{"budget_steps": n, "wsd_val_bpb": wsd[n]["val_bpb"], "cosine_val_bpb": cosine[n]["val_bpb"],
             "branch_step": starts[n], "branch_steps_run": n - starts[n], "cosine_steps_run": n} for n in budgets]
    return rows, exact


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budgets", default="175,350,700", help="optimizer steps per budget, comma-separated")
    ap.add_argument("--decay-fraction", type=float, default=0.2)
    ap.add_argument("--data", help="corpus (default: the Python standard library)")
    ap.add_argument("--cache-dir", type=Path)
    ap.add_argument("--quick", action="store_true", help="budgets 10,20 of tiny batches (a smoke run)")
    common.add_seeds_argument(ap)
    common.add_save_argument(ap, "wsd_branches")
    args = ap.parse_args(argv)
    seeds = common.check_seeds(args.seeds)
    budgets = sorted(int(b) for b in ("10,20" if args.quick else args.budgets).split(","))
    F, top = args.decay_fraction, budgets[-1]
    starts = {n: n - wsd_decay_steps(n, F) for n in budgets}  # the step each budget's decay starts at
    interval = min(s for n, s in starts.items())
    if any(s % interval for s in starts.values()):
        raise SystemExit(f"the decay starts {sorted(starts.values())} must be multiples of the smallest (checkpoints)")
    base = dataclasses.replace(ADAMW_TRAIN, schedule="cosine", eval_interval=top, checkpoint_interval=interval,
                               keep_checkpoints=top, log_interval=25)
    if args.quick:
        base = dataclasses.replace(base, batch_size=4, seq_len=32, warmup_steps=2, eval_tokens=512, log_interval=4)
    spec = DataSpec(path=args.data, vocab_size=MAIN_JOB_VOCAB)
    per_seed, runs = {}, []
    for seed in range(seeds):
        rows, exact = family(args.out / f"seed{seed}", dataclasses.replace(base, seed=seed), spec, starts, F,
                             args.cache_dir)
        per_seed[seed] = {"rows": rows, "top_branch_bitwise_equal_to_trunk": exact}
        runs += [{"arm": arm, "seed": seed, "budget_steps": r["budget_steps"], "val_bpb": r[f"{arm}_val_bpb"]}
                 for r in rows for arm in ("cosine", "wsd")]
    by_budget = {n: common.seed_statistics([r for r in runs if r["budget_steps"] == n], "val_bpb", baseline="cosine")
                 for n in budgets}
    result = {"budgets": budgets, "seeds": seeds, "per_seed": per_seed,
              "statistics": {str(n): st for n, st in by_budget.items()},
              "decay_fraction": F, "decay_shape": "1-sqrt",
              "wsd_family_steps": starts[top] + sum(n - starts[n] for n in budgets),
              "cosine_family_steps": sum(budgets),
              "top_branch_bitwise_equal_to_trunk": all(v["top_branch_bitwise_equal_to_trunk"] for v in per_seed.values()),
              "train": dataclasses.asdict(base), "model": BASE_MODEL.to_dict()}
    (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    for n, st in by_budget.items():
        print(f"budget {n} steps, val bits/byte over seeds 0–{seeds - 1}:")
        for line in common.seed_lines(st):
            print("  " + line)
    print(f"steps per seed: wsd family {result['wsd_family_steps']} (stable trunk + decays), cosine runs "
          f"{result['cosine_family_steps']}; the {top}-step branch equals the trunk bitwise for every seed: "
          f"{result['top_branch_bitwise_equal_to_trunk']}")
    if common.save_from_args(args, result) is not None:
        common.seed_errorbars({"metric": "val_bpb", "arms": {f"{arm} {n}": by_budget[n]["arms"][arm]
                                                             for n in budgets for arm in ("cosine", "wsd")}},
                              common.RESULTS / "wsd_branches.png", "val bits/byte")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
