"""The chunked loss (kernels/loss.py) against the full-logits loss, forward + backward of the loss alone, measured
side by side in one run: compiled temporary memory and time (M20 §8 Λ = R U, §10 cross-entropy).

Both rows are ``jax.value_and_grad`` of Σ_t nll_t with respect to (R, U), jitted:
  * full logits: ``token_nll(dense(R, U, preferred_element_type=f32), x)``, the train step's path today,
  * chunked: ``chunked_token_nll(R, U, x, chunk=…)``, which recomputes each chunk's logits in the backward.
The full path does 3 products of 2·N·D·V FLOPs (Λ, dR, dU), the chunked one 4 (Λ again in the backward).
Memory is XLA's plan (``memory_analysis().temp_size_in_bytes``: scratch beyond the arguments and outputs);
timings alternate between the variants so that drift in machine load hits them alike, median of --rounds.

    python -m experiments.bench_loss                    # B·T = 2 × 2048, D = 512, V = 32768, chunk auto
    python -m experiments.bench_loss --chunk 512 --dtype bfloat16
    python -m experiments.bench_loss --quick

Writes experiments/results/bench_loss.json (``--save``; nothing under --quick unless asked).
"""

from __future__ import annotations

import argparse
import functools
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from mlx_llm.kernels.loss import choose_chunk, chunked_token_nll
from mlx_llm.ops import token_nll
from mlx_llm.ops import dense

MIB = 2**20


def full_nll(r_BTD, u_DV, targets_BT):
    acc = jnp.promote_types(r_BTD.dtype, jnp.float32)
    return token_nll(dense(r_BTD, u_DV, preferred_element_type=acc), targets_BT)


def loss_grad(nll_fn):
    """(Σ nll, (dR, dU)), jitted: what one training step asks of the loss."""
    return jax.jit(jax.value_and_grad(lambda r, u, y: jnp.sum(nll_fn(r, u, y)), argnums=(0, 1)))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--chunk", default="auto", help="rows per chunk, or 'auto' (choose_chunk's 256 MiB tile)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="dtype of R and U")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="B·T = 2 × 256, D = 128, V = 8192, 3 rounds")
    common.add_save_argument(ap, "bench_loss")
    args = ap.parse_args()
    if args.quick:
        args.seq_len, args.d_model, args.vocab, args.rounds = 256, 128, 8192, 3
    return args


def main() -> None:
    args = parse_args()
    n, d, v = args.batch * args.seq_len, args.d_model, args.vocab
    chunk = choose_chunk(n, v) if args.chunk == "auto" else int(args.chunk)
    rng = np.random.default_rng(0)
    r = jnp.asarray(rng.standard_normal((args.batch, args.seq_len, d)), args.dtype)
    u = jnp.asarray(rng.standard_normal((d, v)) / np.sqrt(d), args.dtype)
    y = jnp.asarray(rng.integers(0, v, (args.batch, args.seq_len)), jnp.int32)
    variants = {"full logits": loss_grad(full_nll),
                f"chunked ({chunk} rows)": loss_grad(lambda r, u, y: chunked_token_nll(r, u, y, chunk=chunk))}
    temp = {name: fn.lower(r, u, y).compile().memory_analysis().temp_size_in_bytes for name, fn in variants.items()}
    (loss_a, _), (loss_b, _) = (jax.block_until_ready(fn(r, u, y)) for fn in variants.values())  # warm-up
    calls = {name: functools.partial(fn, r, u, y) for name, fn in variants.items()}
    times = common.interleaved_times(calls, warmup=0, rounds=args.rounds)
    report(args, n, d, v, temp, times, float(loss_a), float(loss_b))
    common.save_from_args(args, {"args": common.arguments(args), "tokens": n, "chunk": chunk,
                                 "temp_bytes": temp, "seconds": times,
                                 "median_seconds": {k: statistics.median(t) for k, t in times.items()},
                                 "loss": {"full": float(loss_a), "chunked": float(loss_b)}})


def report(args, n, d, v, temp, times, loss_full, loss_chunked) -> None:
    print(f"loss forward+backward, B·T = {args.batch}×{args.seq_len} = {n}, D = {d}, V = {v}, {args.dtype} R and U, "
          f"{jax.device_count()} {jax.devices()[0].platform} device(s); median of {args.rounds}")
    print(f"  one (B·T, V) float32 array: {n * v * 4 / MIB:.0f} MiB;  Σ nll full {loss_full:.6f}, "
          f"chunked {loss_chunked:.6f}")
    (name_a, temp_a), (name_b, temp_b) = temp.items()
    med = {name: statistics.median(ts) for name, ts in times.items()}
    for name in temp:
        print(f"  {name:22s} temp {temp[name] / MIB:9.1f} MiB   {med[name] * 1e3:9.1f} ms "
              f"(min {min(times[name]) * 1e3:.1f})")
    print(f"  chunked / full: memory {temp_b / temp_a:.3f}x, time {med[name_b] / med[name_a]:.2f}x")


if __name__ == "__main__":
    main()
