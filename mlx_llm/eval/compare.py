"""``mlx-llm compare``: two groups of runs (one per seed each) compared on one metric, with the statistics of
``mlx_llm.stats``: each group's mean, standard deviation and 95 % interval; the difference of means, its 95 %
interval and the two-sided p-value (Welch's t-test, or the paired t-test over runs matched by their seed).

The metric of a run is the last value of NAME in its ``metrics.jsonl`` (default ``val_bpb``; any numeric key:
``val_loss``, ``val_bpb/<source>``, ``heldout_accuracy``…), else its value in ``summary.json`` (where fine-tuning
runs record their held-out task accuracy). Runs are compared only when they measured the metric on the same
validation data: the same corpus settings (``--data``, ``--val-percent``, extensions, text field), the same
``--eval-tokens`` cap and, for fine-tuning runs, the same data file or task.
"""

from __future__ import annotations

import json
import math

from mlx_llm import stats
from mlx_llm.errors import ConfigError
from mlx_llm.runs.record import Run, open_run
from mlx_llm.settings import JsonProblem, parse_json
from mlx_llm.train.metrics import METRICS_FILE, SUMMARY_FILE

DEFAULT_METRIC = "val_bpb"


def metric_of(run: Run, name: str) -> float:
    """The last value of ``name`` in the run's metrics.jsonl, else in its summary.json; refused naming the run
    when it recorded none (or the value is not a finite number)."""
    value = None
    path = run.path / METRICS_FILE
    if path.is_file():
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = parse_json(line, f"{path}:{n}")
            except JsonProblem as err:
                raise ConfigError(f"{path}:{n} cannot be read ({err.detail})") from None
            if isinstance(row, dict) and name in row:
                value = row[name]
    if value is None and (run.path / SUMMARY_FILE).is_file():
        try:
            summary = parse_json((run.path / SUMMARY_FILE).read_text(encoding="utf-8"), str(run.path / SUMMARY_FILE))
        except JsonProblem as err:
            raise ConfigError(f"{run.path / SUMMARY_FILE} cannot be read ({err.detail})") from None
        value = summary.get(name) if isinstance(summary, dict) else None
    if value is None:
        raise ConfigError(f"run {run.path} records no {name!r} (in {METRICS_FILE} or {SUMMARY_FILE}): compare a "
                          f"metric every run has (--metric)")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"run {run.path}: its {name!r} is {value!r}, not a finite number")
    return float(value)


def validation_data(run: Run) -> dict:
    """What the run's validation metrics were computed on (compared between runs; the settings that choose the
    val split and how much of it is scored)."""
    data = run.record.data.to_dict() if run.record.data is not None else {}
    keep = ("path", "mixture", "extensions", "val_percent", "text_field")
    out = {k: data.get(k) for k in keep}
    out["eval_tokens"] = run.tcfg.eval_tokens
    settings = run.record.settings.to_dict()
    for key in ("data", "task", "eval_examples"):
        if key in settings:
            out[f"settings.{key}"] = settings[key]
    return out


def _group(paths, metric: str, what: str) -> tuple[list[Run], list[float]]:
    runs = [p if isinstance(p, Run) else open_run(p) for p in paths]
    if len(runs) < 2:
        raise ConfigError(f"{what} has {len(runs)} run(s): a mean's interval needs at least two runs (seeds)")
    return runs, [metric_of(r, metric) for r in runs]


def _check_same_data(runs: list[Run]) -> None:
    first = validation_data(runs[0])
    for run in runs[1:]:
        here = validation_data(run)
        if here != first:
            diff = sorted(k for k in first if first[k] != here.get(k))
            raise ConfigError(f"run {run.path} measured its metric on other validation data than {runs[0].path} "
                              f"({', '.join(diff)} differ): their values cannot be compared")


def _paired_order(a: list[Run], b: list[Run]) -> list[int]:
    """For each run of ``a`` (in order), the index of the run of ``b`` with its seed; one to one, else refused."""
    seeds_a, seeds_b = [r.tcfg.seed for r in a], [r.tcfg.seed for r in b]
    for runs, seeds in ((a, seeds_a), (b, seeds_b)):
        dupes = sorted({s for s in seeds if seeds.count(s) > 1})
        if dupes:
            raise ConfigError(f"--paired matches runs by seed, and seed {dupes[0]} is used by more than one run of a "
                              f"group (e.g. {runs[seeds.index(dupes[0])].path})")
    for run, seed in zip(a, seeds_a):
        if seed not in seeds_b:
            raise ConfigError(f"--paired: run {run.path} (seed {seed}) has no run with its seed in --against")
    for run, seed in zip(b, seeds_b):
        if seed not in seeds_a:
            raise ConfigError(f"--paired: run {run.path} (seed {seed}) has no run with its seed among the first runs")
    return [seeds_b.index(s) for s in seeds_a]


def compare(a_paths, b_paths, metric: str = DEFAULT_METRIC, *, paired: bool = False) -> dict:
    """The comparison as ``mlx-llm compare --json`` prints it: {"metric", "a": {"runs", "n", "mean", "std",
    "ci95"}, "b": {…}, "difference": {"mean", "ci95", "p_value", "test"}}."""
    a_runs, a_values = _group(a_paths, metric, "the first group")
    b_runs, b_values = _group(b_paths, metric, "the --against group")
    _check_same_data(a_runs + b_runs)
    if paired:
        order = _paired_order(a_runs, b_runs)
        b_runs, b_values = [b_runs[i] for i in order], [b_values[i] for i in order]
        diff = stats.paired(a_values, b_values)
    else:
        diff = stats.welch(a_values, b_values)
    return {"metric": metric,
            "a": {"runs": [str(r.path) for r in a_runs], **stats.summarize(a_values).as_dict()},
            "b": {"runs": [str(r.path) for r in b_runs], **stats.summarize(b_values).as_dict()},
            "difference": diff.as_dict()}


def table(result: dict) -> str:
    """The comparison as a short table a person reads."""
    rows = [f"{result['metric']}:"]
    for key, label in (("a", "runs"), ("b", "against")):
        g = result[key]
        rows.append(f"  {label:<8} {stats.describe(stats.Summary(g['n'], g['mean'], g['std'], tuple(g['ci95'])))}"
                    f"  sd {g['std']:.4f}  [{g['ci95'][0]:.4f}, {g['ci95'][1]:.4f}]")
    d = result["difference"]
    rows.append("  difference " + stats.verdict(stats.Difference(d["mean"], tuple(d["ci95"]), d["p_value"],
                                                                 d["test"])))
    return "\n".join(rows)


def as_json(result: dict) -> str:
    """Exactly one JSON object."""
    return json.dumps(result, indent=2)
