"""The validated settings of each run kind, stored whole in the run record (``run.json``) and read back on resume.

Every field is documented in its ``metadata["help"]`` (``config.setting``): the CLI builds its flags from these
fields (mlx_llm/cli), so a flag and its field cannot drift apart. Paths are stored absolute (``--data`` too, as
``data_path`` writes it), so a resume from another directory finds the same files; a pretraining run's data also
records its fingerprint (``DataSpec.fingerprint``), so the files themselves are checked, not their spelling.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from mlx_llm.config import PARAM_COUNTS, JsonConfig, setting
from mlx_llm.settings import check_int, check_number
from mlx_llm.errors import ConfigError
from mlx_llm.data.tasks import TASKS
from mlx_llm.data.text import DEFAULT_EXTENSIONS, DEFAULT_VAL_PERCENT
from mlx_llm.data.encoding import default_cache_dir
from mlx_llm.data.mixture import parse_sources
from mlx_llm.train.trackers import check_trackers

TOKENIZERS = ("bpe", "byte")
DEFAULT_VOCAB = 1024  # the main job's BPE vocabulary (recipes.MAIN_JOB_VOCAB)


def _absolute(path) -> str | None:
    return None if path is None else str(Path(path).resolve())


def data_path(path) -> str | None:
    """``--data PATH`` as a run records it: absolute (``~`` expanded, ``.`` and ``..`` folded), from the working
    directory when relative; links are not followed, so a file keeps the name it was given (names decide the
    split of record files and globs). None (the standard library) stays None."""
    return None if path is None else os.path.abspath(os.path.expanduser(str(path)))


def _check_int(owner, name: str, minimum: int, *, optional: bool = False) -> None:
    check_int(f"{type(owner).__name__}.{name}", getattr(owner, name), minimum, optional=optional)


def _check_number(owner, name: str, *, low: float, positive: bool = False) -> float:
    value = check_number(f"{type(owner).__name__}.{name}", getattr(owner, name), low=low, positive=positive)
    object.__setattr__(owner, name, value)
    return value


def _check_task(owner, *, required: bool, data: str | None = None) -> None:
    """``task`` is a known task; with ``data`` (what a data file holds), exactly one of the file and the task."""
    if owner.task is not None and owner.task not in TASKS:
        raise ConfigError(f"{type(owner).__name__}.task = {owner.task!r} is invalid: valid tasks are {list(TASKS)}")
    if data is not None and (owner.task is None) == (owner.data is None):
        raise ConfigError(f"give exactly one of a {data} file (--data FILE.jsonl) and a task (--task NAME: "
                          f"{list(TASKS)}); got data = {owner.data!r}, task = {owner.task!r}")
    if required and owner.task is None:
        raise ConfigError(f"{type(owner).__name__}.task is required: one of {list(TASKS)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataSpec(JsonConfig):
    """Where the pretraining text comes from and how it is tokenised."""

    path: str | None = setting(None, "a text file, a directory (recursive) or a glob; .jsonl/.jsonl.gz/.parquet "
                               "records or a dataset saved by datasets (--text-field); .bin/.npy token ids "
                               "(--vocab-size V); or a mixture: NAME=PATH[:WEIGHT] ... or a mixture .json "
                               "(default: the Python standard library)", flag="data", nargs="+",
                               metavar="PATH")
    mixture: tuple[str, ...] = setting((), "a mixture's sources, NAME=PATH:WEIGHT each (data/mixture.py); set by "
                                       "--data NAME=PATH[:WEIGHT] ...", cli=False)
    extensions: tuple[str, ...] = setting(DEFAULT_EXTENSIONS, "file extensions read from a directory, "
                                          "comma-separated")
    val_percent: float = setting(DEFAULT_VAL_PERCENT, "share of files held out for validation, in percent")
    tokenizer: str = setting("bpe", "bpe (trained on the train split), byte (UTF-8 bytes), or a tokenizer to use "
                             "as it is: a tokenizer.json file or a Hugging Face tokenizer directory (what token "
                             "ids in .bin/.npy shards were made with: the run then samples text and reports bits "
                             "per byte)", metavar="bpe|byte|PATH")
    vocab_size: int = setting(DEFAULT_VOCAB, "BPE vocabulary size (special tokens included); for .bin/.npy token "
                              "ids without --tokenizer, the model's vocabulary (above every id)")
    text_field: str = setting("text", "the field holding each record's text in JSONL, parquet and saved HF datasets")
    fingerprint: str | None = setting(None, "SHA-256 of the files the data reads, taken when the run started "
                                      "(data.corpora.data_identity): a resume, eval and compare check it; unset in "
                                      "records written before it was kept", cli=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", data_path(self.path))
        if self.fingerprint is not None and not (isinstance(self.fingerprint, str)
                                                 and re.fullmatch(r"[0-9a-f]{64}", self.fingerprint)):
            raise ConfigError(f"DataSpec.fingerprint = {self.fingerprint!r} is invalid: it is a SHA-256 in hex (64 "
                              f"digits) written by the run, or unset")
        mixture = (self.mixture,) if isinstance(self.mixture, str) else tuple(self.mixture)
        object.__setattr__(self, "mixture", tuple(s.spec() for s in parse_sources(mixture)))
        if self.mixture and self.path is not None:
            raise ConfigError(f"DataSpec: give either a path ({self.path!r}) or a mixture of sources, not both")
        exts = (self.extensions.split(",") if isinstance(self.extensions, str) else list(self.extensions))
        exts = tuple(e if e.startswith(".") else "." + e for e in (e.strip() for e in exts) if e)
        if not exts:
            raise ConfigError(f"DataSpec.extensions = {self.extensions!r} is invalid: give at least one, e.g. .py,.txt")
        object.__setattr__(self, "extensions", exts)
        value = _check_number(self, "val_percent", low=0.0, positive=True)
        if value >= 100:
            raise ConfigError(f"DataSpec.val_percent = {value!r} is invalid: it must be in (0, 100)")
        path_like = isinstance(self.tokenizer, str) and ("/" in self.tokenizer or self.tokenizer.endswith(".json"))
        if not isinstance(self.tokenizer, str) or not (self.tokenizer in TOKENIZERS or path_like):
            raise ConfigError(f"DataSpec.tokenizer = {self.tokenizer!r} is invalid: valid tokenizers are "
                              f"{list(TOKENIZERS)}, or a path: a tokenizer .json file or a Hugging Face tokenizer "
                              f"directory (./NAME for one here)")
        if self.tokenizer not in TOKENIZERS:
            object.__setattr__(self, "tokenizer", _absolute(self.tokenizer))
        _check_int(self, "vocab_size", 1)
        if not isinstance(self.text_field, str) or not self.text_field:
            raise ConfigError(f"DataSpec.text_field = {self.text_field!r} is invalid: give a field name such as 'text'")

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "extensions": list(self.extensions), "mixture": list(self.mixture)}

    @property
    def sources(self):
        """The mixture's ``mixture.Source``s (empty for a single source)."""
        return parse_sources(self.mixture)


class KindSettings(JsonConfig):
    """A run kind's settings; ``trainable_layout`` declares what its checkpoints hold, so the one loader reads every
    kind without knowing any (runs/load.py)."""

    def trainable_layout(self) -> tuple[str | None, tuple[str, ...]]:
        """(the key of the model (or its LoRA adapters) in the run's trainable tree, None when the tree is the
        model itself; the heads trained beside it, each declared in ``layers.layout.HEADS``)."""
        return None, ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTConfig(KindSettings):
    """Supervised fine-tuning on conversations (M20 §16, U19 §9)."""

    data: str | None = setting(None, 'conversations, JSONL ({"messages": [...]} per line)', metavar="FILE.jsonl", path=True)
    task: str | None = setting(None, "a built-in task (mlx_llm.data.tasks)", choices=TASKS)
    n_train: int | None = setting(None, "cap on the task's train examples", flag="train_examples")
    eval_examples: int | None = setting(200, "held-out task examples scored before and after (unset: all)")

    def __post_init__(self) -> None:
        object.__setattr__(self, "data", _absolute(self.data))
        _check_task(self, required=False, data="data")
        _check_int(self, "n_train", 1, optional=True)
        _check_int(self, "eval_examples", 1, optional=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardConfig(KindSettings):
    """A Bradley–Terry reward model on preference pairs (U19 §11)."""

    data: str | None = setting(None, 'pairs, JSONL ({"prompt": [...], "chosen": {...}, "rejected": {...}} per '
                               'line)', metavar="FILE.jsonl", path=True)
    task: str | None = setting(None, "pairs built from a task (correct vs corrupted answers)", choices=TASKS)
    n_train: int | None = setting(None, "cap on the task's train examples", flag="train_examples")
    model_negatives: bool = setting(False, "with a task, add the base model's own wrong samples as rejected "
                                    "replies")

    def __post_init__(self) -> None:
        object.__setattr__(self, "data", _absolute(self.data))
        _check_task(self, required=False, data="pair")
        _check_int(self, "n_train", 1, optional=True)
        if not isinstance(self.model_negatives, bool):
            raise ConfigError(f"{type(self).__name__}.model_negatives = {self.model_negatives!r} must be true or false")

    def trainable_layout(self) -> tuple[str | None, tuple[str, ...]]:
        return "model", ("reward_head",)  # the trunk and r = w · R_last (post/reward.py)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DPOConfig(RewardConfig):
    """Direct preference optimisation (M20 §16, U19 §13)."""

    beta: float = setting(0.1, "β of the KL leash to the reference (> 0)")
    reference: str | None = setting(None, "the frozen reference run (default: the base)", metavar="RUN",
                                 path=True)
    nll_weight: float = setting(0.0, "α of an added chosen-reply NLL term (RPO; 0: pure DPO)")
    eval_examples: int | None = setting(200, "held-out task examples scored before and after (unset: all)")

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "reference", _absolute(self.reference))
        _check_number(self, "beta", low=0.0, positive=True)
        _check_number(self, "nll_weight", low=0.0)
        _check_int(self, "eval_examples", 1, optional=True)

    def trainable_layout(self) -> tuple[str | None, tuple[str, ...]]:
        return None, ()  # the policy alone (the reference is frozen)


def check_group(k, algorithm: str = "group", name: str = "k") -> int:
    """Replies per prompt: a group baseline compares each reply with the other replies to its prompt (k ≥ 2);
    PPO's value head needs none (k ≥ 1)."""
    if algorithm != "ppo":
        return check_int(name, k, 2, reason="group-relative advantages compare each reply with the other replies "
                                             "to its prompt, so k must be an integer ≥ 2")
    return check_int(name, k, 1, reason="k must be a positive integer")


def _defaults(**fields) -> dict:
    """A clipped algorithm's defaults: one update per rollout unless it says otherwise, no dynamic sampling."""
    return {"dynamic_sampling": False, "epochs": 1, "minibatches": 1, **fields}


# What each algorithm runs when a setting is not given: each paper's recipe as docs/post-training.md cites it.
# A setting outside an algorithm's entry is one it cannot honour (refused by name), except those of every
# algorithm (``EstimatorConfig.COMMON``).
RL_DEFAULTS = {
    "group": dict(kl="reward-k1", loss_aggregation="seq-mean-token-sum", dynamic_sampling=False),
    "grpo": _defaults(kl="loss-k3", clip_low=0.2, clip_high=0.2, loss_aggregation="sequence"),
    "dr_grpo": _defaults(kl="none", clip_low=0.2, clip_high=0.2, loss_aggregation="seq-mean-token-sum"),
    "dapo": _defaults(kl="none", clip_low=0.2, clip_high=0.28, loss_aggregation="token", dynamic_sampling=True),
    "gspo": _defaults(kl="none", clip_low=3e-4, clip_high=4e-4, loss_aggregation="sequence"),
    # Schulman et al. 2017; γ = 1 over a reply, the usual choice for language models
    "ppo": _defaults(kl="reward-k1", clip_low=0.2, clip_high=0.2, epochs=4, minibatches=4, value_coef=0.5,
                     value_clip=0.2, gae_lambda=0.95, loss_aggregation="token"),
}
RL_ALGORITHMS = tuple(RL_DEFAULTS)
CLIPPED = tuple(a for a in RL_ALGORITHMS if "clip_low" in RL_DEFAULTS[a])
KL_PLACEMENTS = ("reward-k1", "loss-k1", "loss-k2", "loss-k3", "none")
LOSS_AGGREGATIONS = ("token", "sequence", "seq-mean-token-sum")
IMPORTANCE = ("none", "tis", "mis")
IS_LEVELS = ("token", "sequence")
DEFAULT_BETA, DEFAULT_IS_CAP, DEFAULT_SAMPLING_ROUNDS = 0.05, 2.0, 3


@dataclasses.dataclass(frozen=True, kw_only=True)
class EstimatorConfig(KindSettings):
    """The policy-gradient estimator of on-policy RL (post/estimator.py) and its rollouts' sampler: the algorithm,
    where the KL to the reference sits, the clip, the loss aggregation, dynamic sampling, several updates per
    rollout, importance weights. Unset fields take the algorithm's defaults (``RL_DEFAULTS``); a setting the
    algorithm cannot honour is refused by name. ``RLConfig`` adds the task and the run's other settings; the
    tabular bandits (post/bandit.py) take this alone."""

    algorithm: str = setting("group", "the estimator: group (REINFORCE, leave-one-out baseline over each prompt's "
                             "k replies), grpo (group-mean baseline / std, clipped token ratio; Shao et al. 2024), "
                             "dr_grpo (no std, no 1/|y|; Liu et al. 2025), dapo (clip-higher, token-level loss, "
                             "dynamic sampling; Yu et al. 2025), gspo (sequence-level ratio; Zheng et al. 2025) or "
                             "ppo (a value head, GAE; Schulman et al. 2017)", choices=RL_ALGORITHMS)
    k: int = setting(8, "replies sampled per prompt (>= 2; ppo: >= 1)")
    beta: float | None = setting(None, f"β of the KL to the reference, > 0 (default {DEFAULT_BETA}; not with --kl "
                                 "none)", show_default=False)
    kl: str | None = setting(None, "where the KL to the reference sits: reward-k1 (Σ_t log π/π_ref subtracted from "
                             "the reward), loss-k1 / loss-k2 / loss-k3 (Schulman's estimator per token in the loss) "
                             "or none (default: the algorithm's: group and ppo reward-k1, grpo loss-k3, the others "
                             "none)", choices=KL_PLACEMENTS, show_default=False)
    clip: float | None = setting(None, "clipped algorithms: ε of the ratio's clip 1 ± ε, in (0, 1) (default 0.2; "
                                 "dapo 0.2/0.28, gspo 3e-4/4e-4 as --clip-low/--clip-high)", show_default=False)
    clip_low: float | None = setting(None, "clipped algorithms: ε_low of the clip's lower side 1 − ε_low, in (0, 1)",
                                     show_default=False)
    clip_high: float | None = setting(None, "clipped algorithms: ε_high of the clip's upper side 1 + ε_high, > 0",
                                      show_default=False)
    epochs: int | None = setting(None, "clipped algorithms: passes over each rollout (default 1; ppo 4)",
                                 show_default=False)
    minibatches: int | None = setting(None, "clipped algorithms: minibatches per pass, splitting the rollout's "
                                      "prompts × k replies evenly (default 1; ppo 4)", show_default=False)
    loss_aggregation: str | None = setting(None, "how per-token terms make the loss: token (mean over the batch's "
                                           "reply tokens), sequence (each reply's token mean, averaged) or "
                                           "seq-mean-token-sum (each reply's token sum, averaged) (default: the "
                                           "algorithm's; gspo: sequence only)", choices=LOSS_AGGREGATIONS,
                                           show_default=False)
    dynamic_sampling: bool | None = setting(None, "group algorithms: drop groups whose rewards are all equal and "
                                            "refill the batch from more prompts (default: on for dapo)",
                                            show_default=False)
    sampling_rounds: int | None = setting(None, "with dynamic sampling: rounds of prompts sampled at most to fill "
                                          f"the batch (default {DEFAULT_SAMPLING_ROUNDS})", show_default=False)
    value_coef: float | None = setting(None, "ppo: weight of the value loss, >= 0 (default 0.5)", show_default=False)
    value_clip: float | None = setting(None, "ppo: how far an update may move a value from its rollout value, > 0 "
                                       "(default 0.2)", show_default=False)
    gae_lambda: float | None = setting(None, "ppo: λ of generalised advantage estimation, in [0, 1] (default "
                                       "0.95)", show_default=False)
    temperature: float = setting(1.0, "rollouts: the sampler's temperature (> 0)")
    top_k: int | None = setting(None, "rollouts: sample among the k most probable tokens (default: all)")
    top_p: float | None = setting(None, "rollouts: sample from the nucleus of mass p, in (0, 1] (default: all)")
    importance: str = setting("none", "weights correcting the sampler q to the trainer's π on every reply token: "
                              "none, tis (min(π/q, C)) or mis (π/q where ≤ C, else 0)", choices=IMPORTANCE)
    is_cap: float | None = setting(None, f"with --importance: the cap C, > 0 (default {DEFAULT_IS_CAP:g})",
                                   show_default=False)
    is_level: str | None = setting(None, "with --importance: per token (π/q of the token) or sequence (of the whole "
                                   "reply) (default token)", choices=IS_LEVELS, show_default=False)

    # settings every algorithm takes; the others are those of its RL_DEFAULTS entry
    COMMON = ("kl", "loss_aggregation", "dynamic_sampling")

    def __post_init__(self) -> None:
        name = type(self).__name__
        if self.algorithm not in RL_ALGORITHMS:
            raise ConfigError(f"{name}.algorithm = {self.algorithm!r} is invalid: valid algorithms are "
                              f"{list(RL_ALGORITHMS)}")
        check_group(self.k, self.algorithm, f"{name}.k")
        self._refuse_foreign()
        defaults = RL_DEFAULTS[self.algorithm]
        for field, value in defaults.items():
            if getattr(self, field) is None:
                object.__setattr__(self, field, value)
        self._check_kl()
        self._check_clip()
        _check_choice(self, "loss_aggregation", LOSS_AGGREGATIONS)
        if self.algorithm == "gspo" and self.loss_aggregation != "sequence":
            raise ConfigError(f"{name}.loss_aggregation = {self.loss_aggregation!r} cannot be honoured by gspo: its "
                              f"ratio is a reply's, so its loss is a mean over replies ('sequence')")
        if self.clipped:
            _check_int(self, "epochs", 1)
            _check_int(self, "minibatches", 1)
        if self.algorithm == "ppo":
            _check_number(self, "value_coef", low=0.0)
            _check_number(self, "value_clip", low=0.0, positive=True)
            object.__setattr__(self, "gae_lambda", check_number(f"{name}.gae_lambda", self.gae_lambda, low=0.0,
                                                                high=1.0))
        self._check_sampling()

    def _refuse_foreign(self) -> None:
        """Settings given that the algorithm cannot honour, named."""
        own = set(RL_DEFAULTS[self.algorithm]) | set(self.COMMON)
        if "clip_low" in own:
            own.add("clip")
        foreign = [f for f in ("clip", "clip_low", "clip_high", "epochs", "minibatches", "value_coef", "value_clip",
                               "gae_lambda") if getattr(self, f) is not None and f not in own]
        if foreign:
            which = ("the clipped algorithms " + str(list(CLIPPED)) if foreign[0] in RL_DEFAULTS["grpo"]
                     or foreign[0] == "clip" else "algorithm 'ppo' only")
            raise ConfigError(f"{type(self).__name__} {foreign} apply to {which}, not {self.algorithm!r}")
        sides = {f: getattr(self, f) for f in ("clip_low", "clip_high") if getattr(self, f) not in (None, self.clip)}
        if self.clip is not None and sides:
            raise ConfigError(f"{type(self).__name__}.clip = {self.clip!r} sets both sides of the clip, and {sides} "
                              f"too: give --clip, or --clip-low and --clip-high")
        if self.dynamic_sampling and self.algorithm == "ppo":
            raise ConfigError(f"{type(self).__name__}.dynamic_sampling drops groups of equal rewards, and ppo has "
                              f"no groups (a value head is its baseline): not with algorithm 'ppo'")

    def _check_kl(self) -> None:
        name = type(self).__name__
        _check_choice(self, "kl", KL_PLACEMENTS)
        if self.kl == "none":
            if self.beta is not None:
                raise ConfigError(f"{name}.beta = {self.beta!r} weighs a KL term, and kl = 'none' has none: give "
                                  f"--kl reward-k1 / loss-k1 / loss-k2 / loss-k3, or no --beta")
            return
        if self.beta is None:
            object.__setattr__(self, "beta", DEFAULT_BETA)
        _check_number(self, "beta", low=0.0, positive=True)

    def _check_clip(self) -> None:
        if self.algorithm not in CLIPPED:
            return
        name = type(self).__name__
        if self.clip is not None:
            value = check_number(f"{name}.clip", self.clip, low=0.0, positive=True, high=1.0, high_open=True)
            for f in ("clip", "clip_low", "clip_high"):
                object.__setattr__(self, f, value)
        low = check_number(f"{name}.clip_low", self.clip_low, low=0.0, positive=True, high=1.0, high_open=True)
        high = check_number(f"{name}.clip_high", self.clip_high, low=0.0, positive=True)
        object.__setattr__(self, "clip_low", low)
        object.__setattr__(self, "clip_high", high)
        object.__setattr__(self, "clip", low if low == high else None)

    def _check_sampling(self) -> None:
        name = type(self).__name__
        if not isinstance(self.dynamic_sampling, bool):
            raise ConfigError(f"{name}.dynamic_sampling = {self.dynamic_sampling!r} must be true or false")
        if not self.dynamic_sampling and self.sampling_rounds is not None:
            raise ConfigError(f"{name}.sampling_rounds = {self.sampling_rounds!r} applies with dynamic sampling "
                              f"(--dynamic-sampling) only")
        if self.dynamic_sampling and self.sampling_rounds is None:
            object.__setattr__(self, "sampling_rounds", DEFAULT_SAMPLING_ROUNDS)
        _check_int(self, "sampling_rounds", 1, optional=True)
        _check_number(self, "temperature", low=0.0, positive=True)
        _check_int(self, "top_k", 1, optional=True)
        if self.top_p is not None:
            object.__setattr__(self, "top_p", check_number(f"{name}.top_p", self.top_p, low=0.0, positive=True,
                                                           high=1.0))
        _check_choice(self, "importance", IMPORTANCE)
        if self.importance == "none":
            given = [f for f in ("is_cap", "is_level") if getattr(self, f) is not None]
            if given:
                raise ConfigError(f"{name} {given} apply with --importance tis or mis, not 'none'")
            return
        for field, default in (("is_cap", DEFAULT_IS_CAP), ("is_level", "token")):
            if getattr(self, field) is None:
                object.__setattr__(self, field, default)
        _check_number(self, "is_cap", low=0.0, positive=True)
        _check_choice(self, "is_level", IS_LEVELS)

    @property
    def clipped(self) -> bool:
        return self.algorithm in CLIPPED

    def estimator(self) -> "EstimatorConfig":
        """These settings alone (an ``RLConfig``'s estimator, hashable: the compiled functions' key)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(EstimatorConfig)}
        return EstimatorConfig(**fields)


def _check_choice(owner, name: str, choices) -> None:
    value = getattr(owner, name)
    if value not in choices:
        raise ConfigError(f"{type(owner).__name__}.{name} = {value!r} is invalid: valid values are {list(choices)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLConfig(EstimatorConfig):
    """KL-leashed on-policy RL on a task (U19 §12): a group of replies per prompt, rewarded by the task's exact
    checker or a reward model, trained by the estimator of ``EstimatorConfig``."""

    task: str | None = setting(None, "a built-in task: prompts and the exact checker", choices=TASKS)
    n_train: int | None = setting(None, "cap on the task's train prompts", flag="train_examples")
    reward_model: str | None = setting(None, "a reward run scoring replies instead of the checker",
                                    metavar="RUN", path=True)
    reference: str | None = setting(None, "the frozen reference run (default: the base)", metavar="RUN",
                                 path=True)
    eval_examples: int | None = setting(200, "held-out task examples scored before and after (unset: all)")

    def __post_init__(self) -> None:
        _check_task(self, required=True)
        object.__setattr__(self, "reward_model", _absolute(self.reward_model))
        object.__setattr__(self, "reference", _absolute(self.reference))
        _check_int(self, "n_train", 1, optional=True)
        _check_int(self, "eval_examples", 1, optional=True)
        super().__post_init__()

    def trainable_layout(self) -> tuple[str | None, tuple[str, ...]]:
        return ("policy", ("value_head",)) if self.algorithm == "ppo" else (None, ())  # PPO: V_t = w · R_t


@dataclasses.dataclass(frozen=True, kw_only=True)
class NoSettings(KindSettings):
    """Run kinds with no settings of their own (pretraining: its data spec; merged and imported runs)."""


KIND_CONFIGS = {"pretrain": NoSettings, "sft": SFTConfig, "reward": RewardConfig, "dpo": DPOConfig,
                "rl": RLConfig, "merged": NoSettings, "imported": NoSettings}



@dataclasses.dataclass(frozen=True, kw_only=True)
class RunOptions(JsonConfig):
    """What a training run reports besides metrics.jsonl and how it runs, for every run kind (the loop,
    ``train.loop.fit``): trackers, profiler, HLO dump, time-based checkpoints, the compilation cache, trusting an
    unverified checkpoint. None of it changes a number, so a resume may give other values. Not stored in the run's
    configs."""

    tracker: tuple[str, ...] = setting((), "experiment trackers, comma-separated: tensorboard (event files in "
                                       "RUN/tb/), wandb (honours WANDB_MODE=offline); the same scalars as "
                                       "metrics.jsonl (default: none)", metavar="NAME,...", show_default=False)
    profile_steps: str | None = setting(None, "trace N steps from step START with jax.profiler into RUN/profile/ "
                                        "(TensorBoard's profile plugin or xprof open it)", metavar="START:N")
    dump_hlo: bool = setting(False, "write the compiled step's HLO text to RUN/hlo/")
    checkpoint_minutes: float | None = setting(None, "also write a checkpoint once M minutes have passed since the "
                                               "last one, beside the --checkpoint-interval ones (M > 0)",
                                               metavar="M")
    compilation_cache: str | None = setting(None, "jax's persistent compilation cache: a second start of the same "
                                            "run loads its compiled programs instead of compiling them again "
                                            "(default: ~/.cache/mlx_llm/jax; train: jax/ under --cache-dir when "
                                            "given; 'off': none)", metavar="DIR")
    trust_unverified: bool = setting(False, "restore a checkpoint that has no checksum manifest although the run "
                                     "writes one for every checkpoint (the manifest was deleted, or the run was "
                                     "killed before writing it); its files are not verified")

    def __post_init__(self) -> None:
        object.__setattr__(self, "tracker", check_trackers(self.tracker))  # installed, or refused naming the extra
        self.profile_range()
        for name in ("dump_hlo", "trust_unverified"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"RunOptions.{name} = {getattr(self, name)!r} must be true or false")
        if self.checkpoint_minutes is not None:
            _check_number(self, "checkpoint_minutes", low=0.0, positive=True)
        if self.compilation_cache is not None and not str(self.compilation_cache).strip():
            raise ConfigError("--compilation-cache '' is invalid: give a directory, or 'off'")

    def compilation_cache_dir(self, cache_dir=None) -> str | None:
        """The compilation cache's directory (absolute): ``compilation_cache``, else jax/ under ``cache_dir``
        (the token cache's directory, default ``~/.cache/mlx_llm``); None when 'off'."""
        if self.compilation_cache == "off":
            return None
        if self.compilation_cache is not None:
            return str(Path(self.compilation_cache).expanduser().resolve())
        return str(Path(cache_dir if cache_dir is not None else default_cache_dir()).expanduser().resolve() / "jax")

    def check_steps(self, steps: int) -> None:
        """The options fit a run of ``steps`` steps: a profiled window must lie within it."""
        window = self.profile_range()
        if window is not None and window[0] > steps:
            raise ConfigError(f"--profile-steps {self.profile_steps} starts after the run's last step ({steps}): "
                              f"give a window that starts at step {steps} or before")
        if window is not None and window[0] + window[1] - 1 > steps:
            raise ConfigError(f"--profile-steps {self.profile_steps} traces steps {window[0]}-{sum(window) - 1}, past "
                              f"the run's last step ({steps}): give at most {steps - window[0] + 1} steps from step "
                              f"{window[0]}")

    def profile_range(self) -> tuple[int, int] | None:
        """(first traced step, steps traced) of ``profile_steps``, 1-based steps as in metrics.jsonl; or None."""
        if self.profile_steps is None:
            return None
        start, sep, n = str(self.profile_steps).partition(":")
        if not (sep and start.strip().isdigit() and n.strip().isdigit() and int(start) >= 1 and int(n) >= 1):
            raise ConfigError(f"--profile-steps {self.profile_steps!r} is invalid: give START:N with START >= 1 the "
                              f"first step traced and N >= 1 steps, e.g. 3:2")
        return int(start), int(n)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sizing(JsonConfig):
    """A new pretraining run's steps from its compute (``scaling.accounting``) instead of ``--steps``: recorded in
    run.json (``RunRecord.sizing``) with the steps it gave."""

    target_flops: float | None = setting(None, "set the steps to spend C training FLOPs: C / (exact training "
                                         "FLOPs per token × tokens per step)", metavar="C")
    tokens_per_param: float | None = setting(None, "set the steps to read R tokens per parameter of "
                                             "--param-count (20: Chinchilla's ratio)", metavar="R")
    param_count: str = setting("non_embedding", "the N of --tokens-per-param: non_embedding, total or active",
                               choices=PARAM_COUNTS)

    def __post_init__(self) -> None:
        for name in ("target_flops", "tokens_per_param"):
            if getattr(self, name) is not None:
                _check_number(self, name, low=0.0, positive=True)
        if self.target_flops is not None and self.tokens_per_param is not None:
            raise ConfigError("give one of --target-flops and --tokens-per-param: each sets the steps")
        if self.param_count not in PARAM_COUNTS:
            raise ConfigError(f"Sizing.param_count = {self.param_count!r} is invalid: valid counts are "
                              f"{list(PARAM_COUNTS)}")

    @property
    def active(self) -> bool:
        return self.target_flops is not None or self.tokens_per_param is not None
