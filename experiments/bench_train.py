"""Training-step throughput against the machine's own matmul peak and against HF transformers, side by side.

Prints tokens/s and achieved FLOP/s of the jitted train step (forward, backward, clipping, AdamW) and the
best `jnp.dot` FLOP/s of the same process; their ratio is the model FLOP utilisation (MFU) against the
measured peak. FLOPs per token follow `accounting.train_flops_per_token`: 6·N_matmul plus the attention
term, counted both for the full T×T score matrix (PaLM's convention) and for the causal half only.
With the `hf` extra installed it also times the same step of `LlamaForCausalLM` with our weights (torch eager,
float32, SDPA attention, logits + cross-entropy, backward, global-norm clipping, torch AdamW) and prints the
tokens/s ratio. Timings interleave the dot, our step and the torch step round by round, so drift in machine
load hits all three alike.

    python -m experiments.bench_train            # d=512, L=8, 8 query / 2 kv heads, T=512, batch 8
    python -m experiments.bench_train --quick    # a smaller model, for a smoke run
    python -m experiments.bench_train --remat full --mesh fsdp=1   # options of TrainConfig; prints compiled memory

Writes experiments/results/bench_train.json (``--save NAME``: another name for a variant; nothing under --quick
unless asked).
"""

from __future__ import annotations

import argparse

import jax
import numpy as np

from experiments import common
from mlx_llm import ModelConfig
from mlx_llm.scaling.accounting import train_flops_per_token
from mlx_llm.config import TrainConfig
from mlx_llm.train.parallel import make_mesh
from mlx_llm.train.step import device_batch, init_state, jit_train_step, optimizer_for, place_state


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--d-ff", type=int, default=1408)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--quick", action="store_true", help="d=256, L=2, T=256, batch 4, 2 rounds")
    ap.add_argument("--remat", default="none", choices=("none", "full", "dots"))
    ap.add_argument("--mesh", default="", help="TrainConfig.mesh, e.g. data=2 (needs that many devices)")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    common.add_save_argument(ap, "bench_train")
    args = ap.parse_args()
    if args.quick:
        args.d_model, args.layers, args.d_ff, args.seq_len, args.batch, args.rounds = 256, 2, 704, 256, 4, 2
    cfg = ModelConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                      n_kv_heads=args.kv_heads, d_head=args.d_model // args.heads, d_ff=args.d_ff,
                      max_seq_len=args.seq_len)
    tcfg = TrainConfig(batch_size=args.batch, seq_len=args.seq_len, steps=10_000, warmup_steps=10,
                       compute_dtype=args.dtype, remat=args.remat, mesh=args.mesh)
    mesh = make_mesh(tcfg.mesh)
    state = place_state(init_state(cfg, tcfg, optimizer_for(tcfg, cfg=cfg)), mesh)
    step = jit_train_step(cfg, tcfg, mesh)
    hf = None if args.no_hf else torch_step(state.params, cfg, args)
    rng = np.random.default_rng(0)
    B, T = args.batch, args.seq_len
    batch = device_batch({"tokens": rng.integers(0, cfg.vocab_size, (B, T), dtype=np.int32),
                          "targets": rng.integers(0, cfg.vocab_size, (B, T), dtype=np.int32),
                          "mask": np.ones((B, T), np.float32), "segment_ids": np.zeros((B, T), np.int32),
                          "positions": np.tile(np.arange(T, dtype=np.int32), (B, 1))}, mesh)
    train = common.carry(step, state, batch)
    memory, compile_s = common.timed(lambda: step.lower(state, batch).compile().memory_analysis())
    compile_s += common.seconds(train)  # compile + first step
    dot, dot_flops = common.matmul_timer(2048, "float32")  # best of 3 products per round
    candidates = {"dot": dot, "ours": lambda: common.seconds(train)}
    if hf is not None:
        common.seconds(hf)  # warm-up; ours is warm after its first step, the dot after matmul_timer
        candidates["hf"] = lambda: common.seconds(hf)
    times = common.interleaved_times(candidates, warmup=0, rounds=args.rounds, self_timed=True)
    step_times, hf_times = times["ours"], times.get("hf", [])
    step_s, peak = min(step_times), dot_flops / min(times["dot"])
    tokens = B * T
    full = train_flops_per_token(cfg, T)
    causal = train_flops_per_token(cfg, T, causal=True)
    print(f"model: d={cfg.d_model} L={cfg.n_layers} heads={cfg.n_heads}/{cfg.n_kv_heads} d_ff={cfg.d_ff} "
          f"V={cfg.vocab_size} T={T} batch={B} dtype={args.dtype}; {cfg.param_count():,} parameters; "
          f"{jax.device_count()} device(s)")
    print(f"compile + first step: {compile_s:.1f} s; step times (s): {', '.join(f'{t:.3f}' for t in step_times)}")
    print(f"compiled step memory (XLA analysis, remat={args.remat}): temporaries {memory.temp_size_in_bytes / 2**20:.0f} "
          f"MiB, arguments {memory.argument_size_in_bytes / 2**20:.0f} MiB")
    print(f"jnp.dot peak (2048², float32, best of {args.rounds * 3}): {peak / 1e9:.1f} GFLOP/s")
    print(f"train step: {step_s:.3f} s, {tokens / step_s:,.0f} tokens/s")
    for name, per_token in (("full attention (PaLM)", full), ("causal half", causal)):
        achieved = per_token * tokens / step_s
        print(f"  FLOPs counted with {name:22s}: {achieved / 1e9:6.1f} GFLOP/s = {achieved / peak:.3f} of peak")
    if hf_times:
        hf_s = min(hf_times)
        print(f"HF transformers LlamaForCausalLM, torch {hf.torch_version} eager: step times (s): "
              f"{', '.join(f'{t:.3f}' for t in hf_times)}; best {hf_s:.3f} s, {tokens / hf_s:,.0f} tokens/s")
        print(f"mlx_llm / HF tokens/s: {hf_s / step_s:.2f}x (best of each); "
              f"{float(np.median(hf_times)) / float(np.median(step_times)):.2f}x (medians)")
    common.save_from_args(args, {
        "args": common.arguments(args), "params": cfg.param_count(), "compile_and_first_step_seconds": compile_s,
        "step_seconds": step_times, "best_step_seconds": step_s, "tokens_per_second": tokens / step_s,
        "dot_peak_flops": peak, "flops_per_token": {"full": full, "causal": causal},
        "of_peak": {"full": full * tokens / step_s / peak, "causal": causal * tokens / step_s / peak},
        "temp_bytes": memory.temp_size_in_bytes, "argument_bytes": memory.argument_size_in_bytes,
        "hf": {"torch": hf.torch_version, "step_seconds": hf_times} if hf_times else None})


def torch_step(params, cfg: ModelConfig, args):
    """One training step of the transformers twin (same weights, same batch shape), or None without the extra."""
    from experiments.hf_twin import try_hf_twin

    twin = try_hf_twin(params, cfg)
    if twin is None:
        return None
    model, torch = twin
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len), generator=g)

    def step():
        logits = model(input_ids=tokens).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size).float(), targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    step.torch_version = torch.__version__
    return step


if __name__ == "__main__":
    main()
