"""Our tokenizers ↔ a transformers tokenizer directory (``tokenizer.json`` + ``tokenizer_config.json``).

- BPE runs already hold a Hugging Face ``tokenizers`` file; it is written as it is.
- A byte tokenizer (ids 0..255 = UTF-8 bytes, specials from 256) becomes a ``tokenizers`` BPE model with no
  merges over GPT-2's byte-to-character alphabet: the byte-level pre-tokenizer spells each byte as one character
  and the vocabulary maps the character of byte b to id b, so every byte is its own token with its own id.
- Both get a post-processor that puts ``<|bos|>`` first (our runs train on documents that start with BOS and
  prompt with it), so ``tokenizer(text)["input_ids"]`` = [bos] + our ``encode(text)``; with
  ``add_special_tokens=False`` the ids are exactly ours. transformers parses special-token strings in text (our
  ``encode(text, parse_special=True)``); our plain ``encode`` spells them.

Import reverses this: the BOS post-processor is dropped and a merge-free byte alphabet becomes a
``ByteTokenizer`` again, so an exported run's tokenizer comes back with the same fingerprint.
"""

from __future__ import annotations

import json
from pathlib import Path

from mlx_llm.errors import DataError
from mlx_llm.train import tokenizer as tok_lib

TOKENIZER_FILE, TOKENIZER_CONFIG_FILE = "tokenizer.json", "tokenizer_config.json"


def byte_chars() -> list[str]:
    """GPT-2's byte → printable character table (the ``tokenizers`` ByteLevel alphabet), indexed by byte:
    printable Latin-1 bytes stand for themselves, the other 68 map to U+0100 onwards in byte order."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    chars, shifted = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + shifted))
            shifted += 1
    return chars


def _byte_level_json(tok: tok_lib.ByteTokenizer) -> dict:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: b for b, c in enumerate(byte_chars())}
    hf = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(list(tok.special_tokens))
    return json.loads(hf.to_str())


def _bos_processor(tok: tok_lib.Tokenizer) -> dict:
    bos = tok_lib.BOS
    return {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [tok.bos_id], "tokens": [bos]}}}


def tokenizer_json(tok: tok_lib.Tokenizer) -> dict:
    """The ``tokenizers`` JSON of ``tok`` with the BOS post-processor."""
    obj = _byte_level_json(tok) if isinstance(tok, tok_lib.ByteTokenizer) else json.loads(tok.to_json())
    return {**obj, "post_processor": _bos_processor(tok)}


def tokenizer_config(tok: tok_lib.Tokenizer, max_len: int) -> dict:
    """``tokenizer_config.json``: load ``tokenizer.json`` as it is (``PreTrainedTokenizerFast``), name the
    specials, add BOS (as the post-processor does)."""
    others = [t for t in tok.special_tokens if t not in (tok_lib.BOS, tok_lib.EOS, tok_lib.PAD)]
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tok_lib.BOS, "eos_token": tok_lib.EOS,
            "pad_token": tok_lib.PAD, "extra_special_tokens": others, "add_bos_token": True,
            "add_eos_token": False, "model_max_length": max_len, "clean_up_tokenization_spaces": False}


def special_ids(tok: tok_lib.Tokenizer) -> dict[str, int]:
    return {"bos": tok.bos_id, "eos": tok.eos_id, "pad": tok.pad_id}


# ----- import -------------------------------------------------------------------------------------------------
def _specials(obj: dict) -> list[str]:
    added = sorted((t for t in obj.get("added_tokens", []) if t.get("special")), key=lambda t: t["id"])
    return [t["content"] for t in added]


def _is_byte_alphabet(obj: dict, specials: list[str]) -> bool:
    model = obj.get("model") or {}
    ids = sorted(t["id"] for t in obj.get("added_tokens", []) if t.get("special"))
    return (model.get("type") == "BPE" and not model.get("merges")
            and model.get("vocab") == {c: b for b, c in enumerate(byte_chars())}
            and ids == list(range(256, 256 + len(specials))) and len(obj.get("added_tokens", [])) == len(specials))


def from_hf(hf_dir: Path) -> tok_lib.Tokenizer:
    """Our tokenizer from ``hf_dir/tokenizer.json`` (see the module docstring); it must hold mlx_llm's special
    tokens (BOS, EOS, PAD) under their names."""
    path = Path(hf_dir) / TOKENIZER_FILE
    if not path.is_file():
        raise DataError(f"{hf_dir} has no {TOKENIZER_FILE}: an imported run needs the tokenizer that matches its "
                        f"embedding (a transformers 'fast' tokenizer file)")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{path} cannot be read as JSON: {exc}") from None
    specials = _specials(obj)
    missing = [t for t in (tok_lib.BOS, tok_lib.EOS, tok_lib.PAD) if t not in specials]
    if missing:
        raise DataError(f"{path}: the tokenizer lacks mlx_llm's special tokens {missing} (its specials are "
                        f"{specials[:8]}); mlx_llm runs need {[tok_lib.BOS, tok_lib.EOS, tok_lib.PAD]}")
    if _is_byte_alphabet(obj, specials):
        return tok_lib.ByteTokenizer(specials)
    if obj.get("post_processor") == _bos_processor(_Ids(obj)):
        obj["post_processor"] = None
    from tokenizers import Tokenizer

    try:
        hf = Tokenizer.from_str(json.dumps(obj))
    except Exception as exc:  # the Rust side raises its own exception type
        raise DataError(f"{path} could not be read by tokenizers: {exc}") from None
    return tok_lib.BPETokenizer(hf, specials)


class _Ids:
    """Just enough of a tokenizer for ``_bos_processor``: the id of BOS in a tokenizer JSON."""

    def __init__(self, obj: dict):
        self.bos_id = next(t["id"] for t in obj["added_tokens"] if t["content"] == tok_lib.BOS)
