"""A run's inputs are identities, not spellings: ``--data`` is recorded absolute with a fingerprint of its files
(``data.corpora.data_identity``), and resume, eval and ``mlx-llm compare`` check the fingerprint, not the string."""

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from helpers import TINY, cli_in_process, snapshot, tiny_train
from mlx_llm.data import corpora
from mlx_llm.errors import ConfigError
from mlx_llm.runs.configs import DataSpec

WORDS = ["def", "return", "self", "value", "import", "class", "for", "in", "if", "else", "x", "y", "(", ")", ":"]


def write_corpus(root: Path, seed: int) -> Path:
    """Twelve word-salad .py files (the training tests' corpus), drawn by ``seed``."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True)
    for i in range(12):
        (root / f"doc{i:02d}.py").write_text("\n".join(" ".join(rng.choice(WORDS, size=8)) for _ in range(60)) + "\n")
    return root


def identity(path, **kw):
    return corpora.data_identity(DataSpec(path=None if path is None else str(path), **kw))


# ----- the record and the fingerprint ------------------------------------------------------------------------------
def test_data_is_recorded_absolute_whatever_its_spelling(tmp_path, monkeypatch):
    """``--data`` is stored as the absolute path it names from the working directory (the file keeps its name:
    links are not followed), so ``data/c``, ``./data/c``, ``data/c/`` and the absolute path are one record; the
    default (the standard library) stays unset; a fingerprint that is not a SHA-256 is refused."""
    write_corpus(tmp_path / "data" / "c", 0)
    monkeypatch.chdir(tmp_path)
    spellings = ["data/c", "./data/c", "data/c/", "data/../data/c", str(tmp_path / "data" / "c")]
    assert {DataSpec(path=p).path for p in spellings} == {str(tmp_path / "data" / "c")}
    assert DataSpec(path="data/*.py").path == str(tmp_path / "data" / "*.py") and DataSpec().path is None
    monkeypatch.setenv("HOME", str(tmp_path))
    assert DataSpec(path="~/data/c").path == str(tmp_path / "data" / "c")
    assert DataSpec.from_dict({"path": "data/c"}).path == str(tmp_path / "data" / "c")  # an older record: from here
    with pytest.raises(ConfigError, match=r"DataSpec.fingerprint = 'abc' is invalid: it is a SHA-256 in hex"):
        DataSpec(fingerprint="abc")


def test_the_fingerprint_is_the_files_not_their_spelling_place_or_times(tmp_path, monkeypatch):
    """The same files under any spelling, copied elsewhere, or touched have one identity; a changed byte (same
    size), a new file or another extension filter is another; a file above the whole-hash size is sampled; token
    shards and mixtures (by source name) have identities too; a named pipe is never opened."""
    c = write_corpus(tmp_path / "data" / "c", 0)
    monkeypatch.chdir(tmp_path)
    first = identity("data/c", extensions=(".py",))
    assert first.files == 12 and first.n_bytes == sum(p.stat().st_size for p in c.iterdir())
    assert identity("./data/c/", extensions=(".py",)) == identity(c, extensions=(".py",)) == first
    copy = shutil.copytree(c, tmp_path / "elsewhere" / "c")
    os.utime(copy / "doc03.py", (1, 1))
    assert identity(copy, extensions=(".py",)) == first
    mix = corpora.data_identity(DataSpec(mixture=(f"web={c}", f"code={copy}:2"), extensions=(".py",)))
    swapped = corpora.data_identity(DataSpec(mixture=(f"code={c}", f"web={copy}:2"), extensions=(".py",)))
    assert mix.files == 24 and mix.fingerprint != swapped.fingerprint
    flip_a_byte(copy / "doc03.py")
    assert identity(copy, extensions=(".py",)).fingerprint != first.fingerprint
    (c / "notes.txt").write_text("more")
    assert identity(c, extensions=(".py",)) == first and identity(c, extensions=(".py", ".txt")).files == 13
    os.mkfifo(c / "pipe.py")  # listed (the corpus counts it as skipped), never read: reading it would block
    assert identity(c, extensions=(".py",)).files == 13
    monkeypatch.setattr(corpora, "FULL_HASH_BYTES", 1000)  # every file sampled: 16 blocks of 64 KiB cover it
    assert identity(copy, extensions=(".py",)).fingerprint != first.fingerprint
    for name in ("a.npy", "b.npy"):
        np.save(tmp_path / name, np.arange(300, dtype=np.uint16))
    assert identity(tmp_path / "*.npy").files == 2 and identity(tmp_path / "a.npy").files == 1


def flip_a_byte(path: Path) -> None:
    """Change the file's first byte (its size stays)."""
    raw = path.read_bytes()
    path.write_bytes(bytes([raw[0] ^ 1]) + raw[1:])


def test_a_refusal_names_an_unset_seed_as_unset(tmp_path):
    """A resume that sets a seed the run left unset says so ("the run has it unset"), not "the run has None"."""
    from mlx_llm.runs.record import RunRecord, open_run, write_run
    from mlx_llm.runs.resume import check_unchanged

    write_run(tmp_path, TINY, tiny_train(), RunRecord(kind="pretrain", data=DataSpec(tokenizer="byte")))
    with pytest.raises(ConfigError, match=r"train.init_seed \(given 5, the run has it unset\)"):
        check_unchanged(open_run(tmp_path), {"train": {"init_seed": 5}})


# ----- runs: resume, eval, compare ---------------------------------------------------------------------------------
TRAIN = ["--extensions", ".py", "--val-percent", 20, "--tokenizer", "byte", "--steps", 3, "--warmup-steps", 1,
         "--batch-size", 4, "--seq-len", 32, "--eval-interval", 3, "--eval-tokens", 256, "--checkpoint-interval", 3,
         "--no-progress", "--sample-tokens", 2]


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    """Two working directories, x and y, each with its own corpus spelled data/c, and a run trained from each with
    ``--data data/c``."""
    root = tmp_path_factory.mktemp("identity")
    (root / "model.json").write_text(json.dumps(TINY.to_dict()))
    runs = {}
    with pytest.MonkeyPatch.context() as mp:
        for place, seed in (("x", 0), ("y", 1)):
            write_corpus(root / place / "data" / "c", seed)
            mp.chdir(root / place)
            out = root / "runs" / place
            proc = cli_in_process("train", "--data", "data/c", *TRAIN, "--config", root / "model.json", "--out", out,
                                  "--cache-dir", root / "cache")
            assert proc.returncode == 0, proc.stderr[-3000:]
            runs[place] = out
    return root, runs


def copied(run: Path, to: Path, data: str | None = None, drop_fingerprint: bool = False) -> Path:
    """A copy of a run directory as another run (its own run id); ``data``: its record's --data rewritten."""
    shutil.copytree(run, to)
    record = json.loads((to / "run.json").read_text())
    record["run_id"] = os.urandom(16).hex()
    if data is not None:
        record["data"]["path"] = data
    if drop_fingerprint:  # as written before fingerprints were kept
        del record["data"]["fingerprint"], record["run_id"]
    (to / "run.json").write_text(json.dumps(record))
    return to


@pytest.mark.slow
def test_a_resume_from_another_directory_trains_on_the_run_s_own_data(places, tmp_path, monkeypatch):
    """The run trained from x with ``--data data/c`` records x's corpus: resumed from y (where data/c is another
    corpus) it trains exactly as resumed from x (metrics.jsonl byte for byte), and mlx-llm eval scores it alike
    from either; ``--data`` given again in another spelling is the same setting, from y it names another one."""
    root, runs = places
    here, there = copied(runs["x"], tmp_path / "here"), copied(runs["x"], tmp_path / "there")
    monkeypatch.chdir(root / "x")
    proc = cli_in_process("train", "--resume", "--out", here, "--steps", 6, "--data", "./data/c", "--no-progress",
                          "--cache-dir", root / "cache")
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = {"x": cli_in_process("eval", "--run", here, "--cache-dir", root / "cache").stdout}
    monkeypatch.chdir(root / "y")
    before = snapshot(there)
    proc = cli_in_process("train", "--resume", "--out", there, "--steps", 6, "--data", "data/c", "--no-progress")
    assert proc.returncode == 2 and re.search(rf"--data \(given '{root / 'y'}/data/c', the run has '{root / 'x'}/data/c'"
                                              r"\)", proc.stderr), proc.stderr
    assert snapshot(there) == before
    proc = cli_in_process("train", "--resume", "--out", there, "--steps", 6, "--no-progress", "--cache-dir",
                          root / "cache")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (there / "metrics.jsonl").read_bytes() == (here / "metrics.jsonl").read_bytes()
    evals["y"] = cli_in_process("eval", "--run", there, "--cache-dir", root / "cache").stdout
    assert "val loss" in evals["x"] and evals["y"].replace(str(there), "") == evals["x"].replace(str(here), "")


@pytest.mark.slow
def test_a_changed_corpus_is_refused_on_resume_and_said_by_eval(places, tmp_path):
    """A copy of the corpus elsewhere is the same data (the run resumes on it); once a byte of it changes, --resume
    is refused in one line naming its path, writing nothing, and mlx-llm eval says plainly that it scores the data
    as it is now; a run whose record has no fingerprint (an older one) resumes and evaluates, saying it is
    unchecked."""
    root, runs = places
    corpus = shutil.copytree(root / "x" / "data" / "c", tmp_path / "moved" / "c")
    run = copied(runs["x"], tmp_path / "run", data=str(corpus))
    flip_a_byte(corpus / "doc05.py")
    before = snapshot(tmp_path)
    proc = cli_in_process("train", "--resume", "--out", run, "--steps", 6, "--no-progress")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert re.search(rf"--resume continues a run on the data it trained on, and the data at {corpus} changed since "
                     rf"{run} recorded it \(it recorded fingerprint [0-9a-f]{{12}}; now 12 files", lines[0])
    assert snapshot(tmp_path) == before
    proc = cli_in_process("eval", "--run", run, "--cache-dir", root / "cache")
    assert proc.returncode == 0 and re.search(rf"note: the data at {corpus} changed since {run} recorded it .*; the "
                                              r"scores below are of the data as it is now\n.* step 3: val loss",
                                              proc.stdout), proc.stdout
    old = copied(runs["x"], tmp_path / "old", drop_fingerprint=True)
    proc = cli_in_process("train", "--resume", "--out", old, "--steps", 4, "--no-progress", "--cache-dir",
                          root / "cache")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"note: {old} records no fingerprint of its data (its run.json predates them" in proc.stdout
    assert json.loads((old / "run.json").read_text())["data"].get("fingerprint") is None  # not made up later


@pytest.mark.slow
def test_compare_checks_the_data_not_its_spelling(places, tmp_path):
    """Two runs trained with ``--data data/c`` from x and from y measured other corpora: refused ("data differ");
    a run of the same corpus copied to another path measured the same data: compared."""
    root, runs = places
    corpus = shutil.copytree(root / "x" / "data" / "c", tmp_path / "c")
    xs = [copied(runs["x"], tmp_path / f"x{i}") for i in range(2)]
    ys = [copied(runs["y"], tmp_path / f"y{i}") for i in range(2)]
    moved = [copied(runs["x"], tmp_path / f"m{i}", data=str(corpus)) for i in range(2)]
    proc = cli_in_process("compare", *xs, "--against", *ys)
    assert proc.returncode == 2 and re.search(r"other validation data than .*x0 \(data differ\)", proc.stderr), \
        proc.stderr
    proc = cli_in_process("compare", *xs, "--against", *moved, "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["difference"]["mean"] == 0.0
