"""The one loader of a run's parameters, and the one writer of a run that holds a single checkpoint.

``load_params(run, step)`` follows the base chain: a run whose checkpoints hold LoRA adapters is its base's
parameters (themselves loaded the same way, at the step the run started from) with the adapters folded in.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mlx_llm.config import ModelConfig, TrainConfig
from mlx_llm.errors import CheckpointError, ConfigError
from mlx_llm.model import init_params
from mlx_llm import lora as lora_lib
from mlx_llm.runs.record import Run, RunRecord, open_run, write_run
from mlx_llm.runs.rundir import check_new_dir, checkpoints, new_dir
from mlx_llm.data import tokenizer as tok_lib
from mlx_llm.train.checkpoint import Checkpoints, RunHints
from mlx_llm.train.parallel import make_mesh, replicated
from mlx_llm.train.step import init_state, optimizer_for


def as_run(run) -> Run:
    return run if isinstance(run, Run) else open_run(run)


def checkpoint_step(run: Run, step: int | None) -> int:
    """``step``, or the run's latest checkpoint; refused by name when the run has none or not that one."""
    steps = run.checkpoint_steps()
    if step is None:
        if not steps:
            raise CheckpointError(f"no checkpoint in {run.path / 'checkpoints'}: nothing to load")
        return steps[-1]
    if step not in steps:
        raise CheckpointError(f"no checkpoint {step} in {run.path}: its checkpoints are {steps}")
    return step


def restore_params(run, step: int | None = None, *, like=None):
    """The trainable tree stored in a run's checkpoint (latest by default), shaped like ``like`` (default: the
    model's parameters; a function returning the tree is called only to trace its shapes), replicated on the
    local devices."""
    run = as_run(run)
    step = checkpoint_step(run, step)
    mesh = make_mesh()
    abstract = jax.eval_shape(lambda: init_state(run.cfg, run.tcfg, optimizer_for(run.tcfg, cfg=run.cfg),
                                                 like() if callable(like) else like))
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated(mesh)), abstract)
    ckpts = checkpoints(run)
    try:
        return ckpts.restore(abstract, step).params
    finally:
        ckpts.close()


def base_params(run: Run):
    """The parameters of the run ``run`` starts from, at the step it started from."""
    if run.record.base is None:
        raise ConfigError(f"{run.path} is a {run.kind} run: it has no base run")
    return load_params(run.record.base.run, run.record.base.step)


def trainable_tree(settings, model, d_model: int) -> dict:
    """A run's trainable tree as its kind declares it (``settings.trainable_layout()``): ``model`` (the model or
    its adapters) alone, or under its key beside zero-initialised heads of width ``d_model``."""
    key, heads = settings.trainable_layout()
    if key is None:
        return model
    return {key: model, **{head: jnp.zeros((d_model,), jnp.float32) for head in heads}}


def restore_trained(run, step: int | None = None) -> tuple:
    """(the model part of a run's checkpoint — its parameters or its LoRA adapters —, the whole trainable tree,
    the base's parameters for a LoRA run or None), by the kind's declared layout."""
    run = as_run(run)
    lora_cfg = run.record.lora
    base = None if lora_cfg is None else base_params(run)
    model = None if lora_cfg is None else lora_lib.init(base, lora_cfg, jax.random.key(0))

    def like():
        return trainable_tree(run.record.settings, init_params(run.cfg, jax.random.key(0)) if model is None else model,
                              run.cfg.d_model)

    trained = restore_params(run, step, like=like)
    key = run.record.settings.trainable_layout()[0]
    return (trained if key is None else trained[key]), trained, base


def load_params(run, step: int | None = None):
    """A language-model run's parameters at ``step`` (default the latest): the checkpoint itself, or, for a
    LoRA run, its base's parameters with the adapters folded in once (W₀ + (α/r)·A·B, lora.py)."""
    run = as_run(run)
    run.require_language_model("loading its parameters as a model")
    model, _, base = restore_trained(run, step)
    return model if base is None else lora_lib.merge(base, model, run.record.lora)


def write_checkpoint_run(out, cfg: ModelConfig, tcfg: TrainConfig, record: RunRecord, tok: tok_lib.Tokenizer,
                         params: Any, step: int) -> Path:
    """Write ``out``: a new run holding ``params`` as its one checkpoint ``step`` (a merged or imported run),
    all of it or nothing (``new_dir``)."""
    out = Path(out)
    check_new_dir(out, "run directory")
    state = init_state(cfg, tcfg, optimizer_for(tcfg, cfg=cfg), params).replace(step=np.int32(step), data_step=np.int32(step))
    needed = sum(int(getattr(a, "nbytes", 0)) for a in jax.tree.leaves(state)) + (1 << 20)  # + configs, tokenizer
    with new_dir(out, needed) as tmp:
        write_run(tmp, cfg, tcfg, record)
        tok.save(tmp)
        ckpts = Checkpoints(tmp, hints=RunHints(resume=f"the same command again (nothing was written to {out})"))
        try:
            ckpts.save(step, state)
        finally:
            ckpts.close()  # orbax's threads stop before the temporary directory is removed
    return out


def merge_run(run, out) -> Path:
    """Write ``out``: a plain run (config, tokenizer, one checkpoint of the merged parameters) from any LoRA run
    that holds a language model (SFT, DPO, RL)."""
    run = as_run(run)
    if run.record.lora is None:
        raise ConfigError(f"{run.path} is not a fine-tuning run with LoRA adapters (it is a {run.kind} run): there is "
                          f"nothing to merge (its checkpoints already hold plain parameters)")
    run.require_language_model("export-merged")
    check_new_dir(Path(out), "run directory")
    step = checkpoint_step(run, None)
    record = RunRecord(kind="merged", data=run.record.data, template=run.record.template,
                       provenance={"merged_from": str(run.path.resolve()), "step": step})
    return write_checkpoint_run(out, run.cfg, run.tcfg, record, tok_lib.load(run.path), load_params(run, step), step)
