"""Causal self-attention, forward + backward: ``kernels.flash`` (FlashAttention-2 in pure JAX) against the xla
reference path of today's training step, ``ops.causal_attention`` over ``ops.causal_mask``, measured side by
side in one run (M20 §6; the target is flash's temporary memory at T = 8192 ≤ 1/8 of xla's).

Each variant is ``jax.vjp`` of the attention with a fixed random cotangent (the gradient of sum(O ⊙ dO)) with
respect to q, k and v, jitted. Time: median of --repeats calls after one warm-up, the variants alternating
within each repeat so that drift in machine load hits them alike. Memory: the compiled executable's temporary
buffers (``memory_analysis().temp_size_in_bytes``: everything but arguments and outputs).

    python -m experiments.bench_attention                   # T = 512, 2048, 8192; B=1, H=8, G=2, K=64
    python -m experiments.bench_attention --lengths 1024 --block-q 64 --block-k 64 --save NAME
    python -m experiments.bench_attention --lengths 1024 4096 --window 256 --save bench_attention_window

``--window W`` adds flash with a sliding window of W (a "local" layer, ModelConfig.sliding_window) beside full
causal flash, the path it replaces: its loops visit only the tiles the band touches, so its time and work grow
as T·W instead of T².

Writes experiments/results/bench_attention.json (``--save``).
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from experiments import common
from mlx_llm.kernels.flash import flash_attention
from mlx_llm.ops import causal_attention, causal_mask

MIB = 2 ** 20


def xla(q_BTHK, k_BTGK, v_BTGK):
    b, t = q_BTHK.shape[:2]
    return causal_attention(q_BTHK, k_BTGK, v_BTGK, causal_mask(None, b, t))


def compiled_grads(attn, q_BTHK, k_BTGK, v_BTGK, do_BTHK, *extra):
    """The jitted (q, k, v, dO, *extra) ↦ (dq, dk, dv), compiled for these shapes: ``attn(q, k, v, *extra)``
    differentiated in q, k and v only (``extra``: segment ids, say, passed as arguments rather than baked in)."""
    run = jax.jit(lambda q, k, v, do, *rest: jax.vjp(lambda *qkv: attn(*qkv, *rest), q, k, v)[1](do))
    return run.lower(q_BTHK, k_BTGK, v_BTGK, do_BTHK, *extra).compile()


def measure(variants: dict, args_: tuple, repeats: int) -> dict:
    """Median seconds per call of each compiled variant, calls interleaved after one warm-up each."""
    calls = {name: functools.partial(fn, *args_) for name, fn in variants.items()}
    return common.time_interleaved(calls, warmup=1, rounds=repeats)


def inputs(b: int, t: int, h: int, g: int, kd: int, dtype=jnp.float32):
    """Random (q, k, v, dO) of these sizes: q and dO (B, T, H, K), k and v (B, T, G, K)."""
    keys = jax.random.split(jax.random.key(0), 4)
    shapes = [(b, t, h, kd), (b, t, g, kd), (b, t, g, kd), (b, t, h, kd)]
    return tuple(jax.random.normal(key, shape, dtype) for key, shape in zip(keys, shapes))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-q", type=int, default=128)
    ap.add_argument("--block-k", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--window", type=int, help="also time flash with this sliding window against full flash")
    common.add_save_argument(ap, "bench_attention")
    args = ap.parse_args()
    print("$ " + common.command_line())
    print(f"causal attention forward+backward, float32, B={args.batch}, H={args.heads}, G={args.kv_heads}, "
          f"K={args.head_dim}, flash blocks {args.block_q}x{args.block_k}, {jax.device_count()} "
          f"{jax.devices()[0].platform} device(s), median of {args.repeats} after a warm-up")
    print(f"{'T':>6} {'flash ms':>10} {'xla ms':>10} {'time f/x':>9} {'flash MiB':>10} {'xla MiB':>10} "
          f"{'mem f/x':>8}")
    flash = functools.partial(flash_attention, block_q=args.block_q, block_k=args.block_k)
    rows = []
    for t in args.lengths:
        arrays = inputs(args.batch, t, args.heads, args.kv_heads, args.head_dim)
        variants = {"flash": compiled_grads(flash, *arrays), "xla": compiled_grads(xla, *arrays)}
        if args.window:
            variants["window"] = compiled_grads(functools.partial(flash, window=args.window), *arrays)
        mem = {name: fn.memory_analysis().temp_size_in_bytes / MIB for name, fn in variants.items()}
        sec = measure(variants, arrays, args.repeats)
        windowed = (f"  window {args.window}: {sec['window'] * 1e3:.1f} ms, {sec['window'] / sec['flash']:.3f} "
                    f"of full flash" if args.window else "")
        print(f"{t:>6} {sec['flash'] * 1e3:>10.1f} {sec['xla'] * 1e3:>10.1f} {sec['flash'] / sec['xla']:>9.2f} "
              f"{mem['flash']:>10.1f} {mem['xla']:>10.1f} {mem['flash'] / mem['xla']:>8.3f}{windowed}", flush=True)
        row = {"seq_len": t, "flash_seconds": sec["flash"], "xla_seconds": sec["xla"],
               "flash_temp_mib": mem["flash"], "xla_temp_mib": mem["xla"],
               "time_ratio": sec["flash"] / sec["xla"], "memory_ratio": mem["flash"] / mem["xla"]}
        if args.window:
            row.update(window=args.window, window_seconds=sec["window"], window_temp_mib=mem["window"],
                       window_time_ratio=sec["window"] / sec["flash"])
        rows.append(row)
    common.save_from_args(args, {"args": common.arguments(args), "rows": rows})


if __name__ == "__main__":
    main()
