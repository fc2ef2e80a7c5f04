"""An autoregressive model and a masked-diffusion model of the same size, trained for the same wall time on the
default corpus (M20 §19), then compared on validation bits per byte and on generation speed.

Models: experiments/configs/dense.json (the main job's model) trained on next-token cross-entropy, and the same
blocks made bidirectional (``causal = false``) trained on the masked-diffusion NELBO (``--objective diffusion``;
its tokenizer has one more special token, <|mask|>, inside the same 1024-token vocabulary). Each model's step
count is set by the library's time budget (``fit_time_budget``: the step timed on the run's first batch after
compiling, as `mlx-llm train --time-budget` does) so that its training loop lasts --seconds, with the main job's
other settings; each run is a normal `mlx-llm train` run directory under --out.

Reported: val bits/byte (exact for AR; an upper bound for diffusion, the NELBO on the same val text with fixed
noise), and generation tokens/s at batch 1 for --length new tokens after a one-token prompt: AR through
`generate` (greedy, cached: one forward of one token per new token), diffusion through the ancestral sampler
with S = 16, 64, 256 steps (S full forwards over the whole sequence; no cache, M20 §19 Figure 6). Times are the
best of --repeats after compiling; tokens/s = length / seconds; ``step_seconds`` is the training loop's measured
seconds per step. The training repeats for each seed (``--seeds K``: seeds 0 … K − 1 under OUT/seed<S>; a seed
fixes the initial parameters, the batch order and the diffusion noise) and diffusion's bound is compared with AR's
bits/byte as the mean over seeds with its 95 % interval and the paired t-test's p-value
(``experiments.common.seed_statistics``); generation speed is measured on seed 0's models. Writes results.json
into --out and experiments/results/diffusion_vs_ar.json (``--save``).

    python -m experiments.diffusion_vs_ar --out runs/diffusion_vs_ar [--seconds 120 --length 128 --seeds 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np

from experiments import common
from experiments.common import CONFIGS
from mlx_llm import ModelConfig, generate
from mlx_llm.decode.diffusion import sample
from mlx_llm.recipes import ADAMW_TRAIN, MAIN_JOB_VOCAB
from mlx_llm.data import tokenizer as tok_lib
from mlx_llm.runs.configs import DataSpec
from mlx_llm.runs.load import load_params
from mlx_llm.runs.record import open_run

STEPS = (16, 64, 256)


def best_seconds(fn, repeats: int) -> float:
    """Best of ``repeats`` calls of ``fn()`` after one compiling call."""
    return common.time_steps(fn, warmup=1, rounds=repeats, stat=min)


def one_run(out: Path, name: str, cfg: ModelConfig, objective: str, base, spec, args, timed: bool) -> dict:
    """One model trained for --seconds on ``objective`` under ``out``/``name`` (with ``timed``: its generation
    speeds too)."""
    tcfg = dataclasses.replace(base, objective=objective)
    summary = common.train_for_seconds(out / name, cfg, tcfg, spec, args.seconds, cache_dir=args.cache_dir,
                                       label=f"{out.name} {name}")
    cfg = open_run(out / name).cfg
    row = {"params": cfg.param_count(), "step_seconds": summary["step_seconds"], "steps": summary["steps"],
           "val_bpb": summary["val_bpb"], "val_bpb_is_bound": objective == "diffusion",
           "train_tokens_per_second": summary["tokens_per_second"], "sample": summary["sample"]}
    if timed:
        params = load_params(out / name)
        tok = tok_lib.load(out / name)
        prompt = tok.bos_prefix[None].astype(np.int32)
        if objective == "ar":
            gen = {"cached": args.length / best_seconds(
                lambda: generate(params, cfg, prompt, args.length).tokens, args.repeats)}
        else:
            gen = {f"S={s}": args.length / best_seconds(
                lambda s=s: sample(params, cfg, prompt, args.length, steps=s, mask_id=tok.mask_id), args.repeats)
                for s in STEPS}
        row["generation_tokens_per_second"] = gen
    print(out.name, name, json.dumps({k: v for k, v in row.items() if k != "sample"}), flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seconds", type=float, default=120.0, help="training-loop wall time per model")
    ap.add_argument("--length", type=int, default=128, help="tokens generated per timed generation")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--data", help="corpus (default: the Python standard library)")
    ap.add_argument("--cache-dir", type=Path)
    common.add_seeds_argument(ap)
    common.add_save_argument(ap, "diffusion_vs_ar")
    args = ap.parse_args(argv)
    seeds = common.check_seeds(args.seeds)
    base = dataclasses.replace(ADAMW_TRAIN, log_interval=5)
    spec = DataSpec(path=args.data, vocab_size=MAIN_JOB_VOCAB)
    ar_cfg = ModelConfig.from_json(CONFIGS / "dense.json")
    models = {"ar": (ar_cfg, "ar"), "diffusion": (dataclasses.replace(ar_cfg, causal=False), "diffusion")}
    rows = common.run_seeds(models, seeds, lambda name, seed: one_run(
        args.out / f"seed{seed}", name, *models[name], dataclasses.replace(base, seed=seed), spec, args,
        timed=seed == 0))
    statistics = common.seed_statistics(rows, "val_bpb", baseline="ar")
    results = {"seeds": seeds, "seconds": args.seconds, "runs": rows, "statistics": statistics,
               "generation_tokens_per_second": {r["arm"]: r["generation_tokens_per_second"]
                                                for r in rows if r["seed"] == 0},
               "arguments": common.arguments(args)}
    common.save_result("results", results, args.out)
    common.save_from_args(args, results)
    print(f"{'model':13s} {'params':>9s} {'steps':>6s} {'val bpb':>9s} {'train tok/s':>11s}")
    for r in rows:
        bpb = f"≤{r['val_bpb']:.4f}" if r["val_bpb_is_bound"] else f"{r['val_bpb']:.4f}"
        print(f"{r['arm'] + ' s' + str(r['seed']):13s} {r['params']:9,d} {r['steps']:6d} {bpb:>9s} "
              f"{r['train_tokens_per_second']:11,.0f}")
    for name, gen in results["generation_tokens_per_second"].items():
        print(f"{name}: generation tokens/s ({args.length} tokens, batch 1): "
              + ", ".join(f"{k} {v:,.0f}" for k, v in gen.items()))
    print(f"val bits/byte over seeds 0–{seeds - 1} (diffusion's is a bound), {args.seconds:g} s of training loop each:")
    for line in common.seed_lines(statistics):
        print("  " + line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
