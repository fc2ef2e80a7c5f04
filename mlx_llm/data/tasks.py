"""Built-in, deterministic chat fine-tuning tasks with exact checkers.

Each task yields examples in the ecosystem's chat shape, ``{"messages": [{"role": "user", ...}, {"role":
"assistant", ...}], "answer": "..."}``, split into ``"train"`` and ``"heldout"``, and ``check`` scores a model's
reply by exact match (no partial credit). ``write_jsonl`` writes them as a file a user can read and replace.

Tasks (``TASKS``):

- ``"arithmetic"``: "What is 47 + 385?" → "432"; addition or subtraction (results may be negative) of operands
  0..999. An operand's digit count (1, 2 or 3) is drawn uniformly, then its value uniformly among the numbers
  with that many digits (0..9 for one), so short operands are not swamped by the 90 % of 0..999 that have three.
  The space (2·10⁶ problems) is sampled: ``n=None`` gives a fixed sample of ``ARITHMETIC_DEFAULT_N[split]``
  distinct problems, and ``n`` may go up to ``ARITHMETIC_MAX_N[split]``.
- ``"addition2"``: the same format, addition of two operands 10..99; all 8,100 problems are enumerated.
- ``"name_function"``: ``NAME_FUNCTION_QUESTION``, a newline and a docstring between triple double quotes →
  the function's bare name ("urlencode"). Functions are the top-level ``def``s and the methods of top-level
  classes of the stdlib ``.py`` files, found with ``ast`` (files that fail to parse are skipped). A docstring
  (``ast.get_docstring``, indentation cleaned) is skipped when it is shorter than ``MIN_DOCSTRING_CHARS`` or
  longer than ``MAX_DOCSTRING_CHARS`` (never truncated) or when it contains the name (case-insensitively: it
  would give the answer away). Identical (docstring, name) pairs count once.

Splits, stable across runs, machines and Python processes (no ``hash()``):

- Arithmetic problems are split by the problem itself: heldout when ``val_score("a op b") < HELDOUT_PERCENT``
  (SHA-256 of the text, as the pretraining corpus splits files). ``addition2`` uses the same rule, so its heldout
  problems are heldout for ``arithmetic`` too: training on either never shows an ``addition2`` heldout problem.
- ``name_function`` is split by file exactly as the pretraining corpus (``read_corpus(None, extensions=(".py",),
  val_percent=5.0)``): heldout pairs come from val files, train pairs from train files, less any pair also found
  in a val file. A model pretrained on the default corpus has not read the file of any heldout function (code
  copied into a train file aside).

Every list is sorted by its problem ((a, op, b), or (name, docstring)): shuffle before training. ``n`` selects a
seeded random subset (``default_rng([seed, split index])``); ``n=None`` gives everything (arithmetic: the
default sample). The stdlib extraction (~4 s) runs once per process.
"""

from __future__ import annotations

import ast
import functools
import json
import re
import warnings
from pathlib import Path

import numpy as np

from mlx_llm.errors import ConfigError
from mlx_llm.data.text import DEFAULT_VAL_PERCENT, Document, read_corpus, val_score

TASKS = ("arithmetic", "addition2", "name_function")
SPLITS = ("train", "heldout")
HELDOUT_PERCENT = 10.0
ARITHMETIC_DEFAULT_N = {"train": 20_000, "heldout": 1_000}
# Larger samples get slow: most of the reachable space is 3-digit × 3-digit, drawn for only 1/9 of the draws.
ARITHMETIC_MAX_N = {"train": 100_000, "heldout": 20_000}
MIN_DOCSTRING_CHARS, MAX_DOCSTRING_CHARS = 20, 400
NAME_FUNCTION_QUESTION = "Which function of the Python standard library has this docstring?"
_INTEGER = re.compile(r"-?(?:0|[1-9][0-9]*)")
_DIGIT_RANGES = np.array([[0, 10], [10, 100], [100, 1000]])  # [low, high) of 1-, 2- and 3-digit operands
_DRAW_BATCH = 4096


def _chat(question: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
            "answer": answer}


# ----- arithmetic ---------------------------------------------------------------------------------
def _problem_split(a: int, op: str, b: int) -> str:
    """``"heldout"`` or ``"train"`` for the problem ``a op b`` (a stable hash of its text)."""
    return "heldout" if val_score(f"{a} {op} {b}") < HELDOUT_PERCENT else "train"


def _arithmetic_example(a: int, op: str, b: int) -> dict:
    answer = str(a + b if op == "+" else a - b)
    return _chat(f"What is {a} {op} {b}?", answer)


def _sample_arithmetic(split: str, n: int, seed: int) -> list[tuple[int, str, int]]:
    """``n`` distinct problems of ``split`` drawn in batches from ``default_rng([seed, split index])``."""
    rng, chosen = np.random.default_rng([seed, SPLITS.index(split)]), set()
    while len(chosen) < n:
        ranges = _DIGIT_RANGES[rng.integers(0, 3, (_DRAW_BATCH, 2))]
        operands = rng.integers(ranges[..., 0], ranges[..., 1])
        ops = rng.integers(0, 2, _DRAW_BATCH)
        for (a, b), o in zip(operands.tolist(), ops.tolist()):
            problem = (a, "+-"[o], b)
            if problem not in chosen and _problem_split(*problem) == split:
                chosen.add(problem)
                if len(chosen) == n:
                    break
    return sorted(chosen)


@functools.lru_cache(maxsize=None)
def _addition2_problems(split: str) -> tuple[tuple[int, str, int], ...]:
    problems = ((a, "+", b) for a in range(10, 100) for b in range(10, 100))
    return tuple(p for p in problems if _problem_split(*p) == split)


# ----- name the function --------------------------------------------------------------------------
def _documented_functions(doc: Document) -> set[tuple[str, str]]:
    """(name, docstring) of the kept top-level functions and methods of one file; empty if it does not parse."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SyntaxWarning on invalid escapes in old sources
            tree = ast.parse(doc.text)
    except (SyntaxError, ValueError):
        return set()
    defs = (ast.FunctionDef, ast.AsyncFunctionDef)
    nodes = [node for node in tree.body if isinstance(node, defs)]
    for cls in (node for node in tree.body if isinstance(node, ast.ClassDef)):
        nodes.extend(node for node in cls.body if isinstance(node, defs))
    out = set()
    for node in nodes:
        text = ast.get_docstring(node)
        if (
            text
            and MIN_DOCSTRING_CHARS <= len(text) <= MAX_DOCSTRING_CHARS
            and node.name.lower() not in text.lower()
        ):
            out.add((node.name, text))
    return out


@functools.lru_cache(maxsize=1)
def _name_function_pairs() -> dict[str, tuple[tuple[str, str], ...]]:
    """Sorted (name, docstring) pairs per split, from the default pretraining corpus split by file."""
    corpus = read_corpus(None, extensions=(".py",), val_percent=DEFAULT_VAL_PERCENT)
    heldout = set().union(*map(_documented_functions, corpus.val))
    train = set().union(*map(_documented_functions, corpus.train)) - heldout
    return {"train": tuple(sorted(train)), "heldout": tuple(sorted(heldout))}


def _name_function_example(name: str, docstring: str) -> dict:
    return _chat(f'{NAME_FUNCTION_QUESTION}\n"""{docstring}"""', name)


# ----- public API ---------------------------------------------------------------------------------
def _check_task(task) -> None:
    if task not in TASKS:
        raise ConfigError(f"task = {task!r} is invalid: valid tasks are {list(TASKS)}")


def _check_args(task, split, n, seed) -> None:
    _check_task(task)
    if split not in SPLITS:
        raise ConfigError(f"split = {split!r} is invalid: valid splits are {list(SPLITS)}")
    if n is not None and (isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1):
        raise ConfigError(f"n = {n!r} is invalid: it must be a positive integer or None (all)")
    if task == "arithmetic" and n is not None and n > ARITHMETIC_MAX_N[split]:
        raise ConfigError(f"n = {n} is invalid for arithmetic {split}: it must be ≤ {ARITHMETIC_MAX_N[split]}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ConfigError(f"seed = {seed!r} is invalid: it must be an integer ≥ 0")


def _subset(items: tuple, split: str, n: int | None, seed: int) -> list:
    """All ``items``, or ``n`` of them chosen by ``default_rng([seed, split index])``, in their order."""
    if n is None or n >= len(items):
        return list(items)
    keep = np.sort(np.random.default_rng([seed, SPLITS.index(split)]).choice(len(items), n, replace=False))
    return [items[k] for k in keep.tolist()]


def examples(task: str, split: str, *, n: int | None = None, seed: int = 0) -> list[dict]:
    """The examples of ``task`` in ``split`` ("train" or "heldout"): at most ``n`` (None: all; for arithmetic,
    ``ARITHMETIC_DEFAULT_N[split]``), each ``{"messages": [user, assistant], "answer": str}``."""
    _check_args(task, split, n, seed)
    if task == "arithmetic":
        problems = _sample_arithmetic(split, ARITHMETIC_DEFAULT_N[split] if n is None else int(n), seed)
        return [_arithmetic_example(*p) for p in problems]
    if task == "addition2":
        return [_arithmetic_example(*p) for p in _subset(_addition2_problems(split), split, n, seed)]
    return [_name_function_example(*p) for p in _subset(_name_function_pairs()[split], split, n, seed)]


def check(task: str, answer: str, expected: str) -> bool:
    """Exact match. Arithmetic: the stripped reply is the integer in canonical form (optional '-', no '+', no
    leading zeros, no decimals, nothing around it) and equals ``expected``. name_function: the stripped reply is
    the name itself."""
    _check_task(task)
    got = answer.strip()
    if task == "name_function":
        return got == expected.strip()
    return _INTEGER.fullmatch(got) is not None and got == expected.strip()


def prompt_messages(example: dict) -> list[dict]:
    """The conversation without its final assistant turn: what a model is asked at evaluation time."""
    messages = example["messages"]
    if messages and messages[-1]["role"] == "assistant":
        messages = messages[:-1]
    return [dict(m) for m in messages]


def write_jsonl(task: str, split: str, path, *, n: int | None = None, seed: int = 0) -> int:
    """Write ``examples(task, split, n=n, seed=seed)`` to ``path``, one JSON object per line (UTF-8, not
    ASCII-escaped); returns the number written."""
    records = examples(task, split, n=n, seed=seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return len(records)
