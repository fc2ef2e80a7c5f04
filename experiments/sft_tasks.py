"""Chat fine-tuning of the main job's pretrained model on the built-in tasks, full against LoRA, for the same wall
time (M20 §16, U19 §9–§10).

First the main job's model is pretrained (`mlx-llm train` defaults: experiments/configs/dense.json, 400 steps on the
standard library) unless --base names an existing run. Then, for each --tasks entry, two `mlx-llm sft` runs from it,
each trained for --seconds (its step time is measured first, after compiling, and its step count set to fit):
full fine-tuning, and LoRA with rank --rank on wq, wv (U19 §10's rule of thumb) plus the FFN's w_up, w_down.
Reported per run: held-out exact match before (the base) and after, on --eval-examples held-out problems, trainable
parameters, training tokens/s and the wall budget (``seconds_budget``). The step counts are set once per task and
mode, then each pair of runs repeats for each seed (``--seeds K``: seeds 0 … K − 1 under OUT/seed<S>; a seed fixes
the LoRA adapters' initialisation and the batch order), and LoRA's held-out exact match is compared with full
fine-tuning's per task as the mean over seeds with its 95 % interval and the paired t-test's p-value
(``experiments.common.seed_statistics``). Writes results.json into --out and experiments/results/sft_tasks.json
(``--save``).

    python -m experiments.sft_tasks --out runs/sft_tasks [--base runs/main] [--tasks addition2] [--seconds 300]
    python -m experiments.sft_tasks --out /tmp/s --tasks addition2 --seconds 5 --eval-examples 20 --seeds 2 --save ""
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from experiments import common
from mlx_llm import lora as lora_lib
from mlx_llm.post.sft import sft_run
from mlx_llm.recipes import BASE_MODEL, ADAMW_TRAIN, MAIN_JOB_VOCAB, SFT_TRAIN
from mlx_llm.runs.configs import DataSpec, SFTConfig
from mlx_llm.runs.pretrain import train_run


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--base", type=Path, help="a pretrained run (default: train the main job into OUT/base)")
    ap.add_argument("--tasks", default="addition2,arithmetic,name_function")
    ap.add_argument("--seconds", type=float, default=300.0, help="training-loop wall time per SFT run")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--lr", type=float, default=SFT_TRAIN.lr)
    ap.add_argument("--lora-lr", type=float, default=1e-2, help="adapters usually want a larger step")
    ap.add_argument("--eval-examples", type=int, default=500)
    common.add_seeds_argument(ap)
    common.add_save_argument(ap, "sft_tasks")
    args = ap.parse_args(argv)
    base = args.base
    if base is None:
        base = args.out / "base"
        if not (base / "config.json").is_file():
            train_run(base, BASE_MODEL, ADAMW_TRAIN, DataSpec(vocab_size=MAIN_JOB_VOCAB), show_progress=False,
                      log=lambda *a: None)
    seeds = common.check_seeds(args.seeds)
    lora_cfg = lora_lib.LoRAConfig(rank=args.rank, alpha=2.0 * args.rank, targets=("wq", "wv", "w_up", "w_down"))
    results = {"seeds": seeds, "seconds": args.seconds, "tasks": {}, "arguments": common.arguments(args)}
    for task in [t for t in args.tasks.split(",") if t]:
        seq_len = 256 if task == "name_function" else SFT_TRAIN.seq_len
        plans = {}
        for mode, lcfg, lr in (("full", None, args.lr), ("lora", lora_cfg, args.lora_lr)):
            tcfg, sps = common.sft_steps_for(base, dataclasses.replace(SFT_TRAIN, seq_len=seq_len, lr=lr), task,
                                             args.seconds, lcfg)
            plans[mode] = (tcfg, lcfg)
            print(f"{task}-{mode}: {sps * 1e3:.0f} ms/step → {tcfg.steps} steps in {args.seconds:.0f} s (every seed)",
                  flush=True)

        def run(mode: str, seed: int) -> dict:
            tcfg, lcfg = plans[mode]
            summary = sft_run(args.out / f"seed{seed}" / f"{task}-{mode}", base, lora_cfg=lcfg, show_progress=False,
                              tcfg=dataclasses.replace(tcfg, seed=seed), log=lambda *a: None,
                              settings=SFTConfig(task=task, eval_examples=args.eval_examples))
            row = {k: summary[k] for k in ("base_heldout_accuracy", "heldout_accuracy", "heldout_examples",
                                           "trainable_params", "tokens_per_second", "train_seconds")}
            row.update(steps=tcfg.steps, seconds_budget=args.seconds)
            print(f"{task}-{mode} seed {seed}", json.dumps(row), flush=True)
            return row

        rows = common.run_seeds(list(plans), seeds, run)
        results["tasks"][task] = {"runs": rows,
                                  "statistics": common.seed_statistics(rows, "heldout_accuracy", baseline="full")}
    common.save_result("results", results, args.out)
    common.save_from_args(args, results)
    print(f"{'run':26s} {'trainable':>10s} {'steps':>6s} {'tok/s':>8s} {'before':>7s} {'after':>7s}")
    for task, entry in results["tasks"].items():
        for r in entry["runs"]:
            print(f"{task + '-' + r['arm'] + ' s' + str(r['seed']):26s} {r['trainable_params']:10,d} {r['steps']:6d} "
                  f"{r['tokens_per_second']:8,.0f} {r['base_heldout_accuracy']:7.1%} {r['heldout_accuracy']:7.1%}")
    for task, entry in results["tasks"].items():
        print(f"{task}: held-out exact match over seeds 0–{seeds - 1}")
        for line in common.seed_lines(entry["statistics"]):
            print("  " + line)


if __name__ == "__main__":
    main()
