"""Resuming a run: one rule for every command, and the plan a resume follows.

The rule (``check_unchanged``): a resumed run is configured as it was. Every setting given on ``--resume``
whose value differs from the stored one is refused by name, except the fields of ``RESUME_MAY_CHANGE``: the
steps (which may only grow), where arrays live and what is recomputed (mesh, remat) and the execution paths,
none of which changes a number beyond float tolerance (DESIGN §6).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from mlx_llm.config import TrainConfig
from mlx_llm.errors import CheckpointError, ConfigError
from mlx_llm.runs.record import TRAIN_CONFIG_FILE, Run, open_run, write_record
from mlx_llm.train.checkpoint import Checkpoints

# TrainConfig fields a resumed run may change (``--from-step`` is not a field: it picks the checkpoint).
RESUME_MAY_CHANGE = frozenset({"steps", "mesh", "remat", "attention_impl", "moe_impl", "loss_chunk"})


def check_unchanged(run: Run, given: dict[str, dict], flags: dict[str, str] | None = None) -> None:
    """``given``: {section: {field: value}} of what a resume was asked with (sections ``model``, ``train``,
    ``data``, ``settings``, ``lora``); any value that differs from the run's is refused, naming the field (as its
    CLI flag when ``flags`` maps "section.field" to one). Fields of ``RESUME_MAY_CHANGE`` may differ."""
    stored = {"model": run.cfg.to_dict(), "train": run.tcfg.to_dict(),
              "data": run.record.data.to_dict() if run.record.data else {},
              "settings": run.record.settings.to_dict(),
              "lora": dataclasses.asdict(run.record.lora) if run.record.lora else {}}
    changed = []
    for section, fields in given.items():
        for name, value in fields.items():
            if section == "train" and name in RESUME_MAY_CHANGE:
                continue
            saved = stored[section].get(name)
            if _normal(value) != _normal(saved):
                what = (flags or {}).get(f"{section}.{name}", f"{section}.{name}")
                changed.append(f"{what} (given {_normal(value)!r}, the run has {_normal(saved)!r})")
    if changed:
        may = ", ".join(sorted((flags or {}).get(f"train.{k}", k) for k in RESUME_MAY_CHANGE))
        raise ConfigError(f"--resume continues a run exactly as it was configured: {'; '.join(changed)} "
                          f"differ(s) from {str(run.path)!r}; only {may} may change on resume (drop the others, "
                          f"or start a new run with another --out)")


def _normal(value):
    """Tuples as lists and paths as absolute strings, as the stored JSON has them."""
    if isinstance(value, tuple):
        return list(value)
    return str(Path(value).resolve()) if isinstance(value, Path) else value


@dataclasses.dataclass(frozen=True)
class ResumePlan:
    """What a resumed run restores and the schedule it follows."""

    step: int | None  # the checkpoint to restore (None: none was written yet, the run starts over)
    from_step: bool  # chosen with --from-step: the checkpoints after it are set aside
    schedule_steps: int  # the total warmup_cosine is defined over (the run's first ``steps``, once extended)


def plan_resume(run_dir: Path, tcfg: TrainConfig, from_step: int | None = None,
                trust_unverified: bool | None = False) -> ResumePlan:
    """Check a resume of ``run_dir`` with ``tcfg`` before anything is written: the checkpoint it restores (the
    latest, or ``from_step``) must be intact (a damaged one is refused, naming the previous intact one; one without
    the manifest the run writes too, unless ``trust_unverified``; None leaves that to the restore, which knows), and
    ``steps`` may only grow (a smaller value would end the run before steps it has taken)."""
    run = open_run(run_dir)
    saved = run.tcfg
    if tcfg.steps < saved.steps:
        raise ConfigError(f"--steps {tcfg.steps} would shorten {str(run_dir)!r}: it was set to {saved.steps} steps; on "
                          f"--resume --steps may only extend a run (more than {saved.steps}); to use an earlier "
                          f"checkpoint, give eval / generate --step N")
    schedule_steps = run.record.schedule_steps or saved.steps
    steps = run.checkpoint_steps()
    if not steps and from_step is None:  # killed before its first checkpoint
        return ResumePlan(None, False, schedule_steps)
    if from_step is not None and from_step not in steps:
        raise CheckpointError(f"--from-step {from_step}: {str(run_dir)!r} has no checkpoint {from_step}; its "
                              f"checkpoints are {steps}")
    step = from_step if from_step is not None else steps[-1]
    ckpts = Checkpoints(run_dir, trust_unverified=trust_unverified is not False)
    try:
        ckpts.check_intact(step)
    finally:
        ckpts.close()
    return ResumePlan(step, from_step is not None, schedule_steps)


def resume_plan(run_dir: Path, changes: dict | None = None, from_step: int | None = None,
                trust_unverified: bool | None = False) -> tuple:
    """(run, train config, ``ResumePlan``) of a resume of ``run_dir``, checked before anything is written:
    ``changes`` ({TrainConfig field: value}, fields of ``RESUME_MAY_CHANGE`` only) applied to the stored train
    config, the checkpoint it restores intact (``trust_unverified``: see ``plan_resume``), ``steps`` not shrunk.
    ``record_resume`` writes it once accepted."""
    run = open_run(run_dir)
    bad = sorted(set(changes or ()) - RESUME_MAY_CHANGE)
    if bad:
        raise ConfigError(f"a resumed run may change only {sorted(RESUME_MAY_CHANGE)} of its train config, not {bad}")
    tcfg = dataclasses.replace(run.tcfg, **(changes or {}))
    return run, tcfg, plan_resume(run_dir, tcfg, from_step, trust_unverified)


def record_resume(run_dir: Path, tcfg: TrainConfig, plan: ResumePlan) -> None:
    """Write what an accepted resume changed: train_config.json, and (first) run.json's schedule_steps when the
    steps grow. Each file atomically; run.json first, so a crash in between leaves the run as it was."""
    run = open_run(run_dir)
    if tcfg == run.tcfg:
        return
    if tcfg.steps != run.tcfg.steps and run.record.schedule_steps is None:
        write_record(run.path, run.record.replace(schedule_steps=plan.schedule_steps))
    tcfg.to_json(Path(run_dir) / TRAIN_CONFIG_FILE)


def schedule_config(tcfg: TrainConfig, schedule_steps: int | None = None) -> TrainConfig:
    """``tcfg`` as the optimizer sees it: the warmup-cosine is defined over ``schedule_steps``, an extended run's
    original total, not over its new ``steps``. The extension rule: the steps a run has taken keep their lr, and
    the steps an extension adds run at the final lr, peak·final_lr_fraction, which is what ``warmup_cosine``
    gives after its end. No step of the extension re-raises the lr the run has annealed (a re-warm would undo
    part of the anneal), and the optimizer state is the same structure, so it restores as is."""
    if schedule_steps is None or schedule_steps == tcfg.steps:
        return tcfg
    return dataclasses.replace(tcfg, steps=schedule_steps)
