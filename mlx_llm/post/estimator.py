"""The one estimator of on-policy RL: every algorithm of ``EstimatorConfig`` (group, grpo, dr_grpo, dapo, gspo, ppo)
as two pure functions of arrays, used unchanged by the language-model trainer (post/rl.py) and the tabular
bandits (post/bandit.py). docs/post-training.md derives each one and its fixed point.

A rollout is P prompts × k replies (rows grouped prompt by prompt), each reply's tokens marked by a mask (B, T);
per reply token it holds log π_old (the trainer's forward at the rollout's parameters), log π_ref (the frozen
reference) and log q (what the sampler drew it with: temperature, top-k, top-p), and per reply a reward r.

``rollout`` makes the update's batch once per rollout:

- the advantage. group: r̃ − the mean of the other k − 1 r̃ of the prompt (leave-one-out); grpo, dapo, gspo:
  (r̃ − the group's mean) / (its standard deviation + 1e-4); dr_grpo: r̃ − the group's mean; ppo: generalised
  advantage estimation over the reply's tokens with the value head (post/ppo.py). r̃ = r − β Σ_t log π_old/π_ref
  with ``kl`` "reward-k1", else r;
- the importance weight of every token, w = π_old/q (of the token or of the reply), truncated (tis) or masked
  (mis) at C, or 1;
- with dynamic sampling, groups whose raw rewards are all equal leave the mask (``keep``).

``loss`` is the loss of one optimizer update at the current log π_θ: per reply token

    ℓ_t = w_t · (−min(ρ_t A_t, clip(ρ_t, 1 − ε_low, 1 + ε_high) A_t) + β k(log π_θ, log π_ref))

with ρ_t = π_θ/π_old of the token (gspo: of the reply, length-normalised; group: no clip), k Schulman's k1/k2/k3
with ``kl`` "loss-k…" (else no term), plus ppo's value loss; aggregated over the batch as ``loss_aggregation``
says. On the first update of a rollout ρ = 1, so the gradient is −w·A·∇log π_θ: REINFORCE with the advantage.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mlx_llm.objectives.preference import (aggregation_weights, clipped_surrogate, gae, group_advantages,
                                           importance_weights, kl_estimate, sequence_log_ratio, token_rewards,
                                           value_loss)
from mlx_llm.runs.configs import EstimatorConfig

SCALED = ("grpo", "dapo", "gspo")  # advantages divided by the group's reward standard deviation
BATCH_KEYS = ("mask", "old_logp", "ref_logp", "adv", "is_weight")  # per reply token, (B, T), from ``rollout``
PPO_KEYS = ("old_value", "ret")


def rollout(s: EstimatorConfig, reward_B, logp_BT, ref_BT, logq_BT, mask_BT, values_BT=None, keep_B=None):
    """(the update's batch: {mask, old_logp, ref_logp, adv, is_weight} and for ppo {old_value, ret}; the rollout's
    metrics: kl (the mean over replies of Σ_t log π_old/π_ref), shaped_reward (reward-k1), is_ratio_mean and
    is_ratio_max (π_old/q over the reply tokens), logprob_gap (the mean |log π_old − log q|)). ``keep_B``: rows
    kept by dynamic sampling (the others leave the mask); rows are grouped by ``s.k``."""
    logp_BT, ref_BT, logq_BT = (jnp.asarray(a) for a in (logp_BT, ref_BT, logq_BT))
    reward_B = jnp.asarray(reward_B).astype(logp_BT.dtype)
    mask = jnp.asarray(mask_BT).astype(logp_BT.dtype)
    reply_kl_B = jnp.sum(mask * (logp_BT - ref_BT), axis=1)
    metrics = {"kl": jnp.mean(reply_kl_B)}
    extra = {}
    if s.algorithm == "ppo":
        beta = s.beta if s.kl == "reward-k1" else 0.0
        adv, ret = gae(token_rewards(reward_B, logp_BT, ref_BT, mask, beta), values_BT, mask, lam=s.gae_lambda)
        extra = {"old_value": values_BT, "ret": ret}
    else:
        shaped = reward_B - s.beta * reply_kl_B if s.kl == "reward-k1" else reward_B
        if s.kl == "reward-k1":
            metrics["shaped_reward"] = jnp.mean(shaped)
        adv_B = group_advantages(shaped.reshape(-1, s.k), "loo" if s.algorithm == "group" else "mean",
                                 scale=s.algorithm in SCALED).reshape(-1)
        adv = adv_B[:, None] * mask
    weight = importance_weights(logp_BT, logq_BT, mask, s.importance, s.is_cap, s.is_level)
    tokens = jnp.maximum(jnp.sum(mask), 1)
    ratio = jnp.where(mask > 0, jnp.exp(logp_BT - logq_BT), 0.0)
    metrics.update(is_ratio_mean=jnp.sum(ratio) / tokens, is_ratio_max=jnp.max(ratio),
                   logprob_gap=jnp.sum(mask * jnp.abs(logp_BT - logq_BT)) / tokens)
    if s.importance != "none":
        metrics["is_weight_mean"] = jnp.sum(weight) / tokens
    kept = mask if keep_B is None else mask * jnp.asarray(keep_B).astype(mask.dtype)[:, None]
    batch = {"mask": kept, "old_logp": logp_BT, "ref_logp": ref_BT, "adv": adv, "is_weight": weight, **extra}
    return batch, metrics


def loss(s: EstimatorConfig, logp_BT, batch, values_BT=None):
    """(Σ of the aggregated per-token loss, its count, {name: Σ of a per-token term}) of one update: ``make_update``'s
    sums (the count sums over micro-batches, so the loss is the whole update's). Terms: policy_loss (the
    surrogate), kl_loss (the loss's KL estimate k, unweighted by β), clip_fraction and approx_kl (k3 of KL(π_old ‖
    π_θ)) for clipped algorithms, value_loss for ppo; each averaged over tokens (``token`` aggregation) or as each
    reply's mean over its tokens averaged over replies."""
    mask = batch["mask"]
    reply = mask > 0  # positions outside the replies (prompt, padding, dropped groups) hold nothing that may overflow
    log_ratio = jnp.where(reply, logp_BT - batch["old_logp"], 0.0)
    ratio_used = sequence_log_ratio(log_ratio, mask) if s.algorithm == "gspo" else log_ratio
    low, high = (s.clip_low, s.clip_high) if s.clipped else (None, None)
    policy, clipped = clipped_surrogate(ratio_used, batch["adv"], low, high)
    per_token, terms = policy, {"policy_loss": policy}
    if s.kl.startswith("loss-"):
        terms["kl_loss"] = kl_estimate(logp_BT, jnp.where(reply, batch["ref_logp"], logp_BT), s.kl[-2:])
        per_token = per_token + s.beta * terms["kl_loss"]
    per_token = batch["is_weight"] * per_token
    if s.clipped:
        terms.update(clip_fraction=clipped, approx_kl=kl_estimate(0.0, log_ratio, "k3"))
    if s.algorithm == "ppo":
        terms["value_loss"] = value_loss(values_BT, batch["old_value"], batch["ret"], s.value_clip)
        per_token = per_token + s.value_coef * terms["value_loss"]
    weights, count = aggregation_weights(mask, s.loss_aggregation)
    per_reply = s.loss_aggregation == "seq-mean-token-sum"  # metrics: each reply's token mean, not its sum
    metric_weights = weights / jnp.maximum(jnp.sum(mask, axis=1, keepdims=True), 1) if per_reply else weights
    sums = {name: jnp.sum(metric_weights * jax.lax.stop_gradient(term)) for name, term in terms.items()}
    return jnp.sum(weights * per_token), count, sums


def make_objective(s: EstimatorConfig, forward):
    """``train.step.make_update``'s objective (trainable, frozen, batch, key) → (Σ loss, (count, expert loads,
    sums)) for ``forward(trainable, frozen, batch) → (log π_θ (B, T), values (B, T) or None, expert loads)``: a
    language model's reply tokens (post/rl.py) or a bandit's table (post/bandit.py)."""

    def objective(trainable, frozen, batch, key):
        logp, values, load = forward(trainable, frozen, batch)
        total, count, sums = loss(s, logp, batch, values)
        return total, (count, load, sums)

    return objective


def spread_groups(reward_B, k: int):
    """Per row, whether its group's rewards differ (dynamic sampling keeps those groups: a group of equal rewards
    has zero advantage under every group baseline without the KL in the reward)."""
    r_PK = jnp.asarray(reward_B).reshape(-1, k)
    return jnp.repeat(jnp.max(r_PK, axis=1) > jnp.min(r_PK, axis=1), k)
