"""The command line under random input (hypothesis, a fixed number of examples per kind, derandomized so that CI sees
the same ones): random values for every flag of every subcommand, and random bytes or random JSON for every kind of
file the project reads. The property: the command exits 0, or exits 1 or 2 with one line and no traceback, and a
refused command leaves its --out (or the run it read) exactly as it was."""

import json
import shutil
import string
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import TINY_CFG, cli_in_process, snapshot

pytestmark = pytest.mark.slow  # each example is a whole command; see the budget in SETTINGS

SETTINGS = settings(max_examples=12, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
TINY = ["--set", "model.d_model=16", "--set", "model.n_layers=1", "--set", "model.n_heads=2", "--set",
        "model.n_kv_heads=1", "--set", "model.d_head=8", "--set", "model.d_ff=32", "--set", "model.max_seq_len=64"]
# last on the command line (argparse keeps the last value): whatever was drawn, a run stays a few tiny steps
BOUNDS = ["--steps", "2", "--warmup-steps", "1", "--seq-len", "16", "--batch-size", "2", "--no-progress",
          "--sample-tokens", "2", "--eval-tokens", "64"]

HOSTILE = st.sampled_from(["", "-1", "0", "1", "1e308", "-1e308", "nan", "inf", "-inf", str(2**63), str(2**64),
                           "1e-320", "abc", "../../../etc/passwd", "/", "x" * 300, "☃", "data=2,fsdp=-1", "a=b",
                           "3:2", "0:0", "bpe", "byte", "off", "auto", "wsd", "cosine", "muon", "none", "full"])
VALUES = st.one_of(HOSTILE, st.integers(-2**70, 2**70).map(str), st.floats(allow_nan=True).map(repr),
                   st.text(string.printable, max_size=12))


def flags_of(command: str) -> list:
    """(flag, takes a value) of every option of ``command``."""
    from mlx_llm.cli.parser import build_parser, subcommands

    parser = subcommands(build_parser())[command]
    out = []
    for action in parser._actions:
        names = [o for o in action.option_strings if o.startswith("--") and o != "--help"]
        if names:
            out.append((names[0], action.nargs != 0))
    return out


def one_line_or_success(proc) -> None:
    """Exit 0, or 1 / 2 with one error line; never a traceback."""
    assert proc.returncode in (0, 1, 2), (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    if proc.returncode:
        lines = [line for line in proc.stderr.splitlines() if line.startswith("mlx-llm")]
        assert len(lines) == 1, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "t.txt"
    rng = np.random.default_rng(0)
    path.write_text("\n".join(" ".join(rng.choice(["def", "x", "return", "(", ")"], 10)) for _ in range(300)))
    return path


def fresh(tmp_path) -> Path:
    """A new directory for one example: hypothesis runs every example of a test in the same ``tmp_path``."""
    return Path(tempfile.mkdtemp(dir=tmp_path))


def drawn_flags(draw, command: str, n: int) -> list:
    chosen = draw(st.lists(st.sampled_from(flags_of(command)), max_size=n))
    argv = []
    for flag, takes_value in chosen:
        argv += [flag, draw(VALUES)] if takes_value else [flag]
    return argv


@SETTINGS
@given(data=st.data())
def test_train_flags(tmp_path, text_file, data):
    out = fresh(tmp_path) / "run"
    argv = drawn_flags(data.draw, "train", 4)
    proc = cli_in_process("train", *argv, "--out", out, "--data", text_file, "--tokenizer", "byte",
                          "--cache-dir", tmp_path / "cache", *TINY, *BOUNDS)
    one_line_or_success(proc)
    if proc.returncode:
        assert not out.exists() or snapshot(out) == {}


@SETTINGS
@given(command=st.sampled_from(["eval", "generate", "eval-task", "export", "export-merged", "compile", "import",
                                "sft", "reward", "dpo", "rl", "chat"]), data=st.data())
def test_other_commands_flags(tmp_path, base_run, command, data):
    """Every other subcommand with random flags, reading the shared tiny run (which must stay unchanged)."""
    before = snapshot(base_run)
    tmp_path = fresh(tmp_path)
    argv = drawn_flags(data.draw, command, 4)
    fixed = {"eval": ["--run", base_run], "generate": ["--run", base_run, "--max-new-tokens", "2"],
             "eval-task": ["--run", base_run, "--task", "arithmetic", "--examples", "2"],
             "export": ["--run", base_run, "--to", tmp_path / "hf"],
             "export-merged": ["--run", base_run, "--out", tmp_path / "merged"],
             "compile": ["--seq-len", "16", "--batch-size", "2"], "import": ["--from", base_run, "--out", tmp_path / "x"],
             "chat": ["--run", base_run, "--max-new-tokens", "2"]}.get(command)
    if fixed is None:  # the post-training commands: a new run from the shared base
        fixed = ["--base", base_run, "--out", tmp_path / "post", "--task", "arithmetic", "--train-examples", "16",
                 "--steps", "1", "--warmup-steps", "0", "--batch-size", "2", "--seq-len", "64", "--no-progress",
                 "--eval-examples", "2"]
    if command == "chat":
        import io
        import sys

        stdin, sys.stdin = sys.stdin, io.StringIO("\n")
        try:
            proc = cli_in_process(command, *argv, *fixed)
        finally:
            sys.stdin = stdin
    else:
        proc = cli_in_process(command, *argv, *fixed)
    one_line_or_success(proc)
    assert snapshot(base_run) == before


# ----- files from outside ------------------------------------------------------------------------------------------
JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**80, 2**80) | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                 max_size=4), max_leaves=12)
CONTENT = st.one_of(st.binary(max_size=300), JSON.map(lambda v: json.dumps(v).encode()),
                    st.just(b"[" * 100_000), st.just(b'{"v": ' + b"9" * 5000 + b"}"), st.just(b'{"x": "\\ud800"}'))


def near_valid(kind: str):
    """Mutations of a valid file of ``kind``: a field replaced by a random JSON value."""
    base = {"config": dict(TINY_CFG), "train_config": {"steps": 2, "batch_size": 2, "seq_len": 16},
            "mixture": {"sources": [{"name": "a", "path": "t.txt", "weight": 1}]}}[kind]
    return st.tuples(st.sampled_from(sorted(base)), JSON).map(
        lambda kv: json.dumps({**base, kv[0]: kv[1]}).encode())


@SETTINGS
@given(kind=st.sampled_from(["config", "train_config", "mixture", "jsonl", "npy", "bin", "parquet"]), data=st.data())
def test_training_files(tmp_path, text_file, kind, data):
    """Model and train configs, mixture files, JSONL records, token shards and parquet, random or nearly valid."""
    tmp_path = fresh(tmp_path)
    shutil.copy(text_file, tmp_path / "t.txt")
    content = data.draw(CONTENT | near_valid(kind) if kind in ("config", "train_config", "mixture") else CONTENT)
    suffix = {"config": ".json", "train_config": ".json", "mixture": ".json", "jsonl": ".jsonl", "npy": ".npy",
              "bin": ".bin", "parquet": ".parquet"}[kind]
    path = tmp_path / f"file{suffix}"
    path.write_bytes(content)
    args = {"config": ["--config", path, "--data", text_file, "--tokenizer", "byte"],
            "train_config": ["--train-config", path, "--data", text_file, "--tokenizer", "byte", *TINY],
            "mixture": ["--data", path, "--tokenizer", "byte", *TINY],
            "jsonl": ["--data", path, "--tokenizer", "byte", *TINY],
            "npy": ["--data", path, "--vocab-size", "64", *TINY], "bin": ["--data", path, "--vocab-size", "64", *TINY],
            "parquet": ["--data", path, "--tokenizer", "byte", *TINY]}[kind]
    out = tmp_path / "run"
    bounds = [] if kind in ("config", "train_config") else BOUNDS
    proc = cli_in_process("train", "--out", out, "--cache-dir", tmp_path / "cache", *args, *bounds,
                          *(["--no-progress", "--sample-tokens", "2"] if kind in ("config", "train_config") else []))
    one_line_or_success(proc)
    if proc.returncode:
        assert not out.exists()


@SETTINGS
@given(name=st.sampled_from(["config.json", "train_config.json", "run.json", "tokenizer.json"]), content=CONTENT)
def test_run_files(tmp_path, base_run, name, content):
    """A run directory whose files were damaged or replaced: eval / generate / --resume refuse in one line and
    change nothing."""
    run = fresh(tmp_path) / "run"
    shutil.copytree(base_run, run)
    (run / name).write_bytes(content)
    before = snapshot(run)
    for argv in (["eval", "--run", run], ["generate", "--run", run, "--prompt", "x", "--max-new-tokens", "1"],
                 ["train", "--resume", "--out", run, "--no-progress"]):
        proc = cli_in_process(*argv)
        one_line_or_success(proc)
        assert snapshot(run) == before


@pytest.fixture(scope="module")
def hf_export(tmp_path_factory):
    import jax

    from mlx_llm import ModelConfig, init_params
    from mlx_llm.data.tokenizer import ByteTokenizer
    from mlx_llm.interop.hf import export_model

    tok = ByteTokenizer()
    cfg = ModelConfig(**{**TINY_CFG, "vocab_size": tok.vocab_size})
    params = jax.tree.map(np.asarray, init_params(cfg, jax.random.key(0)))
    return export_model(params, cfg, tok, tmp_path_factory.mktemp("hf") / "llama")


@SETTINGS
@given(name=st.sampled_from(["config.json", "model.safetensors.index.json", "tokenizer.json",
                             "tokenizer_config.json", "generation_config.json", "model.safetensors"]),
       content=CONTENT)
def test_hf_files(tmp_path, hf_export, name, content):
    """A transformers checkpoint directory with one file replaced: import refuses in one line (or imports) and
    never writes a partial run."""
    tmp_path = fresh(tmp_path)
    src = tmp_path / "hf"
    shutil.copytree(hf_export, src)
    if name == "model.safetensors.index.json":
        (src / "model.safetensors").rename(src / "shard.safetensors")
    (src / name).write_bytes(content)
    out = tmp_path / "run"
    proc = cli_in_process("import", "--from", src, "--out", out)
    one_line_or_success(proc)
    if proc.returncode:
        assert not out.exists()
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".mlx-partial-")]
