"""Pre-tokenized token streams as a training corpus: ``.npy`` arrays and ``.bin`` shards, read as memmaps.

The ids are trained on as they are, never re-tokenised. Layouts (told apart by the file, never by a flag):

- ``.npy``: a 1-D integer array (``np.save``), opened with ``mmap_mode="r"``;
- ``.bin`` in the llm.c layout: a header of 256 little-endian int32 — ``[0]`` the magic 20240520, ``[1]`` the
  version (1: uint16 ids, GPT-2's; 2: uint32 ids, Llama 3's), ``[2]`` the number of ids — then the ids;
- any other ``.bin``: nanoGPT's raw little-endian uint16 ids with no header (``prepare.py``'s ``train.bin``).

``--data`` names one such file or a glob of them (``'data/fineweb10B/fineweb_*.bin'``). The train/val split is
by file name: files whose name has a ``val`` part (``val.bin``, ``fineweb_val_000000.bin``) are val, the others
train, each group in name order; with no val file, the last ``val_percent`` % of the ids are val. Every id is
checked below the model's vocabulary before anything is written (JAX would clamp a larger one silently); the
check reads the shards a chunk at a time, so memory stays bounded whatever their size.

Shards are concatenated in name order (``TokenStream``); the run's tokenizer is ``IdTokenizer`` unless one is
given, so there is no document boundary to mark, no bits per byte and no closing text sample.
"""

from __future__ import annotations

import dataclasses
import glob as globlib
import os
import re
from pathlib import Path

import numpy as np

from mlx_llm.errors import ConfigError, DataError

TOKEN_SUFFIXES = (".bin", ".npy")
LLMC_MAGIC = 20240520
LLMC_HEADER_INTS = 256
LLMC_DTYPES = {1: np.dtype("<u2"), 2: np.dtype("<u4")}
CHECK_CHUNK = 1 << 24  # ids per read when checking the vocabulary bound (32 MiB of uint16)


def is_token_source(path) -> bool:
    """Whether ``--data PATH`` names token ids: a ``.bin`` / ``.npy`` file, or a glob ending in one."""
    return path is not None and str(path).lower().endswith(TOKEN_SUFFIXES)


def _layout(path: Path) -> tuple[str, np.dtype, int, int]:
    """(layout name, dtype, byte offset of the first id, number of ids) of one token file."""
    try:
        size = os.stat(path).st_size
        with open(path, "rb") as f:
            head = f.read(LLMC_HEADER_INTS * 4)
    except OSError as err:
        raise DataError(f"cannot read the token file {path}: {err.strerror or err}") from None
    if path.suffix.lower() == ".npy":
        return _npy_layout(path)
    if len(head) >= 12 and int(np.frombuffer(head[:4], "<i4")[0]) == LLMC_MAGIC:
        header = np.frombuffer(head.ljust(LLMC_HEADER_INTS * 4, b"\0"), "<i4")
        version, n = int(header[1]), int(header[2])
        if version not in LLMC_DTYPES:
            raise DataError(f"{path}: llm.c token shard version {version} is not supported (valid: "
                            f"{sorted(LLMC_DTYPES)}: 1 = uint16 ids, 2 = uint32 ids)")
        dtype = LLMC_DTYPES[version]
        expected = LLMC_HEADER_INTS * 4 + n * dtype.itemsize
        if n < 0 or size != expected:
            raise DataError(f"{path}: its llm.c header gives {n:,} ids ({expected:,} bytes with the header), but the "
                            f"file has {size:,} bytes: the shard is truncated or damaged")
        return f"llm.c v{version}", dtype, LLMC_HEADER_INTS * 4, n
    if size % 2:
        raise DataError(f"{path} has {size:,} bytes, an odd number: not raw uint16 token ids (nanoGPT's .bin) and "
                        f"no llm.c header (magic {LLMC_MAGIC})")
    return "raw uint16", np.dtype("<u2"), 0, size // 2


def _npy_layout(path: Path) -> tuple[str, np.dtype, int, int]:
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as err:
        raise DataError(f"{path} is not a readable .npy array: {err}") from None
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise DataError(f"{path} holds a {arr.ndim}-D {arr.dtype} array: token ids must be a 1-D integer array")
    return f"npy {arr.dtype}", arr.dtype, int(arr.offset), int(arr.shape[0])


@dataclasses.dataclass(frozen=True)
class TokenFile:
    name: str  # the path as given or matched
    path: Path
    layout: str
    dtype: np.dtype
    offset: int
    n_ids: int

    def open(self) -> np.ndarray:
        """The ids as a read-only memmap (no copy)."""
        if self.n_ids == 0:
            return np.zeros((0,), self.dtype)
        return np.memmap(self.path, dtype=self.dtype, mode="r", offset=self.offset, shape=(self.n_ids,))


def find_token_files(path) -> list[TokenFile]:
    """The token files ``path`` names (a file or a glob), sorted by name; one line on any that cannot be used."""
    text = os.path.expanduser(str(path))
    if any(c in text for c in "*?["):
        names = sorted(m for m in globlib.glob(text, recursive=True) if not os.path.isdir(m))
        if not names:
            raise DataError(f"the glob {str(path)!r} matches no file")
    elif os.path.isfile(text):
        names = [text]
    elif os.path.exists(text):
        raise DataError(f"data path {text} is not a regular file: token ids are read from .bin / .npy files")
    else:
        raise DataError(f"data path not found: {text} (give a .bin / .npy file or a glob of them)")
    bad = [n for n in names if not n.lower().endswith(TOKEN_SUFFIXES)]
    if bad:
        raise DataError(f"{bad[0]} is not a token file: a token source holds only {', '.join(TOKEN_SUFFIXES)} files")
    return [TokenFile(n, Path(n), *_layout(Path(n))) for n in names]


def is_val_name(name: str) -> bool:
    """``val.bin``, ``fineweb_val_000000.bin``, ``shard-val.npy``: a ``val`` part in the file's stem."""
    return "val" in re.split(r"[^a-z0-9]+", Path(name).stem.lower())


class TokenStream:
    """Token files concatenated in order, indexed like one 1-D array: ``len``, ``shape``, integer-array and
    slice indexing (the reads of train_batch / val_windows). Only the ids asked for are read."""

    def __init__(self, parts: list[np.ndarray], dtype=None):
        self.parts = [p for p in parts if p.shape[0]]
        self.dtype = np.dtype(dtype or (np.result_type(*self.parts) if self.parts else np.uint16))
        self._ends = np.cumsum([p.shape[0] for p in self.parts], dtype=np.int64)

    @property
    def shape(self) -> tuple[int]:
        return (int(self._ends[-1]) if self.parts else 0,)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                raise ValueError("a TokenStream slices with step 1 only")
            return self._slice(start, stop)
        idx = np.asarray(key, np.int64)
        out = np.empty(idx.shape, self.dtype)
        part = np.searchsorted(self._ends, idx, side="right")
        for k in np.unique(part).tolist():
            sel = part == k
            out[sel] = self.parts[k][idx[sel] - (self._ends[k] - self.parts[k].shape[0])]
        return out

    def _slice(self, start: int, stop: int) -> "TokenStream":
        parts, begin = [], 0
        for p, end in zip(self.parts, self._ends.tolist()):
            lo, hi = max(start, begin) - begin, min(stop, end) - begin
            if hi > lo:
                parts.append(p[lo:hi])
            begin = end
        return TokenStream(parts, self.dtype)

    def __array__(self, dtype=None, copy=None):
        out = np.concatenate(self.parts) if self.parts else np.zeros((0,), self.dtype)
        return out if dtype is None else out.astype(dtype)


def check_ids(files: list[TokenFile], vocab_size: int) -> int:
    """The largest id of ``files``; a ``DataError`` naming the file, the position and the id when one is not
    below ``vocab_size``. Read ``CHECK_CHUNK`` ids at a time."""
    top = -1
    for f in files:
        ids = f.open()
        for start in range(0, f.n_ids, CHECK_CHUNK):
            chunk = np.asarray(ids[start:start + CHECK_CHUNK])
            hi = int(chunk.max())
            if hi >= vocab_size or int(chunk.min()) < 0:
                at = start + int(np.flatnonzero((chunk >= vocab_size) | (chunk < 0))[0])
                raise DataError(f"{f.name}: token id {int(ids[at])} at position {at:,} is outside the vocabulary "
                                f"0..{vocab_size - 1}: give --vocab-size larger than the shards' largest id")
            top = max(top, hi)
    return top


@dataclasses.dataclass
class TokenStats:
    """What a token source holds, for the run's opening line and the record."""

    source: str
    train_files: list[str]
    val_files: list[str]
    layouts: list[str]
    n_ids: int
    max_id: int
    vocab_size: int
    val_rule: str

    def describe(self) -> str:
        return (f"{self.source}: {len(self.train_files) + len(self.val_files)} token files "
                f"({', '.join(sorted(set(self.layouts)))}), {self.n_ids:,} ids, largest {self.max_id} < vocab "
                f"{self.vocab_size}; val: {self.val_rule}")


def read_token_source(path, vocab_size: int, val_percent: float):
    """(train stream, val stream, stats) of the token files ``path`` names (the split: see the module docstring)."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 2:
        raise ConfigError(f"vocab_size = {vocab_size!r} is invalid: a run over token ids needs --vocab-size V, the "
                          f"model's vocabulary (larger than every id in the shards)")
    files = find_token_files(path)
    max_id = check_ids(files, vocab_size)
    val_files = [f for f in files if is_val_name(f.name)]
    train_files = [f for f in files if not is_val_name(f.name)]
    if not train_files:
        raise DataError(f"every file {path!r} matches is a val file ({', '.join(f.name for f in val_files)}): "
                        f"give the train shards too")
    train = TokenStream([f.open() for f in train_files])
    if val_files:
        val, rule = TokenStream([f.open() for f in val_files]), f"{len(val_files)} val file(s)"
    else:
        cut = int(len(train) * (1 - val_percent / 100))
        train, val = train[:cut], train[cut:]
        rule = f"the last {val_percent:g}% of the ids ({len(val):,})"
    stats = TokenStats(str(path), [f.name for f in train_files], [f.name for f in val_files],
                       [f.layout for f in files], sum(f.n_ids for f in files), max_id, vocab_size, rule)
    return train, val, stats
