"""What every config dataclass shares: JSON round trip with named errors (``JsonConfig``), documented fields
(``setting``: the documentation is also the CLI flag's help text), and writing files atomically under the
process's umask. Plain Python: the configs and the command line import no jax."""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import re
from pathlib import Path
from typing import Any

from mlx_llm.errors import ConfigError


MAX_JSON_BYTES = 512 << 20  # a JSON file read from outside (a large tokenizer.json is tens of MB)
MAX_INT_DIGITS = 100  # an integer in such a file (no field of any file we read needs more)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


class JsonProblem(ValueError):
    """Untrusted JSON that cannot be used: ``where`` (a file), ``line`` (when known) and ``detail`` (what is
    wrong); ``syntax`` is the parser's own complaint when the text is not JSON at all (callers word that case
    their way)."""

    def __init__(self, where: str, detail: str, line: int | None = None, syntax: str | None = None):
        super().__init__(f"{where}{'' if line is None else f':{line}'}: {detail}")
        self.where, self.detail, self.line, self.syntax = where, detail, line, syntax


def _line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, max(pos, 0)) + 1


def _deep_line(text: str, limit: int = 500) -> int:
    """The line where the nesting of ``text`` first exceeds ``limit`` (strings skipped)."""
    depth, stripped = 0, _STRING.sub('""', text)
    for m in re.finditer(r"[\[\]{}]", stripped):
        depth += 1 if m.group() in "[{" else -1
        if depth > limit:
            return _line_of(stripped, m.start())
    return 1


def _lone_surrogate(obj, path: str = "") -> str | None:
    """The path of the first string (or key) of ``obj`` holding a lone UTF-16 surrogate, else None."""
    stack = [(obj, path)]
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return where or "the top level"
        elif isinstance(value, dict):
            stack += [(k, f"{where}/{k!r} (a key)") for k in value] + [(v, f"{where}/{k}") for k, v in value.items()]
        elif isinstance(value, list):
            stack += [(v, f"{where}[{i}]") for i, v in enumerate(value)]
    return None


def parse_json(text: str, where: str) -> Any:
    """JSON from outside (a file or a line of one), parsed with bounded cost: invalid JSON, nesting deeper than
    Python's parser goes, an integer of more than ``MAX_INT_DIGITS`` digits and a string holding a lone surrogate
    (not Unicode text) each raise one ``JsonProblem`` line naming ``where`` and the line."""

    def parse_int(digits: str) -> int:
        if len(digits.lstrip("-")) > MAX_INT_DIGITS:
            raise JsonProblem(where, f"an integer of {len(digits):,} digits (at most {MAX_INT_DIGITS} are read)",
                              _line_of(text, text.find(digits)))
        return int(digits)

    try:
        obj = json.loads(text, parse_int=parse_int)
    except json.JSONDecodeError as err:
        syntax = f"{err.msg}: line {err.lineno} column {err.colno} (char {err.pos})"
        raise JsonProblem(where, f"not valid JSON ({syntax})", err.lineno, syntax) from None
    except RecursionError:
        raise JsonProblem(where, "nested too deeply (the JSON files read here are a few levels deep)",
                          _deep_line(text)) from None
    if _SURROGATE_ESCAPE.search(text):
        bad = _lone_surrogate(obj)
        if bad is not None:
            raise JsonProblem(where, f"the string at {bad} holds a lone UTF-16 surrogate (\\ud800-\\udfff without its "
                                     f"pair): it is not Unicode text")
    return obj


def file_inside(directory: str | os.PathLike, name, what: str, error: type[Exception] = ConfigError) -> Path:
    """``directory / name`` for a file name that came from outside (an index file's shard, a fixed name in a
    downloaded directory): it must resolve, links followed, inside ``directory``; a name that is absolute, climbs
    out with ``..`` or is a link leading out raises ``error`` naming it and ``what`` named it. The file need not
    exist (callers check)."""
    if not isinstance(name, str) or not name:
        raise error(f"{what} names {name!r}, not a file name")
    root, path = Path(directory).resolve(), (Path(directory) / name).resolve()
    if Path(name).is_absolute() or not path.is_relative_to(root):
        raise error(f"{what} names {name!r}, which is outside {directory}: a checkpoint directory's files must lie "
                    f"inside it")
    return path


def load_json(path: str | os.PathLike, what: str, error: type[Exception]) -> Any:
    """``read_json(path)``, or ``error`` in one line naming ``what``: not valid JSON (the parser's complaint), or
    why it cannot be used (its line when known)."""
    try:
        return read_json(path)
    except JsonProblem as exc:
        if exc.syntax is not None:
            raise error(f"{what} is not valid JSON: {exc.syntax}") from None
        raise error(f"{what} cannot be used: {exc.detail}" + (f" (line {exc.line})" if exc.line else "")) from None


def read_json(path: str | os.PathLike, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """``parse_json`` of a UTF-8 file of at most ``max_bytes``; every failure (missing, unreadable, too large, not
    UTF-8, not usable JSON) is one ``JsonProblem`` line naming the file."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise JsonProblem(str(path), f"{size:,} bytes, more than the {max_bytes:,} a JSON file may have here")
        with path.open("rb") as fh:
            raw = fh.read(max_bytes + 1)
        text = raw.decode("utf-8")
    except FileNotFoundError:
        raise JsonProblem(str(path), "no such file") from None
    except UnicodeDecodeError as err:
        raise JsonProblem(str(path), f"not UTF-8 text (byte {raw[err.start]:#04x} at offset {err.start})") from None
    except OSError as err:
        raise JsonProblem(str(path), f"cannot be read ({err.strerror or err})") from None
    return parse_json(text, str(path))


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
        if not path.exists():
            raise ConfigError(f"{what} does not exist")
        data = load_json(path, what, ConfigError)
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
    """Write a text file atomically (a crash never leaves half a file; a failed write, a full disk, leaves
    neither the file changed nor its temporary)."""
    replace_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def replace_atomic(path: str | os.PathLike, write) -> None:
    """``write(tmp)`` fills a temporary beside ``path``, which then replaces ``path`` in one step; if the write
    fails, the temporary is removed and ``path`` is as it was."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
