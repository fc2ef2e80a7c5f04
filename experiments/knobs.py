"""Each architecture knob and optimizer option against the main job's AdamW recipe, over seeds, at equal wall time
or at equal steps.

Arms (``ARMS``): the main job as it was before Muon (``baseline``: ``recipes.BASE_MODEL`` / ``ADAMW_TRAIN``,
AdamW with wsd; the committed ablations were measured against it, and its ``muon`` arm is the Muon recipe,
``recipes.MUON_TRAIN``), and the same recipe with one change each: the logit and attention soft caps, ReLU² (at
the SwiGLU's parameter count) and GeGLU FFNs, value embeddings, U-net skips, zero-initialised residual writers, sandwich norms, the √d embedding
scale, Gemma 3's local/global layers with a RoPE base each, the attention-window warmup, multi-token prediction
(D = 1), and the optimizers (Muon at its better lr of ``muon_vs_adamw``, NorMuon, Muon with Polar Express, cautious
weight decay, per-group learning rates). ``--arms a,b+c`` picks arms; ``b+c`` is a combination (the overrides of
both, the later winning), the way to test the best knobs together.

Equal wall time (the default, the question the main job asks; only on an otherwise idle machine): every arm trains
for the same ``--seconds`` of training loop (``common.train_for_seconds``: the library's ``fit_time_budget`` sizes
the steps from the arm's own measured step time, so a slower arm gets fewer steps). Equal steps (``--steps N``,
the comparison a shared machine allows; it credits a knob with what it learns per step, not with its cost): every
arm trains exactly N steps (``common.train_for_steps``), the recipe's warmup and an arm's window warmup scaled by
N / 700 (the main job's steps), and a finished run already in ``--out`` with the same configs is read back, so
an ablation can be split over several commands that share the baseline's runs. ``--eval-tokens`` caps the final
evaluation (the same first tokens of the val split for every arm; default the whole split); ``--batch-size``
shrinks every arm's batch alike (a cheaper ablation of the same model). Each arm runs for
each of ``--seeds`` seeds (``TrainConfig.seed``: initial parameters and batch order); at equal time seed-major
(every arm of seed 0, then of seed 1, …) so a change of machine load hits all arms alike, at equal steps
arm-major (an arm's seeds one after another). Reported per arm: val bits/byte on the whole
val split, mean ± 95 % interval over the seeds (``mlx_llm.stats.summarize``), and its difference from the baseline
paired by seed (``mlx_llm.stats.paired``: the same seed is the same data order) with the p-value; the verdict says
plainly when a difference is not significant. Written: ``experiments/results/knobs.json`` (every run's numbers,
the summaries, the differences, the arms' overrides) and ``knobs.png`` (each arm's difference from the baseline
with its interval).

    python -m experiments.knobs --out runs/knobs                    # every arm, 3 seeds, 200 s each (≈ 4 h)
    python -m experiments.knobs --out runs/knobs --arms baseline,muon,muon+logit_softcap --seeds 5
    python -m experiments.knobs --out /tmp/k --quick                # 3 arms × 2 seeds of 4 s, tiny batches
    python -m experiments.knobs --out runs/knobs-steps --steps 120 --eval-tokens 65536 --arms baseline,muon
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from experiments import common
from mlx_llm import stats
from mlx_llm.recipes import BASE_MODEL, ADAMW_TRAIN, MAIN_JOB_VOCAB
from mlx_llm.runs.configs import DataSpec

BASELINE = "baseline"
MUON_LR = 1e-2  # Muon's better peak lr on the main job (5e-3 and 1e-2, one run each: muon_vs_adamw.json in git history)
# name → (ModelConfig overrides, TrainConfig overrides) of the main job's recipe
ARMS: dict[str, tuple[dict, dict]] = {
    BASELINE: ({}, {}),
    "logit_softcap": ({"logit_softcap": 15.0}, {}),  # modded-nanogpt's 15
    "attn_softcap": ({"attn_softcap": 20.0}, {}),
    "relu2": ({"ffn_pattern": ("relu2",), "d_ff": 528}, {}),  # 2·d·528 = 3·d·352: the SwiGLU's parameters
    "geglu": ({"ffn_pattern": ("geglu",)}, {}),
    "value_embeds": ({"value_embeds": True}, {}),
    "unet": ({"unet_skips": True}, {}),
    "zero_init": ({"zero_init_out": True}, {}),
    "sandwich_norm": ({"sandwich_norm": True}, {}),
    "embed_scale": ({"embed_scale": True}, {}),
    "local_global": ({"mixer_pattern": ("local", "attn"), "sliding_window": 32, "rope_base": 1e5,
                      "rope_local_base": 1e4}, {}),  # Gemma 3's layout at this scale
    "window_warmup": ({"mixer_pattern": ("local",), "sliding_window": 128, "window_warmup_steps": 350,
                       "window_warmup_start": 16}, {}),  # W = seq_len: global attention once warmed up
    "mtp": ({"mtp_depth": 1}, {"mtp_weight": 0.3}),
    "muon": ({}, {"optimizer": "muon", "lr": MUON_LR}),
    "normuon": ({}, {"optimizer": "normuon", "lr": MUON_LR}),
    "polar_express": ({}, {"optimizer": "muon", "lr": MUON_LR, "polar_express": True}),
    "cautious_wd": ({}, {"cautious_wd": True}),
    "lr_groups": ({}, {"embed_lr_scale": 2.0, "scalar_lr_scale": 2.0}),  # tied: the head is the embedding
}
QUICK_ARMS = (BASELINE, "logit_softcap", "normuon")


def arm_overrides(name: str, quick: bool = False) -> tuple[dict, dict]:
    """The (model, train) overrides of arm ``name``: one of ``ARMS``, or several joined by "+" (merged in order)."""
    model, train = {}, {}
    for part in name.split("+"):
        if part not in ARMS:
            raise SystemExit(f"knobs: arm {part!r} is unknown; arms are {sorted(ARMS)} (joined by '+' to combine)")
        m, t = ARMS[part]
        model |= m
        train |= t
    if quick and "window_warmup_steps" in model:
        model |= {"window_warmup_steps": 5, "sliding_window": 32, "window_warmup_start": 4}
    return model, train


def recipe(quick: bool):
    """The main job's (model, train config), as the runs use it: evaluation on the whole val split at the end.
    ``quick``: tiny batches and a capped evaluation (a smoke run of the script)."""
    tcfg = dataclasses.replace(ADAMW_TRAIN, log_interval=25)
    if quick:
        tcfg = dataclasses.replace(tcfg, batch_size=4, seq_len=32, warmup_steps=2, eval_tokens=512, log_interval=5)
    return BASE_MODEL, tcfg


def at_steps(cfg, tcfg, steps: int):
    """The arm's (model, train config) for a run of ``steps`` steps: the recipe's warmup and a window warmup
    scaled by steps / the recipe's steps (at least 1 each)."""
    def scaled(n):
        return max(1, round(n * steps / ADAMW_TRAIN.steps))

    if cfg.window_warmup_steps:
        cfg = dataclasses.replace(cfg, window_warmup_steps=scaled(cfg.window_warmup_steps))
    return cfg, dataclasses.replace(tcfg, steps=steps, warmup_steps=min(scaled(tcfg.warmup_steps), steps - 1))


def run_arm(name: str, seed: int, out: Path, seconds: float, args) -> dict:
    cfg, tcfg = recipe(args.quick)
    model, train = arm_overrides(name, args.quick)
    cfg = dataclasses.replace(cfg, **model)
    tcfg = dataclasses.replace(tcfg, seed=seed, **train)
    if args.eval_tokens is not None:
        tcfg = dataclasses.replace(tcfg, eval_tokens=args.eval_tokens)
    if args.batch_size is not None:
        tcfg = dataclasses.replace(tcfg, batch_size=args.batch_size)
    spec = DataSpec(path=args.data, vocab_size=MAIN_JOB_VOCAB)
    run_dir = out / f"{name}-seed{seed}"
    if args.steps:
        cfg, tcfg = at_steps(cfg, tcfg, args.steps)
        summary = common.train_for_steps(run_dir, cfg, tcfg, spec, args.steps, cache_dir=args.cache_dir)
    else:
        summary = common.train_for_seconds(run_dir, cfg, tcfg, spec, seconds, cache_dir=args.cache_dir,
                                           label=f"{name} seed {seed}")
    row = {"arm": name, "seed": seed, "val_bpb": summary["val_bpb"], "val_loss": summary["val_loss"],
           "steps": summary["steps_this_session"], "step_seconds": summary["step_seconds"], "run": str(run_dir)}
    print(f"{name} seed {seed}: val bits/byte {row['val_bpb']:.4f} in {row['steps']} steps "
          f"({row['step_seconds'] * 1e3:.0f} ms/step)", flush=True)
    return row


def analyse(rows: list[dict], arms: list[str]) -> dict:
    """Per arm: its runs, the summary of val bits/byte over seeds, and (not the baseline) its paired difference
    from the baseline: negative is better."""
    by_arm = {a: sorted((r for r in rows if r["arm"] == a), key=lambda r: r["seed"]) for a in arms}
    base = [r["val_bpb"] for r in by_arm.get(BASELINE, [])]
    out = {}
    for arm, runs in by_arm.items():
        values = [r["val_bpb"] for r in runs]
        entry = {"model": arm_overrides(arm)[0], "train": arm_overrides(arm)[1], "runs": runs,
                 "summary": stats.summarize(values, arm).as_dict(),
                 "steps_mean": sum(r["steps"] for r in runs) / len(runs)}
        if arm != BASELINE and base:
            entry["vs_baseline"] = stats.paired(values, base).as_dict()
        out[arm] = entry
    return out


def report(result: dict) -> None:
    for arm, entry in result["arms"].items():
        line = f"{arm:>24}: {stats.describe(stats.Summary(**{**entry['summary'], 'ci95': tuple(entry['summary']['ci95'])}))}"
        if "vs_baseline" in entry:
            d = entry["vs_baseline"]
            line += "  vs baseline " + stats.verdict(stats.Difference(d["mean"], tuple(d["ci95"]), d["p_value"],
                                                                      d["test"]))
        print(line, flush=True)


def markdown_table(result: dict) -> str:
    """The docs' table: per arm its val bits/byte (mean ± 95 % half-width over the seeds), mean steps, and its
    paired difference from the baseline with interval, p-value and whether it is significant at p < 0.05."""
    lines = ["| arm | val bits/byte | steps | − baseline (paired) | 95 % interval | p | significant |",
             "|---|---|---|---|---|---|---|"]
    for arm, entry in result["arms"].items():
        s = entry["summary"]
        cells = [f"`{arm}`", f"{s['mean']:.4f} ± {(s['ci95'][1] - s['ci95'][0]) / 2:.4f}", f"{entry['steps_mean']:g}"]
        if "vs_baseline" in entry:
            d = entry["vs_baseline"]
            cells += [f"{d['mean']:+.4f}", f"[{d['ci95'][0]:+.4f}, {d['ci95'][1]:+.4f}]", f"{d['p_value']:.3g}",
                      "yes" if d["p_value"] < stats.SIGNIFICANCE else "**no**"]
        else:
            cells += ["—"] * 4
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """Each arm's paired difference from the baseline (val bits/byte) with its 95 % interval; significant ones
    filled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [(a, e["vs_baseline"]) for a, e in result["arms"].items() if "vs_baseline" in e]
    if not arms:
        return
    fig, ax = plt.subplots(figsize=(7, 0.35 * len(arms) + 1.2))
    for i, (arm, d) in enumerate(arms):
        lo, hi = d["ci95"]
        ax.plot([lo, hi], [i, i], color="tab:blue")
        ax.plot([d["mean"]], [i], "o", color="tab:blue", fillstyle="full" if d["p_value"] < 0.05 else "none")
    ax.axvline(0.0, color="gray", lw=0.8)
    ax.set_yticks(range(len(arms)), [a for a, _ in arms])
    budget = f"{result['steps']} steps" if result.get("steps") else f"{result['seconds']:g} s"
    ax.set_xlabel(f"val bits/byte − baseline's (paired by seed, 95 % interval; {budget} each)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="a directory for the runs (one run directory per arm "
                    "and seed)")
    ap.add_argument("--arms", help=f"comma-separated arms, '+' combining several (default: all of {sorted(ARMS)})")
    ap.add_argument("--seeds", type=int, default=3, help="seeds per arm (at least 2; default %(default)s)")
    ap.add_argument("--seconds", type=float, default=200.0, help="training-loop seconds per run (default "
                    "%(default)s)")
    ap.add_argument("--steps", type=int, help="equal steps instead of equal wall time: every arm trains exactly "
                    "this many steps (warmups scaled from the recipe's 700)")
    ap.add_argument("--eval-tokens", type=int, help="cap on the val targets of the final evaluation (default: the "
                    "recipe's, the whole split)")
    ap.add_argument("--batch-size", type=int, help="windows per step (default: the recipe's 32; a smaller one makes "
                    "a cheaper ablation of the same model)")
    ap.add_argument("--data", help="corpus (default: the Python standard library)")
    ap.add_argument("--cache-dir", type=Path)
    ap.add_argument("--quick", action="store_true", help=f"arms {','.join(QUICK_ARMS)}, 2 seeds of 4 s on tiny "
                    f"batches (a smoke run)")
    common.add_save_argument(ap, "knobs")
    args = ap.parse_args(argv)
    arms = args.arms.split(",") if args.arms else list(QUICK_ARMS if args.quick else ARMS)
    seeds = 2 if args.quick and args.seeds == 3 else args.seeds
    seconds = 4.0 if args.quick and args.seconds == 200.0 else args.seconds
    if args.steps is not None and args.steps < 2:
        raise SystemExit(f"knobs: --steps {args.steps} is too few: a run needs a warmup step and a step after it")
    if seeds < 2:
        raise SystemExit(f"knobs: --seeds {seeds} is too few: an interval over seeds needs at least 2")
    if BASELINE not in arms:
        arms.insert(0, BASELINE)
    for arm in arms:
        arm_overrides(arm)  # unknown arms refused before anything runs
    # equal time: seed-major, so a change of machine load hits every arm alike; equal steps: arm-major, so the arms
    # done when a long ablation is stopped have all their seeds
    order = ([(a, s) for a in arms for s in range(seeds)] if args.steps else
             [(a, s) for s in range(seeds) for a in arms])
    rows = [run_arm(arm, seed, args.out, seconds, args) for arm, seed in order]
    result = {"comparison": "equal steps" if args.steps else "equal wall time",
              "seconds": None if args.steps else seconds, "steps": args.steps, "seeds": seeds, "baseline": BASELINE,
              "arms": analyse(rows, arms),
              "recipe": {"model": recipe(args.quick)[0].to_dict(), "train": recipe(args.quick)[1].to_dict()},
              "args": common.arguments(args)}
    report(result)
    print(markdown_table(result), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "knobs.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    plot(result, args.out / "knobs.png")
    path = common.save_from_args(args, result)
    if path is not None:
        plot(result, path.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
