"""Reading a text corpus: files → documents, split train/val by file (M20 §2); train/data.py encodes them.

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
"""

from __future__ import annotations

import dataclasses
import glob as globlib
import hashlib
import logging
import os
import stat
import sysconfig
from pathlib import Path
from typing import Sequence

import numpy as np

from mlx_llm.errors import ConfigError, DataError

log = logging.getLogger(__name__)

DEFAULT_EXTENSIONS = (".py", ".txt", ".md")
STDLIB_EXCLUDED_DIRS = ("site-packages", "__pycache__", "test", "tests", "idle_test")
DEFAULT_VAL_PERCENT = 5.0
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
    not_regular_files: list[str] = dataclasses.field(default_factory=list)  # named pipes, sockets, devices

    def describe(self) -> str:
        odd = f", {len(self.not_regular_files)} not regular files" if self.not_regular_files else ""
        return (
            f"{self.source}: {self.n_documents} documents ({self.n_bytes / 1e6:.2f} MB) kept of {self.n_files} files; "
            f"skipped {len(self.empty_files)} empty, {len(self.non_utf8_files)} not UTF-8{odd}"
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
        elif p.exists():
            raise DataError(f"data path {p} is not a regular file or a directory (a named pipe, socket or device?): "
                            f"only regular files are read")
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
        if not _regular(p):  # a named pipe would block the read forever; a device need not end
            stats.not_regular_files.append(name)
            continue
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
    if stats.not_regular_files:
        log.warning("skipped %d entries that are not regular files (named pipes, sockets, devices): %s",
                    len(stats.not_regular_files), ", ".join(stats.not_regular_files[:5]))
    if not docs:
        raise DataError(
            f"empty corpus: searched {source}; found {len(files)} files"
            + (f", {len(stats.empty_files)} empty" if stats.empty_files else "")
            + (f", {len(stats.non_utf8_files)} not UTF-8 (skipped)" if stats.non_utf8_files else "")
            + (f", {len(stats.not_regular_files)} not regular files (skipped)" if stats.not_regular_files else "")
        )
    return docs, stats


def _regular(path: Path) -> bool:
    """Whether ``path`` (links followed) is a regular file: only those are read."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


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
