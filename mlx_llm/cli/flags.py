"""Flags generated from config fields: each flag is one field of a config dataclass, its help text the field's
documentation (``config.setting``), its choices the field's, its type the field's annotation.

A generated flag has no argparse default: only the flags a user gave reach the command, as ``{section: {field:
value}}`` (``given``). A new run lays them over its recipe (mlx_llm/recipes.py, whose values the help text
shows); a resumed run compares them with the stored settings (runs/resume.py), so one rule covers every command.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
from pathlib import Path
from typing import Any, Iterable

from mlx_llm.errors import MLXLLMError

SEP = "."  # dest = "<section>.<field>"


def parse_int_or_auto(text: str):
    """A number, or "auto" (``--loss-chunk``)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: give a number of rows (0 = the whole logits at "
                                         f"once) or 'auto'") from None


def parse_list(text: str) -> tuple[str, ...]:
    """A comma-separated list (``--extensions .py,.txt``, ``--lora-targets wq,wv``)."""
    return tuple(t.strip() for t in text.split(",") if t.strip())


def absolute_path(text: str) -> str:
    """A path field: stored absolute (runs/configs.py), so compared absolute on resume."""
    return str(Path(text).resolve())


BOOLS = ("bool", "bool | None")  # a field whose unset value (None) the config resolves
TYPES = {"int": int, "float": float, "str": str, "int | None": int, "float | None": float, "str | None": str,
         "int | str": parse_int_or_auto, "tuple[str, ...]": parse_list}


def flag_name(field: dataclasses.Field, prefix: str = "") -> str:
    return "--" + (field.metadata.get("flag") or prefix + field.name).replace("_", "-")


def _help(field: dataclasses.Field, shown) -> str:
    """The field's documentation and the default the command uses (``shown``'s value, else the field's)."""
    text = field.metadata.get("help")
    if not text:
        raise TypeError(f"config field {field.name!r} has no help text: document it with config.setting")
    if field.type in BOOLS or not field.metadata.get("show_default", True) or "default" in text:
        return text
    value = getattr(shown, field.name) if shown is not None else field.default
    value = ",".join(value) if isinstance(value, tuple) else value
    return f"{text} (default: {'unset' if value is None else value})".replace("%", "%%")


def add_config_flags(parser, cls, section: str, *, shown=None, only: Iterable[str] | None = None,
                     exclude: Iterable[str] = (), prefix: str = "", groups: dict | None = None) -> None:
    """One flag per field of ``cls`` (all, or ``only``, minus ``exclude`` and fields marked ``cli=False``), dest
    ``section.field``; ``shown``: the instance whose values the help text gives as defaults; ``groups``: {field:
    argparse group} (e.g. mutually exclusive data sources)."""
    fields = [f for f in dataclasses.fields(cls) if f.metadata.get("cli", True) and f.name not in set(exclude)]
    if only is not None:
        wanted = list(only)
        fields = sorted((f for f in fields if f.name in wanted), key=lambda f: wanted.index(f.name))
    for f in fields:
        target = (groups or {}).get(f.name, parser)
        kwargs: dict[str, Any] = {"dest": section + SEP + f.name, "default": argparse.SUPPRESS,
                                  "help": _help(f, shown)}
        if f.type in BOOLS:  # --flag turns it on, --no-flag off (a default that is on, or one the config resolves)
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = absolute_path if f.metadata.get("path") else TYPES[f.type]
            if "nargs" in f.metadata:
                kwargs["nargs"] = f.metadata["nargs"]
            if "choices" in f.metadata:
                kwargs["choices"] = f.metadata["choices"]
            else:
                kwargs["metavar"] = f.metadata.get("metavar", f.name.upper())
        target.add_argument(flag_name(f, prefix), **kwargs)


def given(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """{section: {field: value}} of the generated flags the user gave."""
    out: dict[str, dict[str, Any]] = {}
    for dest, value in vars(args).items():
        if SEP in dest:
            section, name = dest.split(SEP, 1)
            out.setdefault(section, {})[name] = value
    return out


def flags_of(parser: argparse.ArgumentParser) -> dict[str, str]:
    """{"section.field": "--flag"} of a parser's generated flags (error messages name flags, not fields)."""
    return {a.dest: a.option_strings[0] for a in parser._actions if SEP in a.dest and a.option_strings}


def with_given(config, fields: dict[str, Any]):
    """``config`` with the given fields replaced (validated again by the config itself)."""
    return dataclasses.replace(config, **fields) if fields else config


# ----- --set SECTION.FIELD=VALUE: any field of a command's configs ------------------------------------------
def _typed(text: str, annotation: str, where: str):
    """``text`` as the field's annotated type ("int", "float | None", "tuple[str, ...]", "bool", …)."""
    kinds = [k.strip() for k in annotation.split("|")]
    if "None" in kinds and text.strip().lower() in ("none", "null", ""):
        return None
    kinds = [k for k in kinds if k != "None"]
    if kinds == ["bool"]:
        value = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False}.get(text.lower())
        if value is None:
            raise MLXLLMError(f"--set {where}={text}: {text!r} is not a boolean (give true or false)")
        return value
    if kinds == ["tuple[str, ...]"]:
        return parse_list(text)
    for kind in kinds:
        try:
            return {"int": int, "float": float, "str": str}[kind](text)
        except ValueError:
            continue
    what = " or ".join({"int": "an integer", "float": "a number", "str": "a string"}[k] for k in kinds)
    raise MLXLLMError(f"--set {where}={text}: {text!r} is not {what}")


def apply_sets(given: dict[str, dict[str, Any]], sets: list[str] | None, sections: dict) -> dict:
    """``given`` with each ``--set SECTION.FIELD=VALUE`` added: SECTION names one of the command's configs
    (``sections``: {name: (given's section, config class)}), FIELD one of its fields (an unknown one lists the
    close matches), VALUE typed by the field's annotation; the config validates the value when it is built. A
    field also given by its own flag must have the same value."""
    out = {section: dict(fields) for section, fields in given.items()}
    for item in sets or ():
        target, eq, text = item.partition("=")
        section, dot, name = target.strip().partition(".")
        if not (eq and dot and name):
            raise MLXLLMError(f"--set {item!r} is invalid: give SECTION.FIELD=VALUE, e.g. --set train.lr=1e-3 "
                              f"(sections: {', '.join(sections)})")
        if section not in sections:
            raise MLXLLMError(f"--set {item!r}: this command has no {section!r} settings; its sections are "
                              f"{', '.join(sections)}")
        key, cls = sections[section]
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if name not in fields:
            close = difflib.get_close_matches(name, fields, n=3)
            hint = f"did you mean {' or '.join(close)}? " if close else ""
            raise MLXLLMError(f"--set {target}: {cls.__name__} has no field {name!r}; {hint}valid fields: "
                              f"{', '.join(fields)}")
        value = _typed(text.strip(), fields[name].type, target)
        earlier = out.setdefault(key, {})
        if name in earlier and earlier[name] != value:
            raise MLXLLMError(f"--set {target}={text} contradicts the value {earlier[name]!r} given for it elsewhere")
        earlier[name] = value
    return out
