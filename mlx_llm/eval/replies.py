"""A model's replies through the chat template: sampled or greedy replies to prompts, held-out exact match on a
built-in task (``eval_task``: the skill a fine-tuning run is measured by) and the ``chat`` command's conversation.
"""

from __future__ import annotations

import time

import numpy as np

from mlx_llm.config import ModelConfig
from mlx_llm.data import tasks as tasks_lib
from mlx_llm.data.chat import ChatTemplate
from mlx_llm.data.templates import template_for
from mlx_llm.decode.engine import Engine, Request, complete
from mlx_llm.decode.sampling import DecodeSettings, prompt_seed
from mlx_llm.errors import ConfigError, InputError

REPLY_TOKENS = {"arithmetic": 8, "addition2": 8, "name_function": 40}  # new tokens eval_task allows per reply


def sample_replies(params, cfg: ModelConfig, tok, template: ChatTemplate, prompts, max_new_tokens: int, *,
                   temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                   seed: int = 0, batch_size: int = 64, with_logq: bool = False, n: int = 1, kernels=None) -> list:
    """The model's ``n`` replies to each conversation of ``prompts`` (rendered with the assistant marker), decoded
    until the end-of-turn marker or ``max_new_tokens`` by the engine (``decode.engine.complete``, up to
    ``batch_size`` replies at once): greedy (``temperature`` None) or sampled from p^(1/T) (cut to ``top_k`` /
    ``top_p``); prompt i's request seed is ``sampling.prompt_seed(seed, i)``, so its replies do not depend on the
    batch, and its n replies share the prompt's computation. Returns, prompt by prompt, n rows each of [(reply ids,
    end marker included when produced), text (marker dropped)], with ``with_logq`` a third item: log q of each reply
    id under the sampler (float32 array). The tokenizer's own chat template, when it has one, renders the prompts
    (``template_for``)."""
    template = template_for(tok, template)
    end_id = tok.token_id(template.end)
    encoded = [template.encode(m, tok, generation_prompt=True)[0] for m in prompts]
    longest = max(len(p) for p in encoded)
    if longest + max_new_tokens > cfg.max_seq_len:
        raise ConfigError(f"prompts of up to {longest} tokens + {max_new_tokens} new tokens exceed the model's "
                          f"max_seq_len = {cfg.max_seq_len}")
    requests = [Request(tuple(int(t) for t in p), max_tokens=max_new_tokens, temperature=temperature or 0.0,
                        top_k=top_k or 0, top_p=1.0 if top_p is None else top_p, stop_ids=(end_id,),
                        seed=prompt_seed(seed, i), n=n, logprobs=with_logq) for i, p in enumerate(encoded)]
    out_replies = []
    for done in complete(params, cfg, requests, max_seqs=batch_size, kernels=kernels):
        for reply in done.replies:
            ids = np.asarray(reply.tokens, np.int32)
            text = ids[:-1] if ids.size and ids[-1] == end_id else ids
            out_replies.append((ids, tok.decode(text, skip_special=True))
                               + ((np.asarray(reply.logq, np.float32),) if with_logq else ()))
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
                 temperature: float | None = None, seed: int = 0, read=input, write=print, kernels=None) -> int:
    """The ``chat`` command's loop: each line read is the user's turn, the model's reply (decoded until the
    template's end-of-turn marker) is written and kept in the conversation; an empty line or end of input ends
    it (returns 0). The replies come from one engine kept for the session (turn i sampled with
    ``sampling.prompt_seed(seed, i)``). A turn that cannot be sent — its prompt would leave no room in the model's context
    (``cfg.max_seq_len``), or the template refuses it — is reported and dropped; the session goes on."""
    DecodeSettings(temperature=temperature)  # a bad temperature is refused before the first turn
    template = template_for(tok, template)
    end_id = tok.token_id(template.end)
    messages = [{"role": "system", "content": system}] if system else []
    # one engine for the session: its pages keep the conversation so far, so a turn computes only its new tokens
    # (where every layer is paged; prefix caching)
    engine, turns = Engine(params, cfg, max_seqs=1, kernels=kernels), 0
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
        reply = engine.run([Request(tuple(int(t) for t in ids), max_tokens=n_new, temperature=temperature or 0.0,
                                    stop_ids=(end_id,), seed=prompt_seed(seed, turns))])[0].replies[0]
        turns += 1
        text = tok.decode(np.asarray(reply.tokens, np.int32), skip_special=True)
        write("model> " + text)
        messages = turn + [{"role": "assistant", "content": text if text.strip() else "…"}]
