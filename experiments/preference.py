"""Preference learning from an SFT run, for the same steps or the same wall time each (U19 §11–§13, M20 §16): on-policy RL with the
task's checker as reward under every estimator (group, grpo, dr_grpo, dapo, gspo, ppo: post/estimator.py), RL with
a trained reward model as reward, and DPO; then the β sweep of the KL leash. Every method runs ``--seeds K`` seeds
(``--seed`` 0 … K − 1: initial adapters, batches and samples), and the report gives each method's mean with its
95 % interval and each RL estimator's difference from the group trainer with its p-value (``mlx_llm.stats``,
through ``mlx-llm compare``'s ``eval.compare.compare``, paired by seed).

The start is an SFT run on --task (--sft; default: `experiments.sft_tasks`'s recipe, the main job's model
pretrained then fully fine-tuned for --sft-seconds). A Bradley–Terry reward model is trained from it first
(--rm-seconds; pairs: correct answers against corruptions and the SFT model's own wrong samples). Each method then
trains for --steps steps (equal steps: the comparison to make on a shared machine, where wall time measures the
neighbours) or else for --seconds of loop time (RL's sampling included), at a constant learning rate after warmup; DPO runs
twice, pure (M20 §16) and with the chosen-reply NLL term (``nll_weight`` 1, RPO). Reported per method and seed:
held-out exact match (--eval-examples problems, greedy), KL(π ‖ π_SFT) on held-out prompts (one sampled reply
each, k1), steps, and the per-step curves (RL: mean checker reward of its samples and the KL of its samples to the
reference; DPO: train preference accuracy) in preference_curves.png, with the RL estimators' reward and KL curves
(means over seeds) in rl_algorithms.png. The β sweep trains RL (checker) for --beta-seconds per β and plots reward
against KL (leash_frontier.png). Writes results.json into --out and experiments/results/preference.json
(``--save``; there each per-step curve is thinned to at most 200 evenly spaced steps).

    python -m experiments.preference --out runs/preference [--sft RUN] [--seconds 180] [--seeds 3]
    python -m experiments.preference --out OUT --sft SFT --only rl_checker,rl_grpo,rl_dr_grpo,rl_dapo,rl_gspo,rl_ppo \
        --seeds 3 --steps 20 --batch-size 8 --k 4 --lr 1e-4 --seq-len 64 --eval-examples 200 --save preference_algorithms

``--ppo-grid EPOCHS:LRS`` sweeps PPO's passes over each rollout and its learning rate instead (the methods
``rl_ppo_e{E}_lr{LR}``, every cell over the same seeds, each compared with the group trainer ``rl_checker`` of the
same --out, paired by seed; no β sweep):

    python -m experiments.preference --out OUT --sft SFT --ppo-grid 1,2,4:1e-4,3e-4 --seeds 3 --steps 20 \
        --batch-size 8 --k 4 --seq-len 64 --eval-examples 200 --save preference_ppo_grid

A method's seed whose run directory already holds a summary is read back, not trained again, so a comparison can be
built over several commands (one method each) into the same --out and reported by the last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np

from experiments import common
from mlx_llm import stats
from mlx_llm.eval.compare import compare
from mlx_llm.recipes import BASE_MODEL, ADAMW_TRAIN, MAIN_JOB_VOCAB, PREF_TRAIN, SFT_TRAIN
from mlx_llm.post import prologue as loop
from mlx_llm.data import tasks
from mlx_llm.post.dpo import dpo_run
from mlx_llm.post.reward import reward_run
from mlx_llm.post.rl import rl_run, sampled_kl
from mlx_llm.eval.replies import REPLY_TOKENS
from mlx_llm.post.sft import sft_run
from mlx_llm.runs.configs import DataSpec, DPOConfig, RewardConfig, RLConfig, SFTConfig
from mlx_llm.runs.load import load_params
from mlx_llm.train.metrics import METRICS_FILE
from mlx_llm.runs.pretrain import train_run

LONG = 100_000  # a step count no timed run reaches: --seconds ends it
# the RL estimators with the checker's reward (rl_checker: the group trainer, the baseline of the comparisons)
RL_ALGORITHMS = {"rl_checker": "group", "rl_grpo": "grpo", "rl_dr_grpo": "dr_grpo", "rl_dapo": "dapo",
                 "rl_gspo": "gspo", "rl_ppo": "ppo"}
METHODS = (*RL_ALGORITHMS, "rl_reward_model", "dpo", "dpo_nll")


def ppo_grid(spec: str) -> dict[str, tuple[int, float]]:
    """``"1,2,4:1e-4,3e-4"`` → {``rl_ppo_e1_lr0.0001``: (1, 1e-4), …}: every (epochs, learning rate) pair, or one
    line (SystemExit) naming what is wrong."""
    try:
        epochs_text, lrs_text = spec.split(":")
        epochs = [int(e) for e in epochs_text.split(",")]
        lrs = [float(x) for x in lrs_text.split(",")]
    except ValueError:
        raise SystemExit(f"--ppo-grid {spec!r}: give EPOCHS:LRS, e.g. 1,2,4:1e-4,3e-4 (integers, then numbers)")
    if any(e < 1 for e in epochs) or any(not (0 < x < 1) for x in lrs) or len(set(epochs)) < len(epochs) \
            or len(set(lrs)) < len(lrs):
        raise SystemExit(f"--ppo-grid {spec!r}: the epochs must be distinct integers >= 1 and the learning rates "
                         f"distinct numbers in (0, 1)")
    return {f"rl_ppo_e{e}_lr{x:g}": (e, x) for e in epochs for x in lrs}


def timed(tcfg, steps: int | None = None, **changes):
    """A constant learning rate after warmup (final fraction 1), evaluation only at the end; ``steps`` steps, or
    (None) more than any timed run reaches."""
    return dataclasses.replace(tcfg, steps=steps or LONG, final_lr_fraction=1.0, eval_interval=LONG,
                               checkpoint_interval=LONG, **changes)


def finished(run: Path) -> dict | None:
    """The summary of a run that already ended (its summary.json holds the held-out accuracy), else None."""
    path = run / "summary.json"
    if not path.exists():
        return None
    summary = json.loads(path.read_text())
    return summary if "heldout_accuracy" in summary else None


def sft_start(out: Path, task: str, seconds: float) -> Path:
    """The default start: the main job pretrained into OUT/base, then fully fine-tuned on ``task`` for ``seconds``
    of SFT loop into OUT/sft (either kept if it exists)."""
    base = out / "base"
    if not base.exists():
        spec = DataSpec(vocab_size=MAIN_JOB_VOCAB)
        train_run(base, BASE_MODEL, ADAMW_TRAIN, spec, show_progress=False)
    run = out / "sft"
    if not run.exists():
        tcfg, _ = common.sft_steps_for(base, SFT_TRAIN, task, seconds)
        sft_run(run, base, tcfg=tcfg, settings=SFTConfig(task=task), show_progress=False)
    return run


def heldout_kl(run: Path, sft: Path, task: str, n: int = 200) -> float:
    base = loop.load_base(sft)
    prompts = [tasks.prompt_messages(e) for e in tasks.examples(task, "heldout", n=n)]
    return sampled_kl(load_params(run), base.params, base, prompts, REPLY_TOKENS[task], seed=1)


def curves(run: Path, key: str) -> list:
    rows = [json.loads(line) for line in (run / METRICS_FILE).read_text().splitlines() if line]
    return [(r["step"], r[key]) for r in rows if key in r]


def run_curves(run: Path, name: str) -> dict:
    keys = ("accuracy", "reward", "kl") if name.startswith("rl") else ("accuracy", "margin")
    return {key: curves(run, key) for key in keys}


CURVE_POINTS = 200  # per curve in the committed results file


def thinned(results: dict) -> dict:
    """``results`` with every per-step curve cut to at most CURVE_POINTS evenly spaced steps, the last one kept: the
    file under experiments/results stays small (a 60 s run logs over a thousand steps); OUT's results.json and the
    run directories keep every step."""
    def thin(points: list) -> list:
        if len(points) <= CURVE_POINTS:
            return points
        stride = -(-(len(points) - 1) // (CURVE_POINTS - 1))  # every stride-th step, the last one added: ≤ CURVE_POINTS
        return points[::stride] + ([points[-1]] if (len(points) - 1) % stride else [])

    return {name: {**entry, "curves": [{key: thin(c) for key, c in curves.items()} for curves in entry["curves"]]}
            if isinstance(entry, dict) and "curves" in entry else entry for name, entry in results.items()}


def seed_runs(out: Path, name: str, seeds: int) -> list[Path]:
    """The run directories of a method: OUT/NAME/seed{S} for S = 0 … seeds − 1."""
    return [out / name / f"seed{seed}" for seed in range(seeds)]


def summary_of(values: list) -> dict:
    """Per-seed values, and their mean with its 95 % interval when there are two seeds or more."""
    out = {"per_seed": values}
    if len(values) >= 2:
        out.update(stats.summarize(values).as_dict())
    return out


def mean_curve(runs: list[Path], key: str):
    """The seeds' smoothed curves of ``key``, averaged over the steps they all reach."""
    smoothed = [smooth(curves(run, key)) for run in runs]
    n = min(len(v) for _, v in smoothed)
    return smoothed[0][0][:n], np.mean([v[:n] for _, v in smoothed], axis=0)


def plot_algorithms(out: Path, seeds: int, names: list[str]) -> None:
    """The RL estimators' sampled checker accuracy and KL to the reference per step, means over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name in names:
        runs = seed_runs(out, name, seeds)
        for ax, key in zip(axes, ("accuracy", "kl")):
            ax.plot(*mean_curve(runs, key), label=RL_ALGORITHMS[name])
    axes[0].set_ylabel("checker exact match of the samples (smoothed, mean over seeds)")
    axes[1].set_ylabel("KL of the samples to the reference, Σ_t log π/π_ref (mean over seeds)")
    for ax in axes:
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "rl_algorithms.png", dpi=110)
    plt.close(fig)


def smooth(points, k: int | None = None):
    steps, values = zip(*points)
    k = k or max(1, len(values) // 30)
    return steps[k - 1:], np.convolve(values, np.ones(k) / k, mode="valid")


def plot(results: dict, frontier: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name in (*RL_ALGORITHMS, "rl_reward_model"):
        if name in results:
            axes[0].plot(*smooth(results[name]["curves"][0]["accuracy"]),
                         label=f"{name}: checker exact match of samples (seed 0)")
    if "rl_reward_model" in results:
        axes[0].plot(*smooth(results["rl_reward_model"]["curves"][0]["reward"]), "--",
                     label="rl_reward_model: reward-model score of samples")
    axes[0].set_xlabel("RL step")
    axes[0].set_ylabel("per-step mean (smoothed)")
    axes[0].legend(fontsize=8)
    for name in [n for n in ("dpo", "dpo_nll") if n in results]:
        axes[1].plot(*smooth(results[name]["curves"][0]["accuracy"]), label=f"{name}: train preference accuracy")
    axes[1].set_xlabel("DPO step")
    if any(n in results for n in ("dpo", "dpo_nll")):
        axes[1].legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "preference_curves.png", dpi=110)
    plt.close(fig)
    if not frontier:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    kl = [frontier[b]["kl"] for b in frontier]
    rw = [frontier[b]["reward"] for b in frontier]
    ax.plot(kl, rw, "o-")
    for b, x, y in zip(frontier, kl, rw):
        ax.annotate(f"β = {b}", (x, y), textcoords="offset points", xytext=(5, 5))
    ax.set_xlabel("KL(π ‖ π_SFT) on held-out prompts (nats)")
    ax.set_ylabel("mean checker reward of samples, last 20 steps")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "leash_frontier.png", dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--sft", type=Path, help="an SFT run on --task (default: train one into OUT)")
    ap.add_argument("--task", default="arithmetic", choices=tasks.TASKS)
    ap.add_argument("--sft-seconds", type=float, default=120.0)
    ap.add_argument("--rm-seconds", type=float, default=60.0)
    ap.add_argument("--seconds", type=float, default=180.0, help="loop time of each compared method and seed")
    ap.add_argument("--steps", type=int, help="steps of each compared method and seed (equal steps; overrides "
                    "--seconds)")
    ap.add_argument("--k", type=int, help="RL: replies per prompt (default: the estimator's)")
    ap.add_argument("--lr", type=float, help="learning rate of every method (default: the recipe's)")
    ap.add_argument("--seq-len", type=int, help="sequence length (default: the recipe's; at most the model's)")
    ap.add_argument("--seeds", type=int, default=3, help="seeds of each method (--seed 0 … K − 1)")
    ap.add_argument("--betas", default="0.01,0.05,0.2,1.0")
    ap.add_argument("--beta-seconds", type=float, default=60.0)
    ap.add_argument("--eval-examples", type=int, default=500)
    ap.add_argument("--train-examples", type=int, default=4000, help="task problems the pairs are built from")
    ap.add_argument("--batch-size", type=int, help="prompts (RL) or pairs (DPO) per step (default: the recipe's)")
    ap.add_argument("--replot", action="store_true", help="redraw OUT's plots from its runs and results.json")
    ap.add_argument("--only", help=f"comma-separated methods to run (of {', '.join(METHODS)}); no β sweep")
    ap.add_argument("--ppo-grid", metavar="EPOCHS:LRS",
                    help="PPO's epochs × learning rates, e.g. 1,2,4:1e-4,3e-4 (with rl_checker; no β sweep)")
    common.add_save_argument(ap, "preference")
    args = ap.parse_args()
    if args.seeds < 1:
        ap.error(f"--seeds {args.seeds}: at least 1 (2 or more give intervals and p-values)")
    if args.replot:
        results = common.load_result("results", args.out)
        names = [m for m in METHODS if m in results]
        for name in names:
            results[name]["curves"] = [run_curves(r, name) for r in seed_runs(args.out, name, results.get("seeds", 1))]
        plot(results, results["leash_frontier"], args.out)
        plot_algorithms(args.out, results.get("seeds", 1), [n for n in names if n in RL_ALGORITHMS])
        common.save_result("results", results, args.out)
        return
    grid = {} if args.ppo_grid is None else ppo_grid(args.ppo_grid)
    if grid and args.only is not None:
        ap.error("--ppo-grid runs rl_checker and the grid's cells: leave out --only")
    only = ("rl_checker", *grid) if grid else METHODS if args.only is None else tuple(args.only.split(","))
    if set(only) - set(METHODS) - set(grid):
        ap.error(f"--only {args.only}: the methods are {', '.join(METHODS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    sft = args.sft or sft_start(args.out, args.task, args.sft_seconds)
    quiet = dict(show_progress=False, log=lambda *a: None)
    n_eval, n_pairs = args.eval_examples, args.train_examples
    if args.steps is not None and args.steps < 1:
        ap.error(f"--steps {args.steps}: at least 1")
    batch = {name: value for name, value in (("batch_size", args.batch_size), ("lr", args.lr),
                                             ("seq_len", args.seq_len)) if value is not None}
    seconds = None if args.steps else args.seconds  # equal steps: no time limit
    rl_k = {} if args.k is None else {"k": args.k}
    rm = None
    if "rl_reward_model" in only:
        rm_tcfg = timed(PREF_TRAIN["reward"], **{k: v for k, v in batch.items() if k == "seq_len"})
        rm = reward_run(args.out / "reward", sft, tcfg=rm_tcfg, max_seconds=args.rm_seconds,
                        settings=RewardConfig(task=args.task, model_negatives=True, n_train=n_pairs), **quiet)
        print(f"reward model: held-out preference accuracy {rm['val_accuracy']:.3f} after {rm['steps']} steps",
              flush=True)

    def rl(algorithm="group", lr=None, **settings):
        changes = {**batch, "lr": lr} if lr is not None else batch
        return lambda out, s, seed: rl_run(out, sft, tcfg=timed(PREF_TRAIN["rl"], args.steps, seed=seed, **changes),
                                           max_seconds=s, settings=RLConfig(task=args.task, algorithm=algorithm,
                                                                            eval_examples=n_eval, **rl_k, **settings),
                                           **quiet)

    def dpo(**settings):
        return lambda out, s, seed: dpo_run(out, sft, tcfg=timed(PREF_TRAIN["dpo"], args.steps, seed=seed, **batch),
                                            max_seconds=s, settings=DPOConfig(
                                                task=args.task, model_negatives=True, n_train=n_pairs,
                                                eval_examples=n_eval, **settings), **quiet)

    runs = {**{name: rl(algorithm) for name, algorithm in RL_ALGORITHMS.items()},
            "rl_reward_model": rl(reward_model=args.out / "reward"), "dpo": dpo(), "dpo_nll": dpo(nll_weight=1.0),
            **{name: rl("ppo", lr=lr, epochs=epochs) for name, (epochs, lr) in grid.items()}}
    results = {"sft": str(sft), "task": args.task, "seconds": seconds, "steps": args.steps, "seeds": args.seeds,
               "reward_model": rm, "arguments": common.arguments(args)}
    for name in only:
        per_seed = []
        for seed, run in enumerate(seed_runs(args.out, name, args.seeds)):
            summary = finished(run) or runs[name](run, seconds, seed)
            per_seed.append({"heldout_accuracy": summary["heldout_accuracy"],
                             "sft_heldout_accuracy": summary["base_heldout_accuracy"], "steps": summary["steps"],
                             "kl_to_sft": heldout_kl(run, sft, args.task)})
            print(f"{name} seed {seed}: held-out exact match {summary['base_heldout_accuracy']:.3f} → "
                  f"{summary['heldout_accuracy']:.3f}, KL to SFT {per_seed[-1]['kl_to_sft']:.4f}, "
                  f"{summary['steps']} steps", flush=True)
        results[name] = {"seeds": per_seed, **{key: summary_of([row[key] for row in per_seed])
                                               for key in ("heldout_accuracy", "kl_to_sft", "steps")},
                         "curves": [run_curves(run, name) for run in seed_runs(args.out, name, args.seeds)]}
        if args.seeds >= 2:
            print(f"{name}: held-out exact match {stats.describe(stats.summarize(results[name]['heldout_accuracy']['per_seed']))}",
                  flush=True)
    rl_names = [n for n in only if n in RL_ALGORITHMS or n in grid]
    if args.seeds >= 2 and "rl_checker" in rl_names:
        results["against_group"] = {}
        for name in rl_names:
            if name == "rl_checker":
                continue
            result = compare(seed_runs(args.out, name, args.seeds), seed_runs(args.out, "rl_checker", args.seeds),
                             "heldout_accuracy", paired=True)
            results["against_group"][name] = result["difference"]
            diff = stats.Difference(**{k: (tuple(v) if k == "ci95" else v) for k, v in result["difference"].items()
                                       if k in ("mean", "ci95", "p_value", "test")})
            print(f"{name} − rl_checker, held-out exact match: {stats.verdict(diff)}", flush=True)
    frontier = {}
    for beta in args.betas.split(",") if args.only is None and not grid else ():
        name = f"beta_{beta}"
        rl_run(args.out / name, sft, tcfg=timed(PREF_TRAIN["rl"], **batch), max_seconds=args.beta_seconds,
               settings=RLConfig(task=args.task, beta=float(beta), eval_examples=n_eval), **quiet)
        rewards = [v for _, v in curves(args.out / name, "accuracy")]  # the checker's reward
        frontier[beta] = {"kl": heldout_kl(args.out / name, sft, args.task), "reward": float(np.mean(rewards[-20:]))}
        print(f"β = {beta}: KL {frontier[beta]['kl']:.4f}, reward {frontier[beta]['reward']:.3f}", flush=True)
    results["leash_frontier"] = frontier
    plot(results, frontier, args.out)
    if rl_names and not grid:
        plot_algorithms(args.out, args.seeds, rl_names)
    if grid and args.seeds >= 2:
        results["ppo_grid"] = {name: {"epochs": e, "lr": x, "heldout_accuracy": results[name]["heldout_accuracy"],
                                      "against_group": results["against_group"][name]}
                               for name, (e, x) in grid.items()}
    common.save_result("results", results, args.out)
    common.save_from_args(args, thinned(results))


if __name__ == "__main__":
    main()
