"""The KL leash (U19 §12): its closed form over a finite set of answers, and on-policy RL that converges to it.

Maximise J(π) = E_{y∼π}[r(y)] − β KL(π ‖ π_ref). Over a finite set of answers the maximiser is

    π*(y) = π_ref(y) e^{r(y)/β} / Z,   Z = Σ_y π_ref(y) e^{r(y)/β},   J(π*) = β ln Z = E_{π*}[r] − β KL(π* ‖ π_ref)

(``leash``). On-policy RL estimates ∇J from samples: for each prompt the policy draws k replies with the jitted
decoder (temperature 1: the policy's own distribution), each is scored (the task's exact checker, or a reward
model), and the reward is shaped with the per-token KL penalty, estimator k1:

    r̃(y) = r(y) − β Σ_{t ∈ y} [log π_θ(y_t | ·) − log π_ref(y_t | ·)]

whose expectation under π_θ is exactly r − β·KL. With the leave-one-out group baseline (the mean r̃ of the other
k − 1 replies to the same prompt, so k ≥ 2; RLOO, GRPO-style group-relative without the std division) the
advantage A = r̃ − baseline gives an unbiased estimate of ∇J = E_π[A ∇ log π_θ(y)] (the KL term's own
E_π[∇ log π_θ] vanishes), so the fixed point is exactly π* — ``train_bandit`` runs the same functions on a
3-answer bandit and lands on the closed form. (The k3 estimator r/π − log(r/π) − 1 as a loss term has the
gradient of the *forward* KL(π_ref ‖ π), whose optimum is not π*.) ``RLConfig.algorithm = "ppo"`` trains the
same leashed objective with a value head instead of the group baseline (post/ppo.py).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mlx_llm.config import LoRAConfig, TrainConfig
from mlx_llm.errors import ConfigError
from mlx_llm.objectives.preference import (  # noqa: F401 (the equations live there)
    leash, shaped_rewards, group_advantages, policy_loss, leashed_loss)
from mlx_llm.post import prologue
from mlx_llm.post import pairs as pairs_lib
from mlx_llm.post import ppo
from mlx_llm.data import tasks as tasks_lib
from mlx_llm.post.reward import load_reward_model
from mlx_llm.eval.replies import REPLY_TOKENS, eval_task, sample_replies
from mlx_llm.runs.configs import RLConfig, check_group
from mlx_llm.settings import check_number
from mlx_llm.data.text import epoch_order
from mlx_llm.train.metrics import write_summary
from mlx_llm.train.preflight import compiled_update
from mlx_llm.train.step import moe_offsets


def train_bandit(pi_ref, rewards, beta, *, k: int = 16, steps: int = 4000, lr: float = 0.05, seed: int = 0):
    """On-policy RL on a finite bandit with logits θ (π_θ = softmax θ, starting at π_ref), k samples per step,
    Adam: the same ``leashed_loss`` as the language-model trainer. Returns π_θ after every step, (steps, n)."""
    beta, k = check_number("beta", beta, low=0.0, positive=True), check_group(k)
    log_ref, r = jnp.log(jnp.asarray(pi_ref, jnp.float32)), jnp.asarray(rewards, jnp.float32)
    opt = optax.adam(lr)

    def loss_fn(theta, y_K):
        logp_K = jax.nn.log_softmax(theta)[y_K]
        return leashed_loss(logp_K[None], log_ref[y_K][None], r[y_K][None], beta)[0]

    def step(carry, key):
        theta, opt_state = carry
        y_K = jax.random.categorical(key, theta, shape=(k,))
        updates, opt_state = opt.update(jax.grad(loss_fn)(theta, y_K), opt_state)
        theta = optax.apply_updates(theta, updates)
        return (theta, opt_state), jax.nn.softmax(theta)

    keys = jax.random.split(jax.random.key(seed), steps)
    return jax.jit(lambda: jax.lax.scan(step, (log_ref, opt.init(log_ref)), keys)[1])()


# ----- in a language model ------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=16)  # one function per setting: its jitted update compiles once
def make_objective(cfg, beta: float, k: int, lora_cfg, kernels=None, remat: str = "none"):
    """(trainable, frozen, batch, key) → (Σ loss, (replies, the policy's expert loads, {kl, shaped_reward}
    summed)): ``train.step.make_update``'s form. The batch holds P·K sampled replies grouped by prompt (a
    micro-batch of gradient accumulation holds whole groups) as sequences and their rewards; ``kernels``: the
    execution paths of both forwards."""

    def objective(trainable, frozen, batch, key):
        seqs = {"ids": batch["ids"], "target": batch["target"]}
        policy = prologue.policy_params(trainable, frozen, lora_cfg)
        logp, load = pairs_lib.response_logprobs(policy, cfg, seqs, kernels, remat=remat, return_aux=True)
        logp_ref = jax.lax.stop_gradient(pairs_lib.response_logprobs(frozen["reference"], cfg, seqs, kernels))
        loss, aux = leashed_loss(logp.reshape(-1, k), logp_ref.reshape(-1, k), batch["reward"].reshape(-1, k), beta)
        n = jnp.asarray(logp.shape[0], jnp.float32)
        return loss * n, (n, load, {name: value * n for name, value in aux.items()})

    return objective


def reply_sequences(prompt_ids, replies, width: int, pad_id: int) -> dict:
    """Prompt ids followed by the sampled reply ids, the reply flagged as the response (``pad_sequences``)."""
    return pairs_lib.pad_sequences([(np.concatenate([p, ids]), np.r_[np.zeros(len(p)), np.ones(len(ids))])
                                    for p, (ids, _) in zip(prompt_ids, replies)], width, pad_id)


_logprobs = jax.jit(pairs_lib.response_logprobs, static_argnums=1)


def sampled_kl(policy, reference, base: prologue.Base, prompts, max_new_tokens: int, *, seed: int = 0) -> float:
    """KL(π ‖ π_ref) over ``prompts`` (message lists), estimated from one reply per prompt drawn from π at
    temperature 1: the mean of Σ_t log π − log π_ref over the reply's tokens (k1; unbiased)."""
    replies = sample_replies(policy, base.cfg, base.tok, base.template, prompts, max_new_tokens, temperature=1.0,
                             seed=seed)
    ids = [base.template.encode(m, base.tok, generation_prompt=True)[0] for m in prompts]
    width = max(len(p) for p in ids) + max_new_tokens
    seqs = jax.tree.map(jnp.asarray, reply_sequences(ids, replies, width, base.tok.pad_id))
    seqs = {"ids": seqs["ids"], "target": seqs["target"]}
    return float(jnp.mean(_logprobs(policy, base.cfg, seqs) - _logprobs(reference, base.cfg, seqs)))


class Sampler:
    """The host side of a step: P prompts of the task (an epoch permutation of (seed, epoch)), k replies to each
    from the current policy at temperature 1 (seeded by (seed, step)), their sequences and rewards."""

    def __init__(self, base: prologue.Base, task: str, tcfg: TrainConfig, k: int, frozen, lora_cfg, *, n_train=None,
                 reward_model=None, max_new_tokens=None):
        self.base, self.task, self.tcfg, self.k, self.frozen, self.lora_cfg = base, task, tcfg, k, frozen, lora_cfg
        self.examples = tasks_lib.examples(task, "train", n=n_train, seed=tcfg.batch_seed)
        self.reward_model = reward_model
        self.max_new = max_new_tokens or REPLY_TOKENS[task]
        self.prompts = [base.template.encode(tasks_lib.prompt_messages(e), base.tok, generation_prompt=True)[0]
                        for e in self.examples]
        longest = max(len(p) for p in self.prompts) + self.max_new
        if longest > tcfg.seq_len:
            raise ConfigError(f"{task} prompts + {self.max_new} reply tokens need seq_len ≥ {longest}, got "
                              f"{tcfg.seq_len}")
        self.width = pairs_lib.batch_width(longest, tcfg.seq_len)

    def example_batch(self) -> dict:
        """A batch of this sampler's shapes and dtypes (empty replies), for compiling the update ahead of time."""
        n = self.tcfg.batch_size * self.k
        seqs = reply_sequences([self.prompts[0]] * n, [(np.zeros(0, np.int64), "")] * n, self.width,
                               self.base.tok.pad_id)
        return {"ids": seqs["ids"], "target": seqs["target"], "reward": np.zeros(n, np.float32)}

    def __call__(self, step: int, trainable):

        base, k = self.base, self.k
        idx = np.repeat(epoch_order(step, self.tcfg.batch_size, len(self.examples), self.tcfg.batch_seed), k)
        params = prologue.policy_params(trainable, self.frozen, self.lora_cfg)
        seed = int(np.random.default_rng([self.tcfg.seed, step, 11]).integers(2**31))
        replies = sample_replies(params, base.cfg, base.tok, base.template,
                                 [tasks_lib.prompt_messages(self.examples[i]) for i in idx], self.max_new,
                                 temperature=1.0, seed=seed, batch_size=len(idx))
        seqs = reply_sequences([self.prompts[i] for i in idx], replies, self.width, base.tok.pad_id)
        correct = np.array([tasks_lib.check(self.task, text, self.examples[i]["answer"])
                            for i, (_, text) in zip(idx, replies)], np.float32)
        reward = correct if self.reward_model is None else np.asarray(self.reward_model.score(seqs), np.float32)
        host = {"reward": float(reward.mean()), "accuracy": float(correct.mean()),
                "response_length": float(np.mean([len(ids) for ids, _ in replies]))}
        return {"ids": seqs["ids"], "target": seqs["target"], "reward": reward}, host


@dataclasses.dataclass
class Algorithm:
    """What an RL algorithm gives ``rl_run``: the trainable tree and its policy part, the objective, an example
    batch to compile for, the batch source ``(step, trainable) → (batch, host metrics)`` and the updates per step."""

    trainable: Any
    policy: Callable
    objective: Callable
    example_batch: dict
    batches: Callable
    count_name: str
    describe: str
    epochs: int = 1
    minibatches: int = 1


def _algorithm(base: prologue.Base, tcfg: TrainConfig, s: RLConfig, sampler: "Sampler", lora_cfg) -> Algorithm:
    """The group-baseline trainer (this module) or PPO (post/ppo.py) for ``s.algorithm``."""
    kernels = tcfg.kernels(resolve=True)
    if s.algorithm == "ppo":
        ppo.check_rollout_split(tcfg.batch_size * s.k, s, tcfg.grad_accum)
        return Algorithm(ppo.initial_trainable(base, lora_cfg, tcfg.params_seed, s), lambda t: t["policy"],
                         ppo.make_objective(base.cfg, s, lora_cfg, kernels, tcfg.remat), ppo.example_batch(sampler),
                         lambda step, t: ppo.rollout_batch(sampler, step, t, s, kernels), "reply_tokens",
                         f"PPO: {s.epochs} epochs × {s.minibatches} minibatches per rollout, ε = {s.clip:g}, "
                         f"λ = {s.gae_lambda:g}", s.epochs, s.minibatches)
    return Algorithm(prologue.initial_trainable(base, lora_cfg, tcfg.params_seed), lambda t: t,
                     make_objective(base.cfg, s.beta, s.k, lora_cfg, kernels, tcfg.remat), sampler.example_batch(),
                     sampler, "replies", "leave-one-out group baseline")


def rl_run(run_dir, base_run=None, *, tcfg: TrainConfig | None = None, settings: RLConfig | None = None,
           lora_cfg: LoRAConfig | None = None, resume=False, changes: dict | None = None,
           from_step: int | None = None, show_progress: bool = True, max_seconds: float | None = None,
           log=print, options=None) -> dict:
    """KL-leashed on-policy RL from ``base_run`` on ``settings.task`` (``tcfg.batch_size`` prompts × ``k`` replies
    per step), rewarded by the task's checker or by ``settings.reward_model`` (a reward run with the policy's
    tokenizer); the reference is the base unless ``settings.reference`` names another run. ``settings.algorithm``:
    the leave-one-out group baseline (this module) or PPO (post/ppo.py: a value head, GAE, several clipped updates
    per rollout). Held-out exact match before and after. On resume everything is read back from the run
    (``changes``, ``from_step``: ``prologue.start``)."""
    st = prologue.start(run_dir, "rl", base_run, tcfg=tcfg, settings=settings, lora_cfg=lora_cfg, resume=resume,
                        changes=changes, from_step=from_step, options=options)
    base, tcfg, s, lora_cfg = st.base, st.tcfg, st.settings, st.lora_cfg
    rm = None
    if s.reward_model is not None:
        rm = load_reward_model(s.reward_model)
        if rm.tok.fingerprint() != base.tok.fingerprint():
            raise ConfigError(f"the reward model {s.reward_model} has a different tokenizer from the policy's "
                              f"({base.run}): it cannot score the policy's token ids")
    frozen = {"reference": st.reference.params, **({"base": base.params} if lora_cfg is not None else {})}
    sampler = Sampler(base, s.task, tcfg, s.k, frozen, lora_cfg, n_train=s.n_train, reward_model=rm)
    algo = _algorithm(base, tcfg, s, sampler, lora_cfg)
    update = compiled_update(base.cfg, st.schedule_tcfg, algo.objective, algo.trainable, frozen,
                             algo.example_batch, offsets=None if lora_cfg else moe_offsets(base.cfg),
                             count_name=algo.count_name, epochs=algo.epochs, minibatches=algo.minibatches)
    before = None if st.resume is not None else eval_task(base.params, base.cfg, base.tok, s.task, base.template,
                                               n=s.eval_examples)
    with st.writing():  # the run's lock, held to the end of the run
        log(f"rl from {base.run} (step {base.step}) on {s.task}: {tcfg.batch_size} prompts × {s.k} replies per "
            f"step, β = {s.beta:g}, reward from {'the checker' if rm is None else rm.run}; "
            f"{'LoRA' if lora_cfg else 'full'}; {algo.describe}")

        def evaluate(trainable):
            params = prologue.policy_params(algo.policy(trainable), frozen, lora_cfg)
            return {"heldout_accuracy": eval_task(params, base.cfg, base.tok, s.task, base.template,
                                                  n=s.eval_examples)["accuracy"]}

        out = st.fit(algo.trainable, frozen, update, algo.batches, evaluate,
                     show_progress=show_progress, max_seconds=max_seconds, log=log, on_policy=True,
                     options=options)
        summary = {**out["summary"],
                   **{key: out["last"].get(key) for key in ("reward", "accuracy", "kl", "response_length")}}
        if before is not None:
            summary["base_heldout_accuracy"] = before["accuracy"]
        return write_summary(st.run_dir, summary)
