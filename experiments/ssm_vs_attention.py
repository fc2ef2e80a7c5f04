"""Attention, Mamba and a hybrid of similar size, trained for the same wall time on the default corpus
(M20 §19), then decoded at batch 1 at several contexts.

Models (experiments/configs/): dense.json (the main job's attention model before the knobs, 869,504 parameters), mamba.json
(6 Mamba-1 layers, no FFN, 830,848), hybrid.json (Mamba / attention+SwiGLU alternating, 733,568). Each model's
step count is set by the library's time budget (``fit_time_budget``: the step timed on the run's first batch
after compiling, as `mlx-llm train --time-budget` does) so that its training loop lasts --seconds, with the main
job's other training settings; each run is a normal `mlx-llm train` run directory under --out.
Then, for each trained model: decode steps/s at batch 1 (a jitted one-token cached step; prefill excluded) after
prompts of 128 / 512 / 2048 tokens, and the decode state's bytes at those contexts (`accounting.
decode_state_bytes`: the KV cache grows with the context, the Mamba state does not). ``step_seconds`` and
``train_tokens_per_second`` are the training loop's own. The training repeats for each seed (``--seeds K``:
seeds 0 … K − 1 under OUT/seed<S>; a seed fixes the initial parameters and the batch order) and each model's val
bits/byte is compared with attention's as the mean over seeds with its 95 % interval and the paired t-test's
p-value (``experiments.common.seed_statistics``); decoding speed does not depend on the weights' values and is
measured on seed 0's models. Writes results.json into --out and experiments/results/ssm_vs_attention.json
(``--save``).

    python -m experiments.ssm_vs_attention --out runs/ssm_vs_attention [--seconds 120 --seeds 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import jax
import numpy as np

from experiments import common
from experiments.common import CONFIGS
from mlx_llm import ModelConfig
from mlx_llm.decode import step as step_lib
from mlx_llm.decode.sampling import DecodeSettings, SamplingRows
from mlx_llm.decode.state import init_cache, unstack_layers
from mlx_llm.recipes import ADAMW_TRAIN, MAIN_JOB_VOCAB
from mlx_llm.scaling.accounting import decode_state_bytes
from mlx_llm.runs.configs import DataSpec
from mlx_llm.runs.load import load_params
from mlx_llm.runs.record import open_run

CONTEXTS = (128, 512, 2048)


def decode_tokens_per_second(params, cfg: ModelConfig, context: int, new_tokens: int) -> float:
    """Decode steps per second at batch 1 after a random prompt of ``context`` tokens: the state is prefilled
    once (``decode.step.prefill``), then the library's jitted one-token step (``decode.step.step``, the body of
    `generate`'s loop) is timed over ``new_tokens`` steps, so the prefill is not counted."""
    cfg = dataclasses.replace(cfg, max_seq_len=context + new_tokens + 1)  # the weights do not depend on it
    prompt = np.random.default_rng(0).integers(3, cfg.vocab_size, (1, context)).astype(np.int32)
    layers = unstack_layers(params, cfg)
    _, state = step_lib.prefill(params, init_cache(cfg, 1, context + new_tokens + 1), prompt,
                                np.array([context], np.int32), cfg=cfg)
    token, active, greedy, key = np.array([5], np.int32), np.ones((1,), bool), SamplingRows.of(DecodeSettings()), \
        jax.random.key(0)

    def one_step(s):
        picked, s = step_lib.step(params, s, token, active, greedy, key, cfg=cfg, layers=layers)
        return s, picked.tokens

    decode = common.carry(one_step, state)
    common.seconds(decode)  # compile

    def steps():
        for _ in range(new_tokens - 1):
            decode()
        return decode.last()

    return (new_tokens - 1) / common.seconds(steps)


def one_run(out: Path, name: str, base, spec, args, decode: bool) -> dict:
    """One model trained for --seconds under ``out``/``name`` (with ``decode``: its decoding speeds too)."""
    cfg = ModelConfig.from_json(CONFIGS / f"{name}.json")
    summary = common.train_for_seconds(out / name, cfg, base, spec, args.seconds, cache_dir=args.cache_dir,
                                       label=f"{out.name} {name}")
    cfg = open_run(out / name).cfg
    row = {"params": cfg.param_count(), "step_seconds": summary["step_seconds"], "steps": summary["steps"],
           "val_bpb": summary["val_bpb"], "train_tokens_per_second": summary["tokens_per_second"],
           "decode_state_bytes": {c: decode_state_bytes(cfg, c) for c in CONTEXTS}}
    if decode:
        params = load_params(out / name)
        row["decode_tokens_per_second"] = {c: decode_tokens_per_second(params, cfg, c, args.new_tokens)
                                           for c in CONTEXTS}
    print(out.name, name, json.dumps(row), flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seconds", type=float, default=120.0, help="training-loop wall time per model")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--data", help="corpus (default: the Python standard library)")
    ap.add_argument("--cache-dir", type=Path)
    common.add_seeds_argument(ap)
    common.add_save_argument(ap, "ssm_vs_attention")
    args = ap.parse_args(argv)
    seeds = common.check_seeds(args.seeds)
    base = dataclasses.replace(ADAMW_TRAIN, log_interval=5)
    spec = DataSpec(path=args.data, vocab_size=MAIN_JOB_VOCAB)
    models = ("dense", "mamba", "hybrid")
    rows = common.run_seeds(models, seeds, lambda name, seed: one_run(
        args.out / f"seed{seed}", name, dataclasses.replace(base, seed=seed), spec, args, decode=seed == 0))
    statistics = common.seed_statistics(rows, "val_bpb", baseline="dense")
    results = {"seeds": seeds, "seconds": args.seconds, "runs": rows, "statistics": statistics,
               "decode": {r["arm"]: {"decode_tokens_per_second": r["decode_tokens_per_second"],
                                     "decode_state_bytes": r["decode_state_bytes"]} for r in rows if r["seed"] == 0},
               "arguments": common.arguments(args)}
    common.save_result("results", results, args.out)
    common.save_from_args(args, results)
    print(f"{'model':12s} {'params':>9s} {'steps':>6s} {'val bpb':>8s} {'train tok/s':>11s}")
    for r in rows:
        print(f"{r['arm'] + ' s' + str(r['seed']):12s} {r['params']:9,d} {r['steps']:6d} {r['val_bpb']:8.4f} "
              f"{r['train_tokens_per_second']:11,.0f}")
    print(f"{'model':7s} " + " ".join(f"{'dec/s@' + str(c):>10s}" for c in CONTEXTS) + " "
          + " ".join(f"{'state@' + str(c):>11s}" for c in CONTEXTS))
    for name, d in results["decode"].items():
        print(f"{name:7s} " + " ".join(f"{d['decode_tokens_per_second'][c]:10.1f}" for c in CONTEXTS) + " "
              + " ".join(f"{d['decode_state_bytes'][c]:11,d}" for c in CONTEXTS))
    print(f"val bits/byte over seeds 0–{seeds - 1}, {args.seconds:g} s of training loop each:")
    for line in common.seed_lines(statistics):
        print("  " + line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
