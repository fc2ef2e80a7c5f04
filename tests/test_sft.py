"""Supervised fine-tuning (mlx_llm.post.sft): packing, a pretrained run taught arithmetic (held-out exact match
above the base's), LoRA runs (adapters-only checkpoints, frozen base, merge, bitwise resume)."""

import json
import shutil

import chex
import jax
import numpy as np
import pytest

from mlx_llm import forward
from mlx_llm.config import TrainConfig
from mlx_llm.errors import ConfigError, DataError
from mlx_llm.data.chat import ChatTemplate
from mlx_llm.config import LoRAConfig
from mlx_llm.eval.replies import eval_task
from mlx_llm.post.sft import pack, sft_run
from mlx_llm.runs.configs import SFTConfig
from mlx_llm.runs.load import load_params, merge_run
from mlx_llm.runs.record import open_run
from mlx_llm.data.tokenizer import ByteTokenizer
from helpers import optimized_call
from tiny_runs import BASE_CFG, SFT


def test_pack_keeps_conversations_apart():
    tok, template = ByteTokenizer(), ChatTemplate()
    convs = [template.encode([{"role": "user", "content": q}, {"role": "assistant", "content": a}], tok)
             for q, a in (("1+1", "2"), ("22+2", "24"), ("what?", "no"))]
    rows = pack(convs, 20, tok.pad_id)
    sizes = [len(ids) - 1 for ids, _ in convs]  # next-token positions of each conversation
    assert rows["tokens"].shape == (2, 20) and sizes == [8, 10, 11]
    assert rows["segment_ids"][0].tolist() == [1] * 8 + [2] * 10 + [0] * 2
    assert rows["segment_ids"][1].tolist() == [1] * 11 + [0] * 9
    assert rows["positions"][0, 8:18].tolist() == list(range(10))
    first_ids, first_target = convs[0]
    assert rows["tokens"][0, :8].tolist() == first_ids[:-1].tolist()
    assert rows["mask"][0, :8].tolist() == first_target[1:].astype(float).tolist() and rows["mask"][0].sum() == 5
    assert rows["mask"][1, 11:].sum() == 0 and rows["mask"][0, 18:].sum() == 0
    with pytest.raises(DataError, match=r"does not fit seq_len \+ 1 = 11"):
        pack(convs, 10, tok.pad_id)


@pytest.mark.slow
def test_full_sft_teaches_arithmetic(base_run, tmp_path):
    """150 full SFT steps from the tiny base take the answer tokens' loss from the base's 4.9 nats to below 2.0
    (measured 1.679 and 1.656 for seeds 0 and 1, the same to 2e-6 with and without float64: this short a run is
    not yet chaotic), with every parameter trained and the run recorded as a full SFT run."""
    tcfg = TrainConfig(**SFT, steps=150, eval_interval=150, checkpoint_interval=150)
    summary = optimized_call(sft_run, tmp_path / "sft", base_run, tcfg=tcfg,
                             settings=SFTConfig(task="arithmetic", n_train=20_000, eval_examples=64),
                             show_progress=False)
    rows = [json.loads(line) for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 1 and rows[0]["loss"] > 4.0  # the base on answer tokens
    assert summary["val_loss"] < 2.0, summary
    assert summary["trainable_params"] == BASE_CFG.param_count()
    run = open_run(tmp_path / "sft")
    assert run.record.kind == "sft" and run.record.settings.task == "arithmetic" and run.record.lora is None
    assert run.cfg == BASE_CFG


@pytest.mark.slow
def test_the_committed_sft_start_answers_a_fifth_of_the_problems(arithmetic_sft):
    """The preference tests' start (tests/data/arithmetic_sft: 4,000 steps from the base, its README): held-out
    exact match from 0 to 0.239 over all 1,000 held-out problems, and the same weights, loaded and evaluated
    here, above 0.15 on 400 of them."""
    summary = json.loads((arithmetic_sft / "summary.json").read_text())
    assert summary["base_heldout_accuracy"] == 0.0 and summary["heldout_accuracy"] == 0.239
    run = open_run(arithmetic_sft)
    assert run.record.kind == "sft" and run.record.lora is None and run.cfg == BASE_CFG
    res = eval_task(load_params(arithmetic_sft), run.cfg, ByteTokenizer(), "arithmetic", n=400)
    assert res["n"] == 400 and res["accuracy"] > 0.15, res


@pytest.mark.slow
def test_lora_run_checkpoints_adapters_merges_and_resumes(base_run, tmp_path):
    tcfg = TrainConfig(**{**SFT, "warmup_steps": 2}, steps=6, eval_interval=3, checkpoint_interval=3, log_interval=1)
    lora = LoRAConfig(rank=4, alpha=8.0, targets=("wq", "wv"))
    base_before = jax.device_get(load_params(base_run))
    full, cut = tmp_path / "full", tmp_path / "cut"
    settings = SFTConfig(task="addition2", n_train=500, eval_examples=16)
    summary = sft_run(full, base_run, tcfg=tcfg, settings=settings, lora_cfg=lora, show_progress=False,
                      log=lambda *a: None)
    assert summary["trainable_params"] == 2 * 4 * (64 + 64) + 2 * 4 * (64 + 32)  # L · r(d_in + d_out), wq and wv
    # the base run is untouched, the LoRA run's checkpoint holds only the adapters
    chex.assert_trees_all_equal(jax.device_get(load_params(base_run)), base_before)
    ckpt_files = sum(f.stat().st_size for f in (full / "checkpoints").rglob("*") if f.is_file())
    base_files = sum(f.stat().st_size for f in (base_run / "checkpoints").rglob("*") if f.is_file())
    assert ckpt_files < base_files / 4
    merged_params = load_params(full)
    tokens = np.arange(12, dtype=np.int32)[None]
    assert np.max(np.abs(np.asarray(forward(merged_params, tokens, BASE_CFG))
                         - np.asarray(forward(base_before, tokens, BASE_CFG)))) > 1e-6  # trained adapters act
    out = merge_run(full, tmp_path / "merged")
    merged = open_run(out)
    assert merged.kind == "merged" and merged.record.lora is None and merged.record.base is None
    chex.assert_trees_all_close(jax.device_get(load_params(out)), jax.device_get(merged_params))
    # bitwise resume
    sft_run(cut, base_run, tcfg=tcfg, settings=settings, lora_cfg=lora, show_progress=False, log=lambda *a: None)
    shutil.rmtree(cut / "checkpoints" / "6")
    sft_run(cut, resume=True, show_progress=False, log=lambda *a: None)
    chex.assert_trees_all_equal(jax.device_get(load_params(cut)), jax.device_get(merged_params))
    assert (cut / "metrics.jsonl").read_text() == (full / "metrics.jsonl").read_text()
    # extending it (the one resume rule of every kind): the record and train_config.json say what was done
    sft_run(cut, resume=True, changes={"steps": 8}, show_progress=False, log=lambda *a: None)
    extended = open_run(cut)
    assert extended.tcfg.steps == 8 and extended.record.schedule_steps == 6 and extended.latest_step() == 8


def test_sft_refusals_leave_nothing(base_run, tmp_path):
    tcfg = TrainConfig(**{**SFT, "warmup_steps": 1}, steps=2)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    cases = [
        (dict(task="arithmetic", data=bad), ConfigError, r"give exactly one of a data file"),
        (dict(data=bad), DataError, r"bad.jsonl:1: the conversation has no assistant turn"),
        (dict(task="arithmetic", tcfg=TrainConfig(**{**SFT, "seq_len": 128, "warmup_steps": 1}, steps=2)), ConfigError,
         r"seq_len = 128 is longer than the base model's max_seq_len = 64"),
        (dict(task="arithmetic", lora_cfg=LoRAConfig(targets=("in_x",))), ConfigError,
         r"LoRA targets \['in_x'\] are not weights of this model"),
    ]
    for kwargs, error, message in cases:
        kwargs = {"tcfg": tcfg, **kwargs}
        data_kwargs = {k: kwargs.pop(k) for k in ("task", "data") if k in kwargs}
        with pytest.raises(error, match=message):
            sft_run(tmp_path / "out", base_run, show_progress=False, log=lambda *a: None,
                    settings=SFTConfig(**data_kwargs), **kwargs)
        assert not (tmp_path / "out").exists()
