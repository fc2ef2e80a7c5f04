"""The run layer (mlx_llm/runs): the record's schema, its one reader, the one loader, and runs written by the
code before the schema (tests/data/legacy_runs: tiny runs of every kind written by main at 588c163)."""

import json
import shutil
from pathlib import Path

import chex
import jax
import numpy as np
import pytest

from mlx_llm.errors import CheckpointError, ConfigError
from mlx_llm.config import LoRAConfig
from mlx_llm.post.reward import load_reward_model
from mlx_llm.runs.configs import DataSpec, DPOConfig, RewardConfig, RLConfig, SFTConfig
from mlx_llm.runs.load import load_params, merge_run
from mlx_llm.runs.record import FORMAT, BaseRef, RunRecord, migrate, open_run
from mlx_llm.runs.resume import check_unchanged
from helpers import cli_in_process, snapshot

LEGACY = Path(__file__).parent / "data" / "legacy_runs"
LEGACY_ROOT = "/tmp/mlx_llm_legacy_runs"  # where main wrote them; relocated into each test's tmp_path
PREMOVE = Path(__file__).parent / "data" / "premove_runs"  # written by the code before the rooms moved (README)
PREMOVE_ROOT = "/tmp/mlx_llm_premove_runs"


@pytest.fixture(scope="module")
def legacy(tmp_path_factory) -> Path:
    """The legacy runs copied elsewhere, their absolute base paths pointed at the copy (as if moved there)."""
    root = tmp_path_factory.mktemp("legacy") / "runs"
    shutil.copytree(LEGACY, root)
    for record in root.glob("*/run.json"):
        record.write_text(record.read_text().replace(LEGACY_ROOT, str(root)))
    return root


# ----- the schema --------------------------------------------------------------------------------------------
def test_record_round_trips_and_is_validated(tmp_path):
    record = RunRecord(kind="dpo", data=DataSpec(tokenizer="byte"), base=BaseRef(str(tmp_path), 7),
                       lora=LoRAConfig(rank=2, alpha=4.0), template={"bos": True},
                       settings=DPOConfig(task="arithmetic", beta=0.2), schedule_steps=40)
    d = json.loads(json.dumps(record.to_dict()))
    assert d["format"] == FORMAT == 2 and d["kind"] == "dpo" and d["settings"]["beta"] == 0.2
    assert RunRecord.from_dict(d) == record
    with pytest.raises(ConfigError, match=r"run kind 'sftt' is invalid: valid kinds are \['pretrain', 'sft'"):
        RunRecord(kind="sftt")
    with pytest.raises(ConfigError, match=r"a dpo run's settings are a DPOConfig, not RLConfig"):
        RunRecord(kind="dpo", base=BaseRef("x", 1), settings=RLConfig(task="arithmetic"))
    with pytest.raises(ConfigError, match=r"a sft run records its base run"):
        RunRecord(kind="sft", settings=SFTConfig(task="arithmetic"))
    with pytest.raises(ConfigError, match=r"unknown run record field\(s\) \['extra'\]"):
        RunRecord.from_dict({**d, "extra": 1})
    with pytest.raises(ConfigError, match=r"unknown DPOConfig field\(s\) \['bta'\]"):
        RunRecord.from_dict({**d, "settings": {"bta": 0.1}})


@pytest.mark.parametrize("make, message", [
    (lambda: DataSpec(tokenizer="bpx"), r"DataSpec.tokenizer = 'bpx' is invalid: valid tokenizers are \['bpe', 'byte'\]"),
    (lambda: DataSpec(val_percent=100), r"DataSpec.val_percent = 100.0 is invalid: it must be in \(0, 100\)"),
    (lambda: DataSpec(vocab_size=0), r"DataSpec.vocab_size = 0 is invalid"),
    (lambda: DataSpec(extensions=","), r"DataSpec.extensions = ',' is invalid"),
    (lambda: SFTConfig(), r"give exactly one of a data file"),
    (lambda: SFTConfig(task="arithmetic", n_train=0), r"SFTConfig.n_train = 0 is invalid"),
    (lambda: RewardConfig(task="arithmetic", model_negatives="yes"), r"model_negatives = 'yes' must be true or false"),
    (lambda: DPOConfig(task="arithmetic", beta=float("inf")), r"DPOConfig.beta = inf is invalid"),
    (lambda: RLConfig(), r"RLConfig.task is required"),
    (lambda: RLConfig(task="arithmetic", k=True), r"RLConfig.k = True is invalid"),
])
def test_kind_configs_refuse_bad_values(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def test_a_new_run_records_that_its_checkpoints_carry_manifests(tmp_path):
    """write_run records ``checksums``: a step of the run without a manifest is then refused
    (train/checkpoint.py); a record without the key (an older run) reads as false."""
    from mlx_llm.config import ModelConfig, TrainConfig
    from mlx_llm.runs.record import write_run

    write_run(tmp_path, ModelConfig(vocab_size=8, d_model=8, n_layers=1, n_heads=1, n_kv_heads=1, d_head=8, d_ff=8,
                                    max_seq_len=8), TrainConfig(), RunRecord(kind="pretrain"))
    stored = json.loads((tmp_path / "run.json").read_text())
    assert stored["checksums"] is True and open_run(tmp_path).record.checksums is True
    del stored["checksums"]
    assert RunRecord.from_dict(stored).checksums is False and RunRecord(kind="pretrain").checksums is False


def test_data_spec_default_vocabulary_is_the_main_jobs():
    from mlx_llm.recipes import MAIN_JOB_VOCAB

    assert DataSpec().vocab_size == MAIN_JOB_VOCAB == 1024
    assert DataSpec(extensions="py, .txt").extensions == (".py", ".txt")


def test_migrate_maps_every_format_1_layout():
    lora = {"rank": 2, "alpha": 4.0, "targets": ["wq"]}
    old_dpo = {"data": {"path": None}, "post": {"kind": "dpo", "base": "/b", "base_step": 3, "lora": lora,
                                                 "template": {"bos": True}, "beta": 0.5, "task": "arithmetic",
                                                 "n_train": None, "data": None, "reference": None,
                                                 "model_negatives": True, "nll_weight": 0.0}}
    new = migrate(old_dpo)
    assert new["kind"] == "dpo" and new["base"] == {"run": "/b", "step": 3} and new["lora"] == lora
    assert new["settings"] == {"beta": 0.5, "task": "arithmetic", "n_train": None, "data": None, "reference": None,
                               "model_negatives": True, "nll_weight": 0.0}
    assert migrate({"data": None, "merged_from": "/r"})["provenance"] == {"merged_from": "/r"}
    assert migrate({"data": None, "imported": {"from": "/h"}})["kind"] == "imported"
    assert migrate({"data": {}, "schedule_steps": 6}) == {"format": 2, "kind": "pretrain", "data": {},
                                                          "schedule_steps": 6, "provenance": {}}


# ----- runs written before the schema ------------------------------------------------------------------------
def test_legacy_runs_open_with_their_kinds_and_settings(legacy):
    kinds = {name: open_run(legacy / name).record for name in
             ("base", "sft_lora", "merged", "reward_lora", "dpo_lora", "rl_lora")}
    assert {k: r.kind for k, r in kinds.items()} == {"base": "pretrain", "sft_lora": "sft", "merged": "merged",
                                                     "reward_lora": "reward", "dpo_lora": "dpo", "rl_lora": "rl"}
    assert kinds["sft_lora"].settings == SFTConfig(task="arithmetic", n_train=64)
    assert kinds["dpo_lora"].settings.beta == 0.2 and kinds["dpo_lora"].base == BaseRef(str(legacy / "sft_lora"), 2)
    assert kinds["rl_lora"].settings == RLConfig(task="arithmetic", k=2, n_train=8)
    assert kinds["base"].data.tokenizer == "byte" and kinds["base"].data.vocab_size == 4096  # as stored
    assert all(r.lora == LoRAConfig(rank=2, alpha=4.0) for k, r in kinds.items() if k.endswith("_lora"))


def test_legacy_lora_runs_load_through_their_base_chain(legacy):
    """The old code merged sft_lora into ``merged``: loading sft_lora through its base now gives the same numbers;
    dpo_lora stacks its adapters on sft_lora's merged model."""
    sft = jax.device_get(load_params(legacy / "sft_lora"))
    chex.assert_trees_all_close(sft, jax.device_get(load_params(legacy / "merged")), rtol=0, atol=0)
    base = jax.device_get(load_params(legacy / "base"))
    assert np.max(np.abs(sft["blocks"]["wq"] - base["blocks"]["wq"])) > 0  # the adapters act
    dpo = jax.device_get(load_params(legacy / "dpo_lora"))
    assert dpo["blocks"]["wq"].shape == sft["blocks"]["wq"].shape
    rm = load_reward_model(legacy / "reward_lora")
    assert rm.head.shape == (16,) and rm.cfg.d_model == 16
    with pytest.raises(ConfigError, match=r"is a reward model"):
        load_params(legacy / "reward_lora")


@pytest.mark.parametrize("name", ["sft_lora", "dpo_lora", "rl_lora"])
def test_export_merged_takes_every_lora_kind(legacy, tmp_path, name):
    before = snapshot(legacy)
    out = merge_run(legacy / name, tmp_path / "merged")
    merged = open_run(out)
    assert merged.kind == "merged" and merged.record.provenance["merged_from"] == str((legacy / name).resolve())
    chex.assert_trees_all_close(jax.device_get(load_params(out)), jax.device_get(load_params(legacy / name)),
                                rtol=0, atol=0)
    assert snapshot(legacy) == before  # reading and merging wrote nothing into the runs


def test_merge_refuses_runs_without_adapters_and_reward_models(legacy, tmp_path):
    with pytest.raises(ConfigError, match=r"is not a fine-tuning run with LoRA adapters \(it is a pretrain run\): there is nothing to merge"):
        merge_run(legacy / "base", tmp_path / "m")
    with pytest.raises(ConfigError, match=r"is a reward model"):
        merge_run(legacy / "reward_lora", tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_open_run_creates_nothing(tmp_path, legacy):
    with pytest.raises(CheckpointError, match=r"is not a run directory"):
        open_run(tmp_path / "absent")
    assert not (tmp_path / "absent").exists()
    empty = tmp_path / "copy"
    shutil.copytree(legacy / "base", empty)
    shutil.rmtree(empty / "checkpoints")
    run = open_run(empty)
    assert run.latest_step() is None and run.checkpoint_steps() == []
    with pytest.raises(CheckpointError, match=r"no checkpoint in .*: nothing to load"):
        load_params(run)
    assert not (empty / "checkpoints").exists()
    (empty / "run.json").write_text("{")
    with pytest.raises(CheckpointError, match=r"run directory .* is damaged"):
        open_run(empty)


def test_one_resume_rule_names_every_changed_field(legacy):
    run = open_run(legacy / "dpo_lora")
    check_unchanged(run, {"settings": {"beta": 0.2}, "train": {"steps": 99, "mesh": "data=2"}})  # allowed
    with pytest.raises(ConfigError, match=r"--resume continues a run exactly as it was configured: settings.beta "
                                          r"\(given 0.5, the run has 0.2\); lora.rank \(given 4, the run has 2\)"):
        check_unchanged(run, {"settings": {"beta": 0.5}, "lora": {"rank": 4}})
    with pytest.raises(ConfigError, match=r"train.lr \(given 0.1"):
        check_unchanged(run, {"train": {"lr": 0.1}})


# ----- runs written before the rooms moved ------------------------------------------------------------------------
@pytest.mark.slow
def test_runs_written_before_the_moves_open_resume_evaluate_and_export(tmp_path, monkeypatch):
    """A pretraining run and a LoRA SFT run on it, written by the code before train/, runs/, post/ and the data
    pipeline were split (tests/data/premove_runs/README.md): today's code opens them, extends each by resuming,
    evaluates the base on its validation split, exports it to transformers' format and merges the adapters."""
    root = tmp_path / "runs"
    shutil.copytree(PREMOVE, root)
    for record in root.glob("*/run.json"):
        record.write_text(record.read_text().replace(PREMOVE_ROOT, str(root)))
    monkeypatch.chdir(root)  # the base recorded its corpus as the relative path it was given
    base, sft = root / "base", root / "sft_lora"
    assert (open_run(base).kind, open_run(sft).kind, open_run(sft).record.base) == ("pretrain", "sft", BaseRef(str(base), 4))
    before = jax.device_get(load_params(sft))
    proc = cli_in_process("eval", "--run", base, "--cache-dir", tmp_path / "cache")
    assert proc.returncode == 0 and "bits/byte" in proc.stdout, proc.stderr
    proc = cli_in_process("export", "--run", base, "--to", tmp_path / "hf")
    assert proc.returncode == 0 and (tmp_path / "hf" / "model.safetensors").is_file(), proc.stderr
    merged = merge_run(sft, tmp_path / "merged")
    chex.assert_trees_all_close(jax.device_get(load_params(merged)), before, rtol=0, atol=0)
    # the LoRA run first: once its base has moved on, it is refused ("its base changed")
    for args in (["sft", "--resume", "--out", sft, "--steps", 4],
                 ["train", "--resume", "--out", base, "--steps", 6, "--cache-dir", tmp_path / "cache"]):
        proc = cli_in_process(*args, "--no-progress")
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert open_run(base).latest_step() == 6 and open_run(sft).latest_step() == 4
    steps = [json.loads(line)["step"] for line in (base / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and steps[-1] == 6
