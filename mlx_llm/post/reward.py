"""A Bradley–Terry reward model (U19 §11): the pretrained or SFT trunk plus a scalar head read at the reply's
last token, trained on preference pairs.

    r(c, y) = w · R_last,   R = N_γo(H⁽ᴸ⁾) (the final-normed hidden state, M20 §8), ``reward_head`` w (d,)
    P(y⁺ ≻ y⁻) = σ(r⁺ − r⁻),   L = −log σ(r⁺ − r⁻),   ∂L/∂r⁺ = −σ(r⁻ − r⁺) = −∂L/∂r⁻

"The last response token" is the reply's end-of-turn marker: the position that has read the whole reply. Only
differences of rewards enter, so adding a constant to every reward changes no probability and no loss. The head
starts at zero (every pair at ln 2). A reward run's parameters are ``{"model": trunk or LoRA adapters,
"reward_head": w}``.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mlx_llm.config import LoRAConfig, ModelConfig, TrainConfig
from mlx_llm.errors import ConfigError
from mlx_llm.model import hidden_states
from mlx_llm.objectives.preference import (  # noqa: F401 (the equations live there)
    preference_probability, bt_loss, bt_grads)
from mlx_llm.layers.norm import norm
from mlx_llm.post import prologue
from mlx_llm import lora as lora_lib
from mlx_llm.post import pairs as pairs_lib
from mlx_llm.data.chat import ChatTemplate
from mlx_llm.data import tokenizer as tok_lib
from mlx_llm.runs.configs import RewardConfig
from mlx_llm.runs.load import restore_trained, trainable_tree
from mlx_llm.runs.record import open_run
from mlx_llm.train.metrics import write_summary
from mlx_llm.train.preflight import compiled_update
from mlx_llm.train.step import moe_offsets


# ----- in a model ---------------------------------------------------------------------------------------------
def sequence_rewards(params, head_D, cfg: ModelConfig, seqs, kernels=None, *, remat: str = "none",
                     return_aux: bool = False):
    """r = w · R at each sequence's last id (``length`` − 1), shape (B,); ``kernels``: the execution paths; with
    ``return_aux``, also the trunk's MoE expert loads."""
    ids = seqs["ids"]
    h_BTD, load = hidden_states(params, ids, cfg, kernels=kernels, remat=remat, return_aux=True)
    r_BTD = norm(h_BTD, params["final_norm"], cfg)
    last_BD = jnp.take_along_axis(r_BTD, (seqs["length"] - 1)[:, None, None].astype(jnp.int32), axis=1)[:, 0]
    acc = jnp.promote_types(last_BD.dtype, jnp.float32)  # rewards leave in ≥ float32, like logits
    r_B = jnp.einsum("bd,d->b", last_BD.astype(acc), head_D.astype(acc))
    return (r_B, load) if return_aux else r_B


def pair_rewards(params, head_D, cfg, batch, kernels=None, *, remat: str = "none", return_aux: bool = False):
    """(r⁺, r⁻) of a pair batch, both sides in one forward pass; with ``return_aux``, ((r⁺, r⁻), expert loads)."""
    both = pairs_lib.concat_sequences(batch["chosen"], batch["rejected"])
    r, load = sequence_rewards(params, head_D, cfg, both, kernels, remat=remat, return_aux=True)
    n = batch["chosen"]["ids"].shape[0]
    return ((r[:n], r[n:]), load) if return_aux else (r[:n], r[n:])


@functools.lru_cache(maxsize=16)  # one function per setting: its jitted update compiles once
def make_objective(cfg: ModelConfig, lora_cfg, kernels=None, remat: str = "none"):
    """(trainable, frozen, pair batch, key) → (Σ Bradley–Terry loss, (pairs, expert loads, {accuracy,
    reward_gap} summed)): ``train.step.make_update``'s form; trainable = {"model", "reward_head"}."""

    def objective(trainable, frozen, batch, key):
        params = prologue.policy_params(trainable["model"], frozen, lora_cfg)
        (r_c, r_r), load = pair_rewards(params, trainable["reward_head"], cfg, batch, kernels, remat=remat,
                                        return_aux=True)
        n = jnp.asarray(r_c.shape[0], jnp.float32)
        return jnp.sum(bt_loss(r_c, r_r)), (n, load, {"accuracy": jnp.sum((r_c > r_r).astype(r_c.dtype)),
                                                      "reward_gap": jnp.sum(r_c - r_r)})

    return objective


def make_eval(cfg, lora_cfg, frozen, data: pairs_lib.PairData, batch_size: int, max_tokens: int | None = None):
    """Held-out pairs (``max_tokens``: see ``PairData.val_batches``): mean Bradley–Terry loss and preference
    accuracy (r⁺ > r⁻)."""
    objective = jax.jit(make_objective(cfg, lora_cfg))

    def evaluate(trainable) -> dict:
        totals, n_all = np.zeros(2), 0
        for batch, n in data.val_batches(batch_size, max_tokens):
            loss, (_, _, sums) = objective(trainable, frozen, jax.tree.map(lambda a: jnp.asarray(a[:n]), batch), None)
            totals += np.array([float(loss), float(sums["accuracy"])])
            n_all += n
        loss, acc = totals / n_all
        return {"val_loss": loss, "val_accuracy": acc}

    return evaluate


# ----- runs ---------------------------------------------------------------------------------------------------
def reward_run(run_dir, base_run=None, *, tcfg: TrainConfig | None = None, settings: RewardConfig | None = None,
               lora_cfg: LoRAConfig | None = None, resume=False, changes: dict | None = None,
               from_step: int | None = None, show_progress: bool = True, max_seconds: float | None = None,
               log=print, options=None) -> dict:
    """Train a reward model from ``base_run`` on the pairs of ``settings`` (a data file or a task; with
    ``model_negatives`` the base's own wrong samples are rejected replies); returns held-out preference
    accuracy. On resume everything is read back from the run (``changes``, ``from_step``: ``prologue.start``)."""
    st = prologue.start(run_dir, "reward", base_run, tcfg=tcfg, settings=settings, lora_cfg=lora_cfg, resume=resume,
                        changes=changes, from_step=from_step, options=options)
    base, tcfg, s, lora_cfg = st.base, st.tcfg, st.settings, st.lora_cfg
    data_ = pairs_lib.load_pairs(base, tcfg, data=s.data, task=s.task, n_train=s.n_train,
                                 model_negatives=s.model_negatives)
    trainable = trainable_tree(s, prologue.initial_trainable(base, lora_cfg, tcfg.params_seed), base.cfg.d_model)
    frozen = {"base": base.params} if lora_cfg is not None else {}
    batch_fn = lambda s, _: (data_.train_batch(s, tcfg.batch_size, tcfg.batch_seed), {})  # noqa: E731
    objective = make_objective(base.cfg, lora_cfg, tcfg.kernels(resolve=True), tcfg.remat)
    update = compiled_update(base.cfg, st.schedule_tcfg, objective, trainable, frozen, batch_fn(0, None)[0],
                             offsets=None if lora_cfg else moe_offsets(base.cfg, ("model",)))
    with st.writing():  # the run's lock, held to the end of the run
        log(f"reward model from {base.run} (step {base.step}): {len(data_.train):,} train pairs, {len(data_.val):,} "
            f"held out; {'LoRA' if lora_cfg else 'full'}")
        out = st.fit(trainable, frozen, update, batch_fn,
                     make_eval(base.cfg, lora_cfg, frozen, data_, tcfg.batch_size, tcfg.eval_tokens or None),
                     show_progress=show_progress, max_seconds=max_seconds, log=log, options=options)
        return write_summary(st.run_dir, out["summary"])


@dataclasses.dataclass
class RewardModel:
    cfg: ModelConfig
    params: Any  # the trunk (adapters folded in)
    head: Any  # (d,)
    tok: tok_lib.Tokenizer
    template: ChatTemplate
    run: Path

    def score(self, seqs) -> jax.Array:
        """r of each sequence of ``{"ids", "length"}`` (rendered with this model's tokenizer and template)."""
        return _score(self.params, self.head, seqs, cfg=self.cfg)


_jit_score = jax.jit(lambda params, head, seqs, cfg: sequence_rewards(params, head, cfg, seqs), static_argnums=3)


def _score(params, head, seqs, *, cfg):
    return _jit_score(params, head, {"ids": jnp.asarray(seqs["ids"]), "length": jnp.asarray(seqs["length"])}, cfg)


def load_reward_model(run_dir, step: int | None = None) -> RewardModel:
    """A trained reward run: trunk (with its adapters folded in), head, tokenizer and template."""
    run = open_run(run_dir)
    if run.kind != "reward":
        raise ConfigError(f"{run.path} is not a reward model run (mlx-llm reward --out DIR); it is a {run.kind} run")
    model, trained, base = restore_trained(run, step)
    params = model if base is None else lora_lib.merge(base, model, run.record.lora)
    tok = tok_lib.load(run.path)
    return RewardModel(run.cfg, params, trained["reward_head"], tok, prologue.run_template(run.record, tok), run.path)
