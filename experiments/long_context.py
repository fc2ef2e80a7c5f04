"""Longer contexts than the model was trained on (issue 24, part 5): RoPE scaling with and without a short
fine-tune, and sliding-window decoding against full attention.

1. The main job's model with its AdamW recipe (``recipes.BASE_MODEL`` / ``ADAMW_TRAIN``: seq_len T₀ = 128,
   the default corpus, a 1024-token BPE, as ``mlx-llm train`` builds them) is trained into ``--out/base`` (read
   back when it already finished). Its weights are then evaluated, with the library's own evaluation (``train.step.evaluate`` over the
   whole val split in consecutive windows of T tokens, as the trainer scores val bits/byte), at T = T₀ and at
   T = 2·T₀, 4·T₀ (4·T₀ = 512 = BASE_MODEL.max_seq_len) under four RoPE settings, each only a change of the
   ModelConfig's rope fields (``dataclasses.replace``): none (plain extrapolation), linear position
   interpolation (``rope_scale`` = T₀/T, U19 §7), dynamic NTK and YaRN (``rope_factor`` = T/T₀,
   ``rope_original_max_len`` = T₀). Positions restart at each document (the trainer's packing), and the stdlib
   files run to thousands of tokens, so most windows hold T positions of one file.
2. Each of those is also fine-tuned briefly at T (``--ft-steps`` steps of T₀·B/T windows of T tokens, so every
   step reads the pretraining step's 4,096 tokens; peak lr ``--ft-lr``, cosine, new optimizer moments), starting
   from the trained weights with the scaled config, and evaluated again at T. The library's pretraining command
   cannot start from given parameters with a changed ModelConfig (a branch keeps its parent's configs), so each
   fine-tune is the library's own loop, ``train.lm.train_loop(..., initial_params=...)`` (the path SFT takes),
   in a run directory of its own (``--out/ft-METHOD-T``: config, train config, run.json recording the base it
   started from, checkpoint, metrics, summary). A fine-tune at T₀ itself (no scaling) is the control: what the
   extra steps alone give.
3. Sliding-window decoding: BASE_MODEL with ``mixer_pattern ("local",)``, ``sliding_window`` W = 256,
   against the same weights (random init) with full attention ("attn"): the decode state's bytes
   (``accounting.decode_state_bytes``: min(t, W) positions per local layer, t per full one) and the per-token
   decode time at contexts of 1k, 4k and 16k positions (max_seq_len raised to fit; the context prefilled in
   chunks with ``decode.step.prefill``, then 64 one-token ``decode.step.advance`` steps in one jitted ``lax.scan``, over
   per-layer weights as ``generate`` does; the two models timed in turn, best of 5: ``common.time_interleaved``).

Everything goes to experiments/results/long_context.json with provenance (``--save``; under ``--quick`` only when
asked) and to ``--out/long_context.json``; the tables are printed as markdown.

    python -m experiments.long_context --out runs/long_context           # the measured run (13.5 min on 2 cores)
    python -m experiments.long_context --out /tmp/lc --quick             # a smoke run (tiny runs, ≲ 2 min)

A rerun with the same ``--out`` reads back every finished run; use a new ``--out`` for other settings.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from mlx_llm import init_params
from mlx_llm.config import ModelConfig, TrainConfig
from mlx_llm.decode import step as step_lib
from mlx_llm.decode.sampling import DecodeSettings, SamplingRows
from mlx_llm.decode.state import init_cache, unstack_layers
from mlx_llm.recipes import BASE_MODEL, ADAMW_TRAIN, MAIN_JOB_VOCAB
from mlx_llm.runs.configs import DataSpec
from mlx_llm.runs.load import load_params
from mlx_llm.runs.record import RUN_FILE, RunRecord, open_run, write_run
from mlx_llm.scaling.accounting import decode_state_bytes
from mlx_llm.data import text as text_lib
from mlx_llm.data import encoding as encoding_lib
from mlx_llm.train.metrics import SUMMARY_FILE, write_summary
from mlx_llm.train.parallel import make_mesh
from mlx_llm.data.corpora import read_text_and_tokenizer
from mlx_llm.runs.resume import open_resume
from mlx_llm.train.lm import train_loop
from mlx_llm.runs.pretrain import train_run
from mlx_llm.train.step import evaluate, make_eval_step

METHODS = ("none", "linear", "dynamic", "yarn")
FACTORS = (2, 4)  # T / T₀


@dataclasses.dataclass(frozen=True)
class Setting:
    """The sizes of one version of the experiment (``FULL`` or ``QUICK``)."""

    base: TrainConfig  # the main job's training (T₀ = base.seq_len)
    data: str | None  # corpus path (None: the standard library)
    eval_tokens: int | None  # val targets scored per evaluation (None: the whole split)
    ft_steps: int
    window: int  # W of the sliding-window model
    contexts: tuple[int, ...]  # decode contexts
    new_tokens: int  # decode steps per timed run
    repeats: int
    chunk: int  # prefill chunk


FULL = Setting(base=dataclasses.replace(ADAMW_TRAIN, log_interval=25), data=None, eval_tokens=None, ft_steps=50,
               window=256, contexts=(1024, 4096, 16384), new_tokens=64, repeats=5, chunk=1024)
QUICK = Setting(base=dataclasses.replace(ADAMW_TRAIN, steps=12, batch_size=8, seq_len=32, warmup_steps=2,
                                         eval_interval=12, checkpoint_interval=12, eval_tokens=2048, log_interval=4),
                data=str(text_lib.stdlib_root() / "json"), eval_tokens=2048, ft_steps=3, window=256,
                contexts=(1024, 4096), new_tokens=4, repeats=2, chunk=1024)


def quiet(*_args, **_kwargs) -> None:
    """A ``log`` that prints nothing (the runs' own progress lines)."""


# ----- 1–2: RoPE scaling ----------------------------------------------------------------------------------------
def scaled(cfg: ModelConfig, method: str, t: int, t0: int) -> ModelConfig:
    """``cfg`` with only its rope fields set to extend context T₀ to T."""
    if method == "none" or t == t0:
        return cfg
    if method == "linear":
        return dataclasses.replace(cfg, rope_scaling="linear", rope_scale=t0 / t)
    return dataclasses.replace(cfg, rope_scaling=method, rope_factor=t / t0, rope_original_max_len=t0)


def rope_fields(cfg: ModelConfig) -> dict:
    """The rope fields of ``cfg`` that differ from the defaults (what a method changed)."""
    default = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    return {k: v for k, v in cfg.to_dict().items() if k.startswith("rope_") and v != default[k]}


def val_bpb(params, cfg: ModelConfig, corpus, t: int, eval_tokens: int | None, batch_size: int = 32) -> float:
    """Val bits/byte of ``params`` under ``cfg`` over the val split in consecutive windows of ``t`` tokens (the
    trainer's evaluation)."""
    mesh = make_mesh()
    step = make_eval_step(cfg, mesh, "ar", corpus.tokenizer.mask_id)
    return evaluate(step, params, corpus.val_batches(t, batch_size, eval_tokens), mesh).bits_per_byte


def train_base(out: Path, setting: Setting, spec: DataSpec, cache_dir) -> dict:
    """The main job's run in ``out`` (its summary read back when it already finished)."""
    if (out / SUMMARY_FILE).is_file():
        return json.loads((out / SUMMARY_FILE).read_text())
    summary = train_run(out, BASE_MODEL, setting.base, spec, show_progress=False, cache_dir=cache_dir,
                        sample_tokens=8, log=quiet)
    print(f"base: {summary['steps']} steps at seq_len {setting.base.seq_len}, val bits/byte {summary['val_bpb']:.4f},"
          f" {summary['train_seconds']:.0f} s of training", flush=True)
    return summary


def ft_config(setting: Setting, t: int, steps: int, lr: float) -> TrainConfig:
    """The fine-tune at ``t``: the pretraining step's tokens in windows of ``t``, cosine from ``lr``, new draws of
    windows (seed 1), one evaluation and one checkpoint at the end."""
    base = setting.base
    return dataclasses.replace(base, seq_len=t, batch_size=max(1, base.batch_size * base.seq_len // t), steps=steps,
                               lr=lr, warmup_steps=min(5, steps - 1), schedule="cosine", final_lr_fraction=0.1,
                               eval_interval=steps, checkpoint_interval=steps, keep_checkpoints=1,
                               eval_tokens=setting.eval_tokens or 0, log_interval=min(10, steps), seed=1)


def fine_tune(run_dir: Path, cfg: ModelConfig, tcfg: TrainConfig, params, corpus, spec: DataSpec,
              origin: dict) -> dict:
    """``train_loop`` from ``params`` under ``cfg`` into ``run_dir`` (a run of its own; its summary read back
    when it finished, an interrupted one resumed)."""
    if (run_dir / SUMMARY_FILE).is_file():
        return json.loads((run_dir / SUMMARY_FILE).read_text())
    resume = (run_dir / RUN_FILE).is_file()
    if resume:
        run = open_run(run_dir)
        if run.cfg != cfg or run.tcfg != tcfg:
            raise SystemExit(f"{run_dir} holds a fine-tune with other settings: use a new --out")
    else:
        write_run(run_dir, cfg, tcfg, RunRecord(kind="pretrain", data=spec,
                                                provenance={"initialised_from": origin,
                                                            "experiment": "experiments/long_context.py"}))
        corpus.tokenizer.save(run_dir)
    start = jax.tree.map(jnp.copy, params)  # the first step donates the state: keep the caller's weights
    out = train_loop(run_dir, cfg, tcfg, corpus, plan=open_resume(run_dir).plan if resume else None, show_progress=False, log=quiet, initial_params=start)
    return write_summary(run_dir, out["summary"])


def extension_rows(out: Path, setting: Setting, spec: DataSpec, lr: float, cache_dir) -> tuple[dict, list]:
    """(the T₀ reference, one row per (method, T)): val bits/byte of the trained weights and of each fine-tune."""
    base_run = open_run(out / "base")
    params, cfg, t0 = load_params(base_run), base_run.cfg, setting.base.seq_len
    tok, text = read_text_and_tokenizer(base_run.path, spec, cache_dir)
    corpus = encoding_lib.encode_corpus(text, tok, cache_dir)
    origin = {"run": str(base_run.path), "step": base_run.checkpoint_steps()[-1]}
    ref_ft = fine_tune(out / f"ft-none-{t0}", cfg, ft_config(setting, t0, setting.ft_steps, lr), params, corpus, spec,
                       origin)
    reference = {"T": t0, "val_bpb": val_bpb(params, cfg, corpus, t0, setting.eval_tokens),
                 "val_bpb_finetuned": ref_ft["val_bpb"], "ft_train_seconds": ref_ft["train_seconds"]}
    print(f"T={t0}: {reference['val_bpb']:.4f} bits/byte ({setting.ft_steps} more steps at T={t0}: "
          f"{reference['val_bpb_finetuned']:.4f})", flush=True)
    rows = []
    for t in (f * t0 for f in FACTORS):
        for method in METHODS:
            c = scaled(cfg, method, t, t0)
            before = val_bpb(params, c, corpus, t, setting.eval_tokens)
            ft = fine_tune(out / f"ft-{method}-{t}", c, ft_config(setting, t, setting.ft_steps, lr), params, corpus,
                           spec, origin)
            rows.append({"method": method, "T": t, "factor": t // t0, "rope": rope_fields(c), "val_bpb": before,
                         "val_bpb_finetuned": ft["val_bpb"], "ft_run": str(out / f"ft-{method}-{t}"),
                         "ft_train_seconds": ft["train_seconds"]})
            print(f"T={t} {method}: {before:.4f} bits/byte, fine-tuned {ft['val_bpb']:.4f}", flush=True)
    return reference, rows


def extension_table(reference: dict, rows: list, ft_steps: int, eval_tokens: int | None) -> str:
    """The markdown table of parts 1–2: one row per method, columns T₀ then (as is, fine-tuned) per longer T."""
    t0 = reference["T"]
    ts = sorted({r["T"] for r in rows})
    head = f"| RoPE | T={t0} |" + "".join(f" T={t} ({t // t0}×) | + {ft_steps} steps at {t} |" for t in ts)
    lines = [head, "|---" * (1 + 1 + 2 * len(ts)) + "|"]
    for method in METHODS:
        cells = {r["T"]: r for r in rows if r["method"] == method}
        lines.append(f"| {method} | {reference['val_bpb']:.4f} |"
                     + "".join(f" {cells[t]['val_bpb']:.4f} | {cells[t]['val_bpb_finetuned']:.4f} |" for t in ts))
    scored = "the whole val split" if eval_tokens is None else f"the first {eval_tokens:,} val targets"
    lines.append(f"\nval bits/byte over {scored} in windows of T tokens. T={t0} with {ft_steps} more steps at "
                 f"T={t0} (the control: extra training alone): {reference['val_bpb_finetuned']:.4f}")
    return "\n".join(lines)


# ----- 3: sliding-window decoding -------------------------------------------------------------------------------
def decode_cfg(kind: str, window: int, max_len: int) -> ModelConfig:
    """BASE_MODEL with every mixer of ``kind`` ("local": W = ``window``), serving ``max_len`` positions."""
    return dataclasses.replace(BASE_MODEL, mixer_pattern=(kind,), max_seq_len=max_len,
                               sliding_window=window if kind == "local" else None)


def prefilled(params, cfg: ModelConfig, tokens_1T, chunk: int):
    """(the decode state after ``tokens_1T``, fed in chunks of ``chunk`` through the library's ``decode.step.prefill``,
    its last token)."""
    cache = init_cache(cfg, 1, cfg.max_seq_len)
    for s in range(0, tokens_1T.shape[1], chunk):
        part = tokens_1T[:, s:s + chunk]
        _, cache = step_lib.prefill(params, cache, part, jnp.full((1,), part.shape[1], jnp.int32), cfg=cfg,
                                    first=s == 0)
    return jax.block_until_ready(cache), tokens_1T[:, -1]


def decoder(params, cfg: ModelConfig, n_steps: int):
    """A function of no arguments decoding ``n_steps`` greedy tokens (one jitted ``lax.scan`` of the library's
    one-token step ``decode.step.advance`` over per-layer weights, the state donated) from the state it keeps."""
    layers = unstack_layers(params, cfg)
    greedy, key, active = SamplingRows.of(DecodeSettings()), jax.random.key(0), jnp.ones((1,), bool)

    def run(p, ls, carry):
        def body(c, _):
            cache, tok_1 = c
            picked, cache = step_lib.advance(p, cache, tok_1, active, greedy, key, cfg=cfg, layers=ls)
            return (cache, picked.tokens), None
        return jax.lax.scan(body, carry, None, length=n_steps)[0]

    step = jax.jit(run, donate_argnums=2)
    return lambda state: (lambda new: (new, new[1]))(step(params, layers, state))


def decode_rows(setting: Setting, n_steps: int, repeats: int) -> list:
    """State bytes and per-token decode seconds of the local and the full-attention model at each context."""
    kinds = ("local", "attn")
    params = init_params(decode_cfg("local", setting.window, 8), jax.random.key(0))  # the same weights for both
    rng, rows = np.random.default_rng(0), []
    for ctx in setting.contexts:
        max_len = ctx + (repeats + 1) * n_steps + 1  # the prefix, then the warm-up and timed rounds
        tokens = jnp.asarray(rng.integers(3, BASE_MODEL.vocab_size, (1, ctx)), jnp.int32)
        timers, row = {}, {"context": ctx}
        for kind in kinds:
            cfg = decode_cfg(kind, setting.window, max_len)
            state = prefilled(params, cfg, tokens, setting.chunk)
            row[kind] = {"state_bytes": decode_state_bytes(cfg, ctx, 1, "float32"),
                         "allocated_bytes": sum(a.nbytes for a in jax.tree.leaves(state[0]))}
            timers[kind] = common.carry(decoder(params, cfg, n_steps), state)
        best = common.time_interleaved(timers, warmup=1, rounds=repeats, stat=min)
        for kind in kinds:
            row[kind].update(seconds_per_token=best[kind] / n_steps, tokens_per_second=n_steps / best[kind])
        rows.append(row)
        print(f"decode at {ctx}: " + ", ".join(f"{k} {row[k]['seconds_per_token'] * 1e3:.2f} ms/token" for k in kinds),
              flush=True)
    return rows


def decode_table(rows: list, window: int, n_steps: int) -> str:
    """The markdown table of part 3."""
    lines = [f"| context | state, local W={window} | state, full | ms/token local | ms/token full | tokens/s local "
             f"| tokens/s full | full / local |", "|---" * 8 + "|"]
    for r in rows:
        loc, full = r["local"], r["attn"]
        lines.append(f"| {r['context']:,} | {loc['state_bytes'] / 2**20:.2f} MiB | {full['state_bytes'] / 2**20:.2f} "
                     f"MiB | {loc['seconds_per_token'] * 1e3:.2f} | {full['seconds_per_token'] * 1e3:.2f} | "
                     f"{loc['tokens_per_second']:,.0f} | {full['tokens_per_second']:,.0f} | "
                     f"{full['seconds_per_token'] / loc['seconds_per_token']:.2f}× |")
    lines.append(f"\nbatch 1, float32, random weights; state = accounting.decode_state_bytes at that context; time = "
                 f"best of the timed runs of {n_steps} one-token steps, the two models in turn.")
    return "\n".join(lines)


# ----- the script -------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="directory of the base run and the fine-tunes")
    ap.add_argument("--cache-dir", type=Path, help="token cache (default: the library's)")
    ap.add_argument("--ft-steps", type=int, help="fine-tuning steps at each longer context (default 50)")
    ap.add_argument("--ft-lr", type=float, default=5e-4, help="peak lr of the fine-tunes (pretraining: 5e-3)")
    ap.add_argument("--quick", action="store_true", help="tiny runs and contexts (a smoke run)")
    common.add_save_argument(ap, "long_context")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    setting = QUICK if args.quick else FULL
    if args.ft_steps is not None:
        setting = dataclasses.replace(setting, ft_steps=args.ft_steps)
    spec = DataSpec(path=setting.data, vocab_size=MAIN_JOB_VOCAB)
    t_start = time.perf_counter()
    base = train_base(args.out / "base", setting, spec, args.cache_dir)
    reference, rows = extension_rows(args.out, setting, spec, args.ft_lr, args.cache_dir)
    t_extension = time.perf_counter()
    decode = decode_rows(setting, setting.new_tokens, setting.repeats)
    t_end = time.perf_counter()
    print("\n" + extension_table(reference, rows, setting.ft_steps, setting.eval_tokens) + "\n")
    print(decode_table(decode, setting.window, setting.new_tokens) + "\n")
    print(f"wall time: {t_end - t_start:.0f} s ({t_extension - t_start:.0f} s training and evaluating, "
          f"{t_end - t_extension:.0f} s decoding)")
    payload = {"args": common.arguments(args), "setting": dataclasses.asdict(setting),
               "model": BASE_MODEL.to_dict(),
               "base": {"run": str(args.out / "base"),
                        **{k: base.get(k) for k in ("steps", "val_bpb", "train_seconds")}},
               "reference": reference, "extension": rows,
               "decode": {"window": setting.window, "new_tokens": setting.new_tokens, "rows": decode},
               "seconds": {"total": t_end - t_start, "extension": t_extension - t_start,
                           "decode": t_end - t_extension}}
    common.save_result("long_context", payload, directory=args.out)  # beside the runs, also under --quick
    common.save_from_args(args, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
