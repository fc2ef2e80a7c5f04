"""A run's data, whatever ``--data`` names: text (data/text.py, data/encoding.py), token ids (data/tokens.py) or a
weighted mixture of either (data/mixture.py). ``open_data`` returns the tokenizer at once and the corpus
later, so a run checks its configs against the tokenizer before it spends time encoding."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Callable

import numpy as np

from mlx_llm.errors import ConfigError
from mlx_llm.data.hf_tokenizer import from_hf
from mlx_llm.data import text as text_lib
from mlx_llm.data import encoding as encoding_lib
from mlx_llm.data import packing as packing_lib
from mlx_llm.data import tokenizer as tok_lib
from mlx_llm.data.mixture import MixtureCorpus
from mlx_llm.data.tokens import is_token_source, read_token_source


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
