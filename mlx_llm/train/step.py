"""The training step and the training loop (M20 §10–§12, §20's boxed AdamW line).

``train_step`` is one jitted function of (TrainState, batch), with the state donated and the batch sharded on
the mesh's batch axes; gradient accumulation is a ``lax.scan`` over micro-batches whose summed losses and
gradients are divided once by the step's total target count, so the loss is token-averaged over the whole step
exactly as M20 §10 defines it for a batch.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from mlx_llm.config import ModelConfig, TrainConfig
from mlx_llm.kernels import backend_platform
from mlx_llm.objectives import diffusion
from mlx_llm.objectives.loss import bits_per_byte, mtp_targets, perplexity
from mlx_llm.ops import seed_key
from mlx_llm.model import (hidden_states, init_params, logits_from_hidden, mtp_hidden, nll_from_hidden, resolved,
                           training_window)
from mlx_llm.layers.moe import apply_offset_rule
from mlx_llm.train import watch
from mlx_llm.train.optim import (SpikeState, make_optimizer, multiply_scales, mup_lr_scales, warmup_cosine,
                                 warmup_stable_decay)
from mlx_llm.train.masks import role_lr_scales, strip_routing_state
from mlx_llm.train.parallel import batch_sharding, global_batch, local_rows, replicated, tree_shardings

BATCH_KEYS = ("tokens", "targets", "mask", "segment_ids", "positions")


@flax.struct.dataclass
class TrainState:
    """Everything a resumed run needs: step, params, optimizer moments, rng and the data cursor.

    Batches are a function of (seed, data_step), so restoring ``data_step`` replays the same data.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array  # raw uint32 key data (checkpointable); see jax.random.wrap_key_data
    data_step: jax.Array


def schedule_for(tcfg: TrainConfig):
    """The run's learning-rate schedule of the update count: ``warmup_cosine`` or ``warmup_stable_decay``."""
    if tcfg.schedule == "wsd":
        return warmup_stable_decay(tcfg.lr, tcfg.warmup_steps, tcfg.steps, tcfg.decay_fraction,
                                   tcfg.final_lr_fraction, tcfg.decay_shape)
    return warmup_cosine(tcfg.lr, tcfg.warmup_steps, tcfg.steps, tcfg.final_lr_fraction)


def schedule_config(tcfg: TrainConfig, schedule_steps: int | None = None) -> TrainConfig:
    """``tcfg`` as the optimizer sees it: the warmup-cosine is defined over ``schedule_steps``, an extended run's
    original total, not over its new ``steps``. The extension rule: the steps a run has taken keep their lr, and
    the steps an extension adds run at the final lr, peak·final_lr_fraction, which is what ``warmup_cosine``
    gives after its end. No step of the extension re-raises the lr the run has annealed (a re-warm would undo
    part of the anneal), and the optimizer state is the same structure, so it restores as is."""
    if schedule_steps is None or schedule_steps == tcfg.steps:
        return tcfg
    return dataclasses.replace(tcfg, steps=schedule_steps)


def optimizer_for(tcfg: TrainConfig, updates_per_step: int = 1, *,
                  cfg: ModelConfig | None = None) -> optax.GradientTransformation:
    """The run's optimizer chain (AdamW, Muon or NorMuon, ``--skip-spikes`` around it) for the model ``cfg``
    (None: a standard-parametrization model), with the run's per-leaf learning-rate multipliers (``lr_scales_for``:
    the groups' and, under μP, ``optim.mup_lr_scales``) in one ``optim.scale_per_leaf`` step; with
    ``updates_per_step`` optimizer updates per training step (PPO's epochs × minibatches), the learning rate
    follows the schedule of the step, constant within it."""
    schedule = schedule_for(tcfg)
    if updates_per_step != 1:
        schedule = (lambda base, n: lambda count: base(count // n))(schedule, updates_per_step)
    return make_optimizer(schedule, b1=tcfg.b1, b2=tcfg.b2, weight_decay=tcfg.weight_decay, clip_norm=tcfg.clip_norm,
                          kind=tcfg.optimizer, spike_factor=tcfg.spike_factor if tcfg.skip_spikes else None,
                          polar_express=tcfg.polar_express, cautious_wd=tcfg.cautious_wd,
                          lr_scales=lr_scales_for(tcfg, cfg))


def lr_scales_for(tcfg: TrainConfig, cfg: ModelConfig | None = None) -> Callable | None:
    """The run's per-leaf learning-rate multipliers as one function of the updates tree (``optim.multiply_scales``
    of every source: the groups' ``role_scales_for`` and, for a μP model ``cfg``, ``optim.mup_lr_scales``); None
    when every multiplier is 1."""
    mup = (functools.partial(mup_lr_scales, cfg=cfg, kind=tcfg.optimizer)
           if cfg is not None and cfg.parametrization == "mup" else None)
    return multiply_scales(role_scales_for(tcfg), mup)


def role_scales_for(tcfg: TrainConfig) -> Callable | None:
    """The run's per-group learning-rate multipliers (``--embed-lr-scale``, ``--head-lr-scale``,
    ``--scalar-lr-scale``) as ``role_lr_scales`` of the updates tree; None when all are 1 (the chain is then
    exactly the one without them)."""
    scales = dict(embed=tcfg.embed_lr_scale, head=tcfg.head_lr_scale, scalar=tcfg.scalar_lr_scale)
    if all(v == 1.0 for v in scales.values()):
        return None
    return functools.partial(role_lr_scales, **scales)


def init_state(cfg: ModelConfig, tcfg: TrainConfig, optimizer: optax.GradientTransformation,
               params=None) -> TrainState:
    """A fresh state: random parameters (``init_params``), or the given trainable ``params`` (a pretrained
    model for fine-tuning, LoRA adapters), with new optimizer moments."""
    init_key, rng = jax.random.split(seed_key(tcfg.seed))
    if tcfg.init_seed is not None:  # the parameters from their own seed; the state's noise stays --seed's
        init_key = jax.random.split(seed_key(tcfg.init_seed))[0]
    params = init_params(cfg, init_key) if params is None else params
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params),
                      rng=jax.random.key_data(rng), data_step=jnp.zeros((), jnp.int32))


def cast_params(params, dtype):
    """Compute copy of float32 master weights (bf16 training keeps the float32 master in the state)."""
    return jax.tree.map(lambda p: p.astype(dtype), params)


def summed_loss_and_aux(params, batch, cfg: ModelConfig, compute_dtype, remat: str = "none", kernels=None,
                        z_loss: float = 0.0, mtp_weight: float = 0.0, window=None):
    """(Σ_t b_t · −log p(x_t | x_<t), (Σ_t b_t, aux)) of one (micro-)batch; logits and loss in float32.

    aux holds the MoE expert loads (assignments per expert, stacked like the blocks) of this batch. ``kernels``:
    the execution paths (default the reference ones), the loss chunked as ``kernels.loss_chunk`` says.
    ``z_loss`` W > 0 adds PaLM's auxiliary W·(log Z_t)² per target (Chowdhery et al. 2022, §5: it keeps the
    softmax normaliser near 1 for stability) to the sum, and aux becomes (loads, {"z_loss": Σ_t b_t·W·(log Z_t)²}).
    ``mtp_weight`` λ > 0 (a model with ``mtp_depth`` D) adds λ·(n/D) Σ_k L_k, L_k = Σ_t b^k_t ℓ^k_t / n_k the mean
    loss of MTP depth k over its n_k targets (``mtp_targets``), so that the step's division by n = Σ b_t gives
    L_main + λ·mean_k L_k; aux's dict then holds "mtp_loss" = (n/D) Σ_k L_k (λ-free, summed like the loss).
    With several micro-batches each L_k is its micro-batch's mean (exact for one). ``window``: the 'local' layers'
    warmed-up window (``model.training_window``).
    """
    kernels = resolved(kernels)
    p = cast_params(params, compute_dtype)
    (h_BTD, aux), ctx = hidden_states(p, batch["tokens"], cfg, positions_BT=batch["positions"],
                                      segment_ids_BT=batch["segment_ids"], return_aux=True, remat=remat,
                                      kernels=kernels, window=window, return_ctx=True)
    if not z_loss and not mtp_weight:
        nll_BT = nll_from_hidden(h_BTD, batch["targets"], p, cfg, kernels.loss_chunk)
        b_BT = batch["mask"].astype(nll_BT.dtype)
        return jnp.sum(b_BT * nll_BT), (jnp.sum(b_BT), aux)
    nll_BT, lse_BT = nll_from_hidden(h_BTD, batch["targets"], p, cfg, kernels.loss_chunk, return_lse=True)
    b_BT = batch["mask"].astype(nll_BT.dtype)
    n, extras = jnp.sum(b_BT), {}
    total = jnp.sum(b_BT * nll_BT)
    if z_loss:
        extras["z_loss"] = z_loss * jnp.sum(b_BT * jnp.square(lse_BT))
        total = total + extras["z_loss"]
    if mtp_weight:
        extras["mtp_loss"] = n * mtp_mean_loss(h_BTD, p, batch, cfg, ctx, kernels.loss_chunk)
        total = total + mtp_weight * extras["mtp_loss"]
    return total, (n, (aux, extras))


def mtp_mean_loss(h_BTD, params, batch, cfg: ModelConfig, ctx, loss_chunk=0):
    """(1/D) Σ_k L_k: the mean over the D MTP depths of each depth's mean next-(k+1)-token loss (DeepSeek-V3 §2.2,
    L_MTP without its λ), from the main stack's H⁽ᴸ⁾ and its forward's context (``model.mtp_hidden``)."""
    losses = []
    for k, h_k in enumerate(mtp_hidden(h_BTD, params, batch["targets"], cfg, ctx), start=1):
        targets_k, mask_k = mtp_targets(batch["targets"], batch["mask"], batch["segment_ids"], k)
        nll_BT = nll_from_hidden(h_k, targets_k, params, cfg, loss_chunk)
        b_BT = mask_k.astype(nll_BT.dtype)
        losses.append(jnp.sum(b_BT * nll_BT) / jnp.maximum(jnp.sum(b_BT), 1))
    return sum(losses) / len(losses)


def summed_nelbo_and_aux(params, batch, key, cfg: ModelConfig, compute_dtype, mask_id: int, remat: str = "none",
                         kernels=None):
    """The masked-diffusion counterpart (objectives/diffusion.py): (Σ_b NELBO_b, (Σ maskable tokens, aux)) of
    one (micro-)batch, with t and the masks drawn from ``key``. The window's tokens are x; ``batch["mask"]``
    marks the maskable (real) ones; segment ids keep the bidirectional attention inside each document. The
    bound reads whole logits rows (``kernels.loss_chunk`` does not apply)."""
    p = cast_params(params, compute_dtype)
    x_BT, maskable_BT = batch["tokens"], batch["mask"]
    z_BT, masked_BT, t_B = diffusion.corrupt_batch(key, x_BT, mask_id, maskable_BT)
    h_BTD, aux = hidden_states(p, z_BT, cfg, positions_BT=batch["positions"], segment_ids_BT=batch["segment_ids"],
                               return_aux=True, remat=remat, kernels=resolved(kernels))
    nelbo_B = diffusion.nelbo_from_logits(logits_from_hidden(h_BTD, p, cfg), x_BT, masked_BT, t_B, mask_id)
    return jnp.sum(nelbo_B), (jnp.sum(maskable_BT.astype(nelbo_B.dtype)), aux)


def objective_fn(cfg: ModelConfig, tcfg: TrainConfig, compute_dtype, mask_id, platform: str | None = None,
                 training: bool = False):
    """(params, micro-batch, key[, step]) → (summed loss, (count, aux)) for ``tcfg.objective``; the AR loss ignores
    key. The execution paths are ``tcfg``'s, resolved for ``platform`` (default: the default backend).
    ``training``: the loss a step descends — with the MTP modules' loss (``mtp_depth`` > 0) and, under a window
    warmup, the window of update ``step``; evaluation scores the model as it decodes (neither)."""
    kernels = tcfg.kernels(platform, resolve=True)
    if tcfg.objective == "diffusion":
        diffusion.check_mask_id(mask_id, cfg.vocab_size)
        return lambda p, mb, key, step=None: summed_nelbo_and_aux(p, mb, key, cfg, compute_dtype, mask_id,
                                                                  tcfg.remat, kernels)
    mtp_weight = tcfg.mtp_weight if training and cfg.mtp_depth else 0.0

    def fn(p, mb, key, step=None):
        window = training_window(cfg, step) if training and step is not None else None
        return summed_loss_and_aux(p, mb, cfg, compute_dtype, tcfg.remat, kernels, tcfg.z_loss, mtp_weight, window)

    return fn


def summed_loss(params, batch, cfg: ModelConfig, compute_dtype) -> tuple[jax.Array, jax.Array]:
    """(Σ_t b_t · −log p(x_t | x_<t), Σ_t b_t) of one (micro-)batch."""
    loss_sum, (n, _) = summed_loss_and_aux(params, batch, cfg, compute_dtype)
    return loss_sum, n


def lm_objective(cfg: ModelConfig, tcfg: TrainConfig, mask_id: int | None = None, platform: str | None = None,
                 model_of: Callable | None = None) -> Callable:
    """The language-model objective in the loop's form (``make_update``): (trainable, frozen, micro-batch, key) →
    (Σ loss, (count, expert load, {})). The trainable tree is the model and ``frozen`` is None, unless
    ``model_of(trainable, frozen)`` builds the model from them (adapters beside a frozen base, lora.py): the loss
    is then a function of the trainable part alone, so the frozen part is never differentiated and the optimizer
    sees only what is trained."""
    objective = objective_fn(cfg, tcfg, jnp.dtype(tcfg.compute_dtype), mask_id, platform, training=True)

    def fn(trainable, frozen, mb, key, step=None):
        params = trainable if model_of is None else model_of(trainable, frozen)
        loss_sum, (n, aux) = objective(params, mb, key, step)
        if tcfg.objective == "ar" and (tcfg.z_loss or cfg.mtp_depth):
            load, extras = aux
            return loss_sum, (n, load, extras)
        return loss_sum, (n, aux, {})

    fn.takes_step = bool(cfg.window_warmup_steps)  # make_update passes the update number (the window warmup)
    return fn


@functools.lru_cache(maxsize=16)
def moe_offsets(cfg: ModelConfig, path: tuple[str, ...] = ()) -> Callable | None:
    """M20 §15's control rule for the balancing offsets of the model at ``path`` of the trainable tree (() : the
    tree is the model); None when the model has no MoE layer. The same function for the same arguments (a key of
    ``compiled_steps``)."""
    if "moe" not in cfg.ffn_pattern:
        return None

    def apply(trainable, load):
        if path:
            return {**trainable, path[0]: moe_offsets(cfg, path[1:])(trainable[path[0]], load)}
        return {**trainable, "blocks": apply_offset_rule(trainable["blocks"], load, cfg.offset_rate)}

    return apply


def make_update(objective: Callable, tcfg: TrainConfig, optimizer: optax.GradientTransformation, *,
                offsets: Callable | None = None, count_name: str = "targets", epochs: int = 1,
                minibatches: int = 1, n_layers: int | None = None) -> Callable:
    """(state, batch, frozen) → (state, metrics): the one training step of every run kind; not jitted here.

    ``objective(trainable, frozen, micro-batch, key) → (Σ loss, (count, expert load, {name: Σ metric}))`` sums
    over its micro-batch; an optimizer update accumulates those sums over ``tcfg.grad_accum`` micro-batches (the
    batch's leading axis split in order) and divides by the total count, so the loss is the mean over the whole
    update whatever the split (M20 §10). The key is the state's key folded with the step and the micro-batch
    index, so a resumed run draws exactly what the uninterrupted one would have. After each optimizer update
    ``offsets`` (``moe_offsets``) moves the MoE balancing offsets by the loads counted over its whole batch.

    With ``epochs`` × ``minibatches`` > 1 (PPO, post/ppo.py) the step makes that many optimizer updates on the
    one batch: each epoch visits the rows in a fresh permutation (drawn from the step's key), split into
    ``minibatches`` equal minibatches; the metrics are the mean over the updates. The state's step counts steps.

    With ``tcfg.watch_interval`` N > 0 (the model's ``n_layers`` given), every N-th step's metrics also hold
    ``watch``: the per-layer RMS of the parameters after the update, of the gradients and of the updates
    (train/watch.py), computed here from the stacked layer axis (no extra transfer; other steps skip the
    reductions and carry zeros). With ``--skip-spikes`` they hold ``spikes_skipped``, the run's count so far.
    An objective with ``takes_step`` (``lm_objective`` under a window warmup) also receives the state's step.
    """
    takes_step = getattr(objective, "takes_step", False)
    schedule = schedule_for(tcfg)
    if tcfg.watch_interval and n_layers is None:
        raise ValueError("make_update: watch_interval needs the model's n_layers")

    def one_update(params, opt_state, frozen, batch, key, watching, step):
        at_step = functools.partial(objective, step=step) if takes_step else objective
        grad_fn = jax.value_and_grad(at_step, has_aux=True)
        (loss_sum, (n, load, sums)), grads = _accumulate(grad_fn, tcfg.grad_accum, params, frozen, batch, key)
        # an update that counts nothing (RL's dynamic sampling dropped every group) has zero loss and gradient
        per = jnp.maximum(n, 1)
        grads = jax.tree.map(lambda g: g / per, grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        if offsets is not None:
            params = offsets(params, load)
        metrics = {"loss": loss_sum / per, "grad_norm": optax.tree.norm(strip_routing_state(grads)), count_name: n,
                   "expert_load": load, **{name: total / per for name, total in sums.items()}}
        if isinstance(opt_state, SpikeState):
            metrics["spikes_skipped"] = opt_state.skipped
        if tcfg.watch_interval:
            metrics["watch"] = _watched(watching, params, grads, updates, n_layers)
        return params, opt_state, metrics

    def update(state: TrainState, batch, frozen):
        key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        watching = (state.step + 1) % max(tcfg.watch_interval, 1) == 0
        if epochs * minibatches == 1:
            params, opt_state, metrics = one_update(state.params, state.opt_state, frozen, batch, key, watching,
                                                    state.step)
        else:
            params, opt_state, metrics = _several_updates(
                functools.partial(one_update, watching=watching, step=state.step), state, frozen, batch, key, epochs,
                minibatches)
        new = state.replace(step=state.step + 1, params=params, opt_state=opt_state, data_step=state.data_step + 1)
        loss, grad_norm = metrics.pop("loss"), metrics.pop("grad_norm")
        return new, {"loss": loss, "grad_norm": grad_norm, "lr": schedule(state.step), **metrics}

    return update


def _accumulate(grad_fn: Callable, grad_accum: int, params, frozen, batch, key):
    """(summed values, summed gradients) of ``grad_fn`` over ``grad_accum`` micro-batches (the batch's leading
    axis split in order; micro-batch i draws from ``fold_in(key, i)``), under one ``lax.scan``."""
    if grad_accum == 1:
        return grad_fn(params, frozen, batch, jax.random.fold_in(key, 0))
    micro = jax.tree.map(lambda a: a.reshape(grad_accum, -1, *a.shape[1:]), batch)

    def body(carry, xs):
        mb, i = xs
        return jax.tree.map(jnp.add, carry, grad_fn(params, frozen, mb, jax.random.fold_in(key, i))), None

    shapes = jax.eval_shape(grad_fn, params, frozen, jax.tree.map(lambda a: a[0], micro), key)
    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
    return jax.lax.scan(body, zeros, (micro, jnp.arange(grad_accum)))[0]


def _several_updates(one_update: Callable, state: TrainState, frozen, batch, key, epochs: int, minibatches: int):
    """``epochs`` passes over ``batch`` in ``minibatches`` minibatches each (a permutation per epoch from
    ``key``): (params, opt_state, metrics averaged over the updates; expert loads summed)."""
    rows = jax.tree.leaves(batch)[0].shape[0]
    order = jnp.stack([jax.random.permutation(jax.random.fold_in(key, 1_000_003 + e), rows) for e in range(epochs)])
    order = order.reshape(epochs * minibatches, rows // minibatches)

    def body(carry, xs):
        params, opt_state = carry
        idx, i = xs
        mb = jax.tree.map(lambda a: jnp.take(a, idx, axis=0), batch)
        params, opt_state, metrics = one_update(params, opt_state, frozen, mb, jax.random.fold_in(key, 7919 + i))
        return (params, opt_state), metrics

    (params, opt_state), per_update = jax.lax.scan(body, (state.params, state.opt_state),
                                                   (order, jnp.arange(epochs * minibatches)))
    load = per_update.pop("expert_load")
    last = {name: per_update.pop(name)[-1] for name in ("spikes_skipped",) if name in per_update}
    metrics = {name: jax.tree.map(lambda a: jnp.mean(a, axis=0), value) for name, value in per_update.items()}
    return params, opt_state, {**metrics, **last, "expert_load": jax.tree.map(lambda a: jnp.sum(a, axis=0), load)}


def _watched(watching, params, grads, updates, n_layers: int) -> dict:
    """``watch.watch_stats`` on a step that is watched, the same shapes of zeros on the others (no reductions)."""
    stats = lambda: watch.watch_stats(params, grads, updates, n_layers)  # noqa: E731
    return jax.lax.cond(watching, stats, lambda: jax.tree.map(jnp.zeros_like, jax.eval_shape(stats)))


def lm_update(cfg: ModelConfig, tcfg: TrainConfig, optimizer: optax.GradientTransformation,
              mask_id: int | None = None, platform: str | None = None, model_of: Callable | None = None) -> Callable:
    """The language-model step (``make_update`` of ``lm_objective``): (state, batch, frozen) → (state, metrics);
    not jitted here (``compile_update``). The MoE offsets follow the control rule unless ``model_of`` trains a
    part beside a frozen model (which keeps its offsets). ``platform`` ("cpu", "gpu", "tpu") resolves the "auto"
    execution paths (default: the default backend)."""
    return make_update(lm_objective(cfg, tcfg, mask_id, platform, model_of), tcfg, optimizer,
                       offsets=moe_offsets(cfg) if model_of is None else None, n_layers=cfg.n_layers)


def make_train_step(cfg: ModelConfig, tcfg: TrainConfig, optimizer: optax.GradientTransformation,
                    mask_id: int | None = None, platform: str | None = None) -> Callable:
    """The language-model step of a whole model: (state, batch) → (state, metrics); not jitted here."""
    update = lm_update(cfg, tcfg, optimizer, mask_id, platform)
    return lambda state, batch: update(state, batch, None)


def abstract_state(cfg: ModelConfig, tcfg: TrainConfig, trainable=None) -> TrainState:
    """Shapes and dtypes of a run's TrainState over ``trainable`` (default: a fresh model); nothing allocated."""
    return jax.eval_shape(lambda: init_state(cfg, tcfg, optimizer_for(tcfg, cfg=cfg), trainable))


def place_state(state: TrainState, mesh) -> TrainState:
    return jax.device_put(state, tree_shardings(state, mesh))


def abstract_batch(tcfg: TrainConfig) -> dict:
    """Shapes and dtypes of a language-model batch of ``tcfg``'s size."""
    kinds = {"tokens": jnp.int32, "targets": jnp.int32, "mask": jnp.float32, "segment_ids": jnp.int32,
             "positions": jnp.int32}
    return {k: jax.ShapeDtypeStruct((tcfg.batch_size, tcfg.seq_len), d) for k, d in kinds.items()}


def jit_update(update: Callable, state, frozen, mesh) -> Callable:
    """``update`` (state, batch, frozen) → (state, metrics) jitted on ``mesh``: the state and the frozen tree
    sharded by ``parallel.param_spec`` (replicated on a data-only mesh), the batch split over the mesh's batch
    axes, the state donated. ``state`` and ``frozen``: the trees (arrays or ShapeDtypeStructs) it will get."""
    state_sh, frozen_sh = tree_shardings(state, mesh), tree_shardings(frozen, mesh)
    return jax.jit(on_mesh(update, mesh), in_shardings=(state_sh, batch_sharding(mesh), frozen_sh),
                   out_shardings=(state_sh, replicated(mesh)), donate_argnums=0)


def placed_like(tree, mesh, sharding=None):
    """ShapeDtypeStructs of ``tree`` (arrays, numpy arrays or ShapeDtypeStructs) with their shardings on
    ``mesh`` (``sharding`` for every leaf, else ``parallel.param_spec``'s)."""
    shardings = tree_shardings(tree, mesh) if sharding is None else jax.tree.map(lambda _: sharding, tree)
    return jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), tree, shardings)


def compile_update(update: Callable, state, frozen, batch, mesh):
    """The one way every run kind compiles its step: ``jit_update`` lowered and compiled ahead of time from the
    shapes of ``state``, ``frozen`` and one ``batch`` (as the batch source gives it), so its memory can be read
    before a run writes anything (train/preflight.py) and the loop runs this same executable (one compile)."""
    jitted = jit_update(update, state, frozen, mesh)
    return jitted.lower(placed_like(state, mesh), placed_like(batch, mesh, batch_sharding(mesh)),
                        placed_like(frozen, mesh)).compile()


def compile_lm_step(cfg: ModelConfig, tcfg: TrainConfig, mesh, mask_id: int | None = None, *, trainable=None,
                    frozen=None, model_of: Callable | None = None):
    """The language-model step of ``tcfg`` compiled on ``mesh`` (``compile_update``): over a fresh model, or
    over ``trainable`` beside ``frozen`` (``model_of``: see ``lm_objective``). The whole-model step is kept for
    the next run of this process with the same configs, mesh and tracing settings (``compiled_steps``):
    a resumed, repeated or evaluated run of a notebook or a test module traces, lowers and compiles it once. A
    fine-tuning step (SFT, full or LoRA) is kept the same way, keyed also by the shapes of ``trainable`` and
    ``frozen`` and by ``model_of`` (``lora.model_of`` returns one function per LoRA config)."""
    key = ("lm", cfg, tcfg, mesh, mask_id, shapes_key(trainable), shapes_key(frozen), model_of, tracing_settings())
    return compiled_steps.get(key, lambda: _compile_lm_step(cfg, tcfg, mesh, mask_id, trainable, frozen, model_of))


def _compile_lm_step(cfg, tcfg, mesh, mask_id, trainable, frozen, model_of):
    update = lm_update(cfg, tcfg, optimizer_for(tcfg, cfg=cfg), mask_id, mesh_platform(mesh), model_of)
    return compile_update(update, abstract_state(cfg, tcfg, trainable), frozen, abstract_batch(tcfg), mesh)


def tracing_settings() -> tuple:
    """jax's global settings that change what a traced step computes (its dtypes and matmul precision)."""
    return bool(jax.config.jax_enable_x64), str(jax.config.jax_default_matmul_precision)


class Kept:
    """The values of the last ``maxsize`` keys, built on a miss (a least-recently-used cache whose key need not be
    the builder's arguments): the compiled steps a process reuses. ``cache_clear()`` drops them."""

    def __init__(self, maxsize: int):
        self.maxsize, self._values = maxsize, collections.OrderedDict()

    def get(self, key, build: Callable):
        if key in self._values:
            self._values.move_to_end(key)
            return self._values[key]
        value = build()
        self._values[key] = value
        if len(self._values) > self.maxsize:
            self._values.popitem(last=False)
        return value

    def __len__(self) -> int:
        return len(self._values)

    def cache_clear(self) -> None:
        self._values.clear()


# Every run kind's compiled step, the last eight (compile_lm_step for pretraining and SFT, full or LoRA;
# train/preflight.compiled_update for reward, DPO and RL): a resumed, repeated or evaluated run of this process
# reuses its step. Keyed by what it is traced from. ``compiled_steps.cache_clear()`` drops them (with
# ``jax.clear_caches()``, to free their memory).
compiled_steps = Kept(8)


def shapes_key(tree) -> tuple:
    """A hashable key of a tree's structure and its leaves' shapes and dtypes (what a compile sees of it)."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((tuple(np.shape(x)), str(getattr(x, "dtype", type(x).__name__))) for x in leaves)


@functools.lru_cache(maxsize=8)
def jit_train_step(cfg: ModelConfig, tcfg: TrainConfig, mesh, mask_id: int | None = None) -> Callable:
    """The jitted whole-model step, (state, batch) → (state, metrics) (``jit_update`` of ``lm_update``), with
    ``.lower(state, batch)`` as a jitted function has (the benchmarks read its compiled memory analysis).
    Cached on the (hashable) configs and mesh, so a repeated call in one process compiles once."""
    update = lm_update(cfg, tcfg, optimizer_for(tcfg, cfg=cfg), mask_id, mesh_platform(mesh))
    jitted = jit_update(update, abstract_state(cfg, tcfg), None, mesh)

    def step(state, batch):
        return jitted(state, batch, None)

    step.lower = lambda state, batch: jitted.lower(state, batch, None)
    return step


def mesh_platform(mesh) -> str:
    """"cpu", "gpu" or "tpu" of the mesh's devices (a TPU topology's devices for an AOT compile on the CPU)."""
    return backend_platform(mesh.devices.flat[0].platform)


def on_mesh(fn: Callable, mesh) -> Callable:
    """``fn`` traced with ``mesh`` as the abstract mesh, so kernels that must run under ``jax.shard_map``
    (kernels/attention.py, kernels/gmm.py) find it; shardings still propagate as before (axes stay Auto)."""

    @functools.wraps(fn)
    def traced(*args):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args)

    return traced


EVAL_SEED = 1234  # the diffusion bound's noise at evaluation: fixed, so every evaluation scores the same draws


@functools.lru_cache(maxsize=8)
def make_eval_step(cfg: ModelConfig, mesh, objective: str = "ar", mask_id: int | None = None,
                   kernels=None) -> Callable:
    """(params, batch, index) → (Σ loss, Σ count) in float32, jitted with the batch sharded like training
    batches: Σ b·NLL over targets (AR), or Σ NELBO over maskable tokens (diffusion; batch ``index`` picks the
    fixed noise draw ``fold_in(key(EVAL_SEED), index)``). ``kernels``: the execution paths (default "auto")."""
    paths = {} if kernels is None else {"attention_impl": kernels.attention_impl, "moe_impl": kernels.moe_impl,
                                        "loss_chunk": kernels.loss_chunk, "interpret_kernels": kernels.interpret}
    tcfg = TrainConfig(objective=objective, **paths)
    fn = on_mesh(objective_fn(cfg, tcfg, jnp.float32, mask_id, mesh_platform(mesh)), mesh)

    def step(params, batch, index):
        loss_sum, (n, _) = fn(params, batch, jax.random.fold_in(seed_key(EVAL_SEED), index))
        return loss_sum, n

    # params follow their argument's sharding (replicated, or sharded as in training)
    return jax.jit(step, in_shardings=(None, batch_sharding(mesh), replicated(mesh)), out_shardings=replicated(mesh))


def device_batch(batch: dict, mesh, global_size: int | None = None) -> dict:
    """A host batch as global arrays split over the mesh's batch axes. With one process ``batch`` is the whole
    batch; with several it holds this process's rows (``parallel.local_rows``) of a ``global_size`` batch."""
    if jax.process_count() == 1:
        sharding = batch_sharding(mesh)
        return {k: jax.device_put(np.asarray(batch[k]), sharding) for k in BATCH_KEYS}
    return global_batch(batch, mesh, global_size, BATCH_KEYS)


@dataclasses.dataclass
class EvalResult:
    loss: float  # nats per target token
    perplexity: float
    bits_per_byte: float | None  # None when the scored tokens stand for no known bytes (token ids, IdTokenizer)
    n_targets: int
    n_bytes: int
    per_source: dict | None = None  # a mixture's {source name: EvalResult}; this result is their weighted mean

    def as_dict(self) -> dict:
        bpb = {} if self.bits_per_byte is None else {"val_bpb": self.bits_per_byte}
        out = {"val_loss": self.loss, "val_ppl": self.perplexity, **bpb, "val_targets": self.n_targets,
               "val_bytes": self.n_bytes}
        for name, r in (self.per_source or {}).items():
            out[f"val_loss/{name}"] = r.loss
            if r.bits_per_byte is not None:
                out[f"val_bpb/{name}"] = r.bits_per_byte
        return out


def evaluate(eval_step: Callable, params, val_set, mesh, objective: str = "ar") -> EvalResult:
    """Validation loss, perplexity and bits per byte (total NLL in bits ÷ UTF-8 bytes of the scored text).

    For the diffusion objective the loss is the NELBO (an upper bound on the NLL, so perplexity and bits per
    byte are upper bounds too) and the scored text is the windows' tokens, each val token once."""
    rows = local_rows(mesh, len(val_set.batches[0]["tokens"]))
    totals = [eval_step(params, device_batch({k: b[k][rows] for k in BATCH_KEYS}, mesh, len(b["tokens"])),
                        np.int32(i)) for i, b in enumerate(val_set.batches)]
    nll = float(sum(float(s) for s, _ in totals))
    n = float(sum(float(c) for _, c in totals))
    loss = nll / n
    n_bytes = val_set.n_token_bytes if objective == "diffusion" else val_set.n_bytes
    bpb = float(bits_per_byte(nll, n_bytes)) if n_bytes > 0 else None
    return EvalResult(loss, float(perplexity(loss)), bpb, int(n), int(n_bytes))
