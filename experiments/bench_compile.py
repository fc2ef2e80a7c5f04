"""Compile time of the training-loss gradient at n_layers = 4 and 32 (blocks under one lax.scan), for the
dense stack and for a mixed stack of period 2 (MoE and SwiGLU FFNs alternating, one scan over L/2 groups).

Because the stacked blocks run inside a single scan, XLA compiles one block body (or one group of P layers)
whatever the depth: the ratio of the two compile times should be near 1 (an unrolled loop would grow ~8x).
Both depths give the scan at least two steps: XLA removes a loop of one step, which makes a one-group stack
(n_layers = P) compile faster than any deeper one and would flatter the ratio's denominator.

    python experiments/bench_compile.py [--d-model 256] [--seq-len 128]
"""

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp

from mlx_llm import ModelConfig, forward, init_params
from mlx_llm.objectives.loss import masked_cross_entropy


def compile_seconds(cfg: ModelConfig, batch: int, seq_len: int) -> float:
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
    mask = jax.ShapeDtypeStruct((batch, seq_len), jnp.float32)

    def loss(p, x, y, m):
        return masked_cross_entropy(forward(p, x, cfg), y, m)

    start = time.perf_counter()
    jax.jit(jax.value_and_grad(loss)).lower(params, tokens, tokens, mask).compile()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args()
    base = ModelConfig(vocab_size=4096, d_model=args.d_model, n_layers=2, n_heads=8, n_kv_heads=2,
                       d_head=args.d_model // 8, d_ff=int(args.d_model * 8 / 3) // 8 * 8, max_seq_len=args.seq_len)
    mixed = dataclasses.replace(base, ffn_pattern=("moe", "swiglu"), n_experts=8, moe_top_k=2,
                                moe_d_ff=base.d_ff // 2)
    compile_seconds(dataclasses.replace(base, n_layers=1), args.batch, args.seq_len)  # warm up JAX itself
    print(f"jit compile of value_and_grad(loss), d={args.d_model}, T={args.seq_len}")
    for name, cfg in (("dense", base), ("mixed moe/swiglu (period 2)", mixed)):
        times = {L: compile_seconds(dataclasses.replace(cfg, n_layers=L), args.batch, args.seq_len) for L in (4, 32)}
        print(f"  {name}: n_layers = 4: {times[4]:.3f} s, n_layers = 32: {times[32]:.3f} s, "
              f"ratio 32/4 {times[32] / times[4]:.2f}  (expected near 1)")


if __name__ == "__main__":
    main()
