"""Helpers shared by the test files (a test file never imports another test file; shared fixtures live in
conftest.py)."""

import contextlib
import hashlib
import io
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

import chex

from mlx_llm import ModelConfig
from mlx_llm.config import TrainConfig
from mlx_llm.runs.configs import DataSpec

REPO = Path(__file__).resolve().parents[1]

# The small dense model tests build when its exact shape does not matter; every field can be overridden.
TINY_CFG = dict(vocab_size=64, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_head=4, d_ff=32, max_seq_len=32)


def tiny_cfg(**overrides) -> ModelConfig:
    """A small valid ModelConfig (``TINY_CFG``) with ``overrides`` applied (any ModelConfig field)."""
    return ModelConfig(**{**TINY_CFG, **overrides})


# The training tests' model (test_train.py, test_reliability.py): byte-level vocabulary, two layers.
TINY = tiny_cfg(vocab_size=263, n_heads=2, n_kv_heads=1, d_head=8, max_seq_len=64)


def tiny_train(**kw):
    base = dict(batch_size=4, seq_len=32, steps=6, lr=1e-2, warmup_steps=2, eval_interval=3, eval_tokens=256,
                checkpoint_interval=3, log_interval=1, seed=0)
    return TrainConfig(**{**base, **kw})


def spec_for(corpus_dir):
    return DataSpec(path=str(corpus_dir), extensions=(".py",), val_percent=20.0, tokenizer="byte")


def finished_tiny_run(out, corpus_dir):
    """A finished 6-step tiny run in ``out`` (checkpoints 3 and 6), quietly; returns ``out``."""
    from mlx_llm.runs.pretrain import train_run

    train_run(out, TINY, tiny_train(), spec_for(corpus_dir), show_progress=False, cache_dir=out.parent / "cache",
              sample_tokens=8, log=lambda *a: None)
    return out


class LazyModule:
    """An optional package (an extra) imported at first use, not when its test file is collected: the suite
    collects quickly and without the extras, and only the tests that use a missing one are skipped."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr):
        import pytest

        return getattr(pytest.importorskip(self._name), attr)


def assert_trees_equal(a, b):
    chex.assert_trees_all_equal_structs(a, b)
    chex.assert_trees_all_equal(a, b)  # bitwise, leaf by leaf


def cli_in_process(*args):
    """``mlx_llm.cli.main`` with captured output, as a CompletedProcess."""
    from mlx_llm import cli as cli_lib

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli_lib.main([str(a) for a in args])
        except SystemExit as exc:  # argparse errors exit
            code = exc.code
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def subprocess_env(devices: int | None = None, shared_cache: bool = True, fast_compile: bool = True,
                   **extra) -> dict:
    """The environment of the suite's subprocesses: JAX on the CPU with the session's XLA flags (conftest.py: fast
    compiles; without them if not ``fast_compile``, for a long-running program that XLA's optimizations make
    faster) plus ``devices`` simulated devices, and the session's compilation cache unless ``shared_cache`` is
    False (a test of the cache's own default place); ``extra`` variables on top."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    if not fast_compile:
        from conftest import FAST_COMPILE

        env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace(FAST_COMPILE, "").strip()
    if devices is not None:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    if not shared_cache:
        env.pop("MLX_LLM_COMPILATION_CACHE", None)
    return {**env, **{k: str(v) for k, v in extra.items()}}


def python(*args, devices: int | None = None, shared_cache: bool = True, env: dict | None = None,
           timeout: float = 600, cwd=REPO, stdin: str | None = None, popen: bool = False, **popen_kw):
    """The suite's one way to run Python in a subprocess: ``python ARGS`` (``-m mlx_llm …``, ``-c CODE …``) from the
    repository, in ``subprocess_env`` (or ``env``), output captured as text. Returns the CompletedProcess, or with
    ``popen`` the running Popen (stdout and stderr piped)."""
    command = [sys.executable, *map(str, args)]
    env = subprocess_env(devices, shared_cache) if env is None else env
    if popen:
        return subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                **popen_kw)
    return subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, input=stdin)


OPTIMIZED_CALL = """
import pickle, sys
import jax
jax.config.update("jax_enable_x64", True)  # as in the suite's own processes (conftest.py)
call, result = sys.argv[1:]
with open(call, "rb") as f:
    func, args, kwargs = pickle.load(f)
out = func(*args, **kwargs)
with open(result, "wb") as f:
    pickle.dump(out, f)
"""


def optimized_call(func, *args, timeout: float = 900, **kwargs):
    """``func(*args, **kwargs)`` in a fresh Python whose XLA compiles optimised code (``subprocess_env`` without the
    fast-compile flags; float64 on, as in the suite), returning its result. For a test whose time goes to running
    one long training rather than to compiling many programs: unoptimised XLA:CPU code runs that training about
    1.5× slower, more than a process start costs. ``func``, the arguments and the result travel pickled (a library
    function travels by name); what the call prints stays in the subprocess."""
    with tempfile.TemporaryDirectory() as tmp:
        call, result = Path(tmp) / "call.pkl", Path(tmp) / "result.pkl"
        call.write_bytes(pickle.dumps((func, args, kwargs)))
        proc = python("-c", OPTIMIZED_CALL, call, result, env=subprocess_env(fast_compile=False), timeout=timeout)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return pickle.loads(result.read_bytes())


def cli(*args, **kw):
    """``mlx-llm ARGS`` in a subprocess (``python -m mlx_llm``; ``python``'s keywords)."""
    return python("-m", "mlx_llm", *args, **kw)


def snapshot(root: Path) -> dict:
    """{relative path: sha256} of every file under ``root``: equal before and after means nothing was written."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(root).rglob("*")) if p.is_file()}
