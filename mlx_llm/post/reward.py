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

from mlx_llm.config import ModelConfig, TrainConfig
from mlx_llm.errors import ConfigError
from mlx_llm.model import hidden_states
from mlx_llm.ops import rms_norm
from mlx_llm.post import loop
from mlx_llm.post import lora as lora_lib
from mlx_llm.post import pairs as pairs_lib
from mlx_llm.post.chat import ChatTemplate
from mlx_llm.train import tokenizer as tok_lib
from mlx_llm.train.checkpoint import read_run_files
from mlx_llm.train.metrics import write_summary


# ----- the equations ------------------------------------------------------------------------------------------
def preference_probability(r_chosen, r_rejected):
    """P(y⁺ ≻ y⁻) = σ(r⁺ − r⁻) (U19 §11)."""
    return jax.nn.sigmoid(r_chosen - r_rejected)


def bt_loss(r_chosen, r_rejected):
    """−log σ(r⁺ − r⁻) per pair, as softplus(r⁻ − r⁺) (stable for any difference)."""
    return jax.nn.softplus(r_rejected - r_chosen)


def bt_grads(r_chosen, r_rejected):
    """(∂L/∂r⁺, ∂L/∂r⁻) = (−σ(r⁻ − r⁺), σ(r⁻ − r⁺)), by hand."""
    s = jax.nn.sigmoid(r_rejected - r_chosen)
    return -s, s


# ----- in a model ---------------------------------------------------------------------------------------------
def sequence_rewards(params, head_D, cfg: ModelConfig, seqs, kernels=None) -> jax.Array:
    """r = w · R at each sequence's last id (``length`` − 1), shape (B,); ``kernels``: the execution paths."""
    ids = seqs["ids"]
    r_BTD = rms_norm(hidden_states(params, ids, cfg, kernels=kernels), params["final_norm"], cfg.norm_eps)
    last_BD = jnp.take_along_axis(r_BTD, (seqs["length"] - 1)[:, None, None].astype(jnp.int32), axis=1)[:, 0]
    acc = jnp.promote_types(last_BD.dtype, jnp.float32)  # rewards leave in ≥ float32, like logits
    return jnp.einsum("bd,d->b", last_BD.astype(acc), head_D.astype(acc))


def pair_rewards(params, head_D, cfg, batch, kernels=None):
    both = pairs_lib.concat_sequences(batch["chosen"], batch["rejected"])
    r = sequence_rewards(params, head_D, cfg, both, kernels)
    n = batch["chosen"]["ids"].shape[0]
    return r[:n], r[n:]


@functools.lru_cache(maxsize=16)  # one function per setting: its jitted update compiles once
def make_loss(cfg: ModelConfig, lora_cfg, kernels=None):
    def loss_fn(trainable, frozen, batch):
        params = loop.policy_params(trainable["model"], frozen, lora_cfg)
        r_c, r_r = pair_rewards(params, trainable["reward_head"], cfg, batch, kernels)
        return jnp.mean(bt_loss(r_c, r_r)), {"accuracy": jnp.mean((r_c > r_r).astype(r_c.dtype)),
                                             "reward_gap": jnp.mean(r_c - r_r)}

    return loss_fn


def make_eval(cfg, lora_cfg, frozen, data: pairs_lib.PairData, batch_size: int):
    """Held-out pairs: mean Bradley–Terry loss and preference accuracy (r⁺ > r⁻)."""
    loss_fn = jax.jit(make_loss(cfg, lora_cfg))

    def evaluate(trainable) -> dict:
        totals, n_all = np.zeros(2), 0
        for batch, n in data.val_batches(batch_size):
            loss, aux = loss_fn(trainable, frozen, jax.tree.map(lambda a: jnp.asarray(a[:n]), batch))
            totals += n * np.array([float(loss), float(aux["accuracy"])])
            n_all += n
        loss, acc = totals / n_all
        return {"val_loss": loss, "val_accuracy": acc}

    return evaluate


# ----- runs ---------------------------------------------------------------------------------------------------
def reward_run(run_dir, base_run=None, *, tcfg: TrainConfig | None = None, data=None, task=None,
               lora_cfg: lora_lib.LoRAConfig | None = None, n_train: int | None = None,
               model_negatives: bool = False, resume: bool = False, show_progress: bool = True,
               max_seconds: float | None = None, log=print) -> dict:
    """Train a reward model from ``base_run`` on the pairs of ``data`` or ``task`` (``model_negatives``: add the
    base's own wrong samples as rejected replies); prints and returns held-out preference accuracy."""
    from mlx_llm.train.run import check_run_dir, locked_run_dir

    run_dir = Path(run_dir)
    check_run_dir(run_dir, resume)
    if resume:
        _, tcfg, info = read_run_files(run_dir)
        rec = info["post"]
        base_run, data, task, n_train, model_negatives = (rec["base"], rec["data"], rec["task"], rec["n_train"],
                                                          rec["model_negatives"])
        lora_cfg = loop.lora_from_record(rec)
    base = loop.load_base(base_run)
    if tcfg.seq_len > base.cfg.max_seq_len:
        raise ConfigError(f"seq_len = {tcfg.seq_len} is longer than the base model's max_seq_len = "
                          f"{base.cfg.max_seq_len}")
    data_ = pairs_lib.load_pairs(base, tcfg, data=data, task=task, n_train=n_train, model_negatives=model_negatives)
    record = loop.post_record("reward", base, lora_cfg, task=task, n_train=n_train, model_negatives=model_negatives,
                              data=None if data is None else str(Path(data).resolve()))
    trainable = {"model": loop.initial_trainable(base, lora_cfg, tcfg.seed),
                 "reward_head": jnp.zeros((base.cfg.d_model,), jnp.float32)}
    frozen = {"base": base.params} if lora_cfg is not None else {}
    batch_fn = lambda s, _: (data_.train_batch(s, tcfg.batch_size, tcfg.seed), {})  # noqa: E731
    update = loop.compiled_update(base.cfg, tcfg, make_loss(base.cfg, lora_cfg, tcfg.kernels(resolve=True)),
                                  trainable, frozen, batch_fn(0, None)[0])
    with locked_run_dir(run_dir, resume):  # held to the end of the run
        loop.start_run(run_dir, base, tcfg, record, resume)
        log(f"reward model from {base.run} (step {base.step}): {len(data_.train):,} train pairs, {len(data_.val):,} "
            f"held out; {'LoRA' if lora_cfg else 'full'}")
        out = loop.post_loop(run_dir, base.cfg, tcfg, trainable, frozen, update, batch_fn,
                             evaluate=make_eval(base.cfg, lora_cfg, frozen, data_, tcfg.batch_size),
                             resume=resume, show_progress=show_progress, max_seconds=max_seconds, log=log)
        return write_summary(run_dir, {"steps": out["steps"], "wall_seconds": out["wall_seconds"], **out["eval"]})


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
    from mlx_llm.train.run import load_params, restore_params

    run_dir = Path(run_dir)
    cfg, tcfg, info = read_run_files(run_dir)
    rec = info.get("post") or {}
    if rec.get("kind") != "reward":
        raise ConfigError(f"{run_dir} is not a reward model run (mlx-llm reward --out DIR)")
    base_cfg, base_tcfg, _ = read_run_files(Path(rec["base"]))
    base = load_params(Path(rec["base"]), base_cfg, base_tcfg, rec["base_step"])
    lora_cfg = loop.lora_from_record(rec)
    model_like = base if lora_cfg is None else lora_lib.init(base, lora_cfg, jax.random.key(0))
    like = {"model": model_like, "reward_head": jnp.zeros((cfg.d_model,), jnp.float32)}
    trained = restore_params(run_dir, cfg, tcfg, step, like=like)
    params = trained["model"] if lora_cfg is None else lora_lib.merge(base, trained["model"], lora_cfg)
    return RewardModel(cfg, params, trained["reward_head"], tok_lib.load(run_dir), loop.run_template(info), run_dir)
