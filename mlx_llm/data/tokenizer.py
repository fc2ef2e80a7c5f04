"""Tokenizers: text ↔ token ids, outside the differentiable forward pass (M20 §2).

Two kinds share one interface (``Tokenizer``):

- ``BPETokenizer``: byte-level byte-pair encoding (Sennrich et al. 2016, "Neural Machine Translation of Rare
  Words with Subword Units"; byte-level alphabet as in GPT-2, Radford et al. 2019) trained with Hugging Face
  ``tokenizers``. No normaliser and no added prefix space, so ``decode(encode(text)) == text`` for any text.
- ``ByteTokenizer``: ids 0..255 are the UTF-8 bytes, the special tokens follow.

Special tokens (BOS, EOS, PAD and the chat markers reserved for SFT) are never produced from plain text:
``encode("<|bos|>")`` spells the characters. Pass ``parse_special=True`` to turn marker strings into their ids.
``decode`` writes special ids as their strings (unless ``skip_special=True``), so round trips stay exact.

Roles: which special token plays BOS, EOS and PAD (``Tokenizer.roles``). Ours are ``<|bos|>``, ``<|eos|>`` and
``<|pad|>``; an imported model's tokenizer names its own (Llama 3: ``<|begin_of_text|>`` …; Qwen: no BOS at all).
EOS is required; without a BOS role ``bos_id`` is None and nothing is prepended (``bos_prefix`` is empty);
without a PAD role ``pad_id`` is the EOS id (padding is never a target). A tokenizer may also carry a model's
Jinja ``chat_template`` (data/templates.py). Both are saved in the tokenizer file and covered by the
fingerprint; a tokenizer with our roles and no chat template is saved exactly as before (same fingerprint).
"""

from __future__ import annotations

import abc
import copy
import functools
import hashlib
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from mlx_llm.config import umask_mode
from mlx_llm.errors import ConfigError, DataError, InputError
from mlx_llm.settings import load_json

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
CHAT_MARKERS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
SPECIAL_TOKENS = (BOS, EOS, PAD) + CHAT_MARKERS
MASK = "<|mask|>"  # the absorbing state of masked diffusion (objectives/diffusion.py)
DIFFUSION_SPECIAL_TOKENS = SPECIAL_TOKENS + (MASK,)  # a diffusion run's tokenizer; AR runs keep SPECIAL_TOKENS
TOKENIZER_FILE = "tokenizer.json"
TOKEN_ROLES = ("bos", "eos", "pad")
DEFAULT_ROLES = {"bos": BOS, "eos": EOS, "pad": PAD}
EXTRAS_KEY = "mlx_llm"  # the block of a Hugging Face tokenizer file that holds roles and chat template
_BYTE_TYPE = "mlx_llm.byte"
_IDS_TYPE = "mlx_llm.ids"  # IdTokenizer: a run over token ids whose tokenizer is external


def _check_text(text) -> None:
    if not isinstance(text, str):
        raise InputError(f"text must be a str, got {type(text).__name__}")


def _utf8(text: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InputError(
            f"text is not encodable as UTF-8 ({err.reason} at character {err.start}: {text[err.start]!r}); "
            "only valid Unicode text (no lone surrogates) can be tokenized"
        ) from None


def tokenizer_path(path) -> Path:
    """``path`` itself when it names a ``.json`` file, else ``path / tokenizer.json`` (a run directory)."""
    path = Path(path)
    return path if path.suffix == ".json" else path / TOKENIZER_FILE


def _atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, umask_mode())  # mkstemp makes it private; the file is the run's, like its other files
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class Tokenizer(abc.ABC):
    """What the data pipeline, trainer and sampler rely on. Ids are ``np.int32`` arrays."""

    special_tokens: tuple[str, ...]
    roles: dict[str, str]  # "bos" / "eos" / "pad" → the special token playing it ("eos" always present)
    chat_template: str | None = None  # a model's Jinja chat template (data/templates.py), or None
    origin: str | None = None  # the file ``load`` read (for messages); not saved
    external = False  # True for IdTokenizer: the ids come from a tokenizer this run does not have

    # ----- what each kind implements ------------------------------------------------------------
    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of ids, specials included: the model's V."""

    @abc.abstractmethod
    def token_id(self, token: str) -> int:
        """Id of a special token string."""

    @abc.abstractmethod
    def _encode_plain_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Encode texts with no special-token parsing."""

    @abc.abstractmethod
    def _encode_plain_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """One text with no special-token parsing → (ids, (n, 2) character spans)."""

    @abc.abstractmethod
    def _decode_plain(self, ids: np.ndarray) -> str:
        """Decode ids that contain no special id."""

    @abc.abstractmethod
    def to_json(self) -> str:
        """The serialised tokenizer: what ``save`` writes and ``fingerprint`` hashes."""

    @abc.abstractmethod
    def token_byte_lengths(self) -> np.ndarray:
        """(V,) int32: UTF-8 bytes each id stands for; 0 for special tokens (bits-per-byte counting)."""

    # ----- shared behaviour ----------------------------------------------------------------------
    @property
    def special_ids(self) -> dict[str, int]:
        return {t: self.token_id(t) for t in self.special_tokens}

    @property
    def bos_id(self) -> int | None:
        """Id of the BOS role's token; None when the tokenizer has none (Qwen): nothing is prepended then."""
        return self.token_id(self.roles["bos"]) if "bos" in self.roles else None

    @property
    def bos_prefix(self) -> np.ndarray:
        """What starts a document or prompt: [bos_id], or no id at all without a BOS role; (0 or 1,) int32."""
        return np.asarray([] if self.bos_id is None else [self.bos_id], np.int32)

    @property
    def eos_id(self) -> int:
        return self.token_id(self.roles["eos"])

    @property
    def pad_id(self) -> int:
        """Id of the PAD role's token, else the EOS id (padding positions are never targets)."""
        return self.token_id(self.roles["pad" if "pad" in self.roles else "eos"])

    def with_chat_template(self, source: str | None) -> "Tokenizer":
        """A copy carrying ``source`` as its Jinja chat template (None: without one)."""
        if source is not None and not isinstance(source, str):
            raise ConfigError(f"chat_template must be a Jinja source string or None, got {type(source).__name__}")
        out = copy.copy(self)
        out.chat_template = source
        return out

    def _extras(self) -> dict:
        """What our file format adds to the tokenizer itself: roles unless ours, the chat template if any."""
        extras = {} if self.roles == DEFAULT_ROLES else {"roles": dict(self.roles)}
        return extras if self.chat_template is None else {**extras, "chat_template": self.chat_template}

    @functools.cached_property
    def special_pattern(self) -> re.Pattern:
        """A regex matching any special token string (longest first), as one group."""
        longest_first = sorted(self.special_tokens, key=len, reverse=True)  # "<s>" must not cut "<s>x"
        return re.compile("(" + "|".join(map(re.escape, longest_first)) + ")")

    @property
    def mask_id(self) -> int | None:
        """Id of ``<|mask|>``, or None for a tokenizer built without it (AR runs)."""
        return self.token_id(MASK) if MASK in self.special_tokens else None

    def encode(self, text: str, *, parse_special: bool = False) -> np.ndarray:
        """Text → (n,) int32 ids. No BOS/EOS is added; marker strings stay text unless ``parse_special``."""
        _check_text(text)
        if not parse_special:
            return self.encode_batch([text])[0]
        pieces = self.special_pattern.split(text)
        specials = self.special_ids
        plain = self.encode_batch([p for p in pieces if p not in specials])
        plain_iter = iter(plain)
        out = [np.array([specials[p]], np.int32) if p in specials else next(plain_iter) for p in pieces]
        return np.concatenate(out).astype(np.int32)

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """Plain text (no special-token parsing, like ``encode``) → (ids (n,) int32, spans (n, 2) int64): each
        id's [start, end) character span in ``text``; ids that share a multi-byte character each get its span."""
        _check_text(text)
        _utf8(text)
        return self._encode_plain_offsets(text)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Many texts at once (parallel for BPE); no special-token parsing."""
        texts = list(texts)
        for t in texts:
            _check_text(t)
            _utf8(t)
        return self._encode_plain_batch(texts)

    def decode(self, ids, *, skip_special: bool = False) -> str:
        """Ids → text. Special ids are written as their strings, or dropped with ``skip_special``."""
        ids_n = self._check_ids(ids)
        specials = {i: t for t, i in self.special_ids.items()}
        out, start = [], 0
        for k in np.flatnonzero(np.isin(ids_n, list(specials))).tolist():
            out.append(self._decode_plain(ids_n[start:k]))
            out.append("" if skip_special else specials[int(ids_n[k])])
            start = k + 1
        out.append(self._decode_plain(ids_n[start:]))
        return "".join(out)

    def _check_ids(self, ids) -> np.ndarray:
        ids_n = np.asarray(ids)
        if ids_n.size == 0:
            return np.zeros((0,), np.int64)
        if ids_n.ndim != 1 or not np.issubdtype(ids_n.dtype, np.integer):
            raise InputError(f"ids must be a 1-D sequence of integers, got shape {ids_n.shape} dtype {ids_n.dtype}")
        bad = (ids_n < 0) | (ids_n >= self.vocab_size)
        if bad.any():
            raise InputError(
                f"token id {int(ids_n[bad][0])} is out of range: valid ids are 0..{self.vocab_size - 1}"
            )
        return ids_n.astype(np.int64)

    def save(self, path) -> Path:
        """Write atomically to ``path`` (a ``.json`` file, or a directory → ``tokenizer.json``); returns the file."""
        target = tokenizer_path(path)
        _atomic_write_text(target, self.to_json())
        return target

    def fingerprint(self) -> str:
        """SHA-256 of the serialised tokenizer: equal tokenizers give equal keys (cache keys)."""
        return hashlib.sha256(self.to_json().encode("utf-8")).hexdigest()


class ByteTokenizer(Tokenizer):
    """Ids 0..255 are UTF-8 bytes; ``special_tokens`` take 256, 257, …"""

    def __init__(self, special_tokens: Sequence[str] = SPECIAL_TOKENS, *, roles: dict | None = None,
                 chat_template: str | None = None):
        self.roles = _check_specials(special_tokens, roles)
        self.special_tokens = tuple(special_tokens)
        self._special_index = {t: 256 + k for k, t in enumerate(self.special_tokens)}
        self.chat_template = chat_template

    @property
    def vocab_size(self) -> int:
        return 256 + len(self.special_tokens)

    def token_id(self, token: str) -> int:
        if token not in self._special_index:
            raise InputError(f"{token!r} is not a special token of this tokenizer: {list(self.special_tokens)}")
        return self._special_index[token]

    def _encode_plain_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), np.uint8).astype(np.int32) for t in texts]

    def _encode_plain_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        char_of_byte = np.repeat(np.arange(len(text), dtype=np.int64), [len(c.encode("utf-8")) for c in text])
        return self._encode_plain_batch([text])[0], np.stack([char_of_byte, char_of_byte + 1], axis=1)

    def _decode_plain(self, ids: np.ndarray) -> str:
        # Errors can only come from a partial multi-byte character (a cut id sequence).
        return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def token_byte_lengths(self) -> np.ndarray:
        return np.concatenate([np.ones(256, np.int32), np.zeros(len(self.special_tokens), np.int32)])

    def to_json(self) -> str:
        return json.dumps({"type": _BYTE_TYPE, "version": 1, "special_tokens": list(self.special_tokens),
                           **self._extras()}, indent=2)


class IdTokenizer(Tokenizer):
    """The tokenizer of a run trained on token ids (pre-tokenized shards, data/tokens.py) whose real tokenizer is
    external: V ids and nothing else — no special tokens, no BOS/EOS/PAD role, no byte lengths (so no bits per
    byte). Its "text" is the ids in decimal: ``encode("464 3290")`` → [464, 3290] (spaces or commas between
    ids; each checked < V) and ``decode`` writes each id as " <id>", so ``mlx-llm generate`` on such a run takes
    and prints ids, and a prompt followed by its continuation reads as one list."""

    external = True

    def __init__(self, vocab_size: int):
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ConfigError(f"vocab_size = {vocab_size!r} is invalid: it must be a positive integer")
        self._vocab_size, self.special_tokens, self.roles = vocab_size, (), {}

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def token_id(self, token: str) -> int:
        raise InputError(f"{token!r}: a run over token ids has no special tokens (its tokenizer is external)")

    @property
    def bos_id(self) -> None:
        return None

    @property
    def eos_id(self) -> None:
        """None: no id is known to end a document, so generation runs to its length limit."""
        return None

    @property
    def pad_id(self) -> int:
        """Id 0 fills padding positions; they are marked invalid explicitly and never scored."""
        return 0

    @functools.cached_property
    def special_pattern(self) -> re.Pattern:
        return re.compile("((?!))")  # matches nothing: there is no special token to parse

    def _encode_plain_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self._encode_plain_offsets(t)[0] for t in texts]

    def _encode_plain_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        ids, spans = [], []
        for m in re.finditer(r"[^\s,]+", text):
            word = m.group()
            if not (word.isascii() and word.isdigit()) or int(word) >= self._vocab_size:
                raise InputError(f"{word!r} is not a token id: this run was trained on token ids (an external "
                                 f"tokenizer), so text is written as ids 0..{self._vocab_size - 1}, e.g. '464 3290'")
            ids.append(int(word))
            spans.append(m.span())
        return np.asarray(ids, np.int32), np.asarray(spans, np.int64).reshape(-1, 2)

    def _decode_plain(self, ids: np.ndarray) -> str:
        return "".join(f" {int(i)}" for i in ids)

    def token_byte_lengths(self) -> np.ndarray:
        return np.zeros(self._vocab_size, np.int32)

    def to_json(self) -> str:
        return json.dumps({"type": _IDS_TYPE, "version": 1, "vocab_size": self._vocab_size}, indent=2)


class BPETokenizer(Tokenizer):
    """A Hugging Face byte-level BPE ``tokenizers.Tokenizer`` behind the common interface."""

    def __init__(self, hf_tokenizer, special_tokens: Sequence[str] = SPECIAL_TOKENS, *, roles: dict | None = None,
                 chat_template: str | None = None):
        self.roles = _check_specials(special_tokens, roles)
        self.special_tokens = tuple(special_tokens)
        self._hf = hf_tokenizer
        self._hf.encode_special_tokens = True  # marker strings in plain text are spelled, never parsed
        self._special_index = {t: self._hf.token_to_id(t) for t in self.special_tokens}
        missing = [t for t, i in self._special_index.items() if i is None]
        if missing:
            raise DataError(f"the BPE tokenizer lacks the special tokens {missing[:8]}; it must define "
                            f"{list(self.special_tokens)[:16]}")
        self.chat_template = chat_template

    @property
    def hf(self):
        """The underlying ``tokenizers.Tokenizer`` (read it, do not mutate it)."""
        return self._hf

    @property
    def vocab_size(self) -> int:
        return self._hf.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int:
        if token not in self._special_index:
            raise InputError(f"{token!r} is not a special token of this tokenizer: {list(self.special_tokens)[:16]}")
        return self._special_index[token]

    def _encode_plain_batch(self, texts: list[str]) -> list[np.ndarray]:
        encodings = self._hf.encode_batch_fast(texts, add_special_tokens=False)
        return [np.asarray(e.ids, np.int32) for e in encodings]

    @functools.cached_property
    def _unprocessed(self):
        """The tokenizer without its post-processor: the same ids (no specials are added), but offsets that no
        ByteLevel ``trim_offsets`` has moved."""
        if self._hf.post_processor is None:
            return self._hf
        from tokenizers import Tokenizer as HFTokenizer

        raw = HFTokenizer.from_str(self._hf.to_str())
        raw.post_processor = None
        raw.encode_special_tokens = True
        return raw

    def _encode_plain_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        enc = self._unprocessed.encode(text, add_special_tokens=False)
        return np.asarray(enc.ids, np.int32), np.asarray(enc.offsets, np.int64).reshape(-1, 2)

    def _decode_plain(self, ids: np.ndarray) -> str:
        return self._hf.decode(ids.tolist(), skip_special_tokens=False)

    def token_byte_lengths(self) -> np.ndarray:
        # Byte-level BPE spells every byte as one character, so a token's byte count is its length.
        specials = set(self.special_ids.values())
        return np.array([0 if i in specials else len(self._hf.id_to_token(i) or "") for i in range(self.vocab_size)],
                        np.int32)

    def to_json(self) -> str:
        """The ``tokenizers`` JSON; roles other than ours and a chat template go into its "mlx_llm" block."""
        text, extras = self._hf.to_str(pretty=False), self._extras()
        if not extras:
            return text
        return text.rstrip()[:-1] + f',"{EXTRAS_KEY}":' + json.dumps(extras, ensure_ascii=False) + "}"


def _check_specials(special_tokens: Sequence[str], roles: dict | None = None) -> dict[str, str]:
    """Distinct non-empty special tokens that include each role's token; returns the roles (ours by default)."""
    tokens = list(special_tokens)
    if not all(isinstance(t, str) and t for t in tokens) or len(set(tokens)) != len(tokens):
        raise ConfigError(f"special_tokens = {tokens!r:.200} is invalid: it must list distinct non-empty strings")
    roles = dict(DEFAULT_ROLES if roles is None else roles)
    if set(roles) - set(TOKEN_ROLES) or "eos" not in roles or not all(isinstance(t, str) for t in roles.values()):
        raise ConfigError(f"roles = {roles!r} is invalid: it maps some of {list(TOKEN_ROLES)} (eos required) to "
                          f"special tokens")
    for role in TOKEN_ROLES:
        if role in roles and roles[role] not in tokens:
            raise ConfigError(f"special_tokens = {tokens!r:.200} is invalid: it must include {roles[role]!r} "
                              f"(the {role} token)")
    return {role: roles[role] for role in TOKEN_ROLES if role in roles}


# The largest BPE vocabulary ``train_bpe`` accepts: 4× the largest published LLM vocabulary (Gemma 3's 262,144).
# The tokenizers library aborts the process (SIGABRT) on absurd sizes such as 10⁹ instead of raising.
MAX_BPE_VOCAB = 1 << 20


def min_bpe_vocab_size(special_tokens: Sequence[str] = SPECIAL_TOKENS) -> int:
    """The smallest vocabulary ``train_bpe`` accepts: 256 bytes + the specials + one merge."""
    return 256 + len(special_tokens) + 1


def train_bpe(
    texts: Iterable[str],
    vocab_size: int,
    *,
    min_frequency: int = 2,
    special_tokens: Sequence[str] = SPECIAL_TOKENS,
    max_token_length: int | None = None,
) -> BPETokenizer:
    """Learn byte-level BPE merges on ``texts`` until ``vocab_size`` ids exist (specials and 256 bytes included).

    On a small corpus the merges can run out first (no pair seen ``min_frequency`` times): the result's
    ``vocab_size`` is then smaller than asked. Deterministic for the same texts in the same order.
    """
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

    _check_specials(special_tokens)
    lowest = min_bpe_vocab_size(special_tokens)
    if (isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not
            lowest <= vocab_size <= MAX_BPE_VOCAB):
        raise ConfigError(
            f"BPE vocab_size = {vocab_size!r} is invalid: it must be an integer in [{lowest}, {MAX_BPE_VOCAB:,}] "
            f"(256 byte tokens + {len(special_tokens)} special tokens + at least one merge, up to 2^20)"
        )
    if isinstance(min_frequency, bool) or not isinstance(min_frequency, int) or min_frequency < 1:
        raise ConfigError(f"min_frequency = {min_frequency!r} is invalid: it must be a positive integer")
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        max_token_length=max_token_length,
        show_progress=False,
    )
    hf.train_from_iterator(_checked_texts(texts), trainer)
    return BPETokenizer(hf, special_tokens)


def _checked_texts(texts: Iterable[str]):
    for t in texts:
        _check_text(t)
        yield t


def load(path) -> Tokenizer:
    """Load either kind from ``path`` (a ``tokenizer.json`` file or the run directory holding it), with the roles
    and chat template it was saved with."""
    target = tokenizer_path(path)
    if not target.is_file():
        raise DataError(f"tokenizer file not found: {target} (save one with Tokenizer.save or train_bpe first)")
    obj = load_json(target, f"tokenizer file {target}", DataError)
    if isinstance(obj, dict) and obj.get("type") == _IDS_TYPE:
        return _load_ids(obj, target)
    if not (isinstance(obj, dict) and (obj.get("type") == _BYTE_TYPE or "model" in obj)):
        raise DataError(f"tokenizer file {target} is neither a byte tokenizer nor a Hugging Face tokenizer.json")
    byte = obj.get("type") == _BYTE_TYPE
    if byte:
        specials, extras = obj.get("special_tokens", list(SPECIAL_TOKENS)), obj
    else:
        added = obj.get("added_tokens", [])
        if not isinstance(added, list) or not all(isinstance(a, dict) and isinstance(a.get("content"), str)
                                                  for a in added):
            raise DataError(f"tokenizer file {target}: added_tokens must be a list of objects with a 'content' "
                            f"string")
        specials = [a["content"] for a in added if a.get("special")]
        extras = obj.pop(EXTRAS_KEY, None) or {}
        if not isinstance(extras, dict):
            raise DataError(f"tokenizer file {target}: its {EXTRAS_KEY!r} block must be an object, got "
                            f"{type(extras).__name__}")
        text = target.read_text(encoding="utf-8")
        if extras:  # the tokenizers library refuses keys it does not know
            text = json.dumps(obj, ensure_ascii=False)
    roles, chat_template = extras.get("roles"), extras.get("chat_template")
    if not (chat_template is None or isinstance(chat_template, str)) or not (roles is None or isinstance(roles, dict)):
        raise DataError(f"tokenizer file {target}: its roles must be an object and its chat_template a string, got "
                        f"{type(roles).__name__} and {type(chat_template).__name__}")
    try:
        _check_specials(specials, roles)
    except ConfigError as err:
        raise DataError(f"tokenizer file {target}: {err}") from None
    if byte:
        tok = ByteTokenizer(specials, roles=roles, chat_template=chat_template)
    else:
        from tokenizers import Tokenizer as HFTokenizer

        try:
            hf = HFTokenizer.from_str(text)
        except Exception as err:  # the Rust side raises its own exception type
            raise DataError(f"tokenizer file {target} could not be read by tokenizers: {err}") from None
        tok = BPETokenizer(hf, specials, roles=roles, chat_template=chat_template)
    tok.origin = str(target)
    return tok


def _load_ids(obj: dict, target: Path) -> IdTokenizer:
    try:
        tok = IdTokenizer(obj.get("vocab_size"))
    except ConfigError as err:
        raise DataError(f"tokenizer file {target}: {err}") from None
    tok.origin = str(target)
    return tok
