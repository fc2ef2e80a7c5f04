"""Run directories and orbax checkpoints.

A run directory holds ``config.json``, ``train_config.json``, ``run.json`` (data source), ``tokenizer.json``,
``checkpoints/<step>/`` (orbax, the last ``keep`` kept), ``metrics.jsonl``, ``loss.png`` and ``sample.txt``.
Orbax writes each checkpoint to a temporary directory and renames it when complete, so a run killed while
writing leaves the previous checkpoint loadable.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from mlx_llm.config import ModelConfig, TrainConfig, write_json_atomic
from mlx_llm.errors import CheckpointError, ConfigError

CONFIG_FILE, TRAIN_CONFIG_FILE, RUN_FILE = "config.json", "train_config.json", "run.json"
CHECKPOINT_DIR = "checkpoints"


class Checkpoints:
    """Save / restore a state pytree every k steps in ``run_dir/checkpoints``; keeps the last ``keep``."""

    def __init__(self, run_dir: str | os.PathLike, keep: int = 2):
        self.directory = Path(run_dir).absolute() / CHECKPOINT_DIR
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=False)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: Any) -> None:
        self._manager.save(step, args=ocp.args.StandardSave(state), force=True)
        self._manager.wait_until_finished()

    def restore(self, abstract_state: Any, step: int | None = None) -> Any:
        """Restore into the structure, shapes, dtypes and shardings of ``abstract_state``."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint in {self.directory}: nothing to resume or evaluate")
        try:
            return self._manager.restore(step, args=ocp.args.StandardRestore(abstract_state))
        except (ValueError, KeyError, FileNotFoundError) as exc:
            raise CheckpointError(f"checkpoint {step} in {self.directory} cannot be restored into this model "
                                  f"and optimizer: {str(exc).splitlines()[0]}") from None

    def close(self) -> None:
        self._manager.close()


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs (with shardings) of a pytree, the restore target orbax needs."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None)),
                        tree)


def write_run_files(run_dir: Path, cfg: ModelConfig, tcfg: TrainConfig, run_info: dict) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg.to_json(run_dir / CONFIG_FILE)
    tcfg.to_json(run_dir / TRAIN_CONFIG_FILE)
    write_json_atomic(run_dir / RUN_FILE, run_info)


def read_run_files(run_dir: Path) -> tuple[ModelConfig, TrainConfig, dict]:
    run_dir = Path(run_dir)
    if not (run_dir / CONFIG_FILE).is_file():
        raise CheckpointError(f"{str(run_dir)!r} is not a run directory: it has no {CONFIG_FILE} "
                              f"(give the --out directory of an earlier `mlx-llm train`)")
    try:
        cfg = ModelConfig.from_json(run_dir / CONFIG_FILE)
        tcfg = TrainConfig.from_json(run_dir / TRAIN_CONFIG_FILE)
        info = json.loads((run_dir / RUN_FILE).read_text(encoding="utf-8"))
    except (ConfigError, OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"run directory {str(run_dir)!r} is damaged: {exc}") from None
    return cfg, tcfg, info
