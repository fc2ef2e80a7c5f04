"""A run's metrics: metrics.jsonl (written by process 0 alone), MoE expert-load rows, the loss plot, the progress
bar and summary.json, shared by every run kind (train/loop.py reads them back and checks them)."""

from __future__ import annotations

import json
from pathlib import Path

from mlx_llm.config import ModelConfig
from mlx_llm.errors import MLXLLMError
from mlx_llm.layers.moe import load_imbalance, per_layer_loads
from mlx_llm.settings import replace_atomic, write_text_atomic
from mlx_llm.train.parallel import is_main_process

METRICS_FILE, PLOT_FILE, SUMMARY_FILE = "metrics.jsonl", "loss.png", "summary.json"


class TrainingDiverged(MLXLLMError):
    """The loss or gradient became non-finite."""


# ----- metrics.jsonl and the plot ----------------------------------------------------------------------------------------------
def truncate_metrics(path: Path, last_step: int) -> None:
    """On resume drop lines of steps after the restored checkpoint: they are about to be recomputed."""
    if not path.exists() or not is_main_process():
        return
    keep = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= last_step]
    path.write_text("".join(line + "\n" for line in keep))


def append_metrics(path: Path, rows: list[dict]) -> None:
    """Append rows to metrics.jsonl (process 0 alone writes; every process computed the same rows)."""
    if not is_main_process():
        return
    with path.open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def write_summary(run_dir: Path, summary: dict) -> dict:
    """Write ``summary`` as the run's summary.json, atomically (a full disk leaves no half a summary); returns it."""
    write_text_atomic(run_dir / SUMMARY_FILE, json.dumps(summary, indent=2) + "\n")
    return summary


def plot_losses(metrics_path: Path, out: Path) -> None:
    """The run's train and val loss against the step, as a PNG. A bare ``Figure`` (no pyplot): drawing it leaves the
    process's matplotlib backend and its open figures alone, so a notebook that trains keeps its inline plots."""
    from matplotlib.figure import Figure

    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line]
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1)
    if val:
        ax.plot(*zip(*val), "o-", label="val loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.subplots_adjust(left=0.1, right=0.98, bottom=0.12, top=0.97)  # fixed margins: tight_layout draws twice
    replace_atomic(out, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))


# ----- readback ---------------------------------------------------------------------------------------------
def expert_load_metrics(load, cfg: ModelConfig) -> dict:
    """Per MoE layer: the fraction of assignments each expert received and max/mean load (1 = even)."""
    layers = per_layer_loads(load, cfg)
    if not layers:
        return {}
    fractions = [(counts / max(counts.sum(), 1.0)).round(5).tolist() for _, counts in layers]
    imbalance = [round(float(load_imbalance(counts)), 5) for _, counts in layers]
    return {"moe_layers": [l for l, _ in layers], "expert_load": fractions, "load_imbalance": imbalance}


def progress_bar(show: bool, start: int, total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=start, disable=not show, unit="step", dynamic_ncols=True)
