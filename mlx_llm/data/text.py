"""Reading a text corpus: files → documents, split train/val by document name (M20 §2); data/encoding.py encodes them.

Decisions (each one tested in tests/test_data.py and tests/test_sources.py):

- Default corpus: the ``.py`` sources of the running Python's standard library
  (``sysconfig.get_paths()["stdlib"]``), without ``site-packages``, ``__pycache__`` and test directories
  (``test``, ``tests``, ``idle_test``: they hold deliberately malformed files, non-UTF-8 encodings and generated
  data). Directory walks skip dot-directories (``.git``, ``.venv``) and follow no symlinked directories.
- Sources: a text file is one document (its relative POSIX path is its name); a record file (``*.jsonl``,
  ``*.jsonl.gz``, ``*.parquet``) or a directory saved by ``datasets.save_to_disk`` holds one document per record,
  the string in its ``text_field`` (data/sources.py reads them). A directory walk takes text files by extension
  and record files and saved datasets whatever the extensions.
- Sources are sorted by their relative POSIX path. A document goes to val when
  ``int(sha256(name)[:8], 16) % 10000 < 100 * val_percent`` (stable across machines and Python runs). If that
  leaves val (or train) empty, the document with the lowest (highest) score moves over. A saved DatasetDict with a
  held-out split decides the split of its records itself. A corpus of a single document is cut at the first line
  start at or after ``(1 − val_percent/100)`` of its characters (at that character when no newline follows): the
  tail is val.
- Non-UTF-8 files are skipped and counted (``on_decode_error="skip"``; ``"replace"`` keeps them with U+FFFD,
  ``"error"`` raises). Files, and records, that are empty or whitespace-only are skipped and counted.
- Bounded memory: ``read_corpus`` reads every source once, one document at a time, to find what is kept, to split
  it and to fingerprint it; it keeps only names and digests of text files (one line per file) and nothing per
  record. ``.train`` / ``.val`` are then ``Documents``: iterating one reads its sources again, one document at a
  time. The fingerprint of a text-file corpus is what it was when documents were held in memory (cache keys stay).
"""

from __future__ import annotations

import dataclasses
import glob as globlib
import hashlib
import itertools
import logging
import os
import stat
import sysconfig
from pathlib import Path
from collections.abc import Sequence as SequenceABC
from typing import Iterator, Sequence

import numpy as np

from mlx_llm.errors import ConfigError, DataError
from mlx_llm.data import sources as sources_lib

log = logging.getLogger(__name__)

DEFAULT_EXTENSIONS = (".py", ".txt", ".md")
STDLIB_EXCLUDED_DIRS = ("site-packages", "__pycache__", "test", "tests", "idle_test")
DEFAULT_VAL_PERCENT = 5.0
DEFAULT_TEXT_FIELD = "text"  # the field a record's text is read from (``--text-field``)
_DECODE_POLICIES = ("skip", "replace", "error")
SPLITS = ("train", "val")


# ----- documents, sources, statistics ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Document:
    name: str  # relative POSIX path (``path:LINE`` / ``path:ROW`` for a record); "<name>[train]" / "<name>[val]"
    text: str  # for the two halves of a lone document


@dataclasses.dataclass(frozen=True)
class Source:
    """One file of a corpus (or one split of a saved DatasetDict), read on demand."""

    name: str  # relative POSIX path; a DatasetDict split: "<path>/<split>"
    path: Path
    kind: str = "text"  # "text" (one document) | "jsonl" | "parquet" | "dataset" (one document per record)
    split: str | None = None  # "train" / "val" when the source decides its records' split (a DatasetDict split)
    part: str | None = None  # the DatasetDict split to read


@dataclasses.dataclass
class CorpusStats:
    source: str  # what was searched, in words
    n_files: int = 0  # files matched
    n_documents: int = 0  # documents kept
    n_bytes: int = 0  # UTF-8 bytes kept
    empty_files: list[str] = dataclasses.field(default_factory=list)
    non_utf8_files: list[str] = dataclasses.field(default_factory=list)
    not_regular_files: list[str] = dataclasses.field(default_factory=list)  # named pipes, sockets, devices
    n_records: int = 0  # records read from record sources
    empty_records: int = 0  # of which empty or whitespace-only (skipped)

    def describe(self) -> str:
        odd = f", {len(self.not_regular_files)} not regular files" if self.not_regular_files else ""
        records = f"; {self.n_records} records, {self.empty_records} empty skipped" if self.n_records else ""
        return (
            f"{self.source}: {self.n_documents} documents ({self.n_bytes / 1e6:.2f} MB) kept of {self.n_files} files; "
            f"skipped {len(self.empty_files)} empty, {len(self.non_utf8_files)} not UTF-8{odd}{records}"
        )


class Fingerprint:
    """SHA-256 over split membership, names and content hashes, fed one document at a time.

    A text document adds the line ``split NUL name NUL blake2b₁₆(text)``; a record source adds one such line per
    split it feeds, whose hash runs over ``name NUL len NUL text`` of its records in that split. Train lines come
    first, then val lines, each in corpus order: for documents held in memory this is the formula of
    ``TextCorpus.fingerprint`` before sources were streamed, so existing cache keys stay valid.
    """

    def __init__(self):
        self._hash, self._val_lines = hashlib.sha256(), []
        self._source, self._parts = None, {}

    def _line(self, split: str, name: str, digest: str) -> None:
        line = f"{split}\0{name}\0{digest}\n".encode("utf-8")
        self._hash.update(line) if split == "train" else self._val_lines.append(line)

    def add(self, source: Source | None, split: str, name: str, raw: bytes) -> None:
        """One kept document (``raw``: its UTF-8 text) of ``source`` (None: a document held in memory)."""
        if source is not self._source:
            self._flush()
            self._source = source
        if source is None or source.kind == "text":
            self._line(split, name, hashlib.blake2b(raw, digest_size=16).hexdigest())
            return
        h = self._parts.setdefault(split, hashlib.blake2b(digest_size=16))
        h.update(f"{name}\0{len(raw)}\0".encode("utf-8"))
        h.update(raw)

    def _flush(self) -> None:
        for split in SPLITS:
            if split in self._parts:
                self._line(split, self._source.name, self._parts[split].hexdigest())
        self._parts = {}

    def hexdigest(self) -> str:
        self._flush()
        h = self._hash.copy()
        for line in self._val_lines:
            h.update(line)
        return h.hexdigest()


# ----- the corpus ------------------------------------------------------------------------------------------
@dataclasses.dataclass
class TextCorpus:
    """Train and val documents: lists held in memory, or ``Documents`` read from their sources on demand."""

    train: Sequence[Document]
    val: Sequence[Document]
    stats: CorpusStats

    def _lazy(self) -> "_LazyCorpus | None":
        t, v = self.train, self.val
        same = isinstance(t, Documents) and isinstance(v, Documents) and t.corpus is v.corpus
        return t.corpus if same else None

    def stream(self) -> Iterator[tuple[str, Document, Source | None]]:
        """(split, document, its source or None) for every document, train and val interleaved in corpus order
        when read from sources (one pass over them), else train then val."""
        lazy = self._lazy()
        if lazy is not None:
            return lazy.documents()
        return itertools.chain((("train", d, None) for d in self.train), (("val", d, None) for d in self.val))

    def fingerprint(self) -> str:
        """SHA-256 over split membership, names and content hashes (``Fingerprint``): any change gives a new key."""
        lazy = self._lazy()
        if lazy is not None:
            return lazy.fingerprint
        fp = Fingerprint()
        for split, d, source in self.stream():
            fp.add(source, split, d.name, d.text.encode("utf-8"))
        return fp.hexdigest()

    def n_bytes(self) -> int:
        """UTF-8 bytes of all documents, both splits."""
        lazy = self._lazy()
        if lazy is not None:
            return sum(lazy.n_bytes.values())
        return sum(len(d.text.encode("utf-8")) for d in itertools.chain(self.train, self.val))


class Documents(SequenceABC):
    """The documents of one split, read from the corpus's sources each time they are iterated (one at a time).
    ``len`` is known; indexing and ``+`` read the split through (meant for small corpora and tests)."""

    def __init__(self, corpus: "_LazyCorpus", split: str):
        self.corpus, self.split = corpus, split

    def __iter__(self) -> Iterator[Document]:
        return (d for _, d, _ in self.corpus.documents(only=self.split))

    def __len__(self) -> int:
        return self.corpus.counts[self.split]

    def __getitem__(self, index):
        if isinstance(index, int) and index >= 0:
            found = next(itertools.islice(iter(self), index, None), None)
            if found is None:
                raise IndexError(f"document index {index} is out of range: the split has {len(self)}")
            return found
        return list(self)[index]

    def __add__(self, other) -> list[Document]:
        return list(self) + list(other)

    def __radd__(self, other) -> list[Document]:
        return list(other) + list(self)

    def __repr__(self) -> str:
        return f"Documents({self.split}: {len(self)} documents from {len(self.corpus.sources)} sources)"


@dataclasses.dataclass(frozen=True)
class SplitRule:
    """Which split a document goes to: its source's when the source decides, else by ``val_score`` of its name,
    with the one document a fallback moved (``forced_val`` / ``forced_train``)."""

    val_percent: float
    forced_val: str | None = None
    forced_train: str | None = None

    def split_of(self, name: str, fixed: str | None = None) -> str:
        if fixed is not None:
            return fixed
        if name == self.forced_train:
            return "train"
        return "val" if name == self.forced_val or val_score(name) < self.val_percent else "train"


@dataclasses.dataclass
class _LazyCorpus:
    sources: list[Source]
    rule: SplitRule
    text_field: str
    on_decode_error: str
    counts: dict[str, int]
    n_bytes: dict[str, int]
    fingerprint: str

    def documents(self, only: str | None = None) -> Iterator[tuple[str, Document, Source]]:
        """(split, document, source) in corpus order; ``only``: one split (text files of the other not read)."""
        for source in self.sources:
            if only is not None and source.kind == "text" and self.rule.split_of(source.name) != only:
                continue
            if only is not None and source.split not in (None, only):
                continue
            for doc in source_documents(source, self.text_field, self.on_decode_error):
                split = self.rule.split_of(doc.name, source.split)
                if only in (None, split):
                    yield split, doc, source


# ----- finding sources -------------------------------------------------------------------------------------
def stdlib_root() -> Path:
    """Directory of the running Python's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def _normalise_extensions(extensions: Sequence[str]) -> tuple[str, ...]:
    if isinstance(extensions, str) or not extensions or not all(isinstance(e, str) and e for e in extensions):
        raise ConfigError(f"extensions = {extensions!r} is invalid: give a non-empty list such as ['.py', '.txt']")
    return tuple(sorted({e.lower() if e.startswith(".") else "." + e.lower() for e in extensions}))


def _file_source(name: str, p: Path) -> Source:
    return Source(name, p, sources_lib.record_kind(p.name) or "text")


def _dataset_sources(name: str, p: Path) -> list[Source]:
    return [Source(name if part is None else f"{name}/{part}", p, "dataset", split, part)
            for part, split in sources_lib.dataset_parts(p)]


def _walk(root: Path, extensions: tuple[str, ...], excluded: Sequence[str] = (), records: bool = True,
          prefix: str = "") -> list[Source]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in excluded]
        for d in [d for d in dirnames if records and sources_lib.is_saved_dataset(here / d)]:
            dirnames.remove(d)
            found.extend(_dataset_sources(prefix + (here / d).relative_to(root).as_posix(), here / d))
        for f in filenames:
            if (records and sources_lib.record_kind(f)) or Path(f).suffix.lower() in extensions:
                p = here / f
                found.append(_file_source(prefix + p.relative_to(root).as_posix(), p))
    return found


def find_sources(path=None, extensions: Sequence[str] = DEFAULT_EXTENSIONS) -> tuple[list[Source], str]:
    """Sources sorted by name, and a description of what was searched.

    ``path``: ``None`` (the stdlib ``.py`` files), a file, a saved dataset, a directory (recursive: text files by
    extension, record files and saved datasets) or a glob (matched files are taken whatever their extension;
    matched directories are walked as above).
    """
    if path is None:
        root = stdlib_root()
        found = _walk(root, (".py",), STDLIB_EXCLUDED_DIRS, records=False)
        where = f"*.py under the standard library {root}"
    else:
        exts = _normalise_extensions(extensions)
        p = Path(os.path.expanduser(str(path)))
        if p.is_file():
            found, where = [_file_source(p.name, p)], f"the file {p}"
        elif sources_lib.is_saved_dataset(p):
            found, where = _dataset_sources(p.name, p), f"the saved dataset {p}"
        elif p.is_dir():
            found, where = _walk(p, exts), f"files ending in {', '.join(exts)} under {p}"
        elif p.exists():
            raise DataError(f"data path {p} is not a regular file or a directory (a named pipe, socket or device?): "
                            f"only regular files are read")
        elif any(c in str(path) for c in "*?["):
            found, where = _glob(str(p), exts), f"the glob {str(path)!r}"
        else:
            raise DataError(f"data path not found: {p} (give a text or record file, a directory or a glob)")
    return sorted(found, key=lambda s: s.name), where


def find_files(path=None, extensions: Sequence[str] = DEFAULT_EXTENSIONS) -> tuple[list[tuple[str, Path]], str]:
    """(relative name, path) pairs of ``find_sources``, sorted by name, and a description of what was searched."""
    found, where = find_sources(path, extensions)
    return [(s.name, s.path) for s in found], where


def _glob(pattern: str, exts: tuple[str, ...]) -> list[Source]:
    found = []
    for m in sorted(globlib.glob(pattern, recursive=True)):
        p = Path(m)
        if sources_lib.is_saved_dataset(p):
            found.extend(_dataset_sources(p.as_posix(), p))
        elif p.is_dir():
            found.extend(_walk(p, exts, prefix=p.as_posix() + "/"))
        elif p.exists():  # a named pipe or device too: reading skips it and counts it (``_read_text``)
            found.append(_file_source(p.as_posix(), p))
    return found


# ----- reading documents -----------------------------------------------------------------------------------
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


def _read_text(name: str, p: Path, policy: str, stats: CorpusStats | None) -> Document | None:
    """A text file as a document, or None (skipped and counted in ``stats``: not regular, not UTF-8, empty)."""
    stats = stats if stats is not None else CorpusStats("")
    if not _regular(p):  # a named pipe would block the read forever; a device need not end
        stats.not_regular_files.append(name)
        return None
    try:
        raw = p.read_bytes()
    except OSError as err:
        raise DataError(f"cannot read {name}: {err.strerror or err}") from None
    text = _decode(raw, name, policy)
    if text is None:
        stats.non_utf8_files.append(name)
    elif not text.strip():
        stats.empty_files.append(name)
    else:
        return Document(name, text)
    return None


def source_documents(source: Source, text_field: str = "text", on_decode_error: str = "skip",
                     stats: CorpusStats | None = None) -> Iterator[Document]:
    """The kept documents of one source, read one at a time; what is skipped is counted in ``stats``."""
    if source.kind == "text":
        doc = _read_text(source.name, source.path, on_decode_error, stats)
        if doc is not None:
            yield doc
        return
    if source.kind != "dataset" and not _regular(source.path):
        raise DataError(f"{source.name} is not a regular file (a named pipe, socket or device?): only regular files "
                        f"are read")
    readers = {"jsonl": sources_lib.iter_jsonl, "parquet": sources_lib.iter_parquet}
    if source.kind == "dataset":
        records = sources_lib.iter_dataset(source.path, source.name, text_field, source.part)
    else:
        records = readers[source.kind](source.path, source.name, text_field)
    for name, text in records:
        if stats is not None:
            stats.n_records += 1
        if text.strip():
            yield Document(name, text)
        elif stats is not None:
            stats.empty_records += 1


def read_documents(files: list[tuple[str, Path]], source: str, on_decode_error: str = "skip"):
    """Read text files into memory as UTF-8 documents; returns (documents, stats). Raises ``DataError`` when
    nothing usable is left. (``read_corpus`` streams instead; this is the all-in-memory path.)"""
    _check_decode_policy(on_decode_error)
    stats, docs = CorpusStats(source=source, n_files=len(files)), []
    for name, p in files:
        doc = _read_text(name, p, on_decode_error, stats)
        if doc is not None:
            docs.append(doc)
            stats.n_bytes += len(doc.text.encode("utf-8"))
    stats.n_documents = len(docs)
    _report(stats)
    return docs, stats


def _check_decode_policy(policy) -> None:
    if policy not in _DECODE_POLICIES:
        raise ConfigError(f"on_decode_error = {policy!r} is invalid: use one of {_DECODE_POLICIES}")


def _report(stats: CorpusStats) -> None:
    """Log what was skipped; raise ``DataError`` when no document is left."""
    if stats.non_utf8_files:
        log.warning("skipped %d non-UTF-8 files (first: %s)", len(stats.non_utf8_files), stats.non_utf8_files[0])
    if stats.not_regular_files:
        log.warning("skipped %d entries that are not regular files (named pipes, sockets, devices): %s",
                    len(stats.not_regular_files), ", ".join(stats.not_regular_files[:5]))
    if not stats.n_documents:
        raise DataError(
            f"empty corpus: searched {stats.source}; found {stats.n_files} files"
            + (f", {len(stats.empty_files)} empty" if stats.empty_files else "")
            + (f", {len(stats.non_utf8_files)} not UTF-8 (skipped)" if stats.non_utf8_files else "")
            + (f", {len(stats.not_regular_files)} not regular files (skipped)" if stats.not_regular_files else "")
            + (f", {stats.n_records} records, all empty" if stats.n_records else "")
        )


def _regular(path: Path) -> bool:
    """Whether ``path`` (links followed) is a regular file: only those are read."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


# ----- the split -------------------------------------------------------------------------------------------
def val_score(name: str) -> float:
    """A stable pseudo-random number in [0, 100) from a document name; val when below ``val_percent``."""
    return int(hashlib.sha256(name.encode("utf-8")).hexdigest()[:8], 16) % 10000 / 100.0


def epoch_order(step: int, batch_size: int, n: int, seed: int) -> np.ndarray:
    """The ``batch_size`` item indices of batch ``step`` over ``n`` items: epoch e visits the items in the order
    of a permutation drawn from (seed, e), so a batch is a function of (seed, step) alone."""
    epoch_B, j_B = np.divmod(np.arange(step * batch_size, (step + 1) * batch_size), n)
    orders = {e: np.random.default_rng([seed, int(e)]).permutation(n) for e in np.unique(epoch_B)}
    return np.array([orders[e][j] for e, j in zip(epoch_B, j_B)])


def _check_val_percent(val_percent) -> None:
    if isinstance(val_percent, bool) or not isinstance(val_percent, (int, float)) or not 0 < val_percent < 100:
        raise ConfigError(f"val_percent = {val_percent!r} is invalid: it must be a number in (0, 100)")


def split_documents(docs: list[Document], val_percent: float) -> tuple[list[Document], list[Document]]:
    """Deterministic train/val split by document name (see the module docstring) of documents in memory."""
    _check_val_percent(val_percent)
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


# ----- reading a corpus ------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Scan:
    """What one pass over the sources found."""

    stats: CorpusStats
    counts: dict[str, int]
    n_bytes: dict[str, int]
    fingerprint: str
    lowest: tuple | None  # (val_score, name) of the lowest / highest scoring document split by name
    highest: tuple | None
    only: Document | None  # the document, when there is exactly one
    fixed: bool  # some source decides its records' split


def _scan(sources: list[Source], rule: SplitRule, where: str, text_field: str, policy: str) -> _Scan:
    """Read every source once, one document at a time: counts, bytes, fingerprint and the split's extremes."""
    stats = CorpusStats(source=where, n_files=len(sources))
    counts, n_bytes, fp = dict.fromkeys(SPLITS, 0), dict.fromkeys(SPLITS, 0), Fingerprint()
    lowest = highest = only = None
    for source in sources:
        for doc in source_documents(source, text_field, policy, stats):
            split, raw = rule.split_of(doc.name, source.split), doc.text.encode("utf-8")
            fp.add(source, split, doc.name, raw)
            counts[split] += 1
            n_bytes[split] += len(raw)
            if source.split is None:
                key = (val_score(doc.name), doc.name)
                lowest, highest = min(lowest or key, key), max(highest or key, key)
            only = doc if sum(counts.values()) == 1 else None
    stats.n_documents, stats.n_bytes = sum(counts.values()), sum(n_bytes.values())
    return _Scan(stats, counts, n_bytes, fp.hexdigest(), lowest, highest, only,
                 any(s.split is not None for s in sources))


def _fallback(scan: _Scan, rule: SplitRule) -> SplitRule | None:
    """The rule with one document moved when a split came out empty (see ``split_documents``), or None."""
    if scan.counts["val"] == 0 and scan.lowest is not None:
        return dataclasses.replace(rule, forced_val=scan.lowest[1])
    if scan.counts["train"] == 0 and scan.highest is not None:
        return dataclasses.replace(rule, forced_train=scan.highest[1])
    return None


def read_corpus(
    path=None,
    *,
    extensions: Sequence[str] = DEFAULT_EXTENSIONS,
    val_percent: float = DEFAULT_VAL_PERCENT,
    on_decode_error: str = "skip",
    text_field: str = "text",
) -> TextCorpus:
    """Find, scan and split a corpus (``path=None``: the standard library); train BPE on ``.train``. Every source
    is read once here, so a bad one is refused before anything is written; the documents are read again, one at a
    time, whenever ``.train`` / ``.val`` are iterated (a corpus of one document is held in memory, cut in two)."""
    _check_decode_policy(on_decode_error)
    _check_val_percent(val_percent)
    if not isinstance(text_field, str) or not text_field:
        raise ConfigError(f"text_field = {text_field!r} is invalid: give a field name such as 'text'")
    found, where = find_sources(path, extensions)
    if text_field != DEFAULT_TEXT_FIELD and found and all(s.kind == "text" for s in found):
        raise DataError(f"--text-field {text_field!r} names the text field of JSONL, parquet or saved-dataset "
                        f"records, and {where} holds none (only plain text files): drop --text-field")
    rule = SplitRule(float(val_percent))
    scan = _scan(found, rule, where, text_field, on_decode_error)
    _report(scan.stats)
    if scan.only is not None and not scan.fixed:
        train, val = _split_one(scan.only, val_percent)
        return TextCorpus(train, val, scan.stats)
    moved = _fallback(scan, rule)
    if moved is not None:
        rule, scan = moved, _scan(found, moved, where, text_field, on_decode_error)
    for split in SPLITS:
        if not scan.counts[split]:
            raise DataError(f"the {split} split of {where} is empty ({scan.counts} documents): give records to both "
                            f"splits, or let the name hash split them")
    lazy = _LazyCorpus(found, rule, text_field, on_decode_error, scan.counts, scan.n_bytes, scan.fingerprint)
    return TextCorpus(Documents(lazy, "train"), Documents(lazy, "val"), scan.stats)
