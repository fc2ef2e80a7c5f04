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

import jax
import jax.numpy as jnp
import numpy as np

from mlx_llm.config import LoRAConfig, TrainConfig
from mlx_llm.objectives.preference import (  # noqa: F401 (the equations live there)
    margin, loss_from_margin, dpo_loss, pair_weight)
from mlx_llm.eval.replies import eval_task
from mlx_llm.post import pairs as pairs_lib
from mlx_llm.post import prologue
from mlx_llm.runs.configs import DPOConfig
from mlx_llm.train.metrics import write_summary
from mlx_llm.train.preflight import compiled_update
from mlx_llm.train.step import moe_offsets


# ----- in a model ---------------------------------------------------------------------------------------------
def pair_logprobs(params, cfg, batch, kernels=None, *, remat: str = "none", return_aux: bool = False):
    """(ℓ(y⁺|c), ℓ(y⁻|c)) of a pair batch, both sides in one forward pass; with ``return_aux``,
    ((ℓ(y⁺|c), ℓ(y⁻|c)), the forward's MoE expert loads)."""
    both = pairs_lib.concat_sequences(batch["chosen"], batch["rejected"])
    lp, load = pairs_lib.response_logprobs(params, cfg, both, kernels, remat=remat, return_aux=True)
    n = batch["chosen"]["ids"].shape[0]
    return ((lp[:n], lp[n:]), load) if return_aux else (lp[:n], lp[n:])


@functools.lru_cache(maxsize=16)  # one function per setting: its jitted update compiles once
def make_objective(cfg, beta: float, lora_cfg, nll_weight: float = 0.0, kernels=None, remat: str = "none"):
    """(trainable, frozen, pair batch, key) → (Σ DPO loss, (pairs, the policy's expert loads, {margin, accuracy,
    chosen/rejected implicit rewards} summed)): ``train.step.make_update``'s form, whose step divides by the pairs.

    ``nll_weight`` α > 0 adds α · (−ℓ_θ(y⁺|c) / |y⁺|), the chosen reply's mean token NLL (the RPO loss of Pang et
    al. 2024, "Iterative Reasoning Preference Optimization"): pure DPO (α = 0, the default) can lower ℓ_θ(y⁺)
    when y⁺ and y⁻ differ in a token or two (Pal et al. 2024, "Smaug"), which is exactly what a wrong digit is.
    ``kernels``: the execution paths of both forwards."""

    def objective(trainable, frozen, batch, key):
        ref_c, ref_r = jax.lax.stop_gradient(pair_logprobs(frozen["reference"], cfg, batch, kernels))
        (lp_c, lp_r), load = pair_logprobs(prologue.policy_params(trainable, frozen, lora_cfg), cfg, batch, kernels,
                                           remat=remat, return_aux=True)
        m = margin(lp_c, lp_r, ref_c, ref_r, beta)
        n_chosen = jnp.sum(batch["chosen"]["target"][:, 1:], axis=-1)
        nll = jnp.sum(-lp_c / n_chosen) if nll_weight else 0.0
        return jnp.sum(loss_from_margin(m)) + nll_weight * nll, (jnp.asarray(m.shape[0], jnp.float32), load, {
            "margin": jnp.sum(m), "accuracy": jnp.sum((m > 0).astype(m.dtype)),
            "reward_chosen": beta * jnp.sum(lp_c - ref_c), "reward_rejected": beta * jnp.sum(lp_r - ref_r)})

    return objective


def make_eval(cfg, beta, lora_cfg, frozen, data: pairs_lib.PairData, batch_size: int, max_tokens: int | None = None):
    """Held-out pairs (``max_tokens``: see ``PairData.val_batches``): mean loss, implicit reward margin and
    preference accuracy (margin > 0)."""
    objective = jax.jit(make_objective(cfg, beta, lora_cfg))

    def evaluate(trainable) -> dict:
        totals = np.zeros(3)
        n_all = 0
        for batch, n in data.val_batches(batch_size, max_tokens):
            batch = jax.tree.map(lambda a: jnp.asarray(a[:n]), batch)
            loss, (_, _, sums) = objective(trainable, frozen, batch, None)
            totals += np.array([float(loss), float(sums["margin"]), float(sums["accuracy"])])
            n_all += n
        loss, m, acc = totals / n_all
        return {"val_loss": loss, "val_margin": m, "val_accuracy": acc}

    return evaluate


# ----- runs ---------------------------------------------------------------------------------------------------
def dpo_run(run_dir, base_run=None, *, tcfg: TrainConfig | None = None, settings: DPOConfig | None = None,
            lora_cfg: LoRAConfig | None = None, resume=False, changes: dict | None = None,
            from_step: int | None = None, show_progress: bool = True, max_seconds: float | None = None,
            log=print, options=None) -> dict:
    """DPO from ``base_run`` (the policy's start, and the reference unless ``settings.reference`` names another
    run with the same tokenizer and config) on the pairs of ``settings``' data or task; with a task, held-out
    exact match before and after. Everything is checked before the run directory is created
    (``prologue.start``); on resume everything is read back from the run."""
    st = prologue.start(run_dir, "dpo", base_run, tcfg=tcfg, settings=settings, lora_cfg=lora_cfg, resume=resume,
                        changes=changes, from_step=from_step, options=options)
    base, tcfg, s, lora_cfg = st.base, st.tcfg, st.settings, st.lora_cfg
    data_ = pairs_lib.load_pairs(base, tcfg, data=s.data, task=s.task, n_train=s.n_train,
                                 model_negatives=s.model_negatives)
    trainable = prologue.initial_trainable(base, lora_cfg, tcfg.params_seed)
    frozen = {"reference": st.reference.params, **({"base": base.params} if lora_cfg is not None else {})}
    batch_fn = lambda step, _: (data_.train_batch(step, tcfg.batch_size, tcfg.batch_seed), {})  # noqa: E731
    objective = make_objective(base.cfg, s.beta, lora_cfg, s.nll_weight, tcfg.kernels(resolve=True), tcfg.remat)
    update = compiled_update(base.cfg, st.schedule_tcfg, objective, trainable, frozen, batch_fn(0, None)[0],
                             offsets=None if lora_cfg else moe_offsets(base.cfg))
    before = (eval_task(base.params, base.cfg, base.tok, s.task, base.template, n=s.eval_examples)
              if s.task is not None and st.resume is None else None)
    with st.writing():  # the run's lock, held to the end of the run
        log(f"dpo from {base.run} (step {base.step}), β = {s.beta:g}, NLL weight {s.nll_weight:g}: "
            f"{len(data_.train):,} train pairs, {len(data_.val):,} held out; {'LoRA' if lora_cfg else 'full'}")
        out = st.fit(trainable, frozen, update, batch_fn,
                     make_eval(base.cfg, s.beta, lora_cfg, frozen, data_, tcfg.batch_size,
                               tcfg.eval_tokens or None),
                     show_progress=show_progress, max_seconds=max_seconds, log=log, options=options)
        summary = out["summary"]
        if s.task is not None:
            params = prologue.policy_params(out["state"].params, frozen, lora_cfg)
            summary["heldout_accuracy"] = eval_task(params, base.cfg, base.tok, s.task, base.template,
                                                    n=s.eval_examples)["accuracy"]
            if before is not None:
                summary["base_heldout_accuracy"] = before["accuracy"]
        return write_summary(st.run_dir, summary)
