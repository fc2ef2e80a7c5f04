"""An autoregressive model and a masked-diffusion model of the same size, trained for the same wall time on the
default corpus (M20 §19), then compared on validation bits per byte and on generation speed.

Models: experiments/configs/dense.json (the main job's model) trained on next-token cross-entropy, and the same
blocks made bidirectional (``causal = false``) trained on the masked-diffusion NELBO (``--objective diffusion``;
its tokenizer has one more special token, <|mask|>, inside the same 1024-token vocabulary). Each model's step
time is measured first (after compiling) and its step count set so that its training loop lasts --seconds, with
the main job's other settings; each run is a normal `mlx-llm train` run directory under --out.

Reported: val bits/byte (exact for AR; an upper bound for diffusion, the NELBO on the same val text with fixed
noise), and generation tokens/s at batch 1 for --length new tokens after a one-token prompt: AR through
`generate` (greedy, cached: one forward of one token per new token), diffusion through the ancestral sampler
with S = 16, 64, 256 steps (S full forwards over the whole sequence; no cache, M20 §19 Figure 6). Times are the
best of --repeats after compiling; tokens/s = length / seconds. Writes results.json into --out.

    python experiments/diffusion_vs_ar.py --out runs/diffusion_vs_ar [--seconds 120 --length 128]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import jax
import numpy as np

from mlx_llm import ModelConfig, generate
from mlx_llm.recipes import MAIN_JOB_TRAIN, MAIN_JOB_VOCAB
from mlx_llm.decode.diffusion import sample
from mlx_llm.train import tokenizer as tok_lib
from mlx_llm.train.checkpoint import read_run_files
from mlx_llm.train.run import DataSpec, load_params, train_run
from moe_vs_dense import seconds_per_step

CONFIGS = Path(__file__).parent / "configs"
STEPS = (16, 64, 256)


def best_seconds(fn, repeats: int) -> float:
    jax.block_until_ready(fn())  # compile
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seconds", type=float, default=120.0, help="training-loop wall time per model")
    ap.add_argument("--length", type=int, default=128, help="tokens generated per timed generation")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--data", help="corpus (default: the Python standard library)")
    ap.add_argument("--cache-dir", type=Path)
    args = ap.parse_args()
    base = dataclasses.replace(MAIN_JOB_TRAIN, log_interval=5)
    spec = DataSpec(path=args.data, vocab_size=MAIN_JOB_VOCAB)
    ar_cfg = ModelConfig.from_json(CONFIGS / "dense.json")
    models = {"ar": (ar_cfg, "ar"), "diffusion": (dataclasses.replace(ar_cfg, causal=False), "diffusion")}
    results = {}
    for name, (cfg, objective) in models.items():
        tcfg = dataclasses.replace(base, objective=objective)
        sps = seconds_per_step(cfg, tcfg, mask_id=cfg.vocab_size - 1 if objective == "diffusion" else None)
        steps = max(base.warmup_steps + 1, int(args.seconds / sps))
        print(f"{name}: {sps * 1e3:.1f} ms/step → {steps} steps in {args.seconds:.0f} s", flush=True)
        tcfg = dataclasses.replace(tcfg, steps=steps, eval_interval=steps, checkpoint_interval=steps)
        summary = train_run(args.out / name, cfg, tcfg, spec, cache_dir=args.cache_dir, show_progress=False,
                            log=lambda *a: None)
        cfg, tcfg, _ = read_run_files(args.out / name)
        params = load_params(args.out / name, cfg, tcfg)
        tok = tok_lib.load(args.out / name)
        prompt = np.array([[tok.bos_id]], np.int32)
        if objective == "ar":
            gen = {"cached": args.length / best_seconds(
                lambda: generate(params, cfg, prompt, args.length).tokens, args.repeats)}
        else:
            gen = {f"S={s}": args.length / best_seconds(
                lambda s=s: sample(params, cfg, prompt, args.length, steps=s, mask_id=tok.mask_id), args.repeats)
                for s in STEPS}
        results[name] = {"params": cfg.param_count(), "step_seconds": sps, "steps": steps,
                         "val_bpb": summary["val_bpb"], "val_bpb_is_bound": objective == "diffusion",
                         "train_tokens_per_second": summary["tokens_per_second"],
                         "generation_tokens_per_second": gen, "sample": summary["sample"]}
        print(name, json.dumps({k: v for k, v in results[name].items() if k != "sample"}), flush=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"{'model':10s} {'params':>9s} {'steps':>6s} {'val bpb':>9s} {'train tok/s':>11s}  generation tokens/s "
          f"({args.length} tokens, batch 1)")
    for name, r in results.items():
        bpb = f"≤{r['val_bpb']:.4f}" if r["val_bpb_is_bound"] else f"{r['val_bpb']:.4f}"
        gen = ", ".join(f"{k} {v:,.0f}" for k, v in r["generation_tokens_per_second"].items())
        print(f"{name:10s} {r['params']:9,d} {r['steps']:6d} {bpb:>9s} {r['train_tokens_per_second']:11,.0f}  {gen}")


if __name__ == "__main__":
    main()
