"""Corpus → token stream → packed training windows (M20 §2, §10).

Pipeline: ``read_corpus`` (files → documents, split train/val by file) → ``encode_corpus`` (token streams cached
as NumPy memmaps) → ``Corpus.train_batch(step, …)`` / ``Corpus.val_batches(…)``.

Decisions (each one tested in tests/test_data.py):

- Default corpus: the ``.py`` sources of the running Python's standard library
  (``sysconfig.get_paths()["stdlib"]``), without ``site-packages``, ``__pycache__`` and test directories
  (``test``, ``tests``, ``idle_test``: they hold deliberately malformed files, non-UTF-8 encodings and generated
  data). Directory walks skip dot-directories (``.git``, ``.venv``) and follow no symlinked directories.
- Files are sorted by their relative POSIX path. A file goes to val when
  ``int(sha256(relpath)[:8], 16) % 10000 < 100 * val_percent`` (stable across machines and Python runs). If that
  leaves val (or train) empty, the file with the lowest (highest) score moves over. A corpus of a single
  document is cut at the first line start at or after ``(1 − val_percent/100)`` of its characters (at that
  character when no newline follows): the tail is val.
- Non-UTF-8 files are skipped and counted (``on_decode_error="skip"``; ``"replace"`` keeps them with U+FFFD,
  ``"error"`` raises). Files that are empty or whitespace-only are skipped and counted.
- Stream layout per split: ``BOS doc₀ EOS BOS doc₁ EOS …``; ``doc_starts`` holds the offset of each BOS.
"""

from __future__ import annotations

import dataclasses
import glob as globlib
import hashlib
import json
import logging
import math
import os
import shutil
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from mlx_llm.errors import ConfigError, DataError, InputError
from mlx_llm.train.tokenizer import Tokenizer

log = logging.getLogger(__name__)

DEFAULT_EXTENSIONS = (".py", ".txt", ".md")
STDLIB_EXCLUDED_DIRS = ("site-packages", "__pycache__", "test", "tests", "idle_test")
DEFAULT_VAL_PERCENT = 5.0
CACHE_FORMAT = 1
_DECODE_POLICIES = ("skip", "replace", "error")


# ----- reading ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Document:
    name: str  # relative POSIX path; "<name>[train]" / "<name>[val]" for the two halves of a lone document
    text: str


@dataclasses.dataclass
class CorpusStats:
    source: str  # what was searched, in words
    n_files: int = 0  # files matched
    n_documents: int = 0  # files kept
    n_bytes: int = 0  # UTF-8 bytes kept
    empty_files: list[str] = dataclasses.field(default_factory=list)
    non_utf8_files: list[str] = dataclasses.field(default_factory=list)

    def describe(self) -> str:
        return (
            f"{self.source}: {self.n_documents} documents ({self.n_bytes / 1e6:.2f} MB) kept of {self.n_files} files; "
            f"skipped {len(self.empty_files)} empty, {len(self.non_utf8_files)} not UTF-8"
        )


@dataclasses.dataclass
class TextCorpus:
    train: list[Document]
    val: list[Document]
    stats: CorpusStats

    def fingerprint(self) -> str:
        """SHA-256 over split membership, names and content hashes: any change gives a new key."""
        h = hashlib.sha256()
        for split, docs in (("train", self.train), ("val", self.val)):
            for d in docs:
                digest = hashlib.blake2b(d.text.encode("utf-8"), digest_size=16).hexdigest()
                h.update(f"{split}\0{d.name}\0{digest}\n".encode("utf-8"))
        return h.hexdigest()


def stdlib_root() -> Path:
    """Directory of the running Python's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def _normalise_extensions(extensions: Sequence[str]) -> tuple[str, ...]:
    if isinstance(extensions, str) or not extensions or not all(isinstance(e, str) and e for e in extensions):
        raise ConfigError(f"extensions = {extensions!r} is invalid: give a non-empty list such as ['.py', '.txt']")
    return tuple(sorted({e.lower() if e.startswith(".") else "." + e.lower() for e in extensions}))


def _walk(root: Path, extensions: tuple[str, ...], excluded: Sequence[str] = ()) -> list[tuple[str, Path]]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in excluded]
        for f in filenames:
            if Path(f).suffix.lower() in extensions:
                p = Path(dirpath) / f
                found.append((p.relative_to(root).as_posix(), p))
    return found


def find_files(path=None, extensions: Sequence[str] = DEFAULT_EXTENSIONS) -> tuple[list[tuple[str, Path]], str]:
    """(relative name, path) pairs sorted by name, and a description of what was searched.

    ``path``: ``None`` (the stdlib ``.py`` files), a file, a directory (recursive, by extension) or a glob
    (matched files are taken whatever their extension; matched directories are walked by extension).
    """
    if path is None:
        root = stdlib_root()
        found, where = _walk(root, (".py",), STDLIB_EXCLUDED_DIRS), f"*.py under the standard library {root}"
    else:
        exts = _normalise_extensions(extensions)
        p = Path(os.path.expanduser(str(path)))
        if p.is_file():
            found, where = [(p.name, p)], f"the file {p}"
        elif p.is_dir():
            found, where = _walk(p, exts), f"files ending in {', '.join(exts)} under {p}"
        elif any(c in str(path) for c in "*?["):
            found, where = _glob(str(p), exts), f"the glob {str(path)!r}"
        else:
            raise DataError(f"data path not found: {p} (give a text file, a directory or a glob)")
    return sorted(found, key=lambda item: item[0]), where


def _glob(pattern: str, exts: tuple[str, ...]) -> list[tuple[str, Path]]:
    found = []
    for m in sorted(globlib.glob(pattern, recursive=True)):
        p = Path(m)
        if p.is_file():
            found.append((p.as_posix(), p))
        elif p.is_dir():
            found.extend((f"{p.as_posix()}/{name}", q) for name, q in _walk(p, exts))
    return found


def _decode(raw: bytes, name: str, policy: str) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        if policy == "error":
            raise DataError(
                f"{name} is not valid UTF-8 (byte {raw[err.start]:#04x} at offset {err.start}); "
                "re-encode it, or pass on_decode_error='skip' or 'replace'"
            ) from None
        return raw.decode("utf-8", errors="replace") if policy == "replace" else None


def read_documents(files: list[tuple[str, Path]], source: str, on_decode_error: str = "skip"):
    """Read files as UTF-8 text; returns (documents, stats). Raises ``DataError`` when nothing usable is left."""
    if on_decode_error not in _DECODE_POLICIES:
        raise ConfigError(f"on_decode_error = {on_decode_error!r} is invalid: use one of {_DECODE_POLICIES}")
    stats, docs = CorpusStats(source=source, n_files=len(files)), []
    for name, p in files:
        text = _decode(p.read_bytes(), name, on_decode_error)
        if text is None:
            stats.non_utf8_files.append(name)
        elif not text.strip():
            stats.empty_files.append(name)
        else:
            docs.append(Document(name, text))
            stats.n_bytes += len(text.encode("utf-8"))
    stats.n_documents = len(docs)
    if stats.non_utf8_files:
        log.warning("skipped %d non-UTF-8 files (first: %s)", len(stats.non_utf8_files), stats.non_utf8_files[0])
    if not docs:
        raise DataError(
            f"empty corpus: searched {source}; found {len(files)} files"
            + (f", {len(stats.empty_files)} empty" if stats.empty_files else "")
            + (f", {len(stats.non_utf8_files)} not UTF-8 (skipped)" if stats.non_utf8_files else "")
        )
    return docs, stats


def val_score(name: str) -> float:
    """A stable pseudo-random number in [0, 100) from a document name; val when below ``val_percent``."""
    return int(hashlib.sha256(name.encode("utf-8")).hexdigest()[:8], 16) % 10000 / 100.0


def epoch_order(step: int, batch_size: int, n: int, seed: int) -> np.ndarray:
    """The ``batch_size`` item indices of batch ``step`` over ``n`` items: epoch e visits the items in the order
    of a permutation drawn from (seed, e), so a batch is a function of (seed, step) alone."""
    epoch_B, j_B = np.divmod(np.arange(step * batch_size, (step + 1) * batch_size), n)
    orders = {e: np.random.default_rng([seed, int(e)]).permutation(n) for e in np.unique(epoch_B)}
    return np.array([orders[e][j] for e, j in zip(epoch_B, j_B)])


def split_documents(docs: list[Document], val_percent: float) -> tuple[list[Document], list[Document]]:
    """Deterministic train/val split by document name (see the module docstring)."""
    if isinstance(val_percent, bool) or not isinstance(val_percent, (int, float)) or not 0 < val_percent < 100:
        raise ConfigError(f"val_percent = {val_percent!r} is invalid: it must be a number in (0, 100)")
    if len(docs) == 1:
        return _split_one(docs[0], val_percent)
    by_score = sorted(docs, key=lambda d: (val_score(d.name), d.name))
    val_names = {d.name for d in by_score if val_score(d.name) < val_percent}
    if not val_names:
        val_names = {by_score[0].name}
    if len(val_names) == len(docs):
        val_names.discard(by_score[-1].name)
    return [d for d in docs if d.name not in val_names], [d for d in docs if d.name in val_names]


def _split_one(doc: Document, val_percent: float) -> tuple[list[Document], list[Document]]:
    text = doc.text
    cut = int(len(text) * (1 - val_percent / 100))
    newline = text.find("\n", max(cut - 1, 0))
    cut = newline + 1 if 0 <= newline < len(text) - 1 else cut
    head, tail = text[:cut], text[cut:]
    if not head.strip() or not tail.strip():
        raise DataError(
            f"the corpus is one document ({doc.name}, {len(text)} characters) too short to split into train and "
            f"val at {val_percent}%: give a longer text or more files"
        )
    return [Document(doc.name + "[train]", head)], [Document(doc.name + "[val]", tail)]


def read_corpus(
    path=None,
    *,
    extensions: Sequence[str] = DEFAULT_EXTENSIONS,
    val_percent: float = DEFAULT_VAL_PERCENT,
    on_decode_error: str = "skip",
) -> TextCorpus:
    """Find, read and split a corpus (``path=None``: the standard library). Train BPE on ``.train``."""
    files, where = find_files(path, extensions)
    docs, stats = read_documents(files, where, on_decode_error)
    train, val = split_documents(docs, val_percent)
    return TextCorpus(train, val, stats)


# ----- encoding and the memmap cache --------------------------------------------------------------
@dataclasses.dataclass
class TokenSplit:
    tokens: np.ndarray  # (N,) uint16/uint32 memmap: BOS doc EOS BOS doc EOS …
    doc_starts: np.ndarray  # (n_docs,) int64 offsets of each BOS

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/mlx_llm`` or ``~/.cache/mlx_llm``."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mlx_llm"


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (V ≤ 65536), else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def encode_stream(docs: list[Document], tok: Tokenizer, chunk: int = 256) -> TokenSplit:
    """``BOS doc EOS`` for each document, concatenated; documents encoded ``chunk`` at a time (batch encode)."""
    pieces = []
    for k in range(0, len(docs), chunk):
        pieces.extend(tok.encode_batch([d.text for d in docs[k : k + chunk]]))
    lengths = np.array([len(p) + 2 for p in pieces], np.int64)
    doc_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    out = np.empty(int(lengths.sum()), token_dtype(tok.vocab_size))
    for start, ids in zip(doc_starts.tolist(), pieces):
        out[start] = tok.bos_id
        out[start + 1 : start + 1 + len(ids)] = ids
        out[start + 1 + len(ids)] = tok.eos_id
    return TokenSplit(out, doc_starts)


def cache_key(corpus: TextCorpus, tok: Tokenizer) -> str:
    """Corpus content × tokenizer × cache format."""
    raw = f"{CACHE_FORMAT}\0{corpus.fingerprint()}\0{tok.fingerprint()}"
    return hashlib.sha256(raw.encode("utf-8")).hexdigest()[:32]


def _write_cache(final: Path, splits: dict[str, TokenSplit]) -> None:
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".tmp-", dir=final.parent))
    try:
        meta = {"format": CACHE_FORMAT, "splits": {}}
        for name, s in splits.items():
            s.tokens.tofile(tmp / f"{name}.bin")
            np.save(tmp / f"{name}_doc_starts.npy", s.doc_starts)
            meta["splits"][name] = {"n_tokens": s.n_tokens, "dtype": s.tokens.dtype.name}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        os.rename(tmp, final)  # atomic; fails if another process finished first, and then its copy is used
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


# ----- batches ------------------------------------------------------------------------------------
def pack_windows(windows_BT1: np.ndarray, bos_id: int, pad_id: int) -> dict[str, np.ndarray]:
    """Windows of T+1 tokens → inputs, next-token targets and the packing arrays (M20 §2, §10).

    A segment starts at column 0, at each BOS and at the first PAD of a padding run; ``segment_ids`` count
    segments from 0 within a row (attention stays inside a segment) and ``positions`` restart at 0 at each
    segment start. ``mask`` (float32 b_t) drops targets that are BOS (the next document's start cannot be
    predicted from the previous one) or PAD; the EOS ending a document is a target.
    """
    w_BT1 = np.asarray(windows_BT1).astype(np.int32)
    tokens_BT, targets_BT = w_BT1[:, :-1], w_BT1[:, 1:]
    b, t = tokens_BT.shape
    is_pad_BT = tokens_BT == pad_id
    prev_pad_BT = np.concatenate([np.zeros((b, 1), bool), is_pad_BT[:, :-1]], axis=1)
    starts_BT = (tokens_BT == bos_id) | (is_pad_BT & ~prev_pad_BT)
    starts_BT[:, 0] = True
    col_BT = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    last_start_BT = np.maximum.accumulate(np.where(starts_BT, col_BT, 0), axis=1)
    return {
        "tokens": np.ascontiguousarray(tokens_BT),
        "targets": np.ascontiguousarray(targets_BT),
        "mask": ((targets_BT != bos_id) & (targets_BT != pad_id)).astype(np.float32),
        "segment_ids": (np.cumsum(starts_BT, axis=1) - 1).astype(np.int32),
        "positions": (col_BT - last_start_BT).astype(np.int32),
    }


def _check_positive(**values) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ConfigError(f"{name} = {v!r} is invalid: it must be a positive integer")


def window_starts(n_tokens: int, step: int, *, batch_size: int, seq_len: int, seed: int) -> np.ndarray:
    """(B,) window offsets drawn from ``default_rng([seed, step])``: batch ``step`` is the same on every run."""
    _check_positive(batch_size=batch_size, seq_len=seq_len)
    for name, v in (("seed", seed), ("step", step)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ConfigError(f"{name} = {v!r} is invalid: it must be an integer ≥ 0")
    if n_tokens < seq_len + 1:
        raise ConfigError(
            f"seq_len = {seq_len} is too long for a train split of {n_tokens} tokens: it must be ≤ {n_tokens - 1}"
        )
    return np.random.default_rng([int(seed), int(step)]).integers(0, n_tokens - seq_len, size=batch_size)


@dataclasses.dataclass
class ValSet:
    """Fixed validation batches covering the val stream in order.

    ``n_bytes`` is the UTF-8 byte count of the text whose tokens are scored: Σ over batches of
    ``byte_len[targets] · mask``, where ``byte_len`` gives each token's bytes and 0 for special tokens (so EOS
    and document separators add none). Covering the whole split it equals the UTF-8 size of the val documents.
    Bits per byte = (Σ mask · NLL in nats) / (ln 2 · n_bytes). ``n_token_bytes`` counts the same way over the
    windows' input tokens (``byte_len[tokens] · mask``): the text a masked-diffusion evaluation scores.
    """

    batches: list[dict[str, np.ndarray]]
    n_targets: int  # Σ mask
    n_bytes: int
    bytes_per_batch: list[int]
    n_token_bytes: int = 0


def val_windows(tokens: np.ndarray, seq_len: int, pad_id: int, max_tokens: int | None = None) -> np.ndarray:
    """(W, T+1) consecutive windows sharing one token at each seam (every token after the first is a target
    once), the last padded with PAD; ``max_tokens`` caps the number of target positions covered."""
    n = int(tokens.shape[0])
    n_cover = n - 1 if max_tokens is None else min(n - 1, max_tokens)
    n_windows = math.ceil(n_cover / seq_len)
    idx_WT1 = np.arange(n_windows)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return np.where(idx_WT1 <= n_cover, np.asarray(tokens)[np.minimum(idx_WT1, n - 1)], pad_id)


@dataclasses.dataclass
class Corpus:
    """An encoded corpus: train/val token streams (memmaps) plus what is needed to batch and score them."""

    train: TokenSplit
    val: TokenSplit
    tokenizer: Tokenizer
    stats: CorpusStats
    cache_path: Path
    cache_hit: bool
    encode_seconds: float  # 0 when read from the cache

    def train_batch(self, step: int, *, batch_size: int, seq_len: int, seed: int,
                    rows: slice = slice(None)) -> dict[str, np.ndarray]:
        """Batch ``step`` of B random windows of the train stream: a function of (seed, step) only; ``rows``
        reads only those rows of it (a process's part of the global batch)."""
        starts_B = window_starts(self.train.n_tokens, step, batch_size=batch_size, seq_len=seq_len, seed=seed)[rows]
        w_BT1 = self.train.tokens[starts_B[:, None] + np.arange(seq_len + 1)[None, :]]
        return pack_windows(w_BT1, self.tokenizer.bos_id, self.tokenizer.pad_id)

    def val_batches(self, seq_len: int, batch_size: int, max_tokens: int | None = None) -> ValSet:
        """The val split in order, in batches of ``batch_size`` windows (the last batch padded with PAD rows)."""
        _check_positive(seq_len=seq_len, batch_size=batch_size)
        if max_tokens is not None:
            _check_positive(max_tokens=max_tokens)
        w_WT1 = val_windows(self.val.tokens, seq_len, self.tokenizer.pad_id, max_tokens)
        n_rows = math.ceil(len(w_WT1) / batch_size) * batch_size
        w_WT1 = np.concatenate([w_WT1, np.full((n_rows - len(w_WT1), seq_len + 1), self.tokenizer.pad_id)])
        byte_len = self.tokenizer.token_byte_lengths()
        batches, per_batch = [], []
        for k in range(0, n_rows, batch_size):
            batch = pack_windows(w_WT1[k : k + batch_size], self.tokenizer.bos_id, self.tokenizer.pad_id)
            batches.append(batch)
            per_batch.append(int((byte_len[batch["targets"]] * batch["mask"]).sum()))
        token_bytes = sum(int((byte_len[b["tokens"]] * b["mask"]).sum()) for b in batches)
        return ValSet(batches, int(sum(b["mask"].sum() for b in batches)), sum(per_batch), per_batch, token_bytes)

    def unigram_bits_per_byte(self) -> float:
        """The add-one unigram baseline on the whole val split (BOS never counted: it is never a target)."""
        bos, byte_len = self.tokenizer.bos_id, self.tokenizer.token_byte_lengths()
        train_ids = np.asarray(self.train.tokens)
        val_ids = np.asarray(self.val.tokens)
        val_ids = val_ids[val_ids != bos]
        return unigram_bits_per_byte(
            train_ids[train_ids != bos], val_ids, self.tokenizer.vocab_size, int(byte_len[val_ids].sum())
        )


def encode_corpus(corpus: TextCorpus, tok: Tokenizer, cache_dir=None) -> Corpus:
    """Encode both splits, or memory-map them from ``cache_dir / cache_key`` when already encoded."""
    final = Path(cache_dir if cache_dir is not None else default_cache_dir()) / cache_key(corpus, tok)
    splits, seconds = _read_cache(final), 0.0
    hit = splits is not None
    if not hit:
        shutil.rmtree(final, ignore_errors=True)  # an unreadable cache entry is rebuilt
        t0 = time.perf_counter()
        built = {"train": encode_stream(corpus.train, tok), "val": encode_stream(corpus.val, tok)}
        seconds = time.perf_counter() - t0
        _write_cache(final, built)
        splits = _read_cache(final)
        if splits is None:
            raise DataError(f"could not read back the token cache just written at {final}")
    return Corpus(splits["train"], splits["val"], tok, corpus.stats, final, hit, seconds)


def load_corpus(tok: Tokenizer, path=None, *, cache_dir=None, **read_kwargs) -> Corpus:
    """``read_corpus`` then ``encode_corpus``."""
    return encode_corpus(read_corpus(path, **read_kwargs), tok, cache_dir)


def unigram_bits_per_byte(train_ids, val_ids, vocab_size: int, val_bytes: int) -> float:
    """Add-one (Laplace) unigram: p(v) = (c_v + 1) / (N + V) from train counts; returns
    −Σ_{val ids} log₂ p(v) / ``val_bytes``."""
    _check_positive(vocab_size=vocab_size, val_bytes=val_bytes)
    train_n, val_n = np.asarray(train_ids, np.int64).ravel(), np.asarray(val_ids, np.int64).ravel()
    for name, ids in (("train_ids", train_n), ("val_ids", val_n)):
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise InputError(f"{name} holds ids outside 0..{vocab_size - 1} (min {ids.min()}, max {ids.max()})")
    if val_n.size == 0:
        raise DataError("val_ids is empty: there is nothing to score")
    counts_V = np.bincount(train_n, minlength=vocab_size)
    log2p_V = np.log2(counts_V + 1.0) - np.log2(train_n.size + vocab_size)
    return float(-log2p_V[val_n].sum() / val_bytes)
