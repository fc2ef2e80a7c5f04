"""Experiment trackers (``--tracker tensorboard,wandb``): TensorBoard event files and a W&B run that mirror the
scalars of ``metrics.jsonl`` at the same steps.

``metrics.jsonl`` stays the source of truth; a tracker is a view of it. A row's numbers become scalars under their
keys (a list under ``k`` becomes ``k/0``, ``k/1``…, a dict ``k/sub``); strings, None and bools are not scalars.
The run config goes to TensorBoard as hparams plus a ``config`` text summary (once, not again on resume) and to
W&B as the run's config (flattened to ``model/d_model``…, at every ``wandb.init``).

Resume: ``RUN/trackers.json`` holds each tracker's identity and the last step it was sent::

    {"wandb": {"id": "k3j5x9qa", "last_step": 500}, "tensorboard": {"last_step": 500}, "last_step": 500}

A resumed run replays the steps after its checkpoint with identical values; rows at or below a tracker's stored
``last_step`` are not sent to it again, so no tracker sees a step twice. The W&B run id is reused (the same run
continues); TensorBoard opens a new event file in ``RUN/tb`` (named uniquely: see ``_TensorBoard``). A tracker
that is not in the state starts fresh; the others keep their entries. The state is rewritten atomically after every
``log`` that sent something (TensorBoard's events flushed first).

The trackers' packages (``pip install 'mlx_llm[track]'``) are imported only when a run asks for them. Open the
trackers on the process that writes ``metrics.jsonl`` (process 0) only.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import numbers
import os
import secrets
import string
import textwrap
import time
from pathlib import Path
from typing import Any, Iterable

from mlx_llm.errors import CheckpointError, ConfigError, InputError
from mlx_llm.settings import write_json_atomic

TRACKERS = ("tensorboard", "wandb")
EXTRA = "track"  # pip install 'mlx_llm[track]'
STATE_FILE = "trackers.json"
TB_DIR = "tb"  # RUN/tb: the TensorBoard log dir
PACKAGES = {"tensorboard": "tensorboardX", "wandb": "wandb"}  # the package each tracker imports
HPARAM_METRICS = ("loss", "val_loss", "val_bpb")  # the scalar tags TensorBoard's hparams table shows per run
DEFAULT_PROJECT = "mlx_llm"  # the W&B project when WANDB_PROJECT is not set
_ID_CHARS = string.ascii_lowercase + string.digits  # W&B's own run-id alphabet (8 base-36 characters)


# ----- names ----------------------------------------------------------------------------------------------------------
def check_trackers(names: Iterable[str] | str) -> tuple[str, ...]:
    """Validate tracker names (any subset of ``TRACKERS``, each at most once; a comma-separated string is split)
    and check each one's package can be imported, so that a missing package fails before training starts rather
    than at the first log. Returns the names in ``TRACKERS`` order. Imports nothing (``find_spec`` only)."""
    given = [n for n in names.split(",") if n.strip()] if isinstance(names, str) else list(names)
    seen: list[str] = []
    for raw in given:
        name = raw.strip().lower() if isinstance(raw, str) else raw
        if name not in TRACKERS:
            raise ConfigError(f"unknown tracker {raw!r}: valid trackers are {', '.join(TRACKERS)}")
        if name in seen:
            raise ConfigError(f"tracker {name!r} given twice in {tuple(given)!r}: give each tracker at most once")
        seen.append(name)
    for name in seen:
        if not _installed(PACKAGES[name]):
            raise ConfigError(_missing(name))
    return tuple(n for n in TRACKERS if n in seen)


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a broken or half-removed install
        return False


def _missing(name: str) -> str:
    return f"--tracker {name} needs the {PACKAGES[name]} package: pip install 'mlx_llm[{EXTRA}]'"


def _import(name: str):
    """The tracker's package, or a ConfigError in one line when it cannot be imported."""
    try:
        return importlib.import_module(PACKAGES[name])
    except ImportError as exc:
        raise ConfigError(f"{_missing(name)} (importing it failed: {_one_line(exc)})") from None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


# ----- flattening -----------------------------------------------------------------------------------------------------
def flatten_row(row: dict) -> dict[str, int | float]:
    """A metrics row's scalars (every key but ``step``): numbers as they are (non-finite ones too: they are real
    data), a list under ``k`` as ``k/0``, ``k/1``…, a dict as ``k/sub``, recursively; strings, None and bools are
    skipped. Arrays (anything with ``tolist``) count as lists, so rows need not be converted first."""
    out: dict[str, int | float] = {}
    for key, value in row.items():
        if key != "step":
            _flatten_value(out, str(key), value)
    return out


def _flatten_value(out: dict, key: str, value: Any) -> None:
    if value is None or isinstance(value, (bool, str)):
        return
    if isinstance(value, numbers.Integral):
        out[key] = int(value)
    elif isinstance(value, numbers.Real):
        out[key] = float(value)
    elif isinstance(value, dict):
        for sub, inner in value.items():
            _flatten_value(out, f"{key}/{sub}", inner)
    elif isinstance(value, (list, tuple)):
        for i, inner in enumerate(value):
            _flatten_value(out, f"{key}/{i}", inner)
    elif hasattr(value, "tolist"):  # numpy / jax arrays and their scalars
        _flatten_value(out, key, value.tolist())


def flatten_config(config: dict, prefix: str = "") -> dict[str, int | float | str | bool]:
    """The nested run config as ``{"model/d_model": 256, ...}``: what TensorBoard's hparams and W&B's config take.
    Values that are not int/float/str/bool become strings (``str``), so None or a list stays visible."""
    out: dict[str, int | float | str | bool] = {}
    for key, value in config.items():
        name = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            out.update(flatten_config(value, name))
        elif isinstance(value, (bool, int, float, str)):
            out[name] = value
        else:
            out[name] = str(value)
    return out


def _step_of(row: dict) -> int:
    step = row.get("step") if isinstance(row, dict) else None
    if not isinstance(step, numbers.Integral) or isinstance(step, bool):
        raise InputError(f"a metrics row needs an integer 'step': got {row!r}")
    return int(step)


def _by_step(rows: list[dict]) -> list[tuple[int, dict]]:
    """Rows merged per step (a train row and an eval row of one step become one), in increasing step order: W&B
    drops a row whose step is below one it has already seen."""
    merged: dict[int, dict] = {}
    for row in rows:
        merged.setdefault(_step_of(row), {}).update(flatten_row(row))
    return sorted(merged.items())


# ----- the trackers ---------------------------------------------------------------------------------------------------
class _TensorBoard:
    """tensorboardX event files in RUN/tb; hparams and the config text are written when the tracker is new."""

    name = "tensorboard"

    def __init__(self, run_dir: Path, entry: dict | None, config: dict):
        tensorboardX = _import(self.name)
        # tensorboardX names event files by the second and host and opens them with "wb": without a suffix of
        # its own, a session opened in the same second as the previous one would truncate that one's events
        suffix = f".{time.time_ns()}.{os.getpid()}"
        self.writer = tensorboardX.SummaryWriter(logdir=str(run_dir / TB_DIR), filename_suffix=suffix)
        if entry is None:
            self._write_config(config)
            self.writer.flush()

    def _write_config(self, config: dict) -> None:
        """Hparams (experiment + session start) into this event stream, and the config as JSON in a ``config``
        text summary (tag ``config/text_summary``), indented so the text plugin shows it as a code block while it
        stays valid JSON."""
        from tensorboardX.summary import hparams

        exp, ssi, _ = hparams(flatten_config(config), {m: 0.0 for m in HPARAM_METRICS})
        self.writer.file_writer.add_summary(exp)
        self.writer.file_writer.add_summary(ssi)
        text = json.dumps(config, indent=2, sort_keys=True, default=str)
        self.writer.add_text("config", textwrap.indent(text, "    "), global_step=0)

    def write(self, steps: list[tuple[int, dict]]) -> None:
        for step, scalars in steps:
            for tag, value in scalars.items():
                self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()  # before last_step moves past these rows

    def entry(self) -> dict:
        return {}

    def close(self, failed: bool) -> None:
        if not failed:  # the hparams session ends: a failed run stays without an end status
            from tensorboardX.summary import hparams

            self.writer.file_writer.add_summary(hparams({}, {})[2])
        self.writer.close()


class _WandB:
    """A W&B run in RUN/wandb whose id lives in the state, so a resumed run continues the same W&B run."""

    name = "wandb"

    def __init__(self, run_dir: Path, entry: dict | None, config: dict, name: str | None):
        wandb = _import(self.name)
        self.id = entry["id"] if entry else "".join(secrets.choice(_ID_CHARS) for _ in range(8))
        project = os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT
        try:
            self.run = wandb.init(project=project, dir=str(run_dir), id=self.id, resume="allow",
                                  config=flatten_config(config), name=name)
        except wandb.errors.Error as exc:
            raise ConfigError(f"--tracker wandb could not start run {self.id!r} in project {project!r}: {_one_line(exc)} "
                              "(WANDB_MODE=offline logs without an account or network)") from None

    def write(self, steps: list[tuple[int, dict]]) -> None:
        for step, scalars in steps:
            self.run.log(scalars, step=step)

    def entry(self) -> dict:
        return {"id": self.id}

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


def _read_state(run_dir: Path) -> dict:
    """RUN/trackers.json, or {} when the run never opened a tracker."""
    path = run_dir / STATE_FILE
    if not path.exists():
        return {}
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"tracker state {path} cannot be read ({exc}): delete it to start the trackers "
                              "afresh (a new W&B run)") from None
    if not isinstance(state, dict) or not all(isinstance(state.get(n, {}), dict) for n in TRACKERS):
        raise CheckpointError(f"tracker state {path} is not {{tracker: {{...}}, 'last_step': N}}: got {state!r}")
    if "wandb" in state and not isinstance(state["wandb"].get("id"), str):
        raise CheckpointError(f"tracker state {path} has no W&B run id under 'wandb': got {state['wandb']!r}")
    return state


def _last_step(state: dict, name: str) -> int | None:
    """The last step ``name`` was sent, or None when it was never sent one. An entry without its own
    ``last_step`` (a state in the minimal ``{"wandb": {"id": ...}, "last_step": N}`` form) takes the run's."""
    if name not in state:
        return None
    step = state[name]["last_step"] if "last_step" in state[name] else state.get("last_step")
    return int(step) if isinstance(step, numbers.Real) and not isinstance(step, bool) else None


class Trackers:
    """The run's open trackers. ``Trackers.open(run_dir, (), ...)`` (no tracker) logs nothing and writes nothing.
    Use as a context manager, or call ``close``; a ``with`` block left by an exception marks the W&B run failed."""

    def __init__(self, run_dir: Path | None = None, sinks: list | None = None, state: dict | None = None):
        self.run_dir = run_dir
        self._sinks = sinks or []
        self._state = state or {}
        self._floor = {s.name: _last_step(self._state, s.name) for s in self._sinks}
        self._closed = False

    @classmethod
    def open(cls, run_dir, names, *, config: dict, resume: bool, name: str | None = None) -> "Trackers":
        """Open the trackers ``names`` (see ``check_trackers``) for ``run_dir``. ``resume=True`` continues the
        identities in RUN/trackers.json (a run without one starts fresh); ``resume=False`` starts new ones.
        ``config`` is the nested run config; ``name`` the W&B run's display name (W&B picks one when None)."""
        names = check_trackers(names)
        if not names:
            return cls()
        run_dir = Path(run_dir)
        if not run_dir.is_dir():
            raise CheckpointError(f"run directory {run_dir} does not exist: trackers open in an existing run")
        state = _read_state(run_dir) if resume else {}
        sinks: list = []
        try:
            for tracker in names:
                entry = state.get(tracker)
                sinks.append(_TensorBoard(run_dir, entry, config) if tracker == "tensorboard" else
                             _WandB(run_dir, entry, config, name))
        except BaseException:
            for sink in sinks:
                sink.close(failed=True)
            raise
        self = cls(run_dir, sinks, state)
        self._save()
        return self

    def log(self, rows: list[dict]) -> None:
        """Send ``rows`` (metrics.jsonl rows) to every tracker, except those at or below the step the tracker
        was last sent before this run resumed (the replayed ones); then record the new last step."""
        if not self._sinks or not rows:
            return
        if self._closed:
            raise InputError(f"trackers of {self.run_dir} are closed: {len(rows)} rows cannot be logged")
        merged, sent = _by_step(rows), False
        for sink in self._sinks:
            floor = self._floor[sink.name]
            steps = [(s, v) for s, v in merged if floor is None or s > floor]
            if steps:
                sink.write(steps)
                entry, last = self._state[sink.name], steps[-1][0]
                entry["last_step"] = last if entry.get("last_step") is None else max(entry["last_step"], last)
                sent = True
        if sent:
            self._save()

    def _save(self) -> None:
        """Write the state (atomically): every open tracker's identity and last step (None until it is sent a row),
        other trackers' entries kept as they were, and the run's ``last_step`` (the largest)."""
        for sink in self._sinks:
            self._state.setdefault(sink.name, {"last_step": None}).update(sink.entry())
        steps = [self._state[n].get("last_step") for n in TRACKERS if n in self._state] + [self._state.get("last_step")]
        steps = [s for s in steps if isinstance(s, int)]
        if steps:
            self._state["last_step"] = max(steps)
        write_json_atomic(self.run_dir / STATE_FILE, self._state)

    def close(self, *, failed: bool = False) -> None:
        """Flush and close every tracker (W&B: finish the run, ``failed`` gives it exit code 1). Idempotent."""
        if self._closed:
            return
        self._closed = True
        errors = []
        for sink in self._sinks:
            try:
                sink.close(failed)
            except Exception as exc:  # close the others; report the first failure
                errors.append(exc)
        if errors:
            raise errors[0]

    def __enter__(self) -> "Trackers":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(failed=exc_type is not None)
