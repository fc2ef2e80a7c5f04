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


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
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
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"ModelConfig.{name} = {value!r} is invalid: it must be a positive integer")
        for name in ("rope_base", "rope_scale", "norm_eps"):
            value = getattr(self, name)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
            if not ok:
                raise ConfigError(f"ModelConfig.{name} = {value!r} is invalid: it must be a finite number > 0")
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
        # Floats given as ints in JSON are normalised so equal configs hash equally.
        for name in ("rope_base", "rope_scale", "norm_eps"):
            object.__setattr__(self, name, float(getattr(self, name)))

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

    # ----- JSON ----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "config") -> "ModelConfig":
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a JSON object of ModelConfig fields, got {type(data).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise ConfigError(f"{source}: unknown ModelConfig field(s) {unknown}; valid fields are {sorted(fields)}")
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
        missing = sorted(required - set(data))
        if missing:
            raise ConfigError(f"{source}: missing required ModelConfig field(s) {missing}")
        return cls(**data)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "ModelConfig":
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"model config file {str(path)!r} does not exist") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"model config file {str(path)!r} cannot be read: {exc}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"model config file {str(path)!r} is not valid JSON: {exc}") from None
        return cls.from_dict(data, source=str(path))

    def to_json(self, path: str | os.PathLike) -> None:
        """Write ``config.json`` atomically (a crash never leaves half a file)."""
        write_json_atomic(path, self.to_dict())


def write_json_atomic(path: str | os.PathLike, data: Any) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)
