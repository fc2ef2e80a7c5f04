"""Each architecture knob and optimizer option on top of the Muon main job (``recipes.BASE_MODEL`` / ``MUON_TRAIN``,
700 steps: the main job before the knobs), over seeds, at equal wall time: the ablation at the main job's own length.

``experiments.knobs`` compares the knobs at 100 steps against the AdamW recipe; gains measured that short shrank
more than tenfold at 700 steps (variants.md), so the question "does this knob help the main job?" is asked here at
the main job's length, against the main job itself:

1. **Step costs, timed together.** Every arm's compiled training step and the main job's are timed in one process,
   taking turns round by round (``common.time_interleaved``, median of ``--rounds`` rounds after 2 warm-ups), so a
   change of machine load hits all alike. An arm whose step costs within ±5 % of the main job's (the tolerance the
   main job's own wall time is held to) trains the Muon recipe's 700 steps; a dearer or cheaper one trains
   ``round(700 / ratio)`` steps, its warmup (and a window warmup) scaled alike, so every arm gets the same wall time
   of training. The timing is saved (``knobs_main_step_time.json``) and the runs read it back, so the step counts
   are fixed numbers, not a per-run measurement of a noisy machine.
2. **Runs.** Each arm is ``mlx-llm train`` with the arm's settings as ``--set`` (what differs from the command's
   defaults, today's main job, which took three of these knobs on after this ablation) and ``--steps``, seeds
   0 … ``--seeds``−1, one fresh process each (``main_job_seeds.run_seed``); a finished run in ``--out`` is read
   back when it trained the arm's settings (another's is refused), so the ablation can be split over several
   commands.
3. **Comparison.** Per arm: val bits/byte on the whole val split, mean ± 95 % interval over the seeds, and the
   paired difference from the Muon recipe's own runs of the same seeds (``main_job_muon_seeds.json``, the committed
   results of ``experiments.main_job_seeds --recipe muon``) with its p-value; not significant is said so.

Arms: those of ``experiments.knobs`` with Muon as the base, so ``muon`` is the baseline itself and ``normuon`` and
``polar_express`` change Muon's update; ``unet`` and ``embed_scale`` are included (their AdamW runs at 700 steps
are ``main_job_adamw_*_seeds.json``). ``--arms a+b`` is a combination, timed like an arm (``--timing-only --arms
a+b`` adds its row to the saved timing).

    python -m experiments.knobs_main --out runs/knobs_main --timing-only         # the step costs (≈ 8 min)
    python -m experiments.knobs_main --out runs/knobs_main --arms unet,mtp         # 3 seeds each (≈ 13 min an arm)
    python -m experiments.knobs_main --out runs/knobs_main                        # every arm (≈ 3.5 h)

Writes ``experiments/results/knobs_main.json`` (the arms given: settings, steps, runs, summaries, differences) and
``knobs_main.png`` (each arm's difference from the Muon recipe with its interval); the timing goes to
``knobs_main_step_time.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from experiments import common, knobs, main_job_seeds
from mlx_llm import stats
from mlx_llm.recipes import BASE_MODEL, MAIN_JOB_VOCAB, MUON_TRAIN

BASELINE = "main_job"
AGAINST = "main_job_muon_seeds"  # the Muon main job's committed runs, paired by seed
TIMING = "knobs_main_step_time"
TOLERANCE = 0.05  # a step within ±5 % of the Muon recipe's trains its 700 steps
# arms of experiments.knobs that are the Muon recipe itself (Muon at its lr) or change only what Muon replaced
SKIPPED = {knobs.BASELINE, "muon"}
ARMS = [a for a in knobs.ARMS if a not in SKIPPED]


def overrides(arm: str) -> tuple[dict, dict]:
    """(model, train) overrides of ``arm`` on the Muon recipe: the knobs arm's (several joined by "+" are merged in
    order), without what restates its optimizer (Muon at lr 1e-2)."""
    for part in arm.split("+"):
        if part not in ARMS:
            raise SystemExit(f"knobs_main: arm {part!r} is unknown; arms are {', '.join(ARMS)} (joined by '+' to "
                             f"combine)")
    model, train = knobs.arm_overrides(arm)
    train = {k: v for k, v in train.items() if getattr(MUON_TRAIN, k) != v}
    return dict(model), train


def configs(arm: str, steps: int | None = None):
    """The arm's (ModelConfig, TrainConfig): the Muon recipe's with the arm's overrides; with ``steps``, trained
    that many steps with the warmups scaled by steps / 700."""
    model, train = overrides(arm)
    cfg = dataclasses.replace(BASE_MODEL, **model)
    tcfg = dataclasses.replace(MUON_TRAIN, **train)
    if steps is not None and steps != MUON_TRAIN.steps:
        cfg, tcfg = knobs.at_steps(cfg, tcfg, steps)
    return cfg, tcfg


def settings(arm: str, steps: int) -> list[str]:
    """The ``mlx-llm train --set`` items of ``arm`` at ``steps`` steps: what differs from the command's defaults
    (``MAIN_JOB_MODEL`` / ``MAIN_JOB_TRAIN``), the steps aside (``--steps``)."""
    return main_job_seeds.recipe_settings(*configs(arm, steps))[0]


def steps_for(ratio: float) -> int:
    """The main job's steps when the step costs within ±5 % of its own, else the steps of the same wall time."""
    return MUON_TRAIN.steps if abs(ratio - 1.0) <= TOLERANCE else round(MUON_TRAIN.steps / ratio)


def step_timing(arms: list[str], rounds: int, out: Path, cache_dir: Path | None) -> dict:
    """Median seconds of one compiled training step of the main job and of each arm on the main job's first batch,
    taking turns round by round; per arm its ratio to the main job's and the steps it trains (``steps_for``)."""
    recipes = {BASELINE: (BASE_MODEL, MUON_TRAIN)} | {arm: configs(arm) for arm in arms}
    # out has no tokenizer: the main job's BPE, trained anew (or read from the cache)
    times = common.interleaved_step_times(recipes, rounds, out, cache_dir, MAIN_JOB_VOCAB, MUON_TRAIN.seed)
    base = times[BASELINE]
    per_arm = {arm: {"seconds": times[arm], "ratio": times[arm] / base, "steps": steps_for(times[arm] / base)}
               for arm in arms}
    return {"main_job_seconds": base, "rounds": rounds, "tolerance": TOLERANCE, "arms": per_arm}


def merged_timing(new: dict, old: dict | None) -> dict:
    """``old`` (the saved timing) with ``new``'s arms added or replaced; an arm timed in a later session keeps the
    main job's seconds and the rounds of its own session beside its ratio (a ratio is only meaningful against the
    main job timed with it)."""
    if old is None:
        return new
    merged = dict(old, arms=dict(old["arms"]))
    for arm, row in new["arms"].items():
        merged["arms"][arm] = dict(row, main_job_seconds=new["main_job_seconds"], rounds=new["rounds"])
    return merged


def timed_steps(arm: str) -> int:
    """The steps of ``arm`` from the committed timing (one line, SystemExit, when it has not been timed)."""
    path = common.RESULTS / f"{TIMING}.json"
    timing = common.load_result(TIMING, common.RESULTS) if path.is_file() else {"arms": {}}
    if arm not in timing["arms"]:
        raise SystemExit(f"knobs_main: arm {arm!r} has no step timing in {path}; run --timing-only --arms {arm} first")
    return int(timing["arms"][arm]["steps"])


def run_arm(arm: str, seeds: int, out: Path, cache: Path, main: dict[int, float]) -> dict:
    steps = timed_steps(arm)
    sets = settings(arm, steps)
    rows = [main_job_seeds.run_seed(s, out / arm, cache, main_job_seeds.recipe_settings(*configs(arm, steps))[1], sets)
            for s in range(seeds)]
    values = [r["val_bpb"] for r in rows]
    entry = {"model": overrides(arm)[0], "train": overrides(arm)[1], "settings": sets, "steps_mean": steps,
             "runs": rows, "summary": stats.summarize(values, arm).as_dict()}
    entry["vs_baseline"] = stats.paired(values, [main[r["seed"]] for r in rows]).as_dict()
    d = entry["vs_baseline"]
    print(f"{arm}: {stats.describe(stats.summarize(values, arm))}; minus the main job "
          f"{stats.verdict(stats.Difference(d['mean'], tuple(d['ci95']), d['p_value'], d['test']))}", flush=True)
    return entry


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="a directory for the runs (OUT/ARM/seedS)")
    ap.add_argument("--arms", help=f"comma-separated arms, '+' combining several (default: all of {', '.join(ARMS)})")
    ap.add_argument("--cache-dir", type=Path, help="token cache (default OUT/cache)")
    ap.add_argument("--timing-only", action="store_true", help=f"only time the arms' steps against the main job's "
                    f"(added to results file {TIMING}; with --save, a file of these arms alone)")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds (default %(default)s)")
    common.add_seeds_argument(ap, default=3)
    common.add_save_argument(ap, "knobs_main")
    args = ap.parse_args(argv)
    arms = args.arms.split(",") if args.arms else list(ARMS)
    for arm in arms:
        overrides(arm)  # unknown arms refused before anything runs
    cache = args.cache_dir or args.out / "cache"
    if args.timing_only:
        result = step_timing(arms, args.rounds, args.out, cache)
        for arm, row in result["arms"].items():
            print(f"{arm:>16}: {row['seconds'] * 1e3:6.1f} ms/step, {row['ratio']:.3f}× the main job's "
                  f"({result['main_job_seconds'] * 1e3:.1f} ms) → {row['steps']} steps", flush=True)
        if args.save is not None:  # a timing of its own (a repeat): only these arms; '' for none
            if args.save:
                common.save_result(args.save, result)
        else:  # the timing the runs read: these arms added to (or replacing) those timed before
            saved = common.RESULTS / f"{TIMING}.json"
            common.save_result(TIMING, merged_timing(result, common.load_result(TIMING, common.RESULTS)
                                                     if saved.is_file() else None))
        return 0
    seeds = common.check_seeds(args.seeds)
    for arm in arms:
        timed_steps(arm)  # every arm timed before any run
    main_runs = main_job_seeds.against_runs(AGAINST)
    missing = [s for s in range(seeds) if s not in main_runs]
    if missing:
        raise SystemExit(f"knobs_main: {AGAINST}.json has no run of seed(s) {missing}; use --seeds "
                         f"{min(missing)} or run experiments.main_job_seeds for them")
    base_values = [main_runs[s] for s in range(seeds)]
    timing = common.load_result(TIMING, common.RESULTS)
    result = {"comparison": "equal wall time (steps from the interleaved step timing)",
              "seconds": round(timing["main_job_seconds"] * MUON_TRAIN.steps), "steps": None, "seeds": seeds,
              "baseline": BASELINE, "against": AGAINST,
              "arms": {BASELINE: {"model": {}, "train": {}, "settings": [], "steps_mean": MUON_TRAIN.steps,
                                  "runs": [{"seed": s, "val_bpb": v} for s, v in enumerate(base_values)],
                                  "summary": stats.summarize(base_values, BASELINE).as_dict()}},
              "recipe": {"model": BASE_MODEL.to_dict(), "train": MUON_TRAIN.to_dict()},
              "timing": timing, "args": common.arguments(args)}
    for arm in arms:
        result["arms"][arm] = run_arm(arm, seeds, args.out, cache, main_runs)
    print(knobs.markdown_table(result), flush=True)
    path = common.save_from_args(args, result)
    if path is not None:
        knobs.plot(result, path.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
