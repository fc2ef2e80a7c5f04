"""``mlx-llm serve``: OpenAI's chat and completions endpoints over the engine, on FastAPI + uvicorn.

One process, one engine (``serve.worker``: the engine's own thread), one asyncio loop for the HTTP side.
``build_app`` makes the app from a loaded run; ``serve`` binds, prints the URL and runs until SIGTERM or Ctrl-C:
then it stops accepting, lets the requests in flight finish for ``grace`` seconds, aborts the rest and exits 0.

Bodies are read with a size cap and parsed here (not by FastAPI), so a huge body, deep nesting, bad JSON or
non-UTF-8 bytes answer a 4xx in bounded time; every error is OpenAI's error JSON (``protocol.APIError``).
"""


import asyncio
import hmac
import json
import signal
import socket
import time

import numpy as np

from mlx_llm.data import tokenizer as tok_lib
from mlx_llm.data.templates import template_for
from mlx_llm.decode.engine import Engine
from mlx_llm.errors import ConfigError
from mlx_llm.post.prologue import run_template
from mlx_llm.runs.load import as_run, checkpoint_step, load_params
from mlx_llm.serve import protocol
from mlx_llm.serve.protocol import APIError
from mlx_llm.serve.worker import EngineWorker

MAX_BODY = 2 * 1024 * 1024  # bytes: a context of token ids or messages fits many times over
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
REPLICA_HEADER = "x-mlx-llm-replica"
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class Model:
    """What the endpoints serve: the engine, the tokenizer, the chat template (None: chat is not served)."""

    def __init__(self, engine: Engine, tok, template, *, name: str, root: str):
        self.engine, self.tok, self.template, self.name, self.root = engine, tok, template, name, root
        self.vocab = engine.cfg.vocab_used or engine.cfg.vocab_size
        self.end_id = tok.token_id(template.end) if template is not None else None
        self._texts: dict[int, str] = {}

    def encode_prompt(self, text: str) -> list:
        return [int(t) for t in np.concatenate([self.tok.bos_prefix, self.tok.encode(text)])]

    def encode_chat(self, messages) -> list:
        if self.template is None:
            raise APIError(400, f"this model has no chat template ({self.root} records none): use /v1/completions",
                           param="messages")
        try:
            ids, _ = self.template.encode(messages, self.tok, generation_prompt=True)
        except Exception as err:  # the template's own refusal (roles, order): one line
            raise APIError(400, f"messages are invalid for this model's chat template: {err}", param="messages") \
                from None
        return [int(t) for t in ids]

    def stop_ids(self, chat: bool):
        def of(ignore_eos: bool):
            if ignore_eos:
                return ()
            ids = [self.end_id] if chat else []
            return tuple(i for i in ids + [self.tok.eos_id] if i is not None)
        return of

    def token_text(self, t: int) -> str:
        if t not in self._texts:
            self._texts[t] = self.tok.decode(np.asarray([t], np.int32))
        return self._texts[t]

    def detokenize(self, ids) -> str:
        return self.tok.decode(np.asarray(ids, np.int32), skip_special=True)


def build_app(model: Model, *, api_key: str | None = None, max_queue: int = 256, max_body: int = MAX_BODY,
              replica: str | None = None):
    """The FastAPI app serving ``model`` (its engine's thread starts and stops with the app's lifespan); with
    ``replica`` (one of several behind Ray Serve) every response names it in the ``x-mlx-llm-replica`` header."""
    import contextlib

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from starlette.exceptions import HTTPException

    engine = model.engine
    registry = CollectorRegistry()
    ttft = Histogram("mlx_llm_time_to_first_token_seconds", "time from a request's arrival to its first token",
                     buckets=TTFT_BUCKETS, registry=registry)
    itl = Histogram("mlx_llm_inter_token_latency_seconds", "time between a reply's consecutive tokens",
                    buckets=ITL_BUCKETS, registry=registry)
    finished = Counter("mlx_llm_requests", "requests finished, by how their replies ended", ["finish_reason"],
                       registry=registry)

    def on_finish(job, now):
        for reply in job.completion.replies:
            if reply.times:
                ttft.observe(reply.times[0] - job.arrived)
                for a, b in zip(reply.times, reply.times[1:]):
                    itl.observe(b - a)
            finished.labels(reply.finish_reason or "abort").inc()

    worker = EngineWorker(engine, max_queue=max_queue, on_finish=on_finish)

    class EngineState:  # read at scrape time (plain reads of the engine thread's counters)
        def collect(self):
            # lengths only: the engine thread changes these containers while this runs
            gauges = {"requests_queued": ("requests waiting for rows (in the engine's queue or its inbox)",
                                          len(engine.waiting) + worker.inbox.qsize()),
                      "requests_running": ("replies holding a row", len(engine.running)),
                      "pages_used": ("KV-cache pages held by replies or the prefix cache",
                                     engine.table.pages.count - 1 - len(engine.table.free)),
                      "pages_free": ("KV-cache pages never written or given back", len(engine.table.free)),
                      "pages_available": ("pages a new reply can take (free, or cached and unreferenced)",
                                          engine.table.available),
                      "prefix_cache_hit_rate": ("prefix-cache pages found over pages looked up",
                                                engine.prefix_hit_rate)}
            for name, (doc, value) in gauges.items():
                yield GaugeMetricFamily(f"mlx_llm_{name}", doc, value=value)
            yield CounterMetricFamily("mlx_llm_prompt_tokens", "prompt tokens of submitted requests",
                                      value=worker.prompt_tokens)
            yield CounterMetricFamily("mlx_llm_generation_tokens", "tokens generated", value=worker.generated_tokens)

    registry.register(EngineState())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        worker.start()
        yield
        worker.stop()

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    def error(err: APIError):
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(APIError)
    async def _api_error(request, err: APIError):
        return error(err)

    @app.exception_handler(HTTPException)
    async def _http_error(request, err: HTTPException):
        what = {404: f"no such path: {request.method} {request.url.path}",
                405: f"{request.method} is not allowed on {request.url.path}"}.get(err.status_code, str(err.detail))
        return error(APIError(err.status_code, what))

    @app.exception_handler(Exception)
    async def _crash(request, err: Exception):
        return error(APIError(500, f"internal error: {type(err).__name__}: {err}"))

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        response = None
        if api_key is not None and request.url.path != "/health":
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                response = error(APIError(401, "a valid API key is required: send Authorization: Bearer <key>"))
        response = response or await call_next(request)
        if replica is not None:
            response.headers[REPLICA_HEADER] = replica
        return response

    async def read_json(request: Request):
        size = request.headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > max_body):
            raise APIError(413, f"the request body is {size} bytes; this server takes at most {max_body}")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_body:
                raise APIError(413, f"the request body is over {max_body} bytes, the most this server takes")
        try:
            return json.loads(body.decode("utf-8"))
        except UnicodeDecodeError:
            raise APIError(400, "the request body is not UTF-8") from None
        except RecursionError:
            raise APIError(400, "the request body nests JSON too deeply") from None
        except ValueError as err:
            raise APIError(400, f"the request body is not valid JSON: {err}") from None

    @app.get("/health")
    async def health():
        if worker.error is not None:
            return error(APIError(503, f"the engine failed: {type(worker.error).__name__}: {worker.error}"))
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model.name, "object": "model", "created": 0,
                                            "owned_by": "mlx-llm", "root": model.root,
                                            "max_model_len": engine.max_len}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(registry).decode(), media_type="text/plain; version=0.0.4")

    async def answer(request: Request, kind: str):
        if worker.error is not None:
            raise APIError(503, f"the engine failed: {type(worker.error).__name__}: {worker.error}")
        body = await read_json(request)
        parsed = protocol.parse(body, kind, served=model.name, encode_prompt=model.encode_prompt,
                                encode_chat=model.encode_chat, stop_ids_of=model.stop_ids(kind == "chat"),
                                vocab=model.vocab, max_len=engine.max_len, max_n=engine.max_seqs)
        requests = [protocol.check_engine(engine, r) for r in parsed.requests]
        loop, updates = asyncio.get_running_loop(), asyncio.Queue()
        jobs = []
        for r in requests:
            job = worker.submit(r, loop, updates)
            if job is None:
                for j in jobs:
                    worker.abort(j)
                raise APIError(429, f"the server's queue is full ({max_queue} requests): retry later",
                               headers={"Retry-After": "1"})
            jobs.append(job)
        rid, made = protocol.new_id(kind), protocol.created()
        if parsed.stream:
            return StreamingResponse(stream(parsed, jobs, updates, rid, made), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await whole(request, parsed, jobs, updates, rid, made)

    async def wait_all(request, jobs, updates):
        left = len(jobs)
        try:
            while left:
                try:
                    _, update = await asyncio.wait_for(updates.get(), 0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return False
                    continue
                left -= update is None
            return True
        finally:  # the client went away, or the request was cancelled (Ray Serve's proxy does that on a disconnect)
            if left:
                for job in jobs:
                    worker.abort(job)

    async def whole(request, parsed, jobs, updates, rid, made):
        if not await wait_all(request, jobs, updates):
            return JSONResponse({}, status_code=499)
        if worker.error is not None and any(r.finish_reason == "abort" for j in jobs for r in j.completion.replies):
            raise APIError(500, f"the engine failed: {type(worker.error).__name__}: {worker.error}")
        choices = []
        for i, job in enumerate(jobs):
            for r, reply in enumerate(job.completion.replies):
                choice = {"index": i * job.request.n + r, "finish_reason": reply.finish_reason}
                text = reply.text if reply.text is not None else model.detokenize(reply.tokens)
                if parsed.kind == "chat":
                    choice["message"] = {"role": "assistant", "content": text}
                else:
                    choice["text"] = text
                    if parsed.return_token_ids:
                        choice["prompt_token_ids"] = list(job.request.prompt)
                choice["logprobs"] = logprobs(parsed, reply.tokens, reply.logp, reply.logq, reply.log_mass,
                                              reply.top) if parsed.logprobs else None
                if parsed.return_token_ids:
                    choice["token_ids"] = list(reply.tokens)
                choices.append(choice)
        out = {"id": rid, "object": "chat.completion" if parsed.kind == "chat" else "text_completion",
               "created": made, "model": model.name, "choices": choices,
               "usage": protocol.usage(parsed, [j.completion for j in jobs])}
        if parsed.return_token_ids and parsed.kind == "chat":
            out["prompt_token_ids"] = list(jobs[0].request.prompt)
        return out

    def logprobs(parsed, tokens, logp, logq, mass, top):
        return protocol.logprob_entries(parsed, model.token_text, tokens, logp, logq, mass, top)

    async def stream(parsed, jobs, updates, rid, made):
        chat = parsed.kind == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"
        hold = max((len(s) for s in parsed.stop), default=1) - 1  # a stop string's prefix may still complete
        sent: dict = {}
        left, complete = len(jobs), False

        def chunk(choices, **extra):
            return "data: " + json.dumps({"id": rid, "object": obj, "created": made, "model": model.name,
                                          "choices": choices, **extra}) + "\n\n"
        try:
            if chat:
                first = [{"index": i * j.request.n + r, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None}
                         for i, j in enumerate(jobs) for r in range(j.request.n)]
                yield chunk(first, **({"prompt_token_ids": list(jobs[0].request.prompt)}
                                      if parsed.return_token_ids else {}))
            while left:
                job, update = await updates.get()
                if update is None:
                    left -= 1
                    continue
                i = jobs.index(job)
                index = i * job.request.n + update.reply
                full = update.text if update.text is not None else ""
                done = update.finish_reason is not None
                start = sent.get(index, 0)
                end = len(full) if done else max(len(full) - hold - full.endswith("\ufffd"), start)
                sent[index] = end
                choice = {"index": index, "finish_reason": update.finish_reason,
                          "logprobs": logprobs(parsed, update.tokens, update.logp, update.logq, update.mass,
                                               update.top) if parsed.logprobs else None}
                if chat:
                    choice["delta"] = {"content": full[start:end]} if end > start or not done else {}
                else:
                    choice["text"] = full[start:end]
                if parsed.return_token_ids:
                    choice["token_ids"] = list(update.tokens)
                    if not chat and update.start == 0:
                        choice["prompt_token_ids"] = list(job.request.prompt)
                yield chunk([choice])
            if parsed.include_usage:
                yield chunk([], usage=protocol.usage(parsed, [j.completion for j in jobs]))
            yield "data: [DONE]\n\n"
            complete = True
        finally:
            if not complete:  # the client went away (or the server is stopping): free its rows and pages
                for job in jobs:
                    worker.abort(job)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await answer(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(request, "completion")

    return app


def bound_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` (0: a free port), or a one-line refusal naming them."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {err.strerror}") from None
    return sock


def serve(model: Model, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          max_queue: int = 256, grace: float = 30.0, log=print) -> int:
    """Serve ``model`` until SIGTERM or Ctrl-C; prints the URL once the socket listens. Returns 0."""
    import uvicorn

    sock = bound_socket(host, port)
    family = sock.family
    sock.listen(2048)
    bound = sock.getsockname()[1]
    app = build_app(model, api_key=api_key, max_queue=max_queue)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=grace, access_log=False,
                            lifespan="on")
    server = uvicorn.Server(config)
    # uvicorn re-raises the signal that stopped it to the handler it found: a quiet one, so the process exits 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    shown = f"[{host}]" if family == socket.AF_INET6 else host
    started = time.perf_counter()

    async def main():
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.02)
        if server.started:
            log(f"serving {model.name} at http://{shown}:{bound}/v1 (ready in {time.perf_counter() - started:.1f} s;"
                " SIGTERM or Ctrl-C stops)", flush=True)
        await task

    asyncio.run(main())
    return 0


def servable(run_dir, step: int | None = None):
    """The run and checkpoint step ``open_model`` would serve, or a one-line refusal (nothing loaded)."""
    run = as_run(run_dir)
    run.require_language_model("serve")
    if run.tcfg.objective != "ar":
        raise ConfigError(f"{run.path} was trained with objective {run.tcfg.objective!r}: the server decodes "
                          "next-token (ar) runs")
    return run, checkpoint_step(run, step)


def open_model(run_dir, *, step: int | None = None, name: str | None = None, max_seqs: int = 16,
               max_len: int | None = None, page_size: int = 16, pages: int | None = None, token_budget: int = 512,
               max_top_logprobs: int = protocol.MAX_TOP_LOGPROBS, warm_up: bool = True, kernels=None,
               log=print) -> Model:
    """A run's checkpoint on an engine with these capacity settings, ready to ``serve``; with ``warm_up`` every
    program the engine can run is compiled first (no request waits for a compile). A run that records no chat
    template (a pretraining run) is served for completions only, said in one line through ``log``."""
    run, ckpt = servable(run_dir, step)
    tok = tok_lib.load(run.path)
    template = template_for(tok, run_template(run.record)) if tok.chat_template is not None or run.record.template \
        else None
    if template is None:
        log(f"chat is not served: {run.path} records no chat template (a pretraining run); /v1/completions is")
    engine = Engine(load_params(run, ckpt), run.cfg, max_seqs=max_seqs, max_len=max_len, page_size=page_size,
                    pages=pages, token_budget=token_budget, max_top_logprobs=max_top_logprobs, kernels=kernels)
    model = Model(engine, tok, template, name=name or run.path.name, root=str(run.path))
    engine.detokenize = model.detokenize
    if warm_up:
        start = time.perf_counter()
        log(f"compiling the engine's {len(engine.shapes())} call shapes (--no-warm-up skips this)", flush=True)
        engine.warm_up()
        log(f"compiled in {time.perf_counter() - start:.0f} s", flush=True)
    return model
