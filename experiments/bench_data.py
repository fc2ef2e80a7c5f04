"""Encoding a text corpus: the streaming path (``read_corpus`` + ``encode_corpus``) against the old all-in-memory
path (``read_documents`` + ``split_documents`` + ``encode_stream`` + ``_write_cache``), side by side, as the corpus
grows (issue 25 part 1: peak memory must not grow with the corpus).

For each size a synthetic corpus of text files (word-salad lines, 256 kB files, the same on every run) is written,
then encoded by each path in a fresh process (``python -c``), into an empty token cache. The child reports its
wall time, the bytes and tokens it encoded, its peak RSS (``resource.getrusage``: ``RUSAGE_SELF`` for the process,
``RUSAGE_CHILDREN`` for its encoding workers, measured before anything reads the cache back) and a SHA-256 of each
split's tokens, so the two paths are checked to give the same tokens. Byte-level tokens by default (``--tokenizer
bpe``: a 512-id BPE trained once on the first corpus's first MB).

    python -m experiments.bench_data                      # 25, 50, 100, 200, 400 MB; 2 workers
    python -m experiments.bench_data --sizes 25 100 --workers 4 --tokenizer bpe
    python -m experiments.bench_data --quick              # 2 and 4 MB, for the test

Writes experiments/results/bench_data.json (``--save``; nothing under --quick unless asked) and, with ``--out
DIR``, DIR/bench_data.json too.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np

from experiments import common

FILE_BYTES = 256 << 10
WORDS = ("def", "return", "self", "value", "import", "class", "for", "in", "if", "else", "x", "y", "(", ")", ":",
         "naïve", "café", "= 1", "# note", "print")

# The child: encode CORPUS one way (MODE) with TOKENIZER into CACHE; print one JSON line.
CHILD = textwrap.dedent("""
    import hashlib, json, resource, sys, time
    from pathlib import Path
    import numpy as np
    from mlx_llm.data import encoding as encoding_lib, text as text_lib, tokenizer as T

    mode, corpus, tok_file, cache, workers = sys.argv[1:6]
    tok = T.load(tok_file)
    t0 = time.perf_counter()
    if mode == "stream":
        text = text_lib.read_corpus(corpus, val_percent=5.0)
        out = encoding_lib.encode_corpus(text, tok, cache, workers=int(workers))
        splits, n_bytes = {"train": out.train, "val": out.val}, text.stats.n_bytes
    else:  # the all-in-memory path, as it was before streaming
        files, where = text_lib.find_files(corpus)
        docs, stats = text_lib.read_documents(files, where)
        train, val = text_lib.split_documents(docs, 5.0)
        key = encoding_lib.cache_key(text_lib.TextCorpus(train, val, stats), tok)
        splits = {"train": encoding_lib.encode_stream(train, tok), "val": encoding_lib.encode_stream(val, tok)}
        encoding_lib._write_cache(Path(cache) / key, splits)
        n_bytes = stats.n_bytes
    seconds = time.perf_counter() - t0
    self_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    workers_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    n_tokens = sum(s.n_tokens for s in splits.values())
    digests = {k: hashlib.sha256(np.ascontiguousarray(s.tokens).tobytes()).hexdigest() for k, s in splits.items()}
    print(json.dumps({"seconds": seconds, "n_bytes": n_bytes, "n_tokens": n_tokens, "peak_rss_mb": self_kb / 1024,
                      "worker_peak_rss_mb": workers_kb / 1024, "tokens_sha256": digests}))
""")


def write_corpus(root: Path, n_bytes: int, seed: int = 0) -> Path:
    """About ``n_bytes`` of text in files of ``FILE_BYTES``: up to 64 distinct bodies (the first ones of one
    seeded stream, so a smaller corpus draws only the bodies it uses), each file headed by its number."""
    n_files = max(1, n_bytes // FILE_BYTES)
    bodies = _bodies(min(64, n_files), seed)
    root.mkdir(parents=True)
    for k in range(n_files):
        (root / f"d{k // 100:03d}" / f"f{k:05d}.txt").parent.mkdir(exist_ok=True)
        (root / f"d{k // 100:03d}" / f"f{k:05d}.txt").write_text(f"# file {k}\n" + bodies[k % 64])
    return root


def _bodies(n: int, seed: int) -> list[str]:
    """The first ``n`` file bodies of the stream of ``seed``: lines of 3 to 13 words drawn uniformly from WORDS,
    to at least FILE_BYTES each (word indices drawn as ``rng.integers``, the same draws ``rng.choice`` makes)."""
    rng, words = np.random.default_rng(seed), WORDS
    sizes = [len(w.encode("utf-8")) for w in words]
    bodies = []
    for _ in range(n):
        lines, size = [], 0
        while size < FILE_BYTES:
            picks = rng.integers(0, len(words), size=int(rng.integers(3, 14)))
            lines.append(" ".join([words[i] for i in picks]) + "\n")
            size += sum([sizes[i] for i in picks]) + len(picks)
        bodies.append("".join(lines))
    return bodies


def make_tokenizer(kind: str, corpus: Path, out: Path) -> Path:
    from mlx_llm.data import tokenizer as T

    if kind == "byte":
        return T.ByteTokenizer().save(out)
    sample = [p.read_text() for p in sorted(corpus.rglob("*.txt"))[:4]]
    return T.train_bpe(sample, 512).save(out)


def encode_in_child(mode: str, corpus: Path, tok_file: Path, workers: int, scratch: Path) -> dict:
    cache = Path(tempfile.mkdtemp(prefix=f"cache-{mode}-", dir=scratch))
    try:
        proc = subprocess.run([sys.executable, "-c", CHILD, mode, str(corpus), str(tok_file), str(cache),
                               str(workers)], capture_output=True, text=True, cwd=common.REPO)
        if proc.returncode != 0:
            raise SystemExit(f"the {mode} child failed:\n{proc.stderr[-3000:]}")
        row = json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    row["mb_per_s"] = row["n_bytes"] / row["seconds"] / 1e6
    row["mtokens_per_s"] = row["n_tokens"] / row["seconds"] / 1e6
    return row


def measure(size_mb: float, args, scratch: Path, tok_file: Path | None) -> tuple[dict, Path]:
    corpus = write_corpus(scratch / f"corpus-{size_mb:g}", int(size_mb * 1e6))
    tok_file = tok_file or make_tokenizer(args.tokenizer, corpus, scratch / "tokenizer.json")
    try:
        stream = encode_in_child("stream", corpus, tok_file, args.workers, scratch)
        baseline = encode_in_child("baseline", corpus, tok_file, args.workers, scratch)
    finally:
        shutil.rmtree(corpus, ignore_errors=True)
    row = {"size_mb": size_mb, "n_bytes": stream["n_bytes"], "stream": stream, "baseline": baseline,
           "tokens_equal": stream["tokens_sha256"] == baseline["tokens_sha256"],
           "rss_ratio_baseline_over_stream": baseline["peak_rss_mb"] / stream["peak_rss_mb"],
           "speed_ratio_stream_over_baseline": stream["mb_per_s"] / baseline["mb_per_s"]}
    return row, tok_file


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[25, 50, 100, 200, 400], help="corpus sizes in MB")
    ap.add_argument("--workers", type=int, default=2, help="encoding processes of the streaming path")
    ap.add_argument("--tokenizer", choices=("byte", "bpe"), default="byte")
    ap.add_argument("--quick", action="store_true", help="2 and 4 MB (a test)")
    ap.add_argument("--out", type=Path, help="also write DIR/bench_data.json")
    common.add_save_argument(ap, "bench_data")
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes = [2, 4]
    return args


def main(argv=None) -> int:
    args = parse(argv)
    scratch, tok_file, rows = Path(tempfile.mkdtemp(prefix="bench_data-")), None, []
    try:
        for size in args.sizes:
            row, tok_file = measure(size, args, scratch, tok_file)
            rows.append(row)
            s, b = row["stream"], row["baseline"]
            print(f"{size:g} MB: stream {s['mb_per_s']:.1f} MB/s, {s['mtokens_per_s']:.2f} M tokens/s, peak RSS "
                  f"{s['peak_rss_mb']:.0f} MB (+ workers ≤ {s['worker_peak_rss_mb']:.0f} MB each) | in memory "
                  f"{b['mb_per_s']:.1f} MB/s, peak RSS {b['peak_rss_mb']:.0f} MB | RSS ratio "
                  f"{row['rss_ratio_baseline_over_stream']:.1f}, same tokens: {row['tokens_equal']}", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    first, last = rows[0], rows[-1]
    growth = {p: last[p]["peak_rss_mb"] / first[p]["peak_rss_mb"] for p in ("stream", "baseline")}
    print(f"peak RSS from {first['size_mb']:g} to {last['size_mb']:g} MB of text: stream ×{growth['stream']:.2f}, "
          f"in memory ×{growth['baseline']:.2f}")
    payload = {"args": common.arguments(args), "rows": rows, "peak_rss_growth": growth,
               "tokens_equal": all(r["tokens_equal"] for r in rows)}
    if args.out is not None:
        common.save_result("bench_data", payload, directory=args.out)
    common.save_from_args(args, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
