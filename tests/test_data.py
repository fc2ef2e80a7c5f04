"""Data pipeline: corpus discovery and errors, split, memmap cache, packing, batches, bits-per-byte, baseline."""

import math

import numpy as np
import pytest

from mlx_llm.data import text as text_lib
from mlx_llm.data import encoding as encoding_lib
from mlx_llm.data import packing as packing_lib
from mlx_llm.data import tokenizer as T
from mlx_llm.errors import ConfigError, DataError, InputError

BYTE = T.ByteTokenizer()
B_, E_, P_ = BYTE.bos_id, BYTE.eos_id, BYTE.pad_id


def write(root, files):
    for name, content in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    return root


def ids(text):
    return list(text.encode("utf-8"))


@pytest.fixture
def tree(tmp_path):
    """20 small files (some skipped) in a directory, plus a dot-directory that must be ignored."""
    files = {f"pkg/mod_{k:02d}.py": f"# module {k}\nx_{k} = {k} * 'é'\n" * (k + 1) for k in range(20)}
    files.update({"notes.md": "# Notes\nsome text\n", "data.bin": b"\x00\x01", "empty.txt": "", "blank.py": " \n\t\n"})
    files.update({".venv/lib/site.py": "hidden = True\n", "latin1.txt": "caf\xe9".encode("latin-1")})
    return write(tmp_path / "corpus", files)


# ----- discovery and errors -------------------------------------------------------------------------
def test_directory_walk_extensions_and_skips(tree):
    text = text_lib.read_corpus(tree, val_percent=20)
    names = sorted(d.name for d in text.train + text.val)
    assert names == sorted([f"pkg/mod_{k:02d}.py" for k in range(20)] + ["notes.md"])
    s = text.stats
    assert (s.n_files, s.n_documents) == (24, 21)
    assert s.empty_files == ["blank.py", "empty.txt"] and s.non_utf8_files == ["latin1.txt"]
    assert s.n_bytes == sum(len(d.text.encode()) for d in text.train + text.val)
    assert "skipped 2 empty, 1 not UTF-8" in s.describe()


def test_extensions_are_configurable(tree):
    text = text_lib.read_corpus(tree, extensions=["md"], val_percent=20)
    assert [d.name for d in text.train + text.val] == ["notes.md[train]"] + ["notes.md[val]"]


def test_non_utf8_policies(tmp_path):
    root = write(tmp_path, {"a.txt": "line one\n" * 10, "b.txt": b"caf\xe9 au lait\n" * 10})
    with pytest.raises(DataError, match=r"b.txt is not valid UTF-8 \(byte 0xe9 at offset 3\)"):
        text_lib.read_corpus(root, on_decode_error="error")
    replaced = text_lib.read_corpus(root, on_decode_error="replace", val_percent=50)
    docs = {d.name: d.text for d in replaced.train + replaced.val}
    assert docs["b.txt"] == "caf\ufffd au lait\n" * 10
    with pytest.raises(ConfigError, match="on_decode_error = 'ignore' is invalid"):
        text_lib.read_corpus(root, on_decode_error="ignore")


def test_error_missing_path(tmp_path):
    with pytest.raises(DataError, match=f"data path not found: {tmp_path}/nope.txt"):
        text_lib.read_corpus(tmp_path / "nope.txt")


def test_error_empty_directory(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(DataError, match=r"empty corpus: searched files ending in \.md, \.py, \.txt under .*/d; found 0 files"):
        text_lib.read_corpus(tmp_path / "d")


def test_error_only_empty_and_non_utf8_files(tmp_path):
    root = write(tmp_path / "d", {"a.py": "", "b.txt": "\n\n", "c.txt": b"\xff\xfe"})
    with pytest.raises(DataError, match="found 3 files, 2 empty, 1 not UTF-8 \\(skipped\\)"):
        text_lib.read_corpus(root)


def test_error_glob_matching_nothing(tmp_path):
    with pytest.raises(DataError, match=r"empty corpus: searched the glob '.*/\*\.zzz'; found 0 files"):
        text_lib.read_corpus(str(tmp_path / "*.zzz"))


def test_glob_takes_matched_files(tree):
    text = text_lib.read_corpus(str(tree / "pkg" / "mod_1*.py"), val_percent=20)
    names = sorted(d.name.rsplit("/", 1)[-1] for d in text.train + text.val)
    assert names == [f"mod_{k}.py" for k in range(10, 20)]


def test_invalid_val_percent(tree):
    for bad in (0, 100, -1, "5", True):
        with pytest.raises(ConfigError, match=r"val_percent = .* must be a number in \(0, 100\)"):
            text_lib.read_corpus(tree, val_percent=bad)


# ----- split --------------------------------------------------------------------------------------
def test_split_by_file_is_deterministic_and_stable():
    docs = [text_lib.Document(f"dir/file_{k}.py", "x\n") for k in range(2000)]
    train, val = text_lib.split_documents(docs, 5.0)
    assert len(train) + len(val) == 2000 and 70 <= len(val) <= 130  # ≈ 5 % of files
    assert {d.name for d in val} == {d.name for d in docs if text_lib.val_score(d.name) < 5.0}
    shuffled = list(reversed(docs))[:1000]  # order and company do not matter: the name decides
    _, val2 = text_lib.split_documents(shuffled, 5.0)
    assert {d.name for d in val2} == {d.name for d in val} & {d.name for d in shuffled}


def test_split_fallbacks_keep_both_sides_non_empty():
    docs = [text_lib.Document(n, "x\n") for n in ("a.py", "b.py")]
    train, val = text_lib.split_documents(docs, 0.01)
    assert len(train) == 1 and len(val) == 1
    assert val[0].name == min(("a.py", "b.py"), key=text_lib.val_score)
    train, val = text_lib.split_documents(docs, 99.99)
    assert len(train) == 1 and len(val) == 1


def test_single_document_split_at_line_boundary(tmp_path):
    lines = [f"line {k:03d}\n" for k in range(100)]
    write(tmp_path, {"book.txt": "".join(lines)})
    text = text_lib.read_corpus(tmp_path / "book.txt", val_percent=10)
    assert [d.name for d in text.train] == ["book.txt[train]"] and [d.name for d in text.val] == ["book.txt[val]"]
    assert text.val[0].text == "".join(lines[90:]) and text.train[0].text == "".join(lines[:90])
    write(tmp_path, {"tiny.txt": "x"})
    with pytest.raises(DataError, match="one document \\(tiny.txt, 1 characters\\) too short to split"):
        text_lib.read_corpus(tmp_path / "tiny.txt")


def test_stdlib_default_corpus():
    files, where = text_lib.find_files(None)
    names = [n for n, _ in files]
    assert names == sorted(names) and len(names) > 300 and "os.py" in names
    assert not [n for n in names if set(n.split("/")) & {"test", "tests", "idle_test", "site-packages"}]
    text = text_lib.read_corpus(None)
    assert sum(len(d.text.encode()) for d in text.val) >= 300_000
    assert text.fingerprint() == text_lib.read_corpus(None).fingerprint()


# ----- encoding, cache ----------------------------------------------------------------------------
THREE_DOCS = {"a.txt": "ab", "b.txt": "c", "c.txt": "de"}


def three_doc_corpus():
    docs = [text_lib.Document(n, t) for n, t in THREE_DOCS.items()]
    return text_lib.TextCorpus(docs, [text_lib.Document("v.txt", "vé")], text_lib.CorpusStats("hand-made"))


def test_stream_layout_and_doc_starts(tmp_path):
    corpus = encoding_lib.encode_corpus(three_doc_corpus(), BYTE, tmp_path)
    a, b, c, d, e = ids("abcde")
    assert corpus.train.tokens.tolist() == [B_, a, b, E_, B_, c, E_, B_, d, e, E_]
    assert corpus.train.doc_starts.tolist() == [0, 4, 7]
    assert corpus.val.tokens.tolist() == [B_, *ids("vé"), E_]
    assert isinstance(corpus.train.tokens, np.memmap) and corpus.train.tokens.dtype == np.uint16


def test_token_dtype():
    assert encoding_lib.token_dtype(65536) == np.uint16 and encoding_lib.token_dtype(65537) == np.uint32


def test_cache_reused_and_invalidated(tmp_path, tree):
    cache = tmp_path / "cache"
    text = text_lib.read_corpus(tree, val_percent=20)
    first = encoding_lib.encode_corpus(text, BYTE, cache)
    assert not first.cache_hit and first.encode_seconds > 0

    class NoEncode(T.ByteTokenizer):
        def encode_batch(self, texts):
            raise AssertionError("a cache hit must not encode")

    second = encoding_lib.encode_corpus(text, NoEncode(), cache)  # same fingerprint: same serialised tokenizer
    assert second.cache_hit and second.cache_path == first.cache_path and second.encode_seconds == 0
    assert np.array_equal(second.train.tokens, first.train.tokens)
    bpe = T.train_bpe([d.text for d in text.train], 280)
    third = encoding_lib.encode_corpus(text, bpe, cache)
    assert not third.cache_hit and third.cache_path != first.cache_path
    assert bpe.decode(np.asarray(third.val.tokens)) == "".join(f"<|bos|>{d.text}<|eos|>" for d in text.val)
    write(tree, {"pkg/mod_00.py": "changed = 1\n"})
    fourth = encoding_lib.load_corpus(BYTE, tree, cache_dir=cache, val_percent=20)
    assert not fourth.cache_hit and fourth.cache_path not in (first.cache_path, third.cache_path)
    assert sorted(p.name for p in cache.iterdir() if ".tmp-" in p.name) == []
    assert len(list(cache.iterdir())) == 3


def test_corrupt_cache_entry_is_rebuilt(tmp_path):
    first = encoding_lib.encode_corpus(three_doc_corpus(), BYTE, tmp_path)
    (first.cache_path / "meta.json").write_text("{broken")
    again = encoding_lib.encode_corpus(three_doc_corpus(), BYTE, tmp_path)
    assert not again.cache_hit and again.train.tokens.tolist() == first.train.tokens.tolist()


# ----- packing ------------------------------------------------------------------------------------
def test_pack_three_documents_by_hand():
    a, b, c, d, e = ids("abcde")
    stream = [B_, a, b, E_, B_, c, E_, B_, d, e, E_]
    out = packing_lib.pack_windows(np.array([stream]), B_, P_)
    assert out["tokens"].tolist() == [[B_, a, b, E_, B_, c, E_, B_, d, e]]
    assert out["targets"].tolist() == [[a, b, E_, B_, c, E_, B_, d, e, E_]]
    assert out["segment_ids"].tolist() == [[0, 0, 0, 0, 1, 1, 1, 2, 2, 2]]
    assert out["positions"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1, 2]]
    assert out["mask"].tolist() == [[1, 1, 1, 0, 1, 1, 0, 1, 1, 1]]  # EOS is a target, the next BOS is not
    assert out["mask"].dtype == np.float32 and out["tokens"].dtype == np.int32


def test_pack_window_starting_mid_document_and_padding():
    a, b, c, d, e = ids("abcde")
    out = packing_lib.pack_windows(np.array([[b, E_, B_, c, E_, B_, d], [d, e, E_, P_, P_, P_, P_]]), B_, P_)
    assert out["segment_ids"].tolist() == [[0, 0, 1, 1, 1, 2], [0, 0, 0, 1, 1, 1]]
    assert out["positions"].tolist() == [[0, 1, 0, 1, 2, 0], [0, 1, 2, 0, 1, 2]]
    assert out["mask"].tolist() == [[1, 0, 1, 1, 0, 1], [1, 1, 0, 0, 0, 0]]


# ----- batches ------------------------------------------------------------------------------------
@pytest.fixture
def tree_corpus(tmp_path, tree):
    return encoding_lib.load_corpus(BYTE, tree, cache_dir=tmp_path / "cache", val_percent=20)


def test_train_batch_is_a_function_of_seed_and_step(tree_corpus, tmp_path, tree):
    kw = dict(batch_size=4, seq_len=16, seed=7)
    b1 = tree_corpus.train_batch(3, **kw)
    reloaded = encoding_lib.load_corpus(BYTE, tree, cache_dir=tmp_path / "cache", val_percent=20)
    assert reloaded.cache_hit
    b2 = reloaded.train_batch(3, **kw)
    assert all(np.array_equal(b1[k], b2[k]) for k in b1)
    assert not np.array_equal(b1["tokens"], tree_corpus.train_batch(4, **kw)["tokens"])
    assert not np.array_equal(b1["tokens"], tree_corpus.train_batch(3, batch_size=4, seq_len=16, seed=8)["tokens"])
    starts = packing_lib.window_starts(tree_corpus.train.n_tokens, 3, **kw)
    stream = np.asarray(tree_corpus.train.tokens)
    for row, s in enumerate(starts.tolist()):
        assert b1["tokens"][row].tolist() == stream[s : s + 16].tolist()
        assert b1["targets"][row].tolist() == stream[s + 1 : s + 17].tolist()
    assert {k: v.shape for k, v in b1.items()} == {k: (4, 16) for k in b1}


def test_train_batch_argument_errors(tree_corpus):
    n = tree_corpus.train.n_tokens
    with pytest.raises(ConfigError, match=f"seq_len = {n} is too long for a train split of {n} tokens: it must be ≤ {n - 1}"):
        tree_corpus.train_batch(0, batch_size=1, seq_len=n, seed=0)
    with pytest.raises(ConfigError, match="step = -1 is invalid"):
        tree_corpus.train_batch(-1, batch_size=1, seq_len=4, seed=0)
    with pytest.raises(ConfigError, match="batch_size = 0 is invalid"):
        tree_corpus.train_batch(0, batch_size=0, seq_len=4, seed=0)


@pytest.mark.parametrize("seq_len, batch_size", [(8, 3), (5, 1), (64, 2)])
def test_val_batches_cover_the_split_once(seq_len, batch_size, tmp_path):
    bpe = T.train_bpe(["naïve café 日本語 code = 1\n" * 5, "def f(x):\n    return x\n"], 280)
    text = text_lib.TextCorpus(
        [text_lib.Document("t", "naïve café 日本語 code = 1\n")],
        [text_lib.Document(f"v{k}", f"naïve {k} café 日本語 👩‍👩‍👧\n" * (k + 1)) for k in range(4)],
        text_lib.CorpusStats("hand-made"),
    )
    corpus = encoding_lib.encode_corpus(text, bpe, tmp_path)
    vs = corpus.val_batches(seq_len, batch_size)
    assert vs.n_bytes == sum(len(d.text.encode("utf-8")) for d in text.val)
    assert sum(vs.bytes_per_batch) == vs.n_bytes
    stream = np.asarray(corpus.val.tokens)
    targets = np.concatenate([b["targets"].ravel() for b in vs.batches])
    kept = np.concatenate([(b["targets"] != bpe.pad_id).ravel() for b in vs.batches])
    assert targets[kept].tolist() == stream[1:].tolist()  # every token after the first is a target once
    assert vs.n_targets == int((stream[1:] != bpe.bos_id).sum())
    assert all(b["tokens"].shape == (batch_size, seq_len) for b in vs.batches)


def test_val_batches_max_tokens(tmp_path):
    corpus = encoding_lib.encode_corpus(three_doc_corpus(), BYTE, tmp_path)
    vs = corpus.val_batches(2, 2, max_tokens=2)  # val = BOS v é(2 bytes) EOS: targets v, é₁
    assert [b["targets"].tolist() for b in vs.batches] == [[[*ids("vé")[:2]], [P_, P_]]]
    assert (vs.n_targets, vs.n_bytes) == (2, 2)
    full = corpus.val_batches(2, 2)
    assert (full.n_targets, full.n_bytes) == (4, 3)  # v, é₁, é₂, EOS; EOS adds no byte


def test_bits_per_byte_byte_count_on_known_text(tmp_path):
    text = text_lib.TextCorpus([text_lib.Document("t", "abc")], [text_lib.Document("v", "héllo, wörld ✓\n")], text_lib.CorpusStats("x"))
    vs = encoding_lib.encode_corpus(text, BYTE, tmp_path).val_batches(4, 2)
    assert vs.n_bytes == len("héllo, wörld ✓\n".encode()) == 19


# ----- unigram baseline ---------------------------------------------------------------------------
def test_unigram_bits_per_byte_by_hand():
    # V = 3, train counts (2, 1, 0) → p = (3, 2, 1) / 6; val 0, 2 → bits = log2 2 + log2 6 over 2 bytes
    got = packing_lib.unigram_bits_per_byte([0, 0, 1], [0, 2], 3, 2)
    assert got == pytest.approx((1 + math.log2(6)) / 2, rel=1e-12)
    assert got == pytest.approx(1.7924812503605781, rel=1e-12)


def test_unigram_errors():
    with pytest.raises(InputError, match=r"val_ids holds ids outside 0..2 \(min 0, max 3\)"):
        packing_lib.unigram_bits_per_byte([0], [0, 3], 3, 1)
    with pytest.raises(DataError, match="val_ids is empty"):
        packing_lib.unigram_bits_per_byte([0], [], 3, 1)
    with pytest.raises(ConfigError, match="val_bytes = 0 is invalid"):
        packing_lib.unigram_bits_per_byte([0], [0], 3, 0)


def test_corpus_unigram_baseline_matches_function(tmp_path):
    corpus = encoding_lib.encode_corpus(three_doc_corpus(), BYTE, tmp_path)
    train = [t for t in ids("abcde")] + [E_] * 3
    val = [*ids("vé"), E_]
    expected = packing_lib.unigram_bits_per_byte(train, val, BYTE.vocab_size, 3)
    assert corpus.unigram_bits_per_byte() == pytest.approx(expected, rel=1e-12)
    # by hand: N = 8, V = 263; 'v' and both bytes of 'é' unseen → 1/271; EOS seen 3 times → 4/271
    assert expected == pytest.approx((3 * math.log2(271) + math.log2(271 / 4)) / 3, rel=1e-12)


@pytest.mark.slow
def test_whole_stdlib_byte_stream(tmp_path):
    corpus = encoding_lib.load_corpus(BYTE, cache_dir=tmp_path)
    val_text = text_lib.read_corpus(None).val
    assert corpus.val_batches(256, 8).n_bytes == sum(len(d.text.encode()) for d in val_text)
    assert corpus.train.n_tokens > 5_000_000
    assert 3.0 < corpus.unigram_bits_per_byte() < 8.0  # a byte unigram beats 8 bits, but not by much


def test_named_pipes_in_a_data_directory_are_skipped_and_named(tmp_path):
    """A FIFO would block ``read_bytes`` forever: only regular files are read, and what was skipped is counted."""
    import os

    (tmp_path / "a.py").write_text("x = 1\n" * 20)
    os.mkfifo(tmp_path / "pipe.py")
    corpus = text_lib.read_corpus(tmp_path, val_percent=50.0)
    assert {d.name.split("[")[0] for d in corpus.train + corpus.val} == {"a.py"}
    assert corpus.stats.not_regular_files == ["pipe.py"] and "1 not regular files" in corpus.stats.describe()
    with pytest.raises(DataError, match="not a regular file"):
        text_lib.read_corpus(tmp_path / "pipe.py")
