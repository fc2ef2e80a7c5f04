"""The engine on its own thread: requests come in from the server's event loop, replies go out to it.

The engine is single-threaded host code around jitted calls; the server is an asyncio loop. ``EngineWorker``
owns the engine on one thread: ``submit`` and ``abort`` put work on its inbox (any thread), and the thread steps
the engine while anything runs, handing each reply's new tokens to the job's asyncio queue
(``loop.call_soon_threadsafe``). A job's last update carries ``done``. ``drain`` waits for the running requests
to end; ``stop`` ends the thread (aborting what is left).
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
import time

from mlx_llm.decode.engine import Completion, Engine, Request


@dataclasses.dataclass
class Update:
    """New tokens of one reply (a slice from ``start``), with its text so far and finish reason."""

    reply: int
    start: int
    tokens: list
    logp: list
    logq: list
    mass: list
    top: list
    text: str | None
    finish_reason: str | None


@dataclasses.dataclass
class Job:
    """One engine request in flight: its completion (once the thread submitted it) and where updates go."""

    request: Request
    loop: asyncio.AbstractEventLoop
    updates: asyncio.Queue
    arrived: float = 0.0
    completion: Completion | None = None
    sent: list = dataclasses.field(default_factory=list)  # tokens handed out per reply
    done: bool = False


class EngineWorker:
    """The engine's thread (module docstring). ``stats`` for /metrics: counters and latency samples."""

    def __init__(self, engine: Engine, *, max_queue: int = 256, on_finish=None):
        self.engine, self.max_queue = engine, max_queue
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.jobs: dict[int, Job] = {}
        self.pending = 0  # submitted, not yet done (queued in the inbox or the engine, or running)
        self.on_finish = on_finish  # called on the thread with each finished Job (metrics)
        self.prompt_tokens = self.generated_tokens = 0
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="mlx-llm-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # ----- any thread -------------------------------------------------------------------------------------
    def submit(self, request: Request, loop: asyncio.AbstractEventLoop, updates: asyncio.Queue) -> Job | None:
        """Queue a checked request; its updates go to ``updates`` as (job, Update), then (job, None). None when
        ``max_queue`` requests are already waiting or running."""
        with self._lock:
            if self.pending >= self.max_queue:
                return None
            self.pending += 1
        job = Job(request, loop, updates, sent=[0] * request.n, arrived=time.perf_counter())
        self.inbox.put(("submit", job))
        self._wake.set()
        return job

    def abort(self, job: Job) -> None:
        """End a job now (its client went away): its rows and pages are freed on the thread."""
        self.inbox.put(("abort", job))
        self._wake.set()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ----- the thread -----------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop:
                self._take_inbox()
                if self.engine.waiting or self.engine.running:
                    self.engine.step()
                    self._publish()
                else:
                    self._wake.wait(0.05)
                    self._wake.clear()
        except BaseException as err:  # the engine failed: every job ends with the error
            self.error = err
        for job in list(self.jobs.values()):
            if job.completion is not None:
                self.engine.abort(job.completion)
            self._end(job)
        while not self.inbox.empty():
            kind, job = self.inbox.get()
            if kind == "submit":
                self._end(job)

    def _take_inbox(self) -> None:
        while not self.inbox.empty():
            kind, job = self.inbox.get()
            if kind == "submit":
                job.completion = self.engine.submit(job.request)
                self.jobs[job.completion.id] = job
                self.prompt_tokens += len(job.request.prompt)
            elif not job.done:
                if job.completion is not None:
                    self.engine.abort(job.completion)
                    self._publish_job(job)
                self._end(job)

    def _publish(self) -> None:
        for job in list(self.jobs.values()):
            self._publish_job(job)

    def _publish_job(self, job: Job) -> None:
        for r, reply in enumerate(job.completion.replies):
            k = job.sent[r]
            if k >= 0 and (len(reply.tokens) > k or reply.finish_reason is not None):
                update = Update(r, k, reply.tokens[k:], reply.logp[k:], reply.logq[k:], reply.log_mass[k:],
                                reply.top[k:], reply.text, reply.finish_reason)
                self.generated_tokens += len(update.tokens)
                job.sent[r] = len(reply.tokens) if reply.finish_reason is None else -1  # -1: finish sent
                job.loop.call_soon_threadsafe(job.updates.put_nowait, (job, update))
        if job.completion.done:
            self._end(job)

    def _end(self, job: Job) -> None:
        if job.done:
            return
        job.done = True
        if job.completion is not None:
            self.jobs.pop(job.completion.id, None)
        with self._lock:
            self.pending -= 1
        if self.on_finish is not None and job.completion is not None:
            self.on_finish(job, time.perf_counter())
        job.loop.call_soon_threadsafe(job.updates.put_nowait, (job, None))  # the end of the job's updates
