"""The MoE FFN's achieved FLOP/s against the dense SwiGLU FFN of the same active width, forward + backward,
measured side by side in one run (M20 §15; the issue's target is ≥ 0.7× of dense).

At d, X experts, top-k, expert width m: the MoE FFN of one layer does 6·N·k·3·d·m active FLOPs per training
step on N tokens (2 forward + 4 backward per weight, k experts of 3 matrices), the same as a dense SwiGLU of
width k·m. Both run as ``jax.grad`` of their branch (the MoE one includes the router, the sort and the
dispatch; offsets are zero so routing is as uneven as the random init makes it). Timings alternate between
the variants so that drift in machine load hits them alike. ``ragged_dot`` is jax.lax.ragged_dot on the same
sorted rows, shown for reference: XLA:CPU lowers it to a masked product with every expert on every row.

    python experiments/bench_moe.py                 # d=512, X=8, k=2, T=512, batch 4
    python experiments/bench_moe.py --quick
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from mlx_llm import ModelConfig, init_params
from mlx_llm.layers import ffn, moe
from mlx_llm.ops import dense, rms_norm


def ragged_branch(z_BTD, layer, cfg):
    """The MoE branch with the grouped products done by jax.lax.ragged_dot (reference only)."""
    b, t, d = z_BTD.shape
    y_ND = rms_norm(z_BTD, layer["ffn_norm"], cfg.norm_eps).reshape(b * t, d)
    ids, w = moe.route(dense(y_ND, layer["router"]), layer["router_offset"], cfg.moe_top_k, router=cfg.router)
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.zeros((cfg.n_experts,), jnp.int32).at[flat].add(1)
    rows = y_ND[order // cfg.moe_top_k]
    c = jax.nn.silu(jax.lax.ragged_dot(rows, layer["expert_gate"], sizes)) * jax.lax.ragged_dot(
        rows, layer["expert_up"], sizes)
    out = jax.lax.ragged_dot(c, layer["expert_down"], sizes) * w.reshape(-1)[order][:, None]
    return z_BTD + jnp.zeros((b * t, d)).at[order // cfg.moe_top_k].add(out).reshape(b, t, d)


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
    args = ap.parse_args()
    if args.quick:
        args.d_model, args.expert_d_ff, args.seq_len, args.batch, args.rounds = 128, 176, 128, 2, 2
    d, k, m = args.d_model, args.top_k, args.expert_d_ff
    common = dict(vocab_size=256, d_model=d, n_layers=1, n_heads=8, n_kv_heads=2, d_head=d // 8, max_seq_len=4096)
    moe_cfg = ModelConfig(**common, ffn_pattern=("moe",), n_experts=args.experts, moe_top_k=k, moe_d_ff=m)
    dense_cfg = ModelConfig(**common, d_ff=k * m)
    layer = lambda cfg: jax.tree.map(lambda a: a[0], init_params(cfg, jax.random.key(0))["blocks"])
    z = jax.random.normal(jax.random.key(1), (args.batch, args.seq_len, d))

    def grad_of(branch, cfg):
        return jax.jit(jax.grad(lambda z, layer: jnp.sum(jnp.sin(branch(z, layer, cfg)[0])), argnums=(0, 1)))

    variants = {"dense SwiGLU": (grad_of(ffn.branch, dense_cfg), layer(dense_cfg)),
                "MoE (block-sorted)": (grad_of(moe.branch, moe_cfg), layer(moe_cfg))}
    if not args.no_ragged:
        variants["MoE (ragged_dot)"] = (grad_of(lambda z, l, c: (ragged_branch(z, l, c),), moe_cfg), layer(moe_cfg))
    for fn, params in variants.values():
        jax.block_until_ready(fn(z, params))
    best = {name: float("inf") for name in variants}
    for _ in range(args.rounds):
        for name, (fn, params) in variants.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(z, params))
            best[name] = min(best[name], time.perf_counter() - start)
    n = args.batch * args.seq_len
    flops = 6 * n * k * 3 * d * m  # active FLOPs, the same for every variant
    print(f"FFN forward+backward, d={d}, X={args.experts}, k={k}, m={m} (dense width {k * m}), "
          f"{n} tokens, {jax.device_count()} {jax.devices()[0].platform} device(s); best of {args.rounds}")
    for name, seconds in best.items():
        print(f"  {name:20s} {seconds * 1e3:8.1f} ms  {flops / seconds / 1e9:7.1f} GFLOP/s (active)  "
              f"{best['dense SwiGLU'] / seconds:5.2f}x of dense")


if __name__ == "__main__":
    main()
