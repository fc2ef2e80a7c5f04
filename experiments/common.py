"""What the experiments share: step timing, equal-time training, and results written with their provenance.

Timing. ``seconds`` times one call, waiting for its result with ``jax.block_until_ready``; ``time_steps`` is the
median (or ``stat``) of ``rounds`` calls after ``warmup`` untimed ones (the first compiles). Scripts that compare
several paths side by side use ``time_interleaved``: every round runs each candidate once, in turn, so a change
of machine load during the run hits all of them alike. ``carry`` turns a training step ``state, out = step(state,
*args)`` into a function of no arguments that keeps its own state, so a step is timed like anything else.

Equal time. ``train_for_seconds`` sizes a pretraining run with the library's own ``fit_time_budget`` (the step
timed by ``mlx_llm.train.lm.seconds_per_step`` on the run's first batch, after compiling), the path
``mlx-llm train --time-budget`` takes. Fine-tuning steps have no such function in the library, so
``sft_steps_for`` times them here (``sft_seconds_per_step``, on real packed task rows, LoRA or full).
Equal steps. ``train_for_steps`` trains exactly N steps (a comparison that a shared machine's load cannot bias),
reading back a finished run of the same configs instead of training it again.

Results. ``save_result(name, payload)`` writes experiments/results/NAME.json: the payload's own keys unchanged
(a list payload becomes ``{"rows": [...]}``) plus ``provenance``: the git commit and whether the tree differed
from it (``git status --porcelain``, the results directory itself not counted), the versions of the numerical
stack, the devices, the command (``python -m experiments.NAME ...``), the XLA/JAX environment variables set, the
host's load average and the UTC date. ``add_save_argument`` / ``save_from_args`` give every script the same
``--save NAME`` option.

Nothing here imports jax at module level: the TPU-compile scripts set ``JAX_PLATFORMS`` before jax is imported.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping

EXPERIMENTS = Path(__file__).resolve().parent
REPO = EXPERIMENTS.parent
CONFIGS = EXPERIMENTS / "configs"
RESULTS = EXPERIMENTS / "results"
VERSIONED = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "torch", "transformers", "libtpu",
             "jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin", "jax-cuda13-pjrt")  # the gpu extra
ENVIRONMENT = ("JAX_PLATFORMS", "JAX_ENABLE_X64", "XLA_FLAGS", "CUDA_VISIBLE_DEVICES", "TPU_VISIBLE_CHIPS")
MAX_LISTED_CHANGES = 50
LONG = 10**9  # an interval no run reaches; fit_time_budget caps it to the run's steps (evaluate once, at the end)


# ----- timing -------------------------------------------------------------------------------------------------
def timed(fn: Callable, *args, **kwargs) -> tuple[Any, float]:
    """(``fn(*args, **kwargs)``, wall seconds of the call), the result waited for with ``jax.block_until_ready``."""
    import jax

    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args, **kwargs))
    return out, time.perf_counter() - start


def seconds(fn: Callable, *args, **kwargs) -> float:
    """Wall seconds of one call of ``fn(*args, **kwargs)``, its result waited for."""
    return timed(fn, *args, **kwargs)[1]


def step_times(fn: Callable, *args, warmup: int = 1, rounds: int = 5) -> list[float]:
    """Seconds of each of ``rounds`` calls of ``fn(*args)``, after ``warmup`` untimed calls (the first compiles)."""
    for _ in range(warmup):
        seconds(fn, *args)
    return [seconds(fn, *args) for _ in range(rounds)]


def time_steps(fn: Callable, *args, warmup: int = 1, rounds: int = 5, stat: Callable = statistics.median) -> float:
    """``stat`` (median by default; ``min`` for best-of) of ``step_times``."""
    return float(stat(step_times(fn, *args, warmup=warmup, rounds=rounds)))


def interleaved_times(candidates: Mapping[str, Callable[[], Any]], *, warmup: int = 1, rounds: int = 5,
                      self_timed: bool = False) -> dict[str, list[float]]:
    """Seconds of every round of every candidate (functions of no arguments), the candidates taking turns within
    each round after ``warmup`` untimed calls each. ``self_timed``: each candidate returns its own seconds (for a
    call with an untimed set-up, a prefill say) instead of being timed whole."""
    measure = (lambda fn: fn()) if self_timed else seconds
    for fn in candidates.values():
        for _ in range(warmup):
            measure(fn)
    times = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            times[name].append(float(measure(fn)))
    return times


def time_interleaved(candidates: Mapping[str, Callable[[], Any]], *, warmup: int = 1, rounds: int = 5,
                     stat: Callable = statistics.median, self_timed: bool = False) -> dict[str, float]:
    """``stat`` of each candidate's ``interleaved_times``."""
    times = interleaved_times(candidates, warmup=warmup, rounds=rounds, self_timed=self_timed)
    return {name: float(stat(t)) for name, t in times.items()}


def carry(step: Callable, state, *args) -> Callable[[], Any]:
    """A function of no arguments running ``state, out = step(state, *args)`` on a state it keeps (the next call
    continues from the new one, so donated buffers are never reused) and returning ``out``; ``.state()`` and
    ``.last()`` read the current state and the last call's ``out``."""
    box = [state, None]

    def run():
        box[0], box[1] = step(box[0], *args)
        return box[1]

    run.state, run.last = (lambda: box[0]), (lambda: box[1])
    return run


def interleaved_step_times(recipes: Mapping[str, tuple[Any, Any]], rounds: int, run_dir: Path, cache_dir=None,
                           vocab_size: int = 1024, seed: int = 0) -> dict[str, float]:
    """Median seconds of one compiled training step of each ``name: (ModelConfig, TrainConfig)`` on the same first
    batch of the main job's corpus (``run_dir``'s tokenizer when it has one, else its BPE of ``vocab_size`` trained
    anew), the candidates taking turns round by round after 2 warm-ups (``time_interleaved``), so a change of the
    machine's load hits all alike. The batch's shape and the mesh are the first recipe's (they must agree)."""
    from mlx_llm.data import encoding as encoding_lib
    from mlx_llm.data.corpora import read_text_and_tokenizer
    from mlx_llm.runs.configs import DataSpec
    from mlx_llm.train.parallel import make_mesh
    from mlx_llm.train.step import device_batch, init_state, jit_train_step, optimizer_for, place_state

    first = next(iter(recipes.values()))[1]
    shapes = {(t.batch_size, t.seq_len, t.mesh) for _, t in recipes.values()}
    if len(shapes) != 1:
        raise ValueError(f"interleaved_step_times: the recipes disagree on (batch_size, seq_len, mesh): "
                         f"{sorted(shapes)}; one batch is timed for all")
    tok, text = read_text_and_tokenizer(run_dir, DataSpec(vocab_size=vocab_size), cache_dir)
    corpus = encoding_lib.encode_corpus(text, tok, cache_dir)
    mesh = make_mesh(first.mesh)
    batch = device_batch(corpus.train_batch(0, batch_size=first.batch_size, seq_len=first.seq_len, seed=seed), mesh,
                         first.batch_size)
    candidates = {}
    for name, (cfg, tcfg) in recipes.items():
        cfg = dataclasses.replace(cfg, vocab_size=tok.vocab_size)
        state = place_state(init_state(cfg, tcfg, optimizer_for(tcfg, cfg=cfg)), mesh)
        candidates[name] = carry(jit_train_step(cfg, tcfg, mesh, tok.mask_id), state, batch)
        print(f"compiled {name}", flush=True)
    return time_interleaved(candidates, warmup=2, rounds=rounds)


def matmul_timer(n: int, dtype: str = "float32", calls: int = 3) -> tuple[Callable[[], float], float]:
    """(a self-timed candidate: the best seconds of ``calls`` jitted n×n products, float32 accumulation, compiled
    and warmed; the FLOPs of one product, 2n³): the machine's matmul peak, timed alongside a step."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    dot = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32))
    seconds(dot, a, a)
    return (lambda: min(seconds(dot, a, a) for _ in range(calls))), 2.0 * n**3


# ----- equal-time training -----------------------------------------------------------------------------------
def train_for_seconds(run_dir, cfg, tcfg, spec, budget: float, *, cache_dir=None, label: str | None = None) -> dict:
    """``train_run`` with as many steps as fit ``budget`` seconds of training loop, chosen by the library's
    ``fit_time_budget``; evaluation and checkpoint only at the end. Prints the budget's line; returns the run's
    summary plus ``step_seconds``, the loop's measured seconds per step (train_seconds / steps)."""
    from mlx_llm.runs.pretrain import train_run

    label = label or Path(run_dir).name

    def log(*parts):
        text = " ".join(str(p) for p in parts)
        if text.startswith("time budget"):
            print(f"{label}: {text}", flush=True)

    tcfg = dataclasses.replace(tcfg, eval_interval=LONG, checkpoint_interval=LONG)
    summary = train_run(run_dir, cfg, tcfg, spec, cache_dir=cache_dir, show_progress=False, time_budget=budget,
                        log=log)
    return {**summary, "step_seconds": summary["train_seconds"] / max(summary["steps_this_session"], 1)}


def train_for_steps(run_dir, cfg, tcfg, spec, steps: int, *, cache_dir=None) -> dict:
    """``train_run`` of exactly ``steps`` steps (the schedule sized to them), evaluation and checkpoint only at the
    end: the equal-steps counterpart of ``train_for_seconds``, whose comparisons hold on a shared machine. A
    ``run_dir`` that already holds a finished run of the same configs is read back instead of trained again (a run
    is deterministic), so a comparison can be split over several commands that share its baseline; one of other
    configs is refused. Returns the summary plus ``step_seconds`` (train_seconds / steps; the load of the machine
    at the time, not a property of the arm)."""
    from mlx_llm.runs.pretrain import train_run

    tcfg = dataclasses.replace(tcfg, steps=steps, eval_interval=LONG, checkpoint_interval=LONG)
    summary = finished_run(run_dir, cfg, tcfg) or train_run(run_dir, cfg, tcfg, spec, cache_dir=cache_dir,
                                                            show_progress=False, log=lambda *a: None)
    return {**summary, "step_seconds": summary["train_seconds"] / max(summary["steps_this_session"], 1)}


# how often a run logs, evaluates and checkpoints does not change what it trains
NOT_TRAINING = ("log_interval", "eval_interval", "checkpoint_interval", "keep_checkpoints")


def finished_run(run_dir, cfg, tcfg) -> dict | None:
    """The summary of the run that finished in ``run_dir`` with model ``cfg`` and ``tcfg``'s training settings
    (``NOT_TRAINING`` aside), or None when ``run_dir`` holds no finished run. A run is deterministic, so a
    comparison can read back a run that another command trained; a finished run of another model or other
    training settings is refused in one line (SystemExit) that names the settings that differ."""
    from mlx_llm.config import ModelConfig

    run_dir = Path(run_dir)
    if not (run_dir / "summary.json").is_file():
        return None
    if ModelConfig.from_json(run_dir / "config.json") != cfg:
        raise SystemExit(f"{run_dir} holds a run of other settings (another model): give another --out, or remove it")
    saved, want = json.loads((run_dir / "train_config.json").read_text()), dataclasses.asdict(tcfg)
    differ = sorted(k for k in want if k not in NOT_TRAINING and saved.get(k) != want[k])
    if differ:
        had = ", ".join(f"{k}={saved.get(k)!r}" for k in differ)
        wants = ", ".join(f"{k}={want[k]!r}" for k in differ)
        raise SystemExit(f"{run_dir} holds a run of other settings ({had}; this run wants {wants}): give another "
                         "--out, or remove it")
    return json.loads((run_dir / "summary.json").read_text())


def sft_seconds_per_step(base_run, tcfg, task: str, lora_cfg=None, rounds: int = 5) -> float:
    """Median wall time of one jitted SFT step (full, or LoRA with ``lora_cfg``) on real packed rows of ``task``
    from ``base_run``'s tokenizer, after one compiling call."""
    import jax

    from mlx_llm import lora as lora_lib
    from mlx_llm.data.chat import ChatTemplate
    from mlx_llm.post.prologue import load_base
    from mlx_llm.post.sft import load_data
    from mlx_llm.data import tokenizer as tok_lib
    from mlx_llm.train.parallel import make_mesh, replicated
    from mlx_llm.train.step import device_batch, init_state, jit_update, lm_update, optimizer_for

    base = load_base(base_run)
    cfg, params = base.cfg, base.params
    data = load_data(tok_lib.load(base_run), ChatTemplate(), tcfg.seq_len, task=task, n_train=2000, seed=0)
    mesh = make_mesh()
    trainable = params if lora_cfg is None else lora_lib.init(params, lora_cfg, jax.random.key(0))
    frozen = None if lora_cfg is None else jax.device_put(params, replicated(mesh))
    model_of = None if lora_cfg is None else lora_lib.model_of(lora_cfg)
    state = jax.device_put(init_state(cfg, tcfg, optimizer_for(tcfg, cfg=cfg), trainable), replicated(mesh))
    step = jit_update(lm_update(cfg, tcfg, optimizer_for(tcfg, cfg=cfg), model_of=model_of), state, frozen, mesh)
    batch = device_batch(data.train_batch(0, batch_size=tcfg.batch_size, seq_len=tcfg.seq_len, seed=0), mesh)
    return time_steps(carry(step, state, batch, frozen), warmup=1, rounds=rounds)


def sft_steps_for(base_run, tcfg, task: str, budget: float, lora_cfg=None):
    """(``tcfg`` with as many steps as fit ``budget`` seconds of SFT loop, at least warmup + 1, evaluating and
    checkpointing at the end only; the measured seconds per step)."""
    per_step = sft_seconds_per_step(base_run, tcfg, task, lora_cfg)
    steps = max(tcfg.warmup_steps + 1, int(budget / per_step))
    return dataclasses.replace(tcfg, steps=steps, eval_interval=steps, checkpoint_interval=steps), per_step


# ----- provenance ---------------------------------------------------------------------------------------------
def _git(*args: str) -> str | None:
    try:
        proc = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def git_state() -> dict:
    """The commit checked out, whether the working tree differs from it (``git status --porcelain``; changes under
    experiments/results/ do not count, so writing one result does not mark the next one dirty) and the first
    ``MAX_LISTED_CHANGES`` changed paths. None for both without git."""
    commit, status = _git("rev-parse", "HEAD"), _git("status", "--porcelain")
    if commit is None or status is None:
        return {"commit": None, "dirty": None, "changed": []}
    results = RESULTS.relative_to(REPO).as_posix() + "/"
    paths = [line[3:].split(" -> ")[-1].strip('"') for line in status.splitlines() if line.strip()]
    changed = [p for p in paths if not p.startswith(results)]
    return {"commit": commit.strip(), "dirty": bool(changed), "changed": changed[:MAX_LISTED_CHANGES]}


def versions() -> dict:
    """Installed versions of the numerical stack (None: not installed) and of Python."""
    out = {}
    for dist in VERSIONED:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return {**out, "python": platform.python_version()}


def devices() -> dict:
    """The JAX devices this process sees: platform, kind and count."""
    import jax

    devs = jax.devices()
    return {"platform": devs[0].platform, "kind": devs[0].device_kind, "count": len(devs)}


def command_line(argv: list[str] | None = None) -> str:
    """The command that ran, an experiment written as ``python -m experiments.NAME ...`` (how it is run)."""
    argv = list(sys.argv if argv is None else argv)
    if argv and argv[0].endswith(".py") and Path(argv[0]).resolve().parent == EXPERIMENTS:
        return shlex.join(["python", "-m", f"experiments.{Path(argv[0]).stem}", *argv[1:]])
    return shlex.join(["python", *argv])


def load_average() -> list[float] | None:
    """The host's 1, 5 and 15 minute load averages when the result is written (this run included): timings taken
    on a shared machine say so here. None where the OS has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def provenance(device_info: dict | None = None) -> dict:
    """Where a result comes from: git state, versions, devices, command, environment, load and UTC date (no host
    name). ``device_info``: the devices as a child process that ran the work reported them (``devices()``), for a
    parent that must not start a backend itself (experiments/device_check.py)."""
    return {**git_state(), "versions": versions(), "devices": devices() if device_info is None else device_info,
            "command": command_line(),
            "environment": {k: os.environ[k] for k in ENVIRONMENT if k in os.environ},
            "load_average": load_average(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


# ----- results ------------------------------------------------------------------------------------------------
def jsonable(value):
    """``json.dumps``' ``default``: numpy and jax values as lists or numbers, paths as text, dataclasses as dicts."""
    if hasattr(value, "tolist"):  # numpy and jax scalars and arrays
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def save_result(name: str, payload, directory=RESULTS, *, indent: int = 2, device_info: dict | None = None) -> Path:
    """Write ``directory/NAME.json``: a dict payload with its keys unchanged, a list payload as ``{"rows": ...}``,
    plus a ``provenance`` block (``device_info``: see ``provenance``). Written to a temporary file first, so a
    reader never sees half a file."""
    if isinstance(payload, Mapping):
        if "provenance" in payload:
            raise ValueError("the payload has its own 'provenance' key: save_result writes that one")
        body = {**payload, "provenance": provenance(device_info)}
    else:
        body = {"rows": list(payload), "provenance": provenance(device_info)}
    path = Path(directory) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(body, indent=indent, default=jsonable) + "\n")
    tmp.replace(path)
    return path


def load_result(name: str, directory=RESULTS):
    """The payload ``save_result`` wrote (without its provenance; a list payload as the list), or a file written
    before provenance existed, as it is."""
    data = json.loads((Path(directory) / f"{name}.json").read_text())
    if isinstance(data, dict):
        data = {k: v for k, v in data.items() if k != "provenance"}
        if set(data) == {"rows"}:
            return data["rows"]
    return data


def add_save_argument(ap, name: str) -> None:
    """``--save NAME``: write the result to experiments/results/NAME.json (default ``name``; under ``--quick``
    nothing unless asked; ``--save ''`` writes nothing)."""
    ap.add_argument("--save", metavar="NAME", default=None,
                    help=f"result file experiments/results/NAME.json (default {name}; none under --quick; '' for none)")
    ap.set_defaults(result_name=name)


def save_from_args(args, payload, **kwargs) -> Path | None:
    """``save_result`` under the name ``add_save_argument`` resolved from ``args``; prints the path written."""
    name = args.save if args.save is not None else (None if getattr(args, "quick", False) else args.result_name)
    if not name:
        return None
    path = save_result(name, payload, **kwargs)
    print(f"wrote {path.relative_to(REPO) if path.is_relative_to(REPO) else path}", flush=True)
    return path


def arguments(args) -> dict:
    """The parsed options as plain values, for a payload (the save options left out)."""
    return {k: _plain(v) for k, v in vars(args).items() if k not in ("save", "result_name")}


def _plain(value):
    return str(value) if isinstance(value, Path) else value


# ----- seeds: every comparison is over K seeds per arm --------------------------------------------------------------
MIN_SEEDS = 3  # a comparison script's default never goes below this


def add_seeds_argument(ap, default: int = MIN_SEEDS) -> None:
    """``--seeds K``: runs per arm, seeds 0 … K − 1 (``TrainConfig.seed``: initial parameters and data order)."""
    ap.add_argument("--seeds", type=int, default=default,
                    help=f"runs per arm, seeds 0 … K−1 (default {default}; at least 2 for an interval)")


def check_seeds(seeds: int, what: str = "--seeds") -> int:
    """``seeds`` itself, or one line (SystemExit) when it cannot give an interval."""
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 2:
        raise SystemExit(f"{what} {seeds!r} is too few: a mean's interval over seeds needs at least 2 runs per arm")
    return seeds


def run_seeds(arms, seeds: int, run: Callable[[str, int], dict]) -> list[dict]:
    """``run(arm, seed)`` for every arm and seed, seed-major (every arm of seed 0, then of seed 1, …, so that a
    drift in the machine's speed touches every arm alike); each returned row gets its ``arm`` and ``seed``."""
    return [{**run(arm, seed), "arm": arm, "seed": seed} for seed in range(check_seeds(seeds)) for arm in arms]


def seed_statistics(rows: list[dict], metric: str, baseline: str | None = None, paired: bool = True) -> dict:
    """Per arm (in first-seen order): every run's value of ``metric`` by seed, their summary (mean, std, 95 %
    interval) and, for every arm but ``baseline``, its difference from the baseline (paired by seed: the same
    seed is the same data order and initialisation; else Welch's test) with the p-value and the verdict."""
    from mlx_llm import stats

    arms = list(dict.fromkeys(r["arm"] for r in rows))
    by_arm = {a: sorted((r for r in rows if r["arm"] == a), key=lambda r: r["seed"]) for a in arms}
    out = {}
    for arm, runs in by_arm.items():
        values = [float(r[metric]) for r in runs]
        entry = {"runs": [{"seed": r["seed"], metric: float(r[metric])} for r in runs],
                 "summary": stats.summarize(values, arm).as_dict()}
        if baseline is not None and arm != baseline:
            base = [float(r[metric]) for r in by_arm[baseline]]
            if paired and [r["seed"] for r in runs] != [r["seed"] for r in by_arm[baseline]]:
                raise ValueError(f"{arm} and {baseline} ran other seeds: a paired difference needs the same ones")
            d = (stats.paired if paired else stats.welch)(values, base)
            entry["vs_baseline"] = {**d.as_dict(), "significant": d.significant}
        out[arm] = entry
    return {"metric": metric, "baseline": baseline, "arms": out}


def seed_lines(result: dict, digits: int = 4) -> list[str]:
    """A line per arm: mean ± half-interval (n), and the difference from the baseline in words."""
    from mlx_llm import stats

    lines = []
    width = max(len(a) for a in result["arms"])
    for arm, entry in result["arms"].items():
        s = entry["summary"]
        line = f"{arm:>{width}}: {stats.describe(stats.Summary(s['n'], s['mean'], s['std'], tuple(s['ci95'])), digits)}"
        if "vs_baseline" in entry:
            d = entry["vs_baseline"]
            line += f"  vs {result['baseline']}: " + stats.verdict(
                stats.Difference(d["mean"], tuple(d["ci95"]), d["p_value"], d["test"]), digits)
        lines.append(line)
    return lines


def seed_errorbars(result: dict, path, ylabel: str | None = None) -> Path:
    """Each arm's mean with its 95 % interval as an error bar, every run's value as a dot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(result["arms"])
    fig, ax = plt.subplots(figsize=(max(4.0, 1.1 * len(arms) + 2), 3.6))
    for i, arm in enumerate(arms):
        entry = result["arms"][arm]
        s = entry["summary"]
        ax.errorbar([i], [s["mean"]], yerr=[[s["mean"] - s["ci95"][0]], [s["ci95"][1] - s["mean"]]], fmt="o",
                    capsize=5, color="C0")
        ax.plot([i] * len(entry["runs"]), [r[result["metric"]] for r in entry["runs"]], ".", color="0.5")
    ax.set_xticks(range(len(arms)), arms, rotation=20 if len(arms) > 4 else 0)
    ax.set_ylabel(ylabel or result["metric"])
    ax.set_title("mean and 95 % interval over seeds (dots: the runs)", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
