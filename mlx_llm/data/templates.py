"""A model's own Jinja chat template (``chat_template`` of its tokenizer_config.json), rendered in a sandbox, and
the SFT loss mask over what it renders.

Rendering matches transformers' ``apply_chat_template`` for the conversations mlx_llm accepts. The template is
untrusted code: it is compiled and rendered in a separate process under a deadline, a memory cap and an output
limit (data/template_sandbox.py: a template that runs past one is refused), by jinja2's
``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension and a ``{% generation %}`` tag that renders its body; its globals are
``raise_exception(message)``, ``strftime_now(format)``, ``dict`` and a ``namespace`` that refuses names starting
with "_", and ``tojson`` writes JSON without HTML escaping. It sees ``messages``, ``add_generation_prompt``,
``tools`` / ``documents`` (None) and ``bos_token`` / ``eos_token`` / ``pad_token`` for the tokenizer's roles.
Reading an unsafe attribute (``''.__class__``, ``f.__globals__``, a list's ``append``) raises the sandbox's
SecurityError at once (jinja2 itself would hand back an undefined value), reported as one DataError line.

Token ids: the rendered text, tokenized as transformers does (``apply_chat_template(tokenize=True)`` =
``tokenizer(text, add_special_tokens=False)``: nothing is prepended, the template writes BOS itself when it
wants one), except that special-token strings inside message contents are spelled as text (as ``ChatTemplate``
does), never parsed: only the template's own markup yields special ids.

Where each content lies (the loss mask): the conversation is rendered a second time with each content replaced
by a placeholder that no text contains; the placeholders split that rendering into the template's markup, and
the real rendering must be that markup with each content put back, verbatim or stripped of surrounding
whitespace (templates such as Llama 3's ``| trim`` it). Targets are the tokens that overlap an assistant
content, plus the special token that directly follows it when the template puts one there (its end of turn:
Llama 3's ``<|eot_id|>``, ChatML's ``<|im_end|>``) — what the model must learn to emit to stop. A template that
alters contents otherwise, renders one twice, or drops an assistant reply is refused: the spans cannot be
located. ``end`` (the stop token of decoding) is that end-of-turn token, else the tokenizer's EOS.
"""

from __future__ import annotations

import numpy as np

from mlx_llm.data import template_sandbox
from mlx_llm.data.chat import ChatTemplate, check_messages
from mlx_llm.data.tokenizer import Tokenizer
from mlx_llm.errors import ConfigError, DataError, InputError

PLACEHOLDER = "\ue000{}\ue001"  # private-use characters around the message index: no real text holds them


class TemplateTooCostly(InputError):
    """A rendering stopped by the sandbox's deadline, memory cap or output limit (data/template_sandbox.py): at
    import the template is refused; in ``sft`` / ``chat`` the conversation is."""


def _sandbox():
    """data/template_sandbox.py, once jinja2 is known to be installed (the worker process needs it)."""
    import importlib.util

    if importlib.util.find_spec("jinja2") is None:
        raise ConfigError("rendering a model's chat template needs jinja2 >= 3.1.6 (pip install 'mlx_llm[hf]')")
    return template_sandbox


def compile_template(source: str, where: str) -> str:
    """``source``, checked to compile (in the sandbox process); a syntax error is one DataError line naming
    ``where`` (the file) and the line, a source beyond the size limit one line too."""
    sandbox = _sandbox()
    if not isinstance(source, str):
        raise DataError(f"{where}: chat_template must be a Jinja source string, got {type(source).__name__}")
    try:
        sandbox.compile_source(source)
    except sandbox.TemplateSyntax as err:
        raise DataError(f"{where}: the chat template is not valid Jinja (template line {err.lineno}: "
                        f"{err.message})") from None
    except sandbox.TemplateLimit as err:
        raise DataError(f"{where}: the chat template is refused: {err}") from None
    return source


def render(source: str, where: str, messages, *, generation_prompt: bool, tokens: dict) -> str:
    """One rendering, in the sandbox process (data/template_sandbox.py: a deadline, a memory cap, an output
    limit). The template's ``raise_exception``, its runtime failures and a rendering past a limit are InputErrors
    (this conversation is refused); the sandbox's refusal of an unsafe operation is a DataError (the template
    itself is unsafe)."""
    sandbox = _sandbox()
    context = dict(messages=[dict(m) for m in messages], tools=None, documents=None,
                   add_generation_prompt=bool(generation_prompt), **tokens)
    try:
        return sandbox.render(source, context)
    except sandbox.TemplateRefusal as err:
        raise InputError(f"the chat template refuses this conversation: {err}") from None
    except sandbox.TemplateUnsafe as err:
        raise DataError(f"{where}: the chat template was stopped by the sandbox ({err}); unsafe template "
                        f"operations are refused, never run") from None
    except sandbox.TemplateLimit as err:
        raise TemplateTooCostly(f"the chat template is stopped on this conversation: {err}") from None
    except sandbox.TemplateFailure as err:
        raise InputError(f"the chat template failed on this conversation ({err})") from None


def locate_contents(text: str, probe: str, contents: list[str]) -> list | None:
    """[start, end) of each content in ``text`` (None for one the template left out), given ``probe``: the same
    conversation rendered with ``PLACEHOLDER.format(k)`` as message k's content; None when ``text`` is not the
    probe's markup with the contents put back (verbatim or stripped) — see the module docstring."""
    hits = []
    for k in range(len(contents)):
        count = probe.count(PLACEHOLDER.format(k))
        if count > 1:
            return None
        if count:
            hits.append((probe.index(PLACEHOLDER.format(k)), k))
    hits.sort()
    markup, prev = [], 0
    for p, k in hits:
        markup.append(probe[prev:p])
        prev = p + len(PLACEHOLDER.format(k))
    markup.append(probe[prev:])
    if not text.startswith(markup[0]):
        return None
    spans, pos = [None] * len(contents), len(markup[0])
    for i, (_, k) in enumerate(hits):
        for content in dict.fromkeys((contents[k], contents[k].strip())):
            if text.startswith(content + markup[i + 1], pos):
                break
        else:
            return None
        spans[k] = (pos, pos + len(content))
        pos += len(content) + len(markup[i + 1])
    return spans if pos == len(text) else None


def tokenize_rendered(text: str, contents: list, targets: list, tok: Tokenizer):
    """(ids, target) of a rendered conversation: special tokens of the markup (outside every ``contents`` span)
    become their ids, everything between them is encoded as plain text; a token is a target when it overlaps a
    ``targets`` span, and a markup special token when it starts where a ``targets`` span ends."""
    t_start = np.array([s for s, _ in targets], np.int64)
    t_end = np.array([e for _, e in targets], np.int64)
    marks = [m for m in tok.special_pattern.finditer(text) if not any(s <= m.start() < e for s, e in contents)]
    ids, flags, pos = [], [], 0
    for m in marks + [None]:
        stop = len(text) if m is None else m.start()
        if stop > pos:
            run_ids, spans = tok.encode_offsets(text[pos:stop])
            spans = spans + pos
            ids.append(run_ids)
            flags.append(((spans[:, :1] < t_end[None]) & (spans[:, 1:] > t_start[None])).any(axis=1))
        if m is not None:
            ids.append(np.array([tok.token_id(m.group())], np.int32))
            flags.append(np.array([bool(np.any(t_end == m.start()))]))
            pos = m.end()
    if not ids:
        return np.zeros(0, np.int32), np.zeros(0, bool)
    return np.concatenate(ids).astype(np.int32), np.concatenate(flags).astype(bool)


class JinjaTemplate:
    """A tokenizer's own chat template with ``ChatTemplate``'s interface: ``render``, ``encode`` (ids and SFT
    targets), ``end`` (the end-of-turn token decoding stops at), ``check_tokenizer``; ``to_dict`` is None (the
    tokenizer file, not the run record, holds it)."""

    def __init__(self, source: str, tok: Tokenizer, where: str | None = None):
        self.source, self.where = source, where or tok.origin or "the tokenizer's chat template"
        self.tokens = {f"{role}_token": token for role, token in tok.roles.items()}
        self.specials = tuple(tok.special_tokens)
        self._template = compile_template(source, self.where)
        self.end = self._end_token(tok)

    @classmethod
    def of(cls, tok: Tokenizer) -> "JinjaTemplate":
        return cls(tok.chat_template, tok)

    def _end_token(self, tok: Tokenizer) -> str:
        """The special token right after an assistant reply (probed with a two-turn conversation), else EOS."""
        reply = PLACEHOLDER.format(1)
        try:
            text = self._render([{"role": "user", "content": PLACEHOLDER.format(0)},
                                 {"role": "assistant", "content": reply}], False)
        except TemplateTooCostly as err:
            raise DataError(f"{self.where}: the chat template is refused: {str(err).partition(': ')[2]}") from None
        except InputError:
            return tok.roles["eos"]
        match = tok.special_pattern.match(text, text.find(reply) + len(reply)) if reply in text else None
        return match.group() if match else tok.roles["eos"]

    def _render(self, messages, generation_prompt: bool) -> str:
        return render(self._template, self.where, messages, generation_prompt=generation_prompt, tokens=self.tokens)

    def to_dict(self) -> None:
        return None

    def check_tokenizer(self, tok: Tokenizer) -> None:
        if tuple(tok.special_tokens) != self.specials:
            raise InputError("the chat template was read for another tokenizer (its special tokens differ)")

    def render(self, messages, *, generation_prompt: bool = False) -> str:
        """The conversation as the template writes it (``check_messages`` first, then the template's own checks)."""
        check_messages(messages, require_assistant=not generation_prompt)
        return self._render(messages, generation_prompt)

    def encode(self, messages, tok: Tokenizer, *, generation_prompt: bool = False):
        """(ids (n,) int32, target (n,) bool) of ``render``: targets are each assistant content's tokens and the
        end-of-turn token after it (as ``ChatTemplate.encode``, also in a prompt's history); a conversation the
        template renders as no text is an InputError (``chat`` reports it and sends nothing)."""
        text = self.render(messages, generation_prompt=generation_prompt)
        if not text:  # an empty template (a run imported before import refused one): no prompt to continue
            raise InputError("the chat template renders this conversation as no text, so there is no prompt to send "
                             "the model (its tokenizer's chat_template is empty or writes nothing for it)")
        probe = self._render([{"role": m["role"], "content": PLACEHOLDER.format(k)} for k, m in enumerate(messages)],
                             generation_prompt)
        spans = locate_contents(text, probe, [m["content"] for m in messages])
        if spans is None:
            raise InputError("the chat template changes message contents (beyond trimming whitespace) or writes one "
                             "twice, so the replies cannot be located for the loss mask")
        replies = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
        dropped = [k for k in replies if spans[k] is None]
        if dropped and not generation_prompt:
            raise InputError(f"the chat template leaves out the content of message {dropped[0]} (assistant): its "
                             f"reply cannot be marked for the loss")
        targets = [spans[k] for k in replies if spans[k] is not None]
        return tokenize_rendered(text, [s for s in spans if s is not None], targets, tok)


def template_for(tok: Tokenizer, template=None):
    """The chat template a run renders with: the tokenizer's own Jinja template when it carries one (a model
    imported with its ``chat_template``), else ``template`` (a run's recorded ChatTemplate), else the default
    ``ChatTemplate()``."""
    if tok.chat_template is not None:
        return template if isinstance(template, JinjaTemplate) else JinjaTemplate.of(tok)
    return ChatTemplate() if template is None else template
