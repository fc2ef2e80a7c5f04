"""The ``mlx-llm`` argument parser: each subcommand's flags are generated from the configs it takes
(``flags.add_config_flags``), plus the few that are not config fields (paths, --resume, output switches).

A subcommand has exactly the flags it honours: the preference commands take no ``--objective`` (they train
next-token models) nor ``--compute-dtype`` (their objectives run in float32), ``rl`` no ``--eval-tokens`` (it
evaluates held-out task examples, ``--eval-examples``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mlx_llm.cli.flags import add_config_flags
from mlx_llm.config import ModelConfig, TrainConfig
from mlx_llm.data.tasks import TASKS
from mlx_llm.recipes import MAIN_JOB_TRAIN, MAIN_JOB_VOCAB, PREF_TRAIN, SFT_TRAIN
from mlx_llm.runs.configs import DataSpec, DPOConfig, RewardConfig, RLConfig, RunOptions, SFTConfig, Sizing
from mlx_llm.config import LoRAConfig

KERNEL_FIELDS = ("attention_impl", "moe_impl", "loss_chunk")
COMPILE_FIELDS = ("batch_size", "seq_len", "grad_accum", "mesh", "remat", "compute_dtype", "objective",
                  *KERNEL_FIELDS)
POST_SETTINGS = {"sft": SFTConfig, "reward": RewardConfig, "dpo": DPOConfig, "rl": RLConfig}
POST_RECIPES = {"sft": SFT_TRAIN, **PREF_TRAIN}
POST_EXCLUDED = {"sft": ("objective",), "reward": ("objective", "compute_dtype", "z_loss"),
                 "dpo": ("objective", "compute_dtype", "z_loss"),
                 "rl": ("objective", "compute_dtype", "eval_tokens", "z_loss")}
FAMILIES = "Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral, Mamba, Gemma 2 or Gemma 3"  # interop/hf_config.py: the families mapped
POST_HELP = {"sft": "fine-tune a run on conversations (full or LoRA)",
             "reward": "train a Bradley–Terry reward model on preference pairs",
             "dpo": "direct preference optimisation of a run on preference pairs",
             "rl": "KL-leashed on-policy RL of a run on a task (checker or reward-model reward)"}


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not usage + message
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def add_run_flags(p, *, out_required: bool, sections: dict) -> None:
    """--out, --resume, --from-step, --no-progress: where a training command writes and how it continues; what
    it reports and how it runs (``RunOptions``: trackers, profiler, HLO, time-based checkpoints, the compilation
    cache, --trust-unverified); ``--set`` over ``sections`` ({name: (section, class)})."""
    p.add_argument("--out", type=Path, required=out_required, help="run directory" + (
        "" if out_required else " (default: runs/run-<date>-<time>)"))
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint; "
                   "a setting given with it must equal the run's, except --steps (which extends the run), --mesh, "
                   "--remat and the kernel flags")
    p.add_argument("--from-step", type=int, metavar="N", help="with --resume: continue from checkpoint N, not the "
                   "latest (e.g. when the latest is damaged); later checkpoints are renamed aside, not deleted")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--set", dest="sets", action="append", metavar="SECTION.FIELD=VALUE",
                   help=f"set any field of the command's configs (repeatable; sections: {', '.join(sections)}), "
                   f"e.g. --set train.lr=1e-3; validated like the config files")
    p.set_defaults(sections=sections)
    add_config_flags(p.add_argument_group("reporting and running (none changes a number; a resume may differ)"),
                     RunOptions, "run")


def add_train(sub) -> None:
    tr = sub.add_parser("train", help="train a model (defaults: the ~5-minute main job on the Python stdlib)")
    tr.add_argument("--config", type=Path, help="model config.json (default: the main job's model)")
    tr.add_argument("--train-config", type=Path, help="train_config.json under the flags (default: the main job's "
                    "settings)")
    add_run_flags(tr, out_required=False, sections={"model": ("model", ModelConfig), "train": ("train", TrainConfig),
                                                    "data": ("data", DataSpec), "run": ("run", RunOptions),
                                                    "sizing": ("sizing", Sizing)})
    tr.add_argument("--cache-dir", type=Path, help="token cache (default ~/.cache/mlx_llm)")
    tr.add_argument("--prompt", default="def ", help="prompt of the closing sample (default %(default)r)")
    tr.add_argument("--sample-tokens", type=int, default=200, help="tokens of the closing sample (default "
                    "%(default)s; 0: no sample)")
    tr.add_argument("--time-budget", type=float, metavar="SECONDS", help="set --steps to what fits SECONDS of "
                    "training loop on this machine (measured first)")
    add_config_flags(tr.add_argument_group("sizing by compute (instead of --steps)"), Sizing, "sizing")
    br = tr.add_argument_group("branching (README, 'Warmup-stable-decay branches')")
    br.add_argument("--branch-from", type=Path, metavar="RUN", help="start a new run (--out) from checkpoint "
                    "--branch-step of RUN (parameters and optimizer state), decaying to --steps; every other "
                    "setting is RUN's")
    br.add_argument("--branch-step", type=int, metavar="S", help="with --branch-from: the checkpoint to branch at "
                    "(in the stable phase of RUN's wsd schedule and of the branch's)")
    add_config_flags(tr, TrainConfig, "train", shown=MAIN_JOB_TRAIN)
    add_config_flags(tr.add_argument_group("data"), DataSpec, "data", shown=DataSpec(vocab_size=MAIN_JOB_VOCAB))
    dist = tr.add_argument_group("several processes (README, 'Several machines')")
    dist.add_argument("--distributed", action="store_true", help="join a multi-process run (jax.distributed): "
                      "settings from the flags below, else from JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / "
                      "JAX_PROCESS_ID, else JAX's cluster detection")
    dist.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address (implies --distributed)")
    dist.add_argument("--num-processes", type=int, help="processes in the run (implies --distributed)")
    dist.add_argument("--process-id", type=int, help="this process's index, 0 … N−1 (implies --distributed)")


def add_post(sub, kind: str) -> None:
    """sft, reward, dpo, rl: the base run, the kind's settings, LoRA, and the train config without what the
    kind cannot honour (``POST_EXCLUDED``)."""
    pp = sub.add_parser(kind, help=POST_HELP[kind])
    pp.add_argument("--base", type=Path, help="the run to start from (pretrained, SFT, DPO, RL, merged or imported)")
    cls = POST_SETTINGS[kind]
    add_run_flags(pp, out_required=True, sections={"train": ("train", TrainConfig), kind: ("settings", cls),
                                                   "lora": ("lora", LoRAConfig), "run": ("run", RunOptions)})
    groups = {}
    if kind != "rl":  # rl takes a task only (an empty exclusive group would break --help)
        source = pp.add_mutually_exclusive_group()
        groups = {"data": source, "task": source}
    add_config_flags(pp, cls, "settings", groups=groups)
    add_config_flags(pp.add_argument_group("LoRA"), LoRAConfig, "lora", prefix="lora_")
    add_config_flags(pp.add_argument_group("training"), TrainConfig, "train", shown=POST_RECIPES[kind],
                     exclude=POST_EXCLUDED[kind])


def trust_flag(parser) -> None:
    """``--trust-unverified`` of a command that reads a run's checkpoint (train/checkpoint.py)."""
    parser.add_argument("--trust-unverified", action="store_true", help="restore a checkpoint that has no checksum "
                        "manifest although the run writes them (deleted? copied without it?) without verifying it")


def add_inspect(sub) -> None:
    """eval, compile, eval-task, chat: commands that read a run (or a config) and train nothing."""
    ev = sub.add_parser("eval", help="val loss, perplexity and bits per byte of a run's latest checkpoint")
    trust_flag(ev)
    ev.add_argument("--run", type=Path, required=True, help="the run directory")
    ev.add_argument("--step", type=int, help="checkpoint step (default: latest)")
    ev.add_argument("--cache-dir", type=Path, help="token cache (default ~/.cache/mlx_llm)")
    ev.add_argument("--lm-eval", metavar="TASK[,TASK]", help="run these lm-evaluation-harness tasks instead (the "
                    "eval extra): print its table, write its JSON to RUN/lm_eval/<step>-<tasks>.json")
    ev.add_argument("--lm-eval-include", type=Path, metavar="DIR", help="a folder of local lm-eval task YAMLs")
    ev.add_argument("--limit", type=int, help="lm-eval: at most this many documents per task")
    ev.add_argument("--num-fewshot", type=int, help="lm-eval: few-shot examples per prompt (default: each task's)")
    add_config_flags(ev, TrainConfig, "train", shown=TrainConfig(), only=KERNEL_FIELDS)
    co = sub.add_parser("compile", help="pre-flight: compile a configuration's train step ahead of time (for the "
                        "local devices or a TPU topology) and print its per-device memory")
    co.add_argument("--config", type=Path, help="model config.json (default: the main job's model)")
    co.add_argument("--train-config", type=Path, help="train_config.json (default: the main job's settings)")
    co.add_argument("--target", default="local", help="local (default) or tpu:<generation>-<N>, e.g. tpu:v5e-4, "
                    "tpu:v5p-16, tpu:v6e-4 (N: chips for v5e/v6e, TensorCores for v4/v5p)")
    co.add_argument("--json", action="store_true", help="print one JSON object")
    add_config_flags(co, TrainConfig, "train", shown=MAIN_JOB_TRAIN, only=COMPILE_FIELDS)
    et = sub.add_parser("eval-task", help="held-out exact match of a run on a built-in task")
    trust_flag(et)
    et.add_argument("--run", type=Path, required=True, help="the run directory")
    et.add_argument("--task", choices=TASKS, required=True, help="a built-in task (mlx_llm.data.tasks)")
    et.add_argument("--eval-examples", "--examples", dest="examples", type=int,
                    help="how many held-out examples (default: all)")
    ch = sub.add_parser("chat", help="a terminal chat with a run, over the chat template")
    trust_flag(ch)
    ch.add_argument("--run", type=Path, required=True, help="the run directory")
    ch.add_argument("--max-new-tokens", type=int, default=128, help="reply length limit (default %(default)s)")
    ch.add_argument("--temperature", type=float, help="sampling temperature (omit for greedy decoding)")
    ch.add_argument("--system", help="a system message")


def add_compare(sub) -> None:
    """compare: two groups of runs on one metric, with intervals and a p-value (eval/compare.py)."""
    cp = sub.add_parser("compare", help="compare two groups of runs (one per seed) on a metric: means, 95 %% "
                        "intervals, and the difference's interval and p-value (Welch's t-test, or paired by seed)")
    cp.add_argument("runs", nargs="+", type=Path, metavar="RUN", help="the first group's run directories")
    cp.add_argument("--against", nargs="+", type=Path, required=True, metavar="RUN",
                    help="the second group's run directories (the difference is first minus second)")
    cp.add_argument("--metric", default="val_bpb", help="the last value of this key in each run's metrics.jsonl (or "
                    "summary.json): val_bpb (default), val_loss, val_bpb/<source>, heldout_accuracy, …")
    cp.add_argument("--paired", action="store_true", help="the paired t-test over runs matched by their seeds "
                    "(--seed, --init-seed, --data-seed; one run per seed in each group; a seed the groups differ in "
                    "as wholes, nothing else differing, is what the comparison varies)")
    cp.add_argument("--allow-unfinished", action="store_true", help="compare runs that are unfinished (training "
                    "now, or stopped short of their steps) at the values they hold now, saying at which step each "
                    "was read")
    cp.add_argument("--json", action="store_true", help="print exactly one JSON object")
    trust_flag(cp)


def add_files(sub) -> None:
    """export-merged, export, import, generate."""
    mg = sub.add_parser("export-merged", help="write a plain run with a LoRA run's adapters folded in (SFT, DPO "
                        "or RL)")
    trust_flag(mg)
    mg.add_argument("--run", type=Path, required=True, help="the LoRA run")
    mg.add_argument("--out", type=Path, required=True, help="a new run directory")
    hx = sub.add_parser("export", help=f"write a run as a Hugging Face transformers checkpoint ({FAMILIES}; "
                        f"safetensors)")
    trust_flag(hx)
    hx.add_argument("--run", type=Path, required=True, help="the run directory")
    hx.add_argument("--to", type=Path, required=True, help="a new directory for from_pretrained")
    hx.add_argument("--step", type=int, help="checkpoint step (default: latest)")
    hi = sub.add_parser("import", help=f"a transformers checkpoint directory ({FAMILIES}; safetensors) as a run")
    hi.add_argument("--from", dest="source", type=Path, required=True, help="the transformers checkpoint directory")
    hi.add_argument("--out", type=Path, required=True, help="a new run directory")
    ge = sub.add_parser("generate", help="continue a prompt with a trained run")
    trust_flag(ge)
    ge.add_argument("--run", type=Path, required=True, help="the run directory")
    ge.add_argument("--prompt", required=True, help="the text to continue")
    ge.add_argument("--max-new-tokens", type=int, default=100, help="tokens to generate (default %(default)s)")
    ge.add_argument("--temperature", type=float, help="sampling temperature (omit for greedy decoding)")
    ge.add_argument("--top-k", type=int, help="sample among the k most likely tokens (autoregressive runs)")
    ge.add_argument("--top-p", type=float, help="nucleus sampling: the smallest set of mass ≥ p (autoregressive)")
    ge.add_argument("--beam", type=int, help="beam width (beam search; excludes sampling settings)")
    ge.add_argument("--diffusion-steps", type=int, help="denoising steps S (diffusion runs; default 64)")
    ge.add_argument("--sampler", choices=("ancestral", "remask"), help="diffusion sampler (diffusion runs; default "
                    "ancestral)")
    ge.add_argument("--seed", type=int, default=0, help="seed of the sampler (>= 0; default %(default)s)")
    ge.add_argument("--step", type=int, help="checkpoint step (default: latest)")
    ge.add_argument("--json", action="store_true", help="print the result and how to reproduce it as JSON")
    add_config_flags(ge, TrainConfig, "train", shown=TrainConfig(), only=KERNEL_FIELDS)


def add_serve(sub) -> None:
    """serve: the OpenAI-compatible server."""
    sv = sub.add_parser("serve", help="serve a run over OpenAI's chat and completions API (the serve extra)")
    trust_flag(sv)
    sv.add_argument("--run", type=Path, required=True, help="the run directory")
    sv.add_argument("--step", type=int, help="checkpoint step (default: latest)")
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s: this machine only)")
    sv.add_argument("--port", type=int, default=8000, help="port (default %(default)s; 0 picks a free one)")
    sv.add_argument("--served-name", help="the model name clients send (default: the run directory's name)")
    sv.add_argument("--api-key", help="require Authorization: Bearer KEY on every endpoint but /health (default: "
                    "$MLX_LLM_API_KEY; none: no key)")
    sv.add_argument("--max-seqs", type=int, default=16, help="replies decoded at once (default %(default)s)")
    sv.add_argument("--max-len", type=int, help="positions per reply, prompt and reply (default: the model's "
                    "max_seq_len)")
    sv.add_argument("--page-size", type=int, default=16, help="positions per KV-cache page (default %(default)s)")
    sv.add_argument("--pages", type=int, help="KV-cache pages in the pool (default: every row at --max-len)")
    sv.add_argument("--token-budget", type=int, default=512, help="tokens computed per engine step (default "
                    "%(default)s)")
    sv.add_argument("--max-queue", type=int, default=256, help="requests waiting or running before new ones get "
                    "429 (default %(default)s)")
    sv.add_argument("--max-top-logprobs", type=int, default=20, help="the most top_logprobs a request may ask for "
                    "(default %(default)s; 0 makes every step cheaper and refuses them)")
    sv.add_argument("--no-warm-up", action="store_true", help="start at once and compile each engine program when a "
                    "request first needs it (default: compile them all before serving)")
    sv.add_argument("--grace", type=float, default=30.0, help="seconds SIGTERM lets requests in flight finish "
                    "before aborting them (default %(default)s)")
    sv.add_argument("--replicas", type=int, help="run N engines, each in its own process, behind Ray Serve "
                    "(default: one engine in this process, no Ray)")
    sv.add_argument("--ray-address", help="with --replicas: the Ray cluster to place them on (auto, or HOST:PORT "
                    "of a `ray start --head` node; default: a local Ray started for this server)")
    sv.add_argument("--replica-cpus", type=float, help="with --replicas: CPUs Ray reserves for each (default 1)")
    sv.add_argument("--replica-gpus", type=float, help="with --replicas: GPUs Ray gives each (default 0)")
    add_config_flags(sv, TrainConfig, "train", shown=TrainConfig(), only=KERNEL_FIELDS)
    add_config_flags(sv, RunOptions, "run", only=["compilation_cache"])


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="mlx-llm", description="Train, evaluate and sample a MiniLLM.")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=Parser)
    add_train(sub)
    for kind in POST_SETTINGS:
        add_post(sub, kind)
    add_inspect(sub)
    add_compare(sub)
    add_files(sub)
    add_serve(sub)
    for parser in sub.choices.values():
        parser.set_defaults(subparser=parser)  # a command names its own flags in its errors (flags.flags_of)
    return ap


def subcommands(ap: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """{name: parser} of ``build_parser``'s subcommands."""
    return next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction)).choices
