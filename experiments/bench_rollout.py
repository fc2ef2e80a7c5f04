"""One RL step's rollout, through the engine against the static ``generate`` it replaced, side by side.

The rollout of ``post.rl.Sampler``: P prompts of a built-in task, k replies to each drawn from the policy at
temperature 1 until the end-of-turn marker (``REPLY_TOKENS`` new tokens at most), on the same prompts and seeds
(the RL run's (seed, step) rule) for every server:

  static         the sampler before the engine: ``generate`` over the P·k rows (each prompt repeated k times,
                 right-padded to the longest), one call, every row decoded for the longest reply
  engine n=k     ``eval.replies.sample_replies(…, n=k)``, what the sampler calls now: each prompt one request of k
                 replies; the prompt is computed once and the k replies fork off it
  engine k×1     the same replies asked as P·k separate requests: the prefix cache finds each prompt's full pages

Printed per server: seconds per rollout (median of ``--rounds``, servers taking turns, after one untimed pass
that compiles), its ratio to static, and for the engine the positions computed (prompt chunks and decode steps)
against the static path's (every row: its padded prompt and the longest reply) and the prefix-cache hit rate
(pages found over pages looked up). The policy: ``--run`` (default the committed arithmetic SFT start,
tests/data/arithmetic_sft, whose replies are a fifth right).

Usage: python -m experiments.bench_rollout [--prompts 8 --k 8 --rounds 5]
Writes experiments/results/bench_rollout.json (``--save NAME`` for another name); ``--render`` prints the docs'
table from it (docs/engine.md holds it verbatim; tests/test_engine.py checks).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import jax
import numpy as np

from experiments import common
from mlx_llm.data import tasks as tasks_lib
from mlx_llm.decode import engine as engine_lib
from mlx_llm.decode.engine import Request
from mlx_llm.decode.generate import generate
from mlx_llm.decode.sampling import prompt_seed
from mlx_llm.eval.replies import REPLY_TOKENS, sample_replies
from mlx_llm.post import prologue

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", type=Path, default=REPO / "tests" / "data" / "arithmetic_sft")
    ap.add_argument("--task", default="arithmetic")
    ap.add_argument("--prompts", type=int, default=8, help="P prompts per rollout")
    ap.add_argument("--k", type=int, default=8, help="replies per prompt")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--render", action="store_true", help="print the docs' table from the results file and exit")
    common.add_save_argument(ap, "bench_rollout")
    return ap.parse_args(argv)


def static_rollout(base, messages, k, max_new, seed):
    """The sampler before the engine: one ``generate`` call over the P·k rows (prompts repeated k times)."""
    encoded = [base.template.encode(m, base.tok, generation_prompt=True)[0] for m in messages for _ in range(k)]
    lengths = np.asarray([len(p) for p in encoded], np.int32)
    padded = np.full((len(encoded), lengths.max()), base.tok.pad_id, np.int32)
    for r, p in enumerate(encoded):
        padded[r, :len(p)] = p
    out = generate(base.params, base.cfg, padded, max_new, temperature=1.0, eos_id=base.tok.token_id(base.template.end),
                   pad_id=base.tok.pad_id, prompt_lengths=lengths, seed=seed)
    lens = np.asarray(out.lengths)
    return {"replies": int(lens.size), "reply_tokens": int(lens.sum()),
            "positions": int(len(encoded) * (lengths.max() + lens.max()))}


def engine_rollout(base, messages, k, max_new, seed, *, fork: bool):
    """The engine: P requests of n = k (``fork``), or P·k requests of one reply with the prefix cache."""
    end = base.tok.token_id(base.template.end)
    encoded = [tuple(int(t) for t in base.template.encode(m, base.tok, generation_prompt=True)[0]) for m in messages]
    if fork:
        requests = [Request(p, max_tokens=max_new, temperature=1.0, stop_ids=(end,), seed=prompt_seed(seed, i), n=k)
                    for i, p in enumerate(encoded)]
    else:
        requests = [Request(p, max_tokens=max_new, temperature=1.0, stop_ids=(end,), seed=prompt_seed(seed, i),
                            n=1) for i, p in enumerate(encoded) for _ in range(k)]
    eng = engine_lib.sized_engine(base.params, base.cfg, requests, max_seqs=len(messages) * k)
    done = eng.run(requests)
    tokens = sum(len(r.tokens) for d in done for r in d.replies)
    return {"replies": sum(len(d.replies) for d in done), "reply_tokens": tokens, "positions": eng.tokens_computed,
            "prefix_hit_rate": eng.prefix_hit_rate}


def render(result: dict) -> str:
    a = result["args"]
    lines = [f"Policy: {result['policy']} ({result['params'] / 1e3:.0f}k parameters); {a['prompts']} {a['task']} prompts × "
             f"k = {a['k']} replies at temperature 1 (at most {result['max_new']} tokens each); median of "
             f"{a['rounds']} rollouts, servers taking turns.", "",
             "| server | seconds per rollout | vs static | positions computed | prefix-cache hit rate | reply tokens |",
             "|---|---|---|---|---|---|"]
    for name, r in result["servers"].items():
        hit = f"{r['prefix_hit_rate']:.0%}" if "prefix_hit_rate" in r else "—"
        lines.append(f"| {name} | {r['seconds']:.3f} | {r['vs_static']:.2f}× | {r['positions']:,d} | {hit} | "
                     f"{r['reply_tokens']} |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    if args.render:
        print(render(common.load_result(args.save or "bench_rollout")))
        return
    base = prologue.load_base(args.run)
    examples = tasks_lib.examples(args.task, "train", n=args.prompts, seed=args.seed)
    messages = [tasks_lib.prompt_messages(e) for e in examples]
    max_new = REPLY_TOKENS[args.task]
    seed = int(np.random.default_rng([args.seed, 1, 11]).integers(2**31))  # the sampler's (seed, step) rule, step 1
    servers = {"static": lambda: static_rollout(base, messages, args.k, max_new, seed),
               "engine n=k": lambda: engine_rollout(base, messages, args.k, max_new, seed, fork=True),
               "engine k×1": lambda: engine_rollout(base, messages, args.k, max_new, seed, fork=False)}
    # the sampler's own call is the engine n=k server (a check that the bench measures what RL runs)
    assert len(sample_replies(base.params, base.cfg, base.tok, base.template, messages, max_new, temperature=1.0,
                              seed=seed, batch_size=args.prompts * args.k, n=args.k)) == args.prompts * args.k
    out = {name: fn() for name, fn in servers.items()}  # untimed: compiles
    times = {name: [] for name in servers}
    for _ in range(args.rounds):
        for name, fn in servers.items():
            start = time.perf_counter()
            out[name] = fn()
            times[name].append(time.perf_counter() - start)
    static = statistics.median(times["static"])
    result = {"args": common.arguments(args), "policy": str(args.run.relative_to(REPO)) if args.run.is_relative_to(REPO)
              else str(args.run), "params": int(sum(np.size(x) for x in jax.tree.leaves(base.params))),
              "max_new": max_new,
              "servers": {name: {**out[name], "seconds": statistics.median(t), "all_seconds": t,
                                 "vs_static": static / statistics.median(t)} for name, t in times.items()}}
    print(render(result))
    common.save_from_args(args, result)


if __name__ == "__main__":
    main()
