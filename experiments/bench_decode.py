"""Decode speed, measured side by side in one run (U19 §6, M20 §14).

Decoders of the same greedy continuation:
  cached scan   mlx_llm.generate.generate: prefill + one lax.scan over steps, KV cache (the library's path);
                decode steps run the blocks over per-layer weight arrays (unroll_layers=True, the default)
  layer scan    the same with unroll_layers=False: each step scans the stacked weights, and XLA copies every
                layer's weight slice before its matmul (an extra read + write of all weights per token)
  python loop   the library's jitted one-token step (decode.step.step), called from Python once per token
                (state donated)
  recompute     no cache: a jitted full forward over the whole prefix for every new token

Per-token times at several contexts show U19 §6's line against the triangle: the cached step reads the cache
but computes one K/V row per layer, the recompute step computes all n+1 rows again. At batch 1 decoding is
bound by reading memory, so the script also measures the machine's read bandwidth (a jitted sum over a large
float32 array, best of several) and reports the fraction of the weight-streaming bound achieved:

    bound per token = (bytes of weights read per token + bytes of K/V cache read per token) / bandwidth

Any variant: ``--config experiments/configs/mamba.json`` (or hybrid.json, moe.json, sliding.json) decodes that
model (its max_seq_len raised to fit the contexts). The table then shows the decode state's bytes at each context:
the K/V cache of attention layers grows with it, a Mamba layer's (conv window, SSM state) does not, nor does a
sliding-window layer's ring buffer once the context passes its W slots (sliding.json: W = 128), so a pure-SSM or
pure-local model's per-token time is flat in the context while the recompute column still grows.

With the ``hf`` extra installed it also runs transformers' ``generate(do_sample=False)`` on the same weights
(``experiments/hf_twin.py``), checks the greedy tokens are identical and prints the tokens/s ratio, end to end and
per decode step, timed round-robin with ours.

Usage: python -m experiments.bench_decode [--quick] [--d-model 512 --n-layers 8 ... | --config FILE.json] [--no-hf]
Writes experiments/results/bench_decode.json (``--save NAME``: another name, for a variant such as --config).
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from mlx_llm import ModelConfig, forward, init_params
from mlx_llm.scaling.accounting import decode_state_bytes, kv_rows
from mlx_llm.decode import step as step_lib
from mlx_llm.decode.sampling import DecodeSettings, SamplingRows
from mlx_llm.decode.state import init_cache, unstack_layers
from mlx_llm.decode.generate import generate


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", help="a ModelConfig JSON file (any mixer/FFN pattern) instead of the flags below")
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--n-layers", type=int, default=8)
    ap.add_argument("--n-heads", type=int, default=8)
    ap.add_argument("--n-kv-heads", type=int, default=2)
    ap.add_argument("--d-ff", type=int, default=1408)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens decoded per timed run")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (best is kept)")
    ap.add_argument("--bandwidth-gib", type=float, default=1.0, help="size of the array summed to measure bandwidth")
    ap.add_argument("--quick", action="store_true", help="small run (~30 s): context 256 only, 16 tokens")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers generate() baseline")
    common.add_save_argument(ap, "bench_decode")
    args = ap.parse_args(argv)
    if args.quick:
        args.contexts, args.new_tokens, args.repeats, args.bandwidth_gib = [256], 16, 3, 0.25
    return args


def best_of(timers, repeats, self_timed=False):
    """Best time of each timer, run round-robin (warm-up first) so all of them see the same machine load."""
    return common.time_interleaved(timers, warmup=1, rounds=repeats, stat=min, self_timed=self_timed)


def read_bandwidth(gib, repeats):
    """Bytes per second of a jitted sum over a float32 array of ``gib`` GiB (reads every byte once)."""
    x = jnp.ones((int(gib * 2**30) // 4,), jnp.float32)
    seconds = common.time_steps(jax.jit(jnp.sum), x, warmup=1, rounds=max(repeats, 5), stat=min)
    del x
    return gib * 2**30 / seconds


def weight_bytes_per_token(params, cfg):
    """Every weight is read once per decode step, except the embedding table: only one row of it."""
    n_bytes = sum(a.nbytes for a in jax.tree.leaves(params))
    if not cfg.tie_embeddings:
        n_bytes -= params["embed"].nbytes - params["embed"][0].nbytes
    return n_bytes


def cached_timers(params, cfg, prompt, n_new):
    """Self-timed candidates: n_new greedy decode steps after an untimed prefill, cache donated, for three decoders.

    'scan' / 'lscan' are generate()'s decode loop: one jitted lax.scan over the public ``decode.step.advance``
    (forward one token + choose), over per-layer weights (generate's default) or scanning the stacked weights.
    'loop' calls the public jitted ``decode.step.step`` from Python once per token.
    """
    layers = unstack_layers(params, cfg)  # separate per-layer buffers, made once
    b, t = prompt.shape
    greedy, key = SamplingRows.of(DecodeSettings()), jax.random.key(0)
    active = jnp.ones((b,), bool)

    def scan_fn(cache, tok_B, layers):
        def body(carry, _):
            cache, tok_B = carry
            picked, cache = step_lib.advance(params, cache, tok_B, active, greedy, key, cfg=cfg, layers=layers)
            return (cache, picked.tokens), None
        return jax.lax.scan(body, (cache, tok_B), None, length=n_new)[0]

    scan = jax.jit(scan_fn, donate_argnums=0)

    def timed(decode):
        cache = init_cache(cfg, b, t + n_new, params["embed"].dtype)
        logits, cache = step_lib.prefill(params, cache, prompt, jnp.full((b,), t, jnp.int32), cfg=cfg)
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        jax.block_until_ready((tok, cache))
        return common.seconds(decode, cache, tok)

    def loop(cache, tok):
        for _ in range(n_new):
            picked, cache = step_lib.step(params, cache, tok, active, greedy, key, cfg=cfg, layers=layers)
            tok = picked.tokens
        return tok

    return {"scan": lambda: timed(lambda c, x: scan(c, x, layers)),
            "lscan": lambda: timed(lambda c, x: scan(c, x, None)),
            "loop": lambda: timed(loop)}


def recompute_timer(params, cfg, prompt):
    """No cache: one new token at context n costs a full forward over n + 1 positions (self-timed candidate)."""
    fwd = jax.jit(lambda p, x: jnp.argmax(forward(p, x, cfg)[:, -1], axis=-1))
    x = jnp.concatenate([prompt, prompt[:, :1]], axis=1)
    return lambda: common.seconds(fwd, params, x)


def measure(params, cfg, prompt, n_new, repeats):
    """Per-token seconds of each decoder at this prompt's context."""
    timers = dict(cached_timers(params, cfg, prompt, n_new), recompute=recompute_timer(params, cfg, prompt))
    best = best_of(timers, repeats, self_timed=True)
    return {name: t if name == "recompute" else t / n_new for name, t in best.items()}


def generate_check(params, cfg, prompt, n_new, repeats):
    """generate() itself, end to end: (t(1 + n_new) − t(1)) / n_new is its per-token decode time."""
    run = lambda n: lambda: generate(params, cfg, prompt, n).tokens  # noqa: E731
    best = best_of({"n": run(1 + n_new), "1": run(1)}, repeats)
    return best["1"], (best["n"] - best["1"]) / n_new


def hf_compare(params, cfg, prompt, n_new, repeats):
    """generate() against transformers' ``generate(do_sample=False)`` on the same weights (torch eager, KV cache),
    round-robin: (our seconds, HF seconds) for n_new tokens end to end, per-token decode seconds of each
    ((t(1 + n) − t(1)) / n), and whether the greedy tokens are identical. None without the hf extra."""
    from experiments.hf_twin import try_hf_twin

    twin = try_hf_twin(params, cfg)
    if twin is None:
        return None
    model, torch = twin
    model.eval()
    model.generation_config.eos_token_id = None  # run exactly n tokens, as generate() without eos_id does
    ids = torch.as_tensor(np.array(prompt), dtype=torch.long)

    def hf(n):
        with torch.no_grad():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                  pad_token_id=2)[0, ids.shape[1]:].numpy()

    def ours(n):
        return np.asarray(generate(params, cfg, prompt, n).tokens[0])

    same = bool(np.array_equal(hf(n_new), ours(n_new)))
    best = best_of({"ours n": lambda: ours(1 + n_new), "hf n": lambda: hf(1 + n_new), "ours 1": lambda: ours(1),
                    "hf 1": lambda: hf(1)}, repeats)
    return {"ours": best["ours n"], "hf": best["hf n"], "same_tokens": same,
            "ours_tok": (best["ours n"] - best["ours 1"]) / n_new, "hf_tok": (best["hf n"] - best["hf 1"]) / n_new,
            "torch": torch.__version__}


def in_place_check(params, cfg, max_len, layers):
    """Compiled memory of one donated decode step (``decode.step.step``): temporaries far below the cache size = no
    full copy."""
    cache = init_cache(cfg, 1, max_len, params["embed"].dtype)
    args = (params, cache, jnp.zeros((1,), jnp.int32), jnp.ones((1,), bool), SamplingRows.of(DecodeSettings()),
            jax.random.key(0))
    mem = step_lib.step.lower(*args, cfg=cfg, layers=layers).compile().memory_analysis()
    return mem.temp_size_in_bytes, decode_state_bytes(cfg, max_len, 1, params["embed"].dtype)


def describe(args, cfg, params, w_bytes):
    """Print the machine, the model, the read bandwidth and the in-place check; return the bandwidth."""
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), dtype {args.dtype}")
    kinds = "/".join(f"{m}+{f}" for m, f in cfg.group_kinds)
    heads = (f" heads {cfg.n_heads}q/{cfg.n_kv_heads}kv d_head={cfg.d_head}" if "attn" in cfg.mixer_pattern
             else f" N={cfg.ssm_state} I={cfg.ssm_expand * cfg.d_model}")
    print(f"model: d={cfg.d_model} L={cfg.n_layers} layers {kinds}{heads} d_ff={cfg.d_ff} V={cfg.vocab_size}: "
          f"{cfg.param_count() / 1e6:.1f}M parameters, {w_bytes / 2**20:.1f} MiB of weights read per token")
    bw = read_bandwidth(args.bandwidth_gib, args.repeats)
    print(f"read bandwidth (jitted sum over {args.bandwidth_gib:g} GiB float32, best of ≥5): {bw / 1e9:.1f} GB/s")
    for name, layers in (("per-layer weights", unstack_layers(params, cfg)), ("layer scan", None)):
        temp, cache_b = in_place_check(params, cfg, max(args.contexts) + args.new_tokens, layers)
        print(f"one decode step ({name}), decode state of {cache_b / 2**20:.1f} MiB: compiled temporaries "
              f"{temp / 2**20:.2f} MiB")
    print("  (the cache update is in place: no temporary of the cache's size. Temporaries: one layer's K/V slice"
          " copied for the attention matmul; under the layer scan also one layer's weights, copied every step)")
    return bw


def main(argv=None):
    args = parse_args(argv)
    dtype = jnp.dtype(args.dtype)
    max_len = max(args.contexts) + args.new_tokens + 1
    if args.config:
        cfg = dataclasses.replace(ModelConfig.from_json(args.config), max_seq_len=max_len)
    else:
        cfg = ModelConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
                          n_kv_heads=args.n_kv_heads, d_head=args.d_model // args.n_heads, d_ff=args.d_ff,
                          max_seq_len=max_len)
    # an RBG key: the weights' values do not matter here, and threefry compiles slowly on a small CPU
    params = jax.jit(init_params, static_argnums=(0, 2))(cfg, jax.random.key(0, impl="rbg"), dtype)
    w_bytes = weight_bytes_per_token(params, cfg)
    bw = describe(args, cfg, params, w_bytes)
    rng = np.random.default_rng(0)
    prompts = {ctx: jnp.asarray(rng.integers(0, cfg.vocab_size, (1, ctx)), jnp.int32) for ctx in args.contexts}
    head = (f"\n{'context':>7} | {'cached scan':>11} | {'layer scan':>11} | {'python loop':>11} | {'recompute':>10} | "
            f"{'recomp/cached':>13} | {'state bytes':>11} | {'bound':>8} | {'of bound':>8}")
    print(head + "\n" + "-" * (len(head) - 1))
    rows = []
    for ctx, prompt in prompts.items():
        m = measure(params, cfg, prompt, args.new_tokens, args.repeats)
        state_b = decode_state_bytes(cfg, ctx, 1, dtype)
        t_bound = (w_bytes + state_b) / bw
        print(f"{ctx:>7} | {m['scan'] * 1e3:>8.2f} ms | {m['lscan'] * 1e3:>8.2f} ms | {m['loop'] * 1e3:>8.2f} ms | "
              f"{m['recompute'] * 1e3:>7.1f} ms | {m['recompute'] / m['scan']:>12.1f}x | {state_b:>11,d} | "
              f"{t_bound * 1e3:>5.2f} ms | {t_bound / m['scan']:>7.0%}")
        rows.append({"context": ctx, "seconds_per_token": m, "state_bytes": state_b, "bound_seconds": t_bound,
                     "fraction_of_bound": t_bound / m["scan"]})
    ctx0 = args.contexts[0]
    t_first, t_tok = generate_check(params, cfg, prompts[ctx0], args.new_tokens, args.repeats)
    print(f"\ngenerate() end to end at context {ctx0}: prefill + first token {t_first * 1e3:.1f} ms, then "
          f"{t_tok * 1e3:.2f} ms per token ({1 / t_tok:.0f} tokens/s)")
    hf = None if args.no_hf else hf_compare(params, cfg, prompts[ctx0], args.new_tokens, args.repeats)
    if hf is not None:
        n = 1 + args.new_tokens
        print(f"HF transformers generate (torch {hf['torch']} eager, do_sample=False), same weights, context {ctx0}, "
              f"{n} new tokens: greedy tokens identical: {hf['same_tokens']}\n"
              f"  end to end: ours {hf['ours'] * 1e3:.0f} ms ({n / hf['ours']:.0f} tokens/s), HF {hf['hf'] * 1e3:.0f} ms "
              f"({n / hf['hf']:.0f} tokens/s): {hf['hf'] / hf['ours']:.2f}x\n"
              f"  per decode step: ours {hf['ours_tok'] * 1e3:.2f} ms, HF {hf['hf_tok'] * 1e3:.2f} ms: "
              f"{hf['hf_tok'] / hf['ours_tok']:.2f}x")
    print("per-token times, batch 1; tokens/s = 1000 / ms. 'state bytes' = K/V cache + Mamba states at that "
          "context; 'bound' = (weights + state) / bandwidth; 'of bound' = bound / cached-scan time.\n"
          f"K/V rows one attention layer computes to write {ctx0} tokens (U19 §6): {kv_rows(ctx0, True):,d} with "
          f"the cache, {kv_rows(ctx0, False):,d} without.")
    common.save_from_args(args, {"args": common.arguments(args), "params": cfg.param_count(),
                                 "weight_bytes_per_token": w_bytes, "read_bandwidth_bytes_per_second": bw,
                                 "rows": rows, "generate": {"first_token_seconds": t_first, "seconds_per_token": t_tok},
                                 "hf": hf})


if __name__ == "__main__":
    main()
