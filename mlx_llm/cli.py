"""The ``mlx-llm`` command: train, eval, generate, and the post-training commands (sft, reward, dpo, rl, …).

Every user error (an ``MLXLLMError``, a bad flag, an unreadable file) prints one line naming the problem and
the fix on stderr and exits with status 2, without a traceback; nothing already written is overwritten.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from mlx_llm.config import (ATTENTION_IMPLS, COMPUTE_DTYPES, MOE_IMPLS, OBJECTIVES, REMAT_POLICIES, ModelConfig,
                            TrainConfig)
from mlx_llm.post.tasks import TASKS
from mlx_llm.recipes import MAIN_JOB_MODEL, MAIN_JOB_TRAIN, MAIN_JOB_VOCAB, PREF_BETA, PREF_TRAIN, SFT_TRAIN
from mlx_llm.errors import MLXLLMError


# flags that override a TrainConfig field (flag name → field)
TRAIN_FLAGS = {"steps": int, "batch_size": int, "seq_len": int, "lr": float, "warmup_steps": int,
               "grad_accum": int, "eval_interval": int, "eval_tokens": int, "checkpoint_interval": int,
               "keep_checkpoints": int, "seed": int, "compute_dtype": str, "weight_decay": float,
               "clip_norm": float, "log_interval": int, "objective": str, "mesh": str, "remat": str,
               "attention_impl": str, "moe_impl": str, "loss_chunk": str}


def loss_chunk(text: str):
    """``--loss-chunk``: a number of rows (0 = whole logits) or "auto"."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: give a number of rows (0 = the whole logits at "
                                         f"once) or 'auto'") from None


KERNEL_FLAG_KWARGS = {
    "attention_impl": {"choices": ATTENTION_IMPLS, "help": "attention implementation (default auto: splash on "
                       "TPU, pallas_gpu on GPU, xla on the CPU; flash: blockwise, linear memory, any backend)"},
    "moe_impl": {"choices": MOE_IMPLS, "help": "MoE grouped product (default auto: megablox on TPU, ragged_dot on "
                 "GPU, block on the CPU)"},
    "loss_chunk": {"type": loss_chunk, "metavar": "N|auto", "help": "rows of logits formed at a time by the loss "
                   "(0: all; default auto: chunked on accelerators, whole on the CPU)"},
}


def add_kernel_flags(parser, default=None) -> None:
    for flag, kwargs in KERNEL_FLAG_KWARGS.items():
        parser.add_argument("--" + flag.replace("_", "-"), dest=flag, default=default, **kwargs)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not usage + message
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="mlx-llm", description="Train, evaluate and sample a MiniLLM.")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_Parser)

    tr = sub.add_parser("train", help="train a model (defaults: the ~5-minute main job on the Python stdlib)")
    tr.add_argument("--config", type=Path, help="model config.json (default: the main job's model)")
    tr.add_argument("--train-config", type=Path, help="train_config.json (default: the main job's settings)")
    tr.add_argument("--data", help="a text file, a directory (recursive) or a glob (default: the Python stdlib)")
    tr.add_argument("--extensions", default=".py,.txt,.md", help="file extensions for a directory (default %(default)s)")
    tr.add_argument("--val-percent", type=float, default=5.0, help="share of files held out (default %(default)s)")
    tr.add_argument("--tokenizer", choices=("bpe", "byte"), default="bpe")
    tr.add_argument("--vocab-size", type=int, default=MAIN_JOB_VOCAB, help="BPE vocabulary (default %(default)s)")
    tr.add_argument("--out", type=Path, help="run directory (default: runs/run-<date>-<time>)")
    tr.add_argument("--resume", action="store_true",
                    help="continue the run in --out from its latest checkpoint (with --steps N: extend it to N steps)")
    tr.add_argument("--from-step", type=int, metavar="N",
                    help="with --resume: continue from checkpoint N, not the latest (e.g. when the latest is "
                         "damaged); later checkpoints are renamed aside (<step>.corrupt-… / .superseded-…), not deleted")
    tr.add_argument("--cache-dir", type=Path, help="token cache (default ~/.cache/mlx_llm)")
    tr.add_argument("--prompt", default="def ", help="prompt of the closing sample")
    tr.add_argument("--sample-tokens", type=int, default=200)
    tr.add_argument("--no-progress", action="store_true")
    tr.add_argument("--time-budget", type=float, metavar="SECONDS",
                    help="set --steps to what fits SECONDS of training loop on this machine (measured first)")
    dist = tr.add_argument_group("several processes (README, 'Several machines')")
    dist.add_argument("--distributed", action="store_true",
                      help="join a multi-process run (jax.distributed): settings from the flags below, else from "
                           "JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, else JAX's cluster detection")
    dist.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address (implies --distributed)")
    dist.add_argument("--num-processes", type=int, help="processes in the run (implies --distributed)")
    dist.add_argument("--process-id", type=int, help="this process's index, 0 … N−1 (implies --distributed)")
    for flag, typ in TRAIN_FLAGS.items():
        kwargs = {"compute_dtype": {"choices": COMPUTE_DTYPES},
                  "mesh": {"metavar": "AXIS=N,…", "help": "device mesh, e.g. data=2,fsdp=4 (axes data, fsdp, tensor; "
                           "default: every device on data); parameters and optimizer state are split along fsdp"},
                  "remat": {"choices": REMAT_POLICIES, "help": "recompute activations per layer in the backward "
                            "pass: none (default), full or dots"},
                  "objective": {"choices": OBJECTIVES, "help": "ar (next token, default) or diffusion (masked "
                                "diffusion: a bidirectional denoiser trained on the NELBO bound)"},
                  **KERNEL_FLAG_KWARGS}.get(flag, {})
        tr.add_argument("--" + flag.replace("_", "-"), **{"type": typ, "dest": flag, **kwargs})

    ev = sub.add_parser("eval", help="val loss, perplexity and bits per byte of a run's latest checkpoint")
    ev.add_argument("--run", type=Path, required=True)
    ev.add_argument("--step", type=int, help="checkpoint step (default: latest)")
    ev.add_argument("--cache-dir", type=Path)
    add_kernel_flags(ev, default="auto")

    co = sub.add_parser("compile", help="pre-flight: compile a configuration's train step ahead of time (for "
                        "the local devices or a TPU topology) and print its per-device memory")
    co.add_argument("--config", type=Path, help="model config.json (default: the main job's model)")
    co.add_argument("--train-config", type=Path, help="train_config.json (default: the main job's settings)")
    co.add_argument("--target", default="local", help="local (default) or tpu:<generation>-<N>, e.g. tpu:v5e-4, "
                    "tpu:v5p-16, tpu:v6e-4 (N: chips for v5e/v6e, TensorCores for v4/v5p)")
    co.add_argument("--json", action="store_true", help="print one JSON object")
    for flag in ("batch_size", "seq_len", "grad_accum", "mesh", "remat", "compute_dtype", "objective",
                 "attention_impl", "moe_impl", "loss_chunk"):
        kwargs = {"compute_dtype": {"choices": COMPUTE_DTYPES}, "remat": {"choices": REMAT_POLICIES},
                  "objective": {"choices": OBJECTIVES}, **KERNEL_FLAG_KWARGS}.get(flag, {})
        co.add_argument("--" + flag.replace("_", "-"), **{"type": TRAIN_FLAGS[flag], "dest": flag, **kwargs})

    sf = sub.add_parser("sft", help="fine-tune a pretrained run on conversations (full or LoRA)")
    sf.add_argument("--base", type=Path, help="the pretrained run directory")
    data = sf.add_mutually_exclusive_group()
    data.add_argument("--data", type=Path, help="conversations, JSONL ({\"messages\": [...]} per line)")
    data.add_argument("--task", choices=TASKS, help="a built-in task (mlx_llm.post.tasks)")
    sf.add_argument("--out", type=Path, required=True)
    sf.add_argument("--resume", action="store_true")
    sf.add_argument("--train-examples", type=int, help="cap on the task's train examples")
    sf.add_argument("--eval-examples", type=int, default=200, help="held-out task examples scored at the end")
    sf.add_argument("--lora-rank", type=int, help="train rank-R adapters instead of every weight")
    sf.add_argument("--lora-alpha", type=float, default=16.0)
    sf.add_argument("--lora-targets", default="wq,wv", help="comma-separated weight keys (default %(default)s)")
    sf.add_argument("--no-progress", action="store_true")
    for flag, typ in TRAIN_FLAGS.items():
        if flag not in ("objective", "compute_dtype"):
            sf.add_argument("--" + flag.replace("_", "-"), **{"type": typ, "dest": flag,
                                                               **KERNEL_FLAG_KWARGS.get(flag, {})})

    for name, help_ in (("reward", "train a Bradley–Terry reward model on preference pairs"),
                        ("dpo", "direct preference optimisation of a run on preference pairs"),
                        ("rl", "KL-leashed on-policy RL of a run on a task (checker or reward-model reward)")):
        add_post_parser(sub.add_parser(name, help=help_), name)

    et = sub.add_parser("eval-task", help="held-out exact match of a run on a built-in task")
    et.add_argument("--run", type=Path, required=True)
    et.add_argument("--task", choices=TASKS, required=True)
    et.add_argument("--examples", type=int, help="how many held-out examples (default: all)")

    ch = sub.add_parser("chat", help="a terminal chat with a run, over the chat template")
    ch.add_argument("--run", type=Path, required=True)
    ch.add_argument("--max-new-tokens", type=int, default=128)
    ch.add_argument("--temperature", type=float, help="omit for greedy decoding")
    ch.add_argument("--system", help="a system message")

    mg = sub.add_parser("export-merged", help="write a plain run with a LoRA run's adapters folded in")
    mg.add_argument("--run", type=Path, required=True)
    mg.add_argument("--out", type=Path, required=True)

    hx = sub.add_parser("export", help="write a run as a Hugging Face transformers checkpoint (Llama, Mamba or "
                        "Mixtral; safetensors)")
    hx.add_argument("--run", type=Path, required=True)
    hx.add_argument("--to", type=Path, required=True, help="a new directory for from_pretrained")
    hx.add_argument("--step", type=int, help="checkpoint step (default: latest)")
    hi = sub.add_parser("import", help="a transformers checkpoint directory (Llama, Mamba or Mixtral; "
                        "safetensors) as a run")
    hi.add_argument("--from", dest="source", type=Path, required=True)
    hi.add_argument("--out", type=Path, required=True, help="a new run directory")

    ge = sub.add_parser("generate", help="continue a prompt with a trained run")
    ge.add_argument("--run", type=Path, required=True)
    ge.add_argument("--prompt", required=True)
    ge.add_argument("--max-new-tokens", type=int, default=100)
    ge.add_argument("--temperature", type=float, help="omit for greedy decoding")
    ge.add_argument("--top-k", type=int)
    ge.add_argument("--top-p", type=float)
    ge.add_argument("--beam", type=int, help="beam width (beam search; excludes sampling settings)")
    ge.add_argument("--diffusion-steps", type=int, default=64, help="denoising steps S (diffusion runs)")
    ge.add_argument("--sampler", choices=("ancestral", "remask"), default="ancestral",
                    help="diffusion sampler (diffusion runs; default %(default)s)")
    ge.add_argument("--seed", type=int, default=0)
    ge.add_argument("--step", type=int, help="checkpoint step (default: latest)")
    ge.add_argument("--json", action="store_true", help="print the result and how to reproduce it as JSON")
    add_kernel_flags(ge, default="auto")
    return ap


def add_post_parser(pp, kind: str) -> None:
    """Flags of the preference commands (reward, dpo, rl): base run, data or task, LoRA, training overrides."""
    pp.add_argument("--base", type=Path, help="the run to start from (pretrained or SFT)")
    if kind == "rl":
        pp.add_argument("--task", choices=TASKS, help="a built-in task: prompts and the exact checker")
        pp.add_argument("--reward-model", type=Path, help="a reward run scoring replies instead of the checker")
        pp.add_argument("--k", type=int, default=8, help="replies sampled per prompt (≥ 2; default %(default)s)")
    else:
        data = pp.add_mutually_exclusive_group()
        data.add_argument("--data", type=Path, help='pairs, JSONL ({"prompt": [...], "chosen": {...}, '
                                                    '"rejected": {...}} per line)')
        data.add_argument("--task", choices=TASKS, help="pairs built from a task (correct vs corrupted answers)")
        pp.add_argument("--model-negatives", action="store_true",
                        help="with --task, add the base model's own wrong samples as rejected replies")
    if kind == "dpo":
        pp.add_argument("--nll-weight", type=float, help="α of an added chosen-reply NLL term (RPO; default 0: "
                                                         "pure DPO)")
    if kind != "reward":
        pp.add_argument("--beta", type=float, default=PREF_BETA[kind], help="β of the KL leash (default %(default)s)")
        pp.add_argument("--reference", type=Path, help="the frozen reference run (default: --base)")
        pp.add_argument("--eval-examples", type=int, default=200, help="held-out task examples scored at the end")
    pp.add_argument("--out", type=Path, required=True)
    pp.add_argument("--resume", action="store_true")
    pp.add_argument("--train-examples", type=int, help="cap on the task's train examples")
    pp.add_argument("--lora-rank", type=int, help="train rank-R adapters instead of every weight")
    pp.add_argument("--lora-alpha", type=float, default=16.0)
    pp.add_argument("--lora-targets", default="wq,wv", help="comma-separated weight keys (default %(default)s)")
    pp.add_argument("--no-progress", action="store_true")
    for flag, typ in TRAIN_FLAGS.items():
        if flag not in ("objective", "compute_dtype", "grad_accum", "mesh", "remat"):
            pp.add_argument("--" + flag.replace("_", "-"), **{"type": typ, "dest": flag,
                                                               **KERNEL_FLAG_KWARGS.get(flag, {})})


def train_configs(args) -> tuple[ModelConfig, TrainConfig]:
    cfg = ModelConfig.from_json(args.config) if args.config else MAIN_JOB_MODEL
    tcfg = TrainConfig.from_json(args.train_config) if args.train_config else MAIN_JOB_TRAIN
    overrides = {k: getattr(args, k) for k in TRAIN_FLAGS if getattr(args, k, None) is not None}
    if overrides:
        tcfg = TrainConfig(**{**tcfg.to_dict(), **overrides})
    return cfg, tcfg


def cmd_train(args) -> int:
    from mlx_llm.train.run import RESUME_MAY_CHANGE, DataSpec, train_run

    if args.distributed or any(v is not None for v in (args.coordinator, args.num_processes, args.process_id)):
        from mlx_llm.train.parallel import init_distributed

        init_distributed(args.coordinator, args.num_processes, args.process_id)
        if args.out is None:
            raise MLXLLMError("a multi-process run needs --out DIR (the same shared directory in every process)")
    out = args.out or Path("runs") / time.strftime("run-%Y%m%d-%H%M%S")
    changes = None
    if args.resume:
        if args.out is None:
            raise MLXLLMError("--resume needs --out DIR, the run directory to continue")
        given = (args.config, args.train_config, args.data, args.time_budget) + tuple(
            getattr(args, k) for k in TRAIN_FLAGS if k not in RESUME_MAY_CHANGE)
        if any(v is not None for v in given):
            may = ", ".join("--" + k.replace("_", "-") for k in sorted(RESUME_MAY_CHANGE) if k in TRAIN_FLAGS)
            raise MLXLLMError("--resume continues a run exactly as it was configured: drop the other settings "
                              f"(they are read from the run directory; only {may} may change)")
        changes = {k: getattr(args, k) for k in sorted(RESUME_MAY_CHANGE & TRAIN_FLAGS.keys())
                   if getattr(args, k) is not None}
        cfg = tcfg = spec = None
    else:
        cfg, tcfg = train_configs(args)
        exts = tuple(e if e.startswith(".") else "." + e for e in args.extensions.split(",") if e)
        spec = DataSpec(path=args.data, extensions=exts, val_percent=args.val_percent, tokenizer=args.tokenizer,
                        vocab_size=args.vocab_size)
    summary = train_run(out, cfg, tcfg, spec, resume=args.resume, show_progress=not args.no_progress,
                        cache_dir=args.cache_dir, sample_prompt=args.prompt, sample_tokens=args.sample_tokens,
                        time_budget=args.time_budget, changes=changes, from_step=args.from_step)
    from mlx_llm.train.parallel import is_main_process

    if not is_main_process():  # a multi-process run: process 0 reports
        return 0
    print(f"run: {out}")
    bound = " (diffusion NELBO: upper bounds)" if _is_diffusion(out) else ""
    print(f"val loss {summary['val_loss']:.4f} nats/token, perplexity {summary['val_ppl']:.2f}, "
          f"bits/byte {summary['val_bpb']:.4f}{bound} (unigram baseline {summary['unigram_val_bpb']:.4f}); "
          f"wall {summary['wall_seconds']:.0f} s")
    print("sample:\n" + summary["sample"])
    return 0


def _is_diffusion(run_dir) -> bool:
    from mlx_llm.train.checkpoint import read_run_files

    try:
        return read_run_files(Path(run_dir))[1].objective == "diffusion"
    except MLXLLMError:
        return False


def cmd_eval(args) -> int:
    from mlx_llm.train.run import evaluate_run

    step, res = evaluate_run(args.run, cache_dir=args.cache_dir, step=args.step, kernels=_kernels(args))
    bound = " (diffusion NELBO: upper bounds)" if _is_diffusion(args.run) else ""
    print(f"{args.run} step {step}: val loss {res.loss:.4f} nats/token, perplexity {res.perplexity:.3f}, "
          f"bits/byte {res.bits_per_byte:.4f}{bound} ({res.n_targets:,} tokens, {res.n_bytes:,} bytes)")
    return 0


def _kernels(args):
    """The execution paths of ``--attention-impl`` / ``--moe-impl`` / ``--loss-chunk``, resolved for this backend
    (a kernel it cannot run is refused here, before any work)."""
    from mlx_llm.kernels import Kernels

    return Kernels(attention_impl=args.attention_impl, moe_impl=args.moe_impl, loss_chunk=args.loss_chunk).resolve()


def cmd_compile(args) -> int:
    """The pre-flight check: exit 0 when the step fits the target, 1 (one line: by how much, what helps) when not."""
    from mlx_llm.train.preflight import advice, compile_step, format_report

    cfg, tcfg = train_configs(args)
    out = compile_step(cfg, tcfg, args.target)
    print(json.dumps(out, indent=2) if args.json else format_report(out))
    if not out["fits"]:
        print(f"mlx-llm compile: {advice(out)}", file=sys.stderr)
        return 1
    return 0


def cmd_generate(args) -> int:
    from mlx_llm.train.run import generate_from_run

    record = generate_from_run(args.run, args.prompt, max_new_tokens=args.max_new_tokens,
                               temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                               beam_width=args.beam, seed=args.seed, step=args.step,
                               diffusion_steps=args.diffusion_steps, sampler=args.sampler,
                               kernels=_kernels(args))
    print(json.dumps(record, indent=2) if args.json else args.prompt + record["continuation"])
    return 0


def cmd_sft(args) -> int:
    from mlx_llm.post.sft import sft_run

    show = not args.no_progress
    if args.resume:
        given = (args.base, args.data, args.task, args.train_examples, args.lora_rank) + tuple(
            getattr(args, k) for k in TRAIN_FLAGS if k not in ("objective", "compute_dtype"))
        if any(v is not None for v in given):
            raise MLXLLMError("--resume continues a run exactly as it was configured: give only --out")
        summary = sft_run(args.out, resume=True, show_progress=show, eval_examples=args.eval_examples)
    else:
        if args.base is None or (args.data is None and args.task is None):
            raise MLXLLMError("sft needs --base RUN and one of --data FILE.jsonl / --task NAME")
        overrides = {k: getattr(args, k) for k in TRAIN_FLAGS if getattr(args, k, None) is not None}
        tcfg = TrainConfig(**{**SFT_TRAIN.to_dict(), **overrides})
        summary = sft_run(args.out, args.base, tcfg=tcfg, data=args.data, task=args.task, lora_cfg=_lora_cfg(args),
                          n_train=args.train_examples, eval_examples=args.eval_examples, show_progress=show)
    print(f"run: {args.out}; trainable parameters {summary['trainable_params']:,}; val loss (response tokens) "
          f"{summary['val_loss']:.4f}")
    _print_heldout(summary)
    return 0


def _print_heldout(summary: dict) -> None:
    """The held-out task accuracy of a fine-tuning run's summary, and its base's when measured."""
    if "heldout_accuracy" in summary:
        before = summary.get("base_heldout_accuracy")
        of = f" of {summary['heldout_examples']}" if "heldout_examples" in summary else ""
        print(f"held-out exact match {summary['heldout_accuracy']:.1%}{of}"
              + ("" if before is None else f" (base: {before:.1%})"))




def _lora_cfg(args):
    from mlx_llm.post.lora import LoRAConfig

    return None if args.lora_rank is None else LoRAConfig(
        rank=args.lora_rank, alpha=args.lora_alpha, targets=tuple(t for t in args.lora_targets.split(",") if t))


def cmd_post(args) -> int:
    """reward / dpo / rl: a new run from --base, or --resume of one (then only --out)."""
    from mlx_llm.post import dpo, reward, rl

    kind, show = args.command, not args.no_progress
    specific = {"reward": ("data", "task"), "dpo": ("data", "task", "reference", "nll_weight"),
                "rl": ("task", "reward_model", "reference")}[kind]
    if args.resume:
        given = (args.base, args.train_examples, args.lora_rank) + tuple(getattr(args, k) for k in specific) + tuple(
            getattr(args, k, None) for k in TRAIN_FLAGS)
        if any(v is not None for v in given):
            raise MLXLLMError("--resume continues a run exactly as it was configured: give only --out")
        common = dict(resume=True, show_progress=show)
    else:
        if args.base is None or all(getattr(args, k, None) is None for k in ("data", "task")):
            need = "--task NAME" if kind == "rl" else "one of --data FILE.jsonl / --task NAME"
            raise MLXLLMError(f"{kind} needs --base RUN and {need}")
        overrides = {k: getattr(args, k) for k in TRAIN_FLAGS if getattr(args, k, None) is not None}
        common = dict(base_run=args.base, tcfg=TrainConfig(**{**PREF_TRAIN[kind].to_dict(), **overrides}),
                      task=args.task, lora_cfg=_lora_cfg(args), n_train=args.train_examples, show_progress=show)
    if kind == "reward":
        if not args.resume:
            common.update(data=args.data, model_negatives=args.model_negatives)
        summary = reward.reward_run(args.out, **common)
        print(f"run: {args.out}; held-out preference accuracy {summary['val_accuracy']:.1%} (Bradley–Terry loss "
              f"{summary['val_loss']:.4f})")
        return 0
    if not args.resume:
        common.update(beta=args.beta, reference=args.reference)
    if kind == "dpo":
        if not args.resume:
            common.update(data=args.data, model_negatives=args.model_negatives, nll_weight=args.nll_weight or 0.0)
        summary = dpo.dpo_run(args.out, eval_examples=args.eval_examples, **common)
        print(f"run: {args.out}; held-out pairs: preference accuracy {summary['val_accuracy']:.1%}, implicit reward "
              f"margin {summary['val_margin']:.4f}, loss {summary['val_loss']:.4f}")
    else:
        if not args.resume:
            common.update(k=args.k, reward_model=args.reward_model)
        summary = rl.rl_run(args.out, eval_examples=args.eval_examples, **common)
        if summary["reward"] is None:  # a resumed run that had nothing left to train
            print(f"run: {args.out}; finished at step {summary['steps']}")
        else:
            print(f"run: {args.out}; last step: reward {summary['reward']:.3f}, KL to the reference "
                  f"{summary['kl']:.4f}, reply length {summary['response_length']:.1f}")
    _print_heldout(summary)
    return 0


def cmd_eval_task(args) -> int:
    from mlx_llm.post.loop import run_template
    from mlx_llm.post.sft import eval_task
    from mlx_llm.train import tokenizer as tok_lib
    from mlx_llm.train.checkpoint import read_run_files
    from mlx_llm.train.run import load_params

    cfg, tcfg, info = read_run_files(args.run)
    res = eval_task(load_params(args.run, cfg, tcfg), cfg, tok_lib.load(args.run), args.task, run_template(info),
                    n=args.examples)
    print(f"{args.run} on {args.task}: held-out exact match {res['accuracy']:.1%} ({res['correct']} of {res['n']})")
    return 0


def cmd_chat(args) -> int:
    import numpy as np

    from mlx_llm.decode.generate import generate
    from mlx_llm.post.loop import run_template
    from mlx_llm.train import tokenizer as tok_lib
    from mlx_llm.train.checkpoint import read_run_files
    from mlx_llm.train.run import load_params

    cfg, tcfg, info = read_run_files(args.run)
    template = run_template(info)
    tok, params = tok_lib.load(args.run), load_params(args.run, cfg, tcfg)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("chat with", args.run, "(an empty line or Ctrl-D ends)")
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            return 0
        if not line:
            return 0
        messages.append({"role": "user", "content": line})
        ids, _ = template.encode(messages, tok, generation_prompt=True)
        n_new = min(args.max_new_tokens, cfg.max_seq_len - len(ids))
        if n_new < 1:
            print("(the conversation has reached the model's max_seq_len; start a new one)")
            return 0
        out = generate(params, cfg, ids[None], n_new, temperature=args.temperature,
                       eos_id=tok.token_id(template.end), pad_id=tok.pad_id)
        reply = np.asarray(out.tokens[0])[: int(out.lengths[0])]
        text = tok.decode(reply, skip_special=True)
        print("model>", text)
        messages.append({"role": "assistant", "content": text if text.strip() else "…"})


def cmd_export_merged(args) -> int:
    from mlx_llm.post.sft import merge_run

    print(f"wrote {merge_run(args.run, args.out)}")
    return 0


def cmd_export(args) -> int:
    from mlx_llm.interop.hf import export_run

    out = export_run(args.run, args.to, step=args.step)
    print(f"wrote {out}: load it with transformers' AutoModelForCausalLM.from_pretrained and AutoTokenizer")
    return 0


def cmd_import(args) -> int:
    from mlx_llm.interop.hf import import_hf

    print(f"wrote {import_hf(args.source, args.out)}: a run (mlx-llm generate / eval / sft --base take it)")
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    command = {"train": cmd_train, "eval": cmd_eval, "compile": cmd_compile, "generate": cmd_generate, "sft": cmd_sft,
               "reward": cmd_post, "dpo": cmd_post, "rl": cmd_post, "eval-task": cmd_eval_task, "chat": cmd_chat, "export-merged": cmd_export_merged,
               "export": cmd_export, "import": cmd_import}[args.command]
    try:
        return command(args)
    except MLXLLMError as exc:
        print(f"mlx-llm {args.command}: error: {exc}", file=sys.stderr)
    except OSError as exc:
        print(f"mlx-llm {args.command}: error: {exc.strerror or exc} ({exc.filename or ''})", file=sys.stderr)
    except KeyboardInterrupt:
        print(f"mlx-llm {args.command}: interrupted; the last checkpoint is kept (continue with --resume)",
              file=sys.stderr)
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
