"""Compile time of the training-loss gradient at n_layers = 4 and 32 (blocks under one lax.scan), for the
dense stack and for a mixed stack of period 2 (MoE and SwiGLU FFNs alternating, one scan over L/2 groups).

Because the stacked blocks run inside a single scan, XLA compiles one block body (or one group of P layers)
whatever the depth: the ratio of the two compile times should be near 1 (an unrolled loop would grow ~8x).
Both depths give the scan at least two steps: XLA removes a loop of one step, which makes a one-group stack
(n_layers = P) compile faster than any deeper one and would flatter the ratio's denominator.

    python -m experiments.bench_compile [--d-model 256] [--seq-len 128]

Writes experiments/results/bench_compile.json (``--save``).
"""

import argparse
import dataclasses

import jax
import jax.numpy as jnp

from experiments import common
from mlx_llm import ModelConfig, forward, init_params
from mlx_llm.objectives.loss import masked_cross_entropy


def compile_seconds(cfg: ModelConfig, batch: int, seq_len: int) -> float:
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
    mask = jax.ShapeDtypeStruct((batch, seq_len), jnp.float32)

    def loss(p, x, y, m):
        return masked_cross_entropy(forward(p, x, cfg), y, m)

    return common.seconds(lambda: jax.jit(jax.value_and_grad(loss)).lower(params, tokens, tokens, mask).compile())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    common.add_save_argument(ap, "bench_compile")
    args = ap.parse_args()
    base = ModelConfig(vocab_size=4096, d_model=args.d_model, n_layers=2, n_heads=8, n_kv_heads=2,
                       d_head=args.d_model // 8, d_ff=int(args.d_model * 8 / 3) // 8 * 8, max_seq_len=args.seq_len)
    mixed = dataclasses.replace(base, ffn_pattern=("moe", "swiglu"), n_experts=8, moe_top_k=2,
                                moe_d_ff=base.d_ff // 2)
    compile_seconds(dataclasses.replace(base, n_layers=1), args.batch, args.seq_len)  # warm up JAX itself
    print(f"jit compile of value_and_grad(loss), d={args.d_model}, T={args.seq_len}")
    results = {}
    for name, cfg in (("dense", base), ("mixed moe/swiglu (period 2)", mixed)):
        times = {L: compile_seconds(dataclasses.replace(cfg, n_layers=L), args.batch, args.seq_len) for L in (4, 32)}
        print(f"  {name}: n_layers = 4: {times[4]:.3f} s, n_layers = 32: {times[32]:.3f} s, "
              f"ratio 32/4 {times[32] / times[4]:.2f}  (expected near 1)")
        results[name] = {"compile_seconds": {str(L): t for L, t in times.items()},
                         "ratio_32_over_4": times[32] / times[4]}
    common.save_from_args(args, {"args": common.arguments(args), "stacks": results})


if __name__ == "__main__":
    main()
