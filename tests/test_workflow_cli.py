"""The researcher's workflow through the command line: --set, compute-sized runs, warmup-stable-decay branches,
the profiler and the HLO dump, per-layer diagnostics and the TensorBoard tracker, on a tiny byte-level model."""

import json
from pathlib import Path

import numpy as np
import pytest

from helpers import TINY, cli, cli_in_process, snapshot
from mlx_llm.config import ModelConfig, TrainConfig

pytestmark = pytest.mark.slow

B, T = 4, 32


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("workflow")
    corpus = root / "corpus"
    corpus.mkdir()
    rng = np.random.default_rng(0)
    for i in range(6):
        (corpus / f"m{i}.py").write_text("".join(f"def f{j}(x):\n    return x * {rng.integers(9)} + {i}\n"
                                                 for j in range(60)))
    TINY.to_json(root / "model.json")
    return root


def train(ws: Path, out: Path, *flags, subprocess: bool = False):
    args = ("train", "--out", out, "--config", ws / "model.json", "--data", ws / "corpus", "--extensions", ".py",
            "--tokenizer", "byte", "--val-percent", 20, "--batch-size", B, "--seq-len", T, "--eval-tokens", 256,
            "--log-interval", 1, "--no-progress", "--sample-tokens", 4, "--cache-dir", ws / "cache",
            "--warmup-steps", 1, *flags)
    return cli(*args) if subprocess else cli_in_process(*args)


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


# ----- --set -------------------------------------------------------------------------------------------------
def test_set_changes_the_written_configs(ws, tmp_path):
    proc = train(ws, tmp_path / "run", "--steps", 2, "--set", "model.d_model=32", "--set", "train.lr=2e-3",
                 "--set", "train.eval_interval=2", "--set", "model.mixer_pattern=attn")
    assert proc.returncode == 0, proc.stderr
    cfg = ModelConfig.from_json(tmp_path / "run" / "config.json")
    tcfg = TrainConfig.from_json(tmp_path / "run" / "train_config.json")
    assert cfg.d_model == 32 and cfg.n_layers == TINY.n_layers and tcfg.lr == 2e-3 and tcfg.eval_interval == 2


@pytest.mark.parametrize("sets,message", [
    (["model.d_modle=32"], "ModelConfig has no field 'd_modle'; did you mean d_model?"),
    (["model.d_model=abc"], "'abc' is not an integer"),
    (["model.d_model=-4"], "ModelConfig.d_model = -4 is invalid"),
    (["train.lr=fast"], "'fast' is not a number"),
    (["train.skip_spikes=maybe"], "'maybe' is not a boolean"),
    (["optim.lr=1"], "this command has no 'optim' settings"),
    (["lr=1"], "give SECTION.FIELD=VALUE"),
    (["train.lr=1e-3", "train.lr=2e-3"], "contradicts"),
])
def test_bad_set_is_refused_in_one_line_and_writes_nothing(ws, tmp_path, sets, message):
    (tmp_path / "run").mkdir()
    before = snapshot(tmp_path)
    proc = train(ws, tmp_path / "run", "--steps", 2, *[a for s in sets for a in ("--set", s)])
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert snapshot(tmp_path) == before and not any((tmp_path / "run").iterdir())


def test_sample_tokens_zero_samples_nothing_and_a_negative_count_is_refused(ws, tmp_path):
    proc = train(ws, tmp_path / "none", "--steps", 3, "--sample-tokens", 0)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "none" / "summary.json").read_text())["sample"] is None
    assert not (tmp_path / "none" / "sample.txt").exists() and "sample:" not in proc.stdout
    proc = train(ws, tmp_path / "bad", "--steps", 3, "--sample-tokens", -3)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "mlx-llm train: error: sample_tokens = -3 is invalid: the closing sample's length must be an integer >= 0 (0: no sample)")
    assert not (tmp_path / "bad").exists()


def test_set_and_its_own_flag_must_agree(ws, tmp_path):
    proc = train(ws, tmp_path / "run", "--steps", 2, "--lr", "1e-3", "--set", "train.lr=2e-3")
    assert proc.returncode == 2 and "contradicts" in proc.stderr


# ----- compute-sized runs ----------------------------------------------------------------------------------
def flops_per_token_by_hand(cfg: ModelConfig, vocab: int) -> float:
    """6·N_mm + 12·L·T·h·d_h with N_mm the matmul weights (attention, SwiGLU, the unembedding)."""
    d, h, g, k, m, L = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head, cfg.d_ff, cfg.n_layers
    n_mm = L * (2 * d * h * k + 2 * d * g * k + 3 * d * m) + d * vocab
    return 6 * n_mm + 12 * L * T * h * k


def test_target_flops_sets_the_steps_the_formula_gives(ws, tmp_path):
    C = 5.0e8  # ≈ 60 steps of the tiny model
    proc = train(ws, tmp_path / "run", "--target-flops", C)
    assert proc.returncode == 0, proc.stderr
    vocab = ModelConfig.from_json(tmp_path / "run" / "config.json").vocab_size
    want = round(C / (flops_per_token_by_hand(TINY, vocab) * B * T))
    assert TrainConfig.from_json(tmp_path / "run" / "train_config.json").steps == want and want > 1
    record = json.loads((tmp_path / "run" / "run.json").read_text())["provenance"]["sizing"]
    assert record["steps"] == want and record["target_flops"] == C
    assert record["flops_per_token"] == flops_per_token_by_hand(TINY, vocab)
    assert f"{want:,} steps" in proc.stdout


def test_tokens_per_param_sets_the_steps(ws, tmp_path):
    proc = train(ws, tmp_path / "run", "--tokens-per-param", 0.5)
    assert proc.returncode == 0, proc.stderr
    cfg = ModelConfig.from_json(tmp_path / "run" / "config.json")
    want = round(0.5 * cfg.non_embedding_param_count() / (B * T))
    assert TrainConfig.from_json(tmp_path / "run" / "train_config.json").steps == want


@pytest.mark.parametrize("flags,message", [
    (["--target-flops", "1e12", "--steps", "5"], "--target-flops and --steps each set the steps"),
    (["--target-flops", "1e12", "--time-budget", "5"], "--time-budget and --target-flops each set the steps"),
    (["--target-flops", "1e12", "--tokens-per-param", "20"], "give one of --target-flops and --tokens-per-param"),
    (["--target-flops", "-1"], "target_flops = -1.0 is invalid"),
])
def test_sizing_conflicts_are_refused(ws, tmp_path, flags, message):
    proc = train(ws, tmp_path / "run", *flags)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()


# ----- warmup-stable-decay branches ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def wsd_run(ws):
    out = ws / "wsd"
    proc = train(ws, out, "--steps", 8, "--schedule", "wsd", "--decay-fraction", 0.25, "--checkpoint-interval", 2,
                 "--keep-checkpoints", 10, "--eval-interval", 4)
    assert proc.returncode == 0, proc.stderr
    return out


def final_params(run: Path):
    from mlx_llm.runs.load import load_params
    from mlx_llm.runs.record import open_run

    return load_params(open_run(run))


def test_a_branch_to_the_original_steps_reproduces_the_run_bitwise(ws, wsd_run, tmp_path):
    from helpers import assert_trees_equal

    proc = cli_in_process("train", "--out", tmp_path / "b", "--branch-from", wsd_run, "--branch-step", 4,
                          "--steps", 8, "--no-progress", "--sample-tokens", 4, "--cache-dir", ws / "cache")
    assert proc.returncode == 0, proc.stderr
    assert_trees_equal(final_params(tmp_path / "b"), final_params(wsd_run))
    assert [r for r in rows(tmp_path / "b") if "loss" in r] == [r for r in rows(wsd_run) if "loss" in r]
    assert json.loads((tmp_path / "b" / "run.json").read_text())["provenance"]["branch"] == {
        "run": str(wsd_run.resolve()), "step": 4}


def test_a_longer_branch_decays_over_its_own_steps(ws, wsd_run, tmp_path):
    proc = cli_in_process("train", "--out", tmp_path / "b", "--branch-from", wsd_run, "--branch-step", 6,
                          "--steps", 12, "--no-progress", "--sample-tokens", 4, "--cache-dir", ws / "cache")
    assert proc.returncode == 0, proc.stderr
    lr = {r["step"]: r["lr"] for r in rows(tmp_path / "b") if "lr" in r}
    peak = TrainConfig.from_json(wsd_run / "train_config.json").lr
    # 12 steps decay over the last 3: updates s = 0 … 9 at the peak (s = 9 starts the decay at p = 0)
    assert [lr[s] for s in range(2, 11)] == [peak] * 9
    assert lr[12] < lr[11] < peak


@pytest.mark.parametrize("flags,message", [
    (["--branch-step", "8", "--steps", "8"], "--branch-step 8 is not in the stable phase"),
    (["--branch-step", "3", "--steps", "8"], "has no checkpoint 3"),
    (["--branch-step", "4", "--steps", "8", "--lr", "1"], "--lr (given 1.0, the run has"),
    (["--branch-step", "4"], "needs --out NEW, --branch-step S and --steps N"),
    (["--branch-step", "4", "--steps", "8", "--target-flops", "1e9"], "--target-flops and --steps each set"),
])
def test_bad_branches_are_refused(ws, wsd_run, tmp_path, flags, message):
    before = snapshot(wsd_run)
    proc = cli_in_process("train", "--out", tmp_path / "b", "--branch-from", wsd_run, "--no-progress", *flags)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "b").exists() and snapshot(wsd_run) == before


def test_a_cosine_run_cannot_be_branched(ws, tmp_path):
    assert train(ws, tmp_path / "cos", "--steps", 2, "--schedule", "cosine").returncode == 0
    proc = cli_in_process("train", "--out", tmp_path / "b", "--branch-from", tmp_path / "cos", "--branch-step", 2,
                          "--steps", 4)
    assert proc.returncode == 2 and "only a pretraining run with --schedule wsd can be branched" in proc.stderr


# ----- profiler, HLO, diagnostics, trackers -------------------------------------------------------------------
def test_profile_steps_trace_and_dump_hlo(ws, tmp_path):
    # in a process of its own: the profiler once took down an xdist worker that had run other files before this
    # one (a crash in native code, 2026-12-05); a command-line user's process starts fresh like this one
    proc = train(ws, tmp_path / "run", "--steps", 6, "--profile-steps", "3:2", "--dump-hlo", subprocess=True)
    assert proc.returncode == 0, proc.stderr
    traces = list((tmp_path / "run" / "profile").rglob("*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0
    hlo = (tmp_path / "run" / "hlo" / "step.txt").read_text()
    assert hlo.startswith("HloModule") and "ENTRY" in hlo


def test_bad_profile_range_is_refused(ws, tmp_path):
    proc = train(ws, tmp_path / "run", "--steps", 2, "--profile-steps", "3")
    assert proc.returncode == 2 and "--profile-steps '3' is invalid" in proc.stderr


def test_watch_interval_writes_per_layer_rms(ws, tmp_path):
    proc = train(ws, tmp_path / "run", "--steps", 4, "--watch-interval", 2)
    assert proc.returncode == 0, proc.stderr
    by_step = {r["step"]: r for r in rows(tmp_path / "run") if "loss" in r}
    assert [s for s, r in by_step.items() if "param_rms" in r] == [2, 4]
    for kind in ("param_rms", "grad_rms", "update_rms"):
        assert len(by_step[2][kind]["wq"]) == TINY.n_layers and len(by_step[2][kind]["layer"]) == TINY.n_layers
        assert all(v > 0 for v in by_step[2][kind]["layer"])


def test_tensorboard_has_every_loss_of_metrics_at_its_step_and_resume_adds_no_duplicate(ws, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    assert train(ws, run, "--steps", 4, "--tracker", "tensorboard", "--checkpoint-interval", 2).returncode == 0
    # from checkpoint 2: steps 3 and 4 are replayed (identical), and must not reach TensorBoard twice
    proc = train(ws, run, "--steps", 6, "--tracker", "tensorboard", "--resume", "--from-step", 2)
    assert proc.returncode == 0, proc.stderr
    acc = EventAccumulator(str(run / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    losses = [(e.step, e.value) for e in acc.Scalars("loss")]
    assert [s for s, _ in losses] == [1, 2, 3, 4, 5, 6]
    want = {r["step"]: r["loss"] for r in rows(run) if "loss" in r}
    for step, value in losses:
        assert value == pytest.approx(want[step], rel=1e-6)
    # the first session's closing evaluation (step 4) stays in TensorBoard; metrics.jsonl, rewound to step 2 by
    # --from-step, has only the extended run's evaluation at step 6
    val = {e.step: e.value for e in acc.Scalars("val_bpb")}
    assert sorted(val) == [4, 6]
    assert val[6] == pytest.approx(next(r["val_bpb"] for r in rows(run) if r.get("step") == 6 and "val_bpb" in r))


def test_muon_z_loss_and_spike_skipping_train_through_the_command_line(ws, tmp_path):
    proc = train(ws, tmp_path / "run", "--steps", 3, "--optimizer", "muon", "--z-loss", "1e-4", "--skip-spikes")
    assert proc.returncode == 0, proc.stderr
    tcfg = TrainConfig.from_json(tmp_path / "run" / "train_config.json")
    assert (tcfg.optimizer, tcfg.z_loss, tcfg.skip_spikes) == ("muon", 1e-4, True)
    steps = [r for r in rows(tmp_path / "run") if "loss" in r]
    assert [r["spikes_skipped"] for r in steps] == [0, 0, 0] and all(r["z_loss"] > 0 for r in steps)
