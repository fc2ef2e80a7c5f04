"""The parts of experiments/device_check.py: one function per part, ``PART(quick, earlier) -> dict``, run one at a
time in a child process (device_check.py says why, and how long each should take on one H100/H200-class GPU).

Each returns its measurements plus ``summary``, the line of the printed table; ``earlier`` holds the results of
the parts that ran before it in the same run (the training part reads the environment's bf16 peak from it). A
part, or one variant of it, that cannot apply on this backend raises ``Skip`` (its reason is recorded); a
variant that fails is recorded as failed with its error and the part goes on. The measurements reuse the
benchmark scripts: ``bench_gpu`` (MFU), ``bench_attention`` (compiled forward+backward), ``bench_moe``
(``compare``) and ``bench_decode`` (bandwidth, decode timers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from experiments import bench_decode, bench_gpu, bench_moe, common
from mlx_llm import ModelConfig, init_params
from mlx_llm.config import TrainConfig
from mlx_llm.kernels import backend_platform
from mlx_llm.scaling.accounting import decode_state_bytes
from mlx_llm.train.parallel import make_mesh, tree_shardings
from mlx_llm.train.preflight import compiled_step
from mlx_llm.train.step import abstract_state, init_state, optimizer_for

GiB = 2**30


class Skip(Exception):
    """This part (or one variant of it) cannot apply on this backend; the message says why."""


def on_gpu() -> bool:
    return backend_platform() == "gpu"


def error_text(exc: BaseException) -> str:
    """One line: the exception's type and the first line of its message."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:500]


def memory_stats() -> dict | None:
    """The first local device's allocator statistics (None where the backend keeps none, as on the CPU)."""
    return jax.local_devices()[0].memory_stats() or None


# ----- environment --------------------------------------------------------------------------------------------
PEAK_DOTS = (("bf16", "bfloat16", None), ("fp32", "float32", None), ("fp32_highest", "float32", "highest"))


def _precision(precision: str | None):
    return contextlib.nullcontext() if precision is None else jax.default_matmul_precision(precision)


def dot_timer(n: int, dtype: str, precision: str | None = None):
    """``common.matmul_timer`` traced, compiled and called under ``jax.default_matmul_precision(precision)``
    (None: the backend's default, TF32 for float32 on recent NVIDIA GPUs)."""
    with _precision(precision):
        timer, flops = common.matmul_timer(n, dtype)

    def run():
        with _precision(precision):
            return timer()

    return run, flops


def cuda_versions() -> dict:
    """The CUDA libraries' versions as the jax CUDA plugin reports them ({} without one)."""
    from jax._src.lib import cuda_versions as module

    out = {}
    for name in dir(module) if module is not None else ():
        if name.endswith("_get_version"):
            try:
                out[name.removesuffix("_get_version")] = getattr(module, name)()
            except Exception:  # noqa: BLE001 (a version query that needs arguments or a device: left out)
                continue
    return out


def describe_device(dev) -> dict:
    stats = dev.memory_stats() or {}
    return {"id": dev.id, "kind": dev.device_kind, "platform": dev.platform,
            "compute_capability": getattr(dev, "compute_capability", None),
            "bytes_limit": stats.get("bytes_limit"), "memory_stats": stats or None}


def environment(quick: bool, earlier: dict) -> dict:
    """Devices, memory, versions and the same-run ``jnp.dot`` peaks: bf16, float32 at the default precision and
    float32 at "highest" (two n×n matrices, float32 accumulation, best of 3 calls per round, rounds interleaved)."""
    n, rounds = (256, 2) if quick else (8192, 5)
    timers = {name: dot_timer(n, dtype, precision) for name, dtype, precision in PEAK_DOTS}
    best = common.time_interleaved({k: fn for k, (fn, _) in timers.items()}, warmup=1, rounds=rounds, stat=min,
                                   self_timed=True)
    peaks = {k: flops / best[k] for k, (_, flops) in timers.items()}
    devs = [describe_device(d) for d in jax.devices()]
    limit = devs[0]["bytes_limit"]
    memory = f", {limit / GiB:.1f} GiB for jax" if limit else ""
    return {"summary": f"{len(devs)}x {devs[0]['kind']}{memory}; dot {n}²: bf16 {peaks['bf16'] / 1e12:.3g}, fp32 "
                       f"{peaks['fp32'] / 1e12:.3g}, fp32 highest {peaks['fp32_highest'] / 1e12:.3g} TFLOP/s",
            "backend": jax.default_backend(), "platform_version": jax.devices()[0].client.platform_version,
            "devices": devs, "versions": common.versions(), "cuda": cuda_versions(), "dot_size": n,
            "peak_flops": peaks, "environment_info": jax.print_environment_info(return_string=True)}


# ----- training -----------------------------------------------------------------------------------------------
def llama_1b(seq_len: int) -> ModelConfig:
    """A 1.1B Llama-3.2-1B-like model: d=2048, L=16, 32 query / 8 K/V heads of 64, SwiGLU 8192, V=32768, untied."""
    return ModelConfig(vocab_size=32768, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, d_head=64, d_ff=8192,
                       max_seq_len=seq_len)


def training_setup(part: str, quick: bool) -> tuple[ModelConfig, TrainConfig, int, int]:
    """(model, train config, the peak dot's n, timed rounds) of a training part."""
    if quick:
        cfg = bench_gpu.gpt_config(128, 2, 4096, 128) if part == "training_124m" else dataclasses.replace(
            llama_1b(256), d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=256, vocab_size=2048)
        batch, dtype, n, rounds = 2, "float32", 256, 2
    else:
        cfg = bench_gpu.gpt_config(768, 12, 32768, 1024) if part == "training_124m" else llama_1b(4096)
        batch, dtype, n, rounds = (32, "bfloat16", 8192, 10) if part == "training_124m" else (8, "bfloat16", 8192, 5)
    remat = "none" if part == "training_124m" else "full"
    tcfg = TrainConfig(batch_size=batch, seq_len=cfg.max_seq_len, steps=10_000, warmup_steps=10, compute_dtype=dtype,
                       remat=remat, attention_impl="auto", loss_chunk="auto")
    return cfg, tcfg, n, rounds


def measure_training(cfg: ModelConfig, tcfg: TrainConfig, n: int, rounds: int, earlier: dict) -> dict:
    """MFU of the library's train step (``bench_gpu.measure_mfu``), run as the very executable that
    ``preflight.compiled_step(…, "local")`` compiled, whose predicted memory is set against the device's peak
    (``memory_stats``: read after the first step, before the peak dots allocate anything)."""
    report, compiled = compiled_step(cfg, tcfg, "local")
    if compiled is None:
        raise RuntimeError(f"XLA refused the step: {report['refused']}")
    mesh, devices = make_mesh(tcfg.mesh, jax.devices()), jax.device_count()
    # one jitted program that writes the state where the step wants it: no op-by-op init, no second copy
    state = jax.jit(lambda: init_state(cfg, tcfg, optimizer_for(tcfg, cfg=cfg)),
                    out_shardings=tree_shardings(abstract_state(cfg, tcfg), mesh))()
    batch = bench_gpu.random_batch(cfg.vocab_size, tcfg.batch_size, tcfg.seq_len, mesh)
    step = lambda s, b: compiled(s, b, None)  # noqa: E731
    state, _ = jax.block_until_ready(step(state, batch))
    memory = memory_check(report, memory_stats())
    r = bench_gpu.measure_mfu(step, state, batch, cfg, tcfg, peak_n=n, rounds=rounds, devices=devices)
    env_peak = earlier.get("environment", {}).get("peak_flops", {}).get("bf16" if tcfg.compute_dtype == "bfloat16"
                                                                        else "fp32")
    r["mfu_vs_environment_peak"] = r["achieved_flops"] / (env_peak * devices) if env_peak else None
    mfu = r["mfu_vs_environment_peak"] or r["mfu"]
    line = (f"{cfg.param_count() / 1e6:,.1f}M T={tcfg.seq_len} B={tcfg.batch_size} remat {tcfg.remat}: "
            f"{r['median_step_seconds'] * 1e3:.1f} ms/step, {r['tokens_per_second']:,.0f} tok/s, MFU {mfu:.1%}; "
            + memory["line"])
    return {"summary": line, "model": cfg.to_dict(), "train": tcfg.to_dict(), "kernels": report["attention_impl"],
            **r, "memory": memory, "compile_report": report}


def training(part: str, quick: bool, earlier: dict) -> dict:
    """``measure_training`` with the backend's own kernels ("auto"); if an accelerator kernel (pallas_gpu,
    splash) fails, the step is measured again with flash attention and the failure is kept beside it (the
    first try's memory then counts in the peak)."""
    cfg, tcfg, n, rounds = training_setup(part, quick)
    impl = tcfg.kernels(resolve=True).attention_impl
    try:
        return measure_training(cfg, tcfg, n, rounds, earlier)
    except Exception as exc:  # noqa: BLE001
        if impl in ("xla", "flash", "auto"):
            raise
        out = measure_training(cfg, dataclasses.replace(tcfg, attention_impl="flash"), n, rounds, earlier)
        return {**out, "summary": f"{out['summary']} [flash: {impl} failed]",
                "fallback": {"attention_impl": impl, "error": error_text(exc)}}


def memory_check(report: dict, stats: dict | None) -> dict:
    """The compiled step's predicted bytes per device (arguments + outputs − aliased + temporaries) against the
    allocator's peak after one step (which also holds the batch and whatever the process allocated before)."""
    predicted = report["bytes_per_device"]["total"]
    peak = None if stats is None else stats.get("peak_bytes_in_use")
    if peak is None:
        return {"predicted_bytes": predicted, "measured_peak_bytes": None, "ratio": None,
                "line": f"memory predicted {predicted / GiB:.2f} GiB (no allocator statistics on "
                        f"{backend_platform()})"}
    return {"predicted_bytes": predicted, "measured_peak_bytes": peak, "ratio": peak / predicted,
            "bytes_in_use_after_step": stats.get("bytes_in_use"), "bytes_limit": stats.get("bytes_limit"),
            "line": f"memory predicted {predicted / GiB:.2f} GiB, peak {peak / GiB:.2f} GiB "
                    f"({peak / predicted:.2f}x)"}


def training_124m(quick: bool, earlier: dict) -> dict:
    return training("training_124m", quick, earlier)


def training_1b(quick: bool, earlier: dict) -> dict:
    return training("training_1b", quick, earlier)


# ----- MoE ----------------------------------------------------------------------------------------------------
MOE_FULL = dict(d=2048, experts=16, k=2, m=2048, seq_len=4096, batch=4, rounds=5, dtype="bfloat16")
MOE_QUICK = dict(d=128, experts=8, k=2, m=176, seq_len=128, batch=2, rounds=2, dtype="float32")


def moe(quick: bool, earlier: dict) -> dict:
    """``bench_moe.compare``: the MoE FFN by block dispatch and by ``ragged_dot`` against the dense SwiGLU of the
    same active width, forward + backward, active FLOP/s."""
    sizes = MOE_QUICK if quick else MOE_FULL
    try:
        out = bench_moe.compare(**sizes)
    except Exception as exc:  # noqa: BLE001 (ragged_dot failing must not hide block against dense)
        out = {**bench_moe.compare(**sizes, ragged=False), "ragged_dot_error": error_text(exc)}
    v = out["variants"]
    ragged = v.get("MoE (ragged_dot)")
    summary = (f"dense {v['dense SwiGLU']['active_flops_per_second'] / 1e12:.3g} TFLOP/s; block "
               f"{v['MoE (block-sorted)']['of_dense']:.2f}x, ragged_dot "
               + (f"{ragged['of_dense']:.2f}x of dense" if ragged else f"failed ({out['ragged_dot_error']})"))
    return {"summary": summary, "sizes": sizes, **out}


# ----- decoding -----------------------------------------------------------------------------------------------
DECODE_FULL = dict(context=1024, new_tokens=128, batches=(1, 64), dtype="bfloat16", bandwidth_gib=4.0, repeats=3)
DECODE_QUICK = dict(context=32, new_tokens=8, batches=(1, 4), dtype="float32", bandwidth_gib=0.01, repeats=2)


def decode(quick: bool, earlier: dict) -> dict:
    """Greedy decoding by ``generate``'s loop (``bench_decode.cached_timers``' "scan": one jitted ``lax.scan`` of
    cached steps after an untimed prefill) at each batch, against the bound of reading the weights once and the
    K/V cache of every row per step at the read bandwidth measured in this process (``bench_decode``)."""
    s = DECODE_QUICK if quick else DECODE_FULL
    cfg = llama_1b(s["context"] + s["new_tokens"] + 1)
    if quick:
        cfg = dataclasses.replace(cfg, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_head=16, d_ff=128,
                                  vocab_size=256)
    params = jax.jit(init_params, static_argnums=(0, 2))(cfg, jax.random.key(0, impl="rbg"), jnp.dtype(s["dtype"]))
    bandwidth = bench_decode.read_bandwidth(s["bandwidth_gib"], s["repeats"])
    weights = bench_decode.weight_bytes_per_token(params, cfg)
    rng, rows = np.random.default_rng(0), []
    for b in s["batches"]:
        prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, s["context"])), jnp.int32)
        timer = bench_decode.cached_timers(params, cfg, prompt, s["new_tokens"])["scan"]
        step = bench_decode.best_of({"scan": timer}, s["repeats"], self_timed=True)["scan"] / s["new_tokens"]
        bound = (weights + decode_state_bytes(cfg, s["context"], b, s["dtype"])) / bandwidth
        rows.append({"batch": b, "seconds_per_step": step, "tokens_per_second": b / step,
                     "bound_seconds_per_step": bound, "bound_tokens_per_second": b / bound,
                     "fraction_of_bound": bound / step})
    summary = "; ".join(f"batch {r['batch']}: {r['tokens_per_second']:,.0f} tok/s ({r['fraction_of_bound']:.0%} of "
                        f"{r['bound_tokens_per_second']:,.0f})" for r in rows)
    return {"summary": f"{cfg.param_count() / 1e6:,.1f}M {s['dtype']}, {bandwidth / 1e9:,.0f} GB/s read: " + summary,
            "sizes": s, "params": cfg.param_count(), "weight_bytes_per_token": weights,
            "read_bandwidth_bytes_per_second": bandwidth, "rows": rows}


# ----- the main job -------------------------------------------------------------------------------------------
# The main job on the CPU (README, "The main job"): its wall time with an empty token cache, 35 val files of
# 378,072 bytes; its bits/byte is read from experiments/results/main_job_seeds.json (``mlx-llm train`` with its
# defaults, the run of the main job's own seed).
CPU_MAIN_JOB = {"wall_seconds": 203.4, "val_bytes": 378_072, "results": "main_job_seeds"}


def cpu_reference() -> dict:
    from mlx_llm.recipes import MAIN_JOB_TRAIN

    runs = common.load_result(CPU_MAIN_JOB["results"])["runs"]
    bpb = next(r["val_bpb"] for r in runs if r["seed"] == MAIN_JOB_TRAIN.seed)
    return {**CPU_MAIN_JOB, "val_bpb": bpb}


def main_job_setup(quick: bool):
    """(model, train config, data spec): ``mlx-llm train``'s defaults, or (quick) the same recipe shrunk to a few
    steps on this package's kernels/ sources read as bytes."""
    from mlx_llm.recipes import MAIN_JOB_MODEL, MAIN_JOB_TRAIN, MAIN_JOB_VOCAB
    from mlx_llm.runs.configs import DataSpec

    if not quick:
        return MAIN_JOB_MODEL, MAIN_JOB_TRAIN, DataSpec(vocab_size=MAIN_JOB_VOCAB)
    tcfg = dataclasses.replace(MAIN_JOB_TRAIN, steps=4, batch_size=4, seq_len=64, warmup_steps=1, eval_interval=4,
                               checkpoint_interval=4)
    spec = DataSpec(path=str(common.REPO / "mlx_llm" / "kernels"), extensions=(".py",), tokenizer="byte",
                    val_percent=20.0)
    return MAIN_JOB_MODEL, tcfg, spec


def differences(summary: dict, ref: dict, tcfg: TrainConfig) -> list[str]:
    """What can make this device's bits/byte differ from the CPU's in the last digits."""
    kernels = tcfg.kernels(resolve=True)
    why = []
    if on_gpu() and jax.config.jax_default_matmul_precision is None:
        why.append("float32 matmuls run as TF32 on NVIDIA GPUs by default (the CPU computes them in float32)")
    if kernels.attention_impl not in ("xla", "auto"):
        why.append(f"attention by {kernels.attention_impl} (the CPU runs xla at T = {tcfg.seq_len})")
    if kernels.loss_chunk:
        why.append(f"the loss computed in chunks (loss_chunk={kernels.loss_chunk!r}; whole logits on the CPU)")
    if summary.get("val_bytes") != ref["val_bytes"]:
        why.append(f"a different val set: {summary.get('val_bytes')} bytes, not {ref['val_bytes']} (another "
                   f"Python's standard library)")
    if backend_platform() != "cpu":
        why.append(f"reductions in another order; {tcfg.steps} steps of training carry float differences into the "
                   f"last digits")
    return why


def main_job(quick: bool, earlier: dict) -> dict:
    """``mlx-llm train`` with no flags (``runs.pretrain.train_run`` with the recipes' defaults, an empty token
    cache): its wall time and val bits/byte, against the CPU's (``cpu_reference``)."""
    from mlx_llm.runs.pretrain import train_run

    with tempfile.TemporaryDirectory() as tmp:
        cfg, tcfg, spec = main_job_setup(quick)
        start = time.perf_counter()
        summary = train_run(Path(tmp) / "run", cfg, tcfg, spec, show_progress=False, cache_dir=Path(tmp) / "cache",
                            sample_tokens=8 if quick else 200)
        wall = time.perf_counter() - start
    bpb = summary.get("val_bpb")
    out = {"wall_seconds": wall, "val_bpb": bpb, "val_loss": summary["val_loss"], "val_bytes": summary.get("val_bytes"),
           "train_seconds": summary["train_seconds"], "tokens_per_second": summary.get("tokens_per_second"),
           "steps": summary["steps"], "kernels": dataclasses.asdict(tcfg.kernels(resolve=True))}
    if quick:
        return {"summary": f"toy run ({tcfg.steps} steps): {wall:.1f} s wall, {bpb:.4f} bits/byte (no CPU reference)",
                **out, "cpu_reference": None}
    ref = cpu_reference()
    same = round(bpb, 3) == round(ref["val_bpb"], 3)
    why = [] if same else differences(summary, ref, tcfg)
    return {"summary": f"{wall:.0f} s wall (CPU {ref['wall_seconds']:.0f} s); {bpb:.4f} bits/byte (CPU "
                       f"{ref['val_bpb']:.4f}{', same 3 digits' if same else ''})",
            **out, "cpu_reference": ref, "same_digits": same, "difference": bpb - ref["val_bpb"], "why_different": why}
