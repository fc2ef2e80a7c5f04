"""Per-device memory of real training steps on TPU topologies, from the pre-flight compiler (no TPU needed).

Each row is ``mlx_llm.train.preflight.compile_step`` — the exact jitted train step AOT-compiled for the target
through libtpu (``pip install -e '.[tpu]'``) — for a model, a context length, an attention implementation and a
remat policy. Models: GPT-2-124M-like (T = 1024), Llama-3.2-1B-like (T = 4096, 8192, 16384) and Llama-3-8B-like
(T = 8192, fsdp). Prints a table and writes experiments/results/aot_memory.json (``{"rows": [...]}`` with its
provenance; rewritten after every row, so an interrupted run keeps what it measured).

    python -m experiments.aot_memory                 # every row (long: minutes per 8B compile on 2 cores)
    python -m experiments.aot_memory --only 1b       # one model
    python -m experiments.aot_memory --smallest      # the smallest v5e / v5p slice that holds the 8B model
    python -m experiments.aot_memory --largest       # the largest batch that fits (124M and 1B, splash, remat full)
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from experiments import common  # noqa: E402
from mlx_llm.config import ModelConfig, TrainConfig  # noqa: E402
from mlx_llm.train.preflight import GiB, compile_step, largest_batch  # noqa: E402

MODELS = {
    "124m": ModelConfig(vocab_size=50304, d_model=768, n_layers=12, n_heads=12, n_kv_heads=12, d_head=64,
                        d_ff=2048, max_seq_len=1024, tie_embeddings=True),
    "1b": ModelConfig(vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, d_head=64, d_ff=8192,
                      max_seq_len=32768, rope_base=500000.0, tie_embeddings=True),
    "8b": ModelConfig(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_head=128,
                      d_ff=14336, max_seq_len=32768, rope_base=500000.0),
}
# (model, target, mesh, [(seq_len, batch)])
ROWS = [
    ("124m", "tpu:v5e-4", "fsdp=4", [(1024, 32)]),
    ("1b", "tpu:v5e-4", "fsdp=4", [(4096, 16), (8192, 8), (16384, 4)]),
    ("8b", "tpu:v5p-16", "fsdp=8", [(8192, 8)]),
]


def train_config(seq_len: int, batch: int, mesh: str, attention: str, remat: str) -> TrainConfig:
    loss_chunk = "auto" if attention != "xla" else 0  # the reference row is today's path: whole logits
    return TrainConfig(batch_size=batch, seq_len=seq_len, mesh=mesh, remat=remat, compute_dtype="bfloat16",
                       attention_impl=attention, moe_impl="block", loss_chunk=loss_chunk, warmup_steps=1, steps=10)


def measure(model: str, target: str, mesh: str, seq_len: int, batch: int, attention: str, remat: str) -> dict:
    out, seconds = common.timed(compile_step, MODELS[model], train_config(seq_len, batch, mesh, attention, remat),
                                target)
    out.update(model=model, compile_seconds=round(seconds, 1))
    return out


def save(rows: list, out: Path) -> None:
    """``rows`` with their provenance into ``out`` (a .json path)."""
    common.save_result(out.stem, rows, out.parent, indent=1)


def row_text(r: dict) -> str:
    mem = r["bytes_per_device"]
    sizes = ("refused: " + r.get("refused", "")[:60]) if mem is None else (
        f"args {mem['arguments'] / GiB:6.2f}  temp {mem['temporary'] / GiB:6.2f}  total {mem['total'] / GiB:6.2f} GiB")
    return (f"{r['model']:>5} {r['target']:>11} T={r['seq_len']:>6} B={r['batch_size']:>3} {r['attention_impl']:>6} "
            f"loss_chunk={str(r['loss_chunk']):>4} remat={r['remat']:<4} {sizes}  fits={r['fits']}  "
            f"({r['compile_seconds']} s)")


SLICES = {"v5e": (4, 8, 16, 32, 64, 128, 256), "v5p": (8, 16, 32, 64, 128, 256, 512)}


def smallest_slices(out: Path, lengths=(8192, 32768), tensors=(1, 4, 8)) -> None:
    """For the 8B model at T = 8,192 and 32,768 (splash, chunked loss, remat full, bf16): the first slice of each
    generation whose step fits, trying for each slice ``tensor`` = 1, 4, 8 (heads and FFN split Megatron style)
    with fsdp over the rest and one sequence per fsdp group (so the batch is chips / tensor)."""
    rows = []
    for seq_len in lengths:
        for gen, sizes in SLICES.items():
            found = False
            for n in sizes:
                chips = n // (2 if gen == "v5p" else 1)
                for tensor in (t for t in tensors if chips % t == 0 and chips // t >= 1):
                    mesh = f"fsdp={chips // tensor},tensor={tensor}"
                    r = measure("8b", f"tpu:{gen}-{n}", mesh, seq_len, chips // tensor, "splash", "full")
                    print(row_text(r), mesh, flush=True)
                    rows.append({**r, "mesh_spec": mesh})
                    save(rows, out)
                    if r["fits"]:
                        found = True
                        break
                if found:
                    break


def largest_batches(out: Path) -> None:
    """The largest batch (a multiple of the chips) whose step fits, splash + chunked loss + remat full."""
    rows = []
    for model, target, mesh, seq_len in (("124m", "tpu:v5e-4", "fsdp=4", 1024), ("1b", "tpu:v5e-4", "fsdp=4", 4096)):
        batch, seconds = common.timed(largest_batch, MODELS[model], train_config(seq_len, 4, mesh, "splash", "full"),
                                      target, limit=512)
        rows.append({"model": model, "target": target, "seq_len": seq_len, "largest_batch": batch,
                     "seconds": round(seconds, 1)})
        print(rows[-1], flush=True)
        save(rows, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=sorted(MODELS))
    ap.add_argument("--smallest", action="store_true", help="the smallest slices for the 8B model")
    ap.add_argument("--largest", action="store_true", help="the largest batches that fit")
    ap.add_argument("--seq-len", type=int, help="with --smallest: only this length")
    ap.add_argument("--out", type=Path, default=common.RESULTS / "aot_memory.json",
                    help="the table's file; --smallest and --largest write their own files beside it")
    args = ap.parse_args()
    if args.smallest:
        lengths = (args.seq_len,) if args.seq_len else (8192, 32768)
        return smallest_slices(args.out.with_name(f"aot_smallest_slices{args.seq_len or ''}.json"), lengths)
    if args.largest:
        return largest_batches(args.out.with_name("aot_largest_batch.json"))
    rows = common.load_result(args.out.stem, args.out.parent) if args.only and args.out.exists() else []
    rows = [r for r in rows if args.only and r["model"] != args.only]  # --only reruns one model's rows
    for model, target, mesh, shapes in ROWS:
        if args.only and model != args.only:
            continue
        for seq_len, batch in shapes:
            for attention in ("xla", "splash"):
                for remat in ("none", "full"):
                    rows.append(measure(model, target, mesh, seq_len, batch, attention, remat))
                    print(row_text(rows[-1]), flush=True)
                    save(rows, args.out)


if __name__ == "__main__":
    main()
