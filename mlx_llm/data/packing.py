"""Token streams → packed training windows and validation sets (M20 §2, §10), and the encoded ``Corpus``.

A window holds T + 1 tokens; documents keep their own segment ids (attention never crosses a document) and
positions that restart at each document. Batch ``step`` is a function of (seed, step) only.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np

from mlx_llm.data.text import CorpusStats
from mlx_llm.data.tokenizer import Tokenizer
from mlx_llm.errors import ConfigError, DataError, InputError


# ----- token streams -----------------------------------------------------------------------------
@dataclasses.dataclass
class TokenSplit:
    tokens: np.ndarray  # (N,) uint16/uint32 memmap: BOS doc EOS BOS doc EOS …
    doc_starts: np.ndarray  # (n_docs,) int64 offsets of each BOS

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])


# ----- batches ------------------------------------------------------------------------------------
def pack_windows(windows_BT1: np.ndarray, bos_id: int | None, pad_id: int, *, eos_id: int | None = None,
                 valid_BT1: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Windows of T+1 tokens → inputs, next-token targets and the packing arrays (M20 §2, §10).

    A segment starts at column 0, at each BOS and at the first PAD of a padding run; ``segment_ids`` count
    segments from 0 within a row (attention stays inside a segment) and ``positions`` restart at 0 at each
    segment start. ``mask`` (float32 b_t) drops targets that are BOS (the next document's start cannot be
    predicted from the previous one) or PAD; the EOS ending a document is a target.

    A tokenizer without BOS (``bos_id`` None): a segment starts after each EOS, and the target whose input is
    that EOS (the next document's first token) is dropped instead; with neither (token ids whose tokenizer is
    external) the window is one segment. ``valid_BT1`` marks
    the real tokens (False: padding); by default every token not equal to ``pad_id``, which needs a PAD of its
    own — give it when PAD is the EOS id (Qwen's).
    """
    w_BT1 = np.asarray(windows_BT1).astype(np.int32)
    tokens_BT, targets_BT = w_BT1[:, :-1], w_BT1[:, 1:]
    b, t = tokens_BT.shape
    valid_BT1 = w_BT1 != pad_id if valid_BT1 is None else np.asarray(valid_BT1, bool)
    is_pad_BT = ~valid_BT1[:, :-1]
    prev_pad_BT = np.concatenate([np.zeros((b, 1), bool), is_pad_BT[:, :-1]], axis=1)
    if bos_id is None and eos_id is None:  # token ids with no known separator (data/tokens.py): one stream
        starts_BT, dropped_BT = is_pad_BT & ~prev_pad_BT, np.zeros((b, t), bool)
    elif bos_id is None:
        after_eos_BT = np.concatenate([np.zeros((b, 1), bool), tokens_BT[:, :-1] == eos_id], axis=1)
        starts_BT, dropped_BT = after_eos_BT | (is_pad_BT & ~prev_pad_BT), tokens_BT == eos_id
    else:
        starts_BT, dropped_BT = (tokens_BT == bos_id) | (is_pad_BT & ~prev_pad_BT), targets_BT == bos_id
    starts_BT[:, 0] = True
    col_BT = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    last_start_BT = np.maximum.accumulate(np.where(starts_BT, col_BT, 0), axis=1)
    return {
        "tokens": np.ascontiguousarray(tokens_BT),
        "targets": np.ascontiguousarray(targets_BT),
        "mask": (~dropped_BT & valid_BT1[:, 1:]).astype(np.float32),
        "segment_ids": (np.cumsum(starts_BT, axis=1) - 1).astype(np.int32),
        "positions": (col_BT - last_start_BT).astype(np.int32),
    }


def check_positive(**values) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ConfigError(f"{name} = {v!r} is invalid: it must be a positive integer")


def window_starts(n_tokens: int, step: int, *, batch_size: int, seq_len: int, seed: int) -> np.ndarray:
    """(B,) window offsets drawn from ``default_rng([seed, step])``: batch ``step`` is the same on every run."""
    check_positive(batch_size=batch_size, seq_len=seq_len)
    for name, v in (("seed", seed), ("step", step)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ConfigError(f"{name} = {v!r} is invalid: it must be an integer ≥ 0")
    check_window_fits(n_tokens, seq_len)
    return np.random.default_rng([int(seed), int(step)]).integers(0, n_tokens - seq_len, size=batch_size)


def check_window_fits(n_tokens: int, seq_len: int, where: str = "") -> None:
    """A window of T + 1 tokens must fit the train split (``where``: which source, for a mixture)."""
    if n_tokens < 2:
        raise ConfigError(f"the train split{where} holds {n_tokens} token(s): a training window needs seq_len + 1 = "
                          f"{seq_len + 1}; give more data")
    if n_tokens < seq_len + 1:
        raise ConfigError(
            f"seq_len = {seq_len} is too long for a train split{where} of {n_tokens} tokens: it must be ≤ "
            f"{n_tokens - 1}"
        )


def check_val_fits(n_tokens: int, where: str = "") -> None:
    """The val split must hold at least one target (two tokens)."""
    if n_tokens < 2:
        raise ConfigError(f"the val split{where} holds {n_tokens} token(s): there is nothing to evaluate; give more "
                          f"data (or a larger --val-percent)")


def first_until(items: list, size, budget: int) -> list:
    """The shortest prefix of ``items`` whose ``size``s sum to at least ``budget`` (all of them if they never do;
    at least one): an evaluation capped at about ``budget`` scored tokens, the same ones every time."""
    total = 0
    for i, item in enumerate(items):
        total += size(item)
        if total >= budget:
            return items[:i + 1]
    return items


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


def val_windows(tokens: np.ndarray, seq_len: int, pad_id: int, max_tokens: int | None = None, *,
                with_valid: bool = False):
    """(W, T+1) consecutive windows sharing one token at each seam (every token after the first is a target
    once), the last padded with PAD; ``max_tokens`` caps the number of target positions covered. ``with_valid``:
    also the (W, T+1) mask of real (not padding) tokens."""
    n = int(tokens.shape[0])
    n_cover = n - 1 if max_tokens is None else min(n - 1, max_tokens)
    n_windows = math.ceil(n_cover / seq_len)
    idx_WT1 = np.arange(n_windows)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    covered = np.asarray(tokens[:n_cover + 1])  # only what is scored is read (a memmap's head, not the split)
    windows = np.where(idx_WT1 <= n_cover, covered[np.minimum(idx_WT1, n_cover)], pad_id)
    return (windows, idx_WT1 <= n_cover) if with_valid else windows


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

    def check_windows(self, seq_len: int, where: str = "") -> None:
        """Both splits can be batched at ``seq_len``: checked before a run writes anything."""
        check_window_fits(self.train.n_tokens, seq_len, where)
        check_val_fits(self.val.n_tokens, where)

    def train_batch(self, step: int, *, batch_size: int, seq_len: int, seed: int,
                    rows: slice = slice(None)) -> dict[str, np.ndarray]:
        """Batch ``step`` of B random windows of the train stream: a function of (seed, step) only; ``rows``
        reads only those rows of it (a process's part of the global batch)."""
        starts_B = window_starts(self.train.n_tokens, step, batch_size=batch_size, seq_len=seq_len, seed=seed)[rows]
        w_BT1 = self.train.tokens[starts_B[:, None] + np.arange(seq_len + 1)[None, :]]
        return self._pack(w_BT1, np.ones(w_BT1.shape, bool))

    def _pack(self, w_BT1, valid_BT1) -> dict[str, np.ndarray]:
        tok = self.tokenizer
        return pack_windows(w_BT1, tok.bos_id, tok.pad_id, eos_id=tok.eos_id, valid_BT1=valid_BT1)

    def val_batches(self, seq_len: int, batch_size: int, max_tokens: int | None = None) -> ValSet:
        """The val split in order, in batches of ``batch_size`` windows (the last batch padded with PAD rows)."""
        check_positive(seq_len=seq_len, batch_size=batch_size)
        if max_tokens is not None:
            check_positive(max_tokens=max_tokens)
        w_WT1, valid_WT1 = val_windows(self.val.tokens, seq_len, self.tokenizer.pad_id, max_tokens, with_valid=True)
        n_rows = math.ceil(len(w_WT1) / batch_size) * batch_size
        w_WT1 = np.concatenate([w_WT1, np.full((n_rows - len(w_WT1), seq_len + 1), self.tokenizer.pad_id)])
        valid_WT1 = np.concatenate([valid_WT1, np.zeros((n_rows - len(valid_WT1), seq_len + 1), bool)])
        byte_len = self.tokenizer.token_byte_lengths()
        batches, per_batch = [], []
        for k in range(0, n_rows, batch_size):
            batch = self._pack(w_WT1[k : k + batch_size], valid_WT1[k : k + batch_size])
            batches.append(batch)
            per_batch.append(int((byte_len[batch["targets"]] * batch["mask"]).sum()))
        token_bytes = sum(int((byte_len[b["tokens"]] * b["mask"]).sum()) for b in batches)
        return ValSet(batches, int(sum(b["mask"].sum() for b in batches)), sum(per_batch), per_batch, token_bytes)

    def unigram_bits_per_byte(self) -> float | None:
        """The add-one unigram baseline on the whole val split (BOS never counted: it is never a target); None
        for token ids whose tokenizer is external (no byte lengths)."""
        if self.tokenizer.external:
            return None
        bos, byte_len = self.tokenizer.bos_id, self.tokenizer.token_byte_lengths()
        train_ids = np.asarray(self.train.tokens)
        val_ids = np.asarray(self.val.tokens)
        if bos is not None:
            train_ids, val_ids = train_ids[train_ids != bos], val_ids[val_ids != bos]
        return unigram_bits_per_byte(train_ids, val_ids, self.tokenizer.vocab_size, int(byte_len[val_ids].sum()))


def unigram_bits_per_byte(train_ids, val_ids, vocab_size: int, val_bytes: int) -> float:
    """Add-one (Laplace) unigram: p(v) = (c_v + 1) / (N + V) from train counts; returns
    −Σ_{val ids} log₂ p(v) / ``val_bytes``."""
    check_positive(vocab_size=vocab_size, val_bytes=val_bytes)
    train_n, val_n = np.asarray(train_ids, np.int64).ravel(), np.asarray(val_ids, np.int64).ravel()
    for name, ids in (("train_ids", train_n), ("val_ids", val_n)):
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise InputError(f"{name} holds ids outside 0..{vocab_size - 1} (min {ids.min()}, max {ids.max()})")
    if val_n.size == 0:
        raise DataError("val_ids is empty: there is nothing to score")
    counts_V = np.bincount(train_n, minlength=vocab_size)
    log2p_V = np.log2(counts_V + 1.0) - np.log2(train_n.size + vocab_size)
    return float(-log2p_V[val_n].sum() / val_bytes)
