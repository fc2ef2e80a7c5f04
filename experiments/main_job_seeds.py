"""The main job's own noise: ``mlx-llm train`` with its defaults, once per seed, and the val bits/byte over seeds.

Each run is the README's main job (the default MiniLLM on the embedded corpus, 640 steps) with ``--seed S``
(initial parameters and batch order) in a subprocess of its own, one after the other; the token cache is shared, so
only the first run trains the BPE tokenizer and encodes the corpus. The default seed (0) must give the README's
exact digits (the run is deterministic); the others say how far another seed lands from it.

    python -m experiments.main_job_seeds --out runs/main_job_seeds              # seeds 0 … 4 (≈ 25 min on 2 cores)
    python -m experiments.main_job_seeds --out /tmp/mjs --seeds 3 --steps 40 --save ''  # a quick look
    python -m experiments.main_job_seeds --out runs/cosine_seeds --set train.schedule=cosine \
        --save main_job_cosine_seeds   # one setting changed (``mlx-llm train --set``), then `mlx-llm compare`
    python -m experiments.main_job_seeds --out runs/muon_seeds --recipe muon --save main_job_muon_seeds
    python -m experiments.main_job_seeds --out runs/main_job_seeds --against main_job_muon_seeds

Writes experiments/results/main_job_seeds.json (every run's val bits/byte, val loss, steps and loop seconds; the
mean, standard deviation and 95 % interval over seeds) and main_job_seeds.png (the runs and the interval).
``--against NAME`` also compares these runs with a committed results file of this script, paired by seed (for
runs whose directories are gone: ``mlx-llm compare`` reads run directories); the finished runs in ``--out`` are
read back, so it can be added after the runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

from experiments import common
from mlx_llm import stats
from mlx_llm.recipes import ADAMW_TRAIN, BASE_MODEL, MAIN_JOB_MODEL, MAIN_JOB_TRAIN, MUON_TRAIN

PLOT = common.RESULTS / "main_job_seeds.png"
# --recipe: the main job and the recipes it grew out of (recipes.py), as (ModelConfig, TrainConfig)
RECIPES = {"main_job": (MAIN_JOB_MODEL, MAIN_JOB_TRAIN), "muon": (BASE_MODEL, MUON_TRAIN),
           "adamw": (BASE_MODEL, ADAMW_TRAIN)}


def recipe_settings(cfg, tcfg) -> tuple[list[str], int | None]:
    """(``--set`` items, ``--steps`` or None) that turn ``mlx-llm train``'s defaults (the main job's configs) into
    ``cfg`` / ``tcfg``: every field that differs, the steps aside."""

    def text(value):
        if isinstance(value, tuple):
            return ",".join(str(v) for v in value)
        return str(value).lower() if isinstance(value, bool) else str(value)

    out = []
    for section, mine, base in (("model", cfg, MAIN_JOB_MODEL), ("train", tcfg, MAIN_JOB_TRAIN)):
        for f in dataclasses.fields(mine):
            if f.name != "steps" and getattr(mine, f.name) != getattr(base, f.name):
                out.append(f"{section}.{f.name}={text(getattr(mine, f.name))}")
    return out, (None if tcfg.steps == MAIN_JOB_TRAIN.steps else tcfg.steps)


def with_recipe(recipe: str, sets: list[str], steps: int | None) -> tuple[list[str], int | None]:
    """The ``--set`` items and steps of ``recipe`` with the user's ``sets`` / ``steps`` on top (a field set by both
    takes the user's value)."""
    mine, recipe_steps = recipe_settings(*RECIPES[recipe])
    given = {item.partition("=")[0].strip() for item in sets}
    return [item for item in mine if item.partition("=")[0] not in given] + list(sets), steps or recipe_steps


def run_configs(seed: int, steps: int | None, sets: list[str] = ()):
    """The (ModelConfig, TrainConfig) that ``mlx-llm train --seed seed [--steps steps] --set …`` trains."""
    from mlx_llm.cli.flags import apply_sets
    from mlx_llm.config import ModelConfig, TrainConfig

    given = apply_sets({}, list(sets), {"model": ("model", ModelConfig), "train": ("train", TrainConfig)})
    cfg = dataclasses.replace(MAIN_JOB_MODEL, **given.get("model", {}))
    tcfg = dataclasses.replace(MAIN_JOB_TRAIN, **given.get("train", {}), seed=seed,
                               steps=steps or MAIN_JOB_TRAIN.steps)
    return cfg, tcfg


def run_seed(seed: int, out: Path, cache: Path, steps: int | None, sets: list[str] = ()) -> dict:
    """One ``mlx-llm train`` with its defaults, ``sets`` and ``--seed seed`` in a fresh process; its summary's
    numbers. A finished run in its directory is read back when it trained these settings (``common.finished_run``:
    another's is refused in one line)."""
    run_dir = out / f"seed{seed}"
    if common.finished_run(run_dir, *run_configs(seed, steps, sets)) is None:
        cmd = [sys.executable, "-m", "mlx_llm", "train", "--out", str(run_dir), "--seed", str(seed), "--cache-dir",
               str(cache), "--no-progress", "--sample-tokens", "0"]
        if steps is not None:
            cmd += ["--steps", str(steps)]
        for setting in sets:
            cmd += ["--set", setting]
        code = subprocess.run(cmd).returncode
        if code != 0:
            raise SystemExit(f"main_job_seeds: the run of seed {seed} ended with status {code} (its line is above)")
    summary = json.loads((run_dir / "summary.json").read_text())
    row = {"seed": seed, "val_bpb": summary["val_bpb"], "val_loss": summary["val_loss"], "steps": summary["steps"],
           "train_seconds": summary["train_seconds"], "run": str(run_dir)}
    print(f"seed {seed}: val bits/byte {row['val_bpb']:.4f} (val loss {row['val_loss']:.4f}) in {row['steps']} "
          f"steps, loop {row['train_seconds']:.0f} s", flush=True)
    return row


def against_runs(name: str) -> dict[int, float]:
    """{seed: val bits/byte} of the committed results file ``name`` (one line, SystemExit, when it is missing or
    is not this script's)."""
    path = common.RESULTS / f"{name}.json"
    if not path.is_file():
        raise SystemExit(f"main_job_seeds: --against {name!r}: there is no {path}")
    data = common.load_result(name, path.parent)
    runs = data.get("runs") if isinstance(data, dict) else None
    if not runs or not all({"seed", "val_bpb"} <= set(r) for r in runs):
        raise SystemExit(f"main_job_seeds: --against {name!r}: {path} holds no runs with a seed and val_bpb (it is "
                         f"not a results file of this script)")
    return {int(r["seed"]): float(r["val_bpb"]) for r in runs}


def paired_against(rows: list[dict], other: dict[int, float], name: str) -> dict:
    """These runs' val bits/byte minus ``other``'s, paired over the seeds both have (at least 2)."""
    seeds = [r["seed"] for r in rows if r["seed"] in other]
    if len(seeds) < 2:
        raise SystemExit(f"main_job_seeds: --against {name!r} shares {len(seeds)} seed(s) with these runs; a paired "
                         f"test needs at least 2")
    mine = {r["seed"]: r["val_bpb"] for r in rows}
    a, b = [mine[s] for s in seeds], [other[s] for s in seeds]
    d = stats.paired(a, b)
    return {"name": name, "seeds": seeds, "other": stats.summarize(b, name).as_dict(), "difference": d.as_dict(),
            "verdict": stats.verdict(d)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="a directory for the runs (a finished run is reused)")
    ap.add_argument("--cache-dir", type=Path, default=None, help="token cache (default OUT/cache)")
    ap.add_argument("--steps", type=int, default=None, help="override the main job's steps (a quick look only)")
    ap.add_argument("--recipe", choices=sorted(RECIPES), default="main_job", help="the recipe the runs train: the "
                    "main job (default), or one it grew out of: muon (before the knobs, 700 steps), adamw (before "
                    "Muon); passed to mlx-llm train as the --set items and --steps that differ from its defaults")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", dest="sets",
                    help="a setting changed in every run, on top of the recipe (`mlx-llm train --set`; repeat for "
                    "several)")
    ap.add_argument("--against", metavar="NAME", help="a committed results file of this script "
                    "(experiments/results/NAME.json): these runs minus its runs, paired by seed over the seeds both "
                    "have, stored as 'against' in the results")
    common.add_seeds_argument(ap, default=5)
    common.add_save_argument(ap, "main_job_seeds")
    args = ap.parse_args(argv)
    seeds = common.check_seeds(args.seeds)
    if (args.recipe != "main_job" or args.sets or args.steps) and args.save is None:
        raise SystemExit(f"main_job_seeds: give --save NAME for runs of another recipe or settings "
                         f"(--recipe {args.recipe}, {len(args.sets)} --set, --steps {args.steps}); the default file, "
                         f"{args.result_name}.json, holds the main job's own runs")
    other = against_runs(args.against) if args.against else None  # refused before any run
    sets, steps = with_recipe(args.recipe, args.sets, args.steps)
    rows = [run_seed(s, args.out, args.cache_dir or args.out / "cache", steps, sets) for s in range(seeds)]
    what = (f" of the {args.recipe} recipe" if args.recipe != "main_job" else " of the main job") + \
        (f" with {', '.join(args.sets)}" if args.sets else "")
    summary = stats.summarize([r["val_bpb"] for r in rows], "val bits/byte" + what)
    result = {"seeds": seeds, "steps": rows[0]["steps"], "recipe": args.recipe, "settings": sets, "runs": rows,
              "val_bpb": summary.as_dict(),
              "val_loss": stats.summarize([r["val_loss"] for r in rows], "val loss").as_dict(),
              "arguments": common.arguments(args)}
    print(f"val bits/byte over {seeds} seeds: {stats.describe(summary)} (95 % interval "
          f"[{summary.ci95[0]:.4f}, {summary.ci95[1]:.4f}], std {summary.std:.4f})")
    if other is not None:
        result["against"] = paired_against(rows, other, args.against)
        print(f"minus {args.against} over seeds {result['against']['seeds']}: {result['against']['verdict']}")
    if common.save_from_args(args, result) is not None and not sets and steps is None:  # the main job itself
        plot = {"metric": "val_bpb", "arms": {"main job": {"runs": rows, "summary": summary.as_dict()}}}
        common.seed_errorbars(plot, PLOT, "val bits/byte")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
