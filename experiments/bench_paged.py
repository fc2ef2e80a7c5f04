"""The reference paged attention (the CPU path) against the layout it replaced, side by side, per decode call.

  head-major   ``kernels.paged_attention.reference``: each row's pages gathered straight into (B, G, S, K) keys and
               values, then ``ops.grouped_attention``
  split        the path before it: the pages gathered as (B, S, 2G, K), split into keys and values by strided
               slices, and ``ops.attention`` (which transposes both to (B, G, S, K))

One query per row (a decode step) over B rows of S positions in pages of ``--page-size`` from a pool of random
pages; the outputs are compared (they are the same operations on the same numbers) and each call is timed, the two
taking turns, the best of ``--rounds`` medians kept. Printed: ms per call, the KV bytes read per ms, the ratio.

Usage: python -m experiments.bench_paged [--shapes 1x128 1x2048 32x512 ...]
Writes experiments/results/bench_paged.json (``--save NAME`` for another name); ``--render`` prints the docs' table.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from mlx_llm.kernels.paged_attention import reference
from mlx_llm.ops import attention


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["1x128", "1x512", "1x2048", "8x512", "32x512", "64x512"],
                    help="rows x positions")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=30, help="timed calls per round")
    ap.add_argument("--render", action="store_true", help="print the docs' table from the results file and exit")
    common.add_save_argument(ap, "bench_paged")
    return ap.parse_args(argv)


def split_layout(q_BTHK, kv_pages_PNCK, page_table_BN, lengths_B, n_new_B):
    """The path the reference replaced: gather (B, S, 2G, K), split by strided slices, ``ops.attention``."""
    rows = kv_pages_PNCK[page_table_BN]
    b, n, page, c, k = rows.shape
    rows = rows.reshape(b, n * page, c, k)
    k_BSGK, v_BSGK = rows[..., 0::2, :], rows[..., 1::2, :]
    t, s = q_BTHK.shape[1], n * page
    positions_BT = lengths_B[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    s_S = jnp.arange(s, dtype=jnp.int32)
    mask_BTS = (s_S <= positions_BT[:, :, None]) & (s_S < (lengths_B + n_new_B)[:, None, None])
    return attention(q_BTHK, k_BSGK, v_BSGK, mask_BTS)


def render(result: dict) -> str:
    a = result["args"]
    lines = [f"One query per row, H = {a['heads']}, G = {a['kv_heads']}, K = {a['head_dim']}, pages of "
             f"{a['page_size']}, float32; best of {a['rounds']} medians of {a['calls']} calls, the paths taking "
             "turns; outputs bit-identical in every shape.", "",
             "| rows × positions | split, ms | head-major, ms | KV read, GB/s (split → head-major) | speed-up |",
             "|---|---|---|---|---|"]
    for r in result["shapes"]:
        lines.append(f"| {r['rows']} × {r['positions']:,d} | {r['split_ms']:.2f} | {r['head_major_ms']:.2f} | "
                     f"{r['split_gb_s']:.1f} → {r['head_major_gb_s']:.1f} | {r['speedup']:.2f}× |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    if args.render:
        print(render(common.load_result(args.save or "bench_paged")))
        return
    rng = np.random.default_rng(0)
    g, ps = args.kv_heads, args.page_size
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes]
    pages = 1 + max(b * (s // ps) for b, s in shapes)
    pool = jnp.asarray(rng.standard_normal((pages, ps, 2 * g, args.head_dim)), jnp.float32)
    paths = {"split": jax.jit(split_layout), "head_major": jax.jit(reference)}
    rows = []
    for b, s in shapes:
        n = s // ps
        table = jnp.asarray(rng.permutation(pages - 1)[:b * n].reshape(b, n) + 1, jnp.int32)
        q = jnp.asarray(rng.standard_normal((b, 1, args.heads, args.head_dim)), jnp.float32)
        call = (q, pool, table, jnp.full((b,), s - 1, jnp.int32), jnp.ones((b,), jnp.int32))
        outs = {name: np.asarray(f(*call)) for name, f in paths.items()}
        if not np.array_equal(outs["split"], outs["head_major"]):
            raise SystemExit(f"{b}x{s}: the two paths disagree (max |Δ| "
                             f"{np.abs(outs['split'] - outs['head_major']).max():.3g})")
        best = {name: float("inf") for name in paths}
        for _ in range(args.rounds):
            for name, f in paths.items():
                best[name] = min(best[name], common.time_steps(lambda: jax.block_until_ready(f(*call)),
                                                               warmup=1, rounds=args.calls))
        gb = b * s * 2 * g * args.head_dim * 4 / 1e9
        rows.append({"rows": b, "positions": s, "split_ms": best["split"] * 1e3,
                     "head_major_ms": best["head_major"] * 1e3, "split_gb_s": gb / best["split"],
                     "head_major_gb_s": gb / best["head_major"], "speedup": best["split"] / best["head_major"]})
    result = {"args": common.arguments(args), "shapes": rows}
    print(render(result))
    common.save_from_args(args, result)


if __name__ == "__main__":
    main()
