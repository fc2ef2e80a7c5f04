"""The attention part of experiments/device_check.py: every attention path on the device, against the reference.

Paths: the library's ``xla`` (the reference path: a boolean (B, T, T) mask), ``flash`` (pure JAX, blockwise) and
``pallas_gpu`` (the Triton Pallas ``mha``; on a backend other than a GPU it runs in Pallas interpret mode, which
checks values but says nothing of speed), each through ``kernels.attention.attention``; and cuDNN's fused
attention through ``jax.nn.dot_product_attention(implementation="cudnn")``, given the packed documents as a
boolean mask (which it turns into an additive bias) plus ``is_causal`` and, for a sliding window,
``local_window_size=(W − 1, 0)``. Every window holds packed documents (four per row, cut at random places).

Check: outputs and gradients (dq, dk, dv of sum(O ⊙ dO)) of each path, in the compute dtype, against the
``xla`` path in float32 at ``jax.default_matmul_precision("highest")`` on the same inputs: the largest absolute
error over the largest absolute reference value, per tensor; within tolerance at 3e-2 (bf16) or 1e-4 (float32;
5e-3 on a GPU, whose float32 matmuls run as TF32).
Time: forward + backward (``bench_attention.compiled_grads``), the paths taking turns each round, at every
length with B·T fixed, and with a sliding window (full-causal paths beside it in the same rows). A variant whose
compiled temporaries exceed 90 % of the device's memory is skipped with its size (the reference at T = 16,384
needs the (B, H, T, T) scores); one that fails records its error and the others go on.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from experiments import bench_attention, common
from experiments.device_parts import GiB, Skip, error_text, memory_stats, on_gpu
from mlx_llm.kernels import Kernels
from mlx_llm.kernels.attention import attention as library_attention
from mlx_llm.ops import causal_mask

PATHS = ("xla", "flash", "pallas_gpu", "cudnn")
TOLERANCE = {"bfloat16": 3e-2, "float32": 1e-4}
TF32_TOLERANCE = 5e-3  # float32 on a GPU: the paths' own matmuls run as TF32 (10-bit mantissas) by default
FULL = dict(lengths=(1024, 4096, 16384), tokens=16384, heads=16, kv_heads=4, head_dim=128, dtype="bfloat16",
            windows={4096: 1024, 16384: 1024}, check=(2, 1024, 256), repeats=3)
QUICK = dict(lengths=(128,), tokens=256, heads=4, kv_heads=2, head_dim=16, dtype="float32", windows={128: 32},
             check=(2, 128, 32), repeats=2)


def packed_segments(b: int, t: int, seed: int = 0) -> jax.Array:
    """(B, T) segment ids of four documents per row, cut at random places (ids 0 … 3 in order)."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, t), size=(b, 3), replace=False), axis=1)
    return jnp.asarray((np.arange(t)[None, :, None] >= cuts[:, None, :]).sum(-1), jnp.int32)


def library_path(impl: str):
    """``attn(q, k, v, seg, window=None)`` by the library's ``impl`` (interpret mode for pallas_gpu off a GPU)."""
    kernels = Kernels(attention_impl=impl, interpret=impl == "pallas_gpu" and not on_gpu()).resolve()

    def attn(q, k, v, seg, window=None):
        if impl == "pallas_gpu" and window is not None:
            raise Skip("the Triton mha has no window: a windowed layer under pallas_gpu runs flash")
        return library_attention(q, k, v, seg, causal=True, kernels=kernels, window=window)

    return attn


def cudnn(q, k, v, seg, window=None):
    """cuDNN fused attention through ``jax.nn.dot_product_attention``, the packed documents as a mask."""
    if not on_gpu():
        raise Skip(f"cuDNN attention needs a CUDA GPU; this backend is {jax.default_backend()}")
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        raise Skip(f"cuDNN fused attention takes bfloat16 or float16, not {q.dtype}")
    b, t = q.shape[:2]
    return jax.nn.dot_product_attention(q, k, v, mask=causal_mask(seg, b, t)[:, None], is_causal=True,
                                        local_window_size=None if window is None else (window - 1, 0),
                                        implementation="cudnn")


def paths() -> dict:
    return {**{impl: library_path(impl) for impl in PATHS if impl != "cudnn"}, "cudnn": cudnn}


def outputs_and_grads(attn, q, k, v, do, seg):
    """(O, dq, dk, dv) of ``attn`` at these inputs, jitted."""
    def run(q, k, v, do, seg):
        o, pull = jax.vjp(lambda *qkv: attn(*qkv, seg), q, k, v)
        return (o, *pull(do))

    return jax.jit(run)(q, k, v, do, seg)


def tolerance(dtype: str) -> float:
    return TF32_TOLERANCE if dtype == "float32" and on_gpu() else TOLERANCE[dtype]


def relative_errors(got, ref) -> dict:
    names = ("out", "dq", "dk", "dv")
    return {n: float(jnp.max(jnp.abs(g.astype(jnp.float32) - r)) / jnp.max(jnp.abs(r)))
            for n, g, r in zip(names, got, ref)}


def check(sizes: dict) -> dict:
    """Each path's outputs and gradients against the float32 reference, full causal and windowed."""
    b, t, window = sizes["check"]
    arrays = bench_attention.inputs(b, t, sizes["heads"], sizes["kv_heads"], sizes["head_dim"], sizes["dtype"])
    seg, tol = packed_segments(b, t), tolerance(sizes["dtype"])
    out = {}
    for w in (None, window):
        with jax.default_matmul_precision("highest"):
            ref = outputs_and_grads(functools.partial(library_path("xla"), window=w),
                                    *(a.astype(jnp.float32) for a in arrays), seg)
        for name, attn in paths().items():
            key = name if w is None else f"{name} window {w}"
            try:
                errors = relative_errors(outputs_and_grads(functools.partial(attn, window=w), *arrays, seg), ref)
                out[key] = {"status": "ok", "errors": errors, "within_tolerance": max(errors.values()) <= tol}
            except Skip as exc:
                out[key] = {"status": "skipped", "reason": str(exc)}
            except Exception as exc:  # noqa: BLE001 (one path failing must not hide the others)
                out[key] = {"status": "failed", "reason": error_text(exc)}
    return out


def attention_flops(b: int, t: int, h: int, kd: int, window: int | None) -> float:
    """Forward + backward FLOPs of the entries a causal (windowed) attention keeps: 4·K per (query, key) pair
    forward (QKᵀ and PV), 2.5× that backward (FlashAttention-2's count)."""
    pairs = t * (t + 1) / 2 if window is None else window * t - window * (window - 1) / 2
    return 3.5 * 4 * b * h * kd * pairs


def compile_variant(attn, arrays, seg, limit: int | None) -> tuple:
    """(the compiled forward+backward, its temporaries' bytes), refusing (``Skip``) one that cannot fit."""
    compiled = bench_attention.compiled_grads(attn, *arrays, seg)
    temp = compiled.memory_analysis().temp_size_in_bytes
    if limit and temp > 0.9 * limit:
        raise Skip(f"needs {temp / GiB:.1f} GiB of temporaries, more than 90% of the device's {limit / GiB:.1f} GiB")
    jax.block_until_ready(compiled(*arrays, seg))  # a first call: a path that fails at run time fails here
    return compiled, temp


def time_row(sizes: dict, t: int, window: int | None) -> dict:
    """One row: every path's forward + backward at length t (and window), timed round-robin."""
    b = max(1, sizes["tokens"] // t)
    arrays = bench_attention.inputs(b, t, sizes["heads"], sizes["kv_heads"], sizes["head_dim"], sizes["dtype"])
    seg, limit = packed_segments(b, t), (memory_stats() or {}).get("bytes_limit")
    variants, compiled = {}, {}
    for name, attn in paths().items():
        try:
            compiled[name], temp = compile_variant(functools.partial(attn, window=window), arrays, seg, limit)
            variants[name] = {"status": "ok", "temp_mib": temp / 2**20}
        except Skip as exc:
            variants[name] = {"status": "skipped", "reason": str(exc)}
        except Exception as exc:  # noqa: BLE001
            variants[name] = {"status": "failed", "reason": error_text(exc)}
    calls = {name: functools.partial(fn, *arrays, seg) for name, fn in compiled.items()}
    flops = attention_flops(b, t, sizes["heads"], sizes["head_dim"], window)
    for name, sec in common.time_interleaved(calls, warmup=0, rounds=sizes["repeats"]).items():
        variants[name].update(seconds=sec, tflops_per_second=flops / sec / 1e12)
    return {"seq_len": t, "batch": b, "window": window, "flops": flops, "variants": variants}


def row_line(row: dict) -> str:
    timed = [f"{n} {v['seconds'] * 1e3:.1f}" for n, v in row["variants"].items() if "seconds" in v]
    where = f"T={row['seq_len']}" + (f" W={row['window']}" if row["window"] else "")
    return f"{where}: " + (", ".join(timed) + " ms" if timed else "nothing ran")


def attention_part(quick: bool, earlier: dict) -> dict:
    sizes = QUICK if quick else FULL
    checks = check(sizes)
    rows = []
    for t in sizes["lengths"]:
        rows.append(time_row(sizes, t, None))
        if t in sizes["windows"]:
            rows.append(time_row(sizes, t, sizes["windows"][t]))
        print(" | ".join(row_line(r) for r in rows[-2:] if r["seq_len"] == t), flush=True)
    ran = [c for c in checks.values() if c["status"] == "ok"]
    off = sorted(k for k, c in checks.items() if c["status"] == "ok" and not c["within_tolerance"])
    longest = [r for r in rows if r["window"] is None][-1]
    summary = (f"checks {len(ran) - len(off)}/{len(ran)} within tolerance"
               + (f" (off: {', '.join(off)})" if off else "") + f"; {row_line(longest)}")
    return {"summary": summary, "sizes": {**sizes, "windows": {str(t): w for t, w in sizes["windows"].items()}},
            "interpret_pallas": not on_gpu(), "tolerance": tolerance(sizes["dtype"]), "checks": checks, "rows": rows}
