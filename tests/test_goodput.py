"""Goodput (issue 25): asynchronous checkpoints (manifest once written, verified on resume, resumed bitwise),
time-based checkpoints (--checkpoint-minutes) and jax's persistent compilation cache (--compilation-cache)."""

import json
import shutil
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from orbax.checkpoint._src.handlers import base_pytree_checkpoint_handler as orbax_pytree

from mlx_llm.cli import build_parser
from mlx_llm.cli.commands import compilation_cache
from mlx_llm.cli.parser import subcommands
from mlx_llm.errors import ConfigError
from mlx_llm.runs.configs import RunOptions
from mlx_llm.runs.load import load_params
from mlx_llm.train.checkpoint import MANIFEST_FILE, Checkpoints, abstract_like
from mlx_llm.data.encoding import default_cache_dir
from mlx_llm.train.loop import Cadence
from helpers import assert_trees_equal, cli_in_process, finished_tiny_run, snapshot, tiny_train


@pytest.fixture(scope="module")
def finished(tmp_path_factory, corpus_dir):
    """A finished 6-step tiny run (checkpoints 3 and 6, written asynchronously by the loop)."""
    return finished_tiny_run(tmp_path_factory.mktemp("goodput") / "run", corpus_dir)


def cache_of(finished):
    return ("--cache-dir", finished.parent / "cache")


# ----- asynchronous checkpoints -----------------------------------------------------------------------------------
def test_an_async_save_returns_before_orbax_has_written_it(tmp_path, monkeypatch):
    """``save`` returns while orbax still writes (held here until released); the step appears, with its manifest,
    once ``finish`` has waited for it; older steps are removed only after that; the restore is bitwise."""
    release, original = threading.Event(), orbax_pytree.BasePyTreeCheckpointHandler._write_metadata_file

    async def held(self, *args, **kwargs):
        assert release.wait(60)
        return await original(self, *args, **kwargs)

    monkeypatch.setattr(orbax_pytree.BasePyTreeCheckpointHandler, "_write_metadata_file", held)
    tree = {"w": jnp.arange(12, dtype=jnp.float32).reshape(3, 4), "step": jnp.int32(7)}
    ckpts = Checkpoints(tmp_path, keep=2, asynchronous=True)
    try:
        release.set()
        for step in (1, 2):
            ckpts.save(step, tree)
        ckpts.finish()
        release.clear()
        ckpts.save(3, tree)
        assert not ckpts.step_dir(3).exists() and ckpts.step_dir(1).is_dir()  # in flight: nothing removed yet
        release.set()
        ckpts.finish()
        assert sorted(p.name for p in ckpts.directory.iterdir()) == ["2", "3"]
        listed = json.loads((ckpts.step_dir(3) / MANIFEST_FILE).read_text())["files"]
        assert {p.relative_to(ckpts.step_dir(3)).as_posix() for p in ckpts.step_dir(3).rglob("*")
                if p.is_file() and p.name != MANIFEST_FILE} == set(listed)
        assert ckpts.damage(3) is None
        assert_trees_equal(ckpts.restore(abstract_like(tree), 3), tree)
    finally:
        release.set()
        ckpts.close()


@pytest.mark.slow
def test_async_checkpoints_resume_bitwise_and_damage_is_still_found(tmp_path, finished):
    """Cut back to checkpoint 3 and resumed: the same losses and parameters as the uninterrupted run. A damaged
    async checkpoint is refused as before (nothing written) and --from-step 3 continues to the same run."""
    cut = tmp_path / "cut"
    shutil.copytree(finished, cut)
    shutil.rmtree(cut / "checkpoints" / "6")
    proc = cli_in_process("train", "--resume", "--out", cut, "--no-progress", "--sample-tokens", 8, *cache_of(finished))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (cut / "metrics.jsonl").read_text() == (finished / "metrics.jsonl").read_text()
    assert_trees_equal(jax.device_get(load_params(cut)), jax.device_get(load_params(finished)))
    assert Checkpoints(cut).damage(6) is None
    damaged = tmp_path / "damaged"
    shutil.copytree(finished, damaged)
    path = max((p for p in (damaged / "checkpoints" / "6").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(path.read_bytes())
    data[100:120] = bytes(b ^ 0xFF for b in data[100:120])
    path.write_bytes(bytes(data))
    before = snapshot(tmp_path)
    proc = cli_in_process("train", "--resume", "--out", damaged, *cache_of(finished))
    assert proc.returncode == 2 and "checkpoint 6 is damaged" in proc.stderr and "--from-step 3" in proc.stderr
    assert snapshot(tmp_path) == before
    proc = cli_in_process("train", "--resume", "--out", damaged, "--from-step", 3, "--no-progress",
                          "--sample-tokens", 8, *cache_of(finished))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_trees_equal(jax.device_get(load_params(damaged)), jax.device_get(load_params(finished)))


# ----- time-based checkpoints -------------------------------------------------------------------------------------
def test_a_due_time_checkpoint_reads_back_and_checkpoints():
    tcfg = tiny_train(steps=10, eval_interval=5, checkpoint_interval=5, log_interval=4)
    assert Cadence.after(2, tcfg, False, False) == Cadence(2, False, False, False, False)
    assert Cadence.after(2, tcfg, False, False, due=True) == Cadence(2, False, False, True, True)
    assert Cadence.after(5, tcfg, False, False, due=True) == Cadence.after(5, tcfg, False, False)


@pytest.mark.slow
def test_checkpoint_minutes_adds_checkpoints_and_changes_no_number(tmp_path, finished):
    """--checkpoint-minutes M writes a checkpoint whenever M minutes have passed since the last one (here a tiny
    M: after every step) beside the interval ones; the run's numbers are those of the run without it."""
    out = tmp_path / "timed"
    proc = cli_in_process("train", "--data", json.loads((finished / "run.json").read_text())["data"]["path"],
                          "--extensions", ".py", "--val-percent", 20, "--tokenizer", "byte", "--out", out,
                          "--config", finished / "config.json", "--train-config", finished / "train_config.json",
                          "--keep-checkpoints", 10, "--checkpoint-minutes", 1e-9, "--no-progress",
                          "--sample-tokens", 8, *cache_of(finished))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert Checkpoints(out).all_steps() == [1, 2, 3, 4, 5, 6]
    assert all(Checkpoints(out).damage(s) is None for s in range(1, 7))
    assert (out / "metrics.jsonl").read_text() == (finished / "metrics.jsonl").read_text()
    assert_trees_equal(jax.device_get(load_params(out)), jax.device_get(load_params(finished)))


# ----- the flags --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["train", "sft", "reward", "dpo", "rl"])
def test_every_training_command_has_the_goodput_flags(command):
    parser = subcommands(build_parser())[command]
    flags = {s for a in parser._actions for s in a.option_strings}
    assert {"--checkpoint-minutes", "--compilation-cache", "--trust-unverified"} <= flags
    args = parser.parse_args(["--out", "r", "--checkpoint-minutes", "2.5", "--compilation-cache", "/tmp/x",
                              "--trust-unverified"])
    assert (vars(args)["run.checkpoint_minutes"], vars(args)["run.trust_unverified"]) == (2.5, True)


@pytest.mark.parametrize("fields, message", [
    ({"checkpoint_minutes": 0}, r"RunOptions.checkpoint_minutes = 0 is invalid: it must be a finite number > 0"),
    ({"checkpoint_minutes": float("nan")}, r"RunOptions.checkpoint_minutes = nan is invalid"),
    ({"trust_unverified": "yes"}, r"RunOptions.trust_unverified = 'yes' must be true or false"),
    ({"compilation_cache": " "}, r"--compilation-cache '' is invalid: give a directory, or 'off'")])
def test_run_options_are_validated(fields, message):
    with pytest.raises(ConfigError, match=message):
        RunOptions(**fields)


def test_a_bad_option_is_refused_in_one_line(tmp_path):
    proc = cli_in_process("train", "--out", tmp_path / "new", "--checkpoint-minutes", "-1")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "mlx-llm train: error: RunOptions.checkpoint_minutes = -1.0 is invalid: it must be a finite number > 0"]
    assert not (tmp_path / "new").exists()


# ----- the compilation cache --------------------------------------------------------------------------------------
def test_the_compilation_cache_directory(tmp_path, monkeypatch):
    assert RunOptions().compilation_cache_dir() == str(default_cache_dir().resolve() / "jax")
    assert RunOptions().compilation_cache_dir(tmp_path / "tokens") == str(tmp_path / "tokens" / "jax")
    assert RunOptions(compilation_cache="off").compilation_cache_dir(tmp_path) is None
    monkeypatch.chdir(tmp_path)
    assert RunOptions(compilation_cache="xla").compilation_cache_dir() == str(tmp_path / "xla")


def test_the_compilation_cache_is_set_for_one_command_only(tmp_path):
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    before = [getattr(jax.config, n) for n in names]
    with compilation_cache(str(tmp_path)):
        assert [getattr(jax.config, n) for n in names] == [str(tmp_path), 0.0, -1]
    assert [getattr(jax.config, n) for n in names] == before
    with compilation_cache(None):
        assert [getattr(jax.config, n) for n in names] == before
    assert not any(Path(tmp_path).iterdir())
