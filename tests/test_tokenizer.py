"""Tokenizers: exact round trips on any text, specials, save/load, fingerprints, validation."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_llm.data import tokenizer as T
from mlx_llm.errors import ConfigError, DataError, InputError

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n\tprint(i, 'hello world')\n",
    "The quick brown fox jumps over the lazy dog.\r\n" * 3,
    "日本語のテキスト、そして emoji 👩‍👩‍👧 and café / cafe\u0301.\n",
    "class Foo:\n    def __init__(self):\n        self.x = None  # comment\n",
] * 4

TRICKY = [
    "",
    " ",
    "   leading and trailing   ",
    "\n\n\t\r\n\x0b\x0c",
    "\x00NUL\x00 in text",
    "CJK 漢字 かな 한국어",
    "combining e\u0301 a\u0308\u0323 and ZWJ 👨‍👩‍👧‍👦 flags 🇫🇷",
    "\ufeffBOM and \u2028 line sep \u2029",
    "<|bos|><|user|>hi<|end|><|eos|>",
    "<|bos",
    "\U0010ffff max code point",
]


@pytest.fixture(scope="module")
def bpe():
    return T.train_bpe(CORPUS, 300)


@pytest.fixture(scope="module")
def byte():
    return T.ByteTokenizer()


@pytest.fixture(params=["bpe", "byte"])
def tok(request, bpe, byte):
    return bpe if request.param == "bpe" else byte


@pytest.mark.parametrize("text", TRICKY)
def test_round_trip_tricky_texts(tok, text):
    ids = tok.encode(text)
    assert ids.dtype == np.int32
    assert tok.decode(ids) == text


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_bpe_round_trip_any_text(bpe, text):
    assert bpe.decode(bpe.encode(text)) == text


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_byte_round_trip_any_text(byte, text):
    ids = byte.encode(text)
    assert ids.tolist() == list(text.encode("utf-8"))
    assert byte.decode(ids) == text


@settings(max_examples=50, deadline=None)
@given(st.lists(st.text(), max_size=6))
def test_encode_batch_equals_encode(bpe, texts):
    assert [a.tolist() for a in bpe.encode_batch(texts)] == [bpe.encode(t).tolist() for t in texts]


def test_bpe_learns_merges_and_compresses(bpe):
    text = "def add(a, b):\n    return a + b\n"
    assert bpe.vocab_size == 300
    ids = bpe.encode(text)
    assert len(ids) < 0.85 * len(text.encode("utf-8"))  # 37 merges learned on CORPUS already pay off
    assert max(len(bpe.decode([i])) for i in ids.tolist()) >= 3


def test_special_ids_and_layout(bpe, byte):
    assert byte.vocab_size == 256 + len(T.SPECIAL_TOKENS)
    assert byte.special_ids == {t: 256 + k for k, t in enumerate(T.SPECIAL_TOKENS)}
    assert (byte.bos_id, byte.eos_id, byte.pad_id) == (256, 257, 258)
    assert set(bpe.special_ids) == set(T.SPECIAL_TOKENS)
    assert len(set(bpe.special_ids.values())) == len(T.SPECIAL_TOKENS)
    assert bpe.bos_id == bpe.special_ids["<|bos|>"] and bpe.pad_id == bpe.special_ids["<|pad|>"]


def test_marker_strings_are_text_unless_parsed(tok):
    text = "<|user|>hi<|end|>"
    plain = tok.encode(text)
    assert not set(plain.tolist()) & set(tok.special_ids.values())
    parsed = tok.encode(text, parse_special=True)
    ids = tok.special_ids
    assert parsed[0] == ids["<|user|>"] and parsed[-1] == ids["<|end|>"]
    assert parsed[1:-1].tolist() == tok.encode("hi").tolist()
    assert tok.decode(parsed) == text
    assert tok.decode(parsed, skip_special=True) == "hi"


def test_token_byte_lengths_sum_to_utf8_size(tok):
    text = "naïve 日本 👩‍👩‍👧 code:\n\tx = 1\n"
    ids = tok.encode("<|bos|>" + text + "<|eos|>", parse_special=True)
    lengths = tok.token_byte_lengths()
    assert lengths.shape == (tok.vocab_size,)
    assert int(lengths[ids].sum()) == len(text.encode("utf-8"))
    assert all(lengths[i] == 0 for i in tok.special_ids.values())


def test_save_load_round_trip(tmp_path, tok):
    written = tok.save(tmp_path / "run")
    assert written == tmp_path / "run" / "tokenizer.json"
    again = T.load(tmp_path / "run")
    assert type(again) is type(tok)
    assert again.fingerprint() == tok.fingerprint()
    assert again.special_ids == tok.special_ids and again.vocab_size == tok.vocab_size
    text = "x = '<|eos|>'  # 日本\n"
    assert again.encode(text).tolist() == tok.encode(text).tolist()
    assert T.load(written).fingerprint() == tok.fingerprint()
    assert not list((tmp_path / "run").glob("*.tmp"))


def test_fingerprints_differ_between_tokenizers(bpe, byte):
    other = T.train_bpe(CORPUS, 280)
    assert len({bpe.fingerprint(), byte.fingerprint(), other.fingerprint()}) == 3
    assert T.train_bpe(CORPUS, 300).fingerprint() == bpe.fingerprint()  # training is deterministic
    assert len(bpe.fingerprint()) == 64


def test_byte_tokenizer_file_has_type(tmp_path, byte):
    obj = json.loads(byte.save(tmp_path / "b.json").read_text())
    assert obj["type"] == "mlx_llm.byte" and obj["special_tokens"] == list(T.SPECIAL_TOKENS)


@pytest.mark.parametrize("vocab_size", [0, 263, 100, 300.0, True, "512", 2**20 + 1, 10**9])
def test_train_bpe_rejects_bad_vocab(vocab_size):
    """Too small, not an integer, or absurdly large (the tokenizers library aborts the process on 10⁹)."""
    with pytest.raises(ConfigError, match=r"vocab_size = .* must be an integer in \[264, 1,048,576\]"):
        T.train_bpe(CORPUS, vocab_size)


def test_min_vocab_is_accepted():
    tok = T.train_bpe(CORPUS, 264)
    assert tok.vocab_size == 264 == T.min_bpe_vocab_size()


def test_specials_must_include_bos_eos_pad():
    with pytest.raises(ConfigError, match="must include '<\\|pad\\|>'"):
        T.ByteTokenizer(("<|bos|>", "<|eos|>"))
    with pytest.raises(ConfigError, match="distinct"):
        T.ByteTokenizer(("<|bos|>", "<|eos|>", "<|pad|>", "<|eos|>"))


def test_decode_rejects_out_of_range_ids(tok):
    with pytest.raises(InputError, match=rf"token id {tok.vocab_size} is out of range: valid ids are 0..{tok.vocab_size - 1}"):
        tok.decode([1, tok.vocab_size])
    with pytest.raises(InputError, match="token id -1"):
        tok.decode([-1])


def test_encode_rejects_lone_surrogate_and_non_str(tok):
    with pytest.raises(InputError, match="not encodable as UTF-8"):
        tok.encode("a\ud800b")
    with pytest.raises(InputError, match="must be a str, got bytes"):
        tok.encode(b"abc")


def test_load_errors(tmp_path):
    with pytest.raises(DataError, match="tokenizer file not found: .*nowhere/tokenizer.json"):
        T.load(tmp_path / "nowhere")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DataError, match="is not valid JSON"):
        T.load(bad)
    bad.write_text('{"hello": 1}')
    with pytest.raises(DataError, match="neither a byte tokenizer nor a Hugging Face"):
        T.load(bad)
    bad.write_text('{"type": "mlx_llm.byte", "special_tokens": ["<|bos|>"]}')
    with pytest.raises(DataError, match="must include '<\\|eos\\|>'"):
        T.load(bad)


# ----- roles and chat templates --------------------------------------------------------------------------------
def test_our_roles_and_unchanged_files(bpe, byte):
    for tok in (bpe, byte):
        assert tok.roles == {"bos": "<|bos|>", "eos": "<|eos|>", "pad": "<|pad|>"} and tok.chat_template is None
        assert tok.bos_prefix.tolist() == [tok.bos_id] and tok.bos_prefix.dtype == np.int32
    assert bpe.to_json() == bpe.hf.to_str(pretty=False)  # our tokenizers' files (and fingerprints) are as before
    assert json.loads(byte.to_json()) == {"type": "mlx_llm.byte", "version": 1,
                                          "special_tokens": list(T.SPECIAL_TOKENS)}


def test_other_roles_are_saved_and_fingerprinted(tmp_path, tok):
    kind = type(tok)
    specials = list(tok.special_tokens)
    roles = {"eos": "<|end|>", "pad": "<|eos|>"}
    other = (T.ByteTokenizer(specials, roles=roles, chat_template="{{ x }}") if kind is T.ByteTokenizer
             else T.BPETokenizer(tok.hf, specials, roles=roles, chat_template="{{ x }}"))
    assert other.bos_id is None and other.bos_prefix.tolist() == []
    assert (other.eos_id, other.pad_id) == (tok.token_id("<|end|>"), tok.token_id("<|eos|>"))
    no_pad = other.with_chat_template(None)
    no_pad.roles = {"eos": "<|end|>"}
    assert no_pad.pad_id == other.eos_id  # no PAD: padding uses EOS
    back = T.load(other.save(tmp_path / "run"))
    assert type(back) is kind and back.roles == {"eos": "<|end|>", "pad": "<|eos|>"} and back.chat_template == "{{ x }}"
    assert back.fingerprint() == other.fingerprint()
    fingerprints = {tok.fingerprint(), other.fingerprint(), other.with_chat_template("{{ y }}").fingerprint(),
                    other.with_chat_template(None).fingerprint()}
    assert len(fingerprints) == 4
    assert back.encode("hi <|end|>").tolist() == tok.encode("hi <|end|>").tolist()
    assert tok.chat_template is None and T.load(tok.save(tmp_path / "plain")).fingerprint() == tok.fingerprint()


def test_roles_must_name_special_tokens():
    with pytest.raises(ConfigError, match=r"must include '<\|bos\|>' \(the bos token\)"):
        T.ByteTokenizer(("<|eos|>", "<|pad|>"))
    with pytest.raises(ConfigError, match=r"roles = \{'bos': '<\|bos\|>'\} is invalid: .*eos required"):
        T.ByteTokenizer(roles={"bos": "<|bos|>"})
    with pytest.raises(ConfigError, match=r"roles = .* is invalid"):
        T.ByteTokenizer(roles={"eos": "<|eos|>", "unk": "<|pad|>"})
    with pytest.raises(ConfigError, match=r"chat_template must be a Jinja source string"):
        T.ByteTokenizer().with_chat_template(3)


def test_load_refuses_bad_roles(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"type": "mlx_llm.byte", "special_tokens": ["<|e|>"], "roles": {"eos": "<|x|>"}}))
    with pytest.raises(DataError, match=r"bad.json: special_tokens = .* must include '<\|x\|>' \(the eos token\)"):
        T.load(bad)
    bad.write_text(json.dumps({"type": "mlx_llm.byte", "special_tokens": ["<|e|>"], "roles": ["<|e|>"]}))
    with pytest.raises(DataError, match=r"its roles must be an object and its chat_template a string"):
        T.load(bad)


@pytest.mark.parametrize("text", ["", "hello world", "naïve 日本 👩‍👩‍👧", "<|eos|> stays text", "  \n\t x"])
def test_encode_offsets(tok, text):
    ids, spans = tok.encode_offsets(text)
    assert ids.tolist() == tok.encode(text).tolist() and spans.shape == (len(ids), 2)
    assert spans.dtype == np.int64 and np.all(spans[:, 0] < spans[:, 1]) and np.all(np.diff(spans[:, 0]) >= 0)
    if text:
        assert spans[0, 0] == 0 and spans[-1, 1] == len(text)
    for i, (s, e) in zip(ids.tolist(), spans.tolist()):  # each id spells (part of) its own span's characters
        piece = tok.decode([i])
        assert piece.replace("\ufffd", "") in text[s:e]
