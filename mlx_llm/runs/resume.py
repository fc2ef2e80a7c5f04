"""Resuming a run: the one rule for every command and the library, and the plan a resume follows.

The rule (``check_unchanged``): a resumed run is configured as it was. Every setting given on ``--resume`` (or, from
the library, every field of a whole config given) whose value differs from the stored one is refused by name,
except the fields of ``RESUME_MAY_CHANGE``: the steps (which may only grow), where arrays live and what is
recomputed (mesh, remat) and the execution paths, none of which changes a number beyond float tolerance (DESIGN §6).

``open_resume`` is the one prologue of a resume, for every run kind: it opens the run once, applies the rule and
the allowed changes, and checks the checkpoint it will restore, before anything is written. The ``ResumePlan`` it
returns goes whole to the training loop (``train.loop.fit``), which records what the resume changed only once the
checkpoint is restored.

A pretraining run also continues on the data it trained on: ``check_data`` compares the fingerprint of what its
``--data`` reads now with the one it recorded (``DataSpec.fingerprint``) and refuses a changed corpus by name; a
``--data`` given on resume is compared as the absolute path the run recorded, so another spelling of it is the same.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from mlx_llm.config import TrainConfig
from mlx_llm.data.corpora import data_identity
from mlx_llm.data.text import stdlib_root
from mlx_llm.errors import CheckpointError, ConfigError, DataError, ResumeMismatch
from mlx_llm.runs.configs import DataSpec, data_path
from mlx_llm.runs.record import TRAIN_CONFIG_FILE, Run, open_run, write_record
from mlx_llm.runs.rundir import check_run_dir, checkpoints
from mlx_llm.train.loop import ResumePlan

# TrainConfig fields a resumed run may change (``--from-step`` is not a field: it picks the checkpoint).
RESUME_MAY_CHANGE = frozenset({"steps", "mesh", "remat", "attention_impl", "moe_impl", "loss_chunk"})
SECTION_NAMES = {"model": "model config", "train": "train config", "data": "data settings", "settings": "settings",
                 "lora": "LoRA config"}


def stored_sections(run: Run) -> dict[str, dict]:
    """{section: {field: value}} of what a run was configured with (the sections ``check_unchanged`` compares)."""
    return {"model": run.cfg.to_dict(), "train": run.tcfg.to_dict(),
            "data": run.record.data.to_dict() if run.record.data else {},
            "settings": run.record.settings.to_dict(),
            "lora": dataclasses.asdict(run.record.lora) if run.record.lora else {}}


def given_configs(cfg=None, tcfg=None, spec=None) -> dict[str, dict]:
    """Whole configs given to a library resume as the ``given`` sections of ``check_unchanged`` (None: not given)."""
    out = {}
    for section, config in (("model", cfg), ("train", tcfg), ("data", spec)):
        if config is not None:
            out[section] = config.to_dict()
    out.get("data", {}).pop("fingerprint", None)  # a setting of the record, not asked: ``check_data`` checks the data
    return out


def check_unchanged(run: Run, given: dict[str, dict], flags: dict[str, str] | None = None) -> None:
    """``given``: {section: {field: value}} of what a resume was asked with (sections ``model``, ``train``,
    ``data``, ``settings``, ``lora``); any value that differs from the run's is refused, naming the field (as its
    CLI flag when ``flags`` maps "section.field" to one). Fields of ``RESUME_MAY_CHANGE`` may differ."""
    stored = stored_sections(run)
    changed, by_section = [], {}
    for section, fields in given.items():
        for name, value in fields.items():
            if section == "train" and name in RESUME_MAY_CHANGE:
                continue
            saved = stored[section].get(name)
            if section == "data" and name == "path":  # --data as the run records it: another spelling is the same
                value = data_path(value)
            if _normal(value) != _normal(saved):
                what = (flags or {}).get(f"{section}.{name}", f"{section}.{name}")
                changed.append(f"{what} (given {_shown(value)}, the run has {_shown(saved)})")
                by_section.setdefault(section, {})[name] = (_normal(value), _normal(saved))
    if changed:
        may = ", ".join(sorted((flags or {}).get(f"train.{k}", k) for k in RESUME_MAY_CHANGE))
        detail = "; ".join(f"its {SECTION_NAMES[s]} differs: {d}" for s, d in by_section.items())
        raise ResumeMismatch(f"--resume continues a run exactly as it was configured: {'; '.join(changed)} "
                             f"differ(s) from {str(run.path)!r} ({detail}); only {may} may change on resume (drop "
                             f"the others, or start a new run with another --out)")


def _normal(value):
    """Tuples as lists and paths as absolute strings, as the stored JSON has them."""
    if isinstance(value, tuple):
        return list(value)
    return str(Path(value).resolve()) if isinstance(value, Path) else value


def _shown(value) -> str:
    """A value in a refusal: its repr, or "it unset" (an unset seed is --seed's, not the value None)."""
    return "it unset" if value is None else repr(_normal(value))


# ----- the data a run trained on --------------------------------------------------------------------------------
def identified(spec: DataSpec) -> DataSpec:
    """``spec`` with the fingerprint of what it reads now: the data of a new run, as its record keeps it."""
    return dataclasses.replace(spec, fingerprint=data_identity(spec).fingerprint)


def _where(spec: DataSpec) -> str:
    if spec.sources:
        return "of the mixture " + ", ".join(f"{s.name}={s.path}" for s in spec.sources)
    return f"at {spec.path}" if spec.path is not None else f"(the standard library's .py files under {stdlib_root()})"


def data_change(run: Run) -> tuple[bool, str] | None:
    """None when the data ``run`` names is what it recorded; else (whether it changed, in words): changed, or
    unchecked because the record keeps no fingerprint (written before fingerprints were kept, or imported without
    one). Reads the data's files."""
    spec = run.record.data
    if spec is None:
        return None
    if spec.fingerprint is None:
        return False, (f"{run.path} records no fingerprint of its data (its run.json predates them, or it was "
                       f"imported without one): the data {_where(spec)} is read as it is now, unchecked")
    now = data_identity(spec)
    if now.fingerprint == spec.fingerprint:
        return None
    return True, (f"the data {_where(spec)} changed since {run.path} recorded it (it recorded fingerprint "
                  f"{spec.fingerprint[:12]}; now {now.describe()})")


def check_data(run: Run, log=print, what: str = "--resume continues a run") -> None:
    """Refuse, by name, a run whose data changed since it recorded it (a resume or a branch continues a run on its
    own data); say so when it cannot be checked."""
    change = data_change(run)
    if change is not None and change[0]:
        raise DataError(f"{what} on the data it trained on, and {change[1]}: put those files back, or train a new "
                        f"run on these (another --out)")
    if change is not None:
        log(f"note: {change[1]}")


@dataclasses.dataclass(frozen=True)
class Resume:
    """An accepted resume: the run (opened once), its train config with the allowed changes, and the plan."""

    run: Run
    tcfg: TrainConfig
    plan: ResumePlan
    from_step: int | None = None
    trust_unverified: bool | None = False

    def recheck(self) -> "Resume":
        """The same resume checked again under the run's lock: another process may have changed the run since
        (the run is read again and must equal what was checked; the checkpoint is checked again)."""
        now = open_run(self.run.path)
        if now != self.run:
            raise CheckpointError(f"{str(self.run.path)!r} changed while this command prepared to resume it (another "
                                  f"process wrote to it); run the command again")
        plan = plan_resume(now, self.tcfg, self.from_step, self.trust_unverified)
        return dataclasses.replace(self, plan=dataclasses.replace(plan, on_restored=self.plan.on_restored))


def open_resume(run_dir, *, kind: str | None = None, given: dict | None = None, changes: dict | None = None,
                from_step: int | None = None, trust_unverified: bool | None = False,
                flags: dict[str, str] | None = None) -> Resume:
    """Check a resume of ``run_dir`` before anything is written: the directory holds a run (of ``kind``) that no
    other process trains in; ``given`` (sections, ``check_unchanged``) equals the run's settings; ``changes``
    ({TrainConfig field: value}, fields of ``RESUME_MAY_CHANGE`` only) applied to the stored train config; the
    checkpoint it restores (the latest, or ``from_step``) is intact (a damaged one is refused, naming the previous
    intact one; one without the manifest the run writes too, unless ``trust_unverified``; None leaves that to the
    restore, which knows); ``steps`` may only grow."""
    run = run_dir if isinstance(run_dir, Run) else None
    run_dir = Path(run.path if run is not None else run_dir)
    check_run_dir(run_dir, resume=True)
    run = run if run is not None else open_run(run_dir)
    if kind is not None and run.kind != kind:
        raise ConfigError(f"--resume continues a run exactly as it was configured: {run_dir} is a {run.kind} run, "
                          f"not a {kind} run (resume it with its own command)")
    bad = sorted(set(changes or ()) - RESUME_MAY_CHANGE)
    if bad:
        raise ConfigError(f"a resumed run may change only {sorted(RESUME_MAY_CHANGE)} of its train config, not {bad}")
    check_unchanged(run, given or {}, flags)
    tcfg = dataclasses.replace(run.tcfg, **(changes or {}))
    plan = plan_resume(run, tcfg, from_step, trust_unverified)
    return Resume(run, tcfg, dataclasses.replace(plan, on_restored=lambda: record_resume(run, tcfg, plan)), from_step,
                  trust_unverified)


def plan_resume(run: Run, tcfg: TrainConfig, from_step: int | None = None,
                trust_unverified: bool | None = False) -> ResumePlan:
    """The checkpoint a resume of ``run`` with ``tcfg`` restores, checked (``open_resume``)."""
    saved = run.tcfg
    if tcfg.steps < saved.steps:
        raise ConfigError(f"--steps {tcfg.steps} would shorten {str(run.path)!r}: it was set to {saved.steps} steps; "
                          f"on --resume --steps may only extend a run (more than {saved.steps}); to use an earlier "
                          f"checkpoint, give eval / generate --step N")
    schedule_steps = run.record.schedule_steps or saved.steps
    steps = run.checkpoint_steps()
    if not steps and from_step is None:  # killed before its first checkpoint
        return ResumePlan(None, False, schedule_steps)
    if from_step is not None and from_step not in steps:
        raise CheckpointError(f"--from-step {from_step}: {str(run.path)!r} has no checkpoint {from_step}; its "
                              f"checkpoints are {steps}")
    step = from_step if from_step is not None else steps[-1]
    ckpts = checkpoints(run, trust_unverified=trust_unverified is not False)
    try:
        ckpts.check_intact(step)
    finally:
        ckpts.close()
    return ResumePlan(step, from_step is not None, schedule_steps)


def record_resume(run: Run, tcfg: TrainConfig, plan: ResumePlan) -> None:
    """Write what an accepted resume changed: train_config.json, and (first) run.json's schedule_steps when the
    steps grow. Each file atomically; run.json first, so a crash in between leaves the run as it was."""
    if tcfg == run.tcfg:
        return
    if tcfg.steps != run.tcfg.steps and run.record.schedule_steps is None:
        write_record(run.path, run.record.replace(schedule_steps=plan.schedule_steps))
    tcfg.to_json(run.path / TRAIN_CONFIG_FILE)
