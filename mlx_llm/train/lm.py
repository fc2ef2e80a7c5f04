"""The language-model job of the one training loop (pretraining and chat fine-tuning): its compiled step, its
batches, its validation (loss, perplexity, bits per byte; per source for a mixture), and the sizing of a run
(by wall time, FLOPs or tokens per parameter).

The loop dispatches steps asynchronously and reads metrics back only every ``log_interval`` steps (and before
every evaluation or checkpoint), so no host round-trip sits between two steps. A checkpoint is written only
after every step before it has been checked finite: a diverged run keeps its last good checkpoint.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from mlx_llm.config import INT32_MAX, ModelConfig, TrainConfig, check_mtp_window, check_seq_len, wsd_decay_steps
from mlx_llm.errors import ConfigError
from mlx_llm.model import check_tokens
from mlx_llm.scaling.accounting import train_flops_per_token
from mlx_llm.train.loop import Job, ResumePlan, RunInfo, fit
from mlx_llm.train.parallel import agree, check_batch_divisible, local_rows, make_mesh, shard_tree
from mlx_llm.train.step import (EvalResult, compile_lm_step, device_batch, evaluate, init_state, jit_train_step,
                                make_eval_step, optimizer_for, place_state, schedule_config)


def lm_job(cfg: ModelConfig, tcfg: TrainConfig, corpus, mesh, *, trainable=None, frozen=None, model_of=None,
           schedule_steps: int | None = None, step=None) -> Job:
    """The ``loop.Job`` of a language-model run (pretraining or SFT) over ``corpus`` (any object with
    ``train_batch``, ``val_batches`` and ``tokenizer``): the compiled step (``step``, when the pre-flight check
    compiled it already, else ``compile_lm_step``), this process's rows of each batch (token ids checked in range:
    JAX would clamp them), and validation loss / perplexity / bits per byte (``eval_tokens`` caps the targets
    scored). With ``model_of`` the state's params are ``trainable`` (adapters, say) beside ``frozen`` (placed on
    the mesh; never updated, never checkpointed), and ``model_of(trainable, frozen)`` is the model."""
    mask_id = corpus.tokenizer.mask_id
    if step is None:
        step = compile_lm_step(cfg, schedule_config(tcfg, schedule_steps), mesh, mask_id, trainable=trainable,
                               frozen=frozen, model_of=model_of)
    eval_step = make_eval_step(cfg, mesh, tcfg.objective, mask_id, tcfg.kernels())
    frozen = None if frozen is None else shard_tree(frozen, mesh)
    my_rows = local_rows(mesh, tcfg.batch_size)

    def batches(s, state):
        batch = corpus.train_batch(s, batch_size=tcfg.batch_size, seq_len=tcfg.seq_len, seed=tcfg.batch_seed, rows=my_rows)
        check_tokens(batch["tokens"], cfg, "training batch tokens")
        return device_batch(batch, mesh, tcfg.batch_size), {}

    val_sets = val_sets_of(corpus, tcfg, tcfg.eval_tokens or None)

    def val(state) -> dict:
        params = model_params(state.params, frozen, model_of)
        return evaluate_sets(corpus, tcfg, lambda vs: evaluate(eval_step, params, vs, mesh, tcfg.objective),
                             val_sets).as_dict()

    return Job(step, batches, val, frozen=frozen, describe=describe_val, tokens_per_step=tcfg.batch_size * tcfg.seq_len,
               flops_per_token=train_flops_per_token(cfg, tcfg.seq_len), hlo_text=step.as_text)


def model_params(trainable, frozen=None, model_of=None):
    """The model a trained tree stands for, as plain arrays: the tree itself, or ``model_of(trainable, frozen)``
    materialised (adapters folded into their base)."""
    return trainable if model_of is None else jax.tree.map(jnp.asarray, model_of(trainable, frozen))


def describe_val(r: dict) -> str:
    """A validation result in words (bits per byte only when the tokens stand for known bytes)."""
    bpb = f", bits/byte {r['val_bpb']:.4f}" if "val_bpb" in r else ""
    per = [k.partition("/")[2] for k in r if k.startswith("val_loss/")]
    parts = "".join(f"; {n}: {r[f'val_loss/{n}']:.4f}" + (f" ({r[f'val_bpb/{n}']:.4f} b/B)" if f"val_bpb/{n}" in r
                                                           else "") for n in per)
    return f"val loss {r['val_loss']:.4f}, ppl {r['val_ppl']:.2f}{bpb}{parts}"


def val_sets_of(corpus, tcfg: TrainConfig, max_tokens: int | None) -> dict:
    """{source name: ValSet} of a mixture, {"": ValSet} of a single corpus."""
    if hasattr(corpus, "val_sets"):
        return corpus.val_sets(tcfg.seq_len, tcfg.batch_size, max_tokens)
    return {"": corpus.val_batches(tcfg.seq_len, tcfg.batch_size, max_tokens)}


def evaluate_sets(corpus, tcfg: TrainConfig, score, val_sets: dict | None) -> EvalResult:
    """``score`` (ValSet → EvalResult) over each source's val set; a mixture's result is the weighted mean of
    its sources' loss and bits per byte (``per_source`` holds each one), a single corpus's its own result."""
    val_sets = val_sets_of(corpus, tcfg, None) if val_sets is None else val_sets
    results = {name: score(vs) for name, vs in val_sets.items()}
    if list(results) == [""]:
        return results[""]
    loss = corpus.weighted({n: r.loss for n, r in results.items()})
    bpbs = {n: r.bits_per_byte for n, r in results.items()}
    bpb = None if None in bpbs.values() else corpus.weighted(bpbs)
    return EvalResult(loss, float(np.exp(loss)), bpb, sum(r.n_targets for r in results.values()),
                      sum(r.n_bytes for r in results.values()), per_source=results)


def train_loop(run_dir: Path, cfg: ModelConfig, tcfg: TrainConfig, corpus, *, plan: ResumePlan | None = None,
               info: RunInfo = RunInfo(), show_progress: bool, log=print, initial_params=None, frozen=None,
               model_of=None, step=None, options=None) -> dict:
    """A language-model run's ``loop.fit``: ``initial_params`` start a fine-tuning run (instead of a random
    init); with ``model_of`` they are trained beside the frozen ``frozen`` (``lm_job``). ``plan`` and ``info``:
    the run layer's (``loop.fit``); ``step``: the compiled step, when the pre-flight check compiled it;
    ``options``: ``fit``'s (trackers, profiler, HLO dump). Returns {"state", "summary", "params" (the model's
    parameters: with adapters, folded into their base)}."""
    mesh = make_mesh(tcfg.mesh)
    check_batch_divisible(tcfg.batch_size, tcfg.grad_accum, mesh)
    schedule_steps = plan.schedule_steps if plan is not None else None
    optimizer = optimizer_for(schedule_config(tcfg, schedule_steps), cfg=cfg)
    state = place_state(init_state(cfg, tcfg, optimizer, initial_params), mesh)
    job = lm_job(cfg, tcfg, corpus, mesh, trainable=initial_params, frozen=frozen, model_of=model_of,
                 schedule_steps=schedule_steps, step=step)
    out = fit(run_dir, cfg, tcfg, job, state, plan=plan, info=info, show_progress=show_progress, log=log,
              options=options)
    state = out["state"]
    summary = {**out["summary"], "steps": tcfg.steps, "devices": mesh.devices.size}
    return {"state": state, "summary": summary, "params": model_params(state.params, job.frozen, model_of)}


def finalize_config(cfg: ModelConfig, tok, tcfg: TrainConfig) -> ModelConfig:
    """The model's vocabulary is the tokenizer's; the training length must fit the model and be longer than its
    MTP depth; the diffusion objective trains a bidirectional denoiser (``causal`` set false), the AR objective
    needs a causal model."""
    if cfg.vocab_size != tok.vocab_size:
        cfg = dataclasses.replace(cfg, vocab_size=tok.vocab_size, vocab_used=None)
    if tcfg.objective == "diffusion" and cfg.causal:
        cfg = dataclasses.replace(cfg, causal=False)
    if tcfg.objective == "ar" and not cfg.causal:
        raise ConfigError("the model is bidirectional (causal = false): next-token training would let every "
                          "position read its own target; use --objective diffusion, or causal = true")
    check_seq_len(cfg, tcfg)
    check_mtp_window(cfg, tcfg)
    return cfg


def seconds_per_step(cfg: ModelConfig, tcfg: TrainConfig, corpus, rounds: int = 10, warmup: int = 2) -> float:
    """Median wall time of one jitted training step on the run's first batch: ``warmup`` untimed steps after the
    one that compiles, then the median of ``rounds`` timed ones. (A median of 3 right after compiling missed the
    run's own step time by −7 % to +25 % on a quiet 2-core machine — 527 ms measured against the 420 ms/step the
    run then averaged — so runs meant to take equal time did not.)"""
    mesh = make_mesh(tcfg.mesh)
    step = jit_train_step(cfg, tcfg, mesh, corpus.tokenizer.mask_id)
    state = place_state(init_state(cfg, tcfg, optimizer_for(tcfg, cfg=cfg)), mesh)
    rows = local_rows(mesh, tcfg.batch_size)
    batch = device_batch(corpus.train_batch(0, batch_size=tcfg.batch_size, seq_len=tcfg.seq_len, seed=tcfg.batch_seed,
                                            rows=rows), mesh, tcfg.batch_size)
    times = []
    for _ in range(1 + warmup + rounds):  # the first call compiles
        start = time.perf_counter()
        state, m = step(state, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - start)
    return float(np.median(times[1 + warmup:]))


def fit_time_budget(cfg: ModelConfig, tcfg: TrainConfig, corpus, seconds: float, log=print) -> TrainConfig:
    """``tcfg`` with as many steps as fit ``seconds`` of training loop on this machine (step time measured on
    the run's own first batch; evaluations and checkpoints not counted), warmup and intervals capped to them.
    The schedule then decays over exactly those steps; train_config.json records them, so --resume is exact."""
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigError(f"time budget = {seconds!r} s is invalid: it must be a positive number of seconds")
    per_step = seconds_per_step(cfg, tcfg, corpus)
    steps = agree(max(1, int(seconds / per_step)))  # process 0's measurement decides for every process
    if steps > INT32_MAX:
        raise ConfigError(f"a time budget of {seconds:g} s gives {steps:,} steps at {per_step * 1e3:.2g} ms/step, more "
                          f"than the {INT32_MAX:,} a run's step counter holds; give a smaller budget")
    log(f"time budget {seconds:g} s at {per_step * 1e3:.0f} ms/step: {steps} steps")
    return with_steps(tcfg, steps)


def with_steps(tcfg: TrainConfig, steps: int) -> TrainConfig:
    """``tcfg`` with ``steps`` steps, warmup and intervals capped to them (a sized run); under wsd the warmup
    also leaves room for the decay."""
    warmup = min(tcfg.warmup_steps, max(steps - 1, 0))
    if tcfg.schedule == "wsd":
        warmup = min(warmup, steps - wsd_decay_steps(steps, tcfg.decay_fraction))
    return dataclasses.replace(tcfg, steps=steps, warmup_steps=warmup,
                               eval_interval=min(tcfg.eval_interval, steps),
                               checkpoint_interval=min(tcfg.checkpoint_interval, steps))
