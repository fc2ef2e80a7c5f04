"""An lm-evaluation-harness model class for a run: ``MLXLM``, registered with ``lm_eval`` as ``mlx_llm``.

``lm_eval`` is an optional extra (``pip install 'mlx_llm[eval]'``); this module is the one place mlx_llm imports
it, and importing this module without it raises ``ConfigError`` naming the install command.

How to run it:

- ``mlx-llm eval --run DIR --lm-eval TASK[,TASK] [--lm-eval-include DIR] [--limit N] [--num-fewshot K]`` prints
  the harness's table and writes its results JSON to ``DIR/lm_eval/<step>-<tasks>.json`` (``evaluate_run``,
  ``write_results``); an unknown task name is refused before anything is loaded or written.
- ``python -m mlx_llm.eval.harness --model mlx_llm --model_args run=DIR[,step=N,batch_size=B] --tasks T …``:
  lm_eval 0.4.13 finds models only in its own registry (its ``lm_eval.models`` table; it loads no entry points
  of other packages), so a bare ``lm_eval --model mlx_llm`` cannot see this class. This module registers it and
  then runs lm_eval's own command line with the remaining arguments; in Python, importing this module is enough
  (``lm_eval.simple_evaluate(model="mlx_llm", model_args={"run": DIR}, …)`` or ``model=MLXLM(DIR)``). Under
  lm_eval's command line the rows per call are its ``--batch_size`` (default 1; ``--batch_size 8`` is ours).

What it computes, and how:

- ``loglikelihood``: log p(continuation | context) = Σ log p over the continuation's tokens, and whether each of
  them is the argmax (``is_greedy``). The scored sequence is BOS (when the tokenizer has one) + context +
  continuation; an empty context is scored from BOS alone (EOS for a tokenizer without BOS, the harness's
  convention). Trailing whitespace of the context moves to the continuation, and the continuation's ids are the
  whole text's ids after the context's (the harness's word-boundary rule, ``TemplateLM._encode_pair``).
- Requests are packed: each call's requests fill rows of one static width (the power of two ≥ 16 that holds the
  longest, capped at ``max_seq_len``) first-fit, longest first, each request its own segment (``segment_ids``:
  attention and a Mamba state never cross it) with positions from 0, so every request is scored at its exact
  positions as if alone; ``batch_size`` rows go through one jitted forward (``objectives.loss.token_nll`` per
  target, summed over the continuation on the host); one compile per width.
- ``TRUNCATION``: a request longer than the model's context keeps its last ``max_seq_len`` + 1 tokens
  (``max_seq_len`` inputs predicting ``max_seq_len`` tokens): the context loses its oldest tokens, BOS first. A
  continuation longer than ``max_seq_len`` cannot be scored and is refused (``InputError``, one line).
- ``loglikelihood_rolling``: the harness's rolling windows (``get_rolling_token_windows`` with context 1, made
  disjoint): the first window predicts the first ``max_seq_len`` tokens after BOS/EOS, each later window the
  next ``max_seq_len`` given the token before them, the last one the remaining tokens given a full window; every
  token is scored exactly once and the windows are scored like loglikelihood requests.
- ``generate_until``: the inference engine (``decode.engine.complete``: every request in one run, each with its
  own settings, request k seeded with ``sampling.prompt_seed(seed, k)``; greedy unless the request's
  ``temperature`` > 0 or ``do_sample``; ``top_k`` / ``top_p`` when sampling), stopped at EOS or the first
  ``until`` string and cut before it;
  ``max_gen_toks`` (default 256) is capped at ``max_seq_len`` − 1 and the prompt keeps its last
  ``max_seq_len`` − ``max_gen_toks`` tokens. Any other generation setting is refused, not ignored.

A diffusion run (objective "diffusion") has neither next-token log-likelihoods nor left-to-right decoding, and a
reward run is not a language model: both are refused in one line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from mlx_llm.errors import ConfigError, InputError

try:
    import lm_eval
    import lm_eval.models  # noqa: F401  (the harness's own models, registered before ours: lm_eval imports its
    # table only while the registry is empty)
    from lm_eval import utils as lm_utils
    from lm_eval.api.model import LM
    from lm_eval.api.registry import model_registry
except ImportError:
    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError("lm_eval is not installed: pip install 'mlx_llm[eval]'") from None
    raise

from mlx_llm.decode.engine import Request, complete
from mlx_llm.decode.sampling import prompt_seed
from mlx_llm.model import forward, resolved
from mlx_llm.ops import token_nll
from mlx_llm.runs.load import as_run, checkpoint_step, load_params
from mlx_llm.settings import check_int, write_text_atomic
from mlx_llm.config import INT32_MAX
from mlx_llm.data import tokenizer as tok_lib

NAME = "mlx_llm"  # lm_eval --model mlx_llm
MIN_WIDTH = 16  # the narrowest static width of a scoring batch
DEFAULT_BATCH = 8  # rows per scoring / generation call
DEFAULT_GEN_TOKS = 256  # the harness's default max_gen_toks
GEN_KEYS = ("until", "max_gen_toks", "temperature", "do_sample", "top_k", "top_p")
RESULTS_DIR = "lm_eval"  # RUN/lm_eval/<step>-<tasks>.json
BOOTSTRAP_ITERS = 1000  # resamples of the harness's bootstrapped stderrs (its default is 100,000)
TRUNCATION = ("a request keeps its last max_seq_len + 1 tokens (the context loses its oldest tokens, BOS first); a "
              "continuation longer than max_seq_len is refused")

# Registered by its import path: a lazy entry that lm_eval resolves on first use, the same entry however often
# this module is imported (also as ``python -m``), so registering twice is never a collision.
model_registry.register(NAME, target="mlx_llm.eval.harness:MLXLM")


# ----- requests → token sequences ------------------------------------------------------------------------------
def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) of a loglikelihood request: BOS (if the tokenizer has one) + the context,
    or BOS alone for an empty context (EOS without BOS); trailing whitespace of the context belongs to the
    continuation, whose ids are those of context + continuation after the context's (the harness's rule)."""
    prefix = [int(i) for i in tok.bos_prefix]
    n_space = len(context) - len(context.rstrip())
    if n_space:
        context, continuation = context[:-n_space], context[-n_space:] + continuation
    ctx = tok.encode(context).tolist() if context else []
    cont = tok.encode(context + continuation).tolist()[len(ctx):]
    return (prefix + ctx) or [int(tok.eos_id)], cont


def fit(ctx: list[int], cont: list[int], max_len: int) -> list[int]:
    """The scored sequence: context + continuation cut to its last ``max_len`` + 1 tokens (``TRUNCATION``)."""
    if len(cont) > max_len:
        raise InputError(f"a continuation of {len(cont)} tokens is longer than max_seq_len = {max_len}: it cannot "
                         f"be scored (a continuation must fit the model's context)")
    return (ctx + cont)[-(max_len + 1):]


def rolling_windows(tokens: list[int], prefix_id: int, max_len: int) -> list[tuple[list[int], int]]:
    """(sequence, continuation length) of each disjoint rolling window of ``tokens`` (the module docstring)."""
    windows = lm_utils.get_rolling_token_windows(token_list=list(tokens), prefix_token=prefix_id,
                                                 max_seq_len=max_len, context_len=1)
    return [(ctx + cont, len(cont)) for ctx, cont in map(lm_utils.make_disjoint_window, windows)]


def bucket_width(n: int, max_len: int) -> int:
    """The static width of a batch whose longest input has ``n`` tokens: a power of two ≥ 16, at most max_len."""
    return min(max_len, max(MIN_WIDTH, 1 << (max(n, 1) - 1).bit_length()))


# ----- scoring -----------------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("cfg", "kernels"))
def _token_scores(params, ids_BT, targets_BT, segment_ids_BT, positions_BT, *, cfg, kernels):
    """log p of each target and whether it is the argmax, (B, T) each, for rows packed with several requests
    (attention and the SSM state never cross a segment; positions restart at each)."""
    logits_BTV = forward(params, ids_BT, cfg, positions_BT=positions_BT, segment_ids_BT=segment_ids_BT,
                         kernels=kernels)
    return -token_nll(logits_BTV, targets_BT), jnp.argmax(logits_BTV, axis=-1) == targets_BT


def pack(lengths: list[int], width: int) -> list[list[int]]:
    """Rows of request indices whose input lengths (sequence − 1) fill ``width`` positions: first fit over the
    requests longest first (every length ≤ width)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        k = next((r for r, free in enumerate(room) if free >= lengths[i]), None)
        if k is None:
            rows.append([]), room.append(width)
            k = len(rows) - 1
        rows[k].append(i)
        room[k] -= lengths[i]
    return rows


def score(params, cfg, seqs: list[tuple[list[int], int]], *, batch_size: int = DEFAULT_BATCH, pad_id: int = 0,
          kernels=None) -> list[tuple[float, bool]]:
    """(log p(last n tokens | the ones before), is_greedy) of each (sequence, n) (a sequence fits: ≤ max_seq_len
    + 1 tokens, n ≥ 1): requests packed into rows of ``bucket_width`` of the longest (each its own segment from
    position 0), ``batch_size`` rows a call (the last call filled with empty rows), Σ log p over each request's
    last n targets (float32 log-probs, summed in float64)."""
    kernels = resolved(kernels)
    if not seqs:
        return []
    width = bucket_width(max(len(q) for q, _ in seqs) - 1, cfg.max_seq_len)
    rows = pack([len(q) - 1 for q, _ in seqs], width)
    out: list = [None] * len(seqs)
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        arrays = [np.full((batch_size, width), v, np.int32) for v in (pad_id, pad_id, -1, 0)]
        ids, targets, segments, positions = arrays
        spans = []
        for r, members in enumerate(chunk):
            at = 0
            for j, i in enumerate(members):
                seq, n = seqs[i]
                t = len(seq) - 1
                ids[r, at:at + t], targets[r, at:at + t] = seq[:-1], seq[1:]
                segments[r, at:at + t], positions[r, at:at + t] = j, np.arange(t)
                spans.append((i, r, at + t - n, at + t))
                at += t
            segments[r, at:] = len(members)  # the row's padding: a segment of its own, never scored
        lp, hit = (np.asarray(a) for a in _token_scores(params, ids, targets, segments, positions, cfg=cfg,
                                                         kernels=kernels))
        for i, r, lo, hi in spans:  # the per-token log-probs summed in float64: a long continuation loses nothing
            out[i] = (float(lp[r, lo:hi].astype(np.float64).sum()), bool(hit[r, lo:hi].all()))
    return out


# ----- generation settings -----------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GenSettings:
    """A generate_until request's settings (temperature None: greedy)."""

    until: tuple[str, ...]
    max_new_tokens: int
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None


def gen_settings(kwargs: dict | None, max_len: int) -> GenSettings:
    """The harness's ``gen_kwargs`` read into ``GenSettings``; a setting this class cannot honour is refused."""
    kwargs = dict(kwargs or {})
    unknown = sorted(set(kwargs) - set(GEN_KEYS))
    if unknown:
        raise ConfigError(f"generation setting(s) {unknown} are not supported by the mlx_llm model class: it "
                          f"honours {list(GEN_KEYS)}")
    until = kwargs.get("until") or ()
    until = (until,) if isinstance(until, str) else tuple(until)
    n_new = kwargs.get("max_gen_toks", DEFAULT_GEN_TOKS)
    if isinstance(n_new, bool) or not isinstance(n_new, int) or n_new < 1:
        raise ConfigError(f"max_gen_toks = {n_new!r} is invalid: it must be an integer ≥ 1")
    temperature = float(kwargs.get("temperature") or 0.0)
    sample = kwargs.get("do_sample")
    sample = temperature > 0 if sample is None else bool(sample)
    if not sample:
        return GenSettings(until, min(n_new, max_len - 1))
    return GenSettings(until, min(n_new, max_len - 1), temperature if temperature > 0 else 1.0,
                       kwargs.get("top_k"), kwargs.get("top_p"))


def cut_at_stop(text: str, until) -> str:
    """``text`` up to the first occurrence of any stop string."""
    hits = [i for i in (text.find(s) for s in until if s) if i >= 0]
    return text[:min(hits)] if hits else text


def _batch_size(value) -> int:
    """lm_eval's ``batch_size`` (None, "auto", "auto:N" or a count) as rows per call."""
    if value is None or (isinstance(value, str) and value.startswith("auto")):
        return DEFAULT_BATCH
    try:
        size = int(value)
    except (TypeError, ValueError):
        size = 0
    if size < 1:
        raise ConfigError(f"batch_size = {value!r} is invalid: it must be an integer ≥ 1 (or auto)")
    return size


# ----- the model class ---------------------------------------------------------------------------------------------
class MLXLM(LM):
    """A run's checkpoint as an lm_eval ``LM`` (the module docstring says what each request type computes).

    ``run``: the run directory (or an opened ``Run``); ``step``: its checkpoint (default the latest);
    ``batch_size``: rows per call (default 8; "auto" is the default); ``seed``: the sampler's seed when a request
    samples; ``kernels``: the execution paths (default the reference ones). ``device`` and ``max_batch_size``,
    which lm_eval passes to every model, are accepted and unused: the run goes to JAX's default backend.
    """

    def __init__(self, run, step=None, batch_size=None, max_batch_size=None, device=None, seed=0, kernels=None):
        super().__init__()
        run = as_run(run)
        run.require_language_model("lm-eval")
        if run.tcfg.objective == "diffusion":
            raise ConfigError(f"{run.path} is a diffusion run (objective 'diffusion'): it has no next-token "
                              f"log-likelihood nor left-to-right decoding for lm-eval; `mlx-llm eval` reports its "
                              f"NELBO bound")
        self.run, self.step = run, checkpoint_step(run, None if step is None else int(step))
        self.cfg, self.tok = run.cfg, tok_lib.load(run.path)
        self.params = load_params(run, self.step)
        self.batch_size, self.seed, self.kernels = _batch_size(batch_size), int(seed), resolved(kernels)
        self.max_length = self.cfg.max_seq_len
        self.prefix_id = int(self.tok.bos_id if self.tok.bos_id is not None else self.tok.eos_id)

    def get_model_info(self) -> dict:
        """What lm_eval records under ``config`` beside its own settings."""
        return {"run": str(self.run.path), "checkpoint_step": self.step, "max_seq_len": self.max_length,
                "rows_per_call": self.batch_size, "truncation": TRUNCATION}

    def _score(self, seqs):
        return score(self.params, self.cfg, seqs, batch_size=self.batch_size, pad_id=self.tok.pad_id,
                     kernels=self.kernels)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(log p(continuation | context), is_greedy) per (context, continuation) request."""
        pairs = [encode_pair(self.tok, *req.args) for req in requests]
        seqs = [fit(ctx, cont, self.max_length) for ctx, cont in pairs]
        todo = [k for k, (_, cont) in enumerate(pairs) if cont]  # an empty continuation: log 1, greedy
        scored = dict(zip(todo, self._score([(seqs[k], len(pairs[k][1])) for k in todo])))
        out = [scored.get(k, (0.0, True)) for k in range(len(requests))]
        for req, res in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood", req.args, res)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """log p(text) per (text,) request, every token scored once in the rolling windows (module docstring)."""
        windows, owner = [], []
        for k, req in enumerate(requests):
            for window in rolling_windows(self.tok.encode(req.args[0]).tolist(), self.prefix_id, self.max_length):
                windows.append(window)
                owner.append(k)
        totals = [0.0] * len(requests)
        for k, (ll, _) in zip(owner, self._score(windows)):
            totals[k] += ll
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """The continuation of each (context, gen_kwargs) request: every request through one engine run
        (``_generate``), each with its own settings."""
        settings = [gen_settings(req.args[1], self.max_length) for req in requests]
        out = self._generate(settings, [req.args[0] for req in requests])
        for req, text in zip(requests, out):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return out

    def _prompt(self, context: str, keep: int) -> list[int]:
        ids = [int(i) for i in self.tok.bos_prefix] + (self.tok.encode(context).tolist() if context else [])
        return (ids or [self.prefix_id])[-keep:]

    def _generate(self, settings: list, contexts: list[str]) -> list[str]:
        """Greedy or sampled continuations of ``contexts`` (request k with ``settings[k]``) through the engine
        (``decode.engine.complete``, ``batch_size`` replies at once): request k is seeded with
        ``sampling.prompt_seed(seed, k)``, stops at EOS, its ``max_new_tokens`` or a stop string, and its text is
        cut before the first stop string."""
        detokenize = lambda ids: self.tok.decode(np.asarray(ids, np.int32), skip_special=True)
        eos = () if self.tok.eos_id is None else (int(self.tok.eos_id),)
        requests = [Request(tuple(self._prompt(c, self.max_length - s.max_new_tokens)), max_tokens=s.max_new_tokens,
                            temperature=s.temperature or 0.0, top_k=s.top_k or 0,
                            top_p=1.0 if s.top_p is None else s.top_p, stop_ids=eos,
                            stop=tuple(u for u in s.until if u), seed=prompt_seed(self.seed, k))
                    for k, (s, c) in enumerate(zip(settings, contexts))]
        done = complete(self.params, self.cfg, requests, max_seqs=self.batch_size, detokenize=detokenize,
                        kernels=self.kernels)
        return [cut_at_stop(detokenize(d.replies[0].tokens), s.until) for d, s in zip(done, settings)]


# ----- evaluating a run: tasks, the harness, the results file ------------------------------------------------------
def task_names(tasks) -> list[str]:
    """``"a,b"`` or ``["a", "b"]`` as a list of names; none is refused."""
    names = [t.strip() for t in (tasks.split(",") if isinstance(tasks, str) else tasks) if t.strip()]
    if not names:
        raise ConfigError(f"--lm-eval {tasks!r} names no task: give TASK[,TASK] (list them with `lm-eval ls tasks`)")
    return names


def task_manager(names: list[str], include=None):
    """A ``TaskManager`` that knows every name, or ``ConfigError`` listing the unknown ones (before any work).

    With ``include`` (a folder of task YAMLs) the folder alone is indexed first; the harness's own index (about
    15,000 names, ~10 s) is built only when a name is not a task of that folder (a group or tag may name
    built-in tasks)."""
    from lm_eval.tasks import TaskManager

    if include is not None:
        if not Path(include).is_dir():
            raise ConfigError(f"--lm-eval-include {str(include)!r} is not a directory of task YAMLs")
        local = TaskManager(include_path=str(include), include_defaults=False)
        if all(n in local.all_subtasks for n in names):
            return local
    manager = TaskManager(include_path=None if include is None else str(include))
    unknown = [n for n in names if n not in manager.all_tasks and not Path(n).is_file()]
    if unknown:
        where = "" if include is None else f" (nor in {include})"
        raise ConfigError(f"unknown lm-eval task(s) {', '.join(unknown)}{where}: list the tasks with `lm-eval ls "
                          f"tasks`, or give a folder of task YAMLs with --lm-eval-include DIR")
    return manager


@contextlib.contextmanager
def _in_process_bootstrap():
    """lm_eval bootstraps stderrs in a multiprocessing pool unless DISABLE_MULTIPROC is set; forking a process
    that runs XLA is unsafe, so the resamples run here."""
    old = os.environ.get("DISABLE_MULTIPROC")
    os.environ["DISABLE_MULTIPROC"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("DISABLE_MULTIPROC", None)
        else:
            os.environ["DISABLE_MULTIPROC"] = old


def evaluate_run(run, tasks, *, include=None, limit=None, num_fewshot=None, step=None, batch_size=None,
                 kernels=None, log_samples: bool = False) -> tuple[MLXLM, dict]:
    """The harness's ``simple_evaluate`` of a run's checkpoint on ``tasks``: (the model, lm_eval's results dict).
    The task names, ``limit`` (≥ 1 documents per task) and ``num_fewshot`` (≥ 0) are checked before the
    checkpoint is loaded."""
    check_int("--limit", limit, 1, optional=True, maximum=INT32_MAX)
    check_int("--num-fewshot", num_fewshot, 0, optional=True, maximum=INT32_MAX)
    names = task_names(tasks)
    manager = task_manager(names, include)
    lm = MLXLM(run, step=step, batch_size=batch_size, kernels=kernels)
    with _in_process_bootstrap():
        results = lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=manager, limit=limit,
                                          num_fewshot=num_fewshot, log_samples=log_samples,
                                          bootstrap_iters=BOOTSTRAP_ITERS)
    return lm, results


def results_path(run_dir, step: int, names: list[str]) -> Path:
    """``RUN/lm_eval/<step>-<task+task…>.json`` (characters other than letters, digits, ``._+-`` become ``_``)."""
    return Path(run_dir) / RESULTS_DIR / f"{step}-{re.sub(r'[^A-Za-z0-9._+-]+', '_', '+'.join(names))}.json"


def write_results(path: Path, results: dict) -> Path:
    """The results JSON, written atomically (an earlier file of the same step and tasks is replaced)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(results, indent=2, default=lm_utils.handle_non_serializable) + "\n")
    return path


def table(results: dict) -> str:
    """lm_eval's own table(s): the tasks, and the groups when there are any."""
    out = lm_utils.make_table(results)
    return out + "\n" + lm_utils.make_table(results, "groups") if results.get("groups") else out


def main(argv=None) -> None:
    """``python -m mlx_llm.eval.harness <lm_eval arguments>``: lm_eval's command line, this model registered."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    with _in_process_bootstrap():
        cli_evaluate()


if __name__ == "__main__":
    main()
