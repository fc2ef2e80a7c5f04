"""The run record: the validated schema of ``run.json``, and ``open_run``, the one reader of a run directory.

A run directory holds ``config.json`` (ModelConfig), ``train_config.json`` (TrainConfig), ``run.json`` (this
record), ``tokenizer.json``, ``checkpoints/<step>/`` and the run's outputs. The record says what kind of run it
is and where it comes from:

- ``kind``: pretrain | sft | reward | dpo | rl | merged | imported;
- ``data``: the pretraining corpus settings (``DataSpec``; a fine-tuning run keeps its base's);
- ``base``: ``{"run", "step"}`` of the run it starts from (fine-tuning and preference runs);
- ``lora``: the adapters' ``LoRAConfig`` when the checkpoints hold adapters over the frozen base;
- ``template``: the chat template (fine-tuning and preference runs);
- ``settings``: the kind's own config (``configs.KIND_CONFIGS``), read back whole on resume;
- ``schedule_steps``: the total the lr schedule is defined over, once a run has been extended;
- ``provenance``: where a merged or imported run came from, and what wrote the record;
- ``checksums``: every checkpoint of the run carries a checksum manifest (train/checkpoint.py), so one without is
  refused; set by ``write_run``, absent (false) in runs written before manifests were written for every step.
- ``run_id``: a random id the run gets when ``write_run`` writes it, kept by every later write (a resume) and by a
  copy of the directory, so ``mlx-llm compare`` knows one run under two paths; absent (None) in older records.

Records written before this schema (format 1: keys ``sft`` / ``post`` / ``merged_from`` / ``imported``) are read
through ``migrate`` in memory; nothing is rewritten until the run itself writes its record again.
"""

from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path
from typing import Any

from mlx_llm.config import LoRAConfig, ModelConfig, TrainConfig, write_json_atomic
from mlx_llm.errors import CheckpointError, ConfigError
from mlx_llm.runs.configs import KIND_CONFIGS, DataSpec
from mlx_llm.settings import JsonProblem, read_json

CONFIG_FILE, TRAIN_CONFIG_FILE, RUN_FILE = "config.json", "train_config.json", "run.json"
CHECKPOINT_DIR = "checkpoints"
FORMAT = 2
KINDS = tuple(KIND_CONFIGS)
LM_KINDS = ("pretrain", "sft", "dpo", "rl", "merged", "imported")  # the kinds that hold a language model


@dataclasses.dataclass(frozen=True)
class BaseRef:
    """The run a fine-tuning run starts from, and the checkpoint step it started from."""

    run: str
    step: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunRecord:
    """``run.json`` of a run (see the module docstring); validated on construction."""

    kind: str
    data: DataSpec | None = None
    base: BaseRef | None = None
    lora: LoRAConfig | None = None
    template: dict | None = None
    settings: Any = None
    schedule_steps: int | None = None
    provenance: dict = dataclasses.field(default_factory=dict)
    checksums: bool = False
    run_id: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KIND_CONFIGS:
            raise ConfigError(f"run kind {self.kind!r} is invalid: valid kinds are {list(KINDS)}")
        want = KIND_CONFIGS[self.kind]
        if self.settings is None:
            object.__setattr__(self, "settings", want())
        if not isinstance(self.settings, want):
            raise ConfigError(f"a {self.kind} run's settings are a {want.__name__}, not {type(self.settings).__name__}")
        if self.kind in ("sft", "reward", "dpo", "rl") and self.base is None:
            raise ConfigError(f"a {self.kind} run records its base run")

    def to_dict(self) -> dict:
        return {"format": FORMAT, "kind": self.kind, "data": None if self.data is None else self.data.to_dict(),
                "base": None if self.base is None else dataclasses.asdict(self.base),
                "lora": None if self.lora is None else dataclasses.asdict(self.lora), "template": self.template,
                "settings": self.settings.to_dict(), "schedule_steps": self.schedule_steps,
                "provenance": self.provenance, "checksums": self.checksums, "run_id": self.run_id}

    @classmethod
    def from_dict(cls, d: dict, *, source: str = "run.json") -> "RunRecord":
        if not isinstance(d, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(d).__name__}")
        d = migrate(d) if "format" not in d else d
        if d["format"] != FORMAT:
            raise ConfigError(f"{source}: record format {d['format']!r} is not one this version reads ({FORMAT})")
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)} - {"format"})
        if unknown:
            raise ConfigError(f"{source}: unknown run record field(s) {unknown}")
        kind = d.get("kind")
        if kind not in KIND_CONFIGS:
            raise ConfigError(f"{source}: run kind {kind!r} is invalid: valid kinds are {list(KINDS)}")
        lora = d.get("lora")
        return cls(kind=kind, data=None if d.get("data") is None else DataSpec.from_dict(d["data"], source=source),
                   base=None if d.get("base") is None else BaseRef(**d["base"]),
                   lora=None if lora is None else LoRAConfig(**{**lora, "targets": tuple(lora["targets"])}),
                   template=d.get("template"), settings=KIND_CONFIGS[kind].from_dict(d.get("settings") or {},
                                                                                      source=source),
                   schedule_steps=d.get("schedule_steps"), provenance=d.get("provenance") or {},
                   checksums=d.get("checksums") is True, run_id=_run_id(d.get("run_id"), source))

    def replace(self, **changes) -> "RunRecord":
        return dataclasses.replace(self, **changes)


def _run_id(value, source: str) -> str | None:
    if value is not None and not (isinstance(value, str) and value.isalnum()):
        raise ConfigError(f"{source}: run_id = {value!r} is invalid: it is the id write_run gives a run (hex digits)")
    return value


# The settings format 1 kept beside the base reference, per kind (the rest were the base, LoRA and template).
_LEGACY_SETTINGS = {"sft": ("data", "task", "n_train"), "reward": ("data", "task", "n_train", "model_negatives"),
                    "dpo": ("data", "task", "n_train", "model_negatives", "beta", "reference", "nll_weight"),
                    "rl": ("task", "n_train", "beta", "k", "reward_model", "reference")}


def migrate(old: dict) -> dict:
    """A format-1 ``run.json`` (written before the record had a schema) as a format-2 dict."""
    new = {"format": FORMAT, "kind": "pretrain", "data": old.get("data"), "schedule_steps": old.get("schedule_steps"),
           "provenance": {}}
    post = old.get("sft") or old.get("post")
    if post is not None:
        kind = "sft" if "sft" in old else post["kind"]
        new.update(kind=kind, base={"run": post["base"], "step": post["base_step"]}, lora=post.get("lora"),
                   template=post.get("template"),
                   settings={k: post[k] for k in _LEGACY_SETTINGS[kind] if k in post})
    elif "merged_from" in old:
        new.update(kind="merged", provenance={"merged_from": old["merged_from"]})
    elif "imported" in old:
        new.update(kind="imported", provenance={"imported": old["imported"]})
    return new


@dataclasses.dataclass(frozen=True)
class Run:
    """An opened run directory: its configs and record (read once, never written by this object)."""

    path: Path
    cfg: ModelConfig
    tcfg: TrainConfig
    record: RunRecord

    @property
    def kind(self) -> str:
        return self.record.kind

    def checkpoint_steps(self) -> list[int]:
        """The finished checkpoints' steps, listed without creating anything (orbax's temporary and set-aside
        directories have non-numeric names)."""
        root = self.path / CHECKPOINT_DIR
        return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit()) if root.is_dir() else []

    def latest_step(self) -> int | None:
        steps = self.checkpoint_steps()
        return steps[-1] if steps else None

    def require_language_model(self, what: str) -> None:
        if self.kind not in LM_KINDS:
            raise ConfigError(f"{self.path} is a reward model (a trunk and a scalar reward head), not a language "
                              f"model: {what} needs a language model run; load it with "
                              f"mlx_llm.post.reward.load_reward_model")


def open_run(path) -> Run:
    """Read a run directory's configs and record; raises ``CheckpointError`` naming what is missing or damaged.
    Read-only: never creates or changes anything."""
    path = Path(path)
    if not (path / CONFIG_FILE).is_file():
        raise CheckpointError(f"{str(path)!r} is not a run directory: it has no {CONFIG_FILE} "
                              f"(give the --out directory of an earlier `mlx-llm train`)")
    try:
        cfg = ModelConfig.from_json(path / CONFIG_FILE)
        tcfg = TrainConfig.from_json(path / TRAIN_CONFIG_FILE)
        record = RunRecord.from_dict(read_json(path / RUN_FILE), source=str(path / RUN_FILE))
    except (ConfigError, JsonProblem, KeyError, TypeError) as exc:
        raise CheckpointError(f"run directory {str(path)!r} is damaged: {exc}") from None
    return Run(path, cfg, tcfg, record)


def write_record(path: Path, record: RunRecord) -> None:
    write_json_atomic(Path(path) / RUN_FILE, record.to_dict())


def write_run(path: Path, cfg: ModelConfig, tcfg: TrainConfig, record: RunRecord) -> None:
    """The three files of a new run (``path`` is created if needed); run.json last, so a directory with a
    record has its configs. The record says its checkpoints carry checksum manifests (this version writes one for
    each) and gives the run a new id (``run_id``)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg.to_json(path / CONFIG_FILE)
    tcfg.to_json(path / TRAIN_CONFIG_FILE)
    write_record(path, record.replace(checksums=True, run_id=uuid.uuid4().hex))
