"""The fixed point of every (algorithm, KL placement) pair on the tabular bandits, against the leash's closed form
π* ∝ π_ref e^{r/β} (post/bandit.py; the derivations in docs/post-training.md).

Two bandits: U19 §12's one-token bandit (π_ref = (0.5, 0.3, 0.2), r = (0, 1, 2), β = 1) and the sequence bandit
``bandit.sequence_example()`` (two tokens and an end token, replies of up to three tokens: 15 replies; β = 0.5).
Each pair runs ``--seeds`` seeds of ``--steps`` trainer updates (k = 8 replies, 2 groups per step, AdamW at lr
0.05 decayed to 0 by a cosine), in float32 (``--float64``: as the tests run them); its fixed point is π averaged
over the last tenth of the steps and the seeds.
Reported: the total variation ½ Σ|π − π*| of that average, the per-seed distances (mean and range), and for the
pairs that miss π* the distance to the closed form of what they reach (``per_prefix_fixed_point`` k2/k3;
π* at β·k/(k − 1) for Dr. GRPO). Then the importance-weight rows: a sampler at temperature 0.5 (one token, k2 in
the loss) and a top-p 0.8 sampler (the sequence bandit, the KL in the reward), uncorrected, TIS and MIS.

    python -m experiments.rl_fixed_points [--seeds 4] [--steps 3000] --save rl_fixed_points
    python -m experiments.rl_fixed_points --table rl_fixed_points   # the docs' Markdown tables from a saved result
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from experiments import common
from mlx_llm.post import bandit
from mlx_llm.runs.configs import KL_PLACEMENTS, RL_ALGORITHMS, EstimatorConfig

K, GROUPS, LR = 8, 2, 0.05


def bandits() -> dict:
    seq, seq_ref, seq_r = bandit.sequence_example()
    return {"one_token": (bandit.one_token_bandit(3), np.log([0.5, 0.3, 0.2]), np.array([0.0, 1.0, 2.0]), 1.0),
            "sequence": (seq, seq_ref, seq_r, 0.5)}


def references(b, ref, r, beta) -> dict:
    """The closed forms a pair's fixed point is compared with."""
    star = lambda bt: np.asarray(bandit.closed_form(b, ref, r, bt)["pi"])  # noqa: E731
    return {"pi_star": star(beta), "per_prefix_k2": bandit.per_prefix_fixed_point(b, ref, r, beta, "k2"),
            "per_prefix_k3": bandit.per_prefix_fixed_point(b, ref, r, beta, "k3"),
            "pi_star_beta_k_over_k_minus_1": star(beta * K / (K - 1))}


def measure(b, ref, r, refs, seeds, steps, **settings) -> dict:
    start = time.perf_counter()
    trace = bandit.train(b, ref, r, EstimatorConfig(k=K, **settings), steps=steps, lr=LR, groups=GROUPS,
                         seeds=seeds)
    per_seed = [bandit.total_variation(bandit.fixed_point(trace[i:i + 1]), refs["pi_star"]) for i in range(len(seeds))]
    point = bandit.fixed_point(trace)
    return {"tv_to_pi_star": bandit.total_variation(point, refs["pi_star"]),
            "per_seed_tv": {"mean": float(np.mean(per_seed)), "min": float(np.min(per_seed)),
                            "max": float(np.max(per_seed))},
            **{f"tv_to_{name}": bandit.total_variation(point, want) for name, want in refs.items()
               if name != "pi_star"},
            "fixed_point": point.tolist(), "seconds": time.perf_counter() - start}


# Per (algorithm, KL placement): the closed form its fixed point is predicted to be on each bandit (a key of
# ``references``, or None where there is none) and the reason, as docs/post-training.md derives them.
UNBIASED_REWARD = ("group", "ppo")
PREDICTIONS = {"pi_star": "π*", "per_prefix_k2": "per-prefix k2", "per_prefix_k3": "per-prefix k3",
               "pi_star_beta_k_over_k_minus_1": "π* at βk/(k − 1)"}  # no std division: the reward's expected gradient is unscaled (dr_grpo: by (k−1)/k)


def prediction(algorithm: str, kl: str, bandit_name: str):
    """(the closed form predicted on ``bandit_name``, or None where there is none; the reason) of a pair's fixed
    point."""
    if kl == "reward-k1":
        return "pi_star", "π*: every shaped reward is β ln Z there, so every advantage is 0"
    if kl == "none":
        return None, "no leash: the reward's maximisers"
    if kl == "loss-k1":
        return None, "no leash: k1's expected gradient is 0"
    one = bandit_name == "one_token"
    if algorithm in UNBIASED_REWARD:
        if kl == "loss-k2":
            return ("pi_star" if one else "per_prefix_k2"), \
                "k2's gradient is ∇KL on one token; on replies no later KL reaches a choice (per prefix, Q/β)"
        return "per_prefix_k3", "k3's gradient is the forward KL(π_ref ‖ π)'s (per prefix on replies)"
    if algorithm == "dr_grpo":
        return ("pi_star_beta_k_over_k_minus_1" if one and kl == "loss-k2" else None), \
            "the group mean holds the reply: the reward's gradient × (k − 1)/k, the KL's not" + (
                " (one token: π* at βk/(k − 1))" if kl == "loss-k2" else "; k3's forward KL")
    return None, "the std division weighs the reward against the KL group by group" + (
        "" if kl == "loss-k2" else "; k3's forward KL")


def tables(result: dict) -> str:
    """The docs' Markdown tables: every pair's distance to π* on both bandits, and to its predicted closed form;
    then the importance rows."""
    names = [n for n in ("one_token", "sequence") if n in result["bandits"]]
    lines = ["| `--algorithm` | `--kl` | " + " | ".join(
        f"{n.replace('_', ' ')}: TV to π* (seeds' range) | {n.replace('_', ' ')}: TV to the prediction" for n in names)
        + " | reason |", "|---|---|" + "---|---|" * len(names) + "---|"]
    pairs = result["bandits"][names[0]]["pairs"]
    for key in pairs:
        algorithm, kl = key.split("/")
        cells = []
        for n in names:
            row = result["bandits"][n]["pairs"][key]
            want, _ = prediction(algorithm, kl, n)
            seeds = row["per_seed_tv"]
            cells.append(f"{row['tv_to_pi_star']:.4f} ({seeds['min']:.4f}–{seeds['max']:.4f})")
            cells.append("—" if want is None else
                         f"{row['tv_to_pi_star'] if want == 'pi_star' else row['tv_to_' + want]:.4f} "
                         f"({PREDICTIONS[want]})")
        reasons = {prediction(algorithm, kl, n)[1] for n in names}
        lines.append(f"| {algorithm} | {kl} | " + " | ".join(cells) + " | " + "; ".join(sorted(reasons)) + " |")
    lines += ["", "| bandit | sampler | `--importance` | TV to π* (seeds' range) |", "|---|---|---|---|"]
    for n in names:
        imp = result["bandits"][n]["importance"]
        sampler = ", ".join(f"{k} {v}" for k, v in imp["sampler"].items() if k in ("kl", "temperature", "top_p"))
        for label, row in imp["rows"].items():
            seeds = row["per_seed_tv"]
            lines.append(f"| {n.replace('_', ' ')} | {sampler} | {label} | {row['tv_to_pi_star']:.4f} "
                         f"({seeds['min']:.4f}–{seeds['max']:.4f}) |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--only", help="comma-separated bandits (one_token, sequence)")
    ap.add_argument("--pairs", help="comma-separated ALGORITHM/KL pairs (default: all; no importance rows)")
    ap.add_argument("--float64", action="store_true", help="run in float64, as the tests do")
    ap.add_argument("--table", metavar="NAME", help="print the Markdown tables of experiments/results/NAME.json")
    common.add_save_argument(ap, "rl_fixed_points")
    args = ap.parse_args()
    if args.table:
        print(tables(common.load_result(args.table)))
        return
    if args.float64:
        jax.config.update("jax_enable_x64", True)  # the tests' precision (tests/conftest.py)
    seeds = list(range(args.seeds))
    out = {"k": K, "groups": GROUPS, "lr": LR, "steps": args.steps, "seeds": args.seeds, "dtype": "float64" if args.float64 else "float32",
           "bandits": {}}
    for name, (b, ref, r, beta) in bandits().items():
        if args.only and name not in args.only.split(","):
            continue
        refs = references(b, ref, r, beta)
        rows = {}
        for algorithm in RL_ALGORITHMS:
            for kl in KL_PLACEMENTS:
                if args.pairs and f"{algorithm}/{kl}" not in args.pairs.split(","):
                    continue
                row = measure(b, ref, r, refs, seeds, args.steps, algorithm=algorithm, kl=kl,
                              **({} if kl == "none" else {"beta": beta}))
                rows[f"{algorithm}/{kl}"] = row
                print(f"{name:9s} {algorithm:8s} {kl:10s} TV to π* {row['tv_to_pi_star']:.4f} (seeds "
                      f"{row['per_seed_tv']['min']:.4f}–{row['per_seed_tv']['max']:.4f}); to per-prefix k2 "
                      f"{row['tv_to_per_prefix_k2']:.4f}, k3 {row['tv_to_per_prefix_k3']:.4f}, π*(βk/(k−1)) "
                      f"{row['tv_to_pi_star_beta_k_over_k_minus_1']:.4f}", flush=True)
        if name == "one_token":
            sampler = dict(algorithm="group", kl="loss-k2", beta=beta, temperature=0.5)
            weights = {"none": {}, "tis": dict(importance="tis", is_cap=5.0), "mis": dict(importance="mis", is_cap=5.0)}
        else:
            sampler = dict(algorithm="group", kl="reward-k1", beta=beta, top_p=0.8)
            weights = {"none": {}, "tis": dict(importance="tis", is_cap=100.0, is_level="sequence"),
                       "mis": dict(importance="mis", is_cap=100.0, is_level="sequence")}
        importance = {}
        for label, extra in ({} if args.pairs else weights).items():
            importance[label] = measure(b, ref, r, refs, seeds, args.steps, **sampler, **extra)
            print(f"{name:9s} sampler {sampler} importance {label}: TV to π* {importance[label]['tv_to_pi_star']:.4f}",
                  flush=True)
        out["bandits"][name] = {"beta": beta, "replies": [list(y) for y in b.replies], "rewards": list(map(float, r)),
                                "closed_forms": {k: v.tolist() for k, v in refs.items()}, "pairs": rows,
                                "importance": {"sampler": sampler, "rows": importance}}
    common.save_from_args(args, out)


if __name__ == "__main__":
    main()
