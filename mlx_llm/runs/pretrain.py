"""A pretraining run end to end: run directory, tokenizer, corpus, the loop, metrics, checkpoints, plot, sample.

Everything that can be checked (paths, lock, corpus, tokenizer, configs, the checkpoint to restore, device split)
is checked before the run directory is created or written, so a refused run leaves nothing behind; the run then
holds the directory's lock to its end.
"""

from __future__ import annotations

import contextlib
import errno
from pathlib import Path

import jax

from mlx_llm.config import INT32_MAX, ModelConfig, TrainConfig
from mlx_llm.data.corpora import open_data
from mlx_llm.errors import CheckpointWriteError, ConfigError
from mlx_llm.runs.branch import Branch, branch_configs, start_branch
from mlx_llm.runs.configs import DataSpec, Sizing
from mlx_llm.runs.record import RunRecord, write_run
from mlx_llm.runs.resume import RESUME_MAY_CHANGE, Resume, check_data, given_configs, identified, open_resume
from mlx_llm.runs.rundir import check_run_dir, locked_run_dir, run_info
from mlx_llm.runs.sample import closing_sample
from mlx_llm.settings import check_int, write_text_atomic
from mlx_llm.scaling.accounting import param_count, steps_for_flops, steps_for_tokens_per_param, train_flops_per_token
from mlx_llm.train.lm import finalize_config, fit_time_budget, train_loop, with_steps
from mlx_llm.train.loop import ResumePlan
from mlx_llm.train.metrics import METRICS_FILE, PLOT_FILE, SUMMARY_FILE, plot_losses, write_summary
from mlx_llm.train.parallel import check_batch_divisible, gather_to_host, is_main_process, make_mesh, sync
from mlx_llm.train.preflight import check_fits
from mlx_llm.train.step import schedule_config

SAMPLE_FILE = "sample.txt"


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
    if steps > INT32_MAX:
        raise ConfigError(f"{why}: {steps:,} steps, more than the {INT32_MAX:,} a run's step counter holds; give a "
                          f"smaller budget")
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


def _quiet(*args, **kwargs) -> None:
    return None


def start(run_dir: Path, cfg, tcfg, spec, resume, changes, from_step, branch, trust: bool) -> tuple:
    """(model config, train config, data spec, ``Resume`` or None, parent run, provenance) of a pretraining run,
    checked before anything is written: the ones given (a new run into an empty or new directory), the run's own
    (a resume, by the one rule of runs/resume.py: whole configs given to the library are compared field by field,
    as the command line's flags are), or the parent's with the branch's steps (a branch, ``branch_configs``)."""
    if from_step is not None and not resume:
        raise ConfigError(f"--from-step {from_step} continues a run from one of its checkpoints: it needs --resume")
    if resume:
        if not isinstance(resume, Resume):
            if tcfg is not None:  # a whole train config given: its fields that may change on resume apply
                changes = {**{k: getattr(tcfg, k) for k in RESUME_MAY_CHANGE}, **(changes or {})}
            resume = open_resume(run_dir, kind="pretrain", given=given_configs(cfg, tcfg, spec), changes=changes,
                                 from_step=from_step, trust_unverified=trust)
        return resume.run.cfg, resume.tcfg, resume.run.record.data, resume, None, {}
    check_run_dir(run_dir, resume=False)
    if branch is not None:
        parent, tcfg = branch_configs(branch)
        return (parent.cfg, tcfg, parent.record.data, None, parent,
                {"branch": {"run": str(parent.path), "step": branch.step}})
    return cfg, tcfg, spec, None, None, {}


def own_data(spec: DataSpec, resume: Resume | None, parent, log) -> DataSpec:
    """The run's data as its record keeps it, checked before anything is written: a resume continues on the run's
    own data and a branch on its parent's, each refused by name when the files changed since they were recorded
    (``resume.check_data``); a new run (or a branch of a run that recorded no fingerprint) records the fingerprint
    of what it reads now."""
    if resume:
        check_data(resume.run, log)
        return spec
    if parent is not None:
        check_data(parent, log, "--branch-from continues a run")
        if spec.fingerprint is not None:
            return spec
    return identified(spec)


def train_run(run_dir, cfg: ModelConfig | None, tcfg: TrainConfig | None, spec: DataSpec | None, *,
              resume: bool | Resume = False, show_progress: bool = True, cache_dir=None, sample_prompt: str = "def ",
              sample_tokens: int = 200, time_budget: float | None = None, log=print, changes: dict | None = None,
              from_step: int | None = None, options=None, sizing: Sizing | None = None,
              branch: Branch | None = None) -> dict:
    """Train (or resume) the run in ``run_dir``; returns the summary dict also written to summary.json.

    Everything that can be checked (paths, lock, corpus and its fingerprint, tokenizer, configs, the checkpoint to
    restore, device split) is checked before the run directory is created or written, so a refused run leaves
    nothing behind; the run then holds the directory's lock to its end. ``resume``: True, or the ``Resume`` the
    command line already checked (runs/resume.py); ``changes`` sets fields of ``RESUME_MAY_CHANGE`` (``{"steps":
    N}`` extends a run, see ``train.step.schedule_config``) and ``from_step`` continues from that checkpoint instead
    of the latest (one after it is damaged, say); the checkpoints after it are set aside, not deleted. ``sizing``
    sets a new run's steps from its compute (``size_run``); ``branch`` starts a new run from a checkpoint of a wsd
    run, with that run's settings (runs/branch.py); ``options``: ``loop.fit``'s.
    """
    run_dir, main = Path(run_dir), is_main_process()
    check_int("sample_tokens", sample_tokens, 0, reason="the closing sample's length must be an integer >= 0 "
              "(0: no sample)")
    if not main:  # every process computes the same; process 0 alone reports and writes
        log, show_progress = _quiet, False
    trust = bool(options is not None and options.trust_unverified)
    cfg, tcfg, spec, resume, parent, provenance = start(run_dir, cfg, tcfg, spec, resume, changes, from_step,
                                                        branch, trust)
    spec = own_data(spec, resume, parent, log)
    data = open_data(parent.path if parent else run_dir, spec, tcfg.objective)
    tok = data.tokenizer
    cfg = finalize_config(cfg, tok, tcfg)
    if sizing is not None:
        if resume or branch is not None:
            raise ConfigError("--target-flops / --tokens-per-param size a new run; a resumed or branched run keeps "
                              "its settings")
        tcfg, provenance = size_run(cfg, tcfg, sizing, log)
    check_batch_divisible(tcfg.batch_size, tcfg.grad_accum, make_mesh(tcfg.mesh))
    step = check_fits(cfg, schedule_config(tcfg, resume.plan.schedule_steps if resume else None), mask_id=tok.mask_id)
    if not main:
        sync("corpus")  # process 0 encodes (and caches) first; with a shared cache the others then read it
    corpus = data.build(cache_dir, progress=show_progress)
    if main:
        sync("corpus")
    corpus.check_windows(tcfg.seq_len)  # a split too short for one window is refused before anything is written
    if time_budget is not None:
        if resume:
            raise ConfigError("--time-budget sizes a new run; a resumed run keeps the steps it was given")
        tcfg = fit_time_budget(cfg, tcfg, corpus, time_budget, log)
        step = None  # the steps changed the schedule: the loop compiles its own step
    if options is not None:
        options.check_steps(tcfg.steps)
    record = None if resume else RunRecord(kind="pretrain", data=spec, provenance=provenance)
    sync("checked")  # every process has checked the directory before process 0 writes to it
    with locked_run_dir(run_dir, bool(resume)):
        if resume and main:  # again under the lock: another run may have changed the directory since
            resume = resume.recheck()
        elif main:
            write_run(run_dir, cfg, tcfg, record)
            tok.save(run_dir)
            if branch is not None:
                start_branch(run_dir, branch, parent)
                log(f"branch of {parent.path} at step {branch.step}, decaying to {tcfg.steps} steps")
        sync("started")
        describe(cfg, corpus, log)
        plan = resume.plan if resume else ResumePlan(branch.step) if branch is not None else None
        info = run_info(resume.run if resume else run_dir, "pretrain", cfg, tcfg, None if resume else record)
        out = train_loop(run_dir, cfg, tcfg, corpus, plan=plan, info=info, show_progress=show_progress, log=log,
                         step=step, options=options)
        summary = finish_run(run_dir, out, cfg, tcfg, tok, corpus, sample_prompt, sample_tokens, log)
    return summary


def finish_run(run_dir: Path, out: dict, cfg: ModelConfig, tcfg: TrainConfig, tok, corpus, sample_prompt: str,
               sample_tokens: int, log=print) -> dict:
    """After the loop: the loss plot, the closing sample and summary.json (process 0); the summary."""
    summary = {**out["summary"], "unigram_val_bpb": corpus.unigram_bits_per_byte()}
    params = gather_to_host(out["state"].params)  # whole arrays in every process: the decoder is local
    if is_main_process():
        with finished_files(run_dir, out["summary"]["steps"]):
            _write_finish(run_dir, summary, params, cfg, tcfg, tok, sample_prompt, sample_tokens, log)
    sync("written")
    return summary


@contextlib.contextmanager
def finished_files(run_dir: Path, step):
    """A full disk while writing a finished run's files (plot, sample, summary: each written whole or not at
    all) is one ``CheckpointWriteError``: the training is done and its checkpoints are intact."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise CheckpointWriteError(
            f"no space left on device writing the finished run's files in {run_dir} (loss plot, sample, "
            f"{SUMMARY_FILE}): training is done and checkpoint {step} is intact; free some space, then "
            f"`mlx-llm eval --run {run_dir}` scores it") from None


def _write_finish(run_dir, summary, params, cfg, tcfg, tok, sample_prompt, sample_tokens, log) -> None:
    """The loss plot, the closing sample (into ``summary`` and sample.txt) and summary.json, each atomically."""
    plot_losses(run_dir / METRICS_FILE, run_dir / PLOT_FILE)
    if tok.external:  # token ids without their tokenizer: there is no text to show
        summary["sample"] = None
        log("no closing sample: this run's tokens are ids from an external tokenizer (mlx-llm generate --run "
            "takes and prints ids)")
    elif sample_tokens == 0:  # asked for none (a sweep's points; `mlx-llm generate RUN` samples any run)
        summary["sample"] = None
    else:
        summary["sample"] = closing_sample(params, cfg, tok, sample_prompt, sample_tokens, seed=tcfg.seed,
                                           objective=tcfg.objective)
        write_text_atomic(run_dir / SAMPLE_FILE, summary["sample"])
    write_summary(run_dir, summary)
