"""DPO steps per second: the one training loop (train/loop.py: metrics read back every --log-interval steps,
the update compiled on the mesh) against the loop it replaced (post/prologue.py's post_loop before issue 21: every
step's metrics read back to the host and written at once), in the same process, on the same data and update.

    python -m experiments.bench_post_loop [--model main|tiny] [--steps 60] [--rounds 4] [--log-interval 10]

Both loops run the same compiled update (post/dpo.py's objective, compiled once on the mesh) from the same random
model on the same arithmetic pairs; the baseline is the old per-step loop (a device_get of the metrics and a
metrics.jsonl line after every step), so what is measured is the loop alone. Every step is timed in both. Rounds
alternate between the two so machine noise hits both; reported: median steps/s of each and their ratio
(new / old). Checkpoints and evaluations are left out of both.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from experiments.common import add_save_argument, save_from_args
from mlx_llm.config import TrainConfig
from mlx_llm.model import init_params
from mlx_llm.post import dpo, prologue as loop
from mlx_llm.post import pairs as pairs_lib
from mlx_llm.data.chat import ChatTemplate
from mlx_llm.recipes import BASE_MODEL
from mlx_llm.train import preflight
from mlx_llm.train.parallel import batch_sharding, make_mesh, shard_tree
from mlx_llm.train.step import init_state, optimizer_for, place_state
from mlx_llm.data.tokenizer import ByteTokenizer


def setup(args):
    tok = ByteTokenizer()
    widths = {"main": {}, "tiny": dict(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_head=16, d_ff=64)}
    cfg = dataclasses.replace(BASE_MODEL, vocab_size=tok.vocab_size, max_seq_len=64, **widths[args.model])
    tcfg = TrainConfig(batch_size=args.batch_size, seq_len=64, steps=args.steps, lr=1e-5, warmup_steps=1,
                       eval_interval=args.steps, checkpoint_interval=args.steps, log_interval=args.log_interval,
                       weight_decay=0.0)
    params = init_params(cfg, jax.random.key(0))
    base = loop.Base(Path("."), cfg, tcfg, params, 0, tok, ChatTemplate())
    data = pairs_lib.load_pairs(base, tcfg, task="arithmetic", n_train=2000)
    objective = dpo.make_objective(cfg, 0.1, None)
    return cfg, tcfg, params, data, objective


def compiled(cfg, tcfg, params, data, objective):
    """The run's update compiled once on the mesh (train/preflight.compiled_update), used by both loops: what differs
    between them is the loop alone."""
    trainable = jax.tree.map(jnp.copy, params)
    return preflight.compiled_update(cfg, tcfg, objective, trainable, {"reference": params},
                                data.train_batch(0, tcfg.batch_size, tcfg.seed))


def old_loop(cfg, tcfg, params, data, update, out: Path) -> float:
    """The replaced loop: one host sync and one metrics line per step. Returns steps/s (every step timed)."""
    mesh = make_mesh(tcfg.mesh)
    state = place_state(init_state(cfg, tcfg, optimizer_for(tcfg, cfg=cfg), jax.tree.map(jnp.copy, params)), mesh)
    frozen = shard_tree({"reference": params}, mesh)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with (out / "metrics.jsonl").open("w") as f:
        for s in range(tcfg.steps):
            batch = jax.device_put(data.train_batch(s, tcfg.batch_size, tcfg.seed), batch_sharding(mesh))
            state, m = update(state, batch, frozen)
            row = {"step": s + 1, **{k: float(v) for k, v in jax.device_get(m).items() if k != "expert_load"}}
            if not all(math.isfinite(v) for v in row.values()):
                raise RuntimeError(f"diverged at step {s + 1}")
            f.write(json.dumps(row) + "\n")
    return tcfg.steps / (time.perf_counter() - start)


def new_loop(cfg, tcfg, params, data, update, out: Path) -> float:
    """The one loop (``loop.post_fit``): steps/s from its own accounting (every step; checkpoint and evaluation
    excluded)."""
    trainable = jax.tree.map(jnp.copy, params)
    batch_fn = lambda s, _: (data.train_batch(s, tcfg.batch_size, tcfg.seed), {})  # noqa: E731
    out.mkdir(parents=True, exist_ok=True)
    result = loop.post_fit(out, cfg, tcfg, trainable, {"reference": params}, update, batch_fn, lambda _: {},
                           plan=None, show_progress=False, log=lambda *a: None)
    return result["summary"]["steps_per_second"]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--log-interval", type=int, default=10)
    ap.add_argument("--model", choices=("main", "tiny"), default="main",
                    help="main: the main job's model (d=128, L=4); tiny: d=32, L=2, where the host sync is the cost")
    ap.add_argument("--quick", action="store_true", help="12 steps, 1 round (a smoke run; saves nothing)")
    add_save_argument(ap, "bench_post_loop")
    args = ap.parse_args(argv)
    args.result_name = f"bench_post_loop_{args.model}"
    if args.quick:
        args.steps, args.rounds = 12, 1
    cfg, tcfg, params, data, objective = setup(args)
    update = compiled(cfg, tcfg, params, data, objective)
    times = {"old": [], "new": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, fn in (("old", old_loop), ("new", new_loop)) if r % 2 == 0 else (("new", new_loop),
                                                                                       ("old", old_loop)):
                times[name].append(fn(cfg, tcfg, params, data, update, Path(tmp) / f"{name}{r}"))
                print(f"round {r + 1} {name}: {times[name][-1]:.2f} steps/s", flush=True)
    old, new = statistics.median(times["old"]), statistics.median(times["new"])
    payload = {"steps": args.steps, "batch_size": args.batch_size, "log_interval": args.log_interval,
               "model": args.model, "config": dataclasses.asdict(cfg), "sequence_length": 64,
               "steps_per_second": times,
               "median_old": old, "median_new": new, "ratio_new_over_old": new / old}
    print(f"DPO steps/s: one loop {new:.2f}, replaced loop {old:.2f}: ratio {new / old:.3f}")
    save_from_args(args, payload)
    return payload


if __name__ == "__main__":
    main()
