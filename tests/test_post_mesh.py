"""The one training loop for every run kind: reward, DPO and RL runs on a 2-device mesh (`--mesh data=2`) with
gradient accumulation give the losses of one device; `--eval-tokens` changes what post-training evaluates."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mlx_llm.config import TrainConfig
from mlx_llm.post import loop
from mlx_llm.post import pairs as pairs_lib
from mlx_llm.post.sft import load_data
from mlx_llm.post.chat import ChatTemplate

REPO = Path(__file__).resolve().parents[1]
KINDS = {"reward": ["--task", "arithmetic", "--train-examples", "64", "--batch-size", "4"],
         "dpo": ["--task", "arithmetic", "--train-examples", "64", "--batch-size", "4", "--eval-examples", "2",
                 "--beta", "0.5"],
         "rl": ["--task", "arithmetic", "--train-examples", "16", "--batch-size", "2", "--k", "2",
                "--eval-examples", "2", "--lr", "1e-4"]}
COMMON = ["--steps", "2", "--warmup-steps", "1", "--seq-len", "64", "--eval-interval", "2", "--log-interval", "1",
          "--no-progress"]
SCRIPT = """
import sys
from mlx_llm import cli
base, out, *extra = sys.argv[1:]
kinds = {kinds!r}
for kind, flags in kinds.items():
    assert cli.main([kind, "--base", base, "--out", out + "/" + kind, *{common!r}, *flags, *extra]) == 0, kind
"""


def run_kinds(base: Path, out: Path, devices: int, extra: list[str]) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT.format(kinds=KINDS, common=COMMON), str(base), str(out),
                           *extra], env=env, cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {}
    for kind in KINDS:
        lines = [json.loads(line) for line in (out / kind / "metrics.jsonl").read_text().splitlines()]
        rows[kind] = [r for r in lines if "loss" in r]
    return rows


@pytest.fixture(scope="module")
def one_and_two(arithmetic_sft, tmp_path_factory):
    """From the shared SFT run (conftest.py), which answers a fifth of the problems: RL's rewards are not all 0."""
    root = tmp_path_factory.mktemp("mesh")
    one = run_kinds(arithmetic_sft, root / "one", 1, [])
    two = run_kinds(arithmetic_sft, root / "two", 2, ["--mesh", "data=2", "--grad-accum", "2"])
    return one, two, root


@pytest.mark.parametrize("kind", list(KINDS))
def test_two_devices_with_accumulation_give_the_losses_of_one(one_and_two, kind):
    one, two, root = one_and_two
    assert [r["step"] for r in one[kind]] == [r["step"] for r in two[kind]] == [1, 2]
    assert one[kind][0]["grad_norm"] > 1e-3  # a real gradient is compared, not two zeros
    for a, b in zip(one[kind], two[kind]):
        assert abs(a["loss"] - b["loss"]) <= 1e-6, (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * max(1.0, a["grad_norm"]), (a, b)
    train = json.loads((root / "two" / kind / "train_config.json").read_text())
    assert train["mesh"] == "data=2" and train["grad_accum"] == 2


def test_eval_tokens_caps_what_post_training_scores(base_run):
    base = loop.load_base(base_run)
    tcfg = TrainConfig(batch_size=4, seq_len=64, steps=1, warmup_steps=0)
    data = pairs_lib.load_pairs(base, tcfg, task="arithmetic", n_train=8)
    everything = sum(n for _, n in data.val_batches(4))
    capped = sum(n for _, n in data.val_batches(4, max_tokens=40))
    reply_tokens = [int(np.sum(c[1]) + np.sum(r[1])) for c, r in data.val]
    assert everything == len(data.val) and capped == int(np.searchsorted(np.cumsum(reply_tokens), 40) + 1)
    sft = load_data(base.tok, ChatTemplate(), 64, task="arithmetic", n_train=8)
    full, few = sft.val_batches(64, 4), sft.val_batches(64, 4, max_tokens=30)
    assert 30 <= few.n_targets < full.n_targets
