"""Chat templates are untrusted code: they are compiled and rendered in a separate process, under a deadline and an
address-space limit, inside jinja2's sandbox.

A chat template comes with a downloaded model. jinja2's ``ImmutableSandboxedEnvironment`` stops it from reaching
Python's internals (``__class__``, ``__globals__``, a list's ``append``: every such access raises the sandbox's
SecurityError), but not from spending time or memory: two nested loops of 100,000 iterations each, or
``'x' * 10000000000``, are legal Jinja. So the parent never renders: one long-lived worker process (``python -c``,
importing only jinja2 and the standard library) compiles and renders each template and sends back the text, and

- each rendering must finish within ``DEADLINE_SECONDS`` (the parent waits on the worker's pipe; past the
  deadline it kills the worker, which is started again for the next rendering);
- the worker's address space is capped at ``MEMORY_BYTES`` (``RLIMIT_AS``), so an allocation beyond it fails inside
  the worker (MemoryError) and is reported, never felt by the parent;
- a rendering longer than ``MAX_OUTPUT_CHARS`` characters is refused.

A template that exceeds a limit raises ``TemplateLimit``; the callers turn it into one line (at import: the template
is refused; in ``sft`` / ``chat``: the conversation is). The environment (the globals transformers gives templates,
the ``{% generation %}`` tag) is described in data/templates.py.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import json
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

DEADLINE_SECONDS = 2.0  # one rendering (real chat templates take milliseconds)
START_SECONDS = 60.0  # the worker's start (importing jinja2), on a loaded machine
MEMORY_BYTES = 1 << 30  # the worker's address space: 1 GiB
MAX_OUTPUT_CHARS = 8 << 20  # one rendering: 8 Mi characters (a 128k-token context is about 0.5 Mi)
MAX_SOURCE_CHARS = 1 << 20  # a template's source


class TemplateLimit(Exception):
    """A template that ran past the deadline, the memory cap or the output size (the message says which)."""


class TemplateRefusal(Exception):
    """What the template's ``raise_exception(message)`` raises."""


class TemplateUnsafe(Exception):
    """The sandbox stopped an unsafe operation (the template itself is refused)."""


class TemplateSyntax(Exception):
    """The source is not valid Jinja: ``lineno`` and ``message``."""

    def __init__(self, lineno, message):
        super().__init__(message)
        self.lineno, self.message = lineno, message


class TemplateFailure(Exception):
    """The template failed on this conversation like any code fails (UndefinedError, TypeError, …)."""


# ----- the worker's side ------------------------------------------------------------------------------------------
def _raise_exception(message):
    raise TemplateRefusal(str(message))


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


class _DictMaker:
    """``dict(...)`` and ``dict.fromkeys(...)`` for templates, without handing them the ``dict`` type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


@functools.lru_cache(maxsize=1)
def environment():
    """The one sandboxed Jinja environment (data/templates.py describes it)."""
    import jinja2
    from jinja2 import ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Sandbox(ImmutableSandboxedEnvironment):
        def unsafe_undefined(self, obj, attribute):
            raise jinja2.exceptions.SecurityError(
                f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe")

    class Generation(ext.Extension):
        tags = {"generation"}  # transformers' marker of assistant text; the spans are located without it

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):  # noqa: N805  (jinja's own signature: self travels in args)
            for name in dict(*args[1:], **kwargs):
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(*args, **kwargs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_': {name!r}")

    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_DictMaker(),
                       namespace=Namespace)
    return env


@functools.lru_cache(maxsize=16)
def _compiled(source: str):
    return environment().from_string(source)


def _answer(request) -> tuple:
    """The worker's answer to ("compile", source) or ("render", source, context): ("ok", text) or the kind of
    failure and its message."""
    import jinja2

    try:
        template = _compiled(request[1])
        if request[0] == "compile":
            return ("ok", None)
        text = template.render(**request[2])
        if len(text) > MAX_OUTPUT_CHARS:
            return ("limit", f"its rendering is {len(text):,} characters, more than the {MAX_OUTPUT_CHARS:,} allowed")
        return ("ok", text)
    except TemplateRefusal as err:
        return ("refusal", str(err))
    except jinja2.exceptions.TemplateSyntaxError as err:
        return ("syntax", err.lineno, err.message)
    except jinja2.exceptions.SecurityError as err:
        return ("unsafe", str(err))
    except MemoryError:
        return ("limit", f"it needs more than the {MEMORY_BYTES >> 20} MiB of memory a template may use")
    except RecursionError:
        return ("limit", "it recurses too deeply")
    except Exception as err:  # template code fails like any code: UndefinedError, TypeError, …
        return ("failure", f"{type(err).__name__}: {err}")


def worker_main() -> None:
    """The worker: caps its address space, then answers requests read from stdin until it is closed."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    environment()  # import jinja2 before the first request: the deadline is for rendering alone
    _send(out, ("ready",))
    while True:
        request = _receive(inp)
        if request is None:
            return
        _send(out, _answer(request))


def _send(fh, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    fh.write(struct.pack("<Q", len(data)) + data)
    fh.flush()


def _receive(fh):
    head = fh.read(8)
    if len(head) < 8:
        return None
    (n,) = struct.unpack("<Q", head)
    return pickle.loads(fh.read(n))


# ----- the parent's side ------------------------------------------------------------------------------------------
class _Worker:
    """The one worker process of this process, started on first use and again after it was killed."""

    def __init__(self):
        self._proc = None
        self._lock = threading.Lock()

    def _start(self) -> None:
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
               "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
        code = "from mlx_llm.data.template_sandbox import worker_main; worker_main()"
        self._proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, env=env)
        if self._read(START_SECONDS) != ("ready",):
            self.stop()
            raise TemplateLimit("the template sandbox process did not start (is jinja2 installed?)")

    def _read(self, seconds: float):
        """The worker's next message, or None when it sends none within ``seconds`` (or exits)."""
        fd, deadline = self._proc.stdout.fileno(), time.monotonic() + seconds
        head = self._read_exact(fd, 8, deadline)
        if head is None:
            return None
        body = self._read_exact(fd, struct.unpack("<Q", head)[0], deadline)
        return None if body is None else pickle.loads(body)

    @staticmethod
    def _read_exact(fd: int, n: int, deadline: float) -> bytes | None:
        chunks, got = [], 0
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, min(n - got, 1 << 20))
            if not chunk:
                return None
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def ask(self, request: tuple, seconds: float) -> tuple:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            try:
                _send(self._proc.stdin, request)
            except (BrokenPipeError, OSError):
                self.stop()
                raise TemplateLimit("the template sandbox process stopped") from None
            answer = self._read(seconds)
            if answer is None:
                self.stop()
                raise TemplateLimit(f"it did not finish rendering within {seconds:g} s")
            return answer

    def stop(self) -> None:
        if self._proc is not None:
            with contextlib.suppress(OSError):
                self._proc.kill()
            self._proc.wait()
            for f in (self._proc.stdin, self._proc.stdout):
                with contextlib.suppress(OSError):
                    f.close()
            self._proc = None


_WORKER = _Worker()
atexit.register(_WORKER.stop)


def _checked(answer: tuple):
    kind = answer[0]
    if kind == "ok":
        return answer[1]
    if kind == "syntax":
        raise TemplateSyntax(answer[1], answer[2])
    raise {"refusal": TemplateRefusal, "unsafe": TemplateUnsafe, "failure": TemplateFailure,
           "limit": TemplateLimit}[kind](answer[1])


def _check_source(source) -> None:
    if isinstance(source, str) and len(source) > MAX_SOURCE_CHARS:
        raise TemplateLimit(f"its source is {len(source):,} characters, more than the {MAX_SOURCE_CHARS:,} allowed")


def compile_source(source: str) -> None:
    """Compile ``source`` in the worker: ``TemplateSyntax`` when it is not valid Jinja."""
    _check_source(source)
    _checked(_WORKER.ask(("compile", source), DEADLINE_SECONDS))


def render(source: str, context: dict, seconds: float = DEADLINE_SECONDS) -> str:
    """``source`` rendered with ``context`` in the worker, within ``seconds``; raises ``TemplateRefusal``,
    ``TemplateUnsafe``, ``TemplateFailure`` or ``TemplateLimit``."""
    _check_source(source)
    return _checked(_WORKER.ask(("render", source, context), seconds))
