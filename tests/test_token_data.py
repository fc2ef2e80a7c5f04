"""Pre-tokenized token streams as --data (issue 25): .npy, nanoGPT raw uint16 .bin and llm.c header .bin shards,
read as memmaps; batches hold exactly the shards' ids; a run over ids has an IdTokenizer (no text sample, no
bits per byte, generate takes and prints ids); bad shards and ids >= vocab are refused in one line."""

import json
import os

import numpy as np
import pytest

from mlx_llm.errors import ConfigError, DataError, InputError
from mlx_llm.data import tokenizer as tok_lib
from mlx_llm.data.corpora import token_corpus
from mlx_llm.data.packing import window_starts
from mlx_llm.data.tokens import (LLMC_MAGIC, TokenStream, find_token_files, is_token_source, is_val_name,
                                 read_token_source)
from helpers import cli_in_process, snapshot

V = 97


def write_raw(path, ids):
    np.asarray(ids, "<u2").tofile(path)
    return path


def write_llmc(path, ids, version=1):
    header = np.zeros(256, "<i4")
    header[:3] = (LLMC_MAGIC, version, len(ids))
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(ids, "<u2" if version == 1 else "<u4").tobytes())
    return path


def ids_of(n, seed):
    return np.random.default_rng(seed).integers(0, V, n)


@pytest.fixture
def shards(tmp_path):
    """Two train shards in two layouts and a val shard: (glob, train ids concatenated, val ids)."""
    a, b, v = ids_of(3000, 1), ids_of(2000, 2), ids_of(700, 3)
    write_llmc(tmp_path / "web_train_000001.bin", a)
    write_raw(tmp_path / "web_train_000002.bin", b)
    write_llmc(tmp_path / "web_val_000000.bin", v, version=2)
    return str(tmp_path / "web_*.bin"), np.concatenate([a, b]), v


def test_each_layout_reads_back_its_ids(tmp_path):
    ids = ids_of(1000, 0)
    paths = [write_raw(tmp_path / "raw.bin", ids), write_llmc(tmp_path / "v1.bin", ids),
             write_llmc(tmp_path / "v2.bin", ids, version=2), tmp_path / "ids.npy"]
    np.save(paths[3], ids.astype(np.int32))
    layouts = []
    for p in paths:
        (f,) = find_token_files(p)
        np.testing.assert_array_equal(np.asarray(f.open()), ids)
        layouts.append(f.layout)
    assert layouts == ["raw uint16", "llm.c v1", "llm.c v2", "npy int32"]


def test_batches_hold_exactly_the_shards_ids(shards):
    pattern, train_ids, val_ids = shards
    corpus = token_corpus(pattern, tok_lib.IdTokenizer(V), 10.0)
    assert corpus.train.n_tokens == train_ids.size and corpus.val.n_tokens == val_ids.size
    for step in (0, 5):
        batch = corpus.train_batch(step, batch_size=4, seq_len=16, seed=3)
        starts = window_starts(train_ids.size, step, batch_size=4, seq_len=16, seed=3)
        for row, s in enumerate(starts):
            np.testing.assert_array_equal(batch["tokens"][row], train_ids[s:s + 16])
            np.testing.assert_array_equal(batch["targets"][row], train_ids[s + 1:s + 17])
        assert batch["mask"].all() and (batch["segment_ids"] == 0).all()  # one stream: no separator is known
        np.testing.assert_array_equal(batch["positions"][0], np.arange(16))
    val = corpus.val_batches(16, 4)
    scored = np.concatenate([b["targets"][b["mask"] > 0] for b in val.batches])
    np.testing.assert_array_equal(scored, val_ids[1:])  # every val id after the first is a target once
    assert val.n_bytes == 0 and corpus.unigram_bits_per_byte() is None


def test_the_split_by_name_and_by_tail(tmp_path):
    assert is_val_name("val.bin") and is_val_name("fineweb_val_000000.bin") and not is_val_name("interval.bin")
    ids = ids_of(1000, 4)
    write_raw(tmp_path / "train.bin", ids)
    train, val, stats = read_token_source(tmp_path / "train.bin", V, 10.0)
    np.testing.assert_array_equal(np.asarray(train), ids[:900])
    np.testing.assert_array_equal(np.asarray(val), ids[900:])
    assert "the last 10% of the ids" in stats.val_rule and stats.max_id == ids.max()


def test_a_token_stream_indexes_across_shards():
    parts = [np.arange(5), np.arange(5, 12), np.arange(12, 13)]
    s = TokenStream(parts)
    idx = np.array([[0, 4, 5, 11], [12, 6, 3, 11]])
    np.testing.assert_array_equal(s[idx], idx)
    np.testing.assert_array_equal(np.asarray(s[3:12]), np.arange(3, 12))
    assert len(s[4:6]) == 2 and s.shape == (13,)


@pytest.mark.parametrize("write, message", [
    (lambda p: write_raw(p / "x.bin", [1, 2, V + 3]), f"token id {V + 3} at position 2 is outside the vocabulary"),
    (lambda p: (p / "x.bin").write_bytes(b"\x01\x02\x03"), "odd number"),
    (lambda p: write_llmc(p / "x.bin", [1, 2, 3], version=7), "llm.c token shard version 7 is not supported"),
    (lambda p: (p / "x.bin").write_bytes(write_llmc(p / "y.bin", [1, 2, 3]).read_bytes()[:-2]), "truncated"),
    (lambda p: np.save(p / "x.npy", np.zeros((2, 2), np.int32)), "must be a 1-D integer array"),
    (lambda p: (p / "x.npy").write_bytes(b"not an array"), "is not a readable .npy array"),
])
def test_bad_shards_are_refused_in_one_line(tmp_path, write, message):
    write(tmp_path)
    path = next(p for p in sorted(tmp_path.iterdir()) if p.name.startswith("x"))
    with pytest.raises(DataError, match=message) as err:
        read_token_source(path, V, 10.0)
    assert "\n" not in str(err.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_shard_is_refused(tmp_path):
    p = write_raw(tmp_path / "x.bin", [1, 2, 3, 4])
    p.chmod(0)
    try:
        with pytest.raises(DataError, match="cannot read the token file .*x.bin"):
            read_token_source(p, V, 10.0)
    finally:
        p.chmod(0o600)


def test_the_id_tokenizer_writes_ids_as_text(tmp_path):
    tok = tok_lib.IdTokenizer(V)
    np.testing.assert_array_equal(tok.encode("3, 4  96"), [3, 4, 96])
    assert tok.decode([3, 4]) == " 3 4" and tok.bos_id is None and tok.eos_id is None and tok.external
    with pytest.raises(InputError, match="'97' is not a token id.*ids 0..96"):
        tok.encode("1 97")
    with pytest.raises(InputError, match="'hello' is not a token id"):
        tok.encode("hello")
    loaded = tok_lib.load(tok.save(tmp_path))
    assert isinstance(loaded, tok_lib.IdTokenizer) and loaded.vocab_size == V
    assert loaded.fingerprint() == tok.fingerprint()
    with pytest.raises(ConfigError):
        tok_lib.IdTokenizer(0)
    assert is_token_source("a/b.bin") and is_token_source("x/*.NPY") and not is_token_source("a.jsonl")


def tiny_config(tmp_path):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps({"vocab_size": 128, "d_model": 16, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1,
                                "d_head": 8, "d_ff": 32, "max_seq_len": 32}))
    return ("--config", path, "--steps", 6, "--warmup-steps", 1, "--seq-len", 16, "--batch-size", 4,
            "--eval-interval", 3, "--checkpoint-interval", 3, "--no-progress")


@pytest.mark.slow
def test_a_run_over_token_shards_trains_evaluates_and_generates_ids(tmp_path, shards):
    pattern, train_ids, _ = shards
    out = tmp_path / "run"
    res = cli_in_process("train", "--data", pattern, "--vocab-size", V, "--out", out, *tiny_config(tmp_path))
    assert res.returncode == 0, res.stderr
    assert "no closing sample: this run's tokens are ids from an external tokenizer" in res.stdout
    assert "bits/byte" not in res.stdout and not (out / "sample.txt").exists()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("val_loss" in r for r in rows) and not any("val_bpb" in r for r in rows)
    assert json.loads((out / "tokenizer.json").read_text()) == {"type": "mlx_llm.ids", "version": 1,
                                                                 "vocab_size": V}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["sample"] is None and summary["unigram_val_bpb"] is None
    gen = cli_in_process("generate", "--run", out, "--prompt", "5 6 7", "--max-new-tokens", 4, "--json")
    assert gen.returncode == 0, gen.stderr
    record = json.loads(gen.stdout)
    assert record["prompt_ids"] == [5, 6, 7] and len(record["continuation_ids"]) == 4
    assert record["continuation"] == "".join(f" {i}" for i in record["continuation_ids"])
    bad = cli_in_process("generate", "--run", out, "--prompt", "def f", "--max-new-tokens", 2)
    assert bad.returncode == 2 and "'def' is not a token id" in bad.stderr
    ev = cli_in_process("eval", "--run", out)
    assert ev.returncode == 0 and f"{summary['val_loss']:.4f}" in ev.stdout, ev.stderr


@pytest.mark.slow
def test_refused_token_runs_write_nothing(tmp_path, shards):
    pattern, _, _ = shards
    flags = tiny_config(tmp_path)
    before = snapshot(tmp_path)
    for extra, message in ((("--vocab-size", 50), "outside the vocabulary 0..49"),
                           (("--vocab-size", V, "--objective", "diffusion"), "needs a <|mask|> token"),
                           (("--vocab-size", V, "--data", "a=" + pattern, f"b={tmp_path}"),
                            "either text sources or token-id sources")):
        args = ("train", "--data", pattern, *extra, "--out", tmp_path / "run", *flags)
        res = cli_in_process(*args)
        assert res.returncode == 2 and message in res.stderr and res.stderr.count("\n") == 1, res.stderr
    assert snapshot(tmp_path) == before


@pytest.mark.slow
def test_shards_with_their_tokenizer_sample_text_and_report_bits_per_byte(tmp_path, corpus_dir):
    """Ids made with a known tokenizer (``--tokenizer FILE``): documents are BOS-separated, so the run scores
    bits per byte and writes a closing text sample, as a text run would."""
    texts = [p.read_text() for p in sorted(corpus_dir.glob("*.py"))]
    tok = tok_lib.ByteTokenizer()
    tok_file = tok.save(tmp_path / "tok.json")
    stream = np.concatenate([np.concatenate([tok.bos_prefix, tok.encode(t), [tok.eos_id]]) for t in texts])
    write_raw(tmp_path / "train.bin", stream[: len(stream) * 4 // 5])
    write_raw(tmp_path / "val.bin", stream[len(stream) * 4 // 5:])
    out = tmp_path / "run"
    flags = tiny_config(tmp_path)
    res = cli_in_process("train", "--data", tmp_path / "*.bin", "--tokenizer", tok_file, "--out", out, *flags,
                         "--sample-tokens", 4)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "bits/byte" in res.stdout and (out / "sample.txt").read_text().startswith("def ")
    assert tok_lib.load(out).fingerprint() == tok.fingerprint()
    corpus = token_corpus(tmp_path / "*.bin", tok, 10.0)
    batch = corpus.train_batch(0, batch_size=2, seq_len=16, seed=0)
    assert not batch["mask"][batch["targets"] == tok.bos_id].any()  # a document's BOS is never a target


@pytest.mark.slow
def test_a_run_over_one_npy_array_trains_on_its_tail_split(tmp_path):
    ids = ids_of(4000, 7).astype(np.int32)
    np.save(tmp_path / "ids.npy", ids)
    out = tmp_path / "run"
    res = cli_in_process("train", "--data", tmp_path / "ids.npy", "--vocab-size", V, "--val-percent", 10, "--out", out,
                         *tiny_config(tmp_path))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "npy int32" in res.stdout and "val: the last 10% of the ids (400)" in res.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["val_targets"] for r in rows if "val_loss" in r] == [399, 399]  # every val id after the first
