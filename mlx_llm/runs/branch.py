"""Branches of a warmup-stable-decay run (``mlx-llm train --branch-from RUN --branch-step S --steps N``).

A WSD schedule (``optim.warmup_stable_decay``) holds the peak learning rate until its last ``decay_fraction`` of
steps, and that stable phase does not depend on the total: so one long run, branched at checkpoints S in its
stable phase and decayed to several budgets N, gives the runs of those budgets for the price of one run plus the
decays (Hägele et al. 2024; the standard trick of scaling-law sweeps). A branch is a new run directory that takes
every setting from RUN but ``steps`` (and where arrays live, ``RESUME_MAY_CHANGE``), starts from RUN's
checkpoint S (parameters, optimizer moments, rng and data cursor, copied byte for byte with its checksum
manifest) and RUN's metrics up to S; from there it is an ordinary run (``--resume`` continues it). A branch at S
with N equal to RUN's steps reproduces RUN's final parameters bitwise.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

from mlx_llm.errors import CheckpointError, ConfigError
from mlx_llm.runs.record import Run, open_run
from mlx_llm.runs.resume import RESUME_MAY_CHANGE
from mlx_llm.runs.rundir import checkpoints
from mlx_llm.train.checkpoint import Checkpoints
from mlx_llm.train.metrics import METRICS_FILE, append_metrics


@dataclasses.dataclass(frozen=True)
class Branch:
    """Where a branch starts: RUN's checkpoint ``step``, with ``changes`` to RUN's train config (``steps``, and
    only fields of ``RESUME_MAY_CHANGE``)."""

    run: Path
    step: int
    changes: dict


def branch_configs(branch: Branch) -> tuple[Run, object]:
    """(RUN, the branch's train config), checked before anything is written: RUN is a pretraining run with a wsd
    schedule it has not extended, S is one of its intact checkpoints, and S lies in the stable phase of both RUN's
    schedule and the branch's (else the two would not share the lr up to S)."""
    run = open_run(branch.run)
    bad = sorted(set(branch.changes) - RESUME_MAY_CHANGE)
    if bad or "steps" not in branch.changes:
        others = sorted(RESUME_MAY_CHANGE - {"steps"})
        raise ConfigError(f"a branch takes every setting from {run.path} but --steps (and {others}): "
                          + (f"{bad} cannot change" if bad else "give --steps N"))
    if run.kind != "pretrain" or run.tcfg.schedule != "wsd":
        raise ConfigError(f"--branch-from {run.path}: only a pretraining run with --schedule wsd can be branched (its "
                          f"lr before the decay does not depend on the total steps); this is a {run.kind} run with "
                          f"schedule {run.tcfg.schedule!r}")
    if run.record.schedule_steps is not None:
        raise ConfigError(f"--branch-from {run.path}: the run was extended past its schedule "
                          f"({run.record.schedule_steps} steps); branch a run that was not")
    tcfg = dataclasses.replace(run.tcfg, **branch.changes)
    s, stable = branch.step, run.tcfg.steps - run.tcfg.decay_steps
    if s not in run.checkpoint_steps():
        raise CheckpointError(f"--branch-step {s}: {run.path} has no checkpoint {s}; its checkpoints are "
                              f"{run.checkpoint_steps()}")
    if s > stable or s > tcfg.steps - tcfg.decay_steps:
        raise ConfigError(f"--branch-step {s} is not in the stable phase: {run.path} decays from step {stable}, a "
                          f"branch of {tcfg.steps} steps from step {tcfg.steps - tcfg.decay_steps}; branch at or "
                          f"before both (or give more --steps)")
    ckpts = checkpoints(run)
    try:
        ckpts.check_intact(s)
    finally:
        ckpts.close()
    return run, tcfg


def start_branch(run_dir: Path, branch: Branch, parent: Run) -> None:
    """Copy RUN's checkpoint S (under a temporary name, then renamed: a crash leaves no partial checkpoint) and
    its metrics rows up to S into the new run directory."""
    source = Checkpoints(parent.path).step_dir(branch.step)
    target = Checkpoints(run_dir).step_dir(branch.step)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.copytree(source, tmp)
    os.replace(tmp, target)
    rows = []
    if (parent.path / METRICS_FILE).is_file():
        for line in (parent.path / METRICS_FILE).read_text(encoding="utf-8").splitlines():
            if line.strip() and json.loads(line).get("step", 0) <= branch.step:
                rows.append(json.loads(line))
    append_metrics(run_dir / METRICS_FILE, rows)
