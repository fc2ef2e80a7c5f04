"""The preference and reinforcement objectives as pure functions of log-probabilities, rewards and values
(U19 §11–§13, M20 §16): the Bradley–Terry loss of a reward model, DPO, the KL leash's closed form and the
group-baseline loss of on-policy RL, PPO's clipped terms and GAE. The runs that train with them live in
``mlx_llm.post`` (reward.py, dpo.py, rl.py, ppo.py), which import them from here; their hand gradients are in
``objectives/grads/losses.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mlx_llm.settings import check_number

STD_EPS = 1e-4  # added to a group's reward standard deviation before dividing by it (GRPO's normalisation)


# ----- Bradley–Terry (U19 §11; post/reward.py) ----------------------------------------------------------------
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


# ----- DPO (M20 §16, U19 §13; post/dpo.py) --------------------------------------------------------------------
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


# ----- the KL leash and the group-baseline loss (U19 §12; post/rl.py) -----------------------------------------
def leash(pi_ref, rewards, beta) -> dict:
    """π* ∝ π_ref e^{r/β}, E_{π*}[r], KL(π* ‖ π_ref) and J(π*) = β ln Z (U19 §12), in the dtype of the inputs."""
    beta = check_number("beta", beta, low=0.0, positive=True)
    log_ref, r = jnp.log(jnp.asarray(pi_ref)), jnp.asarray(rewards)
    log_z = jax.nn.logsumexp(log_ref + r / beta)
    log_pi = log_ref + r / beta - log_z
    pi = jnp.exp(log_pi)
    # An answer the reference never gives (π_ref = 0) gets π* = 0 and adds 0·log 0 = 0 to the KL, not NaN.
    kl_terms = jnp.where(pi > 0, pi * (log_pi - jnp.where(pi > 0, log_ref, 0.0)), 0.0)
    return {"pi": pi, "expected_reward": jnp.sum(pi * r), "kl": jnp.sum(kl_terms), "objective": beta * log_z}


def shaped_rewards(r, logp, logp_ref, beta):
    """r̃ = r − β (log π_θ(y) − log π_ref(y)): the k1 KL penalty summed over the reply's tokens, no gradient."""
    return r - beta * jax.lax.stop_gradient(logp - logp_ref)


def group_advantages(r_PK, baseline: str = "loo", scale: bool = False, eps: float = STD_EPS):
    """Advantages of k rewards per prompt, per row of (P, K). ``baseline`` "loo": A = r − the mean of the other
    k − 1 rewards of the same prompt (leave-one-out; RLOO); "mean": A = r − the group's mean, itself included
    (GRPO), which is the leave-one-out advantage times (k − 1)/k. ``scale``: divided by the group's standard
    deviation (ddof 1) + ``eps`` (GRPO, DAPO, GSPO; Dr. GRPO drops it). A group of equal rewards gets A = 0."""
    k = r_PK.shape[-1]
    if baseline == "loo":
        adv = r_PK - (jnp.sum(r_PK, axis=-1, keepdims=True) - r_PK) / (k - 1)
    elif baseline == "mean":
        adv = r_PK - jnp.mean(r_PK, axis=-1, keepdims=True)
    else:
        raise ValueError(f"baseline = {baseline!r}: 'loo' or 'mean'")
    if scale:
        adv = adv / (jnp.std(r_PK, axis=-1, keepdims=True, ddof=1) + eps)
    return adv


def policy_loss(logp_PK, adv_PK):
    """−mean A · log π_θ(y): its gradient is the REINFORCE estimate of −∇J (A carries no gradient)."""
    return -jnp.mean(jax.lax.stop_gradient(adv_PK) * logp_PK)


def leashed_loss(logp_PK, logp_ref_PK, r_PK, beta):
    """(loss, {kl, shaped}) of k sampled replies per prompt: shaped rewards → group advantages → policy loss."""
    shaped = shaped_rewards(r_PK, logp_PK, logp_ref_PK, beta)
    loss = policy_loss(logp_PK, group_advantages(shaped))
    return loss, {"kl": jnp.mean(jax.lax.stop_gradient(logp_PK - logp_ref_PK)), "shaped_reward": jnp.mean(shaped)}


# ----- PPO and GAE (post/ppo.py) ------------------------------------------------------------------------------
def gae(rewards_BT, values_BT, mask_BT, *, gamma: float = 1.0, lam: float = 0.95):
    """(A, G): generalised advantages and returns over each row's reply tokens (``mask_BT``, one contiguous run
    per row); the value after a row's last reply token is 0. Zero outside the reply."""
    mask = mask_BT.astype(values_BT.dtype)

    def back(carry, xs):
        next_adv, next_value = carry
        r, v, m = xs
        delta = r + gamma * next_value - v
        adv = m * (delta + gamma * lam * next_adv)
        return (adv, m * v), adv

    zero = jnp.zeros(values_BT.shape[0], values_BT.dtype)
    xs = (rewards_BT.astype(values_BT.dtype).T[::-1], values_BT.T[::-1], mask.T[::-1])
    adv_BT = jax.lax.scan(back, (zero, zero), xs)[1][::-1].T
    return adv_BT, mask * (adv_BT + values_BT)


def token_rewards(reward_B, logp_BT, logp_ref_BT, mask_BT, beta: float):
    """r_t = −β (log π_old − log π_ref) on every reply token, plus the reply's reward on its last token."""
    mask = mask_BT.astype(logp_BT.dtype)
    last = jnp.arange(mask.shape[1])[None, :] == (mask.shape[1] - 1 - jnp.argmax(mask[:, ::-1], axis=1))[:, None]
    return mask * (-beta * (logp_BT - logp_ref_BT) + last * reward_B[:, None].astype(logp_BT.dtype))


def token_losses(logp, old_logp, adv, values, old_values, returns, *, clip: float, value_clip: float) -> dict:
    """Per-token PPO terms: the clipped surrogate's loss, the clipped value loss, whether the clipped term was the
    active one (its gradient 0) and the k3 estimate of KL(π_old ‖ π_θ) (a diagnostic)."""
    logp, old_logp, adv, values, old_values, returns = map(jnp.asarray, (logp, old_logp, adv, values, old_values,
                                                                          returns))
    log_ratio = logp - old_logp
    policy, clipped = clipped_surrogate(log_ratio, adv, clip, clip)
    return {"policy_loss": policy, "value_loss": value_loss(values, old_values, returns, value_clip),
            "clip_fraction": clipped, "approx_kl": kl_estimate(0.0, log_ratio, "k3")}


def value_loss(values, old_values, returns, value_clip: float):
    """½ max((V − G)², (V_old + clip(V − V_old, ±ε_V) − G)²) per token (PPO's clipped value loss)."""
    clipped_values = old_values + jnp.clip(values - old_values, -value_clip, value_clip)
    return 0.5 * jnp.maximum((values - returns) ** 2, (clipped_values - returns) ** 2)


# ----- the GRPO family's terms (post/estimator.py) ------------------------------------------------------------
def kl_estimate(logp, logp_ref, kind: str):
    """Schulman's (2020) estimators of KL(π ‖ π_ref) from one token y ∼ π, with x = log π_ref(y) − log π(y):
    k1 = −x (unbiased, high variance, negative for some samples), k2 = x²/2 (biased, low variance), k3 = eˣ − 1 − x
    (unbiased, ≥ 0). As loss terms, differentiated through log π at the sampled y, their expected gradients are 0
    (k1), ∇ KL(π ‖ π_ref) (k2, one position) and ∇ KL(π_ref ‖ π) (k3): docs/post-training.md."""
    x = jnp.asarray(logp_ref) - jnp.asarray(logp)
    if kind == "k1":
        return -x
    if kind == "k2":
        return 0.5 * x * x
    if kind == "k3":
        return jnp.expm1(x) - x
    raise ValueError(f"kind = {kind!r}: 'k1', 'k2' or 'k3'")


def clipped_surrogate(log_ratio, adv, clip_low: float | None, clip_high: float | None):
    """(−min(ρA, clip(ρ, 1 − ε_low, 1 + ε_high) A), whether the clipped term is the active one) per token, ρ = e^
    log_ratio; without a clip (``clip_low`` None) the plain importance-weighted −ρA, whose gradient at ρ = 1 is
    REINFORCE's −A ∇log π."""
    ratio = jnp.exp(log_ratio)
    if clip_low is None:
        return -ratio * adv, jnp.zeros_like(ratio)
    bounded = jnp.clip(ratio, 1 - clip_low, 1 + clip_high)
    return -jnp.minimum(ratio * adv, bounded * adv), (ratio * adv > bounded * adv).astype(ratio.dtype)


def sequence_log_ratio(log_ratio_BT, mask_BT):
    """GSPO's ratio on every token of a reply: log s = (1/|y|) Σ_t log(π_θ/π_old) (the reply's length-normalised
    log-ratio) as the value, each token's own log-ratio as the gradient (``sg[log s] + log ρ_t − sg[log ρ_t]``), so
    the mean over the reply's tokens of s·A has the gradient of s·A (Zheng et al. 2025, GSPO-token)."""
    mask = jnp.asarray(mask_BT).astype(log_ratio_BT.dtype)
    mean_B1 = jnp.sum(mask * log_ratio_BT, axis=1, keepdims=True) / jnp.maximum(jnp.sum(mask, 1, keepdims=True), 1)
    return jax.lax.stop_gradient(mean_B1) + log_ratio_BT - jax.lax.stop_gradient(log_ratio_BT)


def importance_weights(logp_BT, logq_BT, mask_BT, kind: str, cap: float | None, level: str):
    """Weights w of the sampled tokens that turn an expectation under the sampler q into one under the trainer's
    π, no gradient: w = π/q per token (``level`` "token") or Π_t π/q of the reply on each of its tokens
    ("sequence"); "tis" truncates them, min(w, C) (Ionides 2008; Yao et al. 2025), "mis" masks them,
    w·1[w ≤ C]; "none" is 1. Zero outside the reply."""
    mask = jnp.asarray(mask_BT).astype(logp_BT.dtype)
    if kind == "none":
        return mask
    log_w = mask * (logp_BT - logq_BT)
    if level == "sequence":
        log_w = jnp.broadcast_to(jnp.sum(log_w, axis=1, keepdims=True), log_w.shape)
    w = jnp.exp(jax.lax.stop_gradient(log_w))
    if kind == "tis":
        w = jnp.minimum(w, cap)
    elif kind == "mis":
        w = jnp.where(w <= cap, w, 0.0)
    else:
        raise ValueError(f"kind = {kind!r}: 'none', 'tis' or 'mis'")
    return mask * w


def aggregation_weights(mask_BT, how: str):
    """(per-token weights, count): Σ weights ⊙ ℓ / count is the loss of per-token terms ℓ aggregated as ``how``
    says. "token": every reply token of the batch counts once, ℓ summed over them / their number (DAPO);
    "sequence": each reply's mean over its tokens, averaged over replies (GRPO's 1/|y|); "seq-mean-token-sum":
    each reply's sum over its tokens, averaged over replies (REINFORCE on log π(y); Dr. GRPO up to a constant).
    Counts sum over micro-batches, so the mean is over the whole update (``train.step.make_update``)."""
    mask = jnp.asarray(mask_BT)
    mask = mask.astype(jnp.promote_types(mask.dtype, jnp.float32))
    tokens_B1 = jnp.sum(mask, axis=1, keepdims=True)
    rows = jnp.sum((tokens_B1 > 0).astype(mask.dtype))
    if how == "token":
        return mask, jnp.sum(mask)
    if how == "sequence":
        return mask / jnp.maximum(tokens_B1, 1), rows
    if how == "seq-mean-token-sum":
        return mask, rows
    raise ValueError(f"how = {how!r}: 'token', 'sequence' or 'seq-mean-token-sum'")
