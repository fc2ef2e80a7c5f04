"""The loop the preference objectives share (reward model, DPO, KL-leashed RL): one jitted update of any loss
over a trainable tree beside a frozen one, with the run directory, checkpoints, exact resume, metrics and
progress of ``train``.

A post-training run starts from a base run (pretrained or SFT) and records it in ``run.json`` under ``"post"``:
``{"kind", "base", "base_step", "lora", "template", ...}``. Its checkpoints hold a ``TrainState`` whose params are
the trainable tree (full parameters, LoRA adapters, or those with a reward head). Batches are a function of
(seed, step, trainable parameters), so a resumed run replays exactly what the uninterrupted one would have,
RL's on-policy samples included.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from mlx_llm.config import ModelConfig, TrainConfig
from mlx_llm.errors import CheckpointError, ConfigError
from mlx_llm.post import lora as lora_lib
from mlx_llm.post.chat import ChatTemplate
from mlx_llm.train import tokenizer as tok_lib
from mlx_llm.train.checkpoint import Checkpoints, abstract_like, read_run_files, write_run_files
from mlx_llm.train.metrics import METRICS_FILE, TrainingDiverged, append_metrics, progress_bar, truncate_metrics
from mlx_llm.train.step import TrainState, init_state, optimizer_for, schedule_for

LossFn = Callable[[Any, Any, dict], tuple[jax.Array, dict]]


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


def run_template(info: dict) -> ChatTemplate:
    record = info.get("sft") or info.get("post")
    return ChatTemplate.from_dict(record["template"]) if record else ChatTemplate()


def load_base(run) -> Base:
    """A pretrained or fine-tuned (SFT, DPO, RL) next-token run's latest parameters, tokenizer and template."""
    from mlx_llm.post.sft import load_base as load_ar

    cfg, tcfg, params, step = load_ar(run)
    info = read_run_files(Path(run))[2]
    return Base(Path(run), cfg, tcfg, params, step, tok_lib.load(run), run_template(info))


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


def post_record(kind: str, base: Base, lora_cfg, **extra) -> dict:
    return {"post": {"kind": kind, "base": str(base.run.resolve()), "base_step": base.step,
                     "lora": None if lora_cfg is None else dataclasses.asdict(lora_cfg),
                     "template": base.template.to_dict(), **extra},
            "data": read_run_files(base.run)[2].get("data")}


def lora_from_record(rec: dict):
    return None if rec["lora"] is None else lora_lib.LoRAConfig(**{**rec["lora"], "targets": tuple(rec["lora"]["targets"])})


def start_run(run_dir: Path, base: Base, tcfg: TrainConfig, record: dict, resume: bool) -> None:
    """Write the run files (a new run) or check the base has not moved since the run began (resume)."""
    if resume:
        started = read_run_files(run_dir)[2]["post"]["base_step"]
        if started != base.step:
            raise CheckpointError(f"{base.run} now ends at checkpoint {base.step}, not {started} as when this run "
                                  f"started: its base changed")
        return
    write_run_files(run_dir, base.cfg, tcfg, record)
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


@functools.lru_cache(maxsize=16)
def make_update(loss_fn: LossFn, tcfg: TrainConfig) -> Callable:
    """(state, frozen, batch) → (state, metrics): ∇ of ``loss_fn`` w.r.t. the trainable tree, clipped AdamW."""
    optimizer, schedule = optimizer_for(tcfg), schedule_for(tcfg)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def update(state: TrainState, frozen, batch):
        (loss, aux), grads = grad_fn(state.params, frozen, batch)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": schedule(state.step), **aux}
        new = state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                            opt_state=opt_state, data_step=state.data_step + 1)
        return new, metrics

    return jax.jit(update, donate_argnums=0)


def compiled_update(cfg: ModelConfig, tcfg: TrainConfig, loss_fn: LossFn, trainable, frozen, example_batch):
    """``make_update``'s update compiled ahead of time for the run's shapes (``example_batch``: one batch as
    ``batch_fn`` returns it) and checked against the local devices' memory (train/preflight.py), before the run
    directory is created: a step that cannot fit is refused in one line. ``post_loop`` then runs this executable,
    so the check costs no second compile."""
    from mlx_llm.train.preflight import check_compiled_fits

    def shapes(tree):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.asarray(a).dtype), tree)

    state = jax.eval_shape(lambda: init_state(cfg, tcfg, optimizer_for(tcfg), trainable))
    compiled = make_update(loss_fn, tcfg).lower(state, shapes(frozen), shapes(example_batch)).compile()
    check_compiled_fits(compiled, "update")
    return compiled


def post_loop(run_dir: Path, cfg: ModelConfig, tcfg: TrainConfig, trainable, frozen, update: Callable,
              batch_fn: Callable, *, evaluate: Callable | None = None, resume: bool, show_progress: bool,
              max_seconds: float | None = None, log=print) -> dict:
    """Train ``trainable`` for ``tcfg.steps`` calls of ``update`` (``compiled_update``); ``batch_fn(step, trainable)
    → (batch, host metrics)``. Every step's metrics go to metrics.jsonl (a non-finite loss stops the run before any checkpoint
    of it); ``evaluate(trainable) → dict`` runs every ``eval_interval`` steps and at the end. ``max_seconds``
    ends the run early (checkpoint and evaluation included) after the step that reaches that much loop time:
    equal-time comparisons."""
    state = init_state(cfg, tcfg, optimizer_for(tcfg), trainable)
    ckpts = Checkpoints(run_dir, keep=tcfg.keep_checkpoints)
    metrics_path = run_dir / METRICS_FILE
    if resume and ckpts.latest_step() is not None:
        state = ckpts.restore(abstract_like(state))
        log(f"resumed {run_dir} from step {int(state.step)}")
    truncate_metrics(metrics_path, int(state.step))
    start = int(state.step)
    bar = progress_bar(show_progress, start, tcfg.steps)
    last, result, t0 = {}, {}, time.perf_counter()
    for s in range(start, tcfg.steps):
        batch, host = batch_fn(s, state.params)
        state, m = update(state, frozen, jax.tree.map(jnp.asarray, batch))
        row = {"step": s + 1, **{k: float(v) for k, v in jax.device_get(m).items()}, **host}
        if not all(math.isfinite(v) for v in row.values() if isinstance(v, float)):
            raise TrainingDiverged(f"step {s + 1}: a metric is not finite ({row}); the last checkpoint is "
                                   f"{ckpts.latest_step()}")
        rows, last = [row], row
        done = s + 1
        final = done == tcfg.steps or (max_seconds is not None and time.perf_counter() - t0 >= max_seconds)
        if evaluate is not None and (done % tcfg.eval_interval == 0 or final):
            result = evaluate(state.params)
            rows.append({"step": done, **result})
            bar.write(f"step {done}: " + ", ".join(f"{k} {v:.4g}" for k, v in result.items()))
        append_metrics(metrics_path, rows)
        bar.set_postfix(loss=f"{row['loss']:.3f}")
        bar.update(1)
        if done % tcfg.checkpoint_interval == 0 or final:
            ckpts.save(done, state)
        if final:
            break
    bar.close()
    ckpts.close()
    if evaluate is not None and not result:
        result = evaluate(state.params)
    return {"state": state, "last": last, "eval": result, "wall_seconds": time.perf_counter() - t0,
            "steps": int(state.step)}
