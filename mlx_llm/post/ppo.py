"""PPO, the algorithm U19 §12–§13 names: a value network, clipped probability ratios and the KL to the reference
(Schulman et al. 2017, "Proximal Policy Optimization Algorithms"; GAE: Schulman et al. 2016).

A rollout samples k replies to each of P prompts from the current policy π_old (temperature 1), and scores every
reply token t (the state is the prompt and the reply so far; the action is the token):

    r_t = −β (log π_old(y_t | ·) − log π_ref(y_t | ·))  + r(y) at the reply's last token
    V_t = w · R_t        (the value head: a (d,) vector on the final-normed hidden state, like the reward model's)
    δ_t = r_t + γ V_{t+1} − V_t    (V after the last token = 0; γ = 1 over a reply)
    A_t = δ_t + γλ A_{t+1}          (generalised advantage estimation), returns G_t = A_t + V_t

so the shaped return of a whole reply is r(y) − β Σ_t log(π/π_ref), the same leashed objective as the group
trainer (post/rl.py), whose maximiser over a finite set of answers is π* ∝ π_ref e^{r/β}. Then ``epochs`` passes
over the rollout, ``minibatches`` optimizer updates each (``train.step.make_update``), minimise per reply token

    −min(ρ_t A_t, clip(ρ_t, 1 − ε, 1 + ε) A_t) + c_V · ½ max((V_t − G_t)², (V_old,t + clip(V_t − V_old,t, ±ε_V) − G_t)²)

with ρ_t = π_θ(y_t | ·) / π_old(y_t | ·), averaged over the reply tokens of the minibatch. Advantages are not
whitened: at π* every answer's shaped return is β ln Z, the advantages vanish and the iterates stop, which
``train_bandit`` checks on the three-answer bandit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mlx_llm.errors import ConfigError
from mlx_llm.objectives.preference import (  # noqa: F401 (the equations live there)
    gae, token_rewards, token_losses)
from mlx_llm.settings import check_number
from mlx_llm.model import hidden_states, nll_from_hidden, resolved
from mlx_llm.layers.norm import norm
from mlx_llm.post import prologue
from mlx_llm.runs.configs import RLConfig
from mlx_llm.runs.load import trainable_tree


def check_rollout_split(rows: int, s: RLConfig, grad_accum: int) -> None:
    """A rollout of ``rows`` replies must split into ``minibatches`` minibatches of ``grad_accum`` micro-batches."""
    if rows % (s.minibatches * grad_accum):
        raise ConfigError(f"a rollout of {rows} replies (prompts × k) cannot be split into {s.minibatches} "
                          f"minibatches of {grad_accum} micro-batches: choose --minibatches and --grad-accum whose "
                          f"product divides it")


# ----- the three-answer bandit --------------------------------------------------------------------------------
def train_bandit(pi_ref, rewards, beta, *, k: int = 16, steps: int = 2000, lr: float = 0.05, epochs: int = 4,
                 minibatches: int = 4, clip: float = 0.2, value_coef: float = 0.5, value_clip: float = 0.2,
                 seed: int = 0):
    """PPO on a finite bandit (one-token replies): logits θ (π_θ = softmax θ, starting at π_ref) and a scalar
    value, k samples per rollout, ``epochs`` × ``minibatches`` Adam updates of ``token_losses`` per rollout (the
    learning rate decayed to 0 by a cosine, as the trainer's schedule decays it), the KL to π_ref in the reward.
    Returns π_θ after every rollout, (steps, n). (At a constant learning rate the iterates reach π* and then
    wander 0.01–0.04 from it: near π* the gradients vanish, and Adam rescales them to steps of about lr.)"""
    beta = check_number("beta", beta, low=0.0, positive=True)
    log_ref, r = jnp.log(jnp.asarray(pi_ref, jnp.float32)), jnp.asarray(rewards, jnp.float32)
    opt = optax.adam(optax.cosine_decay_schedule(lr, steps * epochs * minibatches))
    size = k // minibatches

    def loss_fn(p, mb):
        logp = jax.nn.log_softmax(p["theta"])[mb["y"]]
        values = jnp.broadcast_to(p["value"], logp.shape)
        terms = token_losses(logp, mb["old_logp"], mb["adv"], values, mb["old_value"], mb["ret"], clip=clip,
                             value_clip=value_clip)
        return jnp.mean(terms["policy_loss"] + value_coef * terms["value_loss"])

    def rollout(carry, key):
        p, opt_state = carry
        y = jax.random.categorical(jax.random.fold_in(key, 0), p["theta"], shape=(k,))
        old_logp = jax.nn.log_softmax(p["theta"])[y]
        old_value = jnp.broadcast_to(p["value"], (k,))
        shaped = token_rewards(r[y], old_logp[:, None], log_ref[y][:, None], jnp.ones((k, 1)), beta)
        adv, ret = gae(shaped, old_value[:, None], jnp.ones((k, 1)))
        data = {"y": y, "old_logp": old_logp, "old_value": old_value, "adv": adv[:, 0], "ret": ret[:, 0]}

        def update(c, idx):
            p, opt_state = c
            grads = jax.grad(loss_fn)(p, jax.tree.map(lambda a: a[idx], data))
            updates, opt_state = opt.update(grads, opt_state)
            return (optax.apply_updates(p, updates), opt_state), None

        order = jnp.stack([jax.random.permutation(jax.random.fold_in(key, 1 + e), k) for e in range(epochs)])
        (p, opt_state), _ = jax.lax.scan(update, (p, opt_state), order[:, :size * minibatches].reshape(-1, size))
        return (p, opt_state), jax.nn.softmax(p["theta"])

    params = {"theta": log_ref, "value": jnp.zeros((), jnp.float32)}
    keys = jax.random.split(jax.random.key(seed), steps)
    return jax.jit(lambda: jax.lax.scan(rollout, (params, opt.init(params)), keys)[1])()


# ----- in a language model ------------------------------------------------------------------------------------
def token_logprobs_and_values(params, value_head, cfg, seqs, kernels=None, *, remat: str = "none"):
    """(log π(x_t | x_<t), V_t, expert loads) at every position of ``seqs["ids"][:, 1:]`` (B, W − 1), from one
    forward: the value head reads the final-normed hidden state that predicts the token."""
    kernels = resolved(kernels)
    ids = jnp.asarray(seqs["ids"])
    h_BTD, load = hidden_states(params, ids[:, :-1], cfg, kernels=kernels, remat=remat, return_aux=True)
    logp_BT = -nll_from_hidden(h_BTD, ids[:, 1:], params, cfg, kernels.loss_chunk)
    r_BTD = norm(h_BTD, params["final_norm"], cfg)
    acc = jnp.promote_types(r_BTD.dtype, jnp.float32)
    return logp_BT, jnp.einsum("btd,d->bt", r_BTD.astype(acc), value_head.astype(acc)), load


@functools.lru_cache(maxsize=16)  # one function per setting: its jitted update compiles once
def make_objective(cfg, settings: RLConfig, lora_cfg, kernels=None, remat: str = "none"):
    """(trainable, frozen, minibatch, key) → (Σ over reply tokens of the PPO loss, (reply tokens, the policy's
    expert loads, {policy_loss, value_loss, clip_fraction, approx_kl} summed)): ``make_update``'s form;
    trainable = {"policy": the model or its LoRA adapters, "value_head": (d,)}."""
    s = settings

    def objective(trainable, frozen, batch, key):
        policy = prologue.policy_params(trainable["policy"], frozen, lora_cfg)
        logp, values, load = token_logprobs_and_values(policy, trainable["value_head"], cfg, batch, kernels,
                                                       remat=remat)
        terms = token_losses(logp, batch["old_logp"], batch["adv"], values, batch["old_value"], batch["ret"],
                             clip=s.clip, value_clip=s.value_clip)
        mask = batch["target"][:, 1:].astype(logp.dtype)
        sums = {name: jnp.sum(mask * term) for name, term in terms.items()}
        return sums["policy_loss"] + s.value_coef * sums["value_loss"], (jnp.sum(mask), load, sums)

    return objective


@functools.lru_cache(maxsize=16)
def make_scorer(cfg, settings: RLConfig, lora_cfg, kernels=None):
    """The jitted rollout scoring: (trainable, frozen, seqs, reward) → the update's batch (old log-probabilities
    and values, advantages, returns) and the rollout's mean per-reply KL to the reference."""

    def score(trainable, frozen, seqs, reward):
        policy = prologue.policy_params(trainable["policy"], frozen, lora_cfg)
        logp, values, _ = token_logprobs_and_values(policy, trainable["value_head"], cfg, seqs, kernels)
        ref = frozen["reference"]
        logp_ref = -nll_from_hidden(hidden_states(ref, seqs["ids"][:, :-1], cfg, kernels=resolved(kernels)),
                                    seqs["ids"][:, 1:], ref, cfg, resolved(kernels).loss_chunk)
        mask = seqs["target"][:, 1:]
        rewards = token_rewards(reward, logp, logp_ref, mask, settings.beta)
        adv, ret = gae(rewards, values, mask, lam=settings.gae_lambda)
        kl = jnp.mean(jnp.sum(mask * (logp - logp_ref), axis=1))
        return {**seqs, "old_logp": logp, "old_value": values, "adv": adv, "ret": ret}, kl

    return jax.jit(score)


def initial_trainable(base: prologue.Base, lora_cfg, seed: int, settings: RLConfig) -> dict:
    """The policy (the base's parameters or fresh adapters) and a zero value head (``RLConfig.trainable_layout``)."""
    return trainable_tree(settings, prologue.initial_trainable(base, lora_cfg, seed), base.cfg.d_model)


def rollout_batch(sampler, step: int, trainable, settings: RLConfig, kernels=None):
    """A PPO rollout: the group trainer's sampled replies and rewards (``rl.Sampler``) scored by the current
    policy, value head and reference (through the execution paths ``kernels`` that the update uses)."""
    batch, host = sampler(step, trainable["policy"])
    scorer = make_scorer(sampler.base.cfg, settings, sampler.lora_cfg, kernels)
    seqs = {"ids": jnp.asarray(batch["ids"]), "target": jnp.asarray(batch["target"])}
    scored, kl = scorer(trainable, sampler.frozen, seqs, jnp.asarray(batch["reward"]))
    return jax.tree.map(np.asarray, scored), {**host, "kl": float(kl)}


def example_batch(sampler) -> dict:
    """A rollout batch of the sampler's shapes and dtypes, for compiling the update ahead of time."""
    seqs = sampler.example_batch()
    n, w = seqs["ids"].shape
    per_token = np.zeros((n, w - 1), np.float32)
    return {"ids": seqs["ids"], "target": seqs["target"], "old_logp": per_token, "old_value": per_token,
            "adv": per_token, "ret": per_token}
