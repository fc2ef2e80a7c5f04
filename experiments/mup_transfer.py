"""Learning-rate transfer across widths, measured: the best peak learning rate of AdamW over a grid, at widths
64 … 512, under the standard parametrization (SP) and under μP (``model.parametrization = "mup"``, base width 64,
base head width 16; Yang et al. 2022, "Tensor Programs V", their Figure 1's experiment at CPU scale).

Every (parametrization, width, learning rate, seed) trains the same recipe: a one-layer model (heads of 16, so
n_heads = d/16, d_ff = 4d: every width dimension grows with d), a 512-token BPE of the Python standard library,
``--steps`` AdamW steps (β = (0.9, 0.95), weight decay 0.1, clipping at 1.0, warmup over a tenth, cosine to 10%)
of ``--batch`` sequences of ``--seq-len`` tokens, then the validation loss on ``--eval-tokens`` held-out targets.
The seed sets both the initial parameters and the batch order. The learning rate enters the compiled step as an
argument (the optimizer's schedule has peak 1 and its update is multiplied by η, which is exactly AdamW at peak η:
everything after the clipping is linear in η), so one program per width and parametrization serves the grid.

The optimum at a width: the grid point of least mean validation loss over the seeds, refined by a parabola in
log₂ η through it and its two neighbours (when it is not at the grid's edge). The shift per doubling of width is
the slope of log₂ η* against log₂ d, fitted per seed (each seed's own optimum at each width) and summarised over
the seeds with ``mlx_llm.stats`` (mean, 95 % t-interval), and the two parametrizations' slopes compared with
Welch's test. ``mlx_llm.stats.welch`` also says, at every width, whether the best rate's loss differs
significantly from its neighbours'.

    python -m experiments.mup_transfer      # the committed run: the defaults (6 CPU-minutes, docs/scaling-laws.md)
    python -m experiments.mup_transfer --widths 64 128 --seeds 2 --steps 40 --lrs 3e-3 1e-2 3e-2   # a smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

import numpy as np

from experiments import common

WIDTHS = (64, 128, 256, 512)
LRS = tuple(2.0 ** k for k in range(-10, -3))  # 9.8e-4 … 6.3e-2, a factor of 2 apart
BASE = 64


def model_config(width: int, parametrization: str, vocab_size: int, seq_len: int):
    from mlx_llm.config import ModelConfig

    mup = {"parametrization": "mup", "mup_base_width": BASE, "mup_base_head_width": 16} if parametrization == "mup" \
        else {}
    return ModelConfig(vocab_size=vocab_size, d_model=width, n_layers=1, n_heads=width // 16, n_kv_heads=width // 16,
                       d_head=16, d_ff=4 * width, max_seq_len=seq_len, **mup)


def trainer(cfg, tcfg):
    """(init(seed) → (params, opt_state), step(params, opt_state, batch, lr) → (params, opt_state, loss)), jitted
    once: the run's optimizer chain (``optimizer_for``, μP multipliers included) at peak 1, its update times lr."""
    import jax
    import jax.numpy as jnp
    import optax

    from mlx_llm.model import init_params
    from mlx_llm.train.step import optimizer_for, summed_loss_and_aux

    opt = optimizer_for(dataclasses.replace(tcfg, lr=1.0), cfg=cfg)

    def init(seed: int):
        params = jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(seed))
        return params, opt.init(params)

    def loss_fn(params, batch):
        total, (count, _) = summed_loss_and_aux(params, batch, cfg, jnp.float32)
        return total / count

    @jax.jit
    def step(params, opt_state, batch, lr):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        updates = jax.tree.map(lambda u: u * lr.astype(u.dtype), updates)
        return optax.apply_updates(params, updates), opt_state, loss

    return init, step


def run_grid(args, corpus) -> list[dict]:
    """Every (parametrization, width, lr, seed) of the grid: its final validation loss and its last train loss."""
    import jax.numpy as jnp

    from mlx_llm.config import TrainConfig
    from mlx_llm.train.parallel import make_mesh
    from mlx_llm.train.step import BATCH_KEYS, evaluate, make_eval_step

    vocab = corpus.tokenizer.vocab_size
    tcfg = TrainConfig(batch_size=args.batch, seq_len=args.seq_len, steps=args.steps,
                       warmup_steps=max(1, args.steps // 10), lr=1.0)
    val_set = corpus.val_batches(args.seq_len, args.batch, args.eval_tokens)
    batches = {seed: [{k: jnp.asarray(v) for k, v in corpus.train_batch(
        s, batch_size=args.batch, seq_len=args.seq_len, seed=seed).items() if k in BATCH_KEYS}
        for s in range(args.steps)] for seed in range(args.seeds)}
    mesh, rows = make_mesh(), []
    for parametrization in ("sp", "mup"):
        for width in args.widths:
            cfg = model_config(width, parametrization, vocab, args.seq_len)
            init, step = trainer(cfg, tcfg)
            eval_step = make_eval_step(cfg, mesh, "ar", None)
            for lr in args.lrs:
                for seed in range(args.seeds):
                    t0 = time.perf_counter()
                    params, opt_state = init(seed)
                    for batch in batches[seed]:
                        params, opt_state, loss = step(params, opt_state, batch, jnp.float32(lr))
                    val = evaluate(eval_step, params, val_set, mesh).loss
                    val = val if math.isfinite(val) else float("inf")  # a diverged run: the worst loss there is
                    rows.append({"parametrization": parametrization, "width": width, "lr": lr, "seed": seed,
                                 "val_loss": val, "train_loss": float(loss), "seconds": time.perf_counter() - t0})
                    print(f"{parametrization:3s} d={width:4d} lr={lr:.3g} seed {seed}: val {val:.4f} "
                          f"({rows[-1]['seconds']:.1f} s)", flush=True)
    return rows


def optimum(lrs, losses) -> tuple[float, bool]:
    """(log₂ η*, whether it sits at the grid's edge): the grid's best point, refined by the parabola in log₂ η through
    it and its neighbours when that parabola is convex."""
    x, y = np.log2(np.asarray(lrs)), np.asarray(losses, dtype=np.float64)
    j = int(np.argmin(y))
    if j in (0, len(x) - 1) or not np.all(np.isfinite(y[j - 1:j + 2])):
        return float(x[j]), True
    c2, c1, _ = np.polyfit(x[j - 1:j + 2], y[j - 1:j + 2], 2)
    return (float(-c1 / (2 * c2)), False) if c2 > 0 else (float(x[j]), False)


def analyse(rows: list[dict], widths, lrs, seeds: int) -> dict:
    from mlx_llm import stats

    out = {}
    for p in ("sp", "mup"):
        table = {(r["width"], r["lr"], r["seed"]): r["val_loss"] for r in rows if r["parametrization"] == p}
        per_width, slopes = {}, []
        for w in widths:
            mean = [np.mean([table[(w, lr, s)] for s in range(seeds)]) for lr in lrs]
            x_star, edge = optimum(lrs, mean)
            j = int(np.argmin(mean))
            entry = {"mean_val_loss": [float(m) for m in mean], "best_grid_lr": lrs[j], "lr_opt": 2.0 ** x_star,
                     "at_edge": edge}
            if seeds >= 2:
                best = [table[(w, lrs[j], s)] for s in range(seeds)]
                entry["best"] = stats.summarize(best).as_dict()
                entry["neighbours"] = {f"{lrs[i]:g}": stats.welch([table[(w, lrs[i], s)] for s in range(seeds)],
                                                                  best).as_dict()
                                       for i in (j - 1, j + 1) if 0 <= i < len(lrs)}
            per_width[str(w)] = entry
        for s in range(seeds):  # each seed's own optimum at each width, then its slope against log2 width
            x = [optimum(lrs, [table[(w, lr, s)] for lr in lrs])[0] for w in widths]
            slopes.append(float(np.polyfit(np.log2(widths), x, 1)[0]))
        x_mean = [math.log2(per_width[str(w)]["lr_opt"]) for w in widths]
        out[p] = {"per_width": per_width, "shift_per_doubling": float(np.polyfit(np.log2(widths), x_mean, 1)[0]),
                  "shift_per_doubling_by_seed": slopes}
        if seeds >= 2:
            out[p]["shift_summary"] = stats.summarize(slopes).as_dict()
            out[p]["shift_described"] = stats.describe(stats.summarize(slopes), digits=3)
    if seeds >= 2:
        diff = stats.welch(out["sp"]["shift_per_doubling_by_seed"], out["mup"]["shift_per_doubling_by_seed"])
        out["sp_minus_mup"] = {**diff.as_dict(), "verdict": stats.verdict(diff, digits=3)}
    return out


def plot(rows, result, widths, lrs, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, p, title in zip(axes, ("sp", "mup"), ("standard parametrization", f"μP (base width {BASE})")):
        for i, w in enumerate(widths):
            entry = result[p]["per_width"][str(w)]
            col = plt.cm.viridis(i / max(len(widths) - 1, 1))
            ax.plot(lrs, entry["mean_val_loss"], "o-", color=col, ms=3, label=f"d = {w}")
            ax.axvline(entry["lr_opt"], color=col, ls=":", lw=1)
        ax.set(xscale="log", xlabel="peak learning rate η", title=f"{title}: shift "
               f"{result[p]['shift_per_doubling']:+.2f} log₂η per doubling")
        ax.grid(alpha=0.3)
    finite = [r["val_loss"] for r in rows if math.isfinite(r["val_loss"])]
    axes[0].set(ylabel="val loss (mean over seeds)", ylim=(min(finite) - 0.05, np.percentile(finite, 90) + 0.1))
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", type=int, nargs="+", default=list(WIDTHS))
    ap.add_argument("--lrs", type=float, nargs="+", default=list(LRS))
    ap.add_argument("--seeds", type=int, default=3, help="seeds per (parametrization, width, lr) (3)")
    ap.add_argument("--steps", type=int, default=40, help="training steps (40)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step (8)")
    ap.add_argument("--seq-len", type=int, default=32, help="tokens per sequence (32)")
    ap.add_argument("--eval-tokens", type=int, default=4096, help="held-out targets scored (4096)")
    ap.add_argument("--out", type=Path, default=common.RESULTS, help="where the plot goes (experiments/results)")
    ap.add_argument("--cache-dir", type=Path, default=None, help="token cache (default ~/.cache/mlx_llm)")
    common.add_save_argument(ap, "mup_transfer")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from mlx_llm.data.corpora import open_data
    from mlx_llm.runs.configs import DataSpec

    if min(args.widths) % 16 or len(args.widths) < 2 or len(args.lrs) < 3:
        print("error: give at least two widths (multiples of 16) and three learning rates", file=sys.stderr)
        return 2
    args.widths, args.lrs = sorted(args.widths), sorted(args.lrs)
    t0 = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    corpus = open_data(args.out, DataSpec(vocab_size=512)).build(args.cache_dir)
    rows = run_grid(args, corpus)
    result = analyse(rows, args.widths, args.lrs, args.seeds)
    plot(rows, result, args.widths, args.lrs, args.out / "mup_transfer.png")
    for p in ("sp", "mup"):
        lr_opt = {w: f"{result[p]['per_width'][str(w)]['lr_opt']:.3g}" for w in args.widths}
        print(f"{p}: optimum η* by width {lr_opt}; shift per doubling {result[p]['shift_per_doubling']:+.3f} log₂η"
              + (f" (by seed: {result[p]['shift_described']})" if args.seeds >= 2 else ""))
    if "sp_minus_mup" in result:
        print(f"SP − μP shift: {result['sp_minus_mup']['verdict']}")
    payload = {"rows": rows, "result": result, "settings": common.arguments(args),
               "seconds": time.perf_counter() - t0}
    common.save_from_args(args, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
