"""The Mamba mixer's training cost: the fused, chunked and associative scans, and a Mamba layer against an
attention layer of the dense model, forward + backward, measured side by side in one run (M20 §19).

Rows (each ``jax.grad`` of a sum over the branch's output, jitted, best of --rounds, the variants alternating
so that drift in machine load hits them alike; with each, the compiled temporary memory XLA assigns it):
  * the recurrence alone (Δ, x, B, C, A → Σ_n C s) through ``mamba.fused_scan``, through
    ``kernels.ssm_scan.chunked_scan`` (chunks of --chunk) and through ``discretise`` + ``selective_scan``
    (the associative scan),
  * the whole Mamba branch (``mamba.branch``) with ``ssm_scan`` = "fused", "chunked" and "associative",
  * one attention branch and one SwiGLU branch of experiments/configs/dense.json, for scale: a dense layer is
    both, a Mamba layer of experiments/configs/mamba.json has no FFN.

    python -m experiments.bench_mamba              # the configs' d=128, batch 32, T=128 (the main job's batch)
    python -m experiments.bench_mamba --quick

Writes experiments/results/bench_mamba.json (``--save``; nothing under --quick unless asked).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp

from experiments import common
from experiments.common import CONFIGS
from mlx_llm import ModelConfig, init_params
from mlx_llm.kernels.ssm_scan import chunked_scan
from mlx_llm.layers import attention, ffn, mamba
from mlx_llm.model import Context
from mlx_llm.ops import causal_mask


def first_layer(cfg: ModelConfig) -> dict:
    return jax.tree.map(lambda a: a[0], init_params(cfg, jax.random.key(0))["blocks"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=64, help="positions per chunk of the chunked scan")
    ap.add_argument("--quick", action="store_true", help="batch 4, T=64, 2 rounds")
    common.add_save_argument(ap, "bench_mamba")
    args = ap.parse_args()
    if args.quick:
        args.batch, args.seq_len, args.rounds = 4, 64, 2
    b, t = args.batch, args.seq_len
    mamba_cfg = ModelConfig.from_json(CONFIGS / "mamba.json")
    dense_cfg = ModelConfig.from_json(CONFIGS / "dense.json")
    assoc_cfg = dataclasses.replace(mamba_cfg, ssm_scan="associative")
    chunked_cfg = dataclasses.replace(mamba_cfg, ssm_scan="chunked")
    d, inner, n = mamba_cfg.d_model, mamba_cfg.ssm_expand * mamba_cfg.d_model, mamba_cfg.ssm_state
    keys = jax.random.split(jax.random.key(1), 5)
    h = jax.random.normal(keys[0], (b, t, d))
    scan_args = (jax.nn.softplus(jax.random.normal(keys[1], (b, t, inner)) - 3.0),
                 jax.random.normal(keys[2], (b, t, inner)), jax.random.normal(keys[3], (b, t, n)),
                 jax.random.normal(keys[4], (b, t, n)), -jnp.broadcast_to(jnp.arange(1.0, n + 1), (inner, n)))

    def via_associative(dt, x, bb, c, a):
        s = mamba.selective_scan(*mamba.discretise(dt, x, bb, a))
        return jnp.einsum("btin,btn->bti", s, c)

    def grad_of(fn, nargs):
        return jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(fn(*a))), argnums=tuple(range(nargs))))

    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    ctx = Context(positions_BT=positions, mask_BTS=causal_mask(None, b, t), segment_ids_BT=None)
    attn_layer, mamba_layer = first_layer(dense_cfg), first_layer(mamba_cfg)
    variants = {
        "scan: fused": (grad_of(lambda *a: mamba.fused_scan(*a)[0], 5), scan_args),
        "scan: chunked": (grad_of(lambda *a: chunked_scan(*a, chunk=args.chunk)[0], 5), scan_args),
        "scan: associative": (grad_of(via_associative, 5), scan_args),
        "Mamba branch, fused": (grad_of(lambda h, p: mamba.branch(h, p, mamba_cfg, None), 2), (h, mamba_layer)),
        "Mamba branch, chunked": (grad_of(lambda h, p: mamba.branch(h, p, chunked_cfg, None), 2),
                                  (h, mamba_layer)),
        "Mamba branch, assoc.": (grad_of(lambda h, p: mamba.branch(h, p, assoc_cfg, None), 2), (h, mamba_layer)),
        "attention branch": (grad_of(lambda h, p: attention.branch(h, p, dense_cfg, ctx), 2), (h, attn_layer)),
        "SwiGLU branch": (grad_of(lambda h, p: ffn.branch(h, p, dense_cfg)[0], 2), (h, attn_layer)),
    }
    temp_bytes = {name: fn.lower(*fn_args).compile().memory_analysis().temp_size_in_bytes
                  for name, (fn, fn_args) in variants.items()}
    calls = {name: functools.partial(fn, *fn_args) for name, (fn, fn_args) in variants.items()}
    best = common.time_interleaved(calls, warmup=1, rounds=args.rounds, stat=min)
    print(f"forward+backward, batch {b}, T={t}, d={d}, I={inner}, N={n}, chunk {args.chunk}, "
          f"{jax.device_count()} {jax.devices()[0].platform} device(s); best of {args.rounds}")
    dense_layer = best["attention branch"] + best["SwiGLU branch"]
    print(f"  {'':22s} {'time':>11s} {'temp memory':>14s}")
    for name, seconds in best.items():
        print(f"  {name:22s} {seconds * 1e3:8.1f} ms {temp_bytes[name] / 2**20:10.1f} MiB")
    print(f"  fused / associative: scan {best['scan: associative'] / best['scan: fused']:.2f}x faster, "
          f"branch {best['Mamba branch, assoc.'] / best['Mamba branch, fused']:.2f}x faster")
    print(f"  chunked / fused: scan {best['scan: fused'] / best['scan: chunked']:.2f}x faster, "
          f"branch {best['Mamba branch, fused'] / best['Mamba branch, chunked']:.2f}x faster")
    print(f"  Mamba layer (fused) / dense layer (attention + SwiGLU): "
          f"{best['Mamba branch, fused'] / dense_layer:.2f}x the time")
    common.save_from_args(args, {"args": common.arguments(args), "best_seconds": best, "temp_bytes": temp_bytes,
                                 "mamba_over_dense_layer": best["Mamba branch, fused"] / dense_layer})


if __name__ == "__main__":
    main()
