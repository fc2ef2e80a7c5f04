"""Training-step throughput against the machine's own matmul peak, measured side by side in one run.

Prints tokens/s and achieved FLOP/s of the jitted train step (forward, backward, clipping, AdamW) and the
best `jnp.dot` FLOP/s of the same process; their ratio is the model FLOP utilisation (MFU) against the
measured peak. FLOPs per token follow `accounting.train_flops_per_token`: 6·N_matmul plus the attention
term, counted both for the full T×T score matrix (PaLM's convention) and for the causal half only.
Timings alternate between the dot and the step so that drift in machine load hits both alike.

    python experiments/bench_train.py            # d=512, L=8, 8 query / 2 kv heads, T=512, batch 8
    python experiments/bench_train.py --quick    # a smaller model, for a smoke run
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from mlx_llm import ModelConfig
from mlx_llm.scaling.accounting import train_flops_per_token
from mlx_llm.config import TrainConfig
from mlx_llm.train.parallel import make_mesh, replicated
from mlx_llm.train.step import device_batch, init_state, jit_train_step, optimizer_for


def timed(fn, *args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def dot_peak_flops(n: int, rounds: int) -> float:
    """Best FLOP/s of an n×n float32 matmul (2n³ FLOPs), jitted."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    f = jax.jit(lambda x, y: x @ y)
    f(a, a).block_until_ready()
    return 2 * n**3 / min(timed(f, a, a) for _ in range(rounds))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--d-ff", type=int, default=1408)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--quick", action="store_true", help="d=256, L=2, T=256, batch 4, 2 rounds")
    args = ap.parse_args()
    if args.quick:
        args.d_model, args.layers, args.d_ff, args.seq_len, args.batch, args.rounds = 256, 2, 704, 256, 4, 2
    cfg = ModelConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                      n_kv_heads=args.kv_heads, d_head=args.d_model // args.heads, d_ff=args.d_ff,
                      max_seq_len=args.seq_len)
    tcfg = TrainConfig(batch_size=args.batch, seq_len=args.seq_len, steps=10_000, warmup_steps=10,
                       compute_dtype=args.dtype)
    mesh = make_mesh()
    state = jax.device_put(init_state(cfg, tcfg, optimizer_for(tcfg)), replicated(mesh))
    step = jit_train_step(cfg, tcfg, mesh)
    rng = np.random.default_rng(0)
    B, T = args.batch, args.seq_len
    batch = device_batch({"tokens": rng.integers(0, cfg.vocab_size, (B, T), dtype=np.int32),
                          "targets": rng.integers(0, cfg.vocab_size, (B, T), dtype=np.int32),
                          "mask": np.ones((B, T), np.float32), "segment_ids": np.zeros((B, T), np.int32),
                          "positions": np.tile(np.arange(T, dtype=np.int32), (B, 1))}, mesh)
    t0 = time.perf_counter()
    state, m = step(state, batch)
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t0

    step_times, peaks = [], []
    for _ in range(args.rounds):
        peaks.append(dot_peak_flops(2048, 3))
        start = time.perf_counter()
        state, m = step(state, batch)
        jax.block_until_ready(m)
        step_times.append(time.perf_counter() - start)
    step_s, peak = min(step_times), max(peaks)
    tokens = B * T
    full = train_flops_per_token(cfg, T)
    causal = train_flops_per_token(cfg, T, causal=True)
    print(f"model: d={cfg.d_model} L={cfg.n_layers} heads={cfg.n_heads}/{cfg.n_kv_heads} d_ff={cfg.d_ff} "
          f"V={cfg.vocab_size} T={T} batch={B} dtype={args.dtype}; {cfg.param_count():,} parameters; "
          f"{jax.device_count()} device(s)")
    print(f"compile + first step: {compile_s:.1f} s; step times (s): {', '.join(f'{t:.3f}' for t in step_times)}")
    print(f"jnp.dot peak (2048², float32, best of {args.rounds * 3}): {peak / 1e9:.1f} GFLOP/s")
    print(f"train step: {step_s:.3f} s, {tokens / step_s:,.0f} tokens/s")
    for name, per_token in (("full attention (PaLM)", full), ("causal half", causal)):
        achieved = per_token * tokens / step_s
        print(f"  FLOPs counted with {name:22s}: {achieved / 1e9:6.1f} GFLOP/s = {achieved / peak:.3f} of peak")


if __name__ == "__main__":
    main()
