"""The `mlx-llm` command: user errors give one line, exit 2, and touch nothing. Runs that train go through the real
entry point in a subprocess; the error cases call ``cli.main`` in this process (the same code below the
``__main__`` guard, without a ~2 s interpreter start per case), and a few of them also go through a subprocess."""

import json
from pathlib import Path

import pytest

from helpers import cli, cli_in_process, snapshot

REPO = Path(__file__).resolve().parents[1]




@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A corpus, a finished tiny run, a few config files; shared by the error cases (which must not alter it)."""
    ws = tmp_path_factory.mktemp("cli")
    corpus = ws / "corpus"
    corpus.mkdir()
    for i in range(8):
        (corpus / f"m{i}.py").write_text("".join(f"def f{j}(x):\n    return x * {j} + {i}\n" for j in range(40)))
    (ws / "empty").mkdir()
    (ws / "bad.json").write_text("{not json")
    model = dict(vocab_size=263, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_head=8, d_ff=16, max_seq_len=32)
    (ws / "model.json").write_text(json.dumps(model))
    (ws / "model_unknown.json").write_text(json.dumps({**model, "n_expert": 4}))
    (ws / "model_gqa.json").write_text(json.dumps({**model, "n_kv_heads": 3}))
    run = ws / "run"
    proc = cli("train", "--data", corpus, "--out", run, "--config", ws / "model.json", "--tokenizer", "byte",
               "--steps", 4, "--warmup-steps", 1, "--batch-size", 2, "--seq-len", 16, "--eval-interval", 2,
               "--eval-tokens", 64, "--checkpoint-interval", 2, "--sample-tokens", 5, "--no-progress",
               "--cache-dir", ws / "cache")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "bits/byte" in proc.stdout and "sample:" in proc.stdout
    return ws


@pytest.mark.slow
def test_eval_and_generate_on_a_run(workspace):
    proc = cli("eval", "--run", workspace / "run", "--cache-dir", workspace / "cache")
    assert proc.returncode == 0, proc.stderr
    assert "step 4: val loss" in proc.stdout and "bits/byte" in proc.stdout
    proc = cli("generate", "--run", workspace / "run", "--prompt", "def ", "--max-new-tokens", 6, "--json")
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout)
    assert record["checkpoint_step"] == 4 and record["prompt_ids"][0] == 256 and record["seed"] == 0
    assert len(record["continuation_ids"]) <= 6


CASES = [
    (["train", "--data", "{ws}/missing_dir", "--out", "{ws}/new0"], r"missing_dir"),
    (["train", "--data", "{ws}/empty", "--out", "{ws}/new1"], r"no .* files|empty|nothing"),
    (["train", "--config", "{ws}/bad.json", "--out", "{ws}/new2"], r"bad.json' is not valid JSON"),
    (["train", "--config", "{ws}/model_unknown.json", "--out", "{ws}/new3"],
     r"unknown ModelConfig field\(s\) \['n_expert'\]"),
    (["train", "--config", "{ws}/model_gqa.json", "--out", "{ws}/new4"],
     r"n_heads = 2 is not divisible by n_kv_heads = 3"),
    (["train", "--data", "{ws}/corpus", "--out", "{ws}/run", "--tokenizer", "byte"],
     r"already holds a run; pass --resume"),
    (["train", "--resume", "--out", "{ws}/empty"], r"holds no run"),
    (["train", "--resume", "--out", "{ws}/run", "--lr", "0.1"], r"--resume continues a run exactly as it was"),
    (["train", "--data", "{ws}/corpus", "--out", "{ws}/new5", "--config", "{ws}/model.json", "--seq-len", "64",
      "--tokenizer", "byte"], r"seq_len = 64 is longer than the model's max_seq_len = 32"),
    (["train", "--steps", "0", "--out", "{ws}/new6"], r"TrainConfig.steps = 0 is invalid"),
    (["train", "--compute-dtype", "float16"], r"invalid choice: 'float16'"),
    (["train", "--bogus"], r"unrecognized arguments: --bogus"),
    (["train", "--objective", "mlm"], r"invalid choice: 'mlm'"),
    (["sft", "--task", "arithmetic", "--out", "{ws}/sft0"], r"sft needs --base RUN and one of --data"),
    (["sft", "--base", "{ws}/empty", "--task", "arithmetic", "--out", "{ws}/sft1"], r"is not a run directory"),
    (["sft", "--base", "{ws}/run", "--task", "arithmetic", "--data", "{ws}/bad.json", "--out", "{ws}/sft2"],
     r"argument --data: not allowed with argument --task"),
    (["sft", "--base", "{ws}/run", "--task", "poetry", "--out", "{ws}/sft3"], r"invalid choice: 'poetry'"),
    (["sft", "--base", "{ws}/run", "--data", "{ws}/bad.json", "--out", "{ws}/sft4", "--seq-len", "32"],
     r"bad.json:1: not JSON"),
    (["sft", "--base", "{ws}/run", "--task", "addition2", "--out", "{ws}/sft5", "--seq-len", "32", "--lora-rank", "0"],
     r"LoRA rank = 0 is invalid"),
    (["sft", "--base", "{ws}/run", "--task", "addition2", "--out", "{ws}/sft6", "--seq-len", "32", "--lora-rank", "2",
      "--lora-targets", "wq,embed"], r"LoRA targets \['wq', 'embed'\] are invalid"),
    (["sft", "--base", "{ws}/run", "--task", "addition2", "--out", "{ws}/sft7"],
     r"seq_len = 128 is longer than the base model's max_seq_len = 32"),
    (["sft", "--base", "{ws}/run", "--task", "addition2", "--out", "{ws}/run", "--seq-len", "32"],
     r"already holds a run; pass --resume"),
    (["sft", "--resume", "--task", "addition2", "--out", "{ws}/run"], r"--resume continues a run exactly"),
    (["sft", "--base", "{ws}/run", "--task", "name_function", "--out", "{ws}/sft8", "--seq-len", "32"],
     r"name_function conversation\(s\) are longer than seq_len \+ 1 = 33 tokens; nothing is truncated"),
    (["eval-task", "--run", "{ws}/empty", "--task", "arithmetic"], r"is not a run directory"),
    (["export-merged", "--run", "{ws}/run", "--out", "{ws}/merged"], r"is not a fine-tuning run"),
    (["eval", "--run", "{ws}/empty"], r"is not a run directory"),
    (["generate", "--run", "{ws}/run", "--prompt", "x", "--temperature", "0"], r"temperature"),
    (["generate", "--run", "{ws}/run", "--prompt", "x", "--max-new-tokens", "100"], r"max_seq_len|too long"),
    # found by probing (issue 21): settings accepted and silently ignored before
    (["train", "--resume", "--out", "{ws}/run", "--vocab-size", "512"], r"--vocab-size \(given 512, the run has 1024\)"),
    (["train", "--resume", "--out", "{ws}/run", "--tokenizer", "bpe"], r"--tokenizer \(given 'bpe', the run has 'byte'\)"),
    (["train", "--resume", "--out", "{ws}/run", "--extensions", ".txt"],
     r"--extensions \(given \['.txt'\], the run has \['.py', '.txt', '.md'\]\)"),
    (["train", "--resume", "--out", "{ws}/run", "--val-percent", "10"], r"--val-percent \(given 10.0, the run has 5.0\)"),
    (["train", "--resume", "--out", "{ws}/run", "--time-budget", "5"], r"--time-budget sizes a new run"),
    (["sft", "--resume", "--out", "{ws}/run"], r"is a pretrain run, not a sft run"),
    (["sft", "--base", "{ws}/run", "--task", "addition2", "--out", "{ws}/sft9", "--seq-len", "32", "--lora-alpha", "4"],
     r"--lora-alpha set\(s\) LoRA adapters: give --lora-rank R too"),
    (["dpo", "--base", "{ws}/run", "--task", "arithmetic", "--out", "{ws}/dpo0", "--objective", "ar"],
     r"unrecognized arguments: --objective ar"),
    (["rl", "--base", "{ws}/run", "--task", "arithmetic", "--out", "{ws}/rl0", "--eval-tokens", "8"],
     r"unrecognized arguments: --eval-tokens 8"),
    (["generate", "--run", "{ws}/run", "--prompt", "x", "--diffusion-steps", "3"], r"are settings of a diffusion run"),
    (["generate", "--run", "{ws}/run", "--prompt", "x", "--beam", "100000"],
     r"beam width = 100000 is invalid: it must be between 1 and the vocabulary size 263"),
    (["generate", "--run", "{ws}/run", "--prompt", "x", "--seed", "-1"], r"seed = -1 is invalid"),
]


# an empty corpus, an argparse error, a bad data file: also through the real entry point
SUBPROCESS_CASES = {i for i, (args, _) in enumerate(CASES)
                    if args[:3] == ["train", "--data", "{ws}/empty"] or "--bogus" in args or "{ws}/sft4" in args}


@pytest.mark.slow
@pytest.mark.parametrize("args, message, run", [(a, m, cli_in_process) for a, m in CASES]
                         + [(CASES[i][0], CASES[i][1], cli) for i in sorted(SUBPROCESS_CASES)],
                         ids=[" ".join(c[0][:3]) for c in CASES] + [f"subprocess {i}" for i in sorted(SUBPROCESS_CASES)])
def test_user_errors(workspace, args, message, run):
    before = snapshot(workspace)
    proc = run(*[a.format(ws=workspace) for a in args])
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    err = proc.stderr.strip()
    assert "Traceback" not in proc.stderr
    assert len(err.splitlines()) == 1, err
    import re

    assert re.search(message, err), err
    assert snapshot(workspace) == before  # nothing pre-existing modified, no run directory created


@pytest.mark.slow
def test_batch_not_divisible_by_devices(workspace):
    before = snapshot(workspace)
    proc = cli("train", "--data", workspace / "corpus", "--out", workspace / "new7", "--config",
               workspace / "model.json", "--tokenizer", "byte", "--batch-size", 3, "--seq-len", 16,
               "--cache-dir", workspace / "cache2", devices=2)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "batch_size = 3 (micro-batch 3 with grad_accum = 1) cannot be split over the 2 batch shards" in proc.stderr
    assert snapshot(workspace) == before


@pytest.mark.slow
def test_train_and_generate_a_hybrid_config(workspace, tmp_path):
    """`train --config` and `generate` on a Mamba + attention hybrid (the configs in experiments/configs/ have
    the same shape, only larger): the run trains, evaluates, samples and decodes through the mixed state."""
    hybrid = dict(vocab_size=263, d_model=16, n_layers=2, mixer_pattern=["mamba", "attn"], ffn_pattern=["none", "swiglu"],
                  n_heads=2, n_kv_heads=1, d_head=8, d_ff=16, ssm_state=4, max_seq_len=32, tie_embeddings=True)
    (tmp_path / "hybrid.json").write_text(json.dumps(hybrid))
    proc = cli("train", "--data", workspace / "corpus", "--out", tmp_path / "run", "--config", tmp_path / "hybrid.json",
               "--tokenizer", "byte", "--steps", 2, "--warmup-steps", 1, "--batch-size", 2, "--seq-len", 16,
               "--eval-interval", 2, "--eval-tokens", 64, "--sample-tokens", 4, "--no-progress",
               "--cache-dir", workspace / "cache")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "bits/byte" in proc.stdout and "sample:" in proc.stdout
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["mixer_pattern"] == ["mamba", "attn"] and saved["ssm_scan"] == "fused"
    proc = cli("generate", "--run", tmp_path / "run", "--prompt", "def ", "--max-new-tokens", 5, "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(json.loads(proc.stdout)["continuation_ids"]) <= 5


def test_shipped_variant_configs_load():
    from mlx_llm import ModelConfig

    kinds = {}
    for path in sorted((REPO / "experiments" / "configs").glob("*.json")):
        cfg = ModelConfig.from_json(path)
        kinds[path.stem] = (set(cfg.mixer_pattern), set(cfg.ffn_pattern))
    assert kinds["mamba"] == ({"mamba"}, {"none"}) and kinds["hybrid"] == ({"mamba", "attn"}, {"none", "swiglu"})
    assert kinds["dense"] == ({"attn"}, {"swiglu"}) and "moe" in kinds["moe"][1]


@pytest.mark.slow
def test_sft_lora_eval_task_and_export_merged(workspace, tmp_path):
    """`sft` with LoRA on a built-in task, then `eval-task` on it and `export-merged` to a plain run that
    `generate` reads."""
    proc = cli("sft", "--base", workspace / "run", "--task", "addition2", "--out", tmp_path / "sft", "--steps", 2,
               "--warmup-steps", 1, "--batch-size", 2, "--seq-len", 32, "--eval-interval", 2, "--checkpoint-interval",
               2, "--lora-rank", 2, "--train-examples", 50, "--eval-examples", 4, "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # rank 2 on wq (16 → 16) and wv (16 → 8) of the one layer: 2·(16 + 16) + 2·(16 + 8)
    assert "trainable parameters 112" in proc.stdout and "held-out exact match" in proc.stdout
    proc = cli("eval-task", "--run", tmp_path / "sft", "--task", "addition2", "--examples", 4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "on addition2: held-out exact match" in proc.stdout and "of 4)" in proc.stdout
    before = snapshot(tmp_path / "sft")
    proc = cli_in_process("sft", "--resume", "--out", tmp_path / "sft", "--lora-alpha", 4)
    assert proc.returncode == 2 and "--lora-alpha (given 4.0, the run has 16.0)" in proc.stderr, proc.stderr
    assert snapshot(tmp_path / "sft") == before
    proc = cli("export-merged", "--run", tmp_path / "sft", "--out", tmp_path / "merged")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = cli("generate", "--run", tmp_path / "merged", "--prompt", "What", "--max-new-tokens", 3, "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = cli("chat", "--run", tmp_path / "sft", "--max-new-tokens", 4, stdin="What is 12 + 30?\n\n")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("model>") == 1
