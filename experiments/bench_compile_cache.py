"""Start-up of a training run with jax's persistent compilation cache (``mlx-llm train --compilation-cache DIR``).

The same small run (the main job's model, byte tokens, a few steps) starts in fresh processes: first without the
compilation cache (``--compilation-cache off``; it also fills the token cache, so no later run encodes the
corpus), then ``--rounds`` times with an empty cache directory followed by a start on the cache that run left
(warm), cold and warm alternating. Start-up is the time from the process's start to the end of its first
training step, its metrics read back: imports, corpus, tokenizer, the pre-flight compile of the step, the step's
compile (or its load from the cache) and its first run. The ratio cold / warm is what a restarted run (a
preempted job resumed, a resumed run, a second experiment of one configuration) saves at start-up.

    python -m experiments.bench_compile_cache [--rounds 2] [--steps 3] [--batch-size 8] [--seq-len 128]

Writes experiments/results/bench_compile_cache.json (``--save``).
"""

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from experiments import common

# The child: mlx-llm train, reporting when its first step's metrics are back (seconds since the child started).
CHILD = textwrap.dedent("""
    import sys, time
    t0 = time.perf_counter()
    from mlx_llm.train import loop
    read_back, seen = loop.read_back, []

    def first(*args, **kwargs):
        rows = read_back(*args, **kwargs)
        if not seen:
            seen.append(True)
            print(f"FIRST_STEP {time.perf_counter() - t0:.3f}", file=sys.stderr, flush=True)
        return rows

    loop.read_back = first
    from mlx_llm.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def write_corpus(root: Path) -> Path:
    """A few hundred KB of Python-looking lines (the same on every run)."""
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(16):
        (corpus / f"m{i:02d}.py").write_text("".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}\n\n"
                                                     for j in range(600)))
    return corpus


def start(root: Path, corpus: Path, compile_cache: str, args, name: str) -> dict:
    """One run in a fresh process: {"first_step_s", "process_s"}."""
    cmd = [sys.executable, "-c", CHILD, "train", "--data", str(corpus), "--extensions", ".py", "--tokenizer", "byte",
           "--out", str(root / name), "--cache-dir", str(root / "tokens"), "--compilation-cache", compile_cache,
           "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
           "--warmup-steps", "1", "--log-interval", "1", "--eval-tokens", "2048", "--sample-tokens", "4",
           "--no-progress"]
    began = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=common.REPO)
    took = time.perf_counter() - began
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    first = next(float(line.split()[1]) for line in proc.stderr.splitlines() if line.startswith("FIRST_STEP "))
    return {"first_step_s": first, "process_s": took}


def cache_files(path: Path) -> tuple[int, int]:
    files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else []
    return len(files), sum(p.stat().st_size for p in files)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2, help="cold/warm pairs (default %(default)s)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    common.add_save_argument(ap, "bench_compile_cache")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench_compile_cache-"))
    try:
        corpus = write_corpus(root)
        off = start(root, corpus, "off", args, "off")
        print(f"no compilation cache (token cache filled): first step after {off['first_step_s']:.2f} s", flush=True)
        rows = []
        for r in range(args.rounds):
            cache = root / f"xla{r}"
            cold = start(root, corpus, str(cache), args, f"cold{r}")
            entries = cache_files(cache)
            warm = start(root, corpus, str(cache), args, f"warm{r}")
            rows.append({"cold": cold, "warm": warm, "cache_entries": entries[0], "cache_bytes": entries[1]})
            print(f"round {r + 1}: empty cache {cold['first_step_s']:.2f} s, warm cache {warm['first_step_s']:.2f} s "
                  f"to the first step (ratio {cold['first_step_s'] / warm['first_step_s']:.2f}); "
                  f"{entries[0]} cache files, {entries[1] / 1e6:.1f} MB", flush=True)
        cold_s = statistics.median(r["cold"]["first_step_s"] for r in rows)
        warm_s = statistics.median(r["warm"]["first_step_s"] for r in rows)
        print(f"median start-up: empty cache {cold_s:.2f} s, warm cache {warm_s:.2f} s, ratio {cold_s / warm_s:.2f} "
              f"(without a cache: {off['first_step_s']:.2f} s)")
        common.save_from_args(args, {"args": common.arguments(args), "no_cache": off, "rounds": rows,
                                     "median_first_step_s": {"cold": cold_s, "warm": warm_s},
                                     "ratio_cold_over_warm": cold_s / warm_s})
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
