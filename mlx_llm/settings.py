"""What every config dataclass shares: JSON round trip with named errors (``JsonConfig``), documented fields
(``setting``: the documentation is also the CLI flag's help text), and writing files atomically under the
process's umask. Plain Python: the configs and the command line import no jax."""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
from pathlib import Path
from typing import Any

from mlx_llm.errors import ConfigError


def setting(default: Any, help: str, **meta) -> Any:
    """A config field with its documentation, which is also its CLI flag's help text (mlx_llm/cli), and CLI
    hints: ``choices``, ``metavar``, ``flag`` (the flag's name when it is not the field's), ``path=True`` (given
    relative, stored absolute), ``show_default=False``, ``cli=False`` (no flag), ``nargs`` (argparse's: the flag
    takes several values)."""
    return dataclasses.field(default=default, metadata={"help": help, **meta})


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


def check_int(name: str, value, minimum: int, *, optional: bool = False, maximum: int | None = None,
              reason: str | None = None) -> int | None:
    """The one integer check of the configs: ``value`` an integer (not a bool) in [minimum, maximum] (or None when
    ``optional``), else a ``ConfigError`` naming ``name``, the value and what is valid (``reason``: the words
    after "is invalid:", when the bound has a reason of its own)."""
    if value is None and optional:
        return None
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= minimum
    if not ok or (maximum is not None and value > maximum):
        what = reason or (f"it must be an integer >= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")
                          + (" (or unset)" if optional else ""))
        raise ConfigError(f"{name} = {value!r} is invalid: {what}")
    return int(value)


def check_number(name: str, value, *, low: float, positive: bool = False, high: float | None = None,
                 high_open: bool = False) -> float:
    """The one real-number check of the configs: ``value`` a finite number (not a bool) ≥ ``low`` (> ``low`` when
    ``positive``) and, given ``high``, ≤ ``high`` (< when ``high_open``), else a ``ConfigError`` naming ``name``,
    the value and what is valid. Returns it as a float."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if not (ok and (value > low if positive else value >= low)):
        raise ConfigError(f"{name} = {value!r} is invalid: it must be a finite number {'>' if positive else '>='} "
                          f"{low:g}")
    if high is not None and not (value < high if high_open else value <= high):
        raise ConfigError(f"{name} = {value!r} is invalid: it must be in {'(' if positive else '['}{low:g}, {high:g}"
                          f"{')' if high_open else ']'}")
    return float(value)


def umask_mode() -> int:
    """The mode a new file gets from the process's umask (0o666 & ~umask): for files written through a
    temporary (``tempfile.mkstemp``, safetensors) that would otherwise be private (0o600)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def write_json_atomic(path: str | os.PathLike, data: Any) -> None:
    path = Path(path)
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write a text file atomically (a crash never leaves half a file)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
