"""Supervised fine-tuning on conversations: a pretrained run taught a task, full or LoRA (M20 §16, U19 §9–§10).

``sft_run`` starts from a pretrained run's latest checkpoint and tokenizer and trains on chat data (a JSONL file
of conversations, or a built-in task of ``data/tasks.py``) with the same jitted step, checkpoints, exact resume,
metrics and progress as ``train``: the forward pass is untouched and only the loss mask changes (M20 §16:
assistant content and end-of-turn markers are targets, everything else is context). Conversations are packed
several per window (``pack``): each keeps its own segment id (attention never crosses conversations), its
positions restart at 0, and its mask is its own.

Full fine-tuning trains every parameter from the base's values (new optimizer moments). LoRA (``lora_cfg``)
trains adapters beside the frozen base (lora.py): the run's checkpoints hold the adapters only, and
the run record holds the base run and its checkpoint step, so ``runs.load.load_params`` rebuilds W₀ + (α/r)·A·B
and ``runs.load.merge_run`` writes a plain run with the adapters folded in.

The skill is measured by ``eval.replies.eval_task``: greedy decoding through the chat template on held-out
prompts, scored by the task's exact checker (``tasks.check``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mlx_llm import lora as lora_lib
from mlx_llm.config import LoRAConfig, TrainConfig
from mlx_llm.data import tasks as tasks_lib
from mlx_llm.data import tokenizer as tok_lib
from mlx_llm.data.chat import ChatTemplate, read_conversations
from mlx_llm.data.packing import ValSet, first_until
from mlx_llm.data.templates import template_for
from mlx_llm.data.text import epoch_order, val_score
from mlx_llm.errors import ConfigError, DataError
from mlx_llm.eval.replies import eval_task
from mlx_llm.ops import seed_key
from mlx_llm.post import prologue
from mlx_llm.runs.configs import SFTConfig
from mlx_llm.train.lm import train_loop
from mlx_llm.train.metrics import write_summary
from mlx_llm.train.preflight import check_fits
from mlx_llm.train.step import schedule_config

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
            lora_cfg: LoRAConfig | None = None, template: ChatTemplate = ChatTemplate(), resume=False,
            changes: dict | None = None, from_step: int | None = None, show_progress: bool = True, log=print,
            options=None) -> dict:
    """Fine-tune ``base_run`` on ``settings``' data or task into ``run_dir`` (or resume it: everything is read
    back from the run); returns the summary, with the held-out task accuracy before (base) and after when a task
    is given. Everything is checked before the run directory is created (``prologue.start``)."""
    st = prologue.start(run_dir, "sft", base_run, tcfg=tcfg, settings=settings, lora_cfg=lora_cfg, resume=resume,
                        changes=changes, from_step=from_step, options=options)
    if st.resume is not None:
        template = prologue.run_template(st.resume.run.record)
    base, tcfg, s, lora_cfg = st.base, st.tcfg, st.settings, st.lora_cfg
    cfg, base_params, tok = base.cfg, base.params, base.tok
    if tcfg.objective != "ar":
        raise ConfigError("chat fine-tuning trains next-token predictions: objective must be 'ar'")
    st.template = template = template_for(tok, template)  # an imported model's own chat template, if it has one
    template.check_tokenizer(tok)
    sft_data = load_data(tok, template, tcfg.seq_len, data=s.data, task=s.task, n_train=s.n_train, seed=tcfg.batch_seed)
    trainable = base_params if lora_cfg is None else lora_lib.init(base_params, lora_cfg, seed_key(tcfg.params_seed))
    frozen, model_of = (None, None) if lora_cfg is None else (base_params, lora_lib.model_of(lora_cfg))
    schedule_steps = st.plan.schedule_steps if st.plan else None
    step = check_fits(cfg, schedule_config(tcfg, schedule_steps), trainable=trainable, frozen=frozen,
                      model_of=model_of, mask_id=tok.mask_id)
    with st.writing():  # the run's lock, held to the end of the run
        n_trainable = lora_lib.param_count(trainable) if lora_cfg is not None else cfg.param_count()
        log(f"sft from {base.run} (step {base.step}): {sft_data.train_rows['tokens'].shape[0]:,} packed rows, "
            f"{len(sft_data.val_convs):,} held out; {'LoRA' if lora_cfg else 'full'}: {n_trainable:,} trainable")
        before = (eval_task(base_params, cfg, tok, s.task, template, n=s.eval_examples)
                  if s.task is not None and st.resume is None else None)
        out = train_loop(st.run_dir, cfg, tcfg, sft_data, plan=st.plan, info=st.info(), show_progress=show_progress,
                         log=log, initial_params=trainable, frozen=frozen, model_of=model_of, step=step,
                         options=options)
        summary = {**out["summary"], "trainable_params": n_trainable}
        if s.task is not None:
            after = eval_task(out["params"], cfg, tok, s.task, template, n=s.eval_examples)
            summary["heldout_accuracy"] = after["accuracy"]
            summary["heldout_examples"] = after["n"]
            if before is not None:
                summary["base_heldout_accuracy"] = before["accuracy"]
        write_summary(st.run_dir, summary)
    return summary
