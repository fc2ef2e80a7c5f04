"""What each ``mlx-llm`` subcommand does with its flags.

The library is imported inside each command, not at the top of this module: ``mlx-llm --help`` (and a bad flag)
then answers without importing jax (docs/architecture.md). That is the one place mlx_llm imports inside
functions on purpose.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from mlx_llm.cli.flags import flags_of, with_given
from mlx_llm.cli.parser import POST_RECIPES, POST_SETTINGS
from mlx_llm.config import ModelConfig, TrainConfig
from mlx_llm.errors import MLXLLMError
from mlx_llm.recipes import MAIN_JOB_MODEL, MAIN_JOB_TRAIN, MAIN_JOB_VOCAB
from mlx_llm.runs.configs import DataSpec, RunOptions, Sizing
from mlx_llm.config import LoRAConfig
from mlx_llm.data.mixture import data_flag


# ----- resuming: one rule for every training command --------------------------------------------------------
def resume_of(args, given: dict, kind: str, parser, trust_unverified: bool | None = None):
    """On ``--resume``: the run, opened once, accepted by the one rule (``runs.resume.open_resume``): every given
    setting must equal the run's (flags named), except the train fields of ``RESUME_MAY_CHANGE``, which are
    applied. Returns the ``Resume`` the run function continues. ``trust_unverified``: ``open_resume``'s."""
    from mlx_llm.runs.resume import RESUME_MAY_CHANGE, open_resume

    if args.out is None:
        raise MLXLLMError("--resume needs --out DIR, the run directory to continue")
    asked = {section: dict(fields) for section, fields in given.items()}
    for flag, section, path in (("config", "model", getattr(args, "config", None)),
                                ("train_config", "train", getattr(args, "train_config", None))):
        if path is not None:  # a config file on resume: every field of it is compared
            cls = ModelConfig if section == "model" else TrainConfig
            asked[section] = {**cls.from_json(path).to_dict(), **asked.get(section, {})}
    changes = {k: v for k, v in given.get("train", {}).items() if k in RESUME_MAY_CHANGE}
    resume = open_resume(args.out, kind=kind, given={k: v for k, v in asked.items() if k not in ("run", "sizing")},
                         changes=changes, from_step=args.from_step, trust_unverified=trust_unverified,
                         flags=flags_of(parser))
    base = getattr(args, "base", None)
    if base is not None and str(Path(base).resolve()) != resume.run.record.base.run:
        raise MLXLLMError(f"--resume continues a run exactly as it was configured: --base {base} is not the run's "
                          f"base ({resume.run.record.base.run})")
    return resume


def lora_config(given: dict) -> LoRAConfig | None:
    """LoRA is on when --lora-rank is given; --lora-alpha / --lora-targets without it would mean nothing."""
    fields = given.get("lora", {})
    if fields and "rank" not in fields:
        raise MLXLLMError(f"{', '.join('--lora-' + k for k in sorted(fields))} set(s) LoRA adapters: give "
                          f"--lora-rank R too (without it every weight is trained)")
    return LoRAConfig(**fields) if fields else None


# ----- how a training command runs and ends -------------------------------------------------------------------
def training_command(command):
    """A training command (train, sft, reward, dpo, rl) runs with jax's persistent compilation cache
    (``RunOptions.compilation_cache``) and ends in one line, never a traceback: stopped by SIGTERM / SIGINT at a
    step boundary (``loop.TrainingStopped``: its checkpoint, the resume command) exits 0; a checkpoint that could
    not be written (``errors.CheckpointWriteError``: a full disk) exits 1; SIGTERM outside the training loop
    reads as Ctrl-C (``mlx_llm.cli.main``: interrupted, status 130)."""

    @functools.wraps(command)
    def run(args, given: dict, parser) -> int:
        import jax

        from mlx_llm.train.loop import TrainingStopped

        options = RunOptions(**given.get("run", {}))
        try:
            with compilation_cache(cache_directory(options, getattr(args, "cache_dir", None))):
                return command(args, given, parser)
        except TrainingStopped as stop:
            if jax.process_index() == 0:
                print(f"mlx-llm {args.command}: {stop}", file=sys.stderr)
            return 0

    return run


def _interrupt(signum, frame):
    raise KeyboardInterrupt


@contextlib.contextmanager
def sigterm_interrupts():
    """SIGTERM raises KeyboardInterrupt (one line and status 130, not a silent exit 143) wherever the training
    loop's own handler (``loop.StopSignals``) is not installed: in every command, for its whole run. Installed
    from the main thread only; the previous handler is restored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


CACHE_ENV = "MLX_LLM_COMPILATION_CACHE"  # the compilation cache of every command not given --compilation-cache


def cache_directory(options: RunOptions, cache_dir=None) -> str | None:
    """The command's compilation cache: ``--compilation-cache``, else ``$MLX_LLM_COMPILATION_CACHE`` (one cache
    for every run of a machine, a CI job or a test session; 'off' disables it), else jax/ under ``--cache-dir``,
    else ``~/.cache/mlx_llm/jax`` (``RunOptions.compilation_cache_dir``)."""
    shared = os.environ.get(CACHE_ENV, "").strip()
    if options.compilation_cache is None and shared:
        return None if shared == "off" else str(Path(shared).expanduser().resolve())
    return options.compilation_cache_dir(cache_dir)


COMPILATION_CACHE_SETTINGS = {"jax_persistent_cache_min_compile_time_secs": 0.0,  # small CPU programs too
                              "jax_persistent_cache_min_entry_size_bytes": -1}


@contextlib.contextmanager
def compilation_cache(directory: str | None):
    """jax's persistent compilation cache in ``directory`` (None: off) for one command, every program cached
    however fast it compiled; jax's settings are restored afterwards. The CLI sets it, the library never does
    (DESIGN §3); jax decides whether to use a cache at a process's first compile, so a command run in a process
    that has compiled before (a test) runs uncached."""
    if directory is None:
        yield
        return
    import jax
    from jax.experimental.compilation_cache import compilation_cache as cc

    settings = {"jax_compilation_cache_dir": directory, **COMPILATION_CACHE_SETTINGS}
    before = {name: getattr(jax.config, name) for name in settings}
    for name, value in settings.items():
        jax.config.update(name, value)
    try:
        yield
    finally:
        for name, value in before.items():
            jax.config.update(name, value)
        cc.reset_cache()


# ----- train / eval / compile / generate ----------------------------------------------------------------------
@training_command
def cmd_train(args, given: dict, parser) -> int:
    from mlx_llm.train.parallel import init_distributed, is_main_process
    from mlx_llm.runs.pretrain import train_run

    if args.distributed or any(v is not None for v in (args.coordinator, args.num_processes, args.process_id)):
        init_distributed(args.coordinator, args.num_processes, args.process_id)
        if args.out is None:
            raise MLXLLMError("a multi-process run needs --out DIR (the same shared directory in every process)")
    cfg = tcfg = spec = branch = resume = None
    if "path" in given.get("data", {}):  # --data PATH, or a mixture: NAME=PATH[:WEIGHT] ... / a mixture .json
        given["data"] = {**given["data"], **data_flag(given["data"].pop("path"))}
    check_token_flags(given.get("data", {}))
    sizing = Sizing(**given.pop("sizing", {}))
    options = RunOptions(**given.pop("run", {}))
    sized = {"--time-budget": args.time_budget is not None, "--target-flops": sizing.target_flops is not None,
             "--tokens-per-param": sizing.tokens_per_param is not None}
    asked = [flag for flag, on in sized.items() if on] + (["--steps"] if "steps" in given.get("train", {}) else [])
    if len(asked) > 1:
        raise MLXLLMError(f"{' and '.join(asked)} each set the steps of a run: give one of them")
    if args.resume or args.branch_from is not None:
        if any(sized.values()):
            raise MLXLLMError(f"{asked[0]} sizes a new run; a resumed or branched run keeps its settings "
                              f"(give --steps)")
    if args.branch_from is not None:
        branch = branch_of(args, given, parser)
    elif args.branch_step is not None:
        raise MLXLLMError("--branch-step S needs --branch-from RUN: the run to branch off")
    elif args.resume:
        resume = resume_of(args, given, "pretrain", parser, options.trust_unverified)
    else:
        cfg = with_given(ModelConfig.from_json(args.config) if args.config else MAIN_JOB_MODEL, given.get("model", {}))
        tcfg = with_given(TrainConfig.from_json(args.train_config) if args.train_config else MAIN_JOB_TRAIN,
                          given.get("train", {}))
        spec = with_given(DataSpec(vocab_size=MAIN_JOB_VOCAB), given.get("data", {}))
    out = args.out or Path("runs") / time.strftime("run-%Y%m%d-%H%M%S")
    summary = train_run(out, cfg, tcfg, spec, resume=resume or False, show_progress=not args.no_progress,
                        cache_dir=args.cache_dir, sample_prompt=args.prompt, sample_tokens=args.sample_tokens,
                        time_budget=args.time_budget, from_step=None if resume else args.from_step,
                        options=options, sizing=sizing if sizing.active else None, branch=branch)
    if not is_main_process():  # a multi-process run: process 0 reports
        return 0
    print(f"run: {out}")
    bound = " (diffusion NELBO: upper bounds)" if _is_diffusion(out) else ""
    bpb = ("" if summary.get("val_bpb") is None else f", bits/byte {summary['val_bpb']:.4f}{bound} (unigram "
           f"baseline {summary['unigram_val_bpb']:.4f})")
    print(f"val loss {summary['val_loss']:.4f} nats/token, perplexity {summary['val_ppl']:.2f}{bpb}; "
          f"wall {summary['wall_seconds']:.0f} s")
    for key in (k for k in summary if k.startswith("val_loss/")):
        name = key.partition("/")[2]
        extra = f", bits/byte {summary[f'val_bpb/{name}']:.4f}" if f"val_bpb/{name}" in summary else ""
        print(f"  source {name}: val loss {summary[key]:.4f}{extra}")
    if summary["sample"] is not None:
        print("sample:\n" + summary["sample"])
    return 0


def check_token_flags(data: dict) -> None:
    """--tokenizer bpe / byte train or pick a tokenizer for text; on token-id shards they would be ignored."""
    from mlx_llm.data.mixture import parse_sources
    from mlx_llm.data.tokens import is_token_source

    paths = [data.get("path")] + [s.path for s in parse_sources(data.get("mixture", ()))]
    if data.get("tokenizer") in ("bpe", "byte") and any(is_token_source(p) for p in paths if p):
        raise MLXLLMError(f"--tokenizer {data['tokenizer']} encodes text; token-id shards (.bin/.npy) are read as "
                          f"they are: give --tokenizer PATH (the tokenizer the ids were made with), or none")


def branch_of(args, given: dict, parser):
    """``--branch-from RUN --branch-step S --steps N``: a new run that takes every setting from RUN but the steps
    (and where arrays live: ``RESUME_MAY_CHANGE``); anything else given is refused as on --resume."""
    from mlx_llm.runs.record import open_run
    from mlx_llm.runs.resume import check_unchanged
    from mlx_llm.runs.branch import Branch

    if args.resume or args.from_step is not None:
        raise MLXLLMError("--branch-from starts a new run: it takes no --resume / --from-step (resume a branch "
                          "like any run, with --resume --out BRANCH)")
    if args.out is None or args.branch_step is None or "steps" not in given.get("train", {}):
        raise MLXLLMError("--branch-from RUN needs --out NEW, --branch-step S and --steps N")
    if args.config is not None or args.train_config is not None:
        raise MLXLLMError("--branch-from takes every setting from RUN: drop --config / --train-config")
    run = open_run(args.branch_from)
    check_unchanged(run, {k: v for k, v in given.items() if k != "sizing"}, flags_of(parser))
    return Branch(run=run.path, step=args.branch_step, changes=given.get("train", {}))


def _is_diffusion(run_dir) -> bool:
    from mlx_llm.runs.record import open_run

    try:
        return open_run(run_dir).tcfg.objective == "diffusion"
    except MLXLLMError:
        return False


def trust_of(args):
    """``--trust-unverified`` of a command that reads a run (train/checkpoint.py imported only then)."""
    if not getattr(args, "trust_unverified", False):
        return contextlib.nullcontext()
    from mlx_llm.train.checkpoint import trusting_unverified

    return trusting_unverified()


def kernels_of(given: dict):
    """The execution paths of ``--attention-impl`` / ``--moe-impl`` / ``--loss-chunk`` (default auto), resolved
    for this backend (a kernel it cannot run is refused here, before any work)."""
    from mlx_llm.kernels import Kernels

    return Kernels(**{"attention_impl": "auto", "moe_impl": "auto", "loss_chunk": "auto",
                      **given.get("train", {})}).resolve()


def cmd_eval_harness(args, given: dict) -> int:
    """``eval --lm-eval TASKS``: the harness on the run's checkpoint (eval/harness.py); prints lm_eval's table and
    writes its results JSON into the run (``RUN/lm_eval/<step>-<tasks>.json``). Unknown tasks are refused first."""
    from mlx_llm.eval import harness

    lm, results = harness.evaluate_run(args.run, args.lm_eval, include=args.lm_eval_include, limit=args.limit,
                                       num_fewshot=args.num_fewshot, step=args.step, kernels=kernels_of(given))
    path = harness.write_results(harness.results_path(args.run, lm.step, harness.task_names(args.lm_eval)), results)
    print(harness.table(results))
    print(f"{args.run} step {lm.step}: lm-eval results written to {path}")
    return 0


def cmd_eval(args, given: dict, parser) -> int:
    from mlx_llm.eval.val import evaluate_run

    if args.lm_eval is not None:
        return cmd_eval_harness(args, given)
    harness_only = [f for f, v in (("--lm-eval-include", args.lm_eval_include), ("--limit", args.limit),
                                   ("--num-fewshot", args.num_fewshot)) if v is not None]
    if harness_only:
        raise MLXLLMError(f"{', '.join(harness_only)} set(s) the lm-eval harness: give --lm-eval TASK[,TASK] too")
    step, res = evaluate_run(args.run, cache_dir=args.cache_dir, step=args.step, kernels=kernels_of(given))
    bound = " (diffusion NELBO: upper bounds)" if _is_diffusion(args.run) else ""
    bpb = "" if res.bits_per_byte is None else f", bits/byte {res.bits_per_byte:.4f}{bound}"
    print(f"{args.run} step {step}: val loss {res.loss:.4f} nats/token, perplexity {res.perplexity:.3f}{bpb} "
          f"({res.n_targets:,} tokens, {res.n_bytes:,} bytes)")
    for name, r in (res.per_source or {}).items():
        extra = "" if r.bits_per_byte is None else f", bits/byte {r.bits_per_byte:.4f}"
        print(f"  source {name}: val loss {r.loss:.4f}{extra} ({r.n_targets:,} tokens)")
    return 0


def cmd_compile(args, given: dict, parser) -> int:
    """The pre-flight check: exit 0 when the step fits the target, 1 (one line: by how much, what helps) when not."""
    from mlx_llm.train.preflight import advice, compile_step, format_report

    cfg = ModelConfig.from_json(args.config) if args.config else MAIN_JOB_MODEL
    tcfg = with_given(TrainConfig.from_json(args.train_config) if args.train_config else MAIN_JOB_TRAIN,
                      given.get("train", {}))
    out = compile_step(cfg, tcfg, args.target)
    print(json.dumps(out, indent=2) if args.json else format_report(out))
    if not out["fits"]:
        print(f"mlx-llm compile: {advice(out)}", file=sys.stderr)
        return 1
    return 0


def cmd_generate(args, given: dict, parser) -> int:
    from mlx_llm.runs.sample import generate_from_run

    record = generate_from_run(args.run, args.prompt, max_new_tokens=args.max_new_tokens,
                               temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                               beam_width=args.beam, seed=args.seed, step=args.step,
                               diffusion_steps=args.diffusion_steps, sampler=args.sampler,
                               kernels=kernels_of(given))
    print(json.dumps(record, indent=2) if args.json else args.prompt + record["continuation"])
    return 0


def cmd_serve(args, given: dict, parser) -> int:
    """The OpenAI-compatible server (serve/app.py) until SIGTERM or Ctrl-C."""
    import importlib.util

    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client") if importlib.util.find_spec(m) is None]
    if missing:
        raise MLXLLMError(f"serve needs the serve extra (pip install -e '.[serve]'): {', '.join(missing)} not "
                          "installed")
    from mlx_llm.serve.app import open_model, serve

    for flag, value, low in (("--max-seqs", args.max_seqs, 1), ("--page-size", args.page_size, 1),
                             ("--token-budget", args.token_budget, 1), ("--max-queue", args.max_queue, 1),
                             ("--max-top-logprobs", args.max_top_logprobs, 0), ("--port", args.port, 0)):
        if value < low or (flag == "--port" and value > 65535):
            raise MLXLLMError(f"{flag} = {value} is invalid: it must be an integer ≥ {low}"
                              + (" and ≤ 65535" if flag == "--port" else ""))
    if not args.grace >= 0:
        raise MLXLLMError(f"--grace = {args.grace} is invalid: it must be a number of seconds ≥ 0")
    key = args.api_key if args.api_key is not None else os.environ.get("MLX_LLM_API_KEY") or None
    cache = cache_directory(RunOptions(**given.get("run", {})))  # the engine's programs, as training's
    ray_flags = {"--ray-address": args.ray_address, "--replica-cpus": args.replica_cpus,
                 "--replica-gpus": args.replica_gpus}
    if args.replicas is None:
        given_ray = [flag for flag, value in ray_flags.items() if value is not None]
        if given_ray:
            raise MLXLLMError(f"{given_ray[0]} only applies with --replicas N (engines behind Ray Serve)")
    else:
        cpus = 1.0 if args.replica_cpus is None else args.replica_cpus
        gpus = 0.0 if args.replica_gpus is None else args.replica_gpus
        if args.replicas < 1:
            raise MLXLLMError(f"--replicas = {args.replicas} is invalid: it must be an integer ≥ 1")
        if not cpus > 0 or not gpus >= 0:
            flag, value, rule = ("--replica-cpus", cpus, "> 0") if not cpus > 0 else ("--replica-gpus", gpus, "≥ 0")
            raise MLXLLMError(f"{flag} = {value:g} is invalid: it must be a number {rule}")
        if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.serve") is None:
            raise MLXLLMError("--replicas needs Ray Serve (the serve extra: pip install -e '.[serve]')")
        from mlx_llm.serve.app import servable
        from mlx_llm.serve.replicas import serve_replicas

        options = dict(step=args.step, name=args.served_name, max_seqs=args.max_seqs, max_len=args.max_len,
                       page_size=args.page_size, pages=args.pages, token_budget=args.token_budget,
                       max_top_logprobs=args.max_top_logprobs, warm_up=not args.no_warm_up)
        servable(args.run, args.step)  # the run, then the kernels, refused here before Ray starts
        kernels_of(given)  # (each replica resolves them again for its own backend)
        options["kernels"] = given.get("train", {})
        return serve_replicas(args.run, replicas=args.replicas, model_options=options, host=args.host,
                              port=args.port, api_key=key, max_queue=args.max_queue, grace=args.grace,
                              ray_address=args.ray_address, replica_cpus=cpus, replica_gpus=gpus,
                              jax_config={} if cache is None else {"jax_compilation_cache_dir": cache,
                                                                     **COMPILATION_CACHE_SETTINGS})
    with compilation_cache(cache):
        model = open_model(args.run, step=args.step, name=args.served_name, max_seqs=args.max_seqs,
                           max_len=args.max_len, page_size=args.page_size, pages=args.pages,
                           token_budget=args.token_budget, max_top_logprobs=args.max_top_logprobs,
                           warm_up=not args.no_warm_up, kernels=kernels_of(given))
        return serve(model, host=args.host, port=args.port, api_key=key, max_queue=args.max_queue,
                     grace=args.grace)


# ----- fine-tuning and preference runs ------------------------------------------------------------------------
@training_command
def cmd_post(args, given: dict, parser) -> int:
    """sft / reward / dpo / rl: a new run from --base, or --resume of one (settings checked by the one rule)."""
    from mlx_llm.post import dpo, reward, rl, sft

    kind = args.command
    run_fn = {"sft": sft.sft_run, "reward": reward.reward_run, "dpo": dpo.dpo_run, "rl": rl.rl_run}[kind]
    options = RunOptions(**given.get("run", {}))
    common = dict(show_progress=not args.no_progress, options=options)
    if args.resume:
        summary = run_fn(args.out, resume=resume_of(args, given, kind, parser), **common)
    else:
        settings = given.get("settings", {})
        if args.base is None or (kind != "rl" and not {"data", "task"} & settings.keys()) or (
                kind == "rl" and "task" not in settings):
            need = "--task NAME" if kind == "rl" else "one of --data FILE.jsonl / --task NAME"
            raise MLXLLMError(f"{kind} needs --base RUN and {need}")
        tcfg = with_given(POST_RECIPES[kind], given.get("train", {}))
        summary = run_fn(args.out, args.base, tcfg=tcfg, settings=POST_SETTINGS[kind](**settings),
                         lora_cfg=lora_config(given), from_step=args.from_step, **common)
    print(post_report(kind, args.out, summary))
    _print_heldout(summary)
    return 0


def post_report(kind: str, out, summary: dict) -> str:
    if kind == "sft":
        return (f"run: {out}; trainable parameters {summary['trainable_params']:,}; val loss (response tokens) "
                f"{summary['val_loss']:.4f}")
    if kind == "reward":
        return (f"run: {out}; held-out preference accuracy {summary['val_accuracy']:.1%} (Bradley–Terry loss "
                f"{summary['val_loss']:.4f})")
    if kind == "dpo":
        return (f"run: {out}; held-out pairs: preference accuracy {summary['val_accuracy']:.1%}, implicit reward "
                f"margin {summary['val_margin']:.4f}, loss {summary['val_loss']:.4f}")
    if summary.get("reward") is None:  # a resumed run that had nothing left to train
        return f"run: {out}; finished at step {summary['steps']}"
    return (f"run: {out}; last step: reward {summary['reward']:.3f}, KL to the reference {summary['kl']:.4f}, "
            f"reply length {summary['response_length']:.1f}")


def _print_heldout(summary: dict) -> None:
    """The held-out task accuracy of a fine-tuning run's summary, and its base's when measured."""
    if "heldout_accuracy" in summary:
        before = summary.get("base_heldout_accuracy")
        of = f" of {summary['heldout_examples']}" if "heldout_examples" in summary else ""
        print(f"held-out exact match {summary['heldout_accuracy']:.1%}{of}"
              + ("" if before is None else f" (base: {before:.1%})"))


# ----- reading and writing runs -------------------------------------------------------------------------------
def cmd_eval_task(args, given: dict, parser) -> int:
    from mlx_llm.post.prologue import run_template
    from mlx_llm.eval.replies import eval_task
    from mlx_llm.runs.load import load_params
    from mlx_llm.runs.record import open_run
    from mlx_llm.data import tokenizer as tok_lib

    run = open_run(args.run)
    res = eval_task(load_params(run), run.cfg, tok_lib.load(run.path), args.task, run_template(run.record),
                    n=args.examples)
    print(f"{args.run} on {args.task}: held-out exact match {res['accuracy']:.1%} ({res['correct']} of {res['n']})")
    return 0


def cmd_chat(args, given: dict, parser) -> int:
    from mlx_llm.post.prologue import run_template
    from mlx_llm.eval.replies import chat_session
    from mlx_llm.data.templates import template_for
    from mlx_llm.runs.load import load_params
    from mlx_llm.runs.record import open_run
    from mlx_llm.data import tokenizer as tok_lib

    run = open_run(args.run)
    run.require_language_model("chat")
    tok, params = tok_lib.load(run.path), load_params(run)
    template = template_for(tok, run_template(run.record))  # an imported model's own chat template, if it has one
    print("chat with", args.run, "(an empty line or Ctrl-D ends)")
    return chat_session(params, run.cfg, tok, template, system=args.system, max_new_tokens=args.max_new_tokens,
                        temperature=args.temperature)


def cmd_compare(args, given: dict, parser) -> int:
    """Two groups of runs on one metric: a short table, or exactly one JSON object (``--json``)."""
    from mlx_llm.eval.compare import as_json, compare, table

    result = compare(args.runs, args.against, args.metric, paired=args.paired,
                     allow_unfinished=args.allow_unfinished)
    print(as_json(result) if args.json else table(result))
    return 0


def cmd_export_merged(args, given: dict, parser) -> int:
    from mlx_llm.runs.load import merge_run

    print(f"wrote {merge_run(args.run, args.out)}")
    return 0


def cmd_export(args, given: dict, parser) -> int:
    from mlx_llm.interop.hf import export_run

    out = export_run(args.run, args.to, step=args.step, log=print)
    print(f"wrote {out}: load it with transformers' AutoModelForCausalLM.from_pretrained and AutoTokenizer")
    return 0


def cmd_import(args, given: dict, parser) -> int:
    from mlx_llm.interop.hf import import_hf

    print(f"wrote {import_hf(args.source, args.out)}: a run (mlx-llm generate / eval / sft --base take it)")
    return 0


COMMANDS = {"train": cmd_train, "eval": cmd_eval, "compile": cmd_compile, "generate": cmd_generate,
            "sft": cmd_post, "reward": cmd_post, "dpo": cmd_post, "rl": cmd_post, "eval-task": cmd_eval_task,
            "chat": cmd_chat, "compare": cmd_compare, "export-merged": cmd_export_merged, "export": cmd_export,
            "import": cmd_import, "serve": cmd_serve}
TRAINING = frozenset({"train", "sft", "reward", "dpo", "rl"})  # Ctrl-C keeps their last checkpoint
