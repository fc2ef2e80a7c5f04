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

from mlx_llm.train import data as data_lib
from mlx_llm.post import lora as lora_lib
from mlx_llm.train import tokenizer as tok_lib
from mlx_llm.scaling.accounting import train_flops_per_token
from mlx_llm.train.checkpoint import (RESUME_MAY_CHANGE, Checkpoints, abstract_like, check_run_dir, locked_run_dir,
                                      plan_resume, read_run_files, record_resume, schedule_config, write_run_files)
from mlx_llm.config import ModelConfig, TrainConfig
from mlx_llm.errors import CheckpointError, ConfigError
from mlx_llm.model import check_tokens
from mlx_llm.train.metrics import (METRICS_FILE, PLOT_FILE, Progress, append_metrics, flush, plot_losses,
                                   progress_bar, truncate_metrics, write_summary)
from mlx_llm.train.parallel import (agree, check_batch_divisible, gather_to_host, is_main_process, local_rows, make_mesh,
                                   replicated, shard_tree, sync)
from mlx_llm.train.preflight import check_fits
from mlx_llm.train.step import (EvalResult, compiled_train_step, device_batch, evaluate, init_state, jit_train_step,
                                make_eval_step, optimizer_for, place_state)

SAMPLE_FILE = "sample.txt"


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """Where the text comes from and how it is tokenised (``run.json`` of a run)."""

    path: str | None = None  # None: the Python standard library
    extensions: tuple[str, ...] = data_lib.DEFAULT_EXTENSIONS
    val_percent: float = data_lib.DEFAULT_VAL_PERCENT
    tokenizer: str = "bpe"  # or "byte"
    vocab_size: int = 4096  # BPE only

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "extensions": list(self.extensions)}

    @classmethod
    def from_dict(cls, d: dict) -> "DataSpec":
        return cls(**{**d, "extensions": tuple(d["extensions"])})


# ----- run directory ----------------------------------------------------------------------------------------
def check_same_run(run_dir: Path, cfg: ModelConfig | None, tcfg: TrainConfig | None, spec: DataSpec | None,
                   changes: dict | None = None):
    """On resume, what was asked must equal what the run holds (None: take the run's), except the fields of
    ``RESUME_MAY_CHANGE``, which ``tcfg`` or ``changes`` ({field: value}) may set. Returns the configs to use."""
    saved_cfg, saved_tcfg, info = read_run_files(run_dir)
    saved_spec = DataSpec.from_dict(info["data"])
    if set(changes or ()) - RESUME_MAY_CHANGE:
        raise ConfigError(f"a resumed run may change only {sorted(RESUME_MAY_CHANGE)} of its train config, not "
                          f"{sorted(set(changes) - RESUME_MAY_CHANGE)}")
    tcfg = dataclasses.replace(saved_tcfg if tcfg is None else tcfg, **(changes or {}))
    for name, asked, saved, free in (("model config", cfg, saved_cfg, ()),
                                     ("train config", tcfg, saved_tcfg, RESUME_MAY_CHANGE),
                                     ("data settings", spec, saved_spec, ())):
        diff = {} if asked is None else {k: (v, getattr(saved, k)) for k, v in dataclasses.asdict(asked).items()
                                         if k not in free and v != getattr(saved, k)}
        if diff:
            raise CheckpointError(f"cannot resume {str(run_dir)!r}: its {name} differs from the one given "
                                  f"(field: (given, saved) = {diff}); resume without changing it, or start a new "
                                  f"run with another --out")
    return saved_cfg, tcfg, saved_spec


# ----- the loop ---------------------------------------------------------------------------------------------
def train_loop(run_dir: Path, cfg: ModelConfig, tcfg: TrainConfig, corpus, *, resume: bool, show_progress: bool,
               log=print, initial_params=None, frozen=None, lora_cfg=None, from_step: int | None = None,
               schedule_steps: int | None = None) -> dict:
    """The loop over ``corpus.train_batch`` (any object with ``train_batch``, ``val_batches`` and ``tokenizer``):
    steps, metrics, evaluations, checkpoints. ``initial_params`` start a fine-tuning run (instead of a random
    init); with ``lora_cfg`` they are the adapters and ``frozen`` is the base they adapt (never updated, never
    checkpointed: the run records where it comes from). A resume restores the latest checkpoint, or
    ``from_step`` (the later ones are then set aside, not deleted); ``schedule_steps``: see ``schedule_config``."""
    mask_id = corpus.tokenizer.mask_id
    mesh = make_mesh(tcfg.mesh)
    check_batch_divisible(tcfg.batch_size, tcfg.grad_accum, mesh)
    optimizer = optimizer_for(schedule_config(tcfg, schedule_steps))
    ckpts = Checkpoints(run_dir, tcfg.keep_checkpoints)
    state = place_state(init_state(cfg, tcfg, optimizer, initial_params), mesh)
    metrics_path = run_dir / METRICS_FILE
    last_ckpt = ckpts.latest_step() if from_step is None else from_step
    if resume and last_ckpt is not None:
        state = ckpts.restore(abstract_like(state), last_ckpt)
        if from_step is not None:
            for path in ckpts.set_aside_after(from_step) if is_main_process() else ():
                log(f"set aside {path} (nothing deleted)")
            sync("set aside")
        log(f"resumed {run_dir} from step {last_ckpt}")
    if int(state.data_step) != int(state.step):
        raise CheckpointError(f"checkpoint {last_ckpt} is inconsistent: data cursor {int(state.data_step)} != step "
                              f"{int(state.step)}")
    truncate_metrics(metrics_path, int(state.step))
    step_fn = compiled_train_step(cfg, schedule_config(tcfg, schedule_steps), mesh, mask_id, lora_cfg)
    eval_step = make_eval_step(cfg, mesh, tcfg.objective, mask_id, tcfg.kernels())
    extra = () if lora_cfg is None else (shard_tree(frozen, mesh),)

    def model_params(state):
        return state.params if lora_cfg is None else lora_lib.merge(extra[0], state.params, lora_cfg)

    val_set = corpus.val_batches(tcfg.seq_len, tcfg.batch_size, tcfg.eval_tokens or None)
    flops_per_token = train_flops_per_token(cfg, tcfg.seq_len)
    tokens_per_step = tcfg.batch_size * tcfg.seq_len
    start = int(state.step)
    bar = progress_bar(show_progress, start, tcfg.steps)
    my_rows = local_rows(mesh, tcfg.batch_size)
    progress, result, t_start = Progress(last_step=start), None, time.perf_counter()
    train_seconds, last_row = 0.0, None
    for s in range(start, tcfg.steps):
        batch = corpus.train_batch(s, batch_size=tcfg.batch_size, seq_len=tcfg.seq_len, seed=tcfg.seed, rows=my_rows)
        check_tokens(batch["tokens"], cfg, "training batch tokens")
        state, m = step_fn(state, device_batch(batch, mesh, tcfg.batch_size), *extra)
        progress.pending.append((s, m))
        done = s + 1
        is_eval = done % tcfg.eval_interval == 0 or done == tcfg.steps
        is_ckpt = done % tcfg.checkpoint_interval == 0 or done == tcfg.steps
        if done % tcfg.log_interval == 0 or is_eval or is_ckpt:
            rows = flush(progress, metrics_path, run_dir, last_ckpt, cfg)
            now = time.perf_counter()
            dt, n_steps = now - progress.last_time, done - progress.last_step
            train_seconds += dt
            tok_s = n_steps * tokens_per_step / dt
            last_row = rows[-1]
            moe_postfix = ({"imbalance": f"{max(last_row['load_imbalance']):.2f}"} if "load_imbalance" in last_row
                           else {})
            bar.set_postfix(loss=f"{last_row['loss']:.3f}", tok_s=f"{tok_s:,.0f}",
                            flops=f"{tok_s * flops_per_token / 1e9:.1f}G", **moe_postfix)
            bar.update(n_steps)
            if is_eval:
                result = evaluate(eval_step, model_params(state), val_set, mesh, tcfg.objective)
                append_metrics(metrics_path, [{"step": done, **result.as_dict()}])
                bar.write(f"step {done}: val loss {result.loss:.4f}, ppl {result.perplexity:.2f}, "
                          f"bits/byte {result.bits_per_byte:.4f}")
            if is_ckpt:
                ckpts.save(done, state)
                last_ckpt = done
            progress.last_time, progress.last_step = time.perf_counter(), done
    bar.close()
    ckpts.close()
    wall = time.perf_counter() - t_start
    if result is None:  # nothing left to train (resumed a finished run): evaluate the restored state
        result = evaluate(eval_step, model_params(state), val_set, mesh, tcfg.objective)
    steps_run = tcfg.steps - start
    summary = {"steps": tcfg.steps, "steps_this_session": steps_run, "wall_seconds": wall,
               "train_seconds": train_seconds,
               "tokens_per_second": steps_run * tokens_per_step / train_seconds if train_seconds else None,
               "flops_per_token": flops_per_token, "devices": mesh.devices.size, **result.as_dict()}
    return {"state": state, "summary": summary, "params": model_params(state)}


# ----- whole runs -------------------------------------------------------------------------------------------
def read_text_and_tokenizer(run_dir: Path, spec: DataSpec, cache_dir=None, objective: str = "ar"):
    """(tokenizer, text corpus); the tokenizer is the run's own when it has one, else a new one in memory."""
    text = data_lib.read_corpus(spec.path, extensions=spec.extensions, val_percent=spec.val_percent)
    tok = load_tokenizer(run_dir, spec, text, objective)
    return tok, text


def load_tokenizer(run_dir: Path, spec: DataSpec, text_corpus, objective: str = "ar") -> tok_lib.Tokenizer:
    """The run's tokenizer.json if present, else a new one (BPE trained on the train split only). A diffusion
    run's tokenizer also has ``<|mask|>`` (``DIFFUSION_SPECIAL_TOKENS``); AR tokenizers keep their ids."""
    specials = tok_lib.DIFFUSION_SPECIAL_TOKENS if objective == "diffusion" else tok_lib.SPECIAL_TOKENS
    if (run_dir / tok_lib.TOKENIZER_FILE).is_file():
        tok = tok_lib.load(run_dir)
    elif spec.tokenizer == "byte":
        tok = tok_lib.ByteTokenizer(specials)
    else:
        tok = tok_lib.train_bpe((d.text for d in text_corpus.train), spec.vocab_size, special_tokens=specials)
    if objective == "diffusion" and tok.mask_id is None:
        raise ConfigError(f"the tokenizer of {run_dir} has no {tok_lib.MASK} token: the diffusion objective needs "
                          f"one (the absorbing state); it is added only when a run starts with --objective diffusion")
    return tok


def finalize_config(cfg: ModelConfig, tok, tcfg: TrainConfig) -> ModelConfig:
    """The model's vocabulary is the tokenizer's; the training length must fit the model; the diffusion
    objective trains a bidirectional denoiser (``causal`` set false), the AR objective needs a causal model."""
    if cfg.vocab_size != tok.vocab_size:
        cfg = dataclasses.replace(cfg, vocab_size=tok.vocab_size)
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
    return dataclasses.replace(tcfg, steps=steps, warmup_steps=min(tcfg.warmup_steps, max(steps - 1, 0)),
                               eval_interval=min(tcfg.eval_interval, steps),
                               checkpoint_interval=min(tcfg.checkpoint_interval, steps))


def train_run(run_dir, cfg: ModelConfig | None, tcfg: TrainConfig | None, spec: DataSpec | None, *,
              resume: bool = False, show_progress: bool = True, cache_dir=None, sample_prompt: str = "def ",
              sample_tokens: int = 200, time_budget: float | None = None, log=print, changes: dict | None = None,
              from_step: int | None = None) -> dict:
    """Train (or resume) the run in ``run_dir``; returns the summary dict also written to summary.json.

    Everything that can be checked (paths, lock, corpus, tokenizer, configs, the checkpoint to restore, device
    split) is checked before the run directory is created or written, so a refused run leaves nothing behind; the
    run then holds the directory's lock to its end. On resume, ``changes`` sets fields of ``RESUME_MAY_CHANGE``
    (``{"steps": N}`` extends a run, see ``schedule_config``) and ``from_step`` continues from that checkpoint
    instead of the latest (one after it is damaged, say); the checkpoints after it are set aside, not deleted.
    """
    run_dir, plan, main = Path(run_dir), None, is_main_process()
    if not main:  # every process computes the same; process 0 alone reports and writes
        log, show_progress = (lambda *a, **k: None), False
    check_run_dir(run_dir, resume)
    if from_step is not None and not resume:
        raise ConfigError(f"--from-step {from_step} continues a run from one of its checkpoints: it needs --resume")
    if resume:
        cfg, tcfg, spec = check_same_run(run_dir, cfg, tcfg, spec, changes)
        plan = plan_resume(run_dir, tcfg, from_step)
    tok, text = read_text_and_tokenizer(run_dir, spec, cache_dir, tcfg.objective)
    cfg = finalize_config(cfg, tok, tcfg)
    check_batch_divisible(tcfg.batch_size, tcfg.grad_accum, make_mesh(tcfg.mesh))
    check_fits(cfg, schedule_config(tcfg, plan.schedule_steps if plan else None), mask_id=tok.mask_id)
    if not main:
        sync("corpus")  # process 0 encodes (and caches) first; with a shared cache the others then read it
    corpus = data_lib.encode_corpus(text, tok, cache_dir)
    if main:
        sync("corpus")
    if time_budget is not None:
        if resume:
            raise ConfigError("--time-budget sizes a new run; a resumed run keeps the steps it was given")
        tcfg = fit_time_budget(cfg, tcfg, corpus, time_budget, log)
    sync("checked")  # every process has checked the directory before process 0 writes to it
    with locked_run_dir(run_dir, resume):
        if resume and main:  # again under the lock: another run may have changed the directory since
            plan = plan_resume(run_dir, check_same_run(run_dir, None, tcfg, None)[1], from_step)
            record_resume(run_dir, tcfg, plan)
        elif main:
            write_run_files(run_dir, cfg, tcfg, {"data": spec.to_dict()})
            tok.save(run_dir)
        encoded = "cached" if corpus.cache_hit else f"encoded in {corpus.encode_seconds:.1f} s"
        log(f"corpus: {corpus.stats.describe()}; train {corpus.train.n_tokens:,} tokens, val "
            f"{corpus.val.n_tokens:,} tokens ({encoded})")
        active = (f", {cfg.active_param_count():,} active per token" if cfg.active_param_count() != cfg.param_count()
                  else "")
        log(f"model: {cfg.param_count():,} parameters ({cfg.non_embedding_param_count():,} non-embedding{active}), "
            f"vocab {cfg.vocab_size}; {jax.device_count()} device(s)")
        out = train_loop(run_dir, cfg, tcfg, corpus, resume=resume, show_progress=show_progress, log=log,
                         from_step=plan.step if plan and plan.from_step else None,
                         schedule_steps=plan.schedule_steps if plan else None)
        summary = {**out["summary"], "unigram_val_bpb": corpus.unigram_bits_per_byte()}
        params = gather_to_host(out["state"].params)  # whole arrays in every process: the decoder is local
        if main:
            plot_losses(run_dir / METRICS_FILE, run_dir / PLOT_FILE)
            summary["sample"] = closing_sample(params, cfg, tok, sample_prompt, sample_tokens, seed=tcfg.seed,
                                               objective=tcfg.objective)
            (run_dir / SAMPLE_FILE).write_text(summary["sample"], encoding="utf-8")
            write_summary(run_dir, summary)
        sync("written")
    return summary


def evaluate_run(run_dir, *, cache_dir=None, step: int | None = None, kernels=None) -> tuple[int, EvalResult]:
    """Val loss, perplexity and bits per byte of a run's latest (or given) checkpoint on its whole val split;
    ``kernels``: the execution paths (default "auto"), whatever the run was trained with."""
    run_dir = Path(run_dir)
    cfg, tcfg, info = read_run_files(run_dir)
    spec = DataSpec.from_dict(info["data"])
    tok, text = read_text_and_tokenizer(run_dir, spec, cache_dir, tcfg.objective)
    corpus = data_lib.encode_corpus(text, tok, cache_dir)
    mesh = make_mesh()
    params = load_params(run_dir, cfg, tcfg, step)
    val_set = corpus.val_batches(tcfg.seq_len, tcfg.batch_size, None)
    ckpt_step = Checkpoints(run_dir).latest_step() if step is None else step
    eval_step = make_eval_step(cfg, mesh, tcfg.objective, tok.mask_id, kernels)
    return ckpt_step, evaluate(eval_step, params, val_set, mesh, tcfg.objective)


def load_params(run_dir: Path, cfg: ModelConfig, tcfg: TrainConfig, step: int | None = None):
    """The model parameters of a run's checkpoint (latest by default), replicated on the local mesh; for a LoRA
    fine-tuning run, its base with the adapters folded in (post/sft.py)."""
    info = read_run_files(Path(run_dir))[2]
    post = info.get("post") or {}
    if post.get("kind") == "reward":
        raise ConfigError(f"{run_dir} is a reward model (a trunk and a reward head), not a language model: load it "
                          f"with mlx_llm.post.reward.load_reward_model")
    if (info.get("sft") or post).get("lora") is not None:
        from mlx_llm.post.sft import load_sft_params

        return load_sft_params(run_dir, step)
    return restore_params(run_dir, cfg, tcfg, step)


def restore_params(run_dir: Path, cfg: ModelConfig, tcfg: TrainConfig, step: int | None = None, *, like=None):
    """The trainable parameters stored in a run's checkpoint, shaped like ``like`` (default: the model's)."""
    mesh = make_mesh()
    optimizer = optimizer_for(tcfg)
    abstract = jax.eval_shape(lambda: init_state(cfg, tcfg, optimizer, like))
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated(mesh)), abstract)
    ckpts = Checkpoints(run_dir)
    try:
        return ckpts.restore(abstract, step).params
    finally:
        ckpts.close()


DIFFUSION_SAMPLE_STEPS = 64  # denoising steps of a diffusion run's closing sample


def closing_sample(params, cfg: ModelConfig, tok, prompt: str, max_new_tokens: int, *, seed: int = 0,
                   temperature: float = 0.8, top_p: float = 0.95, objective: str = "ar") -> str:
    """The prompt and a sampled continuation from the cached decoder (stops at EOS or the length limit); for a
    diffusion run, ``max_new_tokens`` positions from the ancestral sampler (64 steps, cut at the first EOS)."""
    from mlx_llm.decode.generate import generate

    ids = np.concatenate([[tok.bos_id], tok.encode(prompt)]).astype(np.int32)[None]
    n_new = max(1, min(max_new_tokens, cfg.max_seq_len - ids.shape[1]))
    if objective == "diffusion":
        from mlx_llm.decode.diffusion import sample

        out = np.asarray(sample(params, cfg, ids, n_new, steps=DIFFUSION_SAMPLE_STEPS, mask_id=tok.mask_id,
                                temperature=temperature, seed=seed))[0, ids.shape[1]:]
        return prompt + tok.decode(_until_eos(out, tok.eos_id), skip_special=True)
    out = generate(params, cfg, ids, n_new, temperature=temperature, top_p=top_p, eos_id=tok.eos_id,
                   pad_id=tok.pad_id, seed=seed)
    new = np.asarray(out.tokens[0])[: int(out.lengths[0])]
    return prompt + tok.decode(new, skip_special=True)


def _until_eos(ids, eos_id: int):
    hits = np.flatnonzero(ids == eos_id)
    return ids[: hits[0]] if hits.size else ids


def generate_from_run(run_dir, prompt: str, *, max_new_tokens: int, temperature=None, top_k=None, top_p=None,
                      beam_width=None, seed: int = 0, step: int | None = None, diffusion_steps: int = 64,
                      sampler: str = "ancestral", kernels=None) -> dict:
    """Continue ``prompt`` with a run's checkpoint; the record holds everything needed to reproduce it (M20 §13).
    A diffusion run is sampled with ``decode.diffusion.sample`` (``sampler``, ``diffusion_steps`` steps,
    ``max_new_tokens`` generated positions, cut at the first EOS); the AR settings top-k/top-p/beam do not apply.
    ``kernels``: the execution paths (default the reference ones)."""
    from mlx_llm.decode.generate import generate

    run_dir = Path(run_dir)
    cfg, tcfg, _ = read_run_files(run_dir)
    tok = tok_lib.load(run_dir)
    ckpt_step = Checkpoints(run_dir).latest_step() if step is None else step
    ids = np.concatenate([[tok.bos_id], tok.encode(prompt)]).astype(np.int32)
    if tcfg.objective == "diffusion":
        if top_k is not None or top_p is not None or beam_width is not None:
            raise ConfigError("--top-k, --top-p and --beam are autoregressive settings: a diffusion run takes "
                              "--temperature, --diffusion-steps and --sampler")
        from mlx_llm.decode.diffusion import sample

        params = load_params(run_dir, cfg, tcfg, ckpt_step)
        out = np.asarray(sample(params, cfg, ids[None], max_new_tokens, steps=diffusion_steps, mask_id=tok.mask_id,
                                sampler=sampler, temperature=temperature, seed=seed, kernels=kernels))[0, ids.size:]
        new = _until_eos(out, tok.eos_id)
        return {"run": str(run_dir), "checkpoint_step": ckpt_step, "prompt": prompt, "prompt_ids": ids.tolist(),
                "settings": {"max_new_tokens": max_new_tokens, "temperature": temperature, "sampler": sampler,
                             "diffusion_steps": diffusion_steps, "eos_id": tok.eos_id},
                "seed": seed, "continuation_ids": new.tolist(), "continuation": tok.decode(new, skip_special=True)}
    params = load_params(run_dir, cfg, tcfg, ckpt_step)
    out = generate(params, cfg, ids[None], max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                   beam_width=beam_width, eos_id=tok.eos_id, pad_id=tok.pad_id, seed=seed, kernels=kernels)
    new = np.asarray(out.tokens[0])[: int(out.lengths[0])]
    return {"run": str(run_dir), "checkpoint_step": ckpt_step, "prompt": prompt, "prompt_ids": ids.tolist(),
            "settings": {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_k": top_k,
                         "top_p": top_p, "beam_width": beam_width, "eos_id": tok.eos_id},
            "seed": seed, "continuation_ids": new.tolist(), "continuation": tok.decode(new, skip_special=True),
            "logq": float(np.asarray(out.logq)[0]), "logp": float(np.asarray(out.logp)[0])}
