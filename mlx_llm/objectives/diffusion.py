"""Masked (absorbing-state) diffusion: forward corruption, the continuous-time bound, and M20 §19's marginal.

M20 §19: a diffusion model generates a whole sequence by refining it over noise levels; its probability of a
clean sequence sums over every hidden trajectory, p_θ(z⁽⁰⁾|c) = Σ p_S(z⁽ˢ⁾|c) Π_s K_θ,s(z⁽ˢ⁻¹⁾|z⁽ˢ⁾, c).
This module builds the discrete diffusion LM of MDLM (Sahoo et al. 2024) and LLaDA (Nie et al. 2025) on the
same blocks, with a bidirectional denoiser (``ModelConfig.causal = False``):

* Forward corruption at time t ∈ (0, 1] (linear schedule α_t = 1 − t): each maskable token is independently
  replaced by MASK with probability t (``corrupt``). Times are drawn per sequence, optionally low-discrepancy
  (``sample_times``: t_b = 1 − ((u + b/B) mod 1), one uniform u per batch, as in MDLM §3.5).
* The denoiser p_θ(x_i | z_t) is the model's softmax over the vocabulary with the MASK logit removed
  (``denoiser_log_probs``); unmasked positions are carried over unchanged and cost nothing (MDLM's SUBS
  parameterisation). The denoiser takes no time input: for absorbing diffusion the clean-data conditional given
  z_t does not depend on t (Ou et al. 2024), and z_t's masks already show the noise level.
* The objective is the continuous-time negative ELBO (MDLM eq. 10 for α_t = 1 − t):
      NELBO(x) = E_{t∼U(0,1)} E_{z_t∼q(·|x)} [ (1/t) Σ_{i masked in z_t} −log p_θ(x_i | z_t) ] ≥ −log p_θ(x),
  estimated without bias by ``nelbo_terms`` (one t and one mask draw per sequence). Averaged per token it is
  reported in nats and as bits per byte: an upper bound on the model's true code length, not an exact one.
  ``exact_nelbo`` computes it by enumeration (tiny cases), and ``discrete_nelbo`` is the S-step bound of the
  ancestral sampler (mlx_llm.decode.diffusion), which tends to the continuous one as S grows.
* ``marginal`` is M20 §19's sum over hidden trajectories for a small explicit chain (transition matrices).

Why a causal mask cannot simply be dropped (M20 §19): a bidirectional model that sees the clean token it must
predict learns to copy it. Here the denoiser only ever sees z_t, in which every position it is scored on is
MASK, so no target leaks (tests/test_diffusion.py checks the gradient of the prediction w.r.t. its own token).
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np

from mlx_llm.errors import ConfigError, InputError
from mlx_llm.model import forward


# ----- M20 §19: the marginal over hidden trajectories --------------------------------------------------------
def marginal(p_S, transitions) -> np.ndarray:
    """p(z⁽⁰⁾) = Σ_{z⁽¹⁾…z⁽ˢ⁾} p_S(z⁽ˢ⁾) Π_s K_s(z⁽ˢ⁻¹⁾ | z⁽ˢ⁾) as the row-vector product p_S K_S … K_1.

    ``p_S`` (n,) is the distribution after the first reverse transition (or the start), ``transitions`` the
    row-stochastic (n, n) matrices applied in order (entry [a, b] = K(b | a)). Each must be a distribution /
    have rows summing to 1; float64."""
    p = np.asarray(p_S, dtype=np.float64)
    if p.ndim != 1 or np.any(p < 0) or not np.isclose(p.sum(), 1.0, atol=1e-12):
        raise InputError(f"p_S = {p!r} is not a probability vector (non-negative, summing to 1)")
    for s, k in enumerate(transitions):
        k = np.asarray(k, dtype=np.float64)
        if k.shape != (p.size, p.size) or np.any(k < 0) or not np.allclose(k.sum(1), 1.0, atol=1e-12):
            raise InputError(f"transition {s} (shape {k.shape}) is not a row-stochastic ({p.size}, {p.size}) matrix")
        p = p @ k
    return p


def bit_flip_kernel(n_bits: int, flip: float) -> np.ndarray:
    """K over the 2^n strings of n bits (index = the bits read as a binary number, first bit most significant):
    each bit kept with probability 1 − flip and flipped with probability flip, independently, so
    K(b | a) = (1 − flip)^{n − h} flip^h for strings at Hamming distance h (M20 §19's example: n = 2, 0.2)."""
    if not (isinstance(n_bits, int) and n_bits >= 1):
        raise InputError(f"n_bits = {n_bits!r} is invalid: it must be a positive integer")
    if not 0.0 <= flip <= 1.0:
        raise InputError(f"flip = {flip!r} is invalid: it must be a probability in [0, 1]")
    idx = np.arange(2 ** n_bits)
    h = np.array([[bin(a ^ b).count("1") for b in idx] for a in idx])
    return (1.0 - flip) ** (n_bits - h) * flip ** h


# ----- corruption and the bound --------------------------------------------------------------------------------
def check_mask_id(mask_id, vocab_size: int) -> int:
    """The MASK id must be a token of the model's vocabulary (the tokenizer's ``<|mask|>``)."""
    if mask_id is None:
        raise ConfigError("masked diffusion needs a MASK token id, and none was given: build the tokenizer with "
                          "the <|mask|> special token (DIFFUSION_SPECIAL_TOKENS), as `mlx-llm train --objective "
                          "diffusion` does")
    if not (isinstance(mask_id, (int, np.integer)) and 0 <= int(mask_id) < vocab_size):
        raise ConfigError(f"mask_id = {mask_id!r} is not a token id of the model: it must be in [0, {vocab_size})")
    return int(mask_id)


def sample_times(key, batch: int, *, antithetic: bool = True) -> jax.Array:
    """t (B,) in (0, 1]: independent uniforms, or (``antithetic``) the low-discrepancy stratified draw
    t_b = 1 − ((u + b/B) mod 1) with one u ∼ U[0, 1): each t_b is still U(0, 1] (so the estimate stays unbiased)
    but the batch covers (0, 1] evenly, which lowers the variance of the batch mean (MDLM §3.5)."""
    if antithetic:
        u = jax.random.uniform(key, (), jnp.float32)
        return 1.0 - jnp.mod(u + jnp.arange(batch, dtype=jnp.float32) / batch, 1.0)
    return 1.0 - jax.random.uniform(key, (batch,), jnp.float32)


def corrupt(key, tokens_BT, t_B, mask_id: int, maskable_BT=None):
    """z_t: each maskable token replaced by MASK independently with probability t_b (α_t = 1 − t).
    Returns (z (B, T), masked (B, T) bool)."""
    u_BT = jax.random.uniform(key, tokens_BT.shape, jnp.float32)  # float32 whatever jax_enable_x64 says
    masked_BT = u_BT < t_B[:, None].astype(jnp.float32)
    if maskable_BT is not None:
        masked_BT = masked_BT & maskable_BT.astype(bool)
    return jnp.where(masked_BT, mask_id, tokens_BT), masked_BT


def denoiser_log_probs(logits_BTV, mask_id: int) -> jax.Array:
    """log p_θ(· | z_t) over the real tokens: the MASK logit is removed (the clean sequence never holds MASK),
    then a max-shifted log-softmax in at least float32."""
    x = logits_BTV.astype(jnp.promote_types(logits_BTV.dtype, jnp.float32))
    x = x.at[..., mask_id].set(-jnp.inf)
    return jax.nn.log_softmax(x, axis=-1)


def masked_nll(logits_BTV, tokens_BT, masked_BT, mask_id: int) -> jax.Array:
    """−log p_θ(x_i | z_t) at masked positions, 0 elsewhere (carried-over positions cost nothing), (B, T)."""
    logp_BTV = denoiser_log_probs(logits_BTV, mask_id)
    nll_BT = -jnp.take_along_axis(logp_BTV, tokens_BT[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return jnp.where(masked_BT, nll_BT, 0.0)


def corrupt_batch(key, tokens_BT, mask_id: int, maskable_BT=None, *, antithetic: bool = True):
    """t (``sample_times``) and z_t (``corrupt``) for a batch: returns (z_BT, masked_BT, t_B)."""
    k_t, k_mask = jax.random.split(key)
    t_B = sample_times(k_t, tokens_BT.shape[0], antithetic=antithetic)
    return (*corrupt(k_mask, tokens_BT, t_B, mask_id, maskable_BT), t_B)


def nelbo_from_logits(logits_BTV, tokens_BT, masked_BT, t_B, mask_id: int) -> jax.Array:
    """(1/t_b) Σ_{i masked} −log p_θ(x_i | z_t) per sequence (B,), from the denoiser's logits on z_t."""
    nll_BT = masked_nll(logits_BTV, tokens_BT, masked_BT, mask_id)
    return jnp.sum(nll_BT, axis=-1) / t_B.astype(nll_BT.dtype)


def nelbo_terms(params, tokens_BT, key, cfg, *, mask_id: int, maskable_BT=None, segment_ids_BT=None,
                positions_BT=None, antithetic: bool = True):
    """One Monte-Carlo draw of the bound for each sequence: t_b, z_t, and (1/t_b) Σ_{i masked} −log p_θ(x_i|z_t).

    Returns (nelbo_B (nats per sequence, an unbiased estimate of its NELBO), masked_BT, t_B)."""
    z_BT, masked_BT, t_B = corrupt_batch(key, tokens_BT, mask_id, maskable_BT, antithetic=antithetic)
    logits_BTV = forward(params, z_BT, cfg, positions_BT=positions_BT, segment_ids_BT=segment_ids_BT)
    return nelbo_from_logits(logits_BTV, tokens_BT, masked_BT, t_B, mask_id), masked_BT, t_B


def diffusion_loss(params, tokens_BT, maskable_BT, key, cfg, *, mask_id: int, segment_ids_BT=None,
                   positions_BT=None, antithetic: bool = True):
    """The training loss: Σ_b NELBO_b / Σ maskable tokens (nats per token, an upper bound on the per-token
    negative log-likelihood in expectation). Returns (loss, nelbo_sum)."""
    nelbo_B, _, _ = nelbo_terms(params, tokens_BT, key, cfg, mask_id=mask_id, maskable_BT=maskable_BT,
                                segment_ids_BT=segment_ids_BT, positions_BT=positions_BT, antithetic=antithetic)
    total = jnp.sum(nelbo_B)
    return total / jnp.sum(maskable_BT.astype(total.dtype)), total


# ----- exact forms on tiny cases (tests, and to read the definitions off) ------------------------------------
def _subsets(n: int):
    return itertools.product((False, True), repeat=n)


def exact_nelbo(log_prob_fn, x, *, steps: int | None = None) -> float:
    """The bound of one sequence x (length n) by enumerating every mask pattern M ⊆ {0…n−1}.

    ``log_prob_fn(masked)`` → (n,) log p_θ(x_i | z_M) for the boolean pattern ``masked`` (z_M = x with M masked).
    Continuous time (``steps`` None): NELBO = Σ_{M≠∅} B(|M|, n−|M|+1) Σ_{i∈M} −log p_θ(x_i | z_M), because
    ∫₀¹ (1/t) t^{|M|} (1−t)^{n−|M|} dt is that Beta function. S steps (the ancestral sampler's discrete-time
    bound, t_k = k/S): NELBO_S = Σ_{k=1}^{S} (1/k) E_{z∼q(·|x, t_k)} Σ_{i masked} −log p_θ(x_i | z), since the
    reverse step from t_k to t_{k−1} reveals a masked position with probability (t_k − t_{k−1})/t_k = 1/k and
    its KL to q then is (1/k)·(−log p_θ(x_i | z)) (MDLM eq. 8 with α_t = 1 − t). Both ≥ −log p_θ(x)."""
    n = len(x)
    total = 0.0
    for pattern in _subsets(n):
        m = sum(pattern)
        if m == 0:
            continue
        mask = np.array(pattern)
        nll = -float(np.sum(np.asarray(log_prob_fn(mask))[mask]))
        if steps is None:
            weight = math.exp(math.lgamma(m) + math.lgamma(n - m + 1) - math.lgamma(n + 1))
        else:
            weight = sum((1.0 / k) * (k / steps) ** m * (1 - k / steps) ** (n - m) for k in range(1, steps + 1))
        total += weight * nll
    return total
