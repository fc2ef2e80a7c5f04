"""Supervised fine-tuning on conversations: a pretrained run taught a task, full or LoRA (M20 §16, U19 §9–§10).

``sft_run`` starts from a pretrained run's latest checkpoint and tokenizer and trains on chat data (a JSONL file
of conversations, or a built-in task of ``post/tasks.py``) with the same jitted step, checkpoints, exact resume,
metrics and progress as ``train``: the forward pass is untouched and only the loss mask changes (M20 §16:
assistant content and end-of-turn markers are targets, everything else is context). Conversations are packed
several per window (``pack``): each keeps its own segment id (attention never crosses conversations), its
positions restart at 0, and its mask is its own.

Full fine-tuning trains every parameter from the base's values (new optimizer moments). LoRA (``lora_cfg``)
trains adapters beside the frozen base (post/lora.py): the run's checkpoints hold the adapters only, and
the run record holds the base run and its checkpoint step, so ``runs.load.load_params`` rebuilds W₀ + (α/r)·A·B
and ``runs.load.merge_run`` writes a plain run with the adapters folded in.

``eval_task`` measures the skill: greedy decoding through the chat template on held-out prompts, scored by the
task's exact checker (``tasks.check``); ``chat_session`` is the ``chat`` command's conversation with a run.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import jax
import numpy as np

from mlx_llm.config import ModelConfig, TrainConfig
from mlx_llm.errors import ConfigError, DataError, InputError
from mlx_llm.post import lora as lora_lib
from mlx_llm.post import tasks as tasks_lib
from mlx_llm.post.chat import ChatTemplate, read_conversations
from mlx_llm.post.templates import template_for
from mlx_llm.train import tokenizer as tok_lib
from mlx_llm.decode.generate import generate
from mlx_llm.post import loop
from mlx_llm.post.loop import run_template
from mlx_llm.runs.configs import SFTConfig
from mlx_llm.runs.resume import record_resume
from mlx_llm.train.checkpoint import locked_run_dir
from mlx_llm.train.preflight import check_fits
from mlx_llm.train.run import train_loop
from mlx_llm.train.data import ValSet, epoch_order, first_until, val_score
from mlx_llm.train.metrics import write_summary

REPLY_TOKENS = {"arithmetic": 8, "addition2": 8, "name_function": 40}  # new tokens eval_task allows per reply
VAL_PERCENT = 5.0  # share of a data file's conversations held out (by a stable hash of their text)


# ----- data ---------------------------------------------------------------------------------------------------
def pack(convs, seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    """Conversations (ids, target) packed greedily, in order, into rows of ``seq_len`` next-token positions:
    tokens/targets/mask/segment_ids/positions (N, seq_len). Segment ids count conversations from 1 within a row
    (0 = padding, mask 0), positions restart at 0 per conversation. A conversation never spans two rows."""
    rows, row = [], []
    for ids, target in convs:
        n = len(ids) - 1
        if n > seq_len:
            raise DataError(f"a conversation of {len(ids)} tokens does not fit seq_len + 1 = {seq_len + 1}")
        if sum(len(c[0]) - 1 for c in row) + n > seq_len:
            rows.append(row)
            row = []
        row.append((ids, target))
    if row:
        rows.append(row)
    out = {"tokens": np.full((len(rows), seq_len), pad_id, np.int32),
           "targets": np.full((len(rows), seq_len), pad_id, np.int32),
           "mask": np.zeros((len(rows), seq_len), np.float32),
           "segment_ids": np.zeros((len(rows), seq_len), np.int32),
           "positions": np.zeros((len(rows), seq_len), np.int32)}
    for r, members in enumerate(rows):
        col = 0
        for k, (ids, target) in enumerate(members, start=1):
            n = len(ids) - 1
            out["tokens"][r, col:col + n] = ids[:-1]
            out["targets"][r, col:col + n] = ids[1:]
            out["mask"][r, col:col + n] = target[1:]
            out["segment_ids"][r, col:col + n] = k
            out["positions"][r, col:col + n] = np.arange(n)
            col += n
    return out


@dataclasses.dataclass
class SFTData:
    """Packed train rows and held-out conversations, with the ``train_batch`` / ``val_batches`` / ``tokenizer``
    interface of the training loop. Batch ``step`` is a function of (seed, step): an epoch's row order is a
    permutation drawn from (seed, epoch)."""

    train_rows: dict[str, np.ndarray]
    val_convs: list
    tokenizer: tok_lib.Tokenizer
    heldout: list  # task examples (dicts) held out, for eval_task; [] for a data file

    def train_batch(self, step: int, *, batch_size: int, seq_len: int, seed: int,
                    rows: slice = slice(None)) -> dict[str, np.ndarray]:
        idx = epoch_order(step, batch_size, self.train_rows["tokens"].shape[0], seed)[rows]
        return {name: a[idx] for name, a in self.train_rows.items()}

    def val_batches(self, seq_len: int, batch_size: int, max_tokens: int | None = None) -> ValSet:
        """The held-out conversations packed in order; ``max_tokens`` (``--eval-tokens``): only the first ones
        whose response tokens reach that many (at least one conversation)."""
        convs = self.val_convs if max_tokens is None else first_until(
            self.val_convs, lambda c: int(np.sum(c[1][1:])), max_tokens)
        rows = pack(convs, seq_len, self.tokenizer.pad_id)
        n = -(-rows["tokens"].shape[0] // batch_size) * batch_size
        rows = {k: np.concatenate([a, np.zeros((n - a.shape[0],) + a.shape[1:], a.dtype)]) for k, a in rows.items()}
        byte_len = self.tokenizer.token_byte_lengths()
        batches = [{k: a[i:i + batch_size] for k, a in rows.items()} for i in range(0, n, batch_size)]
        per_batch = [int((byte_len[b["targets"]] * b["mask"]).sum()) for b in batches]
        return ValSet(batches, int(rows["mask"].sum()), sum(per_batch), per_batch)


def load_data(tok, template: ChatTemplate, seq_len: int, *, data=None, task=None, n_train=None, seed=0) -> SFTData:
    """Conversations of a JSONL file (``VAL_PERCENT`` held out by a stable hash of their text) or of a task's
    train/heldout splits, encoded and checked to fit ``seq_len`` + 1 ids, the train ones shuffled by ``seed``
    and packed. ``template`` gives way to the tokenizer's own chat template when it has one (``template_for``)."""
    template = template_for(tok, template)
    if (data is None) == (task is None):
        raise ConfigError("give exactly one of a data file (--data FILE.jsonl) and a task (--task NAME: "
                          f"{list(tasks_lib.TASKS)})")
    if task is not None:
        train_ex = tasks_lib.examples(task, "train", n=n_train, seed=seed)
        heldout = tasks_lib.examples(task, "heldout")
        train = [template.encode(e["messages"], tok) for e in train_ex]
        val = [template.encode(e["messages"], tok) for e in heldout]
        too_long = sum(len(ids) > seq_len + 1 for ids, _ in train + val)
        if too_long:
            raise DataError(f"{too_long} {task} conversation(s) are longer than seq_len + 1 = {seq_len + 1} tokens; "
                            f"nothing is truncated: raise --seq-len")
    else:
        convs = read_conversations(data, tok, template, seq_len + 1)
        heldout = []
        texts = [tok.decode(ids) for ids, _ in convs]
        val = [c for c, t in zip(convs, texts) if val_score(t) < VAL_PERCENT]
        train = [c for c, t in zip(convs, texts) if val_score(t) >= VAL_PERCENT]
        if not train or not val:
            raise DataError(f"{data}: {len(convs)} conversation(s) leave {len(train)} to train on and {len(val)} held "
                            f"out ({VAL_PERCENT:g} % by a hash of the text): give more conversations")
    order = np.random.default_rng(seed).permutation(len(train))
    return SFTData(pack([train[i] for i in order], seq_len, tok.pad_id), val, tok, heldout)


# ----- runs ---------------------------------------------------------------------------------------------------
def sft_run(run_dir, base_run=None, *, tcfg: TrainConfig | None = None, settings: SFTConfig | None = None,
            lora_cfg: lora_lib.LoRAConfig | None = None, template: ChatTemplate = ChatTemplate(),
            resume: bool = False, changes: dict | None = None, from_step: int | None = None,
            show_progress: bool = True, log=print, options=None) -> dict:
    """Fine-tune ``base_run`` on ``settings``' data or task into ``run_dir`` (or resume it: everything is read
    back from the run); returns the summary, with the held-out task accuracy before (base) and after when a task
    is given. Everything is checked before the run directory is created."""
    run_dir = Path(run_dir)
    run, resumed, plan = loop.resume_of(run_dir, resume, changes, from_step)
    if run is not None:
        tcfg, settings, lora_cfg = resumed, run.record.settings, run.record.lora
        base_run, template = run.record.base.run, run_template(run.record)
    base = loop.load_base(base_run)
    if run is not None:
        loop.check_base_unchanged(run, base)
    cfg, base_params, tok, s = base.cfg, base.params, base.tok, settings
    if tcfg.objective != "ar":
        raise ConfigError("chat fine-tuning trains next-token predictions: objective must be 'ar'")
    if tcfg.seq_len > cfg.max_seq_len:
        raise ConfigError(f"seq_len = {tcfg.seq_len} is longer than the base model's max_seq_len = {cfg.max_seq_len}")
    template = template_for(tok, template)  # an imported model's own chat template, when its tokenizer has one
    template.check_tokenizer(tok)
    sft_data = load_data(tok, template, tcfg.seq_len, data=s.data, task=s.task, n_train=s.n_train, seed=tcfg.seed)
    adapters = None if lora_cfg is None else lora_lib.init(base_params, lora_cfg, jax.random.key(tcfg.seed))
    check_fits(cfg, tcfg, lora_cfg=lora_cfg, mask_id=tok.mask_id)
    with locked_run_dir(run_dir, resume):  # held to the end of the run
        loop.start_run(run_dir, base, tcfg, dataclasses.replace(
            loop.post_record("sft", base, lora_cfg, settings), template=template.to_dict()), plan)
        trainable = adapters if lora_cfg is not None else base_params
        n_trainable = lora_lib.param_count(adapters) if lora_cfg is not None else cfg.param_count()
        log(f"sft from {base.run} (step {base.step}): {sft_data.train_rows['tokens'].shape[0]:,} packed rows, "
            f"{len(sft_data.val_convs):,} held out; {'LoRA' if lora_cfg else 'full'}: {n_trainable:,} trainable")
        before = (eval_task(base_params, cfg, tok, s.task, template, n=s.eval_examples)
                  if s.task is not None and not resume else None)
        out = train_loop(run_dir, cfg, tcfg, sft_data, resume=resume, show_progress=show_progress, log=log,
                         initial_params=trainable, frozen=base_params if lora_cfg is not None else None,
                         lora_cfg=lora_cfg, from_step=plan.step if plan and plan.from_step else None,
                         schedule_steps=plan and plan.schedule_steps,
                         on_restored=(lambda: record_resume(run_dir, tcfg, plan)) if plan else None,
                         options=options)
        summary = {**out["summary"], "trainable_params": n_trainable}
        if s.task is not None:
            after = eval_task(out["params"], cfg, tok, s.task, template, n=s.eval_examples)
            summary["heldout_accuracy"] = after["accuracy"]
            summary["heldout_examples"] = after["n"]
            if before is not None:
                summary["base_heldout_accuracy"] = before["accuracy"]
        write_summary(run_dir, summary)
    return summary


# ----- the skill -----------------------------------------------------------------------------------------------
def sample_replies(params, cfg: ModelConfig, tok, template: ChatTemplate, prompts, max_new_tokens: int, *,
                   temperature: float | None = None, seed: int = 0, batch_size: int = 64) -> list:
    """The model's reply to each conversation of ``prompts`` (rendered with the assistant marker), decoded until
    the end-of-turn marker or ``max_new_tokens``: greedy (``temperature`` None) or sampled from p^(1/T) with
    the jitted decoder. Returns [(reply ids, end marker included when produced), text (marker dropped)].
    The tokenizer's own chat template, when it has one, renders the prompts (``template_for``)."""
    template = template_for(tok, template)
    end_id = tok.token_id(template.end)
    encoded = [template.encode(m, tok, generation_prompt=True)[0] for m in prompts]
    longest = max(len(p) for p in encoded)
    if longest + max_new_tokens > cfg.max_seq_len:
        raise ConfigError(f"prompts of up to {longest} tokens + {max_new_tokens} new tokens exceed the model's "
                          f"max_seq_len = {cfg.max_seq_len}")
    out_replies = []
    for i in range(0, len(encoded), batch_size):
        chunk = encoded[i:i + batch_size]
        chunk = chunk + [chunk[0]] * (batch_size - len(chunk))  # one compiled shape
        lengths = np.array([len(p) for p in chunk], np.int32)
        padded = np.full((batch_size, longest), tok.pad_id, np.int32)
        for r, p in enumerate(chunk):
            padded[r, :len(p)] = p
        out = generate(params, cfg, padded, max_new_tokens, temperature=temperature, eos_id=end_id,
                       pad_id=tok.pad_id, prompt_lengths=lengths, seed=seed + i)
        toks, lens = np.asarray(out.tokens), np.asarray(out.lengths)
        for r in range(min(batch_size, len(encoded) - i)):
            reply = toks[r, :lens[r]]
            text = reply[:-1] if lens[r] and reply[-1] == end_id else reply
            out_replies.append((reply, tok.decode(text, skip_special=True)))
    return out_replies


def eval_task(params, cfg: ModelConfig, tok, task: str, template: ChatTemplate = ChatTemplate(), *,
              n: int | None = None, batch_size: int = 64, max_new_tokens: int | None = None) -> dict:
    """Held-out exact match: each held-out prompt (``tasks.prompt_messages``) rendered with the assistant marker,
    greedy decoding until the end-of-turn marker (at most ``max_new_tokens``, default ``REPLY_TOKENS[task]``:
    room for any correct answer and its end marker in bytes), the reply scored by ``tasks.check``. Returns
    {"accuracy", "n", "correct", "examples": [(prompt, reply, expected), …]}."""
    max_new_tokens = REPLY_TOKENS[task] if max_new_tokens is None else max_new_tokens
    examples = tasks_lib.examples(task, "heldout", n=n)
    start = time.perf_counter()
    replies = [text for _, text in sample_replies(params, cfg, tok, template,
                                                  [tasks_lib.prompt_messages(e) for e in examples], max_new_tokens,
                                                  batch_size=batch_size)]
    correct = [tasks_lib.check(task, r, e["answer"]) for r, e in zip(replies, examples)]
    return {"accuracy": float(np.mean(correct)), "n": len(examples), "correct": int(sum(correct)),
            "seconds": time.perf_counter() - start,
            "examples": [(e["messages"][-2]["content"], r, e["answer"]) for e, r in zip(examples, replies)]}


def chat_session(params, cfg: ModelConfig, tok, template, *, system: str | None = None, max_new_tokens: int = 128,
                 temperature: float | None = None, read=input, write=print) -> int:
    """The ``chat`` command's loop: each line read is the user's turn, the model's reply (decoded until the
    template's end-of-turn marker) is written and kept in the conversation; an empty line or end of input ends
    it (returns 0). A turn that cannot be sent — its prompt would leave no room in the model's context
    (``cfg.max_seq_len``), or the template refuses it — is reported and dropped; the session goes on."""
    template = template_for(tok, template)
    end_id = tok.token_id(template.end)
    messages = [{"role": "system", "content": system}] if system else []
    while True:
        try:
            line = read("you> ").strip()
        except EOFError:
            return 0
        if not line:
            return 0
        turn = messages + [{"role": "user", "content": line}]
        try:
            ids, _ = template.encode(turn, tok, generation_prompt=True)
        except InputError as err:
            write(f"(not sent: {err})")
            continue
        n_new = min(max_new_tokens, cfg.max_seq_len - len(ids))
        if n_new < 1:
            write(f"(not sent: with this message the prompt is {len(ids)} tokens and the model reads at most "
                  f"{cfg.max_seq_len}, leaving no room for a reply; send a shorter message, or an empty line to end)")
            continue
        out = generate(params, cfg, ids[None], n_new, temperature=temperature, eos_id=end_id, pad_id=tok.pad_id)
        text = tok.decode(np.asarray(out.tokens[0])[: int(out.lengths[0])], skip_special=True)
        write("model> " + text)
        messages = turn + [{"role": "assistant", "content": text if text.strip() else "…"}]
