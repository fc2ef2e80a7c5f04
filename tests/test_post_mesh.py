"""The one training loop for every run kind: reward, DPO and every RL estimator (and LoRA) on a 2-device mesh
(`--mesh data=2`) with gradient accumulation give the losses of one device; `--eval-tokens` changes what
post-training evaluates."""

import json
from pathlib import Path

import numpy as np
import pytest

from mlx_llm.config import TrainConfig
from mlx_llm.post import prologue as loop
from mlx_llm.post import pairs as pairs_lib
from mlx_llm.post.sft import load_data
from mlx_llm.data.chat import ChatTemplate
from mlx_llm.runs.configs import RL_ALGORITHMS
from helpers import python

REPO = Path(__file__).resolve().parents[1]
RL = ["rl", "--task", "arithmetic", "--train-examples", "16", "--batch-size", "2", "--k", "2", "--eval-examples", "2",
      "--lr", "1e-4"]
# every estimator, each with its own defaults (the KL in the reward or the loss, each loss aggregation, dapo's
# dynamic sampling, gspo's sequence ratio), trained in full; ppo in minibatches of the rollout. LoRA adapters (a
# trainable tree of another shape: what the mesh shards and accumulation sums) with a token-mean estimator and ppo
# — the estimators' losses do not depend on which tree trains, so the other four add no case
ESTIMATOR = {a: ["--algorithm", a] for a in RL_ALGORITHMS} | {
    "ppo": ["--algorithm", "ppo", "--epochs", "2", "--minibatches", "2", "--batch-size", "4"]}
LORA = ["--lora-rank", "2", "--lora-alpha", "4"]
KINDS = {"reward": ["reward", "--task", "arithmetic", "--train-examples", "64", "--batch-size", "4"],
         "dpo": ["dpo", "--task", "arithmetic", "--train-examples", "64", "--batch-size", "4", "--eval-examples", "2",
                 "--beta", "0.5"],
         **{f"rl_{a}": [*RL, *flags] for a, flags in ESTIMATOR.items()},
         **{f"rl_{a}_lora": [*RL, *ESTIMATOR[a], *LORA] for a in ("grpo", "ppo")}}
COMMON = ["--steps", "2", "--warmup-steps", "1", "--seq-len", "64", "--eval-interval", "2", "--log-interval", "1",
          "--no-progress"]
SCRIPT = """
import sys
from mlx_llm import cli
base, out, *extra = sys.argv[1:]
kinds = {kinds!r}
for kind, (command, *flags) in kinds.items():
    assert cli.main([command, "--base", base, "--out", out + "/" + kind, *{common!r}, *flags, *extra]) == 0, kind
"""


def run_kinds(base: Path, out: Path, devices: int, extra: list[str]) -> dict:
    proc = python("-c", SCRIPT.format(kinds=KINDS, common=COMMON), base, out, *extra, devices=devices, timeout=1200)
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


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS))
def test_two_devices_with_accumulation_give_the_losses_of_one(one_and_two, kind):
    one, two, root = one_and_two
    assert [r["step"] for r in one[kind]] == [r["step"] for r in two[kind]] == [1, 2]
    assert one[kind][0]["grad_norm"] > 1e-3  # a real gradient is compared, not two zeros
    # RL samples its batch from the current policy: after step 1 the two runs' parameters differ by float
    # rounding, and sampling (a discontinuous function of them) may then draw other replies; step 1's batch is
    # the same draw from the same parameters in both.
    compared = one[kind][:1] if kind.startswith("rl") else one[kind]
    # an RL loss at the first update is a mean of terms that cancel (centred advantages, ρ = 1: "group"'s is 0 up
    # to rounding), so it is compared at float32's resolution of the terms (1e-5), not 1e-6 of nothing
    tol = 1e-5 if kind.startswith("rl") else 1e-6
    for a, b in zip(compared, two[kind]):
        assert abs(a["loss"] - b["loss"]) <= tol, (a, b)
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


MOE_CFG = dict(vocab_size=64, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, d_head=8, max_seq_len=16,
               ffn_pattern=("moe",), n_experts=4, moe_top_k=2, moe_d_ff=8, offset_rate=0.1)


def pair_batch(rng, n=4, width=12):
    side = lambda: {"ids": rng.integers(0, 64, (n, width)).astype(np.int32),  # noqa: E731
                    "target": np.concatenate([np.zeros((n, 6)), np.ones((n, width - 6))], axis=1).astype(np.float32),
                    "length": np.full(n, width, np.int32)}
    return {"chosen": side(), "rejected": side()}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dpo", "reward"])
def test_moe_offsets_follow_the_control_rule_in_preference_runs(kind):
    """M20 §15's rule moves the balancing offsets after every step of a full fine-tuning preference run, by the
    policy's expert loads of that step (the reward model's trunk sits at ``trainable["model"]``)."""
    import jax
    import jax.numpy as jnp

    from mlx_llm import ModelConfig, init_params
    from mlx_llm.layers.moe import apply_offset_rule
    from mlx_llm.post import dpo, reward
    from mlx_llm.train.step import init_state, make_update, moe_offsets, optimizer_for

    cfg = ModelConfig(**MOE_CFG)
    params = init_params(cfg, jax.random.key(0))
    tcfg = TrainConfig(batch_size=4, seq_len=12, steps=2, warmup_steps=0, grad_accum=2)
    if kind == "dpo":
        objective, trainable, path = dpo.make_objective(cfg, 0.1, None), params, ()
    else:
        objective, path = reward.make_objective(cfg, None), ("model",)
        trainable = {"model": params, "reward_head": jnp.ones((cfg.d_model,), jnp.float32)}
    update = jax.jit(make_update(objective, tcfg, optimizer_for(tcfg), offsets=moe_offsets(cfg, path)))
    state = init_state(cfg, tcfg, optimizer_for(tcfg), trainable)
    new, m = update(state, pair_batch(np.random.default_rng(0)), {"reference": params})
    model_of = (lambda t: t) if kind == "dpo" else (lambda t: t["model"])
    before, after = model_of(state.params)["blocks"], model_of(new.params)["blocks"]
    want = apply_offset_rule(before, m["expert_load"], cfg.offset_rate)["router_offset"]
    assert float(jnp.abs(after["router_offset"]).max()) > 0  # the offsets moved
    np.testing.assert_array_equal(np.asarray(after["router_offset"]), np.asarray(want))
    positions = 11 if kind == "dpo" else 12  # DPO's forward reads ids[:-1] (next tokens); the reward model all 12
    # every routed assignment of the step, both sides of the 4 pairs, both micro-batches: layers · 8 rows · T · k
    assert float(jnp.sum(m["expert_load"]["router_offset"])) == 2 * 8 * positions * cfg.moe_top_k
