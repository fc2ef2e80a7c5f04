"""Corpus → token streams in the memmap cache (M20 §2): the streaming encoder.

Pipeline: ``text.read_corpus`` (sources → documents, split train/val by name) → ``encode_corpus`` (token streams
cached as NumPy memmaps) → ``packing.Corpus.train_batch(step, …)`` / ``Corpus.val_batches(…)``.

Decisions (each one tested in tests/test_data.py and tests/test_sources.py):

- Stream layout per split: ``BOS doc₀ EOS BOS doc₁ EOS …``; ``doc_starts`` holds the offset of each BOS.
- Encoding streams: documents are read one at a time, gathered into chunks of about ``chunk_bytes`` of one split,
  encoded by ``workers`` processes (the tokenizer handed over as its ``tokenizer.json``; one chunk or
  ``workers=1``: in this process) with at most two chunks per worker in flight, and appended to the cache's files
  as they come back, in order. Memory is bounded by the chunks in flight, not by the corpus. The tokens are those
  of ``encode_stream`` (the all-in-memory path, kept as the reference) on the same documents.
- The cache entry ``cache_dir / cache_key`` is written in a temporary directory and renamed into place (atomic);
  the pass that encodes also fingerprints what it read, and a corpus that changed meanwhile is refused.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from mlx_llm.data.packing import Corpus, TokenSplit, check_positive
from mlx_llm.data.text import SPLITS, Document, Fingerprint, TextCorpus, read_corpus
from mlx_llm.data.tokenizer import Tokenizer, load
from mlx_llm.errors import DataError

log = logging.getLogger(__name__)

CACHE_FORMAT = 1
DEFAULT_CHUNK_BYTES = 1 << 20  # text per encoding chunk


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/mlx_llm`` or ``~/.cache/mlx_llm``."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mlx_llm"


def default_workers() -> int:
    """Encoding processes by default: min(4, CPU count)."""
    return max(1, min(4, os.cpu_count() or 1))


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (V ≤ 65536), else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def encode_stream(docs: list[Document], tok: Tokenizer, chunk: int = 256) -> TokenSplit:
    """``BOS doc EOS`` for each document (``doc EOS`` for a tokenizer without BOS, e.g. Qwen's), concatenated;
    documents encoded ``chunk`` at a time (batch encode). All in memory: the reference of the streaming path."""
    pieces = []
    for k in range(0, len(docs), chunk):
        pieces.extend(tok.encode_batch([d.text for d in docs[k : k + chunk]]))
    bos = tok.bos_prefix
    lengths = np.array([len(bos) + len(p) + 1 for p in pieces], np.int64)
    doc_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    out = np.empty(int(lengths.sum()), token_dtype(tok.vocab_size))
    for start, ids in zip(doc_starts.tolist(), pieces):
        out[start : start + len(bos)] = bos
        out[start + len(bos) : start + len(bos) + len(ids)] = ids
        out[start + len(bos) + len(ids)] = tok.eos_id
    return TokenSplit(out, doc_starts)


def cache_key(corpus: TextCorpus, tok: Tokenizer) -> str:
    """Corpus content × tokenizer × cache format."""
    raw = f"{CACHE_FORMAT}\0{corpus.fingerprint()}\0{tok.fingerprint()}"
    return hashlib.sha256(raw.encode("utf-8")).hexdigest()[:32]


def _write_cache(final: Path, splits: dict[str, TokenSplit]) -> None:
    """Write splits held in memory as a cache entry (the all-in-memory path; ``encode_corpus`` streams)."""
    def write(tmp: Path) -> None:
        meta = {"format": CACHE_FORMAT, "splits": {}}
        for name, s in splits.items():
            s.tokens.tofile(tmp / f"{name}.bin")
            np.save(tmp / f"{name}_doc_starts.npy", s.doc_starts)
            meta["splits"][name] = {"n_tokens": s.n_tokens, "dtype": s.tokens.dtype.name}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))

    _publish(final, write)


def _publish(final: Path, write) -> None:
    """``write(tmp)`` into a temporary directory beside ``final``, then rename it into place (atomic; when another
    process finished first, its entry is used and this one dropped)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".tmp-", dir=final.parent))
    try:
        write(tmp)
        os.rename(tmp, final)
    except OSError:
        if not (final / "meta.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _read_cache(final: Path) -> dict[str, TokenSplit] | None:
    try:
        meta = json.loads((final / "meta.json").read_text())
        out = {}
        for name, m in meta["splits"].items():
            tokens = np.memmap(final / f"{name}.bin", dtype=np.dtype(m["dtype"]), mode="r", shape=(m["n_tokens"],))
            out[name] = TokenSplit(tokens, np.load(final / f"{name}_doc_starts.npy"))
        return out if meta.get("format") == CACHE_FORMAT else None
    except (OSError, ValueError, KeyError):
        return None


# ----- streaming encode ---------------------------------------------------------------------------
class _SplitWriter:
    """Appends one split's tokens to ``NAME.bin`` and its document offsets to a raw file, made ``.npy`` at close."""

    def __init__(self, directory: Path, name: str, dtype: np.dtype):
        self.directory, self.name, self.dtype = directory, name, dtype
        self._tokens = open(directory / f"{name}.bin", "wb")
        self._starts = open(directory / f"{name}_doc_starts.raw", "wb")
        self.n_tokens = self.n_docs = 0

    def write(self, tokens: np.ndarray, doc_starts: np.ndarray) -> None:
        np.asarray(tokens, self.dtype).tofile(self._tokens)
        (np.asarray(doc_starts, np.int64) + self.n_tokens).tofile(self._starts)
        self.n_tokens += len(tokens)
        self.n_docs += len(doc_starts)

    def close(self, block: int = 1 << 20) -> dict:
        self._tokens.close()
        self._starts.close()
        raw, target = self.directory / f"{self.name}_doc_starts.raw", self.directory / f"{self.name}_doc_starts.npy"
        if self.n_docs == 0:
            np.save(target, np.zeros(0, np.int64))
        else:
            out = np.lib.format.open_memmap(target, mode="w+", dtype=np.int64, shape=(self.n_docs,))
            with open(raw, "rb") as fh:
                for k in range(0, self.n_docs, block):
                    out[k : k + block] = np.fromfile(fh, np.int64, count=min(block, self.n_docs - k))
            out.flush()
            del out
        raw.unlink()
        return {"n_tokens": self.n_tokens, "dtype": self.dtype.name}


def _chunks(stream, chunk_bytes: int, fp: Fingerprint):
    """(split, texts, UTF-8 bytes) of about ``chunk_bytes`` of one split's documents, in order; ``fp`` sees every
    document read."""
    pending = {s: ([], 0) for s in SPLITS}
    for split, doc, source in stream:
        raw = doc.text.encode("utf-8")
        fp.add(source, split, doc.name, raw)
        texts, n = pending[split]
        texts.append(doc.text)
        pending[split] = (texts, n + len(raw))
        if n + len(raw) >= chunk_bytes:
            yield split, texts, n + len(raw)
            pending[split] = ([], 0)
    for split, (texts, n) in pending.items():
        if texts:
            yield split, texts, n


def _encode_texts(texts: list[str], tok: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, doc_starts from 0) of one chunk, laid out by ``encode_stream``."""
    split = encode_stream([Document("", t) for t in texts], tok, chunk=max(len(texts), 1))
    return split.tokens, split.doc_starts


def _send(fh, obj) -> None:
    payload = pickle.dumps(obj, protocol=5)
    fh.write(len(payload).to_bytes(8, "little") + payload)
    fh.flush()


def _receive(fh):
    header = fh.read(8)
    if len(header) < 8:
        return None
    return pickle.loads(fh.read(int.from_bytes(header, "little")))


def worker_main(tokenizer_file: str, fingerprint: str) -> None:
    """An encoding worker (``python -c``, see ``_Workers``): chunks of texts in on stdin, ("ok", (tokens,
    doc_starts)) or ("error", exception) out on stdout, until stdin closes."""
    inp, out = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything printed goes to stderr, not into the protocol
    tok = load(tokenizer_file)
    if tok.fingerprint() != fingerprint:
        _send(out, ("error", DataError(f"{tokenizer_file} does not load back as the tokenizer it was saved from: "
                                       f"encoding workers cannot use it")))
        return
    while (texts := _receive(inp)) is not None:
        try:
            _send(out, ("ok", _encode_texts(texts, tok)))
        except Exception as err:  # handed back to the parent, which raises it
            _send(out, ("error", err))


class _Workers:
    """``n`` worker processes started with ``python -c`` (so the caller's main module is never imported again,
    unlike multiprocessing's spawn), each given one chunk at a time, chunk k to worker k mod n: results come back
    in order, at most ``n`` chunks are in flight, and no pipe can deadlock (a worker is idle when sent a chunk)."""

    def __init__(self, tok: Tokenizer, n: int):
        self._dir = tempfile.TemporaryDirectory(prefix="mlx_llm-encode-")
        path = tok.save(Path(self._dir.name) / "tokenizer.json")
        code = f"from mlx_llm.data.encoding import worker_main; worker_main({str(path)!r}, {tok.fingerprint()!r})"
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        self._procs = [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        env=env) for _ in range(n)]

    def _result(self, proc):
        got = _receive(proc.stdout)
        if got is None:
            raise DataError(f"an encoding worker exited (code {proc.wait()}) before returning its chunk")
        if got[0] == "error":
            raise got[1]
        return got[1]

    def map(self, chunks):
        """(split, tokens, doc_starts, bytes) for each (split, texts, bytes) chunk, in order."""
        pending = collections.deque()
        for k, (split, texts, n) in enumerate(chunks):
            proc = self._procs[k % len(self._procs)]
            if len(pending) == len(self._procs):  # the oldest chunk in flight is this worker's
                split_, n_ = pending.popleft()
                yield (split_, *self._result(proc), n_)
            _send(proc.stdin, texts)
            pending.append((split, n))
            k_oldest = k - len(pending) + 1
        while pending:
            split_, n_ = pending.popleft()
            yield (split_, *self._result(self._procs[k_oldest % len(self._procs)]), n_)
            k_oldest += 1

    def close(self, kill: bool = False) -> None:
        """Close the workers' input and wait for them (``kill``: stop them at once, after an error)."""
        for proc in self._procs:
            if kill:
                proc.kill()
            with contextlib.suppress(OSError):
                proc.stdin.close()
        for proc in self._procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proc.stdout.close()
        self._dir.cleanup()


@contextlib.contextmanager
def _encoder(tok: Tokenizer, workers: int):
    """A function chunks → (split, tokens, doc_starts, bytes) in order: in this process, or by ``workers``
    processes that load the tokenizer from its ``tokenizer.json``."""
    if workers <= 1:
        yield lambda chunks: ((s, *_encode_texts(texts, tok), n) for s, texts, n in chunks)
        return
    pool = _Workers(tok, workers)
    try:
        yield pool.map
    except BaseException:
        pool.close(kill=True)
        raise
    pool.close()


def _encode_into(tmp: Path, corpus: TextCorpus, tok: Tokenizer, *, workers: int, chunk_bytes: int,
                 progress: bool) -> tuple[dict, str]:
    """Encode both splits into ``tmp`` chunk by chunk; (the splits' meta, the fingerprint of what was read)."""
    from tqdm.auto import tqdm

    dtype, fp = token_dtype(tok.vocab_size), Fingerprint()
    writers = {s: _SplitWriter(tmp, s, dtype) for s in SPLITS}
    total = corpus.n_bytes()
    n_tokens, start = 0, time.perf_counter()
    with tqdm(total=total, disable=not progress, unit="B", unit_scale=True, desc="encoding", dynamic_ncols=True) \
            as bar, _encoder(tok, 1 if total <= chunk_bytes else workers) as encode:
        for split, tokens, doc_starts, n_bytes in encode(_chunks(corpus.stream(), chunk_bytes, fp)):
            writers[split].write(tokens, doc_starts)
            n_tokens += len(tokens)
            bar.update(n_bytes)
            bar.set_postfix_str(f"{tqdm.format_sizeof(n_tokens / max(time.perf_counter() - start, 1e-9))} tokens/s",
                                refresh=False)
    return {s: w.close() for s, w in writers.items()}, fp.hexdigest()


def _build_cache(final: Path, corpus: TextCorpus, tok: Tokenizer, fingerprint: str, **encode) -> None:
    """Encode into a temporary directory beside ``final`` and rename it into place (atomic)."""
    def write(tmp: Path) -> None:
        splits, seen = _encode_into(tmp, corpus, tok, **encode)
        if seen != fingerprint:
            raise DataError(f"the corpus changed while it was being encoded ({corpus.stats.source}): nothing was "
                            f"cached at {final}; run again once its files stay put")
        (tmp / "meta.json").write_text(json.dumps({"format": CACHE_FORMAT, "splits": splits}, indent=2))

    _publish(final, write)


def encode_corpus(corpus: TextCorpus, tok: Tokenizer, cache_dir=None, *, workers: int | None = None,
                  progress: bool = False, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Corpus:
    """Encode both splits, streaming (see the module docstring), or memory-map them from ``cache_dir / cache_key``
    when already encoded. ``workers``: encoding processes (default ``default_workers()``; 1: this process);
    ``progress``: a bar with bytes/s and tokens/s."""
    workers = default_workers() if workers is None else workers
    check_positive(workers=workers, chunk_bytes=chunk_bytes)
    fingerprint = corpus.fingerprint()
    final = Path(cache_dir if cache_dir is not None else default_cache_dir()) / cache_key(corpus, tok)
    splits, seconds = _read_cache(final), 0.0
    hit = splits is not None
    if not hit:
        shutil.rmtree(final, ignore_errors=True)  # an unreadable cache entry is rebuilt
        t0 = time.perf_counter()
        _build_cache(final, corpus, tok, fingerprint, workers=workers, chunk_bytes=chunk_bytes, progress=progress)
        seconds = time.perf_counter() - t0
        splits = _read_cache(final)
        if splits is None:
            raise DataError(f"could not read back the token cache just written at {final}")
    return Corpus(splits["train"], splits["val"], tok, corpus.stats, final, hit, seconds)


def load_corpus(tok: Tokenizer, path=None, *, cache_dir=None, workers: int | None = None, progress: bool = False,
                **read_kwargs) -> Corpus:
    """``read_corpus`` then ``encode_corpus``."""
    return encode_corpus(read_corpus(path, **read_kwargs), tok, cache_dir, workers=workers, progress=progress)
