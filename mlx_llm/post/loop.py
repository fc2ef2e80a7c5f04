"""What the fine-tuning runs share (SFT, reward model, DPO, KL-leashed RL): the base run they start from, their run
record and resume, and — for the preference objectives — their update compiled on the mesh and run by the one
training loop (``train.loop.fit``; SFT runs the language-model step of ``train.run.train_loop``).

A post-training run starts from a base run (pretrained or SFT) and records it in its run record
(``runs.record``: kind, base run and step, LoRA, template, the kind's settings). Its checkpoints hold a
``TrainState`` whose params are the trainable tree (full parameters, LoRA adapters, or those with a reward head).
Batches are a function of (seed, step, trainable parameters), so a resumed run replays exactly what the
uninterrupted one would have, RL's on-policy samples included.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp

from mlx_llm.config import ModelConfig, TrainConfig
from mlx_llm.errors import CheckpointError, ConfigError
from mlx_llm.post import lora as lora_lib
from mlx_llm.post.chat import ChatTemplate
from mlx_llm.post.templates import template_for
from mlx_llm.train import tokenizer as tok_lib
from mlx_llm.runs.load import load_params
from mlx_llm.runs.record import BaseRef, RunRecord, open_run, write_run
from mlx_llm.runs.resume import ResumePlan, record_resume, resume_plan
from mlx_llm.train.checkpoint import check_run_dir
from mlx_llm.train.loop import Job, fit
from mlx_llm.train.parallel import (batch_sharding, check_batch_divisible, make_mesh, replicated, shard_tree,
                                    tree_shardings)
from mlx_llm.train.preflight import check_compiled_fits
from mlx_llm.train.step import init_state, make_update, on_mesh, optimizer_for, place_state


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


def check_beta(beta) -> float:
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not math.isfinite(beta) or beta <= 0:
        raise ConfigError(f"beta = {beta!r} is invalid: it must be a finite number > 0 (the strength of the leash "
                          f"to the reference)")
    return float(beta)


def post_record(kind: str, base: Base, lora_cfg, settings) -> RunRecord:
    """The record of a fine-tuning run of ``kind`` from ``base``: it keeps the base's corpus settings."""
    return RunRecord(kind=kind, data=base.data, base=BaseRef(str(base.run.resolve()), base.step), lora=lora_cfg,
                     template=base.template.to_dict(), settings=settings)


def resume_of(run_dir: Path, resume: bool, changes: dict | None = None, from_step: int | None = None,
              trust_unverified: bool | None = None) -> tuple:
    """Check a fine-tuning run's directory before any work (``checkpoint.check_run_dir``); for a resume, also
    (run, train config with ``changes``, ``ResumePlan``) of ``runs.resume.resume_plan``, else (None, None, None).
    A checkpoint without the manifest its run writes is refused when it is restored (``fit``, which has the run's
    ``--trust-unverified``), unless ``trust_unverified`` decides here."""
    check_run_dir(run_dir, resume)
    if not resume:
        if from_step is not None or changes:
            raise ConfigError(f"--from-step and changed settings ({sorted(changes or ())}) apply to a resumed run: "
                              f"they need --resume")
        return None, None, None
    return resume_plan(run_dir, changes, from_step, trust_unverified)


def check_base_unchanged(run, base: Base) -> None:
    """A resumed fine-tuning run continues from the base checkpoint it started from."""
    if run.record.base.step != base.step:
        raise CheckpointError(f"{base.run} now ends at checkpoint {base.step}, not {run.record.base.step} as when "
                              f"this run started: its base changed")


def start_run(run_dir: Path, base: Base, tcfg: TrainConfig, record: RunRecord, plan: ResumePlan | None) -> None:
    """Under the run's lock: write the run files (a new run, ``plan`` None), or check the base again (a resume:
    ``post_fit`` records what it changed once its checkpoint is restored)."""
    if plan is not None:
        check_base_unchanged(open_run(run_dir), base)
        return
    write_run(run_dir, base.cfg, tcfg, record)
    base.tok.save(run_dir)


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
    return lora_lib.init(base.params, lora_cfg, jax.random.key(seed))


def compiled_update(cfg: ModelConfig, tcfg: TrainConfig, objective: Callable, trainable, frozen, example_batch, *,
                    offsets: Callable | None = None, count_name: str = "pairs", epochs: int = 1,
                    minibatches: int = 1):
    """The run's update (``train.step.make_update`` of ``objective``) jitted on the mesh of ``tcfg.mesh`` (state
    and frozen trees sharded by ``parallel.param_spec``, the batch split over the batch axes, the state donated),
    compiled ahead of time for the run's shapes (``example_batch``: one batch as the batch source returns it) and
    checked against the devices' memory (train/preflight.py) before the run directory is created: a step that
    cannot fit is refused in one line. ``post_fit`` then runs this executable (one compile). ``epochs`` ×
    ``minibatches``: the optimizer updates of one step (PPO's passes over a rollout; ``make_update``)."""
    mesh = make_mesh(tcfg.mesh)
    rows = jax.tree.leaves(example_batch)[0].shape[0]  # pairs, or RL's prompts × replies
    check_batch_divisible(rows // minibatches, tcfg.grad_accum, mesh)
    optimizer = optimizer_for(tcfg, epochs * minibatches)
    state = jax.eval_shape(lambda: init_state(cfg, tcfg, optimizer, trainable))
    state_sh, frozen_sh, batch_sh = tree_shardings(state, mesh), tree_shardings(frozen, mesh), batch_sharding(mesh)
    update = on_mesh(make_update(objective, tcfg, optimizer, offsets=offsets, count_name=count_name, epochs=epochs,
                                 minibatches=minibatches, n_layers=cfg.n_layers), mesh)
    jitted = jax.jit(update, in_shardings=(state_sh, batch_sh, frozen_sh), out_shardings=(state_sh, replicated(mesh)),
                     donate_argnums=0)

    def placed(tree, shardings):  # arrays, numpy arrays and ShapeDtypeStructs all have .shape and .dtype
        return jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), tree, shardings)

    batch = placed(example_batch, jax.tree.map(lambda _: batch_sh, example_batch))
    compiled = jitted.lower(placed(state, state_sh), batch, placed(frozen, frozen_sh)).compile()
    check_compiled_fits(compiled, "update")
    return compiled


def post_fit(run_dir: Path, cfg: ModelConfig, tcfg: TrainConfig, trainable, frozen, update: Callable,
             batch_fn: Callable, evaluate: Callable, *, plan: ResumePlan | None, show_progress: bool,
             max_seconds: float | None = None, log=print, on_policy: bool = False, options=None) -> dict:
    """A preference run's ``train.loop.fit``: ``update`` from ``compiled_update``; ``batch_fn(step, trainable) →
    (host batch, host metrics)``; ``evaluate(trainable) → dict``. ``on_policy``: the batch source samples from
    the current parameters (RL), so each step's metrics are read back with its batch. ``plan``: the resume's
    (None: a new run); ``options``: ``fit``'s (trackers, profiler, HLO dump). Returns ``fit``'s dict."""
    mesh = make_mesh(tcfg.mesh)
    state = place_state(init_state(cfg, tcfg, optimizer_for(tcfg), trainable), mesh)
    frozen = shard_tree(frozen, mesh)
    batch_sh = batch_sharding(mesh)

    def batches(step, state):
        batch, host = batch_fn(step, state.params)
        return jax.device_put(batch, batch_sh), host

    job = Job(update, batches, lambda state: evaluate(state.params), frozen=frozen, readback_every_step=on_policy,
              hlo_text=getattr(update, "as_text", None))
    return fit(run_dir, cfg, tcfg, job, state, resume=plan is not None, show_progress=show_progress, log=log,
               max_seconds=max_seconds, from_step=plan.step if plan is not None and plan.from_step else None,
               on_restored=None if plan is None else lambda: record_resume(run_dir, tcfg, plan), options=options)
