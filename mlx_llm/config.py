"""Model configuration: one frozen, hashable dataclass, JSON round trip, validation, parameter count.

``ModelConfig`` is a static argument of every jitted function, so it must be hashable and immutable.
Validation runs in ``__post_init__``: an invalid config cannot exist.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

from mlx_llm.errors import ConfigError

_POSITIVE_INTS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_head", "d_ff", "max_seq_len")


def _require_int(cfg, name: str, *, minimum: int) -> None:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ConfigError(f"{type(cfg).__name__}.{name} = {value!r} is invalid: it must be {what}")


def _require_float(cfg, name: str, *, positive: bool = False, low: float | None = None,
                   high: float | None = None) -> None:
    """Finite number (optionally > 0, or in [low, high]); ints are normalised to float so equal configs hash
    equally whatever the JSON spelling."""
    value = getattr(cfg, name)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (not positive or value > 0) and (low is None or value >= low) and (high is None or value <= high)
    if not ok:
        what = "a finite number > 0" if positive else f"a finite number in [{low}, {high}]"
        raise ConfigError(f"{type(cfg).__name__}.{name} = {value!r} is invalid: it must be {what}")
    object.__setattr__(cfg, name, float(value))


class JsonConfig:
    """JSON round trip shared by the frozen config dataclasses; unknown or missing fields are named."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "config"):
        name = cls.__name__
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a JSON object of {name} fields, got {type(data).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise ConfigError(f"{source}: unknown {name} field(s) {unknown}; valid fields are {sorted(fields)}")
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
        missing = sorted(required - set(data))
        if missing:
            raise ConfigError(f"{source}: missing required {name} field(s) {missing}")
        return cls(**data)

    @classmethod
    def from_json(cls, path: str | os.PathLike):
        path = Path(path)
        what = f"{cls.__name__} file {str(path)!r}"
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"{what} does not exist") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{what} cannot be read: {exc}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{what} is not valid JSON: {exc}") from None
        return cls.from_dict(data, source=str(path))

    def to_json(self, path: str | os.PathLike) -> None:
        """Write the JSON file atomically (a crash never leaves half a file)."""
        write_json_atomic(path, self.to_dict())


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig(JsonConfig):
    """The dense MiniLLM of M20 §2: pre-RMSNorm, RoPE (rotate_half), GQA, SwiGLU, no biases.

    ``n_heads * d_head`` need not equal ``d_model`` (the generalisation of M20 §8's count).
    ``rope_scale`` multiplies every position before rotation (position interpolation, U19 §7):
    0.25 makes position 6000 act as 1500.
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_ff: int
    rope_base: float = 10000.0
    rope_scale: float = 1.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    max_seq_len: int

    def __post_init__(self) -> None:
        for name in _POSITIVE_INTS:
            _require_int(self, name, minimum=1)
        for name in ("rope_base", "rope_scale", "norm_eps"):
            _require_float(self, name, positive=True)
        if not isinstance(self.tie_embeddings, bool):
            raise ConfigError(f"ModelConfig.tie_embeddings = {self.tie_embeddings!r} is invalid: it must be true or false")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"ModelConfig.n_heads = {self.n_heads} is not divisible by n_kv_heads = {self.n_kv_heads}: "
                f"GQA needs an integer number of query heads per key/value head (valid n_kv_heads: "
                f"{[g for g in range(1, self.n_heads + 1) if self.n_heads % g == 0]})"
            )
        if self.d_head % 2:
            raise ConfigError(
                f"ModelConfig.d_head = {self.d_head} is odd: RoPE rotates coordinate pairs, so d_head must be even"
            )

    # ----- derived sizes -------------------------------------------------------------------------
    @property
    def q_per_kv(self) -> int:
        """Query heads per key/value head, h_q / h_kv (M20 §6)."""
        return self.n_heads // self.n_kv_heads

    def param_count(self) -> int:
        """Closed-form count of M20 §8, generalised to ``n_heads * d_head != d_model``.

        P = n_E·V·d + L·(2·d·h_q·d_h + 2·d·h_kv·d_h + 3·d·m + 2·d) + d, n_E = 1 tied, 2 untied.
        """
        d, L = self.d_model, self.n_layers
        n_e = 1 if self.tie_embeddings else 2
        per_block = 2 * d * self.n_heads * self.d_head + 2 * d * self.n_kv_heads * self.d_head + 3 * d * self.d_ff + 2 * d
        return n_e * self.vocab_size * d + L * per_block + d

    def non_embedding_param_count(self) -> int:
        """Parameters outside the embedding/unembedding tables (the N of scaling-law fits)."""
        n_e = 1 if self.tie_embeddings else 2
        return self.param_count() - n_e * self.vocab_size * self.d_model


def write_json_atomic(path: str | os.PathLike, data: Any) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


COMPUTE_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig(JsonConfig):
    """Everything the training loop needs besides the model (``train_config.json`` of a run).

    ``batch_size`` is sequences per optimizer step, split into ``grad_accum`` micro-batches; the loss is
    token-averaged over the whole step (M20 §10). ``lr`` is the peak of ``optim.warmup_cosine``.
    ``eval_tokens`` caps the validation targets scored per evaluation (0 = the whole split).
    """

    batch_size: int = 32
    seq_len: int = 256
    steps: int = 1000
    lr: float = 3e-3
    warmup_steps: int = 50
    final_lr_fraction: float = 0.1
    clip_norm: float = 1.0
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    grad_accum: int = 1
    eval_interval: int = 250
    eval_tokens: int = 0
    checkpoint_interval: int = 250
    keep_checkpoints: int = 2
    log_interval: int = 10
    seed: int = 0
    compute_dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("batch_size", "seq_len", "steps", "grad_accum", "eval_interval", "checkpoint_interval",
                     "keep_checkpoints", "log_interval"):
            _require_int(self, name, minimum=1)
        for name in ("warmup_steps", "eval_tokens", "seed"):
            _require_int(self, name, minimum=0)
        _require_float(self, "lr", positive=True)
        _require_float(self, "clip_norm", positive=True)
        _require_float(self, "final_lr_fraction", low=0.0, high=1.0)
        _require_float(self, "weight_decay", low=0.0, high=1.0)
        _require_float(self, "b1", low=0.0, high=0.999999)
        _require_float(self, "b2", low=0.0, high=0.999999)
        if self.warmup_steps > self.steps:
            raise ConfigError(f"TrainConfig.warmup_steps = {self.warmup_steps} is invalid: it must be <= steps = "
                              f"{self.steps}")
        if self.batch_size % self.grad_accum:
            raise ConfigError(f"TrainConfig.batch_size = {self.batch_size} is not divisible by grad_accum = "
                              f"{self.grad_accum}: each micro-batch must hold a whole number of sequences")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ConfigError(f"TrainConfig.compute_dtype = {self.compute_dtype!r} is invalid: valid values are "
                              f"{list(COMPUTE_DTYPES)}")
