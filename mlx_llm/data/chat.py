"""Chat format: conversations rendered with the tokenizer's chat markers, and the SFT loss mask (M20 §16, U19 §9).

A conversation is the ecosystem's usual shape, ``{"messages": [{"role": "system"|"user"|"assistant",
"content": "..."}, ...]}`` (one JSON object per line of a ``.jsonl`` file). ``ChatTemplate`` turns it into text
and token ids together:

    <|bos|><|system|>…<|end|><|user|>…<|end|><|assistant|>…<|end|>…

i.e. BOS, then for each turn its role marker, its content (plain text: marker strings inside content are
spelled, never parsed) and the end-of-turn marker. The template is data (``ChatTemplate.from_dict``: the three
role markers, the end marker, whether BOS leads), so a user can swap markers without code.

The loss mask b_t (M20 §16: "SFT can leave the entire forward pass intact while selecting only response targets
through b_t"): the tokens of each assistant turn's content and its end marker are targets; BOS, role markers,
system and user turns are context only. ``encode`` returns the ids and a per-id ``target`` flag; a training
window then uses tokens = ids[:-1], targets = ids[1:], mask = target[1:] (``training_arrays``).
``decode(ids)`` equals ``render(messages)`` exactly (tests/test_chat.py).

A model imported with its own Jinja ``chat_template`` renders through it instead (``templates.JinjaTemplate``,
chosen by ``templates.template_for``); export writes ours as Jinja (``ChatTemplate.to_jinja``), so transformers
renders the same text. Both accept the same role orders (``check_messages``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from mlx_llm.errors import DataError, InputError
from mlx_llm.data.tokenizer import BOS, CHAT_MARKERS, Tokenizer
from mlx_llm.settings import JsonProblem, parse_json

ROLES = ("system", "user", "assistant")
VALID_ORDER = ("valid conversations are an optional first system message, then user and assistant turns alternating, "
               "starting with user")


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """Role markers, end-of-turn marker and BOS: the whole template (see the module docstring)."""

    system: str = CHAT_MARKERS[0]
    user: str = CHAT_MARKERS[1]
    assistant: str = CHAT_MARKERS[2]
    end: str = CHAT_MARKERS[3]
    bos: bool = True

    @classmethod
    def from_dict(cls, d: dict) -> "ChatTemplate":
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise InputError(f"unknown chat template field(s) {unknown}: valid fields are "
                             f"{[f.name for f in dataclasses.fields(cls)]}")
        return cls(**d)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def marker(self, role: str) -> str:
        return getattr(self, role)

    def check_tokenizer(self, tok: Tokenizer) -> None:
        """Every marker must be one special token of ``tok``, and BOS (when the template writes it) its BOS."""
        missing = [m for m in (self.system, self.user, self.assistant, self.end) if m not in tok.special_tokens]
        if missing:
            raise InputError(f"the chat markers {missing} are not special tokens of the tokenizer "
                             f"({list(tok.special_tokens)[:16]})")
        if self.bos and tok.roles.get("bos") != BOS:
            raise InputError(f"the chat template starts with {BOS!r} but the tokenizer's BOS is "
                             f"{tok.roles.get('bos')!r}")

    def to_jinja(self) -> str:
        """This template as a Jinja ``chat_template`` (what export writes to tokenizer_config.json):
        transformers' ``apply_chat_template`` renders with it exactly what ``render`` does, and refuses role
        orders that ``check_messages`` refuses (through ``raise_exception``)."""
        q = _jinja_string
        order = ("{%- set first = 1 if messages[0]['role'] == 'system' else 0 -%}"
                 "{%- for message in messages -%}"
                 "{%- if loop.index0 >= first and message['role'] != ['user', 'assistant'][(loop.index0 - first) % 2]"
                 f" -%}}{{{{ raise_exception({q('message roles are out of order: ' + VALID_ORDER)}) }}}}"
                 "{%- endif -%}{%- endfor -%}")
        turns = "{%- for message in messages -%}" + "".join(
            f"{{%- {'if' if k == 0 else 'elif'} message['role'] == {q(role)} -%}}{{{{ {q(self.marker(role))} }}}}"
            for k, role in enumerate(ROLES))
        turns += (f"{{%- else -%}}{{{{ raise_exception({q('unknown role: valid roles are ' + ', '.join(ROLES))}) }}}}"
                  f"{{%- endif -%}}{{{{ message['content'] }}}}{{{{ {q(self.end)} }}}}{{%- endfor -%}}")
        head = f"{{{{ {q(BOS)} }}}}" if self.bos else ""
        tail = f"{{%- if add_generation_prompt -%}}{{{{ {q(self.assistant)} }}}}{{%- endif -%}}"
        return "{#- mlx_llm ChatTemplate -#}" + order + head + turns + tail

    def render(self, messages, *, generation_prompt: bool = False) -> str:
        """The conversation as text; with ``generation_prompt`` the assistant marker follows (what a model
        continues at inference)."""
        check_messages(messages, require_assistant=not generation_prompt)
        text = (BOS if self.bos else "") + "".join(
            self.marker(m["role"]) + m["content"] + self.end for m in messages)
        return text + (self.assistant if generation_prompt else "")

    def encode(self, messages, tok: Tokenizer, *, generation_prompt: bool = False):
        """(ids (n,) int32, target (n,) bool): the ids of ``render`` and which of them are SFT targets (the
        content and end marker of assistant turns)."""
        check_messages(messages, require_assistant=not generation_prompt)
        self.check_tokenizer(tok)
        ids, target = ([tok.bos_id], [False]) if self.bos else ([], [])
        for m in messages:
            content = tok.encode(m["content"]).tolist()
            is_target = m["role"] == "assistant"
            ids += [tok.token_id(self.marker(m["role"]))] + content + [tok.token_id(self.end)]
            target += [False] + [is_target] * (len(content) + 1)
        if generation_prompt:
            ids.append(tok.token_id(self.assistant))
            target.append(False)
        return np.asarray(ids, np.int32), np.asarray(target, bool)


def training_arrays(ids, target) -> dict[str, np.ndarray]:
    """One conversation as next-token arrays: tokens = ids[:-1], targets = ids[1:], mask = target[1:]."""
    ids, target = np.asarray(ids), np.asarray(target)
    return {"tokens": ids[:-1], "targets": ids[1:], "mask": target[1:].astype(np.float32)}


def _jinja_string(text: str) -> str:
    """A Jinja string literal of ``text`` (the lexer reads backslash escapes; other characters stand as they are)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def check_messages(messages, *, require_assistant: bool = True, order: bool = True) -> None:
    """A conversation: a non-empty list of {"role", "content"} with known roles and non-empty string content,
    whose roles come in an order a chat model is trained on (``order``)::

        [system] user assistant (user assistant)*     training (``require_assistant``): ends with the reply
        [system] (user assistant)* user               a prompt for the next reply: ends with the user's turn

    i.e. at most one system message, first; then user and assistant strictly alternate, starting with user.
    Raises InputError naming the message and what is valid."""
    if not isinstance(messages, list) or not messages:
        raise InputError(f"messages must be a non-empty list of {{'role', 'content'}} objects, got {messages!r:.80}")
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) - {"role", "content"} or "role" not in m or "content" not in m:
            raise InputError(f"message {k} must be an object with exactly 'role' and 'content', got {m!r:.80}")
        if m["role"] not in ROLES:
            raise InputError(f"message {k} has unknown role {m['role']!r}: valid roles are {list(ROLES)}")
        if not isinstance(m["content"], str):
            raise InputError(f"message {k} ({m['role']}) has content of type {type(m['content']).__name__} "
                             f"({m['content']!r:.40}): content must be a string")
        if not m["content"].strip():
            raise InputError(f"message {k} ({m['role']}) has empty content")
    if require_assistant and not any(m["role"] == "assistant" for m in messages):
        raise InputError("the conversation has no assistant turn: there is nothing to learn from it")
    if order:
        _check_order([m["role"] for m in messages], prompt=not require_assistant)


def _check_order(roles: list[str], *, prompt: bool) -> None:
    first = 1 if roles[0] == "system" else 0
    for k, role in enumerate(roles[first:], start=first):
        if role == "system":
            raise InputError(f"message {k} is a system message: only the first message may be one; {VALID_ORDER}")
        expected = ("user", "assistant")[(k - first) % 2]
        if role != expected:
            raise InputError(f"message {k} is {'an' if role == 'assistant' else 'a'} {role} turn where the "
                             f"{expected}'s turn belongs: {VALID_ORDER}")
    if len(roles) == first:
        raise InputError(f"the conversation is only a system message: {VALID_ORDER}")
    if prompt and roles[-1] != "user":
        raise InputError("the prompt ends with an assistant turn: a prompt ends with the user's turn the reply answers")
    if not prompt and roles[-1] != "assistant":
        raise InputError("the conversation ends with a user turn: a training conversation ends with the assistant's "
                         "reply (drop the unanswered turn)")


def jsonl_records(path):
    """(line number, parsed object) of each non-blank line of a UTF-8 JSONL file; DataError names the file (and
    line) when it is missing, not UTF-8 or a line is not JSON."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    for n, line in enumerate(lines, start=1):
        if line.strip():
            try:
                record = parse_json(line, f"{path}:{n}")
            except JsonProblem as err:
                raise DataError(f"{path}:{n}: not JSON ({err.syntax})" if err.syntax else f"{path}:{n}: {err.detail}"
                                ) from None
            yield n, record


def read_conversations(path, tok: Tokenizer, template: ChatTemplate, max_len: int):
    """Every conversation of a JSONL file, encoded: a list of (ids, target). Bad data is refused with the file,
    line and reason (not JSON, not a conversation, unknown role, content not a string or empty, roles out of
    order — ``check_messages`` — or refused by an imported template's own ``raise_exception``); conversations
    longer than ``max_len`` ids are never truncated: the error says how many and which line is the first.
    ``template``: a ``ChatTemplate`` or a model's ``templates.JinjaTemplate`` (``templates.template_for``)."""
    out, too_long = [], []
    for n, record in jsonl_records(path):
        if not isinstance(record, dict) or "messages" not in record:
            raise DataError(f"{path}:{n}: expected an object with a 'messages' list")
        try:
            ids, target = template.encode(record["messages"], tok)
        except InputError as err:
            raise DataError(f"{path}:{n}: {err}") from None
        if ids.size > max_len:
            too_long.append((n, ids.size))
            continue
        out.append((ids, target))
    if too_long:
        first, size = too_long[0]
        raise DataError(f"{path}: {len(too_long)} conversation(s) are longer than {max_len} tokens after rendering "
                        f"(first: line {first}, {size} tokens); nothing is truncated: shorten or drop them")
    if not out:
        raise DataError(f"{path}: no conversations")
    return out
