"""Training pipeline: exact resume, determinism, divergence, run-directory safety, multi-device, packing."""

import json
import math
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mlx_llm import forward, init_params
from mlx_llm.train.checkpoint import Checkpoints
from mlx_llm.config import TrainConfig
from mlx_llm.errors import CheckpointError, ConfigError
from mlx_llm.train.metrics import TrainingDiverged
from mlx_llm.runs.load import load_params
from mlx_llm.runs.pretrain import train_run
from helpers import TINY, assert_trees_equal, cli, python, spec_for, tiny_cfg, tiny_train

REPO = Path(__file__).resolve().parents[1]


def run(out, corpus_dir, tcfg, *, resume=False, cfg=TINY, cache=None):
    return train_run(out, None if resume else cfg, None if resume else tcfg, None if resume else spec_for(corpus_dir),
                     resume=resume, show_progress=False, cache_dir=cache or out.parent / "cache", sample_tokens=8,
                     log=lambda *a: None)


def final_params(out):
    return jax.device_get(load_params(out))


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, corpus_dir):
    out = tmp_path_factory.mktemp("full") / "run"
    summary = run(out, corpus_dir, tiny_train())
    return out, summary


@pytest.mark.slow
def test_run_directory_contents(full_run):
    out, summary = full_run
    for name in ("config.json", "train_config.json", "run.json", "tokenizer.json", "metrics.jsonl", "loss.png",
                 "sample.txt", "summary.json"):
        assert (out / name).is_file(), name
    assert Checkpoints(out).all_steps() == [3, 6]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in rows if "val_loss" in r] == [3, 6]
    assert summary["val_bpb"] == pytest.approx(summary["val_loss"] / np.log(2) * summary["val_targets"]
                                               / summary["val_bytes"])
    assert rows[-1]["val_loss"] < np.log(263)  # it learned something in 6 steps
    assert summary["sample"].startswith("def ")


def test_resume_is_bitwise_equal_to_uninterrupted(tmp_path, corpus_dir, full_run):
    out = tmp_path / "run"
    run(out, corpus_dir, tiny_train(steps=6))
    # cut the run back to its step-3 checkpoint, as if it had been stopped there, and resume
    shutil.rmtree(out / "checkpoints" / "6")
    run(out, corpus_dir, None, resume=True)
    assert_trees_equal(final_params(out), final_params(full_run[0]))
    assert (out / "metrics.jsonl").read_text() == (full_run[0] / "metrics.jsonl").read_text()


@pytest.mark.slow
def test_same_seed_same_metrics_file(tmp_path, corpus_dir, full_run):
    out = tmp_path / "again"
    run(out, corpus_dir, tiny_train())
    assert (out / "metrics.jsonl").read_text() == (full_run[0] / "metrics.jsonl").read_text()
    other = tmp_path / "seed1"
    run(other, corpus_dir, tiny_train(seed=1, steps=3))
    assert (other / "metrics.jsonl").read_text().splitlines()[0] != \
        (full_run[0] / "metrics.jsonl").read_text().splitlines()[0]


def test_never_overwrites_a_run(full_run, corpus_dir):
    out = full_run[0]
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(CheckpointError, match=r"already holds a run; pass --resume"):
        run(out, corpus_dir, tiny_train())
    with pytest.raises(CheckpointError, match=r"its train config differs.*'lr': \(0.5, 0.01\)"):
        train_run(out, TINY, tiny_train(lr=0.5), spec_for(corpus_dir), resume=True, show_progress=False,
                  log=lambda *a: None)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


@pytest.mark.slow
def test_divergence_stops_and_keeps_last_good_checkpoint(tmp_path, corpus_dir):
    out = tmp_path / "diverge"
    with pytest.raises(TrainingDiverged, match=r"at step (\d+).*last good checkpoint is kept \(step (\d+)"):
        run(out, corpus_dir, tiny_train(lr=1e30, warmup_steps=0, checkpoint_interval=1, steps=6,
                                        clip_norm=1e30))
    steps = Checkpoints(out).all_steps()
    assert steps, "a good checkpoint must survive"
    params = final_params(out)
    assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree.leaves(params))


def test_interrupted_checkpoint_write_leaves_previous_loadable(tmp_path, full_run):
    out = tmp_path / "copy"
    shutil.copytree(full_run[0], out)
    # what orbax leaves when killed mid-write: a temporary directory that was never renamed into place
    partial = out / "checkpoints" / "9.orbax-checkpoint-tmp-1234567890"
    shutil.copytree(out / "checkpoints" / "6", partial)
    for f in list(partial.rglob("*"))[::2]:
        if f.is_file():
            f.write_bytes(b"")
    assert Checkpoints(out).latest_step() == 6
    assert_trees_equal(final_params(out), final_params(full_run[0]))


def test_seq_len_longer_than_model_rejected(tmp_path, corpus_dir):
    with pytest.raises(ConfigError, match=r"seq_len = 128 is longer than the model's max_seq_len = 64"):
        run(tmp_path / "r", corpus_dir, tiny_train(seq_len=128))


@pytest.mark.slow
def test_time_budget_sets_the_steps_it_fits(tmp_path, corpus_dir, monkeypatch):
    """--time-budget measures the step (here replaced by a fixed 50 ms) and trains budget / step-time steps, with
    warmup and intervals capped to them; train_config.json records the steps, so the run resumes as any other."""
    from mlx_llm.train import lm as run_lib

    monkeypatch.setattr(run_lib, "seconds_per_step", lambda cfg, tcfg, corpus: 0.05)
    out = tmp_path / "r"
    summary = train_run(out, TINY, tiny_train(steps=1000, warmup_steps=10, eval_interval=500), spec_for(corpus_dir),
                        show_progress=False, cache_dir=tmp_path / "cache", sample_tokens=4, time_budget=0.2,
                        log=lambda *a: None)
    saved = TrainConfig.from_json(out / "train_config.json")
    assert (saved.steps, saved.warmup_steps, saved.eval_interval, saved.checkpoint_interval) == (4, 3, 4, 3)
    assert summary["steps"] == 4 and Checkpoints(out).latest_step() == 4
    for bad in (0.0, -5.0, float("nan")):
        with pytest.raises(ConfigError, match=r"time budget = .* s is invalid: it must be a positive number"):
            train_run(tmp_path / "bad", TINY, tiny_train(), spec_for(corpus_dir), show_progress=False,
                      cache_dir=tmp_path / "cache", time_budget=bad, log=lambda *a: None)
        assert not (tmp_path / "bad").exists()


def test_the_step_time_is_the_median_of_ten_steps_after_the_warm_ones(monkeypatch):
    """``seconds_per_step`` (what --time-budget sizes a run by) runs the step 1 + 2 + 10 times: the compiling call
    and two warm-up calls are not timed, the median of the last ten is the step time. Here the step is a stand-in
    that advances a fake clock by set durations, so the median is known exactly."""
    from types import SimpleNamespace

    from mlx_llm.train import lm

    durations = iter([100.0, 9.0, 8.0, *[float(s) for s in (7, 1, 2, 3, 4, 5, 6, 8, 9, 10)]])
    clock = [0.0]

    def step(state, batch):
        clock[0] += next(durations)
        return state, {}

    monkeypatch.setattr(lm.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(lm, "jit_train_step", lambda *a, **k: step)
    for name in ("init_state", "optimizer_for"):
        monkeypatch.setattr(lm, name, lambda *a, **k: None)
    monkeypatch.setattr(lm, "place_state", lambda state, mesh: state)
    monkeypatch.setattr(lm, "device_batch", lambda batch, mesh, size: batch)
    corpus = SimpleNamespace(tokenizer=SimpleNamespace(mask_id=None), train_batch=lambda *a, **k: {})
    assert lm.seconds_per_step(TINY, tiny_train(), corpus) == 5.5  # median of 7, 1, 2, …, 10
    assert next(durations, "used up") == "used up"  # exactly 13 calls


def test_segment_mask_isolates_documents_in_a_training_window(corpus_dir):
    """A token's logits do not change when another document in the same packed window changes."""
    from mlx_llm.data.packing import pack_windows

    cfg = TINY
    params = __import__("mlx_llm").init_params(cfg, jax.random.key(0), dtype=jnp.float64)
    bos, eos, pad = 256, 257, 258
    window = np.array([[bos, 10, 11, 12, eos, bos, 20, 21, 22, 23, eos, bos, 30, 31, 32]])
    changed = window.copy()
    changed[0, 6:10] = [40, 41, 42, 43]  # the middle document only
    outs = []
    for w in (window, changed):
        b = pack_windows(w, bos, pad)
        outs.append(forward(params, b["tokens"], cfg, positions_BT=jnp.asarray(b["positions"]),
                            segment_ids_BT=jnp.asarray(b["segment_ids"])))
    np.testing.assert_array_equal(outs[0][0, :5], outs[1][0, :5])  # first document
    np.testing.assert_array_equal(outs[0][0, 11:], outs[1][0, 11:])  # last document
    assert not np.allclose(outs[0][0, 6:10], outs[1][0, 6:10])


@pytest.mark.slow
def test_sigkill_mid_training_resumes_from_last_checkpoint(tmp_path, corpus_dir):
    """A run killed with SIGKILL (no chance to clean up) resumes from its last checkpoint and finishes."""
    import signal
    import time

    model = tmp_path / "model.json"
    TINY.to_json(model)
    out = tmp_path / "killed"
    common = ["--cache-dir", str(tmp_path / "cache"), "--no-progress"]
    args = ["-m", "mlx_llm", "train", "--data", str(corpus_dir), "--extensions", ".py",
            "--val-percent", "20", "--tokenizer", "byte", "--config", str(model), "--out", str(out),
            "--steps", "600", "--warmup-steps", "5", "--batch-size", "4", "--seq-len", "32", "--eval-interval",
            "600", "--eval-tokens", "256", "--checkpoint-interval", "10", "--log-interval", "10",
            "--sample-tokens", "4", *common]
    proc = python(*args, popen=True)
    ckpt_dir = out / "checkpoints"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if ckpt_dir.is_dir() and any(p.name.isdigit() and int(p.name) >= 20 for p in ckpt_dir.iterdir()):
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished or died before it could be killed: " + proc.stderr.read()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = Checkpoints(out).latest_step()
    assert killed_at is not None and 20 <= killed_at < 600
    resumed = cli("train", "--resume", "--out", out, *common)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"from step {killed_at}" in resumed.stdout
    assert Checkpoints(out).latest_step() == 600
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(line)]
    assert steps == list(range(1, 601))  # every step exactly once: none lost, none repeated


@pytest.mark.slow
def test_bfloat16_compute_keeps_float32_master_weights(corpus_dir):
    from mlx_llm.train.parallel import make_mesh, replicated
    from mlx_llm.train.step import device_batch, init_state, jit_train_step, optimizer_for, summed_loss

    tcfg16 = tiny_train(compute_dtype="bfloat16")
    mesh = make_mesh()
    rng = np.random.default_rng(0)
    batch = {"tokens": rng.integers(0, 263, (4, 32)), "targets": rng.integers(0, 263, (4, 32)),
             "mask": np.ones((4, 32), np.float32), "segment_ids": np.zeros((4, 32), np.int32),
             "positions": np.tile(np.arange(32), (4, 1))}
    state = init_state(TINY, tcfg16, optimizer_for(tcfg16))
    l32, n = summed_loss(state.params, batch, TINY, jnp.float32)
    l16, _ = summed_loss(state.params, batch, TINY, jnp.bfloat16)
    assert l16.dtype == jnp.float32  # logits and loss in float32 even when the blocks run in bf16
    assert abs(float(l16 - l32)) / float(n) < 0.02 and float(l16) != float(l32)
    state = jax.device_put(state, replicated(mesh))
    step = jit_train_step(TINY, tcfg16, mesh)
    # the step lowers as a jitted function does (experiments/bench_train reads its compiled memory)
    assert step.lower(state, device_batch(batch, mesh)).compile().memory_analysis().temp_size_in_bytes > 0
    new, metrics = step(state, device_batch(batch, mesh))
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(new.params))
    assert np.isfinite(float(metrics["loss"]))


TINY_MOE = tiny_cfg(vocab_size=263, n_heads=2, n_kv_heads=1, d_head=8, max_seq_len=64, ffn_pattern=("moe", "swiglu"),
                    n_experts=4, moe_top_k=2, moe_d_ff=8, offset_rate=0.01)


@pytest.mark.slow
def test_moe_run_logs_expert_load_and_resumes_bitwise(tmp_path, corpus_dir):
    """An MoE run end to end: offsets move by the control rule and are checkpointed; metrics carry the expert
    load; a resumed run equals the uninterrupted one bit for bit (offsets included)."""
    full, cut = tmp_path / "full", tmp_path / "cut"
    run(full, corpus_dir, tiny_train(), cfg=TINY_MOE)
    rows = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert all(r["moe_layers"] == [0] and len(r["expert_load"][0]) == 4 for r in steps)
    assert all(abs(sum(r["expert_load"][0]) - 1) < 1e-4 and r["load_imbalance"][0] >= 1 for r in steps)
    offsets = final_params(full)["blocks"][0]["router_offset"]
    # 6 steps of ±0.01 (or 0 for an expert exactly at the mean): every offset is a multiple of 0.01, some moved
    assert np.allclose(np.round(offsets / 0.01) * 0.01, offsets, atol=1e-6) and np.abs(offsets).max() > 0
    run(cut, corpus_dir, tiny_train(), cfg=TINY_MOE)
    shutil.rmtree(cut / "checkpoints" / "6")
    run(cut, corpus_dir, None, resume=True)
    assert_trees_equal(final_params(cut), final_params(full))
    assert (cut / "metrics.jsonl").read_text() == (full / "metrics.jsonl").read_text()


@pytest.mark.slow
def test_diffusion_run_trains_evaluates_samples_and_resumes_bitwise(tmp_path, corpus_dir):
    """`--objective diffusion` end to end: the tokenizer gains <|mask|>, the model is made bidirectional, the
    loss (the NELBO per token) falls, eval reports the bound, the closing sample holds no MASK, and a resumed run
    equals the uninterrupted one bit for bit (the noise is a function of (seed, step, micro-batch))."""
    from mlx_llm.runs.record import open_run
    from mlx_llm.runs.sample import generate_from_run
    from mlx_llm.eval.val import evaluate_run

    tcfg = tiny_train(objective="diffusion", grad_accum=2, steps=6)
    full, cut = tmp_path / "full", tmp_path / "cut"
    summary = run(full, corpus_dir, tcfg, cfg=TINY)
    opened = open_run(full)
    cfg, saved_tcfg = opened.cfg, opened.tcfg
    assert not cfg.causal and cfg.vocab_size == 264 and saved_tcfg.objective == "diffusion"
    rows = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
    assert all(np.isfinite(r["loss"]) for r in rows if "loss" in r)
    val = [r["val_loss"] for r in rows if "val_loss" in r]  # the same fixed noise at every evaluation
    assert val[1] < val[0] < math.log(263)  # below the uniform denoiser's bound, ln 263 nats per token
    step, res = evaluate_run(full, cache_dir=tmp_path / "cache")
    assert step == 6 and res.bits_per_byte > 0 and res.n_bytes > 0
    assert evaluate_run(full, cache_dir=tmp_path / "cache")[1] == res  # fixed eval noise: reproducible
    assert "<|mask|>" not in summary["sample"]
    record = generate_from_run(full, "def ", max_new_tokens=6, diffusion_steps=3, sampler="remask")
    assert record["settings"]["sampler"] == "remask" and len(record["continuation_ids"]) <= 6
    assert 263 not in record["continuation_ids"]
    with pytest.raises(ConfigError, match=r"--top-k, --top-p and --beam are autoregressive settings"):
        generate_from_run(full, "def ", max_new_tokens=4, beam_width=2)
    run(cut, corpus_dir, tcfg, cfg=TINY)
    shutil.rmtree(cut / "checkpoints" / "6")
    run(cut, corpus_dir, None, resume=True)
    assert_trees_equal(final_params(cut), final_params(full))
    assert (cut / "metrics.jsonl").read_text() == (full / "metrics.jsonl").read_text()


def test_ar_objective_refuses_a_bidirectional_model(tmp_path, corpus_dir):
    import dataclasses

    with pytest.raises(ConfigError, match=r"bidirectional \(causal = false\): next-token training"):
        run(tmp_path / "ar", corpus_dir, tiny_train(), cfg=dataclasses.replace(TINY, causal=False))
    assert not (tmp_path / "ar").exists()
    with pytest.raises(ConfigError, match=r"TrainConfig.objective = 'mlm' is invalid"):
        tiny_train(objective="mlm")


@pytest.mark.slow
def test_batch_loss_is_token_averaged_and_accumulation_changes_nothing():
    """M20 §10: L = −(1/n) Σ_t b_t log p(x_t | x_<t), n = Σ b_t over the whole batch: rows with unequal numbers
    of selected targets (1 and 7 here) are token-averaged, not row-averaged. Splitting the batch into
    grad_accum = 2 micro-batches (one row each) gives the same loss and the same update."""
    from mlx_llm.objectives.loss import masked_cross_entropy
    from mlx_llm.ops import token_nll
    from mlx_llm.train.parallel import make_mesh
    from mlx_llm.train.step import device_batch, init_state, jit_train_step, optimizer_for

    rng = np.random.default_rng(0)
    ids = rng.integers(0, TINY.vocab_size, (2, 9))
    mask = np.zeros((2, 8), np.float32)
    mask[0, 7], mask[1, 1:] = 1.0, 1.0
    batch = {"tokens": ids[:, :-1], "targets": ids[:, 1:], "mask": mask, "segment_ids": np.zeros((2, 8), np.int32),
             "positions": np.broadcast_to(np.arange(8, dtype=np.int32), (2, 8))}
    mesh, results = make_mesh(), {}
    for accum in (1, 2):
        tcfg = tiny_train(batch_size=2, seq_len=8, grad_accum=accum, warmup_steps=0)
        state = init_state(TINY, tcfg, optimizer_for(tcfg))
        logits = forward(state.params, batch["tokens"], TINY)
        new, metrics = jit_train_step(TINY, tcfg, mesh)(state, device_batch(batch, mesh))
        results[accum] = (float(metrics["loss"]), new.params)
    nll = np.asarray(token_nll(logits, batch["targets"]), np.float64)
    token_mean = (nll * mask).sum() / mask.sum()
    row_mean = ((nll * mask).sum(1) / mask.sum(1)).mean()
    assert abs(token_mean - row_mean) > 0.01  # the two rules differ on this batch
    np.testing.assert_allclose(results[1][0], token_mean, rtol=1e-5)
    np.testing.assert_allclose(float(masked_cross_entropy(logits, batch["targets"], mask)), token_mean, rtol=1e-5)
    np.testing.assert_allclose(results[2][0], results[1][0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(results[1][1]), jax.tree.leaves(results[2][1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_the_compiled_update_is_kept_per_objective_configs_and_shapes():
    """A repeated or resumed fine-tuning run (reward, DPO, RL) gets its compiled update back: the objective makers
    return the same function for the same settings, and the key holds it with the configs, mesh and the trees'
    shapes; another β is another objective, so another program. The cache keeps the last ``maxsize`` keys."""
    from mlx_llm.post import dpo
    from mlx_llm.train.preflight import compiled_update
    from mlx_llm.train.step import Kept, compiled_steps, shapes_key

    compiled_steps.cache_clear()
    cfg, tcfg = tiny_cfg(max_seq_len=16), tiny_train(batch_size=4, seq_len=12)
    params = init_params(cfg, jax.random.key(0))
    side = {"ids": np.zeros((4, 12), np.int32), "target": np.ones((4, 12), np.float32),
            "length": np.full(4, 12, np.int32)}
    batch, frozen = {"chosen": side, "rejected": side}, {"reference": params}
    objective = dpo.make_objective(cfg, 0.1, None)
    assert dpo.make_objective(cfg, 0.1, None) is objective and dpo.make_objective(cfg, 0.2, None) is not objective
    update = compiled_update(cfg, tcfg, objective, params, frozen, batch)
    assert compiled_update(cfg, tcfg, dpo.make_objective(cfg, 0.1, None), params, frozen, batch) is update
    assert compiled_update(cfg, tcfg, dpo.make_objective(cfg, 0.2, None), params, frozen, batch) is not update
    wider = {k: {**side, "ids": np.zeros((4, 13), np.int32)} for k in batch}
    assert shapes_key(wider) != shapes_key(batch) and shapes_key(jax.tree.map(np.copy, batch)) == shapes_key(batch)
    kept, built = Kept(2), []
    for key in "abca":
        kept.get(key, lambda key=key: built.append(key) or key)
    assert built == ["a", "b", "c", "a"]  # "a" was the least recently used when "c" came


def test_the_compiled_step_is_kept_per_configs_and_tracing_settings():
    """A repeated run in one process gets the step compiled for the same configs and mesh back; jax's x64 setting
    (the dtypes the step is traced with) is part of the key, so a float32 run never gets a float64 step."""
    from mlx_llm.train.parallel import make_mesh
    from mlx_llm.train.step import compile_lm_step, compiled_steps

    compiled_steps.cache_clear()
    cfg, tcfg, mesh = tiny_cfg(), tiny_train(), make_mesh()
    step = compile_lm_step(cfg, tcfg, mesh)
    assert compile_lm_step(cfg, tcfg, mesh) is step
    with jax.enable_x64(False):
        single = compile_lm_step(cfg, tcfg, mesh)
    assert single is not step and len(compiled_steps) == 2
    dtypes = lambda compiled: {a.dtype for a in jax.tree.leaves(compiled.out_info)}  # noqa: E731
    assert np.dtype("float64") not in dtypes(single) and np.dtype("float64") in dtypes(step)


def test_the_loss_plot_leaves_the_matplotlib_backend_alone(tmp_path):
    """A run draws loss.png without pyplot: a notebook's backend (inline) and its open figures are untouched."""
    import matplotlib
    import matplotlib.pyplot as plt

    from mlx_llm.train.metrics import plot_losses

    before = matplotlib.get_backend()
    matplotlib.use("svg")
    try:
        figure = plt.figure()
        rows = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.5, "val_loss": 2.7}]
        (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        plot_losses(tmp_path / "metrics.jsonl", tmp_path / "loss.png")
        assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert matplotlib.get_backend() == "svg" and plt.get_fignums() == [figure.number]
    finally:
        plt.close("all")
        matplotlib.use(before)
