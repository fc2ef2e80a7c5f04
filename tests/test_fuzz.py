"""The command line under random input (hypothesis, a fixed number of examples per kind, derandomized so that CI sees
the same ones): random values for every flag of every subcommand, and random bytes or random JSON for every kind of
file the project reads. The property: the command exits 0, or exits 1 or 2 with one line and no traceback, and a
refused command leaves its --out (or the run it read) exactly as it was."""

import dataclasses
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


# ----- compare, sweeps, the gradient checker, the device check (issue 51) -----------------------------------------
@pytest.fixture(scope="module")
def four_runs(base_run, tmp_path_factory):
    """Four copies of the tiny run as four seeds' runs (their own ids and seeds, their own val_bpb): two groups that
    ``compare`` accepts, paired or not."""
    root = tmp_path_factory.mktemp("compare")
    runs = []
    for i in range(4):
        run = root / f"r{i}"
        shutil.copytree(base_run, run)
        record = json.loads((run / "run.json").read_text())
        (run / "run.json").write_text(json.dumps({**record, "run_id": f"{i + 1:032x}"}))
        tcfg = json.loads((run / "train_config.json").read_text())
        (run / "train_config.json").write_text(json.dumps({**tcfg, "seed": i % 2}))
        with (run / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({"step": tcfg["steps"], "val_bpb": 3.0 + 0.1 * i + 0.01 * i * i}) + "\n")
        runs.append(run)
    assert cli_in_process("compare", runs[0], runs[1], "--against", runs[2], runs[3], "--paired").returncode == 0
    return runs


@SETTINGS
@given(which=st.integers(0, 3), name=st.sampled_from(["metrics.jsonl", "summary.json", "run.json",
                                                       "train_config.json", "config.json"]),
       content=CONTENT, data=st.data())
def test_compare_inputs(tmp_path, four_runs, which, name, content, data):
    """``compare`` over runs with one file damaged or replaced, and random flags: a comparison or one line, and no
    run changes."""
    root = fresh(tmp_path)
    runs = [shutil.copytree(r, root / r.name) for r in four_runs]
    (runs[which] / name).write_bytes(content)
    before = [snapshot(r) for r in runs]
    argv = drawn_flags(data.draw, "compare", 2)
    proc = cli_in_process("compare", runs[0], runs[1], "--against", runs[2], runs[3], *argv)
    one_line_or_success(proc)
    if proc.returncode == 0 and "--json" in argv:
        json.loads(proc.stdout)  # exactly one JSON object, non-finite numbers as null
    assert [snapshot(r) for r in runs] == before


SPEC_FIELDS = ("sizes", "budgets", "tokens_per_param", "param_count", "windows", "batch_sizes", "lrs", "seeds")
SPEC_VALUES = st.one_of(JSON, st.tuples(JSON), st.tuples(st.floats(), st.floats()), st.just(float("inf")),
                        st.just((2**64,)), st.lists(st.dictionaries(st.sampled_from(["d_model", "d_ff", "x"]), JSON,
                                                                    max_size=2), max_size=2).map(tuple))


@SETTINGS
@given(fields=st.dictionaries(st.sampled_from(SPEC_FIELDS), SPEC_VALUES, min_size=1, max_size=3))
def test_sweep_specs(fields):
    """A ``SweepSpec`` with random fields is built or refused at construction by a ``ConfigError``, nothing else."""
    from mlx_llm.errors import MLXLLMError
    from test_sweep import SMALL

    if "budgets" in fields or "tokens_per_param" in fields:
        fields.setdefault("budgets" if "tokens_per_param" in fields else "tokens_per_param", ())
    try:
        spec = dataclasses.replace(SMALL, **fields)
    except MLXLLMError as exc:
        assert "\n" not in str(exc)
    else:
        assert spec.sizes is not None


@SETTINGS
@given(name=st.sampled_from(["sweep.json", "sweep.csv"]), content=CONTENT | st.just(b"name,budget\n1,2"))
def test_sweep_files(tmp_path, name, content):
    """A sweep directory whose sweep.json or sweep.csv was damaged: the sweep is refused in one line before any
    training, and its directory is left as it was."""
    from mlx_llm.errors import MLXLLMError
    from mlx_llm.runs.sweep import run_sweep
    from mlx_llm.runs.sweep_table import load_table
    from test_sweep import SMALL

    root = fresh(tmp_path)
    (root / name).write_bytes(content)
    before = snapshot(root)
    if name == "sweep.json":
        with pytest.raises(MLXLLMError) as err:
            run_sweep(SMALL, root, progress=False)
    else:
        try:
            load_table(root / name, lambda line: None)
        except MLXLLMError as exc:
            err = pytest.ExceptionInfo.from_exc_info((type(exc), exc, exc.__traceback__))
        else:
            err = None
    assert err is None or "\n" not in str(err.value)
    assert snapshot(root) == before


GRAD_ARGS = st.fixed_dictionaries({}, optional={
    "seed": st.one_of(st.integers(-2**70, 2**70), st.floats(), st.text(max_size=3), st.none(), st.booleans()),
    "leaves": st.one_of(st.none(), st.text(max_size=4), st.lists(st.text(max_size=4), max_size=2), st.integers()),
    "eps": st.one_of(st.floats(), st.integers(-3, 3), st.text(max_size=3)),
    "directions": st.one_of(st.integers(-3, 40), st.floats(), st.none()),
    "central": st.one_of(st.booleans(), st.integers(0, 2), st.none())})
GRAD_F = {"scalar": lambda p: jnp_sum_sq(p), "tuple": lambda p: (jnp_sum_sq(p), 1.0),
          "vector": lambda p: p["w"] * 2.0, "int": lambda p: 3, "float32": lambda p: jnp_sum_sq(p, "float32")}
GRAD_PARAMS = {"float": {"w": np.linspace(0.1, 1.0, 4)}, "ints": {"w": np.arange(4)}, "empty": {},
               "nested": {"a": {"w": np.ones(3)}, "b": np.zeros((0,))}, "array": np.ones(2)}


def jnp_sum_sq(p, dtype=None):
    import jax
    import jax.numpy as jnp

    leaves = [x.astype(dtype) if dtype else x for x in jax.tree.leaves(p)]
    return sum(jnp.sum(x ** 2) for x in leaves) if leaves else jnp.float64(0.0)


@SETTINGS
@given(f=st.sampled_from(sorted(GRAD_F)), params=st.sampled_from(sorted(GRAD_PARAMS)), kwargs=GRAD_ARGS)
def test_check_grads_arguments(f, params, kwargs):
    """``check_grads`` with random arguments: a report, or an ``InputError`` naming what was wrong — never another
    exception; a correct function it reports as passing."""
    from mlx_llm.errors import InputError
    from mlx_llm.gradcheck import check_grads

    try:
        report = check_grads(GRAD_F[f], GRAD_PARAMS[params], **kwargs)
    except InputError as exc:
        assert "\n" not in str(exc)
    else:
        assert f in ("scalar", "float32") and report.ok, report


@SETTINGS
@given(flags=st.lists(st.sampled_from(["--only", "--budget", "--time-limit", "--out", "--markdown", "--quick"]),
                      max_size=4), data=st.data())
def test_device_check_flags(tmp_path, flags, data):
    """The device check's flags with hostile values, checked as ``main`` checks them before running anything: a
    run's parts and limits, or a one-line refusal (``BadFlag``, argparse's exit 2) — and nothing written."""
    import importlib

    device_check = importlib.import_module("experiments.device_check")
    root = fresh(tmp_path)
    (root / "results.json").write_bytes(data.draw(CONTENT))
    argv = []
    for flag in flags:
        if flag == "--quick":
            argv.append(flag)
            continue
        value = data.draw(HOSTILE | st.sampled_from(["training", "decode,moe", "moe=5", str(root / "results.json"),
                                                     str(root / "out"), str(root / "results.json" / "x")]))
        argv += [flag, value]
    before = snapshot(root)
    try:
        args = device_check.parse_args(argv)
    except SystemExit as exc:
        assert exc.code == 2
        return
    try:
        if args.markdown:
            device_check.markdown(device_check.read_results(args.markdown))
        else:
            parts, limits = device_check.checked(args)
            assert parts and all(p in device_check.PARTS for p in parts)
            assert args.budget is None or args.budget > 0
    except device_check.BadFlag as exc:
        assert "\n" not in str(exc)
    assert snapshot(root) == before
