"""Preference pairs and the response log-probabilities the preference objectives share (U19 §11–§13, M20 §16).

A pair is ``{"prompt": messages, "chosen": message, "rejected": message}`` (one JSON object per line of a
``.jsonl`` file): a conversation ending before the assistant's turn, and two assistant replies to it, the
first preferred. Each reply is rendered with the chat template after the prompt, so a pair becomes two
sequences of ids whose response flags mark the reply's content and its end-of-turn marker (the SFT mask).

Sequences travel as ``{"ids": (B, W), "target": (B, W), "length": (B,)}``, right-padded to W ids. Padding never
changes a real position (causal attention reads only the past), so ragged batches need no attention mask.

Pairs from a built-in task (``task_pairs``): chosen is the correct answer; rejected is a plausible corruption
of it (arithmetic: one digit moved by ±1; name_function: the neighbouring name in the sorted list of names),
or, with ``policy``, one of the model's own wrong samples (temperature 1).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from mlx_llm.config import ModelConfig
from mlx_llm.errors import ConfigError, DataError, InputError
from mlx_llm.model import check_tokens, hidden_states, nll_from_hidden, resolved
from mlx_llm.data import tasks as tasks_lib
from mlx_llm.data.chat import ChatTemplate, check_messages, jsonl_records
from mlx_llm.eval.replies import REPLY_TOKENS, sample_replies
from mlx_llm.data.templates import template_for
from mlx_llm.data.text import epoch_order, val_score
from mlx_llm.data.packing import first_until

VAL_PERCENT = 5.0  # share of a pair file held out, by a stable hash of the pair's text
SIDES = ("chosen", "rejected")


# ----- records ------------------------------------------------------------------------------------------------
def check_pair(record) -> None:
    """A pair record: a prompt conversation that ends with the user's turn (roles in ``check_messages``' order),
    and two different assistant messages. Raises InputError naming the problem."""
    if not isinstance(record, dict) or set(record) != {"prompt", "chosen", "rejected"}:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise InputError(f"expected an object with exactly 'prompt', 'chosen' and 'rejected', got {keys}")
    check_messages(record["prompt"], require_assistant=False, order=False)
    if record["prompt"][-1]["role"] == "assistant":
        raise InputError("the prompt ends with an assistant turn: it must end where the reply starts")
    check_messages(record["prompt"], require_assistant=False)
    for side in SIDES:
        m = record[side]
        if not isinstance(m, dict) or m.get("role") != "assistant":
            raise InputError(f"{side} must be one message with role 'assistant', got {m!r:.80}")
        check_messages([m], order=False)
    if record["chosen"]["content"] == record["rejected"]["content"]:
        raise InputError("chosen and rejected are the same reply: the pair prefers nothing")


def encode_reply(prompt, reply: dict, tok, template: ChatTemplate):
    """(ids, target) of the prompt followed by ``reply``; target marks the reply's content and end marker."""
    return template.encode(list(prompt) + [reply], tok)


def encode_pair(record, tok, template: ChatTemplate):
    return tuple(encode_reply(record["prompt"], record[side], tok, template) for side in SIDES)


def read_pairs(path) -> list[dict]:
    """Every pair of a JSONL file, checked (``check_pair``); errors name the file and line."""
    path, out = Path(path), []
    for n, record in jsonl_records(path):
        try:
            check_pair(record)
        except InputError as err:
            raise DataError(f"{path}:{n}: {err}") from None
        out.append(record)
    if not out:
        raise DataError(f"{path}: no preference pairs")
    return out


def split_pairs(pairs: list[dict]) -> tuple[list[dict], list[dict]]:
    """(train, held out): ``VAL_PERCENT`` of the pairs by a stable hash of their text."""
    held = [val_score(json.dumps(p, sort_keys=True)) < VAL_PERCENT for p in pairs]
    return [p for p, h in zip(pairs, held) if not h], [p for p, h in zip(pairs, held) if h]


# ----- pairs from a task --------------------------------------------------------------------------------------
def corrupt_integer(answer: str, rng: np.random.Generator) -> str:
    """The answer with one digit moved by ±1: a different integer in canonical form (no leading zero)."""
    sign, digits = ("-", answer[1:]) if answer.startswith("-") else ("", answer)
    while True:
        i = int(rng.integers(len(digits)))
        new = int(digits[i]) + int(rng.choice((-1, 1)))
        if 0 <= new <= 9 and not (i == 0 and new == 0 and len(digits) > 1):
            out = sign + digits[:i] + str(new) + digits[i + 1:]
            return "0" if out == "-0" else out


def corruption(task: str, answer: str, rng: np.random.Generator, names: list[str] | None = None) -> str:
    """A plausible wrong answer: a digit off by one (arithmetic), the neighbouring name (name_function)."""
    if task == "name_function":
        k = names.index(answer)
        neighbours = [names[j] for j in (k - 1, k + 1) if 0 <= j < len(names)]
        return neighbours[int(rng.integers(len(neighbours)))]
    return corrupt_integer(answer, rng)


def _pair(example: dict, rejected: str) -> dict:
    return {"prompt": tasks_lib.prompt_messages(example), "chosen": {"role": "assistant", "content": example["answer"]},
            "rejected": {"role": "assistant", "content": rejected}}


def task_pairs(task: str, split: str, *, n: int | None = None, seed: int = 0, policy=None,
               max_new_tokens: int | None = None) -> list[dict]:
    """One pair per example of ``tasks.examples(task, split, n=n, seed=seed)``: the correct answer against a
    corruption. With ``policy = (params, cfg, tok, template)`` the model also answers each prompt twice, greedily
    (its current answer) and at temperature 1, and every distinct wrong, non-empty reply adds a pair (chosen: the
    correct answer; rejected: it)."""
    examples = tasks_lib.examples(task, split, n=n, seed=seed)
    rng = np.random.default_rng([seed, 7])
    names = sorted({e["answer"] for e in examples}) if task == "name_function" else None
    pairs = [_pair(e, corruption(task, e["answer"], rng, names)) for e in examples]
    if policy is not None:
        params, cfg, tok, template = policy
        prompts = [tasks_lib.prompt_messages(e) for e in examples]
        n_new = max_new_tokens or REPLY_TOKENS[task]
        replies = [sample_replies(params, cfg, tok, template, prompts, n_new, temperature=t, seed=seed)
                   for t in (None, 1.0)]
        for e, greedy, sampled in zip(examples, *replies):
            wrong = {text.strip() for _, text in (greedy, sampled)
                     if text.strip() and not tasks_lib.check(task, text, e["answer"])}
            pairs += [_pair(e, text) for text in sorted(wrong)]
    return pairs


# ----- sequences ----------------------------------------------------------------------------------------------
def pad_sequences(seqs, width: int, pad_id: int) -> dict[str, np.ndarray]:
    """(ids, target) sequences right-padded to ``width``: ids (B, W) int32, target (B, W) float32, length (B,)."""
    out = {"ids": np.full((len(seqs), width), pad_id, np.int32), "target": np.zeros((len(seqs), width), np.float32),
           "length": np.zeros(len(seqs), np.int32)}
    for b, (ids, target) in enumerate(seqs):
        if len(ids) > width:
            raise DataError(f"a sequence of {len(ids)} tokens is longer than {width} (seq_len); nothing is "
                            f"truncated: raise --seq-len")
        out["ids"][b, :len(ids)] = ids
        out["target"][b, :len(ids)] = target
        out["length"][b] = len(ids)
    return out


def batch_width(longest: int, limit: int, multiple: int = 16) -> int:
    """The padded width of a run's batches: its longest sequence rounded up to ``multiple`` (one compiled shape,
    little padding), at most ``limit`` (seq_len)."""
    return min(limit, -(-longest // multiple) * multiple)


def concat_sequences(a: dict, b: dict) -> dict:
    return jax.tree.map(lambda x, y: jnp.concatenate([x, y]), a, b)


def response_logprobs(params, cfg: ModelConfig, seqs, kernels=None, *, remat: str = "none",
                      return_aux: bool = False):
    """ℓ(y | c) = Σ_{t ∈ reply} log p(x_t | x_<t) per sequence, (B,): the **sum** over the reply's tokens (M20 §16:
    a length-normalised mean would be a different objective); prompt and padding count nothing. ``kernels``: the
    execution paths (default the reference ones), the loss chunked as ``kernels.loss_chunk`` says; ``remat``:
    model.run_stack; with ``return_aux``, also the forward's MoE expert loads (the offsets' control rule)."""
    kernels = resolved(kernels)
    ids = jnp.asarray(seqs["ids"])
    check_tokens(ids[:, :-1], cfg, "ids")
    h_BTD, load = hidden_states(params, ids[:, :-1], cfg, kernels=kernels, remat=remat, return_aux=True)
    nll_BT = nll_from_hidden(h_BTD, ids[:, 1:], params, cfg, kernels.loss_chunk)
    lp_B = -jnp.sum(jnp.asarray(seqs["target"][:, 1:]).astype(nll_BT.dtype) * nll_BT, axis=-1)
    return (lp_B, load) if return_aux else lp_B


@dataclasses.dataclass
class PairData:
    """Encoded train and held-out pairs; ``train_batch(step)`` is a function of (seed, step): each epoch's order
    is a permutation drawn from (seed, epoch)."""

    train: list  # [(chosen (ids, target), rejected (ids, target))]
    val: list
    width: int
    pad_id: int

    @classmethod
    def build(cls, train_pairs, val_pairs, tok, template: ChatTemplate, width: int) -> "PairData":
        template = template_for(tok, template)
        if not train_pairs or not val_pairs:
            raise DataError(f"{len(train_pairs)} train and {len(val_pairs)} held-out pairs: both must be non-empty")
        enc = [[encode_pair(p, tok, template) for p in ps] for ps in (train_pairs, val_pairs)]
        longest = max(len(s[0]) for ps in enc for pair in ps for s in pair)
        if longest > width:
            raise DataError(f"pairs of up to {longest} tokens do not fit seq_len = {width}; nothing is truncated: "
                            f"raise --seq-len")
        return cls(enc[0], enc[1], batch_width(longest, width), tok.pad_id)

    def _batch(self, pairs) -> dict:
        return {side: pad_sequences([p[k] for p in pairs], self.width, self.pad_id) for k, side in enumerate(SIDES)}

    def train_batch(self, step: int, batch_size: int, seed: int) -> dict:
        return self._batch([self.train[i] for i in epoch_order(step, batch_size, len(self.train), seed)])

    def val_batches(self, batch_size: int, max_tokens: int | None = None) -> list[tuple[dict, int]]:
        """Held-out batches of ``batch_size`` pairs (the last filled with repeats) and how many are real;
        ``max_tokens`` (``--eval-tokens``): only the first pairs whose reply tokens (both sides) reach that many."""
        val = self.val if max_tokens is None else first_until(
            self.val, lambda p: int(np.sum(p[0][1]) + np.sum(p[1][1])), max_tokens)
        out = []
        for i in range(0, len(val), batch_size):
            chunk = val[i:i + batch_size]
            out.append((self._batch(chunk + [chunk[0]] * (batch_size - len(chunk))), len(chunk)))
        return out


def load_pairs(base, tcfg, *, data=None, task=None, n_train=None, model_negatives=False):
    """``PairData`` of a JSONL file (``VAL_PERCENT`` held out by hash) or of a task (its train split, up to
    ``n_train`` problems; every problem of its heldout split, for arithmetic its default sample of 1,000), for
    ``base`` (a ``prologue.Base``: tokenizer, template — the tokenizer's own chat template when it has one — and the
    model that answers when ``model_negatives``)."""
    template = template_for(base.tok, base.template)
    if (data is None) == (task is None):
        raise ConfigError(f"give exactly one of a pair file (--data FILE.jsonl) and a task (--task NAME: "
                          f"{list(tasks_lib.TASKS)})")
    if task is not None:
        policy = (base.params, base.cfg, base.tok, template) if model_negatives else None
        train = task_pairs(task, "train", n=n_train, seed=tcfg.batch_seed, policy=policy)
        val = task_pairs(task, "heldout", seed=tcfg.batch_seed)
    else:
        train, val = split_pairs(read_pairs(data))
    return PairData.build(train, val, base.tok, template, tcfg.seq_len)
