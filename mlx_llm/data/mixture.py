"""Weighted mixtures of data sources: ``--data NAME=PATH[:WEIGHT] ...`` or a mixture JSON file.

Each row of a training batch comes from one source, chosen with probability weight / Σ weights; the choice and
the window inside the source are functions of (seed, step) alone (``default_rng([seed, step, 0])`` picks the
sources of the batch's rows, ``default_rng([seed, step, 1 + k])`` the windows of source k), so a resumed run
draws exactly the batches it would have drawn. Each source keeps its own train/val split; validation is
reported per source (``val_loss/NAME``, ``val_bpb/NAME``) and as the weighted mean of the sources' values
(``val_loss``, ``val_bpb``, with ``val_ppl`` = exp(``val_loss``)). Every source is tokenised by one tokenizer
(BPE is trained on all the text sources' train splits together), and a mixture is all text or all token ids.

A mixture JSON file: ``{"sources": [{"name": "web", "path": "web.jsonl", "weight": 3}, ...]}`` (relative paths
are taken from the file's directory; ``weight`` defaults to 1).
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import numpy as np

from mlx_llm.errors import ConfigError
from mlx_llm.data.packing import check_window_fits
from mlx_llm.settings import JsonProblem, read_json

NAME_RE = re.compile(r"[A-Za-z0-9_.-]+")


@dataclasses.dataclass(frozen=True)
class Source:
    name: str
    path: str  # absolute
    weight: float

    def spec(self) -> str:
        """The canonical ``NAME=PATH:WEIGHT`` stored in the run record (``DataSpec.mixture``)."""
        return f"{self.name}={self.path}:{self.weight!r}"


def _weight(text: str, name: str) -> float:
    try:
        w = float(text)
    except ValueError:
        raise ConfigError(f"the weight {text!r} of source {name!r} is not a number") from None
    if not math.isfinite(w) or w <= 0:
        raise ConfigError(f"the weight {w:g} of source {name!r} is invalid: weights must be positive finite numbers")
    return w


def _exists(path: str, base: Path | None) -> bool:
    full = Path(path).expanduser()
    return (full if full.is_absolute() else (base or Path.cwd()) / full).exists() or any(c in path for c in "*?[")


def parse_source(item: str, base: Path | None = None) -> Source:
    """``NAME=PATH[:WEIGHT]`` → Source (the weight is the part after the last ':' when it reads as a number, so
    a path may hold colons); relative paths are taken from ``base`` (default: the working directory)."""
    name, eq, rest = str(item).partition("=")
    if not eq or not NAME_RE.fullmatch(name) or not rest:
        raise ConfigError(f"data source {item!r} is invalid: give NAME=PATH[:WEIGHT] with NAME of letters, digits, "
                          f"'_', '.', '-' (e.g. web=data/web.jsonl:3)")
    path, colon, tail = rest.rpartition(":")
    looks_numeric = bool(colon) and re.fullmatch(r"[-+]?[0-9.eE+-]+|nan|inf", tail.strip().lower() or "x")
    if looks_numeric:
        weight = _weight(tail, name)
    elif colon and path and not _exists(rest, base) and _exists(path, base):
        raise ConfigError(f"the weight {tail!r} of source {name!r} is not a number (give NAME=PATH:WEIGHT, e.g. "
                          f"{name}={path}:2)")
    else:
        path, weight = rest, 1.0
    full = Path(path).expanduser()
    full = full if full.is_absolute() else (base or Path.cwd()) / full
    return Source(name, str(full.resolve()) if not any(c in path for c in "*?[") else str(full), weight)


def read_mixture_file(path: Path) -> list[Source]:
    """The sources of a mixture JSON file (see the module docstring)."""
    try:
        obj = read_json(path)
    except JsonProblem as err:
        raise ConfigError(f"mixture file {path} cannot be read: {err.detail}") from None
    unknown = sorted(set(obj) - {"sources"}) if isinstance(obj, dict) else []
    if unknown:
        raise ConfigError(f"mixture file {path}: unknown key(s) {unknown}; a mixture file holds only 'sources'")
    entries = obj.get("sources") if isinstance(obj, dict) else None
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise ConfigError(f'mixture file {path}: expected {{"sources": [{{"name": ..., "path": ..., "weight": ...}}, '
                          f'...]}} with at least one source')
    out = []
    for e in entries:
        unknown = sorted(set(e) - {"name", "path", "weight"})
        if unknown or "name" not in e or "path" not in e:
            raise ConfigError(f"mixture file {path}: source {e!r} needs 'name' and 'path' (and optionally 'weight'), "
                              f"not {unknown or 'less'}")
        weight = e.get("weight", 1)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise ConfigError(f"mixture file {path}: the weight {weight!r} of source {e['name']!r} is not a number")
        source = parse_source(f"{e['name']}={e['path']}:{float(weight)!r}", Path(path).parent)
        if _is_mixture_file(Path(source.path), Path(path)):
            raise ConfigError(f"mixture file {path}: source {e['name']!r} is a mixture file ({source.path}); a "
                              f"mixture's sources are data, not other mixtures")
        out.append(source)
    return out


def _is_mixture_file(candidate: Path, mixture: Path) -> bool:
    """``candidate`` is the mixture file itself or another one (a JSON object with "sources")."""
    if candidate.suffix.lower() != ".json" or not candidate.is_file():
        return False
    if candidate.resolve() == mixture.resolve():
        return True
    try:
        obj = read_json(candidate, max_bytes=1 << 20)
    except JsonProblem:
        return False
    return isinstance(obj, dict) and "sources" in obj


def parse_sources(items) -> tuple[Source, ...]:
    """Sources from ``NAME=PATH[:WEIGHT]`` items or canonical specs; names must be unique."""
    sources = tuple(parse_source(i) for i in items)
    names = [s.name for s in sources]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"data source name(s) {dupes} are given more than once: each source needs its own name")
    total = sum(s.weight for s in sources)
    if not math.isfinite(total):
        raise ConfigError(f"the weights {[s.weight for s in sources]} sum to {total}: give smaller weights (only "
                          f"their ratios matter)")
    return sources


def data_flag(values) -> dict:
    """The DataSpec fields ``--data`` gives: one PATH → {"path"}; a mixture JSON file or NAME=PATH[:WEIGHT]
    items → {"path": None, "mixture": canonical specs}."""
    values = [values] if isinstance(values, str) else list(values)
    if len(values) == 1 and "=" not in values[0]:
        path = Path(values[0]).expanduser()
        if path.suffix.lower() == ".json" and path.is_file():
            return {"path": None, "mixture": tuple(s.spec() for s in _checked(read_mixture_file(path)))}
        return {"path": values[0]}
    if not all("=" in v for v in values):
        raise ConfigError(f"--data {' '.join(values)}: give one PATH, or a mixture of NAME=PATH[:WEIGHT] items, "
                          f"every one named")
    return {"path": None, "mixture": tuple(s.spec() for s in parse_sources(values))}


def _checked(sources: list[Source]) -> tuple[Source, ...]:
    return parse_sources([s.spec() for s in sources])


# ----- the mixed corpus -------------------------------------------------------------------------------------
@dataclasses.dataclass
class MixtureCorpus:
    """Sources' corpora (each a ``data.Corpus`` over one tokenizer) drawn in proportion to their weights."""

    sources: tuple[Source, ...]
    corpora: list
    tokenizer: object

    @property
    def probabilities(self) -> np.ndarray:
        w = np.array([s.weight for s in self.sources], np.float64)
        return w / w.sum()

    def row_sources(self, step: int, batch_size: int, seed: int) -> np.ndarray:
        """(B,) the source index of each row of batch ``step``."""
        rng = np.random.default_rng([int(seed), int(step), 0])
        return rng.choice(len(self.sources), size=batch_size, p=self.probabilities)

    def train_batch(self, step: int, *, batch_size: int, seq_len: int, seed: int,
                    rows: slice = slice(None)) -> dict[str, np.ndarray]:
        """Batch ``step``: each row a window of the source ``row_sources`` gives it (read only for ``rows``)."""
        src_B = self.row_sources(step, batch_size, seed)
        starts_B = np.zeros(batch_size, np.int64)
        for k, corpus in enumerate(self.corpora):
            sel = np.flatnonzero(src_B == k)
            if sel.size:
                n = corpus.train.n_tokens
                check_window_fits(n, seq_len)
                starts_B[sel] = np.random.default_rng([int(seed), int(step), 1 + k]).integers(0, n - seq_len, sel.size)
        mine = np.arange(batch_size)[rows]
        w_BT1 = np.stack([self.corpora[src_B[r]].train.tokens[starts_B[r] + np.arange(seq_len + 1)] for r in mine])
        return self.corpora[0]._pack(w_BT1, np.ones(w_BT1.shape, bool))

    def check_windows(self, seq_len: int) -> None:
        """Every source's splits can be batched at ``seq_len`` (``packing.Corpus.check_windows``)."""
        for source, corpus in zip(self.sources, self.corpora):
            corpus.check_windows(seq_len, f" of source {source.name!r}")

    def val_sets(self, seq_len: int, batch_size: int, max_tokens: int | None = None) -> dict:
        """{source name: its ValSet} (``max_tokens`` caps each source's scored targets)."""
        return {s.name: c.val_batches(seq_len, batch_size, max_tokens) for s, c in zip(self.sources, self.corpora)}

    def weighted(self, per_source: dict[str, float]) -> float:
        """Σ_k p_k · value_k over the sources (the mixture's weighted mean)."""
        return float(sum(p * per_source[s.name] for s, p in zip(self.sources, self.probabilities)))

    def unigram_bits_per_byte(self) -> float | None:
        values = [c.unigram_bits_per_byte() for c in self.corpora]
        return None if None in values else self.weighted({s.name: v for s, v in zip(self.sources, values)})

    def describe(self) -> str:
        p = self.probabilities
        return "; ".join(f"{s.name} (p {pk:.3f}): {c.stats.describe()}, train {c.train.n_tokens:,} tokens"
                         for s, pk, c in zip(self.sources, p, self.corpora))
