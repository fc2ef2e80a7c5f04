"""The inference engine against today's static ``generate`` and transformers' continuous batching, side by side.

One stream of requests, the same weights, greedy decoding, three servers of it:

  engine        mlx_llm.decode.engine.Engine: continuous batching over a paged pool, prompt chunks and decode
                steps mixed under a token budget, several decode steps per dispatch
  static        today's path: ``generate`` over batches of ``--static-batch`` requests in arrival order, each
                batch's prompts right-padded to its longest (rounded up to 64) and decoded for its longest reply
                (rounded up to 16: each new shape compiles)
  hf cb         transformers' ``generate_batch`` (continuous batching, torch eager) on the exported twin
                (``experiments/hf_twin.py``); needs the ``hf`` extra

The stream: ``--requests`` requests whose prompt and reply lengths are the built-in tasks' (``data/tasks.py``:
arithmetic, addition2 and name_function held-out examples, in tokens of a byte-level tokenizer: a prompt is the
question's UTF-8 bytes after a 12-token chat header, a reply is the answer's bytes and an end token), with a share
``--long-share`` of long-prompt requests (prompts of 512–1,536 tokens, replies of 32–128). Every request runs for
exactly its reply length (random weights never stop on their own), so each server produces the same output tokens,
and the greedy tokens are compared request by request.

Equal cache memory: the engine's page pool holds as many positions as the largest static batch's cache
(``--static-batch`` rows × its padded prompt and reply); transformers' gets the same number of blocks.
Each server runs the stream once untimed (compiles, and transformers' manager start) and then ``--repeats``
timed passes, the servers taking turns (the best pass is kept); each engine pass is a fresh engine (no prefix
cache carried over), sharing the compiled programs.

Printed: output tokens/s and its ratio to static, time to first token and inter-token latency p50/p99 (the static
path returns a batch's tokens when the batch ends: its first-token time is the batch's end), and, at batch 1,
the engine's per-token time at contexts ``--contexts`` against the weight- and KV-streaming bound
(``experiments.bench_decode``: (weights + K/V read per token) / read bandwidth), the plain cached decoder of
``bench_decode`` beside it; at batch ``--batches`` and context ``--batch-context``, the share of the bound
(weights once + every row's K/V) per decode step.

Usage: python -m experiments.bench_engine [--quick] [--no-hf] [--d-model 512 --n-layers 8 ...]
Writes experiments/results/bench_engine.json (``--save NAME`` for another name). ``--render`` prints the docs'
tables from that file (docs/engine.md holds them verbatim; tests/test_engine.py checks they match).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from experiments.bench_decode import cached_timers, read_bandwidth, weight_bytes_per_token
from mlx_llm import ModelConfig, init_params
from mlx_llm.data import tasks
from mlx_llm.decode.engine import Engine, Request
from mlx_llm.decode.generate import generate
from mlx_llm.scaling.accounting import decode_state_bytes

HEADER = 12  # the chat template's tokens before a question (a byte-level "<|user|>\n" and its end, roughly)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--n-layers", type=int, default=8)
    ap.add_argument("--n-heads", type=int, default=8)
    ap.add_argument("--n-kv-heads", type=int, default=2)
    ap.add_argument("--d-ff", type=int, default=1408)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--long-share", type=float, default=0.25, help="share of long-prompt requests in the stream")
    ap.add_argument("--static-batch", type=int, default=8, help="rows per static generate batch")
    ap.add_argument("--max-seqs", type=int, default=32, help="the engine's rows")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--token-budget", type=int, default=512)
    ap.add_argument("--chunk-buckets", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens decoded per batch-1 and batch-B run")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--batch-context", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bandwidth-gib", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' continuous batching")
    ap.add_argument("--quick", action="store_true", help="a small model and stream (~2 min): a smoke run")
    ap.add_argument("--render", action="store_true", help="print the docs' tables from the results file; run nothing")
    common.add_save_argument(ap, "bench_engine")
    args = ap.parse_args(argv)
    if args.quick:
        args.d_model, args.n_layers, args.n_heads, args.n_kv_heads, args.d_ff, args.vocab = 64, 2, 4, 2, 128, 512
        args.requests, args.max_seqs, args.static_batch, args.repeats, args.bandwidth_gib = 16, 8, 4, 1, 0.25
        args.contexts, args.new_tokens, args.batches, args.batch_context = [128], 8, [1, 8], 128
        args.chunk_buckets, args.token_budget = [64, 256], 256
    return args


def task_stream(n: int, long_share: float, seed: int) -> list[tuple[list[int], int]]:
    """(prompt ids, reply tokens) of ``n`` requests: the built-in tasks' held-out examples in byte tokens, and a
    ``long_share`` of long prompts with longer replies, in a seeded random order."""
    rng = np.random.default_rng(seed)
    pool = [ex for task in tasks.TASKS for ex in tasks.examples(task, "heldout", n=n, seed=seed)]
    out = []
    for _ in range(n):
        if rng.random() < long_share:
            prompt = rng.integers(3, 256, size=int(rng.integers(512, 1537))).tolist()
            out.append((prompt, int(rng.integers(32, 129))))
        else:
            ex = pool[int(rng.integers(len(pool)))]
            question = tasks.prompt_messages(ex)[-1]["content"].encode()
            out.append(([1] * HEADER + list(question), len(ex["answer"].encode()) + 1))
    return out


def percentiles(xs) -> dict:
    xs = np.asarray(xs, float)
    return {"p50": float(np.percentile(xs, 50)), "p99": float(np.percentile(xs, 99))} if len(xs) else {}


def run_engine(params, cfg, stream, args, pages):
    """One pass of the stream through a fresh engine: (seconds, replies' tokens, first-token and inter-token
    seconds, prefix hit rate, preemptions)."""
    eng = Engine(params, cfg, max_seqs=args.max_seqs, max_len=cfg.max_seq_len, page_size=args.page_size, pages=pages,
                 token_budget=args.token_budget, chunk_buckets=args.chunk_buckets, decode_steps=args.decode_steps)
    start = time.perf_counter()
    done = [eng.submit(Request(tuple(p), max_tokens=m)) for p, m in stream]
    while eng.waiting or eng.running:
        eng.step()
    seconds = time.perf_counter() - start
    replies = [c.replies[0] for c in done]
    ttft = [r.times[0] - start for r in replies]
    itl = [b - a for r in replies for a, b in zip(r.times, r.times[1:])]
    return seconds, [r.tokens for r in replies], ttft, itl, eng.prefix_hit_rate, eng.preemptions


def static_batches(stream, batch):
    """The stream in batches of ``batch`` (arrival order): (prompts (B, W) right-padded, lengths, new tokens)."""
    out = []
    for i in range(0, len(stream), batch):
        chunk = stream[i:i + batch]
        width = -(-max(len(p) for p, _ in chunk) // 64) * 64
        new = -(-max(m for _, m in chunk) // 16) * 16
        prompts = np.zeros((len(chunk), width), np.int32)
        for j, (p, _) in enumerate(chunk):
            prompts[j, :len(p)] = p
        out.append((prompts, np.asarray([len(p) for p, _ in chunk], np.int32), new))
    return out


def run_static(params, cfg, stream, batches):
    start, tokens, ttft = time.perf_counter(), [], []
    for prompts, lengths, new in batches:
        out = generate(params, cfg, prompts, new, prompt_lengths=lengths)
        rows = np.asarray(out.tokens)
        ttft += [time.perf_counter() - start] * len(lengths)
        tokens += [rows[j].tolist() for j in range(len(lengths))]
    seconds = time.perf_counter() - start
    return seconds, [t[:m] for t, (_, m) in zip(tokens, stream)], ttft


def hf_runner(params, cfg, stream, args, blocks):
    """transformers' continuous batching of the stream, or None without the hf extra: a function of no arguments
    returning (seconds, tokens, first-token seconds, inter-token seconds)."""
    from experiments.hf_twin import try_hf_twin

    twin = try_hf_twin(params, cfg)
    if twin is None:
        return None
    model, torch = twin
    model.eval()
    from transformers import ContinuousBatchingConfig, GenerationConfig

    gen = GenerationConfig(max_new_tokens=max(m for _, m in stream), do_sample=False, eos_token_id=None,
                           pad_token_id=2)
    cb = ContinuousBatchingConfig(block_size=args.page_size, num_blocks=blocks, max_batch_tokens=args.token_budget,
                                  max_requests_per_batch=args.max_seqs)

    def once():
        """Every request added at once with its own reply length; timed from the first add to the last result
        (the manager's start and stop are not timed)."""
        with torch.no_grad(), model.continuous_batching_context_manager(
                generation_config=gen, continuous_batching_config=cb, block=True, timeout=600, warmup=False) as cbm:
            start = time.perf_counter()
            for i, (p, m) in enumerate(stream):
                cbm.add_request(list(p), request_id=f"r{i}", max_new_tokens=m, record_timestamps=True)
            results = {}
            while len(results) < len(stream):
                r = cbm.get_result(timeout=1)
                if r is not None and r.is_finished():
                    results[r.request_id] = r
                elif r is None and not cbm.is_running():
                    raise RuntimeError("transformers' continuous batching stopped before finishing the stream")
            seconds = time.perf_counter() - start
        tokens, ttft, itl = [], [], []
        for i, (_, m) in enumerate(stream):
            r = results[f"r{i}"]
            tokens.append(list(r.generated_tokens)[:m])
            times = list(r.timestamps or [])
            if times:
                ttft.append(times[0] - r.created_time)
                itl += [b - a for a, b in zip(times, times[1:])]
        return seconds, tokens, ttft, itl

    return once


def batch_one(params, cfg, args, bw, w_bytes):
    """Per-token decode seconds at batch 1 through the engine (decode steps per dispatch as set) and through
    bench_decode's cached scan, against the streaming bound, at each context."""
    rows = []
    rng = np.random.default_rng(1)
    for ctx in args.contexts:
        prompt = tuple(int(x) for x in rng.integers(3, cfg.vocab_size, size=ctx))

        def engine_run(n):
            def timed():  # a fresh engine each time (no prefix cache carried over), built outside the timing
                eng = Engine(params, cfg, max_seqs=1, max_len=cfg.max_seq_len, page_size=args.page_size,
                             pages=-(-(ctx + n) // args.page_size) + 1, token_budget=max(args.token_budget, 512),
                             chunk_buckets=(512,), decode_steps=args.new_tokens)
                return common.seconds(eng.run, [Request(prompt, max_tokens=n)])
            return timed

        timers = {"engine n": engine_run(1 + args.new_tokens), "engine 1": engine_run(1)}
        best = common.time_interleaved(timers, warmup=1, rounds=args.repeats, stat=min, self_timed=True)
        per_token = (best["engine n"] - best["engine 1"]) / args.new_tokens
        plain = common.time_interleaved(
            {"scan": cached_timers(params, cfg, jnp.asarray([prompt], jnp.int32), args.new_tokens)["scan"]},
            warmup=1, rounds=args.repeats, stat=min, self_timed=True)["scan"] / args.new_tokens
        bound = (w_bytes + decode_state_bytes(cfg, ctx, 1, params["embed"].dtype)) / bw
        rows.append({"context": ctx, "engine_seconds_per_token": per_token, "plain_seconds_per_token": plain,
                     "bound_seconds": bound, "engine_of_bound": bound / per_token, "plain_of_bound": bound / plain})
        print(f"{ctx:>7} | {per_token * 1e3:>8.2f} ms | {plain * 1e3:>8.2f} ms | {bound * 1e3:>6.2f} ms | "
              f"{bound / per_token:>6.0%} | {bound / plain:>6.0%}", flush=True)
    return rows


def batch_b(params, cfg, args, bw, w_bytes):
    """Per-step decode seconds of B requests at one context through the engine, against the bound of one step:
    the weights once and every row's K/V."""
    rows = []
    rng = np.random.default_rng(2)
    for b in args.batches:
        prompts = [tuple(int(x) for x in rng.integers(3, cfg.vocab_size, size=args.batch_context)) for _ in range(b)]

        def engine_run(n, b=b, prompts=prompts):
            def timed():
                eng = Engine(params, cfg, max_seqs=max(args.batches), max_len=cfg.max_seq_len,
                             page_size=args.page_size, pages=b * -(-(args.batch_context + n) // args.page_size) + 1,
                             token_budget=max(args.token_budget, 512), chunk_buckets=(512,),
                             decode_steps=args.new_tokens)
                return common.seconds(eng.run, [Request(p, max_tokens=n) for p in prompts])
            return timed

        best = common.time_interleaved({"n": engine_run(1 + args.new_tokens), "1": engine_run(1)}, warmup=1,
                                       rounds=args.repeats, stat=min, self_timed=True)
        per_step = (best["n"] - best["1"]) / args.new_tokens
        bound = (w_bytes + decode_state_bytes(cfg, args.batch_context, b, params["embed"].dtype)) / bw
        rows.append({"batch": b, "context": args.batch_context, "seconds_per_step": per_step,
                     "tokens_per_second": b / per_step, "bound_seconds": bound, "of_bound": bound / per_step})
        print(f"{b:>7} | {per_step * 1e3:>8.2f} ms | {b / per_step:>8.0f} | {bound * 1e3:>6.2f} ms | "
              f"{bound / per_step:>6.0%}", flush=True)
    return rows


def render(result: dict) -> str:
    """The docs' tables (docs/engine.md) from a results file's payload: the stream, batch 1 and batch B."""
    a, st = result["args"], result["stream"]
    out_tokens = sum(st["reply_tokens"])
    lines = [f"Model d={a['d_model']}, L={a['n_layers']}, V={a['vocab']} ({result['params'] / 1e6:.1f}M parameters), "
             f"float32; {st['requests']} requests, prompts of {np.mean(st['prompt_tokens']):.0f} tokens on average "
             f"({min(st['prompt_tokens'])}–{max(st['prompt_tokens'])}), {out_tokens:,d} output tokens; cache memory "
             f"{result['cache_positions']:,d} positions for each server; engine: {a['max_seqs']} rows, pages of "
             f"{a['page_size']}, token budget {a['token_budget']}, {a['decode_steps']} decode steps per dispatch; "
             f"static: batches of {a['static_batch']}. Best of {a['repeats']} passes, servers taking turns.", "",
             "| server | output tokens/s | vs static | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | greedy tokens as static |",
             "|---|---|---|---|---|---|---|---|"]
    ms = lambda d, k: f"{d[k] * 1e3:.0f} ms" if k in d else "—"  # noqa: E731
    for name, r in result["servers"].items():
        lines.append(f"| {name} | {r['tokens_per_second']:.0f} | {r['vs_static']:.2f}× | {ms(r['ttft'], 'p50')} | "
                     f"{ms(r['ttft'], 'p99')} | {ms(r['itl'], 'p50')} | {ms(r['itl'], 'p99')} | "
                     f"{r['same_tokens']}/{st['requests']} |")
    eng = result["servers"]["engine"]
    lines += ["", f"Engine: prefix-cache hit rate {eng['prefix_hit_rate']:.0%}, {eng['preemptions']} preemptions. "
              "First (untimed) pass, compiles included: " + ", ".join(
                  f"{name} {r['first_pass_seconds']:.0f} s" for name, r in result["servers"].items()) + "."]
    lines += ["", f"Batch 1 (read bandwidth {result['read_bandwidth_bytes_per_second'] / 1e9:.1f} GB/s, "
              f"{result['weight_bytes_per_token'] / 2**20:.1f} MiB of weights per token):", "",
              "| context | engine, ms/token | plain decoder, ms/token | bound, ms | engine of bound | plain of bound |",
              "|---|---|---|---|---|---|"]
    for r in result["batch_one"]:
        lines.append(f"| {r['context']:,d} | {r['engine_seconds_per_token'] * 1e3:.2f} | "
                     f"{r['plain_seconds_per_token'] * 1e3:.2f} | {r['bound_seconds'] * 1e3:.2f} | "
                     f"{r['engine_of_bound']:.0%} | {r['plain_of_bound']:.0%} |")
    lines += ["", f"Batch B at context {a['batch_context']:,d} (the bound: the weights once and every row's K/V per "
              "step):", "", "| batch | ms/step | tokens/s | bound, ms | of bound |", "|---|---|---|---|---|"]
    for r in result["batch_b"]:
        lines.append(f"| {r['batch']} | {r['seconds_per_step'] * 1e3:.2f} | {r['tokens_per_second']:.0f} | "
                     f"{r['bound_seconds'] * 1e3:.2f} | {r['of_bound']:.0%} |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    if args.render:
        print(render(common.load_result(args.save or args.result_name)))
        return
    stream = task_stream(args.requests, args.long_share, args.seed)
    longest = max(len(p) + m for p, m in stream)
    max_len = max(max(args.contexts) + args.new_tokens + 1, args.batch_context + args.new_tokens + 1, longest + 64)
    cfg = ModelConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
                      n_kv_heads=args.n_kv_heads, d_head=args.d_model // args.n_heads, d_ff=args.d_ff,
                      max_seq_len=max_len)
    params = jax.jit(init_params, static_argnums=(0, 2))(cfg, jax.random.key(0, impl="rbg"), jnp.float32)
    w_bytes = weight_bytes_per_token(params, cfg)
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}); model d={cfg.d_model} L={cfg.n_layers} "
          f"V={cfg.vocab_size}: {cfg.param_count() / 1e6:.1f}M parameters, {w_bytes / 2**20:.1f} MiB of weights")
    prompt_lens, reply_lens = [len(p) for p, _ in stream], [m for _, m in stream]
    print(f"stream: {len(stream)} requests, prompts {min(prompt_lens)}–{max(prompt_lens)} tokens (mean "
          f"{np.mean(prompt_lens):.0f}), replies {min(reply_lens)}–{max(reply_lens)} (mean {np.mean(reply_lens):.1f}),"
          f" {sum(reply_lens):,d} output tokens")

    batches = static_batches(stream, args.static_batch)
    positions = max(len(lengths) * (prompts.shape[1] + new) for prompts, lengths, new in batches)
    pages = positions // args.page_size + 1
    print(f"cache memory: {positions:,d} positions (the largest static batch's cache) = {pages - 1} pages of "
          f"{args.page_size} for the engine")

    servers = {"engine": lambda: run_engine(params, cfg, stream, args, pages),
               "static": lambda: run_static(params, cfg, stream, batches)}
    hf = None if args.no_hf else hf_runner(params, cfg, stream, args, pages - 1)
    if hf is not None:
        servers["hf cb"] = hf
    first = {}
    for name, fn in servers.items():
        start = time.perf_counter()
        fn()
        first[name] = time.perf_counter() - start
        print(f"{name}: first pass (compiles) {first[name]:.1f} s", flush=True)
    results = {name: [] for name in servers}
    for _ in range(args.repeats):
        for name, fn in servers.items():
            results[name].append(fn())
    best = {name: min(runs, key=lambda r: r[0]) for name, runs in results.items()}
    out_tokens = sum(reply_lens)
    ref = best["static"][1]
    rows = {}
    print(f"\n{'server':>8} | {'seconds':>8} | {'tokens/s':>8} | {'vs static':>9} | {'TTFT p50':>9} | {'TTFT p99':>9} | "
          f"{'ITL p50':>8} | {'ITL p99':>8} | same greedy tokens")
    for name, r in best.items():
        seconds, tokens = r[0], r[1]
        ttft = percentiles(r[2])
        itl = percentiles(r[3]) if name != "static" else {}
        same = sum(a == b for a, b in zip(tokens, ref))
        rows[name] = {"seconds": seconds, "tokens_per_second": out_tokens / seconds,
                      "vs_static": best["static"][0] / seconds, "ttft": ttft, "itl": itl,
                      "same_tokens": same, "all_seconds": [x[0] for x in results[name]],
                      "first_pass_seconds": first[name]}
        if name == "engine":
            rows[name].update(prefix_hit_rate=r[4], preemptions=r[5])
        fmt = lambda d, k: f"{d[k] * 1e3:>6.0f} ms" if k in d else f"{'—':>9}"
        print(f"{name:>8} | {seconds:>6.2f} s | {out_tokens / seconds:>8.1f} | {best['static'][0] / seconds:>8.2f}x | "
              f"{fmt(ttft, 'p50')} | {fmt(ttft, 'p99')} | {fmt(itl, 'p50')[1:]} | {fmt(itl, 'p99')[1:]} | "
              f"{same}/{len(stream)}")
    bw = read_bandwidth(args.bandwidth_gib, max(args.repeats, 5))
    print(f"\nread bandwidth (jitted sum over {args.bandwidth_gib:g} GiB float32): {bw / 1e9:.1f} GB/s\n"
          f"batch 1: {'context':>7} | {'engine':>11} | {'plain':>11} | {'bound':>9} | engine | plain")
    one = batch_one(params, cfg, args, bw, w_bytes)
    print(f"batch B at context {args.batch_context}: {'batch':>7} | {'per step':>11} | tokens/s | {'bound':>9} | of bound")
    many = batch_b(params, cfg, args, bw, w_bytes)
    common.save_from_args(args, {"args": common.arguments(args), "params": cfg.param_count(),
                                 "weight_bytes_per_token": w_bytes, "read_bandwidth_bytes_per_second": bw,
                                 "stream": {"requests": len(stream), "prompt_tokens": prompt_lens,
                                            "reply_tokens": reply_lens},
                                 "cache_positions": positions, "servers": rows, "batch_one": one, "batch_b": many})


if __name__ == "__main__":
    main()
