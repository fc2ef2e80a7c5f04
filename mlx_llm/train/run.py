"""A training run end to end: run directory, tokenizer, corpus, the loop, metrics, checkpoints, plot, sample.

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
import numpy as np

from mlx_llm.post import lora as lora_lib
from mlx_llm.scaling.accounting import param_count, steps_for_flops, steps_for_tokens_per_param, train_flops_per_token
from mlx_llm.runs.branch import Branch, branch_configs, start_branch
from mlx_llm.runs.configs import DataSpec, Sizing
from mlx_llm.runs.load import checkpoint_step, load_params
from mlx_llm.runs.record import RunRecord, open_run, write_run
from mlx_llm.runs.resume import RESUME_MAY_CHANGE, plan_resume, record_resume, schedule_config
from mlx_llm.runs.sample import closing_sample
from mlx_llm.train.checkpoint import check_run_dir, locked_run_dir
from mlx_llm.train.corpora import open_data
from mlx_llm.config import ModelConfig, TrainConfig, wsd_decay_steps
from mlx_llm.errors import CheckpointError, ConfigError
from mlx_llm.model import check_tokens
from mlx_llm.train.loop import Job, fit
from mlx_llm.train.metrics import METRICS_FILE, PLOT_FILE, plot_losses, write_summary
from mlx_llm.train.parallel import (agree, check_batch_divisible, gather_to_host, is_main_process, local_rows, make_mesh,
                                   shard_tree, sync)
from mlx_llm.train.preflight import check_fits
from mlx_llm.train.step import (EvalResult, compiled_train_step, device_batch, evaluate, init_state, jit_train_step,
                                make_eval_step, optimizer_for, place_state)

SAMPLE_FILE = "sample.txt"


# ----- run directory ----------------------------------------------------------------------------------------
def check_same_run(run_dir: Path, cfg: ModelConfig | None, tcfg: TrainConfig | None, spec: DataSpec | None,
                   changes: dict | None = None):
    """On resume, what was asked must equal what the run holds (None: take the run's), except the fields of
    ``RESUME_MAY_CHANGE``, which ``tcfg`` or ``changes`` ({field: value}) may set. Returns the configs to use.
    (The CLI compares only the flags given, by ``runs.resume.check_unchanged``; this is the library's check of
    whole configs.)"""
    run = open_run(run_dir)
    if set(changes or ()) - RESUME_MAY_CHANGE:
        raise ConfigError(f"a resumed run may change only {sorted(RESUME_MAY_CHANGE)} of its train config, not "
                          f"{sorted(set(changes) - RESUME_MAY_CHANGE)}")
    tcfg = dataclasses.replace(run.tcfg if tcfg is None else tcfg, **(changes or {}))
    for name, asked, saved, free in (("model config", cfg, run.cfg, ()),
                                     ("train config", tcfg, run.tcfg, RESUME_MAY_CHANGE),
                                     ("data settings", spec, run.record.data, ())):
        diff = {} if asked is None else {k: (v, getattr(saved, k)) for k, v in dataclasses.asdict(asked).items()
                                         if k not in free and v != getattr(saved, k)}
        if diff:
            raise CheckpointError(f"cannot resume {str(run_dir)!r}: its {name} differs from the one given "
                                  f"(field: (given, saved) = {diff}); resume without changing it, or start a new "
                                  f"run with another --out")
    return run.cfg, tcfg, run.record.data


# ----- the loop ---------------------------------------------------------------------------------------------
def lm_job(cfg: ModelConfig, tcfg: TrainConfig, corpus, mesh, *, frozen=None, lora_cfg=None,
           schedule_steps: int | None = None) -> Job:
    """The ``loop.Job`` of a language-model run (pretraining or SFT) over ``corpus`` (any object with
    ``train_batch``, ``val_batches`` and ``tokenizer``): the compiled step, this process's rows of each batch
    (token ids checked in range: JAX would clamp them), and validation loss / perplexity / bits per byte
    (``eval_tokens`` caps the targets scored). With ``lora_cfg`` the state's params are the adapters and
    ``frozen`` the base they adapt (placed on the mesh; never updated, never checkpointed)."""
    mask_id = corpus.tokenizer.mask_id
    step_fn = compiled_train_step(cfg, schedule_config(tcfg, schedule_steps), mesh, mask_id, lora_cfg)
    eval_step = make_eval_step(cfg, mesh, tcfg.objective, mask_id, tcfg.kernels())
    base = None if lora_cfg is None else shard_tree(frozen, mesh)
    my_rows = local_rows(mesh, tcfg.batch_size)

    def batches(s, state):
        batch = corpus.train_batch(s, batch_size=tcfg.batch_size, seq_len=tcfg.seq_len, seed=tcfg.seed, rows=my_rows)
        check_tokens(batch["tokens"], cfg, "training batch tokens")
        return device_batch(batch, mesh, tcfg.batch_size), {}

    def model_params(state):
        return state.params if lora_cfg is None else lora_lib.merge(base, state.params, lora_cfg)

    val_sets = val_sets_of(corpus, tcfg, tcfg.eval_tokens or None)

    def val(state) -> dict:
        params = model_params(state)
        return evaluate_sets(corpus, tcfg, lambda vs: evaluate(eval_step, params, vs, mesh, tcfg.objective),
                             val_sets).as_dict()

    update = step_fn if lora_cfg is not None else (lambda state, batch, _: step_fn(state, batch))
    return Job(update, batches, val, frozen=base, describe=describe_val, tokens_per_step=tcfg.batch_size * tcfg.seq_len,
               flops_per_token=train_flops_per_token(cfg, tcfg.seq_len), hlo_text=step_fn.as_text)


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


def train_loop(run_dir: Path, cfg: ModelConfig, tcfg: TrainConfig, corpus, *, resume: bool, show_progress: bool,
               log=print, initial_params=None, frozen=None, lora_cfg=None, from_step: int | None = None,
               schedule_steps: int | None = None, on_restored=None, options=None) -> dict:
    """A language-model run's ``loop.fit``: ``initial_params`` start a fine-tuning run (instead of a random
    init); with ``lora_cfg`` they are the adapters over the frozen base ``frozen``. A resume restores the latest
    checkpoint, or ``from_step``; ``schedule_steps``: see ``runs.resume.schedule_config``; ``on_restored``: see
    ``loop.fit``; ``options``: ``fit``'s (trackers, profiler, HLO dump). Returns {"state",
    "summary", "params" (the model's parameters: the base with the adapters folded in, for LoRA)}."""
    mesh = make_mesh(tcfg.mesh)
    check_batch_divisible(tcfg.batch_size, tcfg.grad_accum, mesh)
    optimizer = optimizer_for(schedule_config(tcfg, schedule_steps))
    state = place_state(init_state(cfg, tcfg, optimizer, initial_params), mesh)
    job = lm_job(cfg, tcfg, corpus, mesh, frozen=frozen, lora_cfg=lora_cfg, schedule_steps=schedule_steps)
    out = fit(run_dir, cfg, tcfg, job, state, resume=resume, show_progress=show_progress, log=log,
              from_step=from_step, on_restored=on_restored, options=options)
    state = out["state"]
    params = state.params if lora_cfg is None else lora_lib.merge(job.frozen, state.params, lora_cfg)
    summary = {**out["summary"], "steps": tcfg.steps, "devices": mesh.devices.size}
    return {"state": state, "summary": summary, "params": params}


# ----- whole runs -------------------------------------------------------------------------------------------
def finalize_config(cfg: ModelConfig, tok, tcfg: TrainConfig) -> ModelConfig:
    """The model's vocabulary is the tokenizer's; the training length must fit the model; the diffusion
    objective trains a bidirectional denoiser (``causal`` set false), the AR objective needs a causal model."""
    if cfg.vocab_size != tok.vocab_size:
        cfg = dataclasses.replace(cfg, vocab_size=tok.vocab_size, vocab_used=None)
    if tcfg.objective == "diffusion" and cfg.causal:
        cfg = dataclasses.replace(cfg, causal=False)
    if tcfg.objective == "ar" and not cfg.causal:
        raise ConfigError("the model is bidirectional (causal = false): next-token training would let every "
                          "position read its own target; use --objective diffusion, or causal = true")
    if tcfg.seq_len > cfg.max_seq_len:
        raise ConfigError(f"seq_len = {tcfg.seq_len} is longer than the model's max_seq_len = {cfg.max_seq_len}: "
                          f"lower --seq-len or raise max_seq_len in the model config")
    return cfg


def seconds_per_step(cfg: ModelConfig, tcfg: TrainConfig, corpus, rounds: int = 3) -> float:
    """Median wall time of one jitted training step on the run's first batch, measured after compiling it."""
    mesh = make_mesh(tcfg.mesh)
    step = jit_train_step(cfg, tcfg, mesh, corpus.tokenizer.mask_id)
    state = place_state(init_state(cfg, tcfg, optimizer_for(tcfg)), mesh)
    rows = local_rows(mesh, tcfg.batch_size)
    batch = device_batch(corpus.train_batch(0, batch_size=tcfg.batch_size, seq_len=tcfg.seq_len, seed=tcfg.seed,
                                            rows=rows), mesh, tcfg.batch_size)
    times = []
    for _ in range(rounds + 1):  # the first call compiles
        start = time.perf_counter()
        state, m = step(state, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - start)
    return float(np.median(times[1:]))


def fit_time_budget(cfg: ModelConfig, tcfg: TrainConfig, corpus, seconds: float, log=print) -> TrainConfig:
    """``tcfg`` with as many steps as fit ``seconds`` of training loop on this machine (step time measured on
    the run's own first batch; evaluations and checkpoints not counted), warmup and intervals capped to them.
    The schedule then decays over exactly those steps; train_config.json records them, so --resume is exact."""
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigError(f"time budget = {seconds!r} s is invalid: it must be a positive number of seconds")
    per_step = seconds_per_step(cfg, tcfg, corpus)
    steps = agree(max(1, int(seconds / per_step)))  # process 0's measurement decides for every process
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


def size_run(cfg: ModelConfig, tcfg: TrainConfig, sizing: Sizing, log=print) -> tuple[TrainConfig, dict]:
    """(``tcfg`` with the steps ``sizing`` gives, what was chosen for run.json's provenance): ``--target-flops``
    C → C / (F·B·T) with F the exact training FLOPs per token (``accounting.steps_for_flops``), or
    ``--tokens-per-param`` R → R·N / (B·T). The same steps on every machine."""
    flops = train_flops_per_token(cfg, tcfg.seq_len)
    tokens = tcfg.batch_size * tcfg.seq_len
    if sizing.target_flops is not None:
        steps = steps_for_flops(cfg, tcfg.seq_len, tcfg.batch_size, sizing.target_flops)
        why = f"--target-flops {sizing.target_flops:.4g} at {flops:.4g} FLOPs/token × {tokens:,} tokens/step"
    else:
        n = param_count(cfg, sizing.param_count)
        steps = steps_for_tokens_per_param(cfg, tcfg.seq_len, tcfg.batch_size, sizing.tokens_per_param,
                                           sizing.param_count)
        why = (f"--tokens-per-param {sizing.tokens_per_param:g} × {n:,} {sizing.param_count} parameters / "
               f"{tokens:,} tokens/step")
    sized = with_steps(tcfg, steps)
    log(f"{why}: {steps:,} steps ({steps * tokens * flops:.4g} training FLOPs, {steps * tokens:,} tokens)")
    return sized, {"sizing": {**sizing.to_dict(), "steps": steps, "flops_per_token": flops,
                              "tokens_per_step": tokens, "training_flops": steps * tokens * flops}}


def describe(cfg: ModelConfig, corpus, log) -> None:
    """The run's opening lines: the corpus and the model."""
    mixture = hasattr(corpus, "sources")
    for k, c in enumerate(corpus.corpora if mixture else [corpus]):
        how = "cached" if c.cache_hit else f"encoded in {c.encode_seconds:.1f} s"
        how = "token ids, read as memmaps" if c.cache_path is None else how
        what = f"source {corpus.sources[k].name} (p {corpus.probabilities[k]:.3f})" if mixture else "corpus"
        log(f"{what}: {c.stats.describe()}; train {c.train.n_tokens:,} tokens, val {c.val.n_tokens:,} tokens ({how})")
    active = (f", {cfg.active_param_count():,} active per token" if cfg.active_param_count() != cfg.param_count()
              else "")
    log(f"model: {cfg.param_count():,} parameters ({cfg.non_embedding_param_count():,} non-embedding{active}), "
        f"vocab {cfg.vocab_size}; {jax.device_count()} device(s)")


def run_configs(run_dir: Path, cfg, tcfg, spec, resume: bool, changes, from_step, branch,
                trust_unverified: bool = False) -> tuple:
    """(model config, train config, data spec, resume plan, parent run, provenance) of a pretraining run: the
    ones given (a new run), the run's own with ``changes`` (a resume, checked by ``plan_resume``), or the parent's
    with the branch's steps (a branch, checked by ``branch_configs``)."""
    if from_step is not None and not resume:
        raise ConfigError(f"--from-step {from_step} continues a run from one of its checkpoints: it needs --resume")
    if resume:
        cfg, tcfg, spec = check_same_run(run_dir, cfg, tcfg, spec, changes)
        return cfg, tcfg, spec, plan_resume(run_dir, tcfg, from_step, trust_unverified), None, {}
    if branch is not None:
        parent, tcfg = branch_configs(branch)
        return (parent.cfg, tcfg, parent.record.data, None, parent,
                {"branch": {"run": str(parent.path), "step": branch.step}})
    return cfg, tcfg, spec, None, None, {}


def train_run(run_dir, cfg: ModelConfig | None, tcfg: TrainConfig | None, spec: DataSpec | None, *,
              resume: bool = False, show_progress: bool = True, cache_dir=None, sample_prompt: str = "def ",
              sample_tokens: int = 200, time_budget: float | None = None, log=print, changes: dict | None = None,
              from_step: int | None = None, options=None, sizing: Sizing | None = None,
              branch: Branch | None = None) -> dict:
    """Train (or resume) the run in ``run_dir``; returns the summary dict also written to summary.json.

    Everything that can be checked (paths, lock, corpus, tokenizer, configs, the checkpoint to restore, device
    split) is checked before the run directory is created or written, so a refused run leaves nothing behind; the
    run then holds the directory's lock to its end. On resume, ``changes`` sets fields of ``RESUME_MAY_CHANGE``
    (``{"steps": N}`` extends a run, see ``schedule_config``) and ``from_step`` continues from that checkpoint
    instead of the latest (one after it is damaged, say); the checkpoints after it are set aside, not deleted.
    ``sizing`` sets a new run's steps from its compute (``size_run``); ``branch`` starts a new run from a
    checkpoint of a wsd run, with that run's settings (runs/branch.py); ``options``: ``loop.fit``'s.
    """
    run_dir, main = Path(run_dir), is_main_process()
    if not main:  # every process computes the same; process 0 alone reports and writes
        log, show_progress = (lambda *a, **k: None), False
    check_run_dir(run_dir, resume)
    trust = bool(options is not None and options.trust_unverified)
    cfg, tcfg, spec, plan, parent, provenance = run_configs(run_dir, cfg, tcfg, spec, resume, changes, from_step,
                                                            branch, trust)
    data = open_data(parent.path if parent else run_dir, spec, tcfg.objective)
    tok = data.tokenizer
    cfg = finalize_config(cfg, tok, tcfg)
    if sizing is not None:
        if resume or branch is not None:
            raise ConfigError("--target-flops / --tokens-per-param size a new run; a resumed or branched run keeps "
                              "its settings")
        tcfg, provenance = size_run(cfg, tcfg, sizing, log)
    check_batch_divisible(tcfg.batch_size, tcfg.grad_accum, make_mesh(tcfg.mesh))
    check_fits(cfg, schedule_config(tcfg, plan.schedule_steps if plan else None), mask_id=tok.mask_id)
    if not main:
        sync("corpus")  # process 0 encodes (and caches) first; with a shared cache the others then read it
    corpus = data.build(cache_dir, progress=show_progress)
    if main:
        sync("corpus")
    if time_budget is not None:
        if resume:
            raise ConfigError("--time-budget sizes a new run; a resumed run keeps the steps it was given")
        tcfg = fit_time_budget(cfg, tcfg, corpus, time_budget, log)
    sync("checked")  # every process has checked the directory before process 0 writes to it
    with locked_run_dir(run_dir, resume):
        if resume and main:  # again under the lock: another run may have changed the directory since
            plan = plan_resume(run_dir, check_same_run(run_dir, None, tcfg, None)[1], from_step, trust)
        elif main:
            write_run(run_dir, cfg, tcfg, RunRecord(kind="pretrain", data=spec, provenance=provenance))
            tok.save(run_dir)
            if branch is not None:
                start_branch(run_dir, branch, parent)
                log(f"branch of {parent.path} at step {branch.step}, decaying to {tcfg.steps} steps")
        sync("started")
        describe(cfg, corpus, log)
        out = train_loop(run_dir, cfg, tcfg, corpus, resume=resume or branch is not None, show_progress=show_progress,
                         log=log, from_step=plan.step if plan and plan.from_step else None,
                         schedule_steps=plan.schedule_steps if plan else None,
                         on_restored=(lambda: record_resume(run_dir, tcfg, plan)) if resume and main else None,
                         options=options)
        summary = finish_run(run_dir, out, cfg, tcfg, tok, corpus, sample_prompt, sample_tokens, log)
    return summary


def finish_run(run_dir: Path, out: dict, cfg: ModelConfig, tcfg: TrainConfig, tok, corpus, sample_prompt: str,
               sample_tokens: int, log=print) -> dict:
    """After the loop: the loss plot, the closing sample and summary.json (process 0); the summary."""
    summary = {**out["summary"], "unigram_val_bpb": corpus.unigram_bits_per_byte()}
    params = gather_to_host(out["state"].params)  # whole arrays in every process: the decoder is local
    if is_main_process():
        plot_losses(run_dir / METRICS_FILE, run_dir / PLOT_FILE)
        if tok.external:  # token ids without their tokenizer: there is no text to show
            summary["sample"] = None
            log("no closing sample: this run's tokens are ids from an external tokenizer (mlx-llm generate --run "
                "takes and prints ids)")
        else:
            summary["sample"] = closing_sample(params, cfg, tok, sample_prompt, sample_tokens, seed=tcfg.seed,
                                               objective=tcfg.objective)
            (run_dir / SAMPLE_FILE).write_text(summary["sample"], encoding="utf-8")
        write_summary(run_dir, summary)
    sync("written")
    return summary


def evaluate_run(run_dir, *, cache_dir=None, step: int | None = None, kernels=None) -> tuple[int, EvalResult]:
    """Val loss, perplexity and bits per byte of a run's latest (or given) checkpoint on its whole val split;
    ``kernels``: the execution paths (default "auto"), whatever the run was trained with."""
    run = open_run(run_dir)
    cfg, tcfg = run.cfg, run.tcfg
    if run.record.data is None:
        raise ConfigError(f"{run.path} records no corpus settings: there is no validation split to evaluate on")
    data = open_data(run.path, run.record.data, tcfg.objective)
    corpus = data.build(cache_dir)
    mesh = make_mesh()
    ckpt_step = checkpoint_step(run, step)
    params = load_params(run, ckpt_step)
    eval_step = make_eval_step(cfg, mesh, tcfg.objective, data.tokenizer.mask_id, kernels)
    return ckpt_step, evaluate_sets(corpus, tcfg, lambda vs: evaluate(eval_step, params, vs, mesh, tcfg.objective),
                                    None)
