"""OpenAI's chat and completions protocol: request bodies checked field by field into engine requests, and the
response and stream-chunk objects built from the engine's replies. No HTTP here (``serve.app`` holds it).

Every request field is either supported (``CHAT_FIELDS``, ``COMPLETION_FIELDS``), accepted only at its no-op
value (``NEUTRAL``: null, a penalty of 0, ``echo`` false…), or refused with a 400 that names it; a bad value is a
400 naming the field, its value and what is valid."""

from __future__ import annotations

import dataclasses
import math
import numbers
import secrets
import time

from mlx_llm.config import SEED_MAX
from mlx_llm.decode.engine import Request
from mlx_llm.decode.sampling import prompt_seed
from mlx_llm.errors import InputError

MAX_TOP_LOGPROBS = 20  # chat's top_logprobs bound (OpenAI's); completions' logprobs takes 0-5
COMMON_FIELDS = ("model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "stream", "stream_options",
                 "user", "top_k", "min_tokens", "stop_token_ids", "ignore_eos", "return_token_ids")
CHAT_FIELDS = COMMON_FIELDS + ("messages", "max_completion_tokens", "logprobs", "top_logprobs")
COMPLETION_FIELDS = COMMON_FIELDS + ("prompt", "logprobs")
# fields the server does not implement, accepted at the value that asks for nothing (anything else: 400)
NEUTRAL = {"frequency_penalty": (0,), "presence_penalty": (0,), "repetition_penalty": (1,), "logit_bias": ({},),
           "best_of": (1,), "echo": (False,), "suffix": ("",), "tools": ([],), "functions": ([],),
           "parallel_tool_calls": (False,), "tool_choice": ("none",), "response_format": ({"type": "text"},),
           "store": (False,), "metadata": ({},), "service_tier": ("auto", "default"), "modalities": (["text"],),
           "min_p": (0,)}


class APIError(Exception):
    """An error answered as OpenAI's error JSON: status, message, its type, the field it is about."""

    def __init__(self, status: int, message: str, *, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}

    @property
    def kind(self) -> str:
        return {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}.get(
            self.status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.status}}


def bad(field: str, value, valid: str) -> APIError:
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return APIError(400, f"{field} = {shown} is invalid: {valid}", param=field)


def _int(body, field, default, low, high=None):
    v = body.get(field)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < low or (high is not None and v > high):
        raise bad(field, v, f"it must be an integer in [{low}, {high}]" if high is not None else
                  f"it must be an integer ≥ {low}")
    return int(v)


def _real(body, field, default, low, high, *, open_low=False):
    v = body.get(field)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v > high or \
            (v <= low if open_low else v < low):
        raise bad(field, v, f"it must be a number in {'(' if open_low else '['}{low}, {high}]")
    return float(v)


def _bool(body, field, default=False):
    v = body.get(field)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(field, v, "it must be true or false")
    return v


@dataclasses.dataclass
class Parsed:
    """A checked request: its prompts (token ids), the engine request of each, and how to answer."""

    kind: str  # "chat" or "completion"
    model: str
    prompts: list  # list of tuples of token ids
    requests: list  # engine.Request per prompt
    stream: bool
    include_usage: bool
    logprobs: bool
    top_logprobs: int
    return_token_ids: bool
    stop: tuple


def check_fields(body, allowed: tuple) -> None:
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object; got {type(body).__name__}")
    for field, value in body.items():
        if field in allowed or value is None:
            continue
        if field in NEUTRAL:
            if any(value == v and type(value) is type(v) or (isinstance(v, int) and not isinstance(value, bool) and
                                                             isinstance(value, numbers.Real) and value == v)
                   for v in NEUTRAL[field]):
                continue
            raise APIError(400, f"{field} is not supported by this server (only {NEUTRAL[field][0]!r} is accepted)",
                           param=field)
        raise APIError(400, f"{field} is not supported by this server (supported: {', '.join(allowed)})",
                       param=field)


def parse(body, kind: str, *, served: str, encode_prompt, encode_chat, stop_ids_of, vocab: int, max_len: int,
          max_n: int) -> Parsed:
    """A chat (``kind`` "chat") or completions request body → ``Parsed``. ``encode_prompt(text)`` and
    ``encode_chat(messages)`` give token ids; ``stop_ids_of(ignore_eos)`` the ids that end a reply; ``vocab``
    the valid ids; ``max_len`` the context (prompt + max_tokens); ``max_n`` the most replies per prompt."""
    check_fields(body, CHAT_FIELDS if kind == "chat" else COMPLETION_FIELDS)
    model = body.get("model")
    if not isinstance(model, str):
        raise bad("model", model, f"it must be a string (this server serves {served!r})")
    if model != served:
        raise APIError(404, f"the model {model!r} does not exist: this server serves {served!r}", param="model")
    if kind == "chat":
        prompts = [tuple(encode_chat(_messages(body.get("messages"))))]
    else:
        prompts = [tuple(p) for p in _prompts(body.get("prompt"), encode_prompt, vocab)]
    n = _int(body, "n", 1, 1, max_n)
    temperature = _real(body, "temperature", 1.0, 0, 2)
    top_p = _real(body, "top_p", 1.0, 0, 1, open_low=True)
    top_k = _int(body, "top_k", 0, -1)
    top_k = 0 if top_k == -1 else top_k  # vLLM's "no top-k" spelling
    seed = _int(body, "seed", None, 0, SEED_MAX)
    ignore_eos = _bool(body, "ignore_eos")
    stop = _stop(body.get("stop"))
    extra = body.get("stop_token_ids")
    if extra is not None and (not isinstance(extra, list) or any(
            isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab for t in extra)):
        raise bad("stop_token_ids", extra, f"it must be a list of token ids in [0, {vocab})")
    stop_ids = tuple(dict.fromkeys(tuple(stop_ids_of(ignore_eos)) + tuple(extra or ())))
    if kind == "chat":
        logprobs = _bool(body, "logprobs")
        top = _int(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
        if top and not logprobs:
            raise bad("top_logprobs", top, "it needs logprobs = true")
        limit = body.get("max_completion_tokens")
        if limit is not None and body.get("max_tokens") is not None and limit != body.get("max_tokens"):
            raise APIError(400, "max_tokens and max_completion_tokens differ: give one of them", param="max_tokens")
        field = "max_completion_tokens" if limit is not None else "max_tokens"
    else:
        v = body.get("logprobs")
        if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Integral) or not 0 <= v <= 5):
            raise bad("logprobs", v, "it must be an integer in [0, 5] (the most likely tokens to list) or null")
        logprobs, top, field = v is not None, int(v or 0), "max_tokens"
    longest = max(len(p) for p in prompts)
    if longest >= max_len:
        raise APIError(413, f"the prompt has {longest} tokens; this model's context is {max_len} tokens (prompt "
                       f"and reply), which leaves no room for a reply", param="messages" if kind == "chat" else "prompt")
    # chat: until the context is full by default (as OpenAI's); completions: 16 tokens (the legacy default)
    max_tokens = _int(body, field, (max_len - longest) if kind == "chat" else 16, 1)
    if longest + max_tokens > max_len:
        raise bad(field, max_tokens, f"the prompt has {longest} tokens and the context {max_len}, so at most "
                  f"{max_len - longest} can be generated")
    min_tokens = _int(body, "min_tokens", 0, 0, max_tokens)
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise bad("stream_options", options, 'it must be {"include_usage": true|false}')
    if options is not None and not stream:
        raise bad("stream_options", options, "it is only allowed with stream = true")
    include_usage = _bool(options or {}, "include_usage")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad("user", user, "it must be a string")
    return_ids = _bool(body, "return_token_ids")
    if seed is None:
        seed = secrets.randbelow(SEED_MAX)
    requests = [Request(p, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                        stop_ids=stop_ids, stop=stop, seed=seed if len(prompts) == 1 else prompt_seed(seed, i), n=n,
                        logprobs=logprobs, top_logprobs=top, min_tokens=min_tokens) for i, p in enumerate(prompts)]
    return Parsed(kind, model, prompts, requests, stream, include_usage, logprobs, top, return_ids, stop)


def _stop(v) -> tuple:
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not 1 <= len(items) <= 16 or any(not isinstance(s, str) or not s for s in items):
        raise bad("stop", v, "it must be a non-empty string or a list of 1 to 16 of them")
    return tuple(items)


def _messages(v) -> list:
    if not isinstance(v, list) or not v:
        raise bad("messages", v, "it must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or set(m) - {"role", "content", "name"}:
            raise bad(f"messages[{i}]", m, "it must be an object with a role and a content (and optionally a name)")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if any(not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str)
                   for p in content):
                raise bad(f"messages[{i}].content", content, "only text parts ({type: text, text}) are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content", content, "it must be a string or a list of text parts")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": content})
    return out


def _prompts(v, encode_prompt, vocab: int) -> list:
    """prompt: a string, a list of strings, a list of token ids, or a list of lists of token ids."""
    ids_ok = lambda xs: isinstance(xs, list) and xs and all(
        not isinstance(t, bool) and isinstance(t, numbers.Integral) for t in xs)
    if isinstance(v, str):
        return [encode_prompt(v)]
    if ids_ok(v):
        prompts = [v]
    elif isinstance(v, list) and v and all(isinstance(p, str) for p in v):
        return [encode_prompt(p) for p in v]
    elif isinstance(v, list) and v and all(ids_ok(p) for p in v):
        prompts = v
    else:
        raise bad("prompt", v, "it must be a string, a list of strings, a list of token ids or a list of lists of "
                  "token ids (none empty)")
    for p in prompts:
        if any(not 0 <= t < vocab for t in p):
            raise bad("prompt", p, f"token ids must be in [0, {vocab})")
    return [[int(t) for t in p] for p in prompts]


# ----- responses ------------------------------------------------------------------------------------------
def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)


def usage(parsed: Parsed, completions) -> dict:
    prompt = sum(len(p) for p in parsed.prompts)
    done = sum(len(r.tokens) for c in completions for r in c.replies)
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}


def logprob_entries(parsed: Parsed, token_text, tokens, logp, logq, mass, top, offset: int = 0):
    """The ``logprobs`` object of a choice for ``tokens`` (a slice of a reply, from index ``offset``): log p of
    each token under the model (OpenAI's ``logprob``); the extensions ``logq`` (log q, the distribution it was
    drawn from) and ``log_mass`` (the log of the mass of p at the temperature that top-k and top-p kept)."""
    if parsed.kind == "chat":
        content = []
        for k, t in enumerate(tokens):
            s = token_text(t)
            content.append({"token": s, "logprob": logp[k], "bytes": list(s.encode()), "logq": logq[k],
                            "log_mass": mass[k],
                            "top_logprobs": [{"token": token_text(i), "logprob": v, "bytes": list(token_text(i).encode())}
                                             for i, v in (top[k] if parsed.top_logprobs else [])]})
        return {"content": content}
    text = [token_text(t) for t in tokens]
    return {"tokens": text, "token_logprobs": list(logp), "token_logqs": list(logq), "token_log_masses": list(mass),
            "top_logprobs": [{token_text(i): v for i, v in top[k]} for k in range(len(tokens))]
            if parsed.top_logprobs else None, "text_offset": None}


def created() -> int:
    return int(time.time())


def check_engine(engine, request) -> Request:
    """The engine's own check of a request, as a 400 (what the protocol did not already refuse)."""
    try:
        return engine.check(request)
    except InputError as err:
        raise APIError(400, str(err)) from None
