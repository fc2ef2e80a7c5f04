"""Warmup-stable-decay branches against cosine runs of the same budgets, on the default corpus (issue: the
researcher's workflow; Hägele et al. 2024, "Scaling laws and compute-optimal training beyond fixed training
durations").

One WSD run of the largest budget (the main job's model and settings, ``--schedule wsd --decay-fraction F``,
1-sqrt decay) checkpoints at the start of each smaller budget's decay; each smaller budget N is a branch
(``mlx-llm train --branch-from RUN --branch-step (1 − F)·N --steps N``) that decays from there. The largest
budget is the WSD run itself. Each budget also gets its own cosine run (the main job's schedule). Reported per
budget: the final val bits/byte on the whole val split of both, and the optimizer steps each way costs: the
branches share the stable run, so the WSD family costs N_max + F·Σ N_smaller steps against Σ N for the cosine
runs. Every run is a normal run directory under --out.

    python -m experiments.wsd_branches --out runs/wsd           # budgets 175, 350, 700 (≈ 14 min on 2 cores)
    python -m experiments.wsd_branches --out /tmp/w --quick     # tiny budgets (a smoke run)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from experiments import common
from mlx_llm.recipes import MAIN_JOB_MODEL, MAIN_JOB_TRAIN, MAIN_JOB_VOCAB
from mlx_llm.runs.branch import Branch
from mlx_llm.runs.configs import DataSpec
from mlx_llm.train.run import train_run


def run(out: Path, tcfg, spec, cache_dir, branch=None) -> dict:
    """One run (or branch) quietly; its summary."""
    summary = train_run(out, None if branch else MAIN_JOB_MODEL, None if branch else tcfg,
                        None if branch else spec, show_progress=False, cache_dir=cache_dir, sample_tokens=8,
                        log=lambda *a: None, branch=branch)
    print(f"{out.name}: {summary['steps']} steps, val bits/byte {summary['val_bpb']:.4f}, "
          f"{summary['train_seconds']:.0f} s", flush=True)
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budgets", default="175,350,700", help="optimizer steps per budget, comma-separated")
    ap.add_argument("--decay-fraction", type=float, default=0.2)
    ap.add_argument("--data", help="corpus (default: the Python standard library)")
    ap.add_argument("--cache-dir", type=Path)
    ap.add_argument("--quick", action="store_true", help="budgets 10,20 of tiny batches (a smoke run)")
    common.add_save_argument(ap, "wsd_branches")
    args = ap.parse_args(argv)
    budgets = sorted(int(b) for b in ("10,20" if args.quick else args.budgets).split(","))
    F, top = args.decay_fraction, budgets[-1]
    starts = {n: n - max(1, round(F * n)) for n in budgets}  # the step each budget's decay starts at
    interval = min(s for n, s in starts.items())
    if any(s % interval for s in starts.values()):
        raise SystemExit(f"the decay starts {sorted(starts.values())} must be multiples of the smallest (checkpoints)")
    base = dataclasses.replace(MAIN_JOB_TRAIN, eval_interval=top, checkpoint_interval=interval, keep_checkpoints=top,
                               log_interval=25)
    if args.quick:
        base = dataclasses.replace(base, batch_size=4, seq_len=32, warmup_steps=2, eval_tokens=512, log_interval=4)
    spec = DataSpec(path=args.data, vocab_size=MAIN_JOB_VOCAB)
    wsd_cfg = dataclasses.replace(base, steps=top, schedule="wsd", decay_fraction=F)
    wsd = {top: run(args.out / f"wsd-{top}", wsd_cfg, spec, args.cache_dir)}
    for n in budgets[:-1]:
        wsd[n] = run(args.out / f"wsd-{n}", None, None, args.cache_dir,
                     Branch(args.out / f"wsd-{top}", starts[n], {"steps": n}))
    cosine = {n: run(args.out / f"cosine-{n}", dataclasses.replace(base, steps=n, eval_interval=n,
                                                                 checkpoint_interval=n), spec, args.cache_dir)
              for n in budgets}
    rows = [{"budget_steps": n, "wsd_val_bpb": wsd[n]["val_bpb"], "cosine_val_bpb": cosine[n]["val_bpb"],
             "branch_step": None if n == top else starts[n],
             "wsd_steps_run": top if n == top else n - starts[n], "cosine_steps_run": n} for n in budgets]
    result = {"rows": rows, "decay_fraction": F, "decay_shape": wsd_cfg.decay_shape,
              "wsd_family_steps": sum(r["wsd_steps_run"] for r in rows),
              "cosine_family_steps": sum(budgets), "train": dataclasses.asdict(base), "model": MAIN_JOB_MODEL.to_dict()}
    (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    for r in rows:
        print(f"budget {r['budget_steps']:>5} steps: wsd {r['wsd_val_bpb']:.4f}, cosine {r['cosine_val_bpb']:.4f} "
              f"bits/byte")
    print(f"steps: wsd family {result['wsd_family_steps']}, cosine runs {result['cosine_family_steps']}")
    common.save_from_args(args, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
