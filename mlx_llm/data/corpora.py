"""A run's data, whatever ``--data`` names: text (data/text.py, data/encoding.py), token ids (data/tokens.py) or a
weighted mixture of either (data/mixture.py). ``open_data`` returns the tokenizer at once and the corpus
later, so a run checks its configs against the tokenizer before it spends time encoding.

``data_identity`` says what the data is, whatever its path is called: a SHA-256 over the files it reads (each
file's name as the corpus names it, its size and a hash of its bytes), recorded in the run (``DataSpec.
fingerprint``) so that a resume, an evaluation and a comparison check the data itself, not its spelling."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import os
import stat
from pathlib import Path
from typing import Callable

import numpy as np

from mlx_llm.errors import ConfigError, DataError
from mlx_llm.data.hf_tokenizer import from_hf
from mlx_llm.data import text as text_lib
from mlx_llm.data import encoding as encoding_lib
from mlx_llm.data import packing as packing_lib
from mlx_llm.data import tokenizer as tok_lib
from mlx_llm.data.mixture import MixtureCorpus
from mlx_llm.data.tokens import find_token_files, is_token_source, read_token_source


@dataclasses.dataclass
class Data:
    tokenizer: tok_lib.Tokenizer
    build: Callable[..., object]  # build(cache_dir, progress=False) → the corpus (encodes text on a cache miss)


def token_corpus(path, tok: tok_lib.Tokenizer, val_percent: float) -> packing_lib.Corpus:
    """A ``data.Corpus`` over token files: memmaps, nothing encoded or cached."""
    train, val, stats = read_token_source(path, tok.vocab_size, val_percent)
    empty = np.zeros((0,), np.int64)
    return packing_lib.Corpus(packing_lib.TokenSplit(train, empty), packing_lib.TokenSplit(val, empty), tok, stats,
                           cache_path=None, cache_hit=True, encode_seconds=0.0)


def _id_tokenizer(run_dir: Path, spec, objective: str) -> tok_lib.Tokenizer:
    if objective == "diffusion":
        raise ConfigError("the diffusion objective needs a <|mask|> token, and token ids from an external tokenizer "
                          "have none: train token shards with --objective ar")
    if (run_dir / tok_lib.TOKENIZER_FILE).is_file():
        return tok_lib.load(run_dir)
    if spec.tokenizer not in ("bpe", "byte"):  # the tokenizer the ids were made with
        return given_tokenizer(spec.tokenizer)
    return tok_lib.IdTokenizer(spec.vocab_size)


def open_data(run_dir: Path, spec, objective: str = "ar") -> Data:
    """The run's tokenizer (its own when it has one) and the builder of its corpus."""
    paths = [s.path for s in spec.sources] or [spec.path]
    kinds = {is_token_source(p) for p in paths}
    if len(kinds) > 1:
        raise ConfigError("a mixture holds either text sources or token-id sources (.bin/.npy), not both: their "
                          "ids would come from different tokenizers")
    if kinds == {True}:
        if spec.tokenizer == "byte":
            raise ConfigError("--tokenizer byte encodes text; token-id shards (.bin/.npy) are read as they are: give "
                              "--tokenizer PATH (the tokenizer the ids were made with), or none")
        tok = _id_tokenizer(run_dir, spec, objective)
        if not spec.sources:
            return Data(tok, lambda cache_dir=None, progress=False: token_corpus(spec.path, tok, spec.val_percent))
        return Data(tok, lambda cache_dir=None, progress=False: MixtureCorpus(
            spec.sources, [token_corpus(s.path, tok, spec.val_percent) for s in spec.sources], tok))
    texts = [text_lib.read_corpus(p, extensions=spec.extensions, val_percent=spec.val_percent,
                                  text_field=spec.text_field) for p in paths]
    joined = texts[0] if len(texts) == 1 else _Joined(texts)
    tok = load_tokenizer(run_dir, spec, joined, objective)
    if not spec.sources:
        return Data(tok, lambda cache_dir=None, progress=False: encoding_lib.encode_corpus(texts[0], tok, cache_dir,
                                                                                   progress=progress))
    return Data(tok, lambda cache_dir=None, progress=False: MixtureCorpus(
        spec.sources, [encoding_lib.encode_corpus(t, tok, cache_dir, progress=progress) for t in texts], tok))


def read_text_and_tokenizer(run_dir: Path, spec, cache_dir=None, objective: str = "ar"):
    """(tokenizer, text corpus); the tokenizer is the run's own when it has one, else a new one in memory."""
    text = text_lib.read_corpus(spec.path, extensions=spec.extensions, val_percent=spec.val_percent,
                                text_field=spec.text_field)
    tok = load_tokenizer(run_dir, spec, text, objective)
    return tok, text


def load_tokenizer(run_dir: Path, spec, text_corpus, objective: str = "ar") -> tok_lib.Tokenizer:
    """The run's tokenizer.json if present, else a new one (BPE trained on the train split only). A diffusion
    run's tokenizer also has ``<|mask|>`` (``DIFFUSION_SPECIAL_TOKENS``); AR tokenizers keep their ids."""
    specials = tok_lib.DIFFUSION_SPECIAL_TOKENS if objective == "diffusion" else tok_lib.SPECIAL_TOKENS
    if (run_dir / tok_lib.TOKENIZER_FILE).is_file():
        tok = tok_lib.load(run_dir)
    elif spec.tokenizer == "byte":
        tok = tok_lib.ByteTokenizer(specials)
    elif spec.tokenizer != "bpe":
        tok = given_tokenizer(spec.tokenizer)
    else:
        tok = tok_lib.train_bpe((d.text for d in text_corpus.train), spec.vocab_size, special_tokens=specials)
    if objective == "diffusion" and tok.mask_id is None:
        raise ConfigError(f"the tokenizer of {run_dir} has no {tok_lib.MASK} token: the diffusion objective needs "
                          f"one (the absorbing state); it is added only when a run starts with --objective diffusion")
    return tok


def given_tokenizer(path: str) -> tok_lib.Tokenizer:
    """``--tokenizer PATH``: a tokenizer file (ours, or a Hugging Face ``tokenizer.json``) or a Hugging Face
    tokenizer directory (roles and chat template read as ``mlx-llm import`` reads them), used as it is."""
    p = Path(path)
    if p.is_dir():
        return from_hf(p)
    if p.is_file():
        return tok_lib.load(p)
    raise ConfigError(f"--tokenizer {path}: no such file or directory (give bpe, byte, a tokenizer.json file or a "
                      f"Hugging Face tokenizer directory)")


class _Joined:
    """The train documents of several text corpora in turn (what a mixture's BPE is trained on)."""

    def __init__(self, texts):
        self.texts = texts

    @property
    def train(self):
        return itertools.chain.from_iterable(t.train for t in self.texts)


# ----- what the data is ------------------------------------------------------------------------------------------
FULL_HASH_BYTES = 16 << 20  # a file up to this size is hashed whole
SAMPLE_BLOCKS, SAMPLE_BYTES = 16, 1 << 16  # a larger one: its size and 16 evenly spaced blocks of 64 KiB
_DATASET_FILES = ("dataset_dict.json", "dataset_info.json", "state.json")  # beside a saved dataset's .arrow files


@dataclasses.dataclass(frozen=True)
class DataIdentity:
    """What a run's data is: ``fingerprint`` (SHA-256, hex) over every file it reads, in corpus order, of the
    line ``name NUL size NUL blake2b(bytes)``; ``files`` and ``n_bytes`` say how much that was."""

    fingerprint: str
    files: int
    n_bytes: int

    def describe(self) -> str:
        return f"{self.files:,} files, {self.n_bytes:,} bytes, fingerprint {self.fingerprint[:12]}"


def data_identity(spec) -> DataIdentity:
    """The identity of what ``spec`` (a ``DataSpec``) reads now: its files found as a run finds them (a directory's
    by its extensions, a glob's matches, a saved dataset's Arrow files, the standard library's .py files by
    default), named as the corpus names them (relative to a directory, the file name of a single file, the match
    of a glob), so the same files under another spelling of their path have the same identity, and a mixture's
    sources by name in order. Cheap: a file is read once, and one over ``FULL_HASH_BYTES`` only in
    ``SAMPLE_BLOCKS`` blocks (an edit that keeps its size and misses them is not seen); times are not used, so a
    copy of the corpus (or a touched file) is the same data."""
    h, files, n_bytes = hashlib.sha256(), 0, 0
    roots = [(s.name, s.path) for s in spec.sources] or [("", spec.path)]
    for source, root in roots:
        h.update(f"source\0{source}\n".encode("utf-8"))
        for name, path in _data_files(root, spec.extensions):
            size, digest = _file_digest(path)
            h.update(f"{name}\0{size}\0{digest}\n".encode("utf-8"))
            files, n_bytes = files + 1, n_bytes + size
    return DataIdentity(h.hexdigest(), files, n_bytes)


def _data_files(root, extensions) -> list[tuple[str, Path]]:
    """(name, path) of every file ``root`` (a ``--data`` path, or None: the standard library) reads."""
    if root is not None and is_token_source(root):
        files = find_token_files(root)
        base = os.path.dirname(str(root)) if any(c in str(root) for c in "*?[") else os.path.dirname(files[0].name)
        return [(os.path.relpath(f.name, _fixed_part(base)), f.path) for f in files]
    out, seen = [], set()
    for source in text_lib.find_sources(root, extensions)[0]:
        if source.kind != "dataset":
            out.append((source.name, source.path))
        elif source.path not in seen:  # a DatasetDict's splits are one directory
            seen.add(source.path)
            out += [(f"{source.name.rsplit('/', 1)[0] if source.part else source.name}/{rel}", source.path / rel)
                    for rel in _dataset_files(source.path)]
    return out


def _fixed_part(path: str) -> str:
    """The leading directories of a glob that hold no wildcard (what its matches are named relative to)."""
    parts = Path(path).parts
    return str(Path(*itertools.takewhile(lambda p: not any(c in p for c in "*?["), parts)) or ".")


def _dataset_files(root: Path) -> list[str]:
    """A saved dataset's files that hold its data (its Arrow tables and their JSON descriptions), relative, sorted;
    caches that ``datasets`` may write beside them later are not the data."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for f in filenames:
            if (f.endswith(".arrow") and not f.startswith("cache-")) or f in _DATASET_FILES:
                found.append((Path(dirpath) / f).relative_to(root).as_posix())
    return sorted(found)


def _file_digest(path: Path) -> tuple[int, str]:
    """(size, blake2b hex) of a regular file's bytes (sampled above ``FULL_HASH_BYTES``); a special file (a named
    pipe, a device: the corpus skips it) is named by its kind, never read."""
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            return 0, "not-a-regular-file"
        h = hashlib.blake2b(digest_size=16)
        with open(path, "rb") as fh:
            if info.st_size <= FULL_HASH_BYTES:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
            else:
                span = max(info.st_size - SAMPLE_BYTES, 0)
                for k in range(SAMPLE_BLOCKS):
                    fh.seek(span * k // (SAMPLE_BLOCKS - 1))
                    h.update(fh.read(SAMPLE_BYTES))
    except OSError as err:
        raise DataError(f"cannot read {path} to fingerprint the data: {err.strerror or err}") from None
    return info.st_size, h.hexdigest()
