"""Muon against AdamW at equal steps on the main job's settings (default corpus, the main job's model, 700
steps of 32 × 128 tokens), with the warmup-cosine schedule the main job had when this was first run, reported
as measured.

Muon (``--optimizer muon``, train/muon.py): Newton–Schulz orthogonalised Nesterov momentum on every layer's
matrices, scaled to AdamW's update RMS (0.2·√max(fan_in, fan_out), Liu et al. 2025) so the same learning rate
and decoupled weight decay apply; AdamW on the embedding, norms and the rest. Runs: AdamW at the main job's lr,
then Muon at each of ``--muon-lrs``, for each seed (``--seeds K``: seeds 0 … K − 1 under OUT/seed<S>; a seed
fixes the initial parameters and the batch order, the same for every arm). Reported per run: final val
bits/byte on the whole val split, the median step time of the training loop (``train_seconds / steps``: Muon's
five Newton–Schulz iterations per matrix are extra matmuls; equal steps, so a busy machine changes these times
and not the bits/byte), and the loss at a few steps; per arm the mean over seeds with its 95 % interval, and
each Muon arm's difference from AdamW with the paired t-test's p-value (``experiments.common.seed_statistics``).
Every run is a normal run directory under --out; one that already finished with the arm's training settings
(its ``summary.json`` and ``train_config.json``; how often it logged, evaluated or checkpointed aside) is read
back instead of trained again, and one that finished with other settings is refused in one line.

    python -m experiments.muon_vs_adamw --out runs/muon            # 3 seeds × 3 arms, ≈ 1 h on 2 cores
    python -m experiments.muon_vs_adamw --out /tmp/m --quick --seeds 2  # 20 tiny steps (a smoke run)
    python -m experiments.muon_vs_adamw --out /tmp/m --timing-only # the two steps timed interleaved (≈ 1 min)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from experiments import common
from mlx_llm.recipes import BASE_MODEL, ADAMW_TRAIN, MAIN_JOB_VOCAB
from mlx_llm.runs.configs import DataSpec
from mlx_llm.runs.pretrain import train_run


def losses_at(run_dir: Path, steps) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    by_step = {r["step"]: r["loss"] for r in rows if "loss" in r}
    return {s: by_step.get(s) for s in steps}


def interleaved_step_times(base, lrs, rounds: int, run_dir: Path, cache_dir=None) -> dict:
    """Median seconds of one compiled training step of each optimizer on the main job's first batch (with
    ``run_dir``'s tokenizer when it has one), the candidates taking turns round by round
    (``common.time_interleaved``), so a change of load hits all alike."""
    recipes = {opt: (BASE_MODEL, dataclasses.replace(base, optimizer=opt, lr=lrs[opt])) for opt in ("adamw", "muon")}
    times = common.interleaved_step_times(recipes, rounds, run_dir, cache_dir, MAIN_JOB_VOCAB, base.seed)
    return {"seconds": times, "muon_vs_adamw": times["muon"] / times["adamw"], "rounds": rounds}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--muon-lrs", default="5e-3,1e-2", help="Muon's peak learning rates, comma-separated")
    ap.add_argument("--data", help="corpus (default: the Python standard library)")
    ap.add_argument("--cache-dir", type=Path)
    ap.add_argument("--quick", action="store_true", help="20 steps of tiny batches (a smoke run)")
    ap.add_argument("--timing-only", action="store_true", help="only the interleaved step timing (results file "
                    "muon_step_time unless --save)")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds")
    common.add_seeds_argument(ap)
    common.add_save_argument(ap, "muon_vs_adamw")
    args = ap.parse_args(argv)
    if args.timing_only:
        base = dataclasses.replace(ADAMW_TRAIN, schedule="cosine")
        result = interleaved_step_times(base, {"adamw": base.lr, "muon": base.lr}, args.rounds,
                                        args.out / f"adamw-lr{base.lr:g}", args.cache_dir)
        print(f"step: adamw {result['seconds']['adamw'] * 1e3:.0f} ms, muon {result['seconds']['muon'] * 1e3:.0f} ms "
              f"({result['muon_vs_adamw']:.3f}×)")
        if args.save != "":  # --save '' writes nothing
            common.save_result(args.save or "muon_step_time", result)
        return 0
    seeds = common.check_seeds(args.seeds)
    base = dataclasses.replace(ADAMW_TRAIN, schedule="cosine", log_interval=25, eval_interval=ADAMW_TRAIN.steps)
    if args.quick:
        base = dataclasses.replace(base, steps=20, batch_size=4, seq_len=32, warmup_steps=2, eval_tokens=512,
                                   eval_interval=20, checkpoint_interval=20, log_interval=5)
    spec = DataSpec(path=args.data, vocab_size=MAIN_JOB_VOCAB)
    arms = {f"adamw-lr{base.lr:g}": ("adamw", base.lr)}
    arms.update({f"muon-lr{float(lr):g}": ("muon", float(lr)) for lr in args.muon_lrs.split(",")})
    checkpoints = sorted({1, base.steps // 4, base.steps // 2, base.steps})

    def run(arm: str, seed: int) -> dict:
        optimizer, lr = arms[arm]
        tcfg = dataclasses.replace(base, optimizer=optimizer, lr=lr, seed=seed)
        out = args.out / f"seed{seed}" / arm
        summary = common.finished_run(out, BASE_MODEL, tcfg) or train_run(
            out, BASE_MODEL, tcfg, spec, show_progress=False, cache_dir=args.cache_dir, sample_tokens=0,
            log=lambda *a: None)
        row = {"optimizer": optimizer, "lr": lr, "steps": tcfg.steps, "val_bpb": summary["val_bpb"],
               "val_loss": summary["val_loss"],
               "step_seconds": summary["train_seconds"] / summary["steps_this_session"],
               "train_loss_at": losses_at(out, checkpoints)}
        print(f"seed {seed} {optimizer} lr {lr:g}: val bits/byte {row['val_bpb']:.4f}, "
              f"{row['step_seconds'] * 1e3:.0f} ms/step", flush=True)
        return row

    rows = common.run_seeds(list(arms), seeds, run)
    for row in rows:
        adamw = next(r for r in rows if r["seed"] == row["seed"] and r["optimizer"] == "adamw")
        row["step_time_vs_adamw"] = row["step_seconds"] / adamw["step_seconds"]
    statistics = common.seed_statistics(rows, "val_bpb", baseline=next(iter(arms)))
    result = {"seeds": seeds, "rows": rows, "statistics": statistics, "train": dataclasses.asdict(base),
              "model": BASE_MODEL.to_dict(), "arguments": common.arguments(args)}
    common.save_result("results", result, args.out)
    common.save_from_args(args, result)
    print(f"val bits/byte over seeds 0–{seeds - 1}, {base.steps} steps each:")
    for line in common.seed_lines(statistics):
        print("  " + line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
