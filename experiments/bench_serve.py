"""``mlx-llm serve`` under load: N concurrent streaming clients over loopback, against the engine called in process
(the server's overhead) and transformers' continuous batching (``generate_batch``'s manager), side by side.

One stream of requests — the engine benchmark's mix (``experiments.bench_engine.task_stream``: the built-in tasks'
prompt and reply lengths, a share of long prompts) — on the same random weights, greedy, each request running for
exactly its reply length (``ignore_eos``; random weights never stop on their own). Three servers of it, each driven
closed-loop by ``--clients`` clients (a client sends its next request when its last one ends):

  server      the HTTP server (serve/app.py) in a subprocess on a free loopback port, the same engine settings; the
              clients stream ``/v1/completions`` with token-id prompts (asyncio + httpx in this process)
  engine      the same engine in this process, the same closed loop on ``submit``/``step`` (no HTTP, no JSON, no
              detokenizing): what the server adds is the difference
  hf cb       transformers' continuous batching (torch eager) on the exported twin (``experiments/hf_twin.py``),
              the same closed loop on ``add_request``/``get_result``; needs the ``hf`` extra

Printed per server: requests/s, output tokens/s, time to first token and inter-token latency p50/p99 (each
token's time is when its client, or the in-process loop, saw it: tokens that arrive together are 0 s apart), and
the server's ratios to the in-process engine. Each server runs one untimed pass (compiles), then ``--repeats``
timed passes, taking turns; pass k of every server is the same stream (``task_stream`` with seed ``--seed`` + k),
and each pass has its own, so the server's long-lived engine finds no prefix of an earlier pass in its cache (the
in-process engine is a fresh one each pass): the rows are totals over the timed passes. Greedy tokens are compared
request by request.

Usage: python -m experiments.bench_serve [--quick] [--no-hf] [--clients 32 ...]
Writes experiments/results/bench_serve.json (``--save NAME`` for another name); ``--render`` prints the docs' table
from that file (docs/serving.md holds it; tests/test_serve.py checks it matches).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import queue
import subprocess
import sys
import threading
import time

import numpy as np

from experiments import common
from experiments.bench_engine import percentiles, task_stream


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--n-layers", type=int, default=8)
    ap.add_argument("--n-heads", type=int, default=8)
    ap.add_argument("--n-kv-heads", type=int, default=2)
    ap.add_argument("--d-ff", type=int, default=1408)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--long-share", type=float, default=0.25)
    ap.add_argument("--clients", type=int, default=32, help="concurrent clients (each keeps one request in flight)")
    ap.add_argument("--max-seqs", type=int, default=32, help="the engine's rows")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--token-budget", type=int, default=512)
    ap.add_argument("--chunk-buckets", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' continuous batching")
    ap.add_argument("--quick", action="store_true", help="a small model and stream (~1 min): a smoke run")
    ap.add_argument("--render", action="store_true", help="print the docs' table from the results file; run nothing")
    ap.add_argument("--serve-only", action="store_true", help=argparse.SUPPRESS)  # the server subprocess
    common.add_save_argument(ap, "bench_serve")
    args = ap.parse_args(argv)
    if args.quick:
        args.d_model, args.n_layers, args.n_heads, args.n_kv_heads, args.d_ff, args.vocab = 64, 2, 4, 2, 128, 512
        args.requests, args.clients, args.max_seqs, args.repeats = 24, 8, 8, 1
        args.chunk_buckets, args.token_budget = [64, 256], 256
    return args


def streams_of(args) -> list:
    """The untimed pass's stream and each timed pass's: the same mix, seeds ``--seed`` … ``--seed + repeats``."""
    return [task_stream(args.requests, args.long_share, args.seed + k) for k in range(args.repeats + 1)]


def model_of(args):
    """The benchmark's random model: (params, cfg, the streams, the engine's settings)."""
    import jax
    import jax.numpy as jnp

    from mlx_llm import ModelConfig, init_params

    stream = streams_of(args)
    longest = max(len(p) + m for s in stream for p, m in s)
    max_len = -(-(longest + 1) // args.page_size) * args.page_size
    cfg = ModelConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
                      n_kv_heads=args.n_kv_heads, d_head=args.d_model // args.n_heads, d_ff=args.d_ff,
                      max_seq_len=max_len)
    params = jax.jit(init_params, static_argnums=(0, 2))(cfg, jax.random.key(0, impl="rbg"), jnp.float32)
    settings = dict(max_seqs=args.max_seqs, max_len=max_len, page_size=args.page_size, token_budget=args.token_budget,
                    chunk_buckets=tuple(args.chunk_buckets), decode_steps=args.decode_steps)
    return params, cfg, stream, settings


def serve_only(args) -> None:
    """The server subprocess: the benchmark's model behind ``serve`` on a free loopback port (prints its URL)."""
    from mlx_llm.data.tokenizer import IdTokenizer
    from mlx_llm.decode.engine import Engine
    from mlx_llm.serve.app import Model, serve

    params, cfg, _, settings = model_of(args)  # the same model and settings as the clients' process
    engine = Engine(params, cfg, max_top_logprobs=0, **settings)
    engine.warm_up()  # every shape compiled before the URL is printed (as `mlx-llm serve` does by default)
    model = Model(engine, IdTokenizer(cfg.vocab_size), None, name="bench", root="(random weights)")
    engine.detokenize = model.detokenize
    serve(model, port=0, max_queue=10 * args.requests)


# ----- the three servers, closed loop --------------------------------------------------------------------------
def run_http(url: str, stream, clients: int):
    """(seconds, tokens per request, first-token seconds, inter-token seconds) of the stream over HTTP."""
    import httpx

    async def main():
        todo = collections.deque(range(len(stream)))
        tokens, ttft, itl = [None] * len(stream), [], []

        async def client(h):
            while todo:
                i = todo.popleft()
                prompt, m = stream[i]
                sent, times, got = time.perf_counter(), [], []
                body = {"model": "bench", "prompt": prompt, "max_tokens": m, "temperature": 0, "ignore_eos": True,
                        "stream": True, "return_token_ids": True}
                async with h.stream("POST", url + "/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            ids = json.loads(line[6:])["choices"][0]["token_ids"]
                            now = time.perf_counter()
                            times += [now] * len(ids)
                            got += ids
                tokens[i] = got
                ttft.append(times[0] - sent)
                itl.extend(b - a for a, b in zip(times, times[1:]))

        limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
        async with httpx.AsyncClient(timeout=600, limits=limits) as h:
            start = time.perf_counter()
            await asyncio.gather(*[client(h) for _ in range(clients)])
            return time.perf_counter() - start, tokens, ttft, itl

    return asyncio.run(main())


WARM: list = []


def run_engine(params, cfg, stream, settings, clients: int):
    """The same closed loop on the engine in this process."""
    from mlx_llm.decode.engine import Engine, Request

    eng = Engine(params, cfg, **settings)
    if not WARM:
        eng.warm_up()  # every shape once per process (the programs are shared by later engines)
        WARM.append(True)
    todo, live = collections.deque(range(len(stream))), {}
    sent, out = {}, [None] * len(stream)
    start = time.perf_counter()

    def submit():
        i = todo.popleft()
        sent[i] = time.perf_counter()
        live[i] = eng.submit(Request(tuple(stream[i][0]), max_tokens=stream[i][1]))

    for _ in range(min(clients, len(stream))):
        submit()
    while live:
        eng.step()
        for i, c in list(live.items()):
            if c.done:
                out[i] = c.replies[0]
                del live[i]
                if todo:
                    submit()
    seconds = time.perf_counter() - start
    ttft = [out[i].times[0] - sent[i] for i in range(len(stream))]
    itl = [b - a for r in out for a, b in zip(r.times, r.times[1:])]
    return seconds, [r.tokens for r in out], ttft, itl


def hf_runner(params, cfg, settings, clients: int):
    """transformers' continuous batching, the same closed loop (a function of the stream); None without the hf
    extra."""
    from experiments.hf_twin import try_hf_twin

    twin = try_hf_twin(params, cfg)
    if twin is None:
        return None
    model, torch = twin
    model.eval()
    from transformers import ContinuousBatchingConfig, GenerationConfig

    gen = GenerationConfig(max_new_tokens=settings["max_len"], do_sample=False, eos_token_id=None, pad_token_id=2)
    blocks = settings["max_seqs"] * settings["max_len"] // settings["page_size"]
    cb = ContinuousBatchingConfig(block_size=settings["page_size"], num_blocks=blocks,
                                  max_batch_tokens=settings["token_budget"], max_requests_per_batch=settings["max_seqs"])

    def once(stream):
        with torch.no_grad(), model.continuous_batching_context_manager(
                generation_config=gen, continuous_batching_config=cb, block=True, timeout=600, warmup=False) as cbm:
            todo, results, sent = collections.deque(range(len(stream))), {}, {}

            def add():
                i = todo.popleft()
                sent[i] = time.perf_counter()
                cbm.add_request(list(stream[i][0]), request_id=f"r{i}", max_new_tokens=stream[i][1],
                                record_timestamps=True)

            start = time.perf_counter()
            for _ in range(min(clients, len(stream))):
                add()
            while len(results) < len(stream):
                r = cbm.get_result(timeout=1)
                if r is not None and r.is_finished():
                    results[r.request_id] = r
                    if todo:
                        add()
                elif r is None and not cbm.is_running():
                    raise RuntimeError("transformers' continuous batching stopped before finishing the stream")
            seconds = time.perf_counter() - start
        tokens, ttft, itl = [], [], []
        for i, (_, m) in enumerate(stream):
            r = results[f"r{i}"]
            tokens.append(list(r.generated_tokens)[:m])
            times = list(r.timestamps or [])
            if times:
                ttft.append(times[0] - sent[i])
                itl += [b - a for a, b in zip(times, times[1:])]
        return seconds, tokens, ttft, itl

    return once


def without_save(argv) -> list:
    """The command line less ``--save NAME`` (the server subprocess writes nothing)."""
    out, skip = [], False
    for a in argv:
        if not skip and a != "--save" and not a.startswith("--save="):
            out.append(a)
        skip = a == "--save"
    return out


def start_server(argv) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "experiments.bench_serve", "--serve-only", *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    while True:
        try:
            line = lines.get(timeout=600)
        except queue.Empty:
            proc.kill()
            raise RuntimeError("the server did not start in 600 s") from None
        if line.startswith("serving "):
            return proc, line.split(" at ")[1].split()[0]
        if proc.poll() is not None:
            raise RuntimeError("the server exited: " + proc.stderr.read()[-2000:])


def render(result: dict) -> str:
    rows = result["servers"]
    lines = [f"Model d={result['args']['d_model']}, L={result['args']['n_layers']}, V={result['args']['vocab']} "
             f"({result['params'] / 1e6:.1f}M parameters), float32; {result['args']['repeats']} timed passes of "
             f"{result['args']['requests']} requests ({sum(result['stream']['reply_tokens']):,d} output tokens in all),"
             f" {result['args']['clients']} concurrent clients, closed loop; engine: {result['args']['max_seqs']} rows,"
             f" pages of {result['args']['page_size']}, token budget {result['args']['token_budget']}. Totals over the"
             " passes, servers taking turns.", "",
             "| server | requests/s | output tokens/s | vs in-process engine | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 "
             "| greedy tokens as engine |", "|---|---|---|---|---|---|---|---|---|"]
    ms = lambda d, k: f"{d[k] * 1e3:.0f} ms" if k in d else "—"
    for name, r in rows.items():
        lines.append(f"| {name} | {r['requests_per_second']:.2f} | {r['tokens_per_second']:.1f} | "
                     f"{r['vs_engine']:.2f}× | {ms(r['ttft'], 'p50')} | {ms(r['ttft'], 'p99')} | "
                     f"{ms(r['itl'], 'p50')} | {ms(r['itl'], 'p99')} | {r['same_tokens']}/{result['stream']['requests']} |")
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.render:
        print(render(common.load_result(args.save or args.result_name)))
        return
    if args.serve_only:
        serve_only(args)
        return
    import jax

    params, cfg, streams, settings = model_of(args)
    print(f"device: {jax.devices()[0].device_kind}; model d={cfg.d_model} L={cfg.n_layers} V={cfg.vocab_size}: "
          f"{cfg.param_count() / 1e6:.1f}M parameters; {args.repeats} timed passes of {args.requests} requests, "
          f"{sum(m for s in streams[1:] for _, m in s):,d} output tokens; {args.clients} clients", flush=True)
    proc, url = start_server(without_save(argv))
    try:
        servers = {"server": lambda s: run_http(url, s, args.clients),
                   "engine": lambda s: run_engine(params, cfg, s, settings, args.clients)}
        hf = None if args.no_hf else hf_runner(params, cfg, settings, args.clients)
        if hf is not None:
            servers["hf cb"] = hf
        first = {}
        for name, fn in servers.items():
            start = time.perf_counter()
            fn(streams[0])
            first[name] = time.perf_counter() - start
            print(f"{name}: first pass (compiles) {first[name]:.1f} s", flush=True)
        results = {name: [] for name in servers}
        for stream in streams[1:]:
            for name, fn in servers.items():
                results[name].append(fn(stream))
    finally:
        proc.terminate()
        proc.wait(60)
    timed = streams[1:]
    out_tokens, n_requests = sum(m for s in timed for _, m in s), sum(len(s) for s in timed)
    total = {name: sum(r[0] for r in runs) for name, runs in results.items()}
    ref, rows = [t for r in results["engine"] for t in r[1]], {}
    for name, runs in results.items():
        tokens = [t for r in runs for t in r[1]]
        rows[name] = {"seconds": total[name], "requests_per_second": n_requests / total[name],
                      "tokens_per_second": out_tokens / total[name], "vs_engine": total["engine"] / total[name],
                      "ttft": percentiles([x for r in runs for x in r[2]]),
                      "itl": percentiles([x for r in runs for x in r[3]]),
                      "same_tokens": sum(a == b for a, b in zip(tokens, ref)),
                      "all_seconds": [r[0] for r in runs], "first_pass_seconds": first[name]}
    result = {"args": common.arguments(args), "params": cfg.param_count(),
              "stream": {"requests": n_requests, "prompt_tokens": [len(p) for s in timed for p, _ in s],
                         "reply_tokens": [m for s in timed for _, m in s]}, "servers": rows}
    print(render(result))
    common.save_from_args(args, result)


if __name__ == "__main__":
    main()
