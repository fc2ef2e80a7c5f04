"""Test-session setup: float64 everywhere so the seeds' 6–9 digit numbers can be asserted exactly.

Tests of float32 / bfloat16 paths pass explicit dtypes. The library itself never changes jax.config.

Compilation is most of what the suite spends (programs are tiny), so the session
- compiles with XLA:CPU's LLVM optimizations off and its elemental emitters instead of the MLIR fusion emitters
  (``FAST_COMPILE``): about 5× faster compiles of the same programs (the same math to float rounding; the
  experiments and the main job run XLA's defaults);
- shares one persistent compilation cache among its xdist workers, the CLI subprocesses and in-process commands
  (``MLX_LLM_COMPILATION_CACHE``, ``JAX_COMPILATION_CACHE_DIR``: ``<tmp>/mlx_llm-test-jax-cache``, at most 4 GiB,
  least recently used entries dropped): a program compiled once is loaded wherever it is compiled again (another
  test file, another process, the next session on this machine).
Both are environment variables set here, before jax starts its backend, so every subprocess inherits them.

The session also writes bytecode (``__pycache__``, git-ignored) where the environment says not to
(``PYTHONDONTWRITEBYTECODE``): every xdist worker and every subprocess of the suite imports the library and the
test modules again, and without their bytecode each one compiles them from source (0.6 s more per process to
import the training path, about 4 s more to collect the suite; pytest's rewritten test modules are cached the same
way).
"""

import gc
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.dont_write_bytecode = False  # this process's later imports (the test modules, the library)
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)  # the workers and subprocesses
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
if FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()
os.environ.setdefault("MLX_LLM_COMPILATION_CACHE", str(Path(tempfile.gettempdir()) / "mlx_llm-test-jax-cache"))
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.environ["MLX_LLM_COMPILATION_CACHE"])
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import jax  # noqa: E402  (after the environment above)
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from filelock import FileLock  # noqa: E402

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_platforms", "cpu")


FILE_SECONDS = Path(__file__).with_name("file_seconds.json")  # tests/file_seconds.py writes it from a full run


def pytest_collection_modifyitems(config, items):
    """The test files heaviest first (their seconds in the last measured full run; files it does not list after
    them, in collection order), each file's tests in their own order. xdist's ``--dist loadfile`` deals whole
    files to the workers in this order, so the long files start early and the short ones fill the end, instead
    of one worker finishing a long file alone while the other waits."""
    seconds = json.loads(FILE_SECONDS.read_text()) if FILE_SECONDS.is_file() else {}
    first = {}
    for i, item in enumerate(items):
        first.setdefault(item.path, i)
    items.sort(key=lambda item: (-seconds.get(item.path.name, 0.0), first[item.path]))


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_functions():
    """Drop every compiled executable after each test module. The whole suite compiles thousands of functions in
    one process; keeping all of them made XLA:CPU's compiler crash (SIGSEGV inside backend_compile) late in the
    run. Functions shared within a module stay compiled (the library's own cache of every run kind's compiled step
    too, ``train.step.compiled_steps``); across modules they compile again."""
    yield
    from mlx_llm.train.step import compiled_steps

    compiled_steps.cache_clear()
    jax.clear_caches()
    gc.collect()


def _built_once(tmp_path_factory, worker_id: str, name: str, build):
    """``build(dir)`` run once per test session, also when pytest-xdist spreads the session over workers: the
    workers share their session's temporary root, and a file lock lets the first one build while the others wait
    for it (a build that raised leaves no marker, so the next worker builds again and raises the same error)."""
    if worker_id == "master":  # no xdist: this process is the whole session
        return build(tmp_path_factory.mktemp(name))
    root = tmp_path_factory.getbasetemp().parent / name
    with FileLock(str(root) + ".lock"):
        if not (root / "BUILT").exists():
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir()
            (root / "BUILT").write_text(str(build(root)))
        return Path((root / "BUILT").read_text())


@pytest.fixture(scope="session")
def base_run(tmp_path_factory, worker_id):
    """A tiny byte-level pretrained run (tests/tiny_runs.py), shared by the fine-tuning tests."""
    from tiny_runs import pretrain

    return _built_once(tmp_path_factory, worker_id, "base", pretrain)


@pytest.fixture(scope="session")
def arithmetic_sft(tmp_path_factory, worker_id):
    """The preference runs' start: the tiny base fully fine-tuned on arithmetic for 4,000 steps, committed in
    tests/data/arithmetic_sft (its README: how it was built, what it scores) and copied once per session, so
    that the runs which start from it may write beside it. Training that far is chaotic in float rounding (the
    same recipe with and without float64 ends at other exact matches), so every test starts from one fixed draw."""
    def copy(root: Path) -> Path:
        shutil.copytree(Path(__file__).parent / "data" / "arithmetic_sft", root / "sft")
        return root / "sft"

    return _built_once(tmp_path_factory, worker_id, "arithmetic", copy)


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    """A small corpus of 12 word-salad .py files (the training tests' data; see helpers.spec_for)."""
    d = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    words = ["def", "return", "self", "value", "import", "class", "for", "in", "if", "else", "x", "y", "(", ")", ":"]
    for i in range(12):
        lines = [" ".join(rng.choice(words, size=8)) for _ in range(60)]
        (d / f"doc{i:02d}.py").write_text("\n".join(lines) + "\n")
    return d
