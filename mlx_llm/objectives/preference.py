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


def group_advantages(r_PK):
    """A = r̃ − mean of the other k − 1 rewards of the same prompt (leave-one-out), per row of (P, K)."""
    k = r_PK.shape[-1]
    return r_PK - (jnp.sum(r_PK, axis=-1, keepdims=True) - r_PK) / (k - 1)


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
    """Per-token PPO terms: the clipped surrogate's loss, the clipped value loss, whether the ratio was clipped
    and the k3 estimate of KL(π_old ‖ π_θ) (a diagnostic)."""
    logp, old_logp, adv, values, old_values, returns = map(jnp.asarray, (logp, old_logp, adv, values, old_values,
                                                                          returns))
    log_ratio = logp - old_logp
    ratio = jnp.exp(log_ratio)
    policy = -jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - clip, 1 + clip) * adv)
    clipped_values = old_values + jnp.clip(values - old_values, -value_clip, value_clip)
    value = 0.5 * jnp.maximum((values - returns) ** 2, (clipped_values - returns) ** 2)
    return {"policy_loss": policy, "value_loss": value, "clip_fraction": (jnp.abs(ratio - 1) > clip).astype(logp.dtype),
            "approx_kl": (ratio - 1) - log_ratio}
