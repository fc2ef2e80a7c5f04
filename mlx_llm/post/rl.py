"""The KL leash (U19 §12): its closed form over a finite set of answers, and on-policy RL that converges to it.

Maximise J(π) = E_{y∼π}[r(y)] − β KL(π ‖ π_ref). Over a finite set of answers the maximiser is

    π*(y) = π_ref(y) e^{r(y)/β} / Z,   Z = Σ_y π_ref(y) e^{r(y)/β},   J(π*) = β ln Z = E_{π*}[r] − β KL(π* ‖ π_ref)

(``leash``). On-policy RL estimates ∇J from samples: for each prompt the sampler draws k replies from the policy
with the inference engine (``--temperature``, ``--top-k``, ``--top-p``; recording log q of every token; a
group's k replies are one request, so its prompt is computed once), each is
scored (the task's exact checker, or a reward model), and the estimator (post/estimator.py: group, grpo,
dr_grpo, dapo, gspo, ppo; the KL in the reward or the loss) turns the rollout into advantages and a loss. The
default, ``group`` with the KL in the reward,

    r̃(y) = r(y) − β Σ_{t ∈ y} [log π_θ(y_t | ·) − log π_ref(y_t | ·)],   A = r̃ − the mean r̃ of the other k − 1 replies

gives an unbiased estimate of ∇J = E_π[A ∇ log π_θ(y)], so its fixed point is exactly π* — ``train_bandit`` runs
it on a 3-answer bandit and lands on the closed form; post/bandit.py checks every (algorithm, KL placement) pair
on a sequence bandit. Every step, ``rollout_batch`` scores the rollout with the trainer's forward (log π_old, log
π_ref, ppo's values) and logs the ratio π_old/q of the sampled tokens (``is_ratio_mean``, ``is_ratio_max``,
``logprob_gap``): 1 on-policy at temperature 1 without a cut, the kept mass with top-p.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from mlx_llm.config import LoRAConfig, TrainConfig
from mlx_llm.errors import ConfigError
from mlx_llm.objectives.preference import (  # noqa: F401 (the equations live there)
    leash, shaped_rewards, group_advantages, policy_loss, leashed_loss)
from mlx_llm.post import bandit, estimator, prologue
from mlx_llm.post import pairs as pairs_lib
from mlx_llm.post import ppo
from mlx_llm.data import tasks as tasks_lib
from mlx_llm.post.reward import load_reward_model
from mlx_llm.eval.replies import REPLY_TOKENS, eval_task, sample_replies
from mlx_llm.runs.configs import EstimatorConfig, RLConfig, check_group  # noqa: F401
from mlx_llm.runs.load import trainable_tree
from mlx_llm.data.text import epoch_order
from mlx_llm.train.metrics import write_summary
from mlx_llm.train.preflight import compiled_update
from mlx_llm.train.step import moe_offsets


def train_bandit(pi_ref, rewards, beta, *, k: int = 16, steps: int = 4000, lr: float = 0.05, seed: int = 0):
    """On-policy RL on a finite bandit (one-token replies, ``bandit.one_token_bandit``) with the group trainer's
    estimator (k1-shaped reward, leave-one-out advantages) through the trainer's update, logits θ (π_θ = softmax
    θ, starting at π_ref), k samples per step, the learning rate decayed to 0 by a cosine. Returns π_θ after every
    step, (steps, n)."""
    s = EstimatorConfig(k=k, beta=beta)
    b = bandit.one_token_bandit(len(pi_ref))
    return bandit.train(b, jnp.log(jnp.asarray(pi_ref)), rewards, s, steps=steps, lr=lr, seeds=(seed,))[0]


# ----- in a language model ------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=16)  # one function per setting: its jitted update compiles once
def make_objective(cfg, s: EstimatorConfig, lora_cfg, kernels=None, remat: str = "none"):
    """``train.step.make_update``'s objective of the estimator ``s`` for a language model: (trainable, frozen,
    update batch, key) → (Σ loss, (count, the policy's expert loads, summed terms)); the forward gives the log-
    probability of every token (and ppo's values) through the execution paths ``kernels``."""

    def forward(trainable, frozen, batch):
        model, head = (trainable["policy"], trainable["value_head"]) if s.algorithm == "ppo" else (trainable, None)
        policy = prologue.policy_params(model, frozen, lora_cfg)
        return ppo.token_logprobs_and_values(policy, head, cfg, batch, kernels, remat=remat)

    return estimator.make_objective(s, forward)


@functools.lru_cache(maxsize=16)
def make_scorer(cfg, s: EstimatorConfig, lora_cfg, kernels=None):
    """The jitted rollout scoring: (trainable, frozen, sampled batch) → (the update's batch, the rollout's
    metrics) by ``estimator.rollout``, from the trainer's log π_old (and ppo's values) and log π_ref of every
    token through the execution paths ``kernels`` the update uses."""

    def score(trainable, frozen, batch):
        model, head = (trainable["policy"], trainable["value_head"]) if s.algorithm == "ppo" else (trainable, None)
        policy = prologue.policy_params(model, frozen, lora_cfg)
        logp, values, _ = ppo.token_logprobs_and_values(policy, head, cfg, batch, kernels)
        ref, _, _ = ppo.token_logprobs_and_values(frozen["reference"], None, cfg, batch, kernels)
        out, metrics = estimator.rollout(s, batch["reward"], logp, ref, batch["logq"], batch["target"][:, 1:],
                                         values, batch["keep"] if s.dynamic_sampling else None)
        return {"ids": batch["ids"], **out}, metrics

    return jax.jit(score)


def reply_sequences(prompt_ids, replies, width: int, pad_id: int) -> dict:
    """Prompt ids followed by the sampled reply ids, the reply flagged as the response (``pad_sequences``)."""
    return pairs_lib.pad_sequences([(np.concatenate([p, r[0]]), np.r_[np.zeros(len(p)), np.ones(len(r[0]))])
                                    for p, r in zip(prompt_ids, replies)], width, pad_id)


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
    from the current policy drawn by the engine with the settings' temperature, top-k and top-p (seeded by (seed,
    step)), their sequences, rewards and the engine's log q of every reply token. With dynamic sampling, groups
    whose rewards are all equal are replaced by groups of more prompts (up to ``sampling_rounds`` rounds, each
    seeded by (seed, step, round)); groups still equal stay in the batch with ``keep`` 0."""

    def __init__(self, base: prologue.Base, tcfg: TrainConfig, s: RLConfig, frozen, lora_cfg, *, reward_model=None,
                 max_new_tokens=None):
        self.base, self.tcfg, self.s, self.frozen, self.lora_cfg = base, tcfg, s, frozen, lora_cfg
        self.task, self.k = s.task, s.k
        self.examples = tasks_lib.examples(s.task, "train", n=s.n_train, seed=tcfg.batch_seed)
        self.reward_model = reward_model
        vocab = base.cfg.vocab_size
        if s.top_k is not None and s.top_k > vocab:  # up front: the decoder refused it only after compiling
            raise ConfigError(f"top_k = {s.top_k} is larger than the base model's vocabulary (V = {vocab}): give "
                              f"1 … {vocab}, or leave --top-k unset for no cut")
        self.max_new = max_new_tokens or REPLY_TOKENS[s.task]
        self.prompts = [base.template.encode(tasks_lib.prompt_messages(e), base.tok, generation_prompt=True)[0]
                        for e in self.examples]
        longest = max(len(p) for p in self.prompts) + self.max_new
        if longest > tcfg.seq_len:
            raise ConfigError(f"{s.task} prompts + {self.max_new} reply tokens need seq_len ≥ {longest}, got "
                              f"{tcfg.seq_len}")
        self.width = pairs_lib.batch_width(longest, tcfg.seq_len)

    def example_batch(self) -> dict:
        """A sampled batch of this sampler's shapes and dtypes (empty replies)."""
        n = self.tcfg.batch_size * self.k
        seqs = reply_sequences([self.prompts[0]] * n, [(np.zeros(0, np.int64), "")] * n, self.width,
                               self.base.tok.pad_id)
        zeros = np.zeros(n, np.float32)
        return {"ids": seqs["ids"], "target": seqs["target"], "reward": zeros, "keep": zeros,
                "logq": np.zeros((n, self.width - 1), np.float32)}

    def _round(self, params, prompts, seed: int) -> dict:
        """k replies to each prompt index of ``prompts``: their rows (prompt index, reply ids, text, log q), the
        checker's verdicts and the rewards."""
        base, idx = self.base, np.repeat(prompts, self.k)
        # a group's k replies are one request with n = k: the engine computes its prompt once
        replies = sample_replies(params, base.cfg, base.tok, base.template,
                                 [tasks_lib.prompt_messages(self.examples[i]) for i in prompts], self.max_new,
                                 temperature=self.s.temperature, top_k=self.s.top_k, top_p=self.s.top_p, seed=seed,
                                 batch_size=len(idx), with_logq=True, n=self.k)
        correct = np.array([tasks_lib.check(self.task, text, self.examples[i]["answer"])
                            for i, (_, text, _) in zip(idx, replies)], np.float32)
        reward = correct
        if self.reward_model is not None:
            seqs = reply_sequences([self.prompts[i] for i in idx], replies, self.width, base.tok.pad_id)
            reward = np.asarray(self.reward_model.score(seqs), np.float32)
        return {"idx": idx, "replies": replies, "correct": correct, "reward": reward}

    def __call__(self, step: int, trainable):
        s, k, p = self.s, self.k, self.tcfg.batch_size
        params = prologue.policy_params(trainable, self.frozen, self.lora_cfg)
        seed = int(np.random.default_rng([self.tcfg.seed, step, 11]).integers(2**31))
        first = self._round(params, epoch_order(step, p, len(self.examples), self.tcfg.batch_seed), seed)
        groups = [{name: value[g * k:(g + 1) * k] for name, value in first.items()} for g in range(p)]
        keep = [bool(np.ptp(g["reward"]) > 0) for g in groups]
        rounds = 1
        while s.dynamic_sampling and not all(keep) and rounds < s.sampling_rounds:
            rng = np.random.default_rng([self.tcfg.seed, step, 11, rounds])
            more = self._round(params, rng.integers(len(self.examples), size=p), int(rng.integers(2**31)))
            rounds += 1
            for g in range(p):
                group = {name: value[g * k:(g + 1) * k] for name, value in more.items()}
                if np.ptp(group["reward"]) > 0 and not all(keep):
                    slot = keep.index(False)
                    groups[slot], keep[slot] = group, True
        rows = {name: np.concatenate([g[name] for g in groups]) if name != "replies"
                else [r for g in groups for r in g[name]] for name in groups[0]}
        seqs = reply_sequences([self.prompts[i] for i in rows["idx"]], rows["replies"], self.width,
                               self.base.tok.pad_id)
        logq = np.zeros((len(rows["idx"]), self.width - 1), np.float32)
        for row, (i, (ids, _, lq)) in enumerate(zip(rows["idx"], rows["replies"])):
            start = len(self.prompts[i]) - 1  # position t of (W − 1) predicts ids[t + 1]
            logq[row, start:start + len(ids)] = lq
        host = {"reward": float(first["reward"].mean()), "accuracy": float(first["correct"].mean()),
                "response_length": float(np.mean([len(r[0]) for r in first["replies"]]))}
        if s.dynamic_sampling:
            host.update(kept_groups=float(np.mean(keep)), sampling_rounds=float(rounds))
        return {"ids": seqs["ids"], "target": seqs["target"], "reward": rows["reward"].astype(np.float32),
                "keep": np.repeat(np.asarray(keep, np.float32), k), "logq": logq}, host


def rollout_batch(sampler: Sampler, scorer, step: int, trainable):
    """A step's batch: the sampler's rollout from the current policy, scored (``make_scorer``) into the update's
    batch; host metrics: the sampler's and the rollout's (kl, is_ratio_mean, is_ratio_max, logprob_gap, …)."""
    policy = trainable["policy"] if sampler.s.algorithm == "ppo" else trainable
    sampled, host = sampler(step, policy)
    scored, metrics = scorer(trainable, sampler.frozen, jax.tree.map(jnp.asarray, sampled))
    return jax.tree.map(np.asarray, scored), {**host, **{name: float(v) for name, v in metrics.items()}}


def example_batch(sampler: Sampler, s: EstimatorConfig) -> dict:
    """An update batch of the sampler's shapes and dtypes, for compiling the update ahead of time."""
    ids = sampler.example_batch()["ids"]
    per_token = np.zeros((ids.shape[0], ids.shape[1] - 1), np.float32)
    names = estimator.BATCH_KEYS + (estimator.PPO_KEYS if s.algorithm == "ppo" else ())
    return {"ids": ids, **{name: per_token for name in names}}


def describe(s: EstimatorConfig) -> str:
    """One line of the estimator's settings, for the run's log."""
    kl = "no KL" if s.kl == "none" else f"KL {s.kl}, β = {s.beta:g}"
    parts = [s.algorithm, kl, f"loss {s.loss_aggregation}"]
    if s.clipped:
        parts.append(f"clip [1 − {s.clip_low:g}, 1 + {s.clip_high:g}], epochs × minibatches per rollout "
                     f"{s.epochs} × {s.minibatches}")
    if s.algorithm == "ppo":
        parts.append(f"λ = {s.gae_lambda:g}")
    if s.dynamic_sampling:
        parts.append(f"dynamic sampling ({s.sampling_rounds} rounds)")
    parts.append(f"sampler τ = {s.temperature:g}" + (f", top-k {s.top_k}" if s.top_k else "")
                 + (f", top-p {s.top_p:g}" if s.top_p else ""))
    if s.importance != "none":
        parts.append(f"{s.importance} per {s.is_level}, C = {s.is_cap:g}")
    return "; ".join(parts)


def rl_run(run_dir, base_run=None, *, tcfg: TrainConfig | None = None, settings: RLConfig | None = None,
           lora_cfg: LoRAConfig | None = None, resume=False, changes: dict | None = None,
           from_step: int | None = None, show_progress: bool = True, max_seconds: float | None = None,
           log=print, options=None) -> dict:
    """KL-leashed on-policy RL from ``base_run`` on ``settings.task`` (``tcfg.batch_size`` prompts × ``k`` replies
    per step), rewarded by the task's checker or by ``settings.reward_model`` (a reward run with the policy's
    tokenizer); the reference is the base unless ``settings.reference`` names another run. The estimator is
    ``settings``' (post/estimator.py; ppo's value head in post/ppo.py), one compiled update per step making
    ``epochs`` × ``minibatches`` optimizer updates for the clipped algorithms. Held-out exact match before and
    after. On resume everything is read back from the run (``changes``, ``from_step``: ``prologue.start``)."""
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
    sampler = Sampler(base, tcfg, s, frozen, lora_cfg, reward_model=rm)
    epochs, minibatches = (s.epochs, s.minibatches) if s.clipped else (1, 1)
    if s.clipped:
        ppo.check_rollout_split(tcfg.batch_size * s.k, s, tcfg.grad_accum)
    est, kernels = s.estimator(), tcfg.kernels(resolve=True)
    trainable = trainable_tree(s, prologue.initial_trainable(base, lora_cfg, tcfg.params_seed), base.cfg.d_model)
    model_key = s.trainable_layout()[0]
    update = compiled_update(base.cfg, st.schedule_tcfg, make_objective(base.cfg, est, lora_cfg, kernels, tcfg.remat),
                             trainable, frozen, example_batch(sampler, est),
                             offsets=None if lora_cfg else moe_offsets(base.cfg, (model_key,) if model_key else ()),
                             count_name="reply_tokens" if s.loss_aggregation == "token" else "replies",
                             epochs=epochs, minibatches=minibatches)
    scorer = make_scorer(base.cfg, est, lora_cfg, kernels)
    before = None if st.resume is not None else eval_task(base.params, base.cfg, base.tok, s.task, base.template,
                                               n=s.eval_examples)
    with st.writing():  # the run's lock, held to the end of the run
        log(f"rl from {base.run} (step {base.step}) on {s.task}: {tcfg.batch_size} prompts × {s.k} replies per "
            f"step, reward from {'the checker' if rm is None else rm.run}; {'LoRA' if lora_cfg else 'full'}; "
            f"{describe(s)}")

        def evaluate(trainable):
            model = trainable[model_key] if model_key else trainable
            params = prologue.policy_params(model, frozen, lora_cfg)
            return {"heldout_accuracy": eval_task(params, base.cfg, base.tok, s.task, base.template,
                                                  n=s.eval_examples)["accuracy"]}

        out = st.fit(trainable, frozen, update, lambda step, t: rollout_batch(sampler, scorer, step, t), evaluate,
                     show_progress=show_progress, max_seconds=max_seconds, log=log, on_policy=True,
                     options=options)
        summary = {**out["summary"],
                   **{key: out["last"].get(key) for key in ("reward", "accuracy", "kl", "response_length")}}
        if before is not None:
            summary["base_heldout_accuracy"] = before["accuracy"]
        return write_summary(st.run_dir, summary)
