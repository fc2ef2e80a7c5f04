"""bf16 MFU of a 125M-parameter model's training step on one accelerator, against the peak measured in the same run.

The model is GPT-2-small-sized in our layout (d=768, L=12, 12 query / 4 kv heads of 64, SwiGLU m=2048, V=32768,
T=1024: 124M parameters with untied embeddings, see the first printed line). The step is the library's own
(`train.step.jit_train_step`: forward, backward, global-norm clipping, AdamW; bf16 compute with float32 master
weights, float32 logits and loss). The peak is the best bf16 `jnp.dot` of two 8192×8192 matrices in this
process (float32 accumulation), timed round-robin with the step; MFU = (FLOPs per token × tokens/s) / peak,
FLOPs per token from `accounting.train_flops_per_token` (6·N plus attention, PaLM's count). Target: ≥ 45%.

    python -m experiments.bench_gpu                 # on a GPU/TPU host
    python -m experiments.bench_gpu --quick         # a CPU smoke run of the same code (tiny model, float32 peak)

``gpt_config``, ``random_batch`` and ``measure_mfu`` are also the training part of experiments/device_check.py.
Writes experiments/results/bench_gpu.json (``--save``; nothing under --quick unless asked).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from mlx_llm import ModelConfig
from mlx_llm.config import TrainConfig
from mlx_llm.scaling.accounting import train_flops_per_token
from mlx_llm.train.parallel import make_mesh
from mlx_llm.train.step import device_batch, init_state, jit_train_step, optimizer_for, place_state


def gpt_config(d: int, L: int, V: int, T: int) -> ModelConfig:
    """The benchmark's model family: heads of 64 (a third as many K/V heads), SwiGLU width 8d/3 rounded to 64."""
    return ModelConfig(vocab_size=V, d_model=d, n_layers=L, n_heads=d // 64, n_kv_heads=max(1, d // 192),
                       d_head=64, d_ff=8 * d // 3 // 64 * 64, max_seq_len=T)


def random_batch(V: int, B: int, T: int, mesh) -> dict:
    """A language-model batch of uniform random tokens, one document per row, placed on ``mesh``."""
    rng = np.random.default_rng(0)
    return device_batch({"tokens": rng.integers(0, V, (B, T), dtype=np.int32),
                         "targets": rng.integers(0, V, (B, T), dtype=np.int32),
                         "mask": np.ones((B, T), np.float32), "segment_ids": np.zeros((B, T), np.int32),
                         "positions": np.tile(np.arange(T, dtype=np.int32), (B, 1))}, mesh)


def measure_mfu(step, state, batch, cfg: ModelConfig, tcfg: TrainConfig, *, peak_n: int, rounds: int,
                devices: int = 1) -> dict:
    """``step`` (state, batch) → (state, metrics) timed round-robin with the best ``jnp.dot`` of two peak_n²
    matrices of the compute dtype (best of 3 per round); MFU = FLOPs per token × tokens/s / (peak × devices)."""
    dot, dot_flops = common.matmul_timer(peak_n, tcfg.compute_dtype)
    train = common.carry(step, state, batch)
    times = common.interleaved_times({"dot": dot, "step": lambda: common.seconds(train)}, warmup=1, rounds=rounds,
                                     self_timed=True)
    step_s, peak = float(np.median(times["step"])), dot_flops / min(times["dot"])
    per_token, tokens = train_flops_per_token(cfg, tcfg.seq_len), tcfg.batch_size * tcfg.seq_len
    achieved = per_token * tokens / step_s
    return {"params": cfg.param_count(), "flops_per_token": per_token, "step_seconds": times["step"],
            "median_step_seconds": step_s, "tokens_per_second": tokens / step_s, "peak_flops": peak,
            "achieved_flops": achieved, "mfu": achieved / (peak * devices), "loss": float(train.last()["loss"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--remat", default="none", choices=("none", "full", "dots"))
    ap.add_argument("--quick", action="store_true", help="d=128, L=2, T=128, batch 4, float32: a CPU smoke run")
    ap.add_argument("--attention-impl", default="auto", help="kernels.Kernels.attention_impl (default auto)")
    ap.add_argument("--loss-chunk", default="auto", help="rows of logits at a time, 0 for all, or auto")
    common.add_save_argument(ap, "bench_gpu")
    args = ap.parse_args()
    d, L, V, T, n, dtype = 768, 12, 32768, args.seq_len, 8192, jnp.bfloat16
    if args.quick:
        d, L, V, T, n, dtype, args.batch, args.rounds = 128, 2, 4096, 128, 1024, jnp.float32, 4, 3
    cfg = gpt_config(d, L, V, T)
    tcfg = TrainConfig(batch_size=args.batch, seq_len=T, steps=10_000, warmup_steps=10,
                       compute_dtype=jnp.dtype(dtype).name, remat=args.remat, attention_impl=args.attention_impl,
                       loss_chunk=args.loss_chunk if args.loss_chunk == "auto" else int(args.loss_chunk))
    mesh = make_mesh("", jax.devices()[:1])
    print(f"kernels: {tcfg.kernels(resolve=True)}")
    state = place_state(init_state(cfg, tcfg, optimizer_for(tcfg, cfg=cfg)), mesh)
    r = measure_mfu(jit_train_step(cfg, tcfg, mesh), state, random_batch(V, args.batch, T, mesh), cfg, tcfg,
                    peak_n=n, rounds=args.rounds)
    step_s, B = r["median_step_seconds"], args.batch
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}); compute {jnp.dtype(dtype).name}, "
          f"remat {args.remat}")
    print(f"model: d={d} L={L} heads {cfg.n_heads}/{cfg.n_kv_heads}x64 d_ff={cfg.d_ff} V={V} T={T} batch {B}: "
          f"{cfg.param_count() / 1e6:.1f}M parameters; {r['flops_per_token'] / 1e9:.3f} GFLOP per token")
    print(f"measured peak ({jnp.dtype(dtype).name} jnp.dot {n}², best): {r['peak_flops'] / 1e12:.1f} TFLOP/s")
    print(f"train step: median {step_s * 1e3:.1f} ms, {B * T / step_s:,.0f} tokens/s, "
          f"{r['achieved_flops'] / 1e12:.1f} TFLOP/s")
    print(f"MFU against the measured peak: {r['mfu']:.1%} (target >= 45%); loss {r['loss']:.3f}")
    common.save_from_args(args, {"args": common.arguments(args), **{k: v for k, v in r.items() if k != "loss"}})


if __name__ == "__main__":
    main()
