"""Sampling from a masked-diffusion denoiser (objectives/diffusion.py): a whole sequence refined over S steps.

The generated region (``length`` positions after the prompt) starts as all MASK; every step runs the
bidirectional denoiser over the whole sequence and reveals some masked positions; revealed tokens and the
prompt never change. Two samplers, each one ``jax.lax.scan`` over steps under ``jax.jit``, seeded:

* ``"ancestral"`` (MDLM): the reverse process of the training corruption. Going from t_k = k/S to t_{k−1},
  each still-masked position is revealed with probability (t_k − t_{k−1})/t_k = 1/k, its token drawn from
  p_θ(· | z_{t_k}) (MASK excluded, ``temperature`` applied; ``None`` takes the most probable token). The last
  step (k = 1) reveals everything. Its S-step probability of an output is what
  ``objectives.diffusion.exact_nelbo(..., steps=S)`` bounds.
* ``"remask"`` (LLaDA's low-confidence remasking with semi-autoregressive blocks): the region is cut into
  blocks of ``block_length`` (default: one block), filled left to right with S / n_blocks steps each; every
  step predicts all masked positions of the current block and keeps the ``n_j`` most confident (probability
  of the predicted token), with the block's positions spread evenly over its steps. Not a sample of the
  trained model's distribution; a decoding heuristic that often reads better at small S.

No KV cache (M20 §19, Figure 6): every step changes tokens anywhere in the sequence and the attention is
bidirectional, so every position's keys and values change at every step; there is no append-only record to
keep. Each step costs one full forward over prompt + length positions, so S steps cost S forwards, against one
cached forward per token for autoregressive decoding (experiments/diffusion_vs_ar.py measures both).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from mlx_llm.config import ModelConfig
from mlx_llm.errors import ConfigError, InputError
from mlx_llm.model import Params, check_tokens, forward, resolved
from mlx_llm.objectives.diffusion import check_mask_id, denoiser_log_probs
from mlx_llm.ops import seed_key

SAMPLERS = ("ancestral", "remask")


def _draw(key, logp_BTV, temperature):
    """A token per position from log p (already without MASK): argmax when ``temperature`` is None."""
    if temperature is None:
        return jnp.argmax(logp_BTV, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, logp_BTV / temperature, axis=-1).astype(jnp.int32)


def reveal_schedule(length: int, steps: int, block_length: int | None) -> tuple[int, np.ndarray]:
    """(block_length, n (S,)): how many positions of the current block the remasking sampler reveals at each
    step; each block's positions are spread as evenly as possible over its S / n_blocks steps."""
    block = length if block_length is None else block_length
    if not (isinstance(block, int) and 1 <= block and length % block == 0):
        raise ConfigError(f"block_length = {block_length!r} is invalid: it must be a positive divisor of the "
                          f"generated length {length}")
    n_blocks = length // block
    if steps % n_blocks:
        raise ConfigError(f"steps = {steps} cannot be split evenly over {n_blocks} blocks of {block} positions: "
                          f"the remasking sampler needs steps to be a multiple of the number of blocks")
    per = steps // n_blocks
    counts = np.array([block // per + (1 if j < block % per else 0) for j in range(per)], np.int32)
    return block, np.tile(counts, n_blocks)


@functools.partial(jax.jit, static_argnames=("cfg", "length", "steps", "sampler", "block_length", "temperature",
                                             "mask_id", "kernels"))
def _sample(params, prompt_BP, key, *, cfg, length, steps, sampler, block_length, temperature, mask_id, kernels):
    b, p = prompt_BP.shape
    seq_BT = jnp.concatenate([prompt_BP.astype(jnp.int32), jnp.full((b, length), mask_id, jnp.int32)], axis=1)
    pos_T = jnp.arange(p + length)

    def logp(seq_BT):
        return denoiser_log_probs(forward(params, seq_BT, cfg, kernels=kernels), mask_id)

    if sampler == "ancestral":
        def body(seq_BT, xs):
            k, step_key = xs
            k_draw, k_reveal = jax.random.split(step_key)
            masked_BT = seq_BT == mask_id
            draw_BT = _draw(k_draw, logp(seq_BT), temperature)
            reveal_BT = masked_BT & (jax.random.uniform(k_reveal, seq_BT.shape) * k < 1.0)  # prob 1/k
            return jnp.where(reveal_BT, draw_BT, seq_BT), None

        ks = jnp.arange(steps, 0, -1)
        return jax.lax.scan(body, seq_BT, (ks, jax.random.split(key, steps)))[0]

    block, counts = reveal_schedule(length, steps, block_length)
    per_block = steps // (length // block)

    def body(seq_BT, xs):
        j, n_reveal, step_key = xs
        lo = p + (j // per_block) * block
        logp_BTV = logp(seq_BT)
        draw_BT = _draw(step_key, logp_BTV, temperature)
        conf_BT = jnp.take_along_axis(logp_BTV, draw_BT[..., None], axis=-1)[..., 0]
        candidate_BT = (seq_BT == mask_id) & (pos_T >= lo) & (pos_T < lo + block)
        conf_BT = jnp.where(candidate_BT, conf_BT, -jnp.inf)
        rank_BT = jnp.argsort(jnp.argsort(-conf_BT, axis=-1, stable=True), axis=-1)
        reveal_BT = candidate_BT & (rank_BT < n_reveal)
        return jnp.where(reveal_BT, draw_BT, seq_BT), None

    xs = (jnp.arange(steps), jnp.asarray(counts), jax.random.split(key, steps))
    return jax.lax.scan(body, seq_BT, xs)[0]


def sample(params: Params, cfg: ModelConfig, prompt_BP, length: int, *, steps: int, mask_id: int,
           sampler: str = "ancestral", temperature: float | None = 1.0, block_length: int | None = None,
           seed: int = 0, kernels=None) -> jax.Array:
    """Generate ``length`` tokens after each prompt (B, P) with S = ``steps`` denoising steps; returns the
    (B, P + length) ids (the prompt unchanged, no MASK left). See the module docstring for the samplers.
    Invalid settings raise ``ConfigError`` / ``InputError`` naming the value, before any work. ``kernels``: the
    execution paths of the denoiser's forward (default the reference ones)."""
    if cfg.causal:
        raise ConfigError("this model is causal (causal = true): it is not a diffusion denoiser; decode it with "
                          "mlx_llm.generate")
    mask_id = check_mask_id(mask_id, cfg.vocab_size)
    if sampler not in SAMPLERS:
        raise ConfigError(f"sampler = {sampler!r} is invalid: valid samplers are {list(SAMPLERS)}")
    if not (isinstance(steps, (int, np.integer)) and steps >= 1):
        raise ConfigError(f"steps = {steps!r} is invalid: a diffusion sampler needs at least 1 step")
    if not (isinstance(length, (int, np.integer)) and length >= 1):
        raise InputError(f"length = {length!r} is invalid: it must be a positive number of tokens to generate")
    if temperature is not None and not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ConfigError(f"temperature = {temperature!r} is invalid: it must be > 0 (or None for the most "
                          f"probable token)")
    prompt = np.asarray(prompt_BP)
    if prompt.ndim != 2:
        raise InputError(f"prompt must have shape (batch, length); got shape {prompt.shape}")
    if prompt.shape[1] + length > cfg.max_seq_len:
        raise InputError(f"prompt length {prompt.shape[1]} + length {length} = {prompt.shape[1] + length} is longer "
                         f"than max_seq_len = {cfg.max_seq_len}: the denoiser sees the whole sequence at once")
    check_tokens(prompt, cfg, "prompt")
    if np.any(prompt == mask_id):
        b, t = np.argwhere(prompt == mask_id)[0]
        raise InputError(f"prompt[{b}, {t}] is the MASK id {mask_id}: prompt positions are never masked")
    if sampler == "remask":
        reveal_schedule(int(length), int(steps), block_length)
    return _sample(params, jnp.asarray(prompt, jnp.int32), seed_key(seed), cfg=cfg, length=int(length),
                   steps=int(steps), sampler=sampler, block_length=block_length,
                   temperature=None if temperature is None else float(temperature), mask_id=mask_id,
                   kernels=resolved(kernels))
