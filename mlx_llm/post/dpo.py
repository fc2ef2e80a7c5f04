"""Direct preference optimisation (M20 §16, U19 §13): the KL-leashed objective solved for the reward, so the policy
is trained on preference pairs directly, with no reward model and no sampling.

    L_DPO = −log σ(β [ℓ_θ(y⁺|c) − ℓ_θ(y⁻|c) − ℓ_ref(y⁺|c) + ℓ_ref(y⁻|c)])

ℓ is the **sum** of the reply's token log-probabilities (``pairs.response_logprobs``; M20 §16: normalising by
length would change the objective). The bracket times β is the *margin* m (the difference of the implicit
rewards β·log π_θ/π_ref of the two replies); ∂L/∂θ = −β σ(−m) (∇ℓ_θ(y⁺|c) − ∇ℓ_θ(y⁻|c)): each pair pushes with
weight β σ(−m), large while the policy still ranks the pair wrongly. The reference is frozen; its log-probs are
computed in the same step with no gradient through them.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from mlx_llm.config import TrainConfig
from mlx_llm.errors import ConfigError
from mlx_llm.post import loop
from mlx_llm.post import lora as lora_lib
from mlx_llm.post import pairs as pairs_lib
from mlx_llm.train.metrics import write_summary


# ----- the equations ------------------------------------------------------------------------------------------
def margin(lp_chosen, lp_rejected, ref_chosen, ref_rejected, beta):
    """m = β [(ℓ_θ(y⁺) − ℓ_ref(y⁺)) − (ℓ_θ(y⁻) − ℓ_ref(y⁻))]: the implicit reward margin (U19 §13)."""
    return beta * ((lp_chosen - ref_chosen) - (lp_rejected - ref_rejected))


def loss_from_margin(m):
    """−log σ(m) = softplus(−m), stable for any m."""
    return jax.nn.softplus(-m)


def dpo_loss(lp_chosen, lp_rejected, ref_chosen, ref_rejected, beta):
    """Per-pair DPO loss (M20 §16)."""
    return loss_from_margin(margin(lp_chosen, lp_rejected, ref_chosen, ref_rejected, beta))


def pair_weight(m, beta):
    """β σ(−m): how hard a pair pushes (∂L/∂ℓ_θ(y⁺) = −β σ(−m), U19 §13)."""
    return beta * jax.nn.sigmoid(-m)


# ----- in a model ---------------------------------------------------------------------------------------------
def pair_logprobs(params, cfg, batch, kernels=None):
    """(ℓ(y⁺|c), ℓ(y⁻|c)) of a pair batch, both sides in one forward pass."""
    both = pairs_lib.concat_sequences(batch["chosen"], batch["rejected"])
    lp = pairs_lib.response_logprobs(params, cfg, both, kernels)
    n = batch["chosen"]["ids"].shape[0]
    return lp[:n], lp[n:]


@functools.lru_cache(maxsize=16)  # one function per setting: its jitted update compiles once
def make_loss(cfg, beta: float, lora_cfg, nll_weight: float = 0.0, kernels=None):
    """(trainable, frozen, batch) → (mean DPO loss, {margin, accuracy, chosen/rejected implicit rewards}).

    ``nll_weight`` α > 0 adds α · (−ℓ_θ(y⁺|c) / |y⁺|), the chosen reply's mean token NLL (the RPO loss of Pang et
    al. 2024, "Iterative Reasoning Preference Optimization"): pure DPO (α = 0, the default) can lower ℓ_θ(y⁺)
    when y⁺ and y⁻ differ in a token or two (Pal et al. 2024, "Smaug"), which is exactly what a wrong digit is.
    ``kernels``: the execution paths of both forwards."""

    def loss_fn(trainable, frozen, batch):
        ref_c, ref_r = jax.lax.stop_gradient(pair_logprobs(frozen["reference"], cfg, batch, kernels))
        lp_c, lp_r = pair_logprobs(loop.policy_params(trainable, frozen, lora_cfg), cfg, batch, kernels)
        m = margin(lp_c, lp_r, ref_c, ref_r, beta)
        n_chosen = jnp.sum(batch["chosen"]["target"][:, 1:], axis=-1)
        nll = jnp.mean(-lp_c / n_chosen) if nll_weight else 0.0
        return jnp.mean(loss_from_margin(m)) + nll_weight * nll, {
            "margin": jnp.mean(m), "accuracy": jnp.mean((m > 0).astype(m.dtype)),
            "reward_chosen": beta * jnp.mean(lp_c - ref_c), "reward_rejected": beta * jnp.mean(lp_r - ref_r)}

    return loss_fn


def make_eval(cfg, beta, lora_cfg, frozen, data: pairs_lib.PairData, batch_size: int):
    """Held-out pairs: mean loss, implicit reward margin and preference accuracy (margin > 0)."""
    loss_fn = jax.jit(make_loss(cfg, beta, lora_cfg))

    def evaluate(trainable) -> dict:
        totals = np.zeros(3)
        n_all = 0
        for batch, n in data.val_batches(batch_size):
            batch = jax.tree.map(lambda a: jnp.asarray(a[:n]), batch)
            loss, aux = loss_fn(trainable, frozen, batch)
            totals += n * np.array([float(loss), float(aux["margin"]), float(aux["accuracy"])])
            n_all += n
        loss, m, acc = totals / n_all
        return {"val_loss": loss, "val_margin": m, "val_accuracy": acc}

    return evaluate


# ----- runs ---------------------------------------------------------------------------------------------------
def dpo_run(run_dir, base_run=None, *, tcfg: TrainConfig | None = None, beta: float = 0.1, data=None, task=None,
            reference=None, lora_cfg: lora_lib.LoRAConfig | None = None, n_train: int | None = None,
            model_negatives: bool = False, nll_weight: float = 0.0, eval_examples: int | None = 200,
            resume: bool = False, show_progress: bool = True, max_seconds: float | None = None, log=print) -> dict:
    """DPO from ``base_run`` (the policy's start, and the reference unless ``reference`` names another run with
    the same tokenizer and config) on pairs of ``data`` or ``task``; with a task, held-out exact match before and
    after. Everything is checked before the run directory is created."""
    from mlx_llm.post.sft import eval_task
    from mlx_llm.train.run import check_run_dir, locked_run_dir

    run_dir = Path(run_dir)
    check_run_dir(run_dir, resume)
    if resume:
        _, tcfg, info = loop.read_run_files(run_dir)
        rec = info["post"]
        base_run, beta, data, task, reference = rec["base"], rec["beta"], rec["data"], rec["task"], rec["reference"]
        n_train, model_negatives, nll_weight = rec["n_train"], rec["model_negatives"], rec["nll_weight"]
        lora_cfg = loop.lora_from_record(rec)
    beta = loop.check_beta(beta)
    if isinstance(nll_weight, bool) or not isinstance(nll_weight, (int, float)) or not 0 <= nll_weight < math.inf:
        raise ConfigError(f"nll_weight = {nll_weight!r} is invalid: it must be a finite number ≥ 0 (0: pure DPO)")
    base = loop.load_base(base_run)
    ref = base if reference is None else loop.load_base(reference)
    loop.check_same_model(base, ref, "reference")
    if tcfg.seq_len > base.cfg.max_seq_len:
        raise ConfigError(f"seq_len = {tcfg.seq_len} is longer than the base model's max_seq_len = "
                          f"{base.cfg.max_seq_len}")
    data_ = pairs_lib.load_pairs(base, tcfg, data=data, task=task, n_train=n_train, model_negatives=model_negatives)
    record = loop.post_record("dpo", base, lora_cfg, beta=beta, task=task, n_train=n_train,
                              data=None if data is None else str(Path(data).resolve()),
                              reference=None if reference is None else str(Path(reference).resolve()),
                              model_negatives=model_negatives, nll_weight=nll_weight)
    trainable = loop.initial_trainable(base, lora_cfg, tcfg.seed)
    frozen = {"reference": ref.params, **({"base": base.params} if lora_cfg is not None else {})}
    batch_fn = lambda s, _: (data_.train_batch(s, tcfg.batch_size, tcfg.seed), {})  # noqa: E731
    update = loop.compiled_update(base.cfg, tcfg, make_loss(base.cfg, beta, lora_cfg, nll_weight,
                                                            tcfg.kernels(resolve=True)),
                                  trainable, frozen, batch_fn(0, None)[0])
    before = (eval_task(base.params, base.cfg, base.tok, task, base.template, n=eval_examples)
              if task is not None and not resume else None)
    with locked_run_dir(run_dir, resume):  # held to the end of the run
        loop.start_run(run_dir, base, tcfg, record, resume)
        log(f"dpo from {base.run} (step {base.step}), β = {beta:g}, NLL weight {nll_weight:g}: {len(data_.train):,} train pairs, "
            f"{len(data_.val):,} held out; {'LoRA' if lora_cfg else 'full'}")
        out = loop.post_loop(run_dir, base.cfg, tcfg, trainable, frozen, update, batch_fn,
                             evaluate=make_eval(base.cfg, beta, lora_cfg, frozen, data_, tcfg.batch_size),
                             resume=resume, show_progress=show_progress, max_seconds=max_seconds, log=log)
        summary = {"steps": out["steps"], "wall_seconds": out["wall_seconds"], **out["eval"]}
        if task is not None:
            params = loop.policy_params(out["state"].params, frozen, lora_cfg)
            summary["heldout_accuracy"] = eval_task(params, base.cfg, base.tok, task, base.template, n=eval_examples)["accuracy"]
            if before is not None:
                summary["base_heldout_accuracy"] = before["accuracy"]
        return write_summary(run_dir, summary)
