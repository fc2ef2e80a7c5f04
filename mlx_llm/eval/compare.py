"""``mlx-llm compare``: two groups of runs (one per seed each) compared on one metric, with the statistics of
``mlx_llm.stats``: each group's mean, standard deviation and 95 % interval; the difference of means, its 95 %
interval and the two-sided p-value (Welch's t-test, or the paired t-test over runs matched by their seeds).

The metric of a run is the last value of NAME in its ``metrics.jsonl`` (default ``val_bpb``; any numeric key:
``val_loss``, ``val_bpb/<source>``, ``heldout_accuracy``…), else its value in ``summary.json`` (where fine-tuning
runs record their held-out task accuracy), with the step it was read at. What is refused, each in one line naming
the run, before any statistic is computed:

- a run given twice: the same directory (its path resolved, links followed) or a copy of it (the same run id);
- an unfinished run (its last checkpoint short of its steps, unless its command ended there on purpose, or its
  run lock held: it is training now), unless ``allow_unfinished``, which compares the values the runs hold now
  and says at which step each was read;
- runs whose metric was not measured on the same validation data: the same data (its fingerprint, whatever its
  path is called; the absolute path for runs recorded before fingerprints were kept), the same split settings
  (``--val-percent``, extensions, text field, a mixture's sources and weights), the same ``--eval-tokens`` cap
  and, for fine-tuning runs, the same data file or task;
- paired, runs that do not pair one to one by their seeds (``pair_order``).
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import math
import os
from pathlib import Path

from mlx_llm import stats
from mlx_llm.errors import ConfigError
from mlx_llm.runs.record import Run, open_run
from mlx_llm.runs.resume import RESUME_MAY_CHANGE
from mlx_llm.runs.rundir import LOCK_FILE
from mlx_llm.settings import JsonProblem, parse_json, read_json
from mlx_llm.train.metrics import METRICS_FILE, SUMMARY_FILE

DEFAULT_METRIC = "val_bpb"
TRAINED_KINDS = ("pretrain", "sft", "reward", "dpo", "rl")  # written by the training loop, step by step
SEEDS = {"seed": "--seed", "init_seed": "--init-seed", "data_seed": "--data-seed"}  # a run's seed triple


@dataclasses.dataclass(frozen=True)
class Reading:
    """A run's value of the metric and the step it was read at (None when its summary does not say)."""

    value: float
    step: int | None


def metric_of(run: Run, name: str) -> float:
    """The last value of ``name`` in the run's metrics.jsonl, else in its summary.json; refused naming the run
    when it recorded none (or the value is not a finite number)."""
    return read_metric(run, name).value


def read_metric(run: Run, name: str) -> Reading:
    """``metric_of`` and the step of the row it came from; a file that cannot be read is one ``ConfigError``."""
    found = _last_row(run.path / METRICS_FILE, name)
    if found is None and (run.path / SUMMARY_FILE).is_file():
        try:
            summary = read_json(run.path / SUMMARY_FILE)
        except JsonProblem as err:
            raise ConfigError(f"{run.path / SUMMARY_FILE} cannot be read ({err.detail})") from None
        if isinstance(summary, dict) and summary.get(name) is not None:
            found = summary
    if found is None:
        raise ConfigError(f"run {run.path} records no {name!r} (in {METRICS_FILE} or {SUMMARY_FILE}): compare a "
                          f"metric every run has (--metric)")
    value, step = found[name], found.get("step", found.get("steps"))
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"run {run.path}: its {name!r} is {value!r}, not a finite number")
    return Reading(float(value), step if isinstance(step, int) and not isinstance(step, bool) else None)


def _last_row(path: Path, name: str) -> dict | None:
    """The last row of a metrics.jsonl holding ``name``, read line by line (None: no such row, or no file)."""
    if not path.is_file():
        return None
    found = None
    try:
        with open(path, "rb") as fh:
            for n, raw in enumerate(fh, start=1):
                if not raw.strip():
                    continue
                try:
                    row = parse_json(raw.decode("utf-8"), f"{path}:{n}")
                except UnicodeDecodeError as err:
                    raise ConfigError(f"{path}:{n} cannot be read (not UTF-8 text: byte {raw[err.start]:#04x} at "
                                      f"offset {err.start})") from None
                except JsonProblem as err:
                    raise ConfigError(f"{path}:{n} cannot be read ({err.detail})") from None
                if isinstance(row, dict) and row.get(name) is not None:
                    found = row
    except OSError as err:
        raise ConfigError(f"{path} cannot be read ({err.strerror or err})") from None
    return found


# ----- what each run is -------------------------------------------------------------------------------------------
def unfinished(run: Run) -> str | None:
    """Why ``run`` is not finished, in words (None when it is): another process trains in it (its run lock is
    held), or its last checkpoint is short of its steps, unless the command that trained it ended there on purpose
    (a time limit, ``max_seconds``: its summary.json ends at that checkpoint) and it was never extended. Merged and
    imported runs are written whole."""
    if run.kind not in TRAINED_KINDS:
        return None
    if _locked(run.path):
        return f"it is training now (another process holds {run.path / LOCK_FILE})"
    last, steps = run.latest_step(), run.tcfg.steps
    if last is not None and (last >= steps or (run.record.schedule_steps is None and _ended_at(run) == last)):
        return None
    return f"its last checkpoint is {'none' if last is None else f'step {last}'} of its {steps} steps"


def _ended_at(run: Run) -> int | None:
    """The step the run's summary.json says its last command ended at (None: no readable summary)."""
    try:
        summary = read_json(run.path / SUMMARY_FILE)
    except JsonProblem:
        return None
    steps = summary.get("steps") if isinstance(summary, dict) else None
    return steps if isinstance(steps, int) and not isinstance(steps, bool) else None


def _locked(path: Path) -> bool:
    """A run lock held by another open file (``runs.rundir.run_lock``): a shared lock cannot be had. A probe that
    creates and changes nothing."""
    try:
        fd = os.open(path / LOCK_FILE, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def validation_data(run: Run, fingerprints: bool = True) -> dict:
    """What the run's validation metrics were computed on (compared between runs; the settings that choose the
    val split and how much of it is scored): the data by its fingerprint, or, when not every run compared records
    one (``fingerprints`` False), by its absolute path."""
    spec = run.record.data
    data = spec.to_dict() if spec is not None else {}
    out = {k: data.get(k) for k in ("extensions", "val_percent", "text_field")}
    if fingerprints:
        out["data"] = data.get("fingerprint")
        out["mixture"] = [[s.name, s.weight] for s in spec.sources] if spec is not None else []
    else:
        out["data"], out["mixture"] = data.get("path"), data.get("mixture")
    out["eval_tokens"] = run.tcfg.eval_tokens
    settings = run.record.settings.to_dict()
    for key in ("data", "task", "eval_examples"):
        if key in settings:
            out[f"settings.{key}"] = settings[key]
    return out


def seeds_of(run: Run) -> dict[str, int]:
    """The seeds a run used: ``--seed`` (its noise), ``--init-seed`` and ``--data-seed`` (``--seed``'s when unset)."""
    t = run.tcfg
    return {"seed": t.seed, "init_seed": t.params_seed, "data_seed": t.batch_seed}


def _seed_words(run: Run) -> str:
    """The seeds as given: ``seed 0``, then ``init seed 3`` / ``data seed 5`` when set apart from it."""
    t = run.tcfg
    apart = [f"{k.replace('_', ' ')} {getattr(t, k)}" for k in ("init_seed", "data_seed") if getattr(t, k) is not None]
    return ", ".join([f"seed {t.seed}", *apart])


# ----- the checks -------------------------------------------------------------------------------------------------
def _group(paths, what: str) -> list[Run]:
    runs = [p if isinstance(p, Run) else open_run(p) for p in paths]
    if len(runs) < 2:
        raise ConfigError(f"{what} has {len(runs)} run(s): a mean's interval needs at least two runs (seeds)")
    return runs


def _check_distinct(runs: list[Run]) -> None:
    """Each run counts once: not the same directory twice (links resolved), nor a copy of one (its run id)."""
    seen: dict = {}
    for run in runs:
        keys = [("path", str(run.path.resolve()))] + ([("id", run.record.run_id)] if run.record.run_id else [])
        for key in keys:
            if key in seen:
                how = "the same directory" if key[0] == "path" else f"a copy of it (the same run id {key[1]})"
                raise ConfigError(f"run {run.path} is {seen[key].path} again, {how}: each run counts once in a "
                                  f"comparison (give every run one time)")
            seen[key] = run


def _check_finished(runs: list[Run], allow_unfinished: bool) -> None:
    for run in runs:
        why = None if allow_unfinished else unfinished(run)
        if why is not None:
            raise ConfigError(f"run {run.path} is unfinished ({why}): compare finished runs, or give "
                              f"--allow-unfinished to compare the values the runs hold now")


def _check_same_data(runs: list[Run]) -> None:
    fingerprints = all(r.record.data is None or r.record.data.fingerprint is not None for r in runs)
    first = validation_data(runs[0], fingerprints)
    for run in runs[1:]:
        here = validation_data(run, fingerprints)
        if here != first:
            diff = sorted(k for k in first if first[k] != here.get(k))
            raise ConfigError(f"run {run.path} measured its metric on other validation data than {runs[0].path} "
                              f"({', '.join(diff)} differ): their values cannot be compared")


def _settings(run: Run) -> dict:
    """Everything that sets a run's numbers but its seeds (and the execution paths, which change none)."""
    skip = set(SEEDS) | (RESUME_MAY_CHANGE - {"steps"})
    out = {f"model.{k}": v for k, v in run.cfg.to_dict().items()}
    out |= {f"train.{k}": v for k, v in run.tcfg.to_dict().items() if k not in skip}
    out |= {f"settings.{k}": v for k, v in run.record.settings.to_dict().items()}
    out["lora"] = dataclasses.asdict(run.record.lora) if run.record.lora is not None else None
    return out


def pair_order(a: list[Run], b: list[Run]) -> tuple[list[int], list[str], str | None]:
    """(for each run of ``a`` in order, the index of its pair in ``b``; the seeds it was paired by; the seed the
    comparison varies, or None). Pairs have equal seeds — ``--seed``, ``--init-seed``, ``--data-seed``, unset ones
    being ``--seed``'s — except one seed that is the same in every run of a group and other between the groups,
    when nothing else differs: that seed is what the comparison varies (an init-only or data-only study). The
    seeds that vary within a group are the pairing key; the pairing must be one to one. Else refused by name."""
    sa, sb = [seeds_of(r) for r in a], [seeds_of(r) for r in b]
    within = [k for k in SEEDS if len({s[k] for s in sa}) > 1 or len({s[k] for s in sb}) > 1]
    between = [k for k in SEEDS if k not in within and sa[0][k] != sb[0][k]]
    varied = _varied_seed(a, b, between)
    key = [k for k in SEEDS if k != varied]
    for runs, seeds in ((a, sa), (b, sb)):
        keys = [tuple(s[k] for k in key) for s in seeds]
        for i, k in enumerate(keys):
            if keys.count(k) > 1:
                raise ConfigError(f"--paired matches runs by their seeds, and {_seed_words(runs[i])} is used by more "
                                  f"than one run of a group (e.g. {runs[i].path}, {runs[keys.index(k, i + 1)].path})")
    kb = [tuple(s[k] for k in key) for s in sb]
    ka = [tuple(s[k] for k in key) for s in sa]
    for runs, keys, others, where in ((a, ka, kb, "in --against"), (b, kb, ka, "among the first runs")):
        for run, k in zip(runs, keys):
            if k not in others:
                raise ConfigError(f"--paired: run {run.path} ({_seed_words(run)}) has no run with its seeds {where}: "
                                  f"pairs share {' and '.join(SEEDS[s] for s in key)} (unset: --seed's)")
    return [kb.index(k) for k in ka], [k for k in key if k in within], varied


def _varied_seed(a: list[Run], b: list[Run], between: list[str]) -> str | None:
    """The one seed the comparison varies (the same within each group, other between them), checked: the groups
    must differ in nothing else, or the pairs would mix the seed's effect with the settings'."""
    if not between:
        return None
    what = " and ".join(f"{SEEDS[k]} ({seeds_of(a[0])[k]} against {seeds_of(b[0])[k]})" for k in between)
    if len(between) > 1:
        raise ConfigError(f"--paired: the groups differ in {what}: a paired comparison varies one seed at most")
    first = _settings(a[0])
    differ = sorted({k for run in a[1:] + b for k, v in _settings(run).items() if first.get(k) != v})
    if differ:
        raise ConfigError(f"--paired: the groups differ in {what} and in their settings ({', '.join(differ[:5])}): "
                          f"pairs that compare settings need equal seeds (give both the same {SEEDS[between[0]]})")
    return between[0]


# ----- the comparison ---------------------------------------------------------------------------------------------
def compare(a_paths, b_paths, metric: str = DEFAULT_METRIC, *, paired: bool = False,
            allow_unfinished: bool = False) -> dict:
    """The comparison as ``mlx-llm compare --json`` prints it: {"metric", "a": {"runs", "steps", "n", "mean",
    "std", "ci95"}, "b": {…}, "difference": {"mean", "ci95", "p_value", "test"[, "zero_variance"]}}, with
    "paired_by" and "varied_seed" when paired and "unfinished" ({run: why}) when ``allow_unfinished`` let such
    runs in. ``steps``: the step each run's value was read at."""
    a_runs, b_runs = _group(a_paths, "the first group"), _group(b_paths, "the --against group")
    pairing = pair_order(a_runs, b_runs) if paired else None
    if pairing is not None:
        b_runs = [b_runs[i] for i in pairing[0]]
    _check_distinct(a_runs + b_runs)
    _check_finished(a_runs + b_runs, allow_unfinished)
    a_read, b_read = [read_metric(r, metric) for r in a_runs], [read_metric(r, metric) for r in b_runs]
    _check_same_data(a_runs + b_runs)
    a_values, b_values = [r.value for r in a_read], [r.value for r in b_read]
    diff = stats.paired(a_values, b_values) if paired else stats.welch(a_values, b_values)
    out = {"metric": metric,
           "a": {"runs": [str(r.path) for r in a_runs], "steps": [r.step for r in a_read],
                 **stats.summarize(a_values).as_dict()},
           "b": {"runs": [str(r.path) for r in b_runs], "steps": [r.step for r in b_read],
                 **stats.summarize(b_values).as_dict()},
           "difference": diff.as_dict()}
    if pairing is not None:
        out["paired_by"], out["varied_seed"] = pairing[1], pairing[2]
    if allow_unfinished:
        out["unfinished"] = {str(r.path): why for r in a_runs + b_runs if (why := unfinished(r)) is not None}
    return out


def table(result: dict) -> str:
    """The comparison as a short table a person reads."""
    rows = [f"{result['metric']}:"]
    for key, label in (("a", "runs"), ("b", "against")):
        g = result[key]
        rows.append(f"  {label:<8} {stats.describe(stats.Summary(g['n'], g['mean'], g['std'], tuple(g['ci95'])))}"
                    f"  sd {g['std']:.4f}  [{g['ci95'][0]:.4f}, {g['ci95'][1]:.4f}]")
    d = result["difference"]
    rows.append("  difference " + stats.verdict(stats.Difference(d["mean"], tuple(d["ci95"]), d["p_value"],
                                                                 d["test"], d.get("zero_variance", False))))
    if "paired_by" in result:
        by = ", ".join(SEEDS[k] for k in result["paired_by"]) or "nothing (one run per group)"
        varied = f"; the groups differ in {SEEDS[result['varied_seed']]}" if result["varied_seed"] else ""
        rows.append(f"  paired by {by}{varied}")
    if "unfinished" in result:
        for key in ("a", "b"):
            for run, step in zip(result[key]["runs"], result[key]["steps"]):
                why = result["unfinished"].get(run)
                rows.append(f"  {run}: read at step {step}" + (f" (unfinished: {why})" if why else ""))
    return "\n".join(rows)


def as_json(result: dict) -> str:
    """Exactly one JSON object; a statistic that is not finite (values near the float range overflow) is null."""
    return json.dumps(_finite(result), indent=2, allow_nan=False)


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
