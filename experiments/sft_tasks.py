"""Chat fine-tuning of the main job's pretrained model on the built-in tasks, full against LoRA, for the same wall
time (M20 §16, U19 §9–§10).

First the main job's model is pretrained (`mlx-llm train` defaults: experiments/configs/dense.json, 400 steps on the
standard library) unless --base names an existing run. Then, for each --tasks entry, two `mlx-llm sft` runs from it,
each trained for --seconds (its step time is measured first, after compiling, and its step count set to fit):
full fine-tuning, and LoRA with rank --rank on wq, wv (U19 §10's rule of thumb) plus the FFN's w_up, w_down.
Reported per run: held-out exact match before (the base) and after, on --eval-examples held-out problems, trainable
parameters and training tokens/s. Writes results.json into --out.

    python experiments/sft_tasks.py --out runs/sft_tasks [--base runs/main] [--tasks addition2] [--seconds 300]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import jax
import numpy as np

from mlx_llm.recipes import MAIN_JOB_MODEL, MAIN_JOB_TRAIN, MAIN_JOB_VOCAB, SFT_TRAIN
from mlx_llm.post import lora as lora_lib
from mlx_llm.post.chat import ChatTemplate
from mlx_llm.post.sft import load_base, load_data, sft_run
from mlx_llm.train import tokenizer as tok_lib
from mlx_llm.train.parallel import make_mesh, replicated
from mlx_llm.train.run import DataSpec, train_run
from mlx_llm.train.step import device_batch, init_state, jit_train_step, optimizer_for


def sft_seconds_per_step(base_run: Path, tcfg, task: str, lora_cfg, rounds: int = 5) -> float:
    """Median wall time of one jitted SFT step (full or LoRA) on real packed task rows, compiled first."""
    cfg, _, params, _ = load_base(base_run)
    tok = tok_lib.load(base_run)
    data = load_data(tok, ChatTemplate(), tcfg.seq_len, task=task, n_train=2000, seed=0)
    mesh = make_mesh()
    trainable = params if lora_cfg is None else lora_lib.init(params, lora_cfg, jax.random.key(0))
    extra = () if lora_cfg is None else (jax.device_put(params, replicated(mesh)),)
    step = jit_train_step(cfg, tcfg, mesh, None, lora_cfg)
    state = jax.device_put(init_state(cfg, tcfg, optimizer_for(tcfg), trainable), replicated(mesh))
    batch = device_batch(data.train_batch(0, batch_size=tcfg.batch_size, seq_len=tcfg.seq_len, seed=0), mesh)
    state, m = step(state, batch, *extra)
    jax.block_until_ready(m)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        state, m = step(state, batch, *extra)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--base", type=Path, help="a pretrained run (default: train the main job into OUT/base)")
    ap.add_argument("--tasks", default="addition2,arithmetic,name_function")
    ap.add_argument("--seconds", type=float, default=300.0, help="training-loop wall time per SFT run")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--lr", type=float, default=SFT_TRAIN.lr)
    ap.add_argument("--lora-lr", type=float, default=1e-2, help="adapters usually want a larger step")
    ap.add_argument("--eval-examples", type=int, default=500)
    args = ap.parse_args()
    base = args.base
    if base is None:
        base = args.out / "base"
        if not (base / "config.json").is_file():
            train_run(base, MAIN_JOB_MODEL, MAIN_JOB_TRAIN, DataSpec(vocab_size=MAIN_JOB_VOCAB), show_progress=False,
                      log=lambda *a: None)
    lora_cfg = lora_lib.LoRAConfig(rank=args.rank, alpha=2.0 * args.rank, targets=("wq", "wv", "w_up", "w_down"))
    results = {}
    for task in [t for t in args.tasks.split(",") if t]:
        seq_len = 256 if task == "name_function" else SFT_TRAIN.seq_len
        for mode, lcfg, lr in (("full", None, args.lr), ("lora", lora_cfg, args.lora_lr)):
            tcfg = dataclasses.replace(SFT_TRAIN, seq_len=seq_len, lr=lr)
            sps = sft_seconds_per_step(base, tcfg, task, lcfg)
            steps = max(tcfg.warmup_steps + 1, int(args.seconds / sps))
            tcfg = dataclasses.replace(tcfg, steps=steps, eval_interval=steps, checkpoint_interval=steps)
            name = f"{task}-{mode}"
            print(f"{name}: {sps * 1e3:.0f} ms/step → {steps} steps in {args.seconds:.0f} s", flush=True)
            summary = sft_run(args.out / name, base, tcfg=tcfg, task=task, lora_cfg=lcfg,
                              eval_examples=args.eval_examples, show_progress=False, log=lambda *a: None)
            results[name] = {k: summary[k] for k in ("base_heldout_accuracy", "heldout_accuracy", "heldout_examples",
                                                      "trainable_params", "tokens_per_second", "train_seconds")}
            results[name]["steps"] = steps
            print(name, json.dumps(results[name]), flush=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"{'run':22s} {'trainable':>10s} {'steps':>6s} {'tok/s':>8s} {'before':>7s} {'after':>7s}")
    for name, r in results.items():
        print(f"{name:22s} {r['trainable_params']:10,d} {r['steps']:6d} {r['tokens_per_second']:8,.0f} "
              f"{r['base_heldout_accuracy']:7.1%} {r['heldout_accuracy']:7.1%}")


if __name__ == "__main__":
    main()
