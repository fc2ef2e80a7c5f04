"""Hand gradients of every objective the library trains with, from their formulas (no autodiff): the next-token
loss with PaLM's z-loss, dense or chunked (M20 §10–§11), the masked-diffusion NELBO (M20 §19, objectives/
diffusion.py), the sequence log-likelihood, and the preference and RL objectives of ``objectives/preference.py``
(U19 §11–§13): Bradley–Terry, DPO, the KL leash's closed form, the group-baseline loss, PPO's clipped surrogate
and clipped value loss, GAE's dependence on the values and rewards.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mlx_llm.objectives.diffusion import denoiser_log_probs, nelbo_from_logits
from mlx_llm.objectives.grads.primitives import _acc, cross_entropy_backward
from mlx_llm.objectives.loss import masked_cross_entropy
from mlx_llm.objectives.preference import group_advantages, leash, margin, shaped_rewards
from mlx_llm.ops import softmax


# ----- the next-token loss and z-loss (M20 §10–§11; train/step.py) ------------------------------------------
def z_loss_backward(logits_BTV, mask_BT, weight: float) -> jax.Array:
    """∂/∂Λ of (W/n) Σ_t b_t ℓ_t², ℓ_t = logsumexp(Λ_t), n = Σ b: (2W b_t ℓ_t / n) softmax(Λ_t), since
    ∂ℓ/∂Λ = softmax(Λ) (PaLM's z-loss, Chowdhery et al. 2022 §5)."""
    x = _acc(logits_BTV)
    b_BT = jnp.asarray(mask_BT).astype(x.dtype)
    lse_BT = jax.nn.logsumexp(x, axis=-1)
    return (2 * weight * b_BT * lse_BT / jnp.sum(b_BT))[..., None] * softmax(x, axis=-1)


def lm_loss_and_backward(logits_BTV, targets_BT, mask_BT, z_loss: float = 0.0):
    """(L, G_Λ) of the training loss per target, L = (1/n) Σ_t b_t (−log p(x_t) + W ℓ_t²) (``train.step``'s
    summed loss over its count): M20 §11's (b/n)(p − 1[v = y]) plus ``z_loss_backward``."""
    loss = masked_cross_entropy(logits_BTV, targets_BT, mask_BT)
    g_BTV = cross_entropy_backward(logits_BTV, targets_BT, mask_BT)
    if z_loss:
        x, b_BT = _acc(logits_BTV), jnp.asarray(mask_BT).astype(g_BTV.dtype)
        loss = loss + z_loss * jnp.sum(b_BT * jax.nn.logsumexp(x, axis=-1) ** 2) / jnp.sum(b_BT)
        g_BTV = g_BTV + z_loss_backward(logits_BTV, mask_BT, z_loss)
    return loss, g_BTV


def _chunk_terms(r_cD, u_DV, y_c, w_c, z_loss):
    """One chunk of rows: (Σ w (ℓ − Λ_y + W ℓ²), G_Λ = w (p − onehot) + 2W w ℓ p) with p = exp(Λ − ℓ)."""
    logits_cV = _acc(r_cD) @ _acc(u_DV)
    lse_c = jax.nn.logsumexp(logits_cV, axis=-1)
    p_cV = jnp.exp(logits_cV - lse_c[:, None])
    onehot_cV = jax.nn.one_hot(y_c, u_DV.shape[1], dtype=p_cV.dtype)
    picked_c = jnp.sum(onehot_cV * logits_cV, axis=-1)
    loss = jnp.sum(w_c * (lse_c - picked_c + z_loss * lse_c**2))
    g_cV = w_c[:, None] * (p_cV - onehot_cV) + (2 * z_loss * w_c * lse_c)[:, None] * p_cV
    return loss, g_cV


def chunked_lm_loss_and_backward(r_BTD, u_DV, targets_BT, mask_BT, *, chunk: int, z_loss: float = 0.0):
    """(L, G_R, G_U) of ``lm_loss_and_backward`` on Λ = R U (M20 §8), ``chunk`` rows of Λ at a time, as
    ``kernels.loss`` computes it: per chunk G_Λ from the recomputed logits, G_R = G_Λ Uᵀ and G_U = Σ_chunks Rᵀ G_Λ
    (M20 §11's linear map), so no (B·T, V) array exists. Equal to the dense loss and gradient."""
    d = r_BTD.shape[-1]
    r_ND, y_N = _acc(r_BTD).reshape(-1, d), jnp.asarray(targets_BT).reshape(-1).astype(jnp.int32)
    b_N = jnp.asarray(mask_BT).reshape(-1).astype(r_ND.dtype)
    n, chunk = r_ND.shape[0], min(chunk, r_ND.shape[0])
    pad = -n % chunk
    w_CC = (jnp.pad(b_N, (0, pad)) / jnp.sum(b_N)).reshape(-1, chunk)  # padded rows weigh 0
    r_CCD = jnp.pad(r_ND, ((0, pad), (0, 0))).reshape(-1, chunk, d)
    y_CC = jnp.pad(y_N, (0, pad)).reshape(-1, chunk)

    def step(carry, xs):
        loss, g_u_DV = carry
        r_cD, y_c, w_c = xs
        loss_c, g_cV = _chunk_terms(r_cD, u_DV, y_c, w_c, z_loss)
        return (loss + loss_c, g_u_DV + r_cD.T @ g_cV), g_cV @ _acc(u_DV).T

    init = (jnp.zeros((), r_ND.dtype), jnp.zeros(u_DV.shape, r_ND.dtype))
    (loss, g_u_DV), g_r_CCD = jax.lax.scan(step, init, (r_CCD, y_CC, w_CC))
    return loss, g_r_CCD.reshape(-1, d)[:n].reshape(r_BTD.shape), g_u_DV


def sequence_log_likelihood_backward(logits_BTV, targets_BT, mask_BT, g_B) -> jax.Array:
    """∂/∂Λ of Σ_b g_b ℓ_b, ℓ_b = Σ_t b_t log p(x_t | x_<t) (``sequence_log_likelihood``, DPO's ℓ_θ, M20 §16):
    g_b b_t (1[v = x_t] − p_v), zero at masked positions."""
    p_BTV = softmax(_acc(logits_BTV), axis=-1)
    onehot_BTV = jax.nn.one_hot(targets_BT, logits_BTV.shape[-1], dtype=p_BTV.dtype)
    w_BT = jnp.asarray(mask_BT).astype(p_BTV.dtype) * jnp.asarray(g_B, p_BTV.dtype)[:, None]
    return w_BT[..., None] * (onehot_BTV - p_BTV)


# ----- the masked-diffusion NELBO (M20 §19; objectives/diffusion.py) ----------------------------------------
def nelbo_logits_backward(logits_BTV, tokens_BT, masked_BT, t_B, mask_id: int, g_B) -> jax.Array:
    """∂/∂Λ of Σ_b g_b (1/t_b) Σ_{i masked} −log p_θ(x_i | z_t): (g_b/t_b) 1[i masked] (p − 1[v = x_i]), p the
    denoiser's softmax with the MASK logit removed, so the MASK column gets exactly 0 (MDLM's SUBS)."""
    p_BTV = jnp.exp(denoiser_log_probs(jnp.asarray(logits_BTV), mask_id))
    onehot_BTV = jax.nn.one_hot(tokens_BT, logits_BTV.shape[-1], dtype=p_BTV.dtype)
    g_over_t_B = jnp.asarray(g_B, p_BTV.dtype) / t_B.astype(p_BTV.dtype)
    w_BT = jnp.asarray(masked_BT).astype(p_BTV.dtype) * g_over_t_B[:, None]
    return w_BT[..., None] * (p_BTV - onehot_BTV)


def nelbo_loss_and_backward(logits_BTV, tokens_BT, masked_BT, t_B, maskable_BT, mask_id: int):
    """(L, G_Λ) of ``diffusion_loss``: L = Σ_b NELBO_b / Σ maskable tokens, so g_b = 1/Σ maskable."""
    logits_BTV = jnp.asarray(logits_BTV)
    n = jnp.sum(jnp.asarray(maskable_BT).astype(_acc(logits_BTV).dtype))
    loss = jnp.sum(nelbo_from_logits(logits_BTV, tokens_BT, masked_BT, t_B, mask_id)) / n
    g_B = jnp.full(tokens_BT.shape[:1], 1.0 / n)
    return loss, nelbo_logits_backward(logits_BTV, tokens_BT, masked_BT, t_B, mask_id, g_B)


# ----- Bradley–Terry and the reward head (U19 §11) -------------------------------------------------------------
def bt_loss_backward(r_chosen, r_rejected, g=1.0):
    """∂/∂(r⁺, r⁻) of g·(−log σ(r⁺ − r⁻)): (−g σ(r⁻ − r⁺), g σ(r⁻ − r⁺)) — only the difference matters."""
    s = jax.nn.sigmoid(jnp.asarray(r_rejected) - jnp.asarray(r_chosen))
    return -g * s, g * s


def reward_head_backward(last_BD, head_D, g_B):
    """r_b = w · R_b (the reward or value head on the final-normed row): G_w = Σ_b g_b R_b, G_R_b = g_b w."""
    g_B = _acc(g_B)
    return g_B[:, None] * _acc(head_D)[None, :], g_B @ _acc(last_BD)


# ----- DPO (M20 §16, U19 §13) ----------------------------------------------------------------------------------
def dpo_loss_backward(lp_chosen, lp_rejected, ref_chosen, ref_rejected, beta: float, g=1.0) -> dict:
    """∂/∂ of g·softplus(−m), m = β[(ℓ_θ⁺ − ℓ_ref⁺) − (ℓ_θ⁻ − ℓ_ref⁻)]: ∂L/∂m = −σ(−m), so
    ∂L/∂ℓ_θ⁺ = −β σ(−m) g = −∂L/∂ℓ_θ⁻ (U19 §13's pair weight), and the reference's with the opposite signs."""
    w = g * beta * jax.nn.sigmoid(-margin(lp_chosen, lp_rejected, ref_chosen, ref_rejected, beta))
    return {"lp_chosen": -w, "lp_rejected": w, "ref_chosen": w, "ref_rejected": -w}


# ----- the KL leash (U19 §12) -----------------------------------------------------------------------------------
def leash_backward(pi_ref, rewards, beta: float) -> dict:
    """Gradients of the closed form's outputs (``leash``) with respect to π_ref (each entry free, > 0), r and β.
    With π* = π_ref e^{r/β}/Z, E = E_{π*}[r], V = Var_{π*}[r] and KL = E/β − ln Z:
    J = β ln Z:  ∂J/∂r = π*, ∂J/∂π_ref = β π*/π_ref, ∂J/∂β = −KL;
    E:           ∂E/∂r = π* + π*(r − E)/β, ∂E/∂π_ref = (π*/π_ref)(r − E), ∂E/∂β = −V/β²;
    KL:          ∂KL/∂r = π*(r − E)/β², ∂KL/∂π_ref = (π*/π_ref)((r − E)/β − 1), ∂KL/∂β = −V/β³."""
    out = leash(pi_ref, rewards, beta)
    pi, e, kl = out["pi"], out["expected_reward"], out["kl"]
    r, ratio = jnp.asarray(rewards), out["pi"] / jnp.asarray(pi_ref)
    var = jnp.sum(pi * (r - e) ** 2)
    return {"objective": {"pi_ref": beta * ratio, "rewards": pi, "beta": -kl},
            "expected_reward": {"pi_ref": ratio * (r - e), "rewards": pi + pi * (r - e) / beta, "beta": -var / beta**2},
            "kl": {"pi_ref": ratio * ((r - e) / beta - 1), "rewards": pi * (r - e) / beta**2, "beta": -var / beta**3}}


def leashed_loss_backward(logp_PK, logp_ref_PK, r_PK, beta: float):
    """∂/∂ log π_θ of the group-baseline loss −mean(A ⊙ log π_θ) (``leashed_loss``): −A/(P·K). The advantages A
    (shaped rewards minus the leave-one-out mean) carry no gradient, so log π_ref and r get exactly 0."""
    adv_PK = group_advantages(shaped_rewards(r_PK, logp_PK, logp_ref_PK, beta))
    return -adv_PK / adv_PK.size, jnp.zeros_like(logp_ref_PK), jnp.zeros_like(r_PK)


# ----- PPO and GAE (post/ppo.py) ---------------------------------------------------------------------------------
def ppo_backward(logp, old_logp, adv, values, old_values, returns, *, clip: float, value_clip: float,
                 g_policy=1.0, g_value=1.0):
    """(G_log π_θ, G_V) of Σ g_policy·(−min(ρA, clip(ρ, 1 ± ε)A)) + g_value·½ max((V − G)², (V_c − G)²),
    ρ = exp(log π_θ − log π_old), V_c = V_old + clip(V − V_old, ±ε_V), per token:
    the surrogate's derivative is −Aρ where the unclipped term is the minimum (always inside [1 − ε, 1 + ε], where
    the two terms agree) and 0 where the clipped, constant term is; the value loss's is V − G where the unclipped
    square is the larger, and 0 where the clipped one is (V_c is then constant in V)."""
    ratio = jnp.exp(logp - old_logp)
    unclipped = ratio * adv <= jnp.clip(ratio, 1 - clip, 1 + clip) * adv
    clipped_values = old_values + jnp.clip(values - old_values, -value_clip, value_clip)
    larger = (values - returns) ** 2 >= (clipped_values - returns) ** 2
    return -g_policy * adv * ratio * unclipped, g_value * (values - returns) * larger


def gae_backward(rewards_BT, values_BT, mask_BT, g_adv_BT, g_ret_BT, *, gamma: float = 1.0, lam: float = 0.95):
    """(G_r, G_V) of Σ G_A ⊙ A + G_G ⊙ G for ``gae``: A_t = m_t(δ_t + γλ A_{t+1}), δ_t = r_t + γ m_{t+1} V_{t+1} − V_t,
    G_t = m_t(A_t + V_t). Reverse mode runs forward in time: Ā_t = G_A_t + m_t G_G_t + γλ m_{t−1} Ā_{t−1} (the
    total gradient reaching A_t), e_t = m_t Ā_t reaches δ_t, so G_r_t = e_t and
    G_V_t = −e_t + γ m_t e_{t−1} + m_t G_G_t (V_t enters δ_t, δ_{t−1} and G_t)."""
    m_BT = jnp.asarray(mask_BT).astype(values_BT.dtype)

    def forward(abar_prev_B, xs):
        g_a_B, g_g_B, m_B, m_prev_B = xs
        abar_B = g_a_B + m_B * g_g_B + gamma * lam * m_prev_B * abar_prev_B
        return abar_B, m_B * abar_B

    m_prev_BT = jnp.pad(m_BT[:, :-1], ((0, 0), (1, 0)))
    xs = tuple(jnp.asarray(a, values_BT.dtype).T for a in (g_adv_BT, g_ret_BT, m_BT, m_prev_BT))
    e_BT = jax.lax.scan(forward, jnp.zeros(values_BT.shape[0], values_BT.dtype), xs)[1].T
    e_prev_BT = jnp.pad(e_BT[:, :-1], ((0, 0), (1, 0)))
    g_values_BT = -e_BT + gamma * m_BT * e_prev_BT + m_BT * jnp.asarray(g_ret_BT, values_BT.dtype)
    return e_BT, g_values_BT

