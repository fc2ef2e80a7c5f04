"""Tabular bandits where the KL leash's maximiser is known exactly, for checking every estimator's fixed point.

A policy over V tokens writes replies of at most T tokens, one logit vector per prefix (a table θ (H, V)); with an
end token a reply ends at its first end token, else after T tokens. Small V and T make every reply enumerable, so
π_θ(y) = Π_t π_θ(y_t | y_<t) and the leash's maximiser

    π*(y) = π_ref(y) e^{r(y)/β} / Σ_y' π_ref(y') e^{r(y')/β}          (U19 §12, ``objectives.preference.leash``)

are exact vectors over the replies. ``train`` runs an estimator (post/estimator.py: the language-model trainer's
``rollout`` and ``loss``, unchanged) on the bandit through the trainer's own update (``train.step.make_update``:
AdamW, clipping, epochs × minibatches) for several seeds at once, sampling with the rollout settings' temperature,
top-k and top-p (``decode.sampling.decoding_logprobs``, the decoder's rules). One token (T = 1, no end token) is
U19 §12's bandit.

Closed forms of the biased placements: ``per_prefix_fixed_point`` — with the KL as a per-token loss term (k2 or
k3), each prefix's conditional solves its own one-step problem with the expected reward-to-go and no KL after it
(docs/post-training.md derives it).
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from mlx_llm.config import TrainConfig
from mlx_llm.decode.sampling import DecodeSettings, decoding_logprobs
from mlx_llm.errors import ConfigError
from mlx_llm.objectives.preference import leash
from mlx_llm.ops import seed_key_data
from mlx_llm.post import estimator
from mlx_llm.runs.configs import EstimatorConfig
from mlx_llm.train.step import init_state, make_update, optimizer_for


@dataclasses.dataclass(frozen=True, eq=False)
class Bandit:
    """Every reply of a tabular policy: ``tokens``, the index of the prefix each token is written after
    (``prefixes``) and the reply's positions (``mask``), each (N, T); ``prefix_list`` names the H prefixes."""

    vocab: int
    length: int
    eos: int | None
    replies: tuple
    prefix_list: tuple
    tokens: np.ndarray
    prefixes: np.ndarray
    mask: np.ndarray

    @property
    def n_replies(self) -> int:
        return len(self.replies)

    @property
    def n_prefixes(self) -> int:
        return len(self.prefix_list)

    def table(self, logits) -> jax.Array:
        """``logits`` as the (H, V) table (one token's bandit also takes its V logits)."""
        return jnp.reshape(jnp.asarray(logits), (self.n_prefixes, self.vocab))

    def token_logprobs(self, logits_HV, rows):
        """log π(y_t | y_<t) of replies ``rows`` (B,) at each position, (B, T), 0 after a reply's end."""
        logp_HV = jax.nn.log_softmax(logits_HV, axis=-1)
        mask = jnp.asarray(self.mask)[rows]
        return jnp.where(mask > 0, logp_HV[jnp.asarray(self.prefixes)[rows], jnp.asarray(self.tokens)[rows]], 0.0)

    def reply_logprobs(self, logits_HV):
        """log π(y) of every reply, (N,)."""
        return jnp.sum(self.token_logprobs(logits_HV, jnp.arange(self.n_replies)), axis=1)

    def reply_probs(self, probs_HV) -> np.ndarray:
        """π(y) = Π_t π(y_t | y_<t) of every reply from a table of conditionals (NumPy, float64), (N,)."""
        probs = np.asarray(probs_HV, np.float64)[self.prefixes, self.tokens]
        return np.prod(np.where(self.mask > 0, probs, 1.0), axis=1)


def make_bandit(vocab: int, length: int, *, eos: bool = True) -> Bandit:
    """Replies of up to ``length`` tokens over ``vocab`` tokens, the last of them the end token when ``eos``
    (a reply ends at it; without it every reply has ``length`` tokens)."""
    end = vocab - 1 if eos else None
    if vocab < 2 or length < 1:
        raise ConfigError(f"a bandit needs vocab ≥ 2 and length ≥ 1, got vocab = {vocab}, length = {length}")
    replies = [toks for n in range(1, length + 1) for toks in itertools.product(range(vocab), repeat=n)
               if end not in toks[:-1] and (n == length or toks[-1] == end)]
    prefix_list = sorted({r[:t] for r in replies for t in range(len(r))}, key=lambda p: (len(p), p))
    index = {p: i for i, p in enumerate(prefix_list)}
    shape = (len(replies), length)
    tokens, prefixes, mask = np.zeros(shape, np.int32), np.zeros(shape, np.int32), np.zeros(shape, np.float64)
    for i, reply in enumerate(replies):
        for t, token in enumerate(reply):
            tokens[i, t], prefixes[i, t], mask[i, t] = token, index[reply[:t]], 1.0
    return Bandit(vocab, length, end, tuple(replies), tuple(prefix_list), tokens, prefixes, mask)


def one_token_bandit(n: int) -> Bandit:
    """U19 §12's bandit: one token, ``n`` answers."""
    return make_bandit(n, 1, eos=False)


def sequence_example(seed: int = 0, *, vocab: int = 3, length: int = 3, scale: float = 0.7):
    """The sequence bandit the tests and docs use: two tokens and the end token, replies of up to three tokens (15
    replies, 7 prefixes), reference logits N(0, ``scale``²) per prefix and a checker's reward, 0 or 1 per reply
    (both drawn from ``seed``). Returns (bandit, reference logits (H, V), rewards (N,))."""
    b = make_bandit(vocab, length)
    rng = np.random.default_rng(seed)
    ref = rng.normal(size=(b.n_prefixes, vocab)) * scale
    return b, ref, rng.integers(0, 2, b.n_replies).astype(np.float64)


def closed_form(bandit: Bandit, ref_logits, rewards, beta: float) -> dict:
    """``leash`` over the bandit's replies: π* ∝ π_ref(y) e^{r(y)/β}, E_{π*}[r], KL(π* ‖ π_ref), β ln Z."""
    return leash(jnp.exp(bandit.reply_logprobs(bandit.table(ref_logits))), jnp.asarray(rewards), beta)


def sampler_logits(logits_HV, s: EstimatorConfig):
    """log q of the rollouts' sampler at every prefix: temperature → top-k → top-p → renormalise (the decoder's
    ``decoding_logprobs``)."""
    return decoding_logprobs(logits_HV, DecodeSettings(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p))


def _tcfg(s: EstimatorConfig, steps: int, lr: float, groups: int) -> TrainConfig:
    """The trainer's AdamW with a cosine decay of ``lr`` to 0 over ``steps`` (the iterates settle) and no weight
    decay (it would pull the logits toward 0, a prior the leash does not have)."""
    return TrainConfig(batch_size=groups, seq_len=8, steps=steps, lr=lr, warmup_steps=0, final_lr_fraction=0.0,
                       weight_decay=0.0)


def train(bandit: Bandit, ref_logits, rewards, s: EstimatorConfig, *, steps: int = 2000, lr: float = 0.05,
          groups: int = 1, seeds=(0,)):
    """π_θ over the replies after every step, (len(seeds), steps, N): the policy starts at the reference; each step
    samples ``groups`` × k replies from the sampler (dynamic sampling: up to ``sampling_rounds`` × ``groups``
    groups, the first ``groups`` with differing rewards kept), scores them (``estimator.rollout``: log π_old, log
    π_ref, log q, a tabular value per prefix for ppo) and makes the trainer's update (``make_update`` of
    ``estimator.make_objective``: ``epochs`` × ``minibatches`` AdamW updates)."""
    k, rows = s.k, groups * s.k
    epochs, minibatches = (s.epochs, s.minibatches) if s.clipped else (1, 1)
    if rows % minibatches:
        raise ConfigError(f"{groups} groups × k = {k} replies cannot be split into {minibatches} minibatches")
    ref = bandit.table(ref_logits).astype(jnp.float64 if jax.config.jax_enable_x64 else jnp.float32)
    r_N = jnp.asarray(rewards, ref.dtype)
    tcfg = _tcfg(s, steps, lr, groups)
    opt = optimizer_for(tcfg, epochs * minibatches)
    prefixes, mask_N = jnp.asarray(bandit.prefixes), jnp.asarray(bandit.mask, ref.dtype)

    def forward(trainable, frozen, batch):
        logp = bandit.token_logprobs(trainable["embed"], batch["rows"])
        values = trainable["value_head"][prefixes[batch["rows"]]] if "value_head" in trainable else None
        return logp, values, None

    update = make_update(estimator.make_objective(s, forward), tcfg, opt, epochs=epochs, minibatches=minibatches)
    rounds = s.sampling_rounds if s.dynamic_sampling else 1

    def step(state, t):
        key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), 1_000_000 + t)
        theta = state.params["embed"]
        logq_HV = sampler_logits(theta, s)
        logq_N = jnp.sum(jnp.where(mask_N > 0, logq_HV[prefixes, jnp.asarray(bandit.tokens)], 0.0), axis=1)
        drawn = jax.random.categorical(key, logq_N, shape=(rounds * rows,))
        if rounds > 1:  # the first `groups` groups whose rewards differ, then the rest in order
            spread = estimator.spread_groups(r_N[drawn], k)[::k]
            order = jnp.argsort(~spread, stable=True)[:groups]
            drawn = drawn.reshape(-1, k)[order].reshape(-1)
        reward = r_N[drawn]
        mask = mask_N[drawn]
        logq = jnp.where(mask > 0, logq_HV[prefixes[drawn], jnp.asarray(bandit.tokens)[drawn]], 0.0)
        values = state.params["value_head"][prefixes[drawn]] * mask if "value_head" in state.params else None
        keep = estimator.spread_groups(reward, k) if s.dynamic_sampling else None
        batch, _ = estimator.rollout(s, reward, bandit.token_logprobs(theta, drawn),
                                     bandit.token_logprobs(ref, drawn), logq, mask, values, keep)
        state, _ = update(state, {**batch, "rows": drawn}, None)
        return state, jnp.exp(bandit.reply_logprobs(state.params["embed"]))

    # the table is an embedding (a prefix's row is its logits); ppo's value head is one value per prefix
    params = {"embed": ref} | ({"value_head": jnp.zeros(bandit.n_prefixes, ref.dtype)} if s.algorithm == "ppo" else {})

    def run(seed):
        state = init_state(None, tcfg, opt, params)
        state = state.replace(rng=seed_key_data(seed))
        return jax.lax.scan(step, state, jnp.arange(steps))[1]

    return jax.jit(jax.vmap(run))(jnp.asarray(seeds))


def total_variation(p, q) -> float:
    """½ Σ |p − q|."""
    return float(0.5 * np.abs(np.asarray(p, np.float64) - np.asarray(q, np.float64)).sum())


def fixed_point(trace, tail: float = 0.1):
    """The iterates' fixed point: π averaged over the last ``tail`` of the steps and over the seeds, (N,)."""
    trace = np.asarray(trace, np.float64)
    return trace[:, -max(1, int(tail * trace.shape[1])):].mean(axis=(0, 1))


def per_prefix_fixed_point(bandit: Bandit, ref_logits, rewards, beta: float, kind: str = "k2"):
    """The fixed point of a group-baseline update with the KL as a per-token loss term (k2 or k3, summed over each
    reply's tokens), as π over the replies: backward over the prefixes, each conditional π(· | h) solves the
    one-step problem of its expected reward-to-go Q(h, y) = E_π[r | h, y] with the KL of that position alone —

        k2:  π(y | h) ∝ π_ref(y | h) e^{Q(h, y)/β}                      (∇ of KL(π(·|h) ‖ π_ref(·|h)))
        k3:  π(y | h) = β π_ref(y | h) / (β + V(h) − Q(h, y)),  Σ_y π(y | h) = 1 fixing V   (∇ of KL(π_ref ‖ π))

    — because a token's k term is differentiated through that token's log-probability only, no later position's
    KL reaches it (docs/post-training.md). One token: k2 gives π*, k3 the forward-KL fixed point."""
    if kind not in ("k2", "k3"):
        raise ValueError(f"kind = {kind!r}: 'k2' or 'k3'")
    logits = np.reshape(np.asarray(ref_logits, np.float64), (bandit.n_prefixes, bandit.vocab))
    ref_HV = np.exp(logits - logits.max(-1, keepdims=True))
    ref_HV /= ref_HV.sum(-1, keepdims=True)
    r = np.asarray(rewards, np.float64)
    index = {reply: i for i, reply in enumerate(bandit.replies)}
    pi_HV = np.zeros_like(ref_HV)
    value = {}  # V(h) = E_π[r | h] of each prefix, from the longest back
    for h in sorted(range(bandit.n_prefixes), key=lambda i: -len(bandit.prefix_list[i])):
        prefix = bandit.prefix_list[h]
        q = np.array([r[index[prefix + (y,)]] if prefix + (y,) in index else value[prefix + (y,)]
                      for y in range(bandit.vocab)])
        pi_HV[h] = _one_step(ref_HV[h], q, beta, kind)
        value[prefix] = float(pi_HV[h] @ q)
    return bandit.reply_probs(pi_HV)


def _one_step(ref_V, q_V, beta: float, kind: str) -> np.ndarray:
    if kind == "k2":
        w = np.log(ref_V) + q_V / beta
        return np.exp(w - w.max()) / np.exp(w - w.max()).sum()
    # Σ_y β π_ref(y) / (β + v − q_y) = 1 for v > max q − β: decreasing in v, so bisection
    lo, hi = float(q_V.max() - beta) + 1e-15, float(q_V.max()) + 1.0
    while np.sum(beta * ref_V / (beta + hi - q_V)) > 1:
        hi += 2 * (hi - lo)
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if np.sum(beta * ref_V / (beta + mid - q_V)) > 1 else (lo, mid)
    pi = beta * ref_V / (beta + 0.5 * (lo + hi) - q_V)
    return pi / pi.sum()
