"""Record sources for --data (issue 25 part 1): JSON Lines, gzipped JSON Lines, parquet, saved HF datasets; each
one read, split, encoded and decoded back to exactly its records' texts, trained through the CLI, refused in one
line when broken; the encode streams in bounded memory and gives the same tokens with several workers."""

import gzip
import json
import os
import tracemalloc

import numpy as np
import pytest

from helpers import cli_in_process, snapshot
from mlx_llm.errors import DataError
from mlx_llm.data import text as text_lib
from mlx_llm.data import encoding as encoding_lib
from mlx_llm.data import sources as S
from mlx_llm.data import tokenizer as T

BYTE = T.ByteTokenizer()
WORDS = ["alpha", "beta", "gamma", "delta", "naïve", "café", "日本", "x = 1", "\n", "    ", "def", "return"]
FORMATS = ["jsonl", "jsonl.gz", "parquet", "dataset", "dataset_dict"]


def texts(n: int, seed: int = 0, ascii_only: bool = False) -> list[str]:
    rng = np.random.default_rng(seed)
    words = [w for w in WORDS if w.isascii()] if ascii_only else WORDS
    return [" ".join(rng.choice(words, size=int(rng.integers(5, 60)))) + f" #{k}\n" for k in range(n)]


def write_source(root, fmt: str, bodies: list[str], field: str = "body"):
    """``bodies`` as one source of format ``fmt`` (a blank JSONL line and an empty record included); returns
    (path, {document name: text} in corpus order, the names a saved DatasetDict puts in val)."""
    rows = [{field: b, "id": k} for k, b in enumerate(bodies)]
    if fmt.startswith("jsonl"):
        path = root / f"part.{fmt}"
        lines = [json.dumps(r, ensure_ascii=False) for r in rows[:3]] + ["", json.dumps({field: " ", "id": -1})]
        lines += [json.dumps(r, ensure_ascii=False) for r in rows[3:]]
        data = ("\n".join(lines) + "\n").encode("utf-8")
        path.write_bytes(gzip.compress(data) if fmt.endswith(".gz") else data)
        numbers = [1, 2, 3] + list(range(6, 6 + len(rows) - 3))
        return path, {f"{path.name}:{n}": b for n, b in zip(numbers, bodies)}, set()
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = root / "part.parquet"
        pq.write_table(pa.table({"id": [r["id"] for r in rows], field: bodies}), path, row_group_size=7)
        return path, {f"{path.name}:{k}": b for k, b in enumerate(bodies)}, set()
    import datasets

    ds = datasets.Dataset.from_dict({field: bodies, "id": list(range(len(bodies)))})
    path = root / fmt
    if fmt == "dataset":
        ds.save_to_disk(str(path))
        return path, {f"{fmt}:{k}": b for k, b in enumerate(bodies)}, set()
    cut = len(bodies) * 3 // 4
    datasets.DatasetDict({"train": ds.select(range(cut)), "validation": ds.select(range(cut, len(bodies)))}) \
        .save_to_disk(str(path))
    names = {f"{fmt}/train:{k}": b for k, b in enumerate(bodies[:cut])}
    val = {f"{fmt}/validation:{k}": b for k, b in enumerate(bodies[cut:])}
    return path, {**names, **val}, set(val)


def expected_split(docs: dict, fixed_val: set, val_percent: float) -> tuple[list[str], list[str]]:
    """(train names, val names) in corpus order: the saved DatasetDict's own split, else the name hash."""
    is_val = (lambda n: n in fixed_val) if fixed_val else (lambda n: text_lib.val_score(n) < val_percent)
    return [n for n in docs if not is_val(n)], [n for n in docs if is_val(n)]


def stream_text(tok, tokens) -> str:
    return tok.decode(np.asarray(tokens))


# ----- each format, read and encoded ---------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_encodes_exactly_its_records(tmp_path, fmt, monkeypatch):
    monkeypatch.setattr(S, "BATCH_ROWS", 5)  # several record batches
    bodies = texts(40)
    path, docs, fixed_val = write_source(tmp_path, fmt, bodies)
    text = text_lib.read_corpus(path, text_field="body", val_percent=20)
    train_names, val_names = expected_split(docs, fixed_val, 20)
    assert train_names and val_names
    assert [d.name for d in text.train] == train_names and [d.name for d in text.val] == val_names
    train, val = [docs[n] for n in train_names], [docs[n] for n in val_names]
    assert [d.text for d in text.train] == train and [d.text for d in text.val] == val
    assert text.stats.n_documents == 40 and text.stats.n_bytes == sum(len(b.encode()) for b in bodies)
    if fmt.startswith("jsonl"):
        assert (text.stats.n_records, text.stats.empty_records) == (41, 1)
    bpe = T.train_bpe((d.text for d in text.train), 300)
    for tok in (BYTE, bpe):
        corpus = encoding_lib.encode_corpus(text, tok, tmp_path / "cache", workers=1)
        for split, want in (("train", train), ("val", val)):
            got = getattr(corpus, split)
            assert stream_text(tok, got.tokens) == "".join(f"<|bos|>{t}<|eos|>" for t in want)
            assert len(got.doc_starts) == len(want) and got.tokens[got.doc_starts].tolist() == [tok.bos_id] * len(want)
    assert text_lib.read_corpus(path, text_field="body", val_percent=20).fingerprint() == text.fingerprint()


def test_directory_and_glob_of_record_files(tmp_path):
    root = tmp_path / "shards"
    root.mkdir()
    (root / "notes.txt").write_text("a plain text file\n" * 3)
    a, docs_a, _ = write_source(root, "jsonl", texts(10, 1))
    (root / "sub").mkdir()
    b, docs_b, _ = write_source(root / "sub", "parquet", texts(10, 2))
    text = text_lib.read_corpus(root, text_field="body", val_percent=20)
    names = {d.name for d in text.train + text.val}
    want = {f"part.jsonl:{n.split(':')[1]}" for n in docs_a} | {f"sub/{n}" for n in docs_b} | {"notes.txt"}
    assert names == want and len(text.train) + len(text.val) == 21
    globbed = text_lib.read_corpus(str(root / "**" / "*.parquet"), text_field="body", val_percent=20)
    assert {d.name.rsplit(":", 1)[0] for d in globbed.train + globbed.val} == {b.as_posix()}


def test_text_files_keep_their_documents_and_key(tmp_path):
    """A text-file corpus is read lazily, with the fingerprint of its documents held in memory."""
    for k in range(12):
        (tmp_path / f"m{k:02d}.py").write_text(f"x_{k} = {k}\n" * (k + 1))
    text = text_lib.read_corpus(tmp_path, val_percent=20)
    assert isinstance(text.train, text_lib.Documents) and len(text.train) + len(text.val) == 12
    in_memory = text_lib.TextCorpus(list(text.train), list(text.val), text.stats)
    assert in_memory.fingerprint() == text.fingerprint()
    assert encoding_lib.cache_key(in_memory, BYTE) == encoding_lib.cache_key(text, BYTE)
    files, where = text_lib.find_files(tmp_path)
    train, val = text_lib.split_documents(text_lib.read_documents(files, where)[0], 20)
    assert [d.name for d in train] == [d.name for d in text.train] and text.val[0] == val[0]


# ----- streaming, workers, BPE -----------------------------------------------------------------------------
def test_workers_give_the_same_tokens(tmp_path):
    path, _, _ = write_source(tmp_path, "jsonl", texts(300, 3))
    text = text_lib.read_corpus(path, text_field="body", val_percent=10)
    bpe = T.train_bpe((d.text for d in text.train), 300)
    for tok in (BYTE, bpe):
        one = encoding_lib.encode_corpus(text, tok, tmp_path / "one", workers=1, chunk_bytes=2048)
        two = encoding_lib.encode_corpus(text, tok, tmp_path / "two", workers=2, chunk_bytes=2048)
        assert not two.cache_hit and one.cache_path.name == two.cache_path.name
        for split in ("train", "val"):
            a, b = getattr(one, split), getattr(two, split)
            assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.doc_starts, b.doc_starts)
            ref = encoding_lib.encode_stream(list(getattr(text, split)), tok)
            assert np.array_equal(a.tokens, ref.tokens) and np.array_equal(a.doc_starts, ref.doc_starts)
    assert sorted(p.name for p in (tmp_path / "two").iterdir() if ".tmp-" in p.name) == []


def _peak(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def big_jsonl(path, n_bytes: int) -> None:
    record = json.dumps({"text": "lorem ipsum dolor sit amet " * 370})  # about 10 kB
    with open(path, "w") as fh:
        for _ in range(n_bytes // len(record)):
            fh.write(record + "\n")


def test_encoding_memory_does_not_grow_with_the_corpus(tmp_path):
    """Python-heap peak (tracemalloc) of read + encode, in this process, for 2 MB and 20 MB of records: the
    chunks in flight bound it, not the corpus."""
    peaks = {}
    for mb in (2, 20):
        path = tmp_path / f"c{mb}.jsonl"
        big_jsonl(path, mb << 20)
        peaks[mb] = _peak(lambda: encoding_lib.encode_corpus(text_lib.read_corpus(path, val_percent=5), BYTE, tmp_path / "cache",
                                                  workers=1, chunk_bytes=64 << 10))
    assert peaks[20] < 4 << 20 and peaks[20] < 1.5 * peaks[2] + (1 << 20), peaks


def test_bpe_training_reads_the_train_split_lazily(tmp_path):
    path = tmp_path / "c.jsonl"
    big_jsonl(path, 6 << 20)
    text = text_lib.read_corpus(path, val_percent=5)
    peak = _peak(lambda: T.train_bpe((d.text for d in text.train), 300))
    assert peak < 2 << 20, peak  # the 6 MB of train text never held at once


# ----- refusals ----------------------------------------------------------------------------------------------
def bad_sources(root):
    """{case: (path, expected message)}: each one broken in one way."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (root / "missing.jsonl").write_text('{"body": "ok"}\n{"text": "no body", "id": 3}\n')
    (root / "not_string.jsonl").write_text('{"body": "ok"}\n{"body": 17}\n')
    (root / "not_json.jsonl").write_text('{"body": "ok"}\n{"body": \n')
    (root / "garbage.jsonl.gz").write_bytes(b"this is not gzip at all\n")
    (root / "truncated.jsonl.gz").write_bytes(gzip.compress(b'{"body": "ok"}\n' * 100)[:40])
    (root / "corrupt.parquet").write_bytes(b"PAR1 not really parquet")
    pq.write_table(pa.table({"body": [1, 2, 3]}), root / "ints.parquet")
    pq.write_table(pa.table({"text": ["a", "b"]}), root / "nofield.parquet")
    return {
        "missing field": ("missing.jsonl", r"missing.jsonl:2 has no field 'body' \(its fields: text, id\)"),
        "non-string field": ("not_string.jsonl", r"not_string.jsonl:2: field 'body' is int, not a string"),
        "bad JSON": ("not_json.jsonl", r"not_json.jsonl:2 is not valid JSON"),
        "gzip garbage": ("garbage.jsonl.gz", r"garbage.jsonl.gz is not a readable gzip file"),
        "truncated gzip": ("truncated.jsonl.gz", r"truncated.jsonl.gz is not a readable gzip file"),
        "corrupt parquet": ("corrupt.parquet", r"corrupt.parquet is not a readable parquet file"),
        "parquet non-string": ("ints.parquet", r"ints.parquet: field 'body' is int64, not a string"),
        "parquet missing field": ("nofield.parquet", r"nofield.parquet has no field 'body' \(its fields: text\)"),
    }


@pytest.fixture(scope="module")
def bad_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    return root, bad_sources(root)


BAD_CASES = ["missing field", "non-string field", "bad JSON", "gzip garbage", "truncated gzip", "corrupt parquet",
             "parquet non-string", "parquet missing field"]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_records_refused_in_one_line(bad_dir, case):
    root, cases = bad_dir
    name, message = cases[case]
    with pytest.raises(DataError, match=message) as err:
        text_lib.read_corpus(root / name, text_field="body")
    assert "\n" not in str(err.value)


def test_missing_field_of_a_saved_dataset(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"text": ["a", "b"], "n": [1, 2]}).save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(DataError, match=r"ds has no field 'body' \(its fields: text, n\)"):
        text_lib.read_corpus(tmp_path / "ds", text_field="body")
    datasets.DatasetDict({"test": datasets.Dataset.from_dict({"text": ["a"]})}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"dd is a DatasetDict without a 'train' split \(its splits: test\)"):
        text_lib.read_corpus(tmp_path / "dd")


def test_unreadable_files_are_named(tmp_path, monkeypatch):
    (tmp_path / "a.jsonl").write_text('{"text": "hello"}\n')
    (tmp_path / "b.txt").write_text("hello\n")

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(S, "open", denied, raising=False)
    with pytest.raises(DataError, match=r"^cannot read a.jsonl: Permission denied$"):
        text_lib.read_corpus(tmp_path / "a.jsonl")
    monkeypatch.setattr(type(tmp_path), "read_bytes", denied)
    with pytest.raises(DataError, match=r"^cannot read b.txt: Permission denied$"):
        text_lib.read_corpus(tmp_path / "b.txt")


# ----- through the command line ---------------------------------------------------------------------------------
MODEL = dict(vocab_size=263, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_head=8, d_ff=16, max_seq_len=32)
TRAIN_FLAGS = ["--tokenizer", "byte", "--steps", 2, "--warmup-steps", 1, "--batch-size", 2, "--seq-len", 16,
               "--eval-interval", 2, "--eval-tokens", 32, "--checkpoint-interval", 2, "--sample-tokens", 4,
               "--no-progress", "--val-percent", 20]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    ws = tmp_path_factory.mktemp("cli_sources")
    (ws / "model.json").write_text(json.dumps(MODEL))
    return ws


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_cli_trains_on_each_format(workspace, fmt):
    root = workspace / fmt.replace(".", "_")
    root.mkdir()
    path, docs, _ = write_source(root, fmt, texts(30, 4, ascii_only=True))
    run, cache = root / "run", root / "cache"
    proc = cli_in_process("train", "--data", path, "--text-field", "body", "--out", run, "--config",
                          workspace / "model.json", "--cache-dir", cache, *TRAIN_FLAGS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "30 documents" in proc.stdout
    corpus = encoding_lib.load_corpus(T.load(run), path, cache_dir=cache, text_field="body", val_percent=20)
    assert corpus.cache_hit  # the run encoded exactly this corpus
    batch = corpus.train_batch(0, batch_size=2, seq_len=16, seed=0)
    source = "\0".join(docs.values())
    for row in batch["tokens"]:
        for piece in BYTE.decode(row).replace("<|eos|>", "<|bos|>").split("<|bos|>"):
            assert piece in source, piece


@pytest.mark.slow
@pytest.mark.parametrize("case", ["missing field", "non-string field", "corrupt parquet", "gzip garbage"])
def test_cli_refuses_bad_sources_in_one_line(workspace, bad_dir, case):
    root, cases = bad_dir
    name, message = cases[case]
    run = workspace / f"refused-{case.replace(' ', '_')}"
    before = snapshot(workspace), snapshot(root)
    proc = cli_in_process("train", "--data", root / name, "--text-field", "body", "--out", run, "--config",
                          workspace / "model.json", "--cache-dir", workspace / "cache", *TRAIN_FLAGS)
    assert proc.returncode == 2, (proc.stdout[-2000:], proc.stderr[-2000:])
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    import re

    assert re.search(message, err), err
    assert (snapshot(workspace), snapshot(root)) == before and not run.exists()


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_cli_refuses_an_unreadable_file(workspace, tmp_path):
    path = tmp_path / "locked.jsonl"
    path.write_text('{"body": "secret"}\n' * 5)
    path.chmod(0)
    try:
        before = snapshot(workspace)
        proc = cli_in_process("train", "--data", path, "--text-field", "body", "--out", workspace / "locked",
                              "--config", workspace / "model.json", *TRAIN_FLAGS)
        err = proc.stderr.strip()
        assert proc.returncode == 2 and len(err.splitlines()) == 1, err
        assert "cannot read locked.jsonl: Permission denied" in err, err
        assert snapshot(workspace) == before
    finally:
        path.chmod(0o644)
