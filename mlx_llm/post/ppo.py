"""PPO, the algorithm U19 §12–§13 names: a value network, clipped probability ratios and the KL to the reference
(Schulman et al. 2017, "Proximal Policy Optimization Algorithms"; GAE: Schulman et al. 2016). ``--algorithm ppo``
of the one estimator (post/estimator.py); this module holds what is PPO's own: the value head and its bandit.

A rollout samples k replies to each of P prompts from the current policy π_old, and scores every reply token t
(the state is the prompt and the reply so far; the action is the token):

    r_t = −β (log π_old(y_t | ·) − log π_ref(y_t | ·))  + r(y) at the reply's last token   (--kl reward-k1)
    V_t = w · R_t        (the value head: a (d,) vector on the final-normed hidden state, like the reward model's)
    δ_t = r_t + γ V_{t+1} − V_t    (V after the last token = 0; γ = 1 over a reply)
    A_t = δ_t + γλ A_{t+1}          (generalised advantage estimation), returns G_t = A_t + V_t

so the shaped return of a whole reply is r(y) − β Σ_t log(π/π_ref), the same leashed objective as the group
trainer's, whose maximiser over a finite set of answers is π* ∝ π_ref e^{r/β}. Then ``epochs`` passes over the
rollout, ``minibatches`` optimizer updates each (``train.step.make_update``), minimise per reply token

    −min(ρ_t A_t, clip(ρ_t, 1 − ε, 1 + ε) A_t) + c_V · ½ max((V_t − G_t)², (V_old,t + clip(V_t − V_old,t, ±ε_V) − G_t)²)

with ρ_t = π_θ(y_t | ·) / π_old(y_t | ·), averaged over the reply tokens of the minibatch. Advantages are not
whitened: at π* every answer's shaped return is β ln Z, the advantages vanish and the iterates stop, which
``train_bandit`` checks on the three-answer bandit.
"""

from __future__ import annotations

import jax.numpy as jnp

from mlx_llm.errors import ConfigError
from mlx_llm.objectives.preference import (  # noqa: F401 (the equations live there)
    gae, token_rewards, token_losses)
from mlx_llm.model import hidden_states, nll_from_hidden, resolved
from mlx_llm.layers.norm import norm
from mlx_llm.post import bandit
from mlx_llm.runs.configs import EstimatorConfig


def check_rollout_split(rows: int, s: EstimatorConfig, grad_accum: int) -> None:
    """A rollout of ``rows`` replies must split into ``minibatches`` minibatches of ``grad_accum`` micro-batches."""
    if rows % (s.minibatches * grad_accum):
        raise ConfigError(f"a rollout of {rows} replies (prompts × k) cannot be split into {s.minibatches} "
                          f"minibatches of {grad_accum} micro-batches: choose --minibatches and --grad-accum whose "
                          f"product divides it")


def train_bandit(pi_ref, rewards, beta, *, k: int = 16, steps: int = 2000, lr: float = 0.05, epochs: int = 4,
                 minibatches: int = 4, clip: float = 0.2, value_coef: float = 0.5, value_clip: float = 0.2,
                 seed: int = 0):
    """PPO on a finite bandit (one-token replies, ``bandit.one_token_bandit``): logits θ (π_θ = softmax θ, starting
    at π_ref) and a scalar value, k samples per rollout, ``epochs`` × ``minibatches`` updates per rollout of the
    estimator's loss through the trainer's update (the learning rate decayed to 0 by a cosine), the KL to π_ref
    in the reward. Returns π_θ after every rollout, (steps, n)."""
    s = EstimatorConfig(algorithm="ppo", k=k, beta=beta, epochs=epochs, minibatches=minibatches, clip=clip,
                        value_coef=value_coef, value_clip=value_clip)
    b = bandit.one_token_bandit(len(pi_ref))
    return bandit.train(b, jnp.log(jnp.asarray(pi_ref)), rewards, s, steps=steps, lr=lr, seeds=(seed,))[0]


def token_logprobs_and_values(params, value_head, cfg, seqs, kernels=None, *, remat: str = "none"):
    """(log π(x_t | x_<t), V_t or None without a ``value_head``, expert loads) at every position of
    ``seqs["ids"][:, 1:]`` (B, W − 1), from one forward: the value head reads the final-normed hidden state that
    predicts the token."""
    kernels = resolved(kernels)
    ids = jnp.asarray(seqs["ids"])
    h_BTD, load = hidden_states(params, ids[:, :-1], cfg, kernels=kernels, remat=remat, return_aux=True)
    logp_BT = -nll_from_hidden(h_BTD, ids[:, 1:], params, cfg, kernels.loss_chunk)
    if value_head is None:
        return logp_BT, None, load
    r_BTD = norm(h_BTD, params["final_norm"], cfg)
    acc = jnp.promote_types(r_BTD.dtype, jnp.float32)
    return logp_BT, jnp.einsum("btd,d->bt", r_BTD.astype(acc), value_head.astype(acc)), load
