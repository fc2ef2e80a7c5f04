"""The engine's log-prob contract, measured: its log p against the trainer's scoring, and a reply alone against
the same reply in a batch, in float32 and bfloat16, with the layers looped as the trainer loops them (scan) and
unrolled.

For each dtype and layer loop, on one model of random weights (the numbers are rounding, not learning):

  equal shapes   B prompts of exactly T tokens, each computed in one chunk (chunk bucket T, a page table of T
                 positions), the first reply token's log p against the trainer's scoring of the same B × T inputs
                 (``post.ppo.token_logprobs_and_values``, what RL's rollout scoring calls): how many are equal bit
                 for bit, and the largest difference
  batch          ``--requests`` seeded requests at temperature 1 (prompts of 4 to ``--max-prompt`` tokens, replies of
                 ``--new-tokens``) through one engine of ``--max-seqs`` rows: chunked prefill, decode steps, rows
                 joining and leaving
  alone          every request through an engine by itself
  trainer        the batch's sequences (prompt + reply, right-padded) scored by the trainer in one call, as RL does

Reported per setting: the largest |log p alone − log p batch| over the tokens both drew (and how many replies drew
different tokens: a sample follows the rounding of its logits), the largest |log p engine − log p trainer| and
|log q − log p| (temperature 1 without a cut: q is p). The largest engine-vs-trainer difference over the batch is
the tolerance docs/engine.md states.

Usage: python -m experiments.logprob_contract [--d-model 256 --n-layers 4 ...]
Writes experiments/results/logprob_contract.json (``--save NAME`` for another name); ``--render`` prints the docs'
table from it (docs/engine.md holds it verbatim; tests/test_engine.py checks).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from mlx_llm import ModelConfig, init_params
from mlx_llm.decode.engine import Engine, Request
from mlx_llm.post import ppo

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--n-layers", type=int, default=4)
    ap.add_argument("--n-heads", type=int, default=4)
    ap.add_argument("--n-kv-heads", type=int, default=2)
    ap.add_argument("--d-ff", type=int, default=704)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--max-prompt", type=int, default=120)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--max-seqs", type=int, default=8)
    ap.add_argument("--equal-rows", type=int, default=4, help="B of the equal-shapes check")
    ap.add_argument("--equal-tokens", type=int, default=64, help="T of the equal-shapes check")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--render", action="store_true", help="print the docs' table from the results file and exit")
    common.add_save_argument(ap, "logprob_contract")
    return ap.parse_args(argv)


def _trainer_logp(params, cfg, seqs_BW):
    """log p of every position's next token by the trainer's scoring (RL's rollout scoring calls it)."""
    return np.asarray(jax.jit(lambda s: ppo.token_logprobs_and_values(params, None, cfg, {"ids": s})[0])(seqs_BW),
                      np.float64)


def equal_shapes(params, cfg, args, unroll: bool) -> dict:
    b, t = args.equal_rows, args.equal_tokens
    rng = np.random.default_rng(args.seed + 1)
    prompts = [tuple(int(x) for x in rng.integers(0, cfg.vocab_size, t)) for _ in range(b)]
    eng = Engine(params, cfg, max_seqs=b, max_len=t + args.page_size, page_size=args.page_size, token_budget=b * t,
                 chunk_buckets=(t,), width_buckets=(t // args.page_size,), row_buckets=(b,), decode_steps=1,
                 unroll_layers=unroll)
    done = eng.run([Request(p, max_tokens=1, temperature=1.0, seed=i, logprobs=True) for i, p in enumerate(prompts)])
    engine_lp = np.asarray([d.replies[0].logp[0] for d in done])
    seqs = np.asarray([list(p) + d.replies[0].tokens for p, d in zip(prompts, done)], np.int32)
    trainer_lp = _trainer_logp(params, cfg, seqs)[:, -1]
    return {"rows": b, "tokens": t, "bit_equal": int(np.sum(engine_lp == trainer_lp)),
            "max_abs_diff": float(np.max(np.abs(engine_lp - trainer_lp)))}


def stream(params, cfg, args, unroll: bool) -> dict:
    rng = np.random.default_rng(args.seed + 2)
    requests = [Request(tuple(int(x) for x in rng.integers(0, cfg.vocab_size, int(rng.integers(4, args.max_prompt)))),
                        max_tokens=args.new_tokens, temperature=1.0, seed=i, logprobs=True)
                for i in range(args.requests)]
    max_len = -(-(args.max_prompt + args.new_tokens) // args.page_size) * args.page_size
    make = lambda rows: Engine(params, cfg, max_seqs=rows, max_len=max_len, page_size=args.page_size,  # noqa: E731
                               token_budget=256, chunk_buckets=(32, 128), decode_steps=4, unroll_layers=unroll)
    batch = [d.replies[0] for d in make(args.max_seqs).run(requests)]
    lone_engine = make(1)
    alone = [lone_engine.run([r])[0].replies[0] for r in requests]
    diff_alone, differ = 0.0, 0
    for a, b in zip(alone, batch):
        same = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), len(a.tokens))
        differ += same < len(a.tokens)
        if same:
            diff_alone = max(diff_alone, float(np.max(np.abs(np.subtract(a.logp[:same], b.logp[:same])))))
    width = max(len(r.prompt) + len(b.tokens) for r, b in zip(requests, batch))
    seqs = np.zeros((len(requests), width), np.int32)
    for i, (r, b) in enumerate(zip(requests, batch)):
        seqs[i, :len(r.prompt) + len(b.tokens)] = list(r.prompt) + b.tokens
    trainer = _trainer_logp(params, cfg, seqs)
    diff_trainer = max(float(np.max(np.abs(np.asarray(b.logp) - trainer[i, len(r.prompt) - 1:len(r.prompt) - 1
                                                                        + len(b.tokens)])))
                       for i, (r, b) in enumerate(zip(requests, batch)))
    diff_q = max(float(np.max(np.abs(np.subtract(b.logq, b.logp)))) for b in batch)
    return {"requests": len(requests), "tokens": sum(len(b.tokens) for b in batch), "replies_differ": differ,
            "alone_vs_batch": diff_alone, "engine_vs_trainer": diff_trainer, "logq_vs_logp": diff_q}


def render(result: dict) -> str:
    a = result["args"]
    lines = [f"Model d={a['d_model']}, L={a['n_layers']}, V={a['vocab']}, random weights; equal shapes: "
             f"{a['equal_rows']} prompts of {a['equal_tokens']} tokens; stream: {a['requests']} requests (prompts of "
             f"4–{a['max_prompt']} tokens, {a['new_tokens']} sampled tokens each at temperature 1), the batch engine "
             f"of {a['max_seqs']} rows.", "",
             "| dtype | layers | equal shapes: bit-equal | equal shapes: max \\|Δ\\| | engine vs trainer: max \\|Δ\\| "
             "| alone vs batch: max \\|Δ\\| | replies that drew other tokens | log q vs log p |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["settings"]:
        e, s = r["equal_shapes"], r["stream"]
        lines.append(f"| {r['dtype']} | {r['layers']} | {e['bit_equal']}/{e['rows']} | {e['max_abs_diff']:.2g} | "
                     f"{s['engine_vs_trainer']:.2g} | {s['alone_vs_batch']:.2g} | {s['replies_differ']}/{s['requests']}"
                     f" | {s['logq_vs_logp']:.2g} |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    if args.render:
        print(render(common.load_result(args.save or "logprob_contract")))
        return
    cfg = ModelConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
                      n_kv_heads=args.n_kv_heads, d_head=args.d_model // args.n_heads, d_ff=args.d_ff,
                      max_seq_len=max(args.max_prompt + args.new_tokens, args.equal_tokens + args.page_size) + 64)
    base = init_params(cfg, jax.random.PRNGKey(args.seed))
    settings = []
    for name, dtype in DTYPES.items():
        params = jax.tree.map(lambda x: x.astype(dtype), base)
        for layers, unroll in (("scan", False), ("unrolled", True)):
            row = {"dtype": name, "layers": layers, "equal_shapes": equal_shapes(params, cfg, args, unroll),
                   "stream": stream(params, cfg, args, unroll)}
            settings.append(row)
            print(render({"args": vars(args), "settings": [row]}).splitlines()[-1], flush=True)
    result = {"args": common.arguments(args), "settings": settings}
    print(render(result))
    common.save_from_args(args, result)


if __name__ == "__main__":
    main()
