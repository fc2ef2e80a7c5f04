"""Attention, Mamba and a hybrid of similar size, trained for the same wall time on the default corpus
(M20 §19), then decoded at batch 1 at several contexts.

Models (experiments/configs/): dense.json (the main job's attention model, 869,504 parameters), mamba.json
(6 Mamba-1 layers, no FFN, 830,848), hybrid.json (Mamba / attention+SwiGLU alternating, 733,568). Each model's
step count is set by the library's time budget (``fit_time_budget``: the step timed on the run's first batch
after compiling, as `mlx-llm train --time-budget` does) so that its training loop lasts --seconds, with the main
job's other training settings; each run is a normal `mlx-llm train` run directory under --out.
Then, for each trained model: decode steps/s at batch 1 (a jitted one-token cached step; prefill excluded) after
prompts of 128 / 512 / 2048 tokens, and the decode state's bytes at those contexts (`accounting.
decode_state_bytes`: the KV cache grows with the context, the Mamba state does not). ``step_seconds`` and
``train_tokens_per_second`` are the training loop's own. Writes results.json into --out and
experiments/results/ssm_vs_attention.json (``--save``).

    python -m experiments.ssm_vs_attention --out runs/ssm_vs_attention [--seconds 120]
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
from mlx_llm.decode.state import forward_cached, init_cache, unstack_layers
from mlx_llm.recipes import MAIN_JOB_TRAIN, MAIN_JOB_VOCAB
from mlx_llm.scaling.accounting import decode_state_bytes
from mlx_llm.runs.configs import DataSpec
from mlx_llm.runs.load import load_params
from mlx_llm.runs.record import open_run

CONTEXTS = (128, 512, 2048)


def decode_tokens_per_second(params, cfg: ModelConfig, context: int, new_tokens: int) -> float:
    """Decode steps per second at batch 1 after a random prompt of ``context`` tokens: the state is prefilled
    once, then a jitted one-token ``forward_cached`` step (the body of `generate`'s loop) is timed over
    ``new_tokens`` steps, so the prefill is not counted."""
    cfg = dataclasses.replace(cfg, max_seq_len=context + new_tokens + 1)  # the weights do not depend on it
    prompt = np.random.default_rng(0).integers(3, cfg.vocab_size, (1, context)).astype(np.int32)
    layers = unstack_layers(params, cfg)
    prefill = jax.jit(lambda p, t, s: forward_cached(p, t, s, cfg))
    step = jax.jit(lambda layers, p, t, s: forward_cached(p, t, s, cfg, layers=layers), donate_argnums=3)
    _, state = prefill(params, prompt, init_cache(cfg, 1, context + new_tokens + 1))
    token = np.array([[5]], np.int32)

    def one_step(s):
        logits, s = step(layers, params, token, s)
        return s, logits

    decode = common.carry(one_step, state)
    common.seconds(decode)  # compile

    def steps():
        for _ in range(new_tokens - 1):
            decode()
        return decode.last()

    return (new_tokens - 1) / common.seconds(steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seconds", type=float, default=120.0, help="training-loop wall time per model")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--data", help="corpus (default: the Python standard library)")
    ap.add_argument("--cache-dir", type=Path)
    common.add_save_argument(ap, "ssm_vs_attention")
    args = ap.parse_args()
    base = dataclasses.replace(MAIN_JOB_TRAIN, log_interval=5)
    spec = DataSpec(path=args.data, vocab_size=MAIN_JOB_VOCAB)
    results = {}
    for name in ("dense", "mamba", "hybrid"):
        cfg = ModelConfig.from_json(CONFIGS / f"{name}.json")
        summary = common.train_for_seconds(args.out / name, cfg, base, spec, args.seconds, cache_dir=args.cache_dir)
        cfg = open_run(args.out / name).cfg
        params = load_params(args.out / name)
        results[name] = {
            "params": cfg.param_count(), "step_seconds": summary["step_seconds"], "steps": summary["steps"],
            "val_bpb": summary["val_bpb"], "train_tokens_per_second": summary["tokens_per_second"],
            "decode_tokens_per_second": {c: decode_tokens_per_second(params, cfg, c, args.new_tokens)
                                         for c in CONTEXTS},
            "decode_state_bytes": {c: decode_state_bytes(cfg, c) for c in CONTEXTS}}
        print(name, json.dumps(results[name]))
    common.save_result("results", results, args.out)
    common.save_from_args(args, results)
    print(f"{'model':7s} {'params':>9s} {'steps':>6s} {'val bpb':>8s} {'train tok/s':>11s} "
          + " ".join(f"{'dec/s@' + str(c):>10s}" for c in CONTEXTS) + " "
          + " ".join(f"{'state@' + str(c):>11s}" for c in CONTEXTS))
    for name, r in results.items():
        print(f"{name:7s} {r['params']:9,d} {r['steps']:6d} {r['val_bpb']:8.4f} {r['train_tokens_per_second']:11,.0f} "
              + " ".join(f"{r['decode_tokens_per_second'][c]:10.1f}" for c in CONTEXTS) + " "
              + " ".join(f"{r['decode_state_bytes'][c]:11,d}" for c in CONTEXTS))


if __name__ == "__main__":
    main()
