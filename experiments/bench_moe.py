"""The MoE FFN's achieved FLOP/s against the dense SwiGLU FFN of the same active width, forward + backward,
measured side by side in one run (M20 §15; the issue's target is ≥ 0.7× of dense).

At d, X experts, top-k, expert width m: the MoE FFN of one layer does 6·N·k·3·d·m active FLOPs per training
step on N tokens (2 forward + 4 backward per weight, k experts of 3 matrices), the same as a dense SwiGLU of
width k·m. Both run as ``jax.grad`` of their branch (the MoE one includes the router, the sort and the
dispatch; offsets are zero so routing is as uneven as the random init makes it). Timings alternate between
the variants so that drift in machine load hits them alike. ``ragged_dot`` is the same branch with
``impl="ragged_dot"`` (kernels/gmm.py: jax.lax.ragged_dot on the sorted rows, no padding blocks), the GPU path;
XLA:CPU lowers it to a masked product with every expert on every row, so on the CPU it trails "block".

    python -m experiments.bench_moe                 # d=512, X=8, k=2, T=512, batch 4
    python -m experiments.bench_moe --quick

``compare`` is also the MoE part of experiments/device_check.py (bf16, GPU sizes).
Writes experiments/results/bench_moe.json (``--save``; nothing under --quick unless asked).
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from experiments import common
from mlx_llm import ModelConfig, init_params
from mlx_llm.layers import ffn, moe


def compare(d: int, experts: int, k: int, m: int, seq_len: int, batch: int, rounds: int, *, ragged: bool = True,
            dtype: str = "float32") -> dict:
    """The dense SwiGLU of width k·m, the block-sorted MoE and (``ragged``) the ragged_dot MoE, forward+backward
    on batch × seq_len tokens in ``dtype``, timed round-robin (best of ``rounds``); prints the table and returns
    {"tokens", "active_flops", "variants": {name: best seconds, active FLOP/s, ×dense, compiled/active FLOPs}}."""
    shape = dict(vocab_size=256, d_model=d, n_layers=1, n_heads=8, n_kv_heads=2, d_head=d // 8, max_seq_len=4096)
    moe_cfg = ModelConfig(**shape, ffn_pattern=("moe",), n_experts=experts, moe_top_k=k, moe_d_ff=m)
    dense_cfg = ModelConfig(**shape, d_ff=k * m)

    def layer(cfg):
        """Layer 0's weights in ``dtype``."""
        return jax.tree.map(lambda a: a[0].astype(dtype), init_params(cfg, jax.random.key(0))["blocks"])

    z = jax.random.normal(jax.random.key(1), (batch, seq_len, d), dtype)

    def grad_of(branch, cfg):
        """(the compiled gradient, its params): compiled ahead so that XLA's FLOP count can be printed too."""
        params = layer(cfg)
        grad = jax.jit(jax.grad(lambda z, layer: jnp.sum(jnp.sin(branch(z, layer, cfg)[0].astype(jnp.float32))),
                                argnums=(0, 1)))
        return grad.lower(z, params).compile(), params

    variants = {"dense SwiGLU": grad_of(ffn.branch, dense_cfg), "MoE (block-sorted)": grad_of(moe.branch, moe_cfg)}
    if ragged:
        variants["MoE (ragged_dot)"] = grad_of(functools.partial(moe.branch, impl="ragged_dot"), moe_cfg)
    calls = {name: functools.partial(fn, z, params) for name, (fn, params) in variants.items()}
    best = common.time_interleaved(calls, warmup=1, rounds=rounds, stat=min)
    n = batch * seq_len
    flops = 6 * n * k * 3 * d * m  # active FLOPs, the same for every variant
    print(f"FFN forward+backward, d={d}, X={experts}, k={k}, m={m} (dense width {k * m}), {dtype}, "
          f"{n} tokens, {jax.device_count()} {jax.devices()[0].platform} device(s); best of {rounds}")
    rows = {}
    for name, seconds in best.items():
        compiled = variants[name][0].cost_analysis()["flops"]  # what XLA will execute, padding and masking included
        print(f"  {name:20s} {seconds * 1e3:8.1f} ms  {flops / seconds / 1e9:7.1f} GFLOP/s (active)  "
              f"{best['dense SwiGLU'] / seconds:5.2f}x of dense  {best['MoE (block-sorted)'] / seconds:5.2f}x of "
              f"block  compiled/active FLOPs {compiled / flops:5.2f}")
        rows[name] = {"best_seconds": seconds, "active_flops_per_second": flops / seconds,
                      "of_dense": best["dense SwiGLU"] / seconds, "compiled_over_active_flops": compiled / flops}
    return {"tokens": n, "active_flops": flops, "variants": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-d-ff", type=int, default=704)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-ragged", action="store_true", help="skip the ragged_dot reference (slow on CPU)")
    ap.add_argument("--quick", action="store_true", help="d=128, T=128, batch 2, 2 rounds")
    common.add_save_argument(ap, "bench_moe")
    args = ap.parse_args()
    if args.quick:
        args.d_model, args.expert_d_ff, args.seq_len, args.batch, args.rounds = 128, 176, 128, 2, 2
    out = compare(args.d_model, args.experts, args.top_k, args.expert_d_ff, args.seq_len, args.batch, args.rounds,
                  ragged=not args.no_ragged)
    common.save_from_args(args, {"args": common.arguments(args), **out})


if __name__ == "__main__":
    main()
