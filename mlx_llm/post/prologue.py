"""What every fine-tuning run shares (SFT, reward model, DPO, KL-leashed RL): the base run it starts from, the one
prologue that checks a new run or a resume before anything is written (``start``), its run record, and the run of
the one training loop (``train.loop.fit``) over a preference objective's compiled update.

A post-training run starts from a base run (pretrained or SFT) and records it in its run record
(``runs.record``: kind, base run and step, LoRA, template, the kind's settings). Its checkpoints hold a
``TrainState`` whose params are the trainable tree (full parameters, LoRA adapters, or those with a head).
Batches are a function of (seed, step, trainable parameters), so a resumed run replays exactly what the
uninterrupted one would have, RL's on-policy samples included.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp

from mlx_llm import lora as lora_lib
from mlx_llm.config import LoRAConfig, ModelConfig, TrainConfig, check_seq_len
from mlx_llm.data import tokenizer as tok_lib
from mlx_llm.data.chat import ChatTemplate
from mlx_llm.data.templates import template_for
from mlx_llm.errors import CheckpointError, ConfigError
from mlx_llm.ops import seed_key
from mlx_llm.runs.load import load_params
from mlx_llm.runs.record import BaseRef, RunRecord, open_run, write_run
from mlx_llm.runs.resume import Resume, open_resume
from mlx_llm.runs.rundir import check_run_dir, locked_run_dir, run_info
from mlx_llm.train.loop import Job, ResumePlan, RunInfo, fit
from mlx_llm.train.parallel import batch_sharding, make_mesh, shard_tree
from mlx_llm.train.step import init_state, optimizer_for, place_state, schedule_config


@dataclasses.dataclass
class Base:
    """The run a post-training run starts from: its configs, parameters, tokenizer and chat template."""

    run: Path
    cfg: ModelConfig
    tcfg: TrainConfig
    params: Any
    step: int
    tok: Any
    template: ChatTemplate
    data: Any = None  # the base's corpus settings (DataSpec), which a fine-tuning run keeps


def run_template(record, tok=None):
    """The chat template a run records (its base's, for a fine-tuning run); the default one otherwise. Given the
    run's tokenizer, a model's own Jinja template (an imported run's) takes precedence (``templates.template_for``)."""
    template = ChatTemplate.from_dict(record.template) if record.template else ChatTemplate()
    return template if tok is None else template_for(tok, template)


def load_base(run) -> Base:
    """A next-token language-model run's latest parameters, tokenizer and template: the start of a fine-tuning
    or preference run (pretrained, SFT, DPO, RL, merged or imported)."""
    run = open_run(run)
    run.require_language_model("fine-tuning")
    if run.tcfg.objective != "ar":
        raise ConfigError(f"{run.path} was trained with objective {run.tcfg.objective!r}: chat fine-tuning starts "
                          f"from a next-token (ar) run")
    step = run.latest_step()
    if step is None:
        raise CheckpointError(f"{run.path} has no checkpoint to fine-tune")
    tok = tok_lib.load(run.path)
    return Base(run.path, run.cfg, run.tcfg, load_params(run, step), step, tok, run_template(run.record, tok),
                run.record.data)


def check_same_model(base: Base, other: Base, role: str) -> None:
    """A reference or reward model must share the policy's tokenizer and (for a reference) its config."""
    if other.tok.fingerprint() != base.tok.fingerprint():
        raise ConfigError(f"the {role} run {other.run} has a different tokenizer from the policy's ({base.run}): "
                          f"their token ids do not mean the same text")
    if role == "reference" and other.cfg != base.cfg:
        diff = [f.name for f in dataclasses.fields(ModelConfig) if getattr(other.cfg, f.name) != getattr(base.cfg, f.name)]
        raise ConfigError(f"the reference run {other.run} has a different model config from the policy's "
                          f"({base.run}): {diff} differ")


@dataclasses.dataclass
class Start:
    """A fine-tuning run's start, checked before anything is written (``start``): the directory, the kind, its
    train config, settings and LoRA (given, or read back on resume), the base (and the reference, the base unless
    the settings name another run with the same tokenizer and config) and, on resume, the accepted ``Resume``."""

    run_dir: Path
    kind: str
    tcfg: TrainConfig
    settings: Any
    lora_cfg: LoRAConfig | None
    base: Base
    reference: Base
    resume: Resume | None = None
    template: ChatTemplate | None = None

    @property
    def plan(self) -> ResumePlan | None:
        return None if self.resume is None else self.resume.plan

    @property
    def cfg(self) -> ModelConfig:
        return self.base.cfg

    @property
    def schedule_tcfg(self) -> TrainConfig:
        """The train config as the optimizer sees it (an extended run keeps its schedule: ``schedule_config``)."""
        return schedule_config(self.tcfg, self.plan.schedule_steps if self.plan is not None else None)

    def record(self) -> RunRecord:
        """The run record of a new run: it keeps the base's corpus settings."""
        template = self.template if self.template is not None else self.base.template
        return RunRecord(kind=self.kind, data=self.base.data, base=BaseRef(str(self.base.run.resolve()),
                                                                            self.base.step),
                         lora=self.lora_cfg, template=template.to_dict(), settings=self.settings)

    @contextlib.contextmanager
    def writing(self):
        """Hold the run's lock to the end of the run: write the run files (a new run), or check the resume again
        under the lock (the base too: ``fit`` records what the resume changed once its checkpoint is restored)."""
        with locked_run_dir(self.run_dir, self.resume is not None):
            if self.resume is not None:
                self.resume = self.resume.recheck()
                check_base_unchanged(self.resume.run, self.base)
            else:
                write_run(self.run_dir, self.base.cfg, self.tcfg, self.record())
                self.base.tok.save(self.run_dir)
            yield self

    def fit(self, trainable, frozen, update: Callable, batch_fn: Callable, evaluate: Callable, **kw) -> dict:
        """``post_fit`` of this run (its directory, configs, resume plan and run info); ``kw``: ``post_fit``'s."""
        return post_fit(self.run_dir, self.cfg, self.tcfg, trainable, frozen, update, batch_fn, evaluate,
                        plan=self.plan, info=self.info(), **kw)

    def info(self) -> RunInfo:
        """The loop's ``RunInfo`` of this run."""
        run = self.resume.run if self.resume is not None else self.run_dir
        return run_info(run, self.kind, self.base.cfg, self.tcfg, None if self.resume else self.record())


def check_base_unchanged(run, base: Base) -> None:
    """A resumed fine-tuning run continues from the base checkpoint it started from."""
    if run.record.base.step != base.step:
        raise CheckpointError(f"{base.run} now ends at checkpoint {base.step}, not {run.record.base.step} as when "
                              f"this run started: its base changed")


def start(run_dir, kind: str, base_run=None, *, tcfg: TrainConfig | None = None, settings=None,
          lora_cfg: LoRAConfig | None = None, resume: bool | Resume = False, changes: dict | None = None,
          from_step: int | None = None, options=None) -> Start:
    """The one prologue of every fine-tuning run, before anything is written: a new run's directory is checked
    (empty or new, no other run in it); a resume (``resume`` True, or the ``Resume`` the command line checked) is
    accepted by the one rule (runs/resume.py) and everything else is read back from the run (``changes``,
    ``from_step``: ``open_resume``); the base is loaded (on resume, still at the step the run started from), the
    reference too, and the training window checked against the base model (and ``options``, the run's
    ``RunOptions``, against its steps)."""
    run_dir = Path(run_dir)
    if resume:
        if not isinstance(resume, Resume):
            resume = open_resume(run_dir, kind=kind, changes=changes, from_step=from_step, trust_unverified=None)
        record = resume.run.record
        tcfg, settings, lora_cfg, base_run = resume.tcfg, record.settings, record.lora, record.base.run
    else:
        check_run_dir(run_dir, resume=False)
        if from_step is not None or changes:
            raise ConfigError(f"--from-step and changed settings ({sorted(changes or ())}) apply to a resumed run: "
                              f"they need --resume")
        resume = None
    base = load_base(base_run)
    if resume is not None:
        check_base_unchanged(resume.run, base)
    check_seq_len(base.cfg, tcfg, "the base model")
    if options is not None:
        options.check_steps(tcfg.steps)
    reference = getattr(settings, "reference", None)
    ref = base if reference is None else load_base(reference)
    check_same_model(base, ref, "reference")
    return Start(run_dir, kind, tcfg, settings, lora_cfg, base, ref, resume)


def policy_params(trainable, frozen, lora_cfg):
    """The model a trainable tree stands for: the parameters themselves, or the frozen base with adapters."""
    if lora_cfg is None:
        return trainable
    return lora_lib.adapted(frozen["base"], trainable, lora_cfg)


def initial_trainable(base: Base, lora_cfg, seed: int):
    """A copy of the base's parameters (full; the frozen reference keeps the originals, and the step donates its
    state), or fresh adapters (LoRA)."""
    if lora_cfg is None:
        return jax.tree.map(jnp.copy, base.params)
    return lora_lib.init(base.params, lora_cfg, seed_key(seed))


def post_fit(run_dir: Path, cfg: ModelConfig, tcfg: TrainConfig, trainable, frozen, update: Callable,
             batch_fn: Callable, evaluate: Callable, *, plan: ResumePlan | None = None, info: RunInfo = RunInfo(),
             show_progress: bool, max_seconds: float | None = None, log=print, on_policy: bool = False,
             options=None) -> dict:
    """A preference run's ``train.loop.fit``: ``update`` from ``train.preflight.compiled_update``;
    ``batch_fn(step, trainable) → (host batch, host metrics)``; ``evaluate(trainable) → dict``. ``on_policy``: the
    batch source samples from the current parameters (RL), so each step's metrics are read back with its batch.
    ``plan`` and ``info``: the run layer's (``Start.plan``, ``Start.info()``). Returns ``fit``'s dict."""
    mesh = make_mesh(tcfg.mesh)
    state = place_state(init_state(cfg, tcfg, optimizer_for(tcfg, cfg=cfg), trainable), mesh)
    frozen = shard_tree(frozen, mesh)
    batch_sh = batch_sharding(mesh)

    def batches(step, state):
        batch, host = batch_fn(step, state.params)
        return jax.device_put(batch, batch_sh), host

    job = Job(update, batches, lambda state: evaluate(state.params), frozen=frozen, readback_every_step=on_policy,
              hlo_text=getattr(update, "as_text", None))
    return fit(run_dir, cfg, tcfg, job, state, plan=plan, info=info, show_progress=show_progress, log=log,
               max_seconds=max_seconds, options=options)
