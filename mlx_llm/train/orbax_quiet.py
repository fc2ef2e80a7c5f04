"""What a failed orbax write leaves behind, settled without a sound, so the failure reaches the caller as one error.

orbax writes a checkpoint's files from a background thread running an asyncio event loop of its own. When one
write fails (a full disk), the loop stops at that first error and orbax closes it with the other writes still in
flight (it closes its loops without cancelling their tasks). Each of those tensorstore writes then completes into
a closed loop: its callback raises ``RuntimeError: Event loop is closed``, reported through ``sys.unraisablehook``
as a bare traceback; the futures nobody awaited log "exception was never retrieved" on the ``asyncio`` logger when
they are collected; and orbax's own threads re-raise the error from ``join``. A full disk printed 25–32 such
tracebacks around the one-line message. While a ``Checkpoints`` is open (``Quiet``), orbax's error logs and the
closed-loop reports are dropped, and after a failed save ``settle`` waits for all of it, the asyncio loggers
dropped too, and the errors left in orbax's closed loops are retrieved: the failures they describe reach the
caller as exceptions.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import sys
import threading
import time

import tensorstore as ts

ASYNC_LOGGERS = ("asyncio", "concurrent.futures")  # where abandoned futures report, when collected
CLOSED_LOOP = "Event loop is closed"
WAIT_SECONDS = 30.0  # for orbax's threads and the writes still in flight


class Quiet:
    """From construction to ``close``: orbax's error logs (absl records from orbax's files: tracebacks from its
    threads) and the reports of writes completing into a closed loop are dropped; every other log record and
    unraisable exception is reported as before. Installed by a ``Checkpoints`` for its lifetime; when one is
    already installed (another ``Checkpoints`` is open), the hook is left to it, so hooks never pile up."""

    def __init__(self):
        self._previous = sys.unraisablehook
        self._installed = not getattr(self._previous, "drops_closed_loops", False)
        if self._installed:
            sys.unraisablehook = self._hook = _closed_loops_dropped(self._previous)
        self._filter = lambda record: not_orbax_error(record)  # this object's own: another's stays at ``close``
        logging.getLogger("absl").addFilter(self._filter)

    def close(self) -> None:
        if self._installed and sys.unraisablehook is self._hook:  # else a later hook wraps it: it stays
            sys.unraisablehook = self._previous
        logging.getLogger("absl").removeFilter(self._filter)


def _closed_loops_dropped(previous):
    """An unraisable hook passing every report to ``previous`` except asyncio's "Event loop is closed"."""

    def hook(unraisable) -> None:
        if not closed_loop(unraisable.exc_value):
            previous(unraisable)

    hook.drops_closed_loops = True
    return hook


def closed_loop(exc: BaseException | None) -> bool:
    """``exc`` is asyncio's "Event loop is closed", raised where a finished write schedules its callback."""
    return isinstance(exc, RuntimeError) and str(exc) == CLOSED_LOOP


def settle(manager) -> None:
    """Wait until orbax's background writes after a failed save have ended: its threads, and the tensorstore
    writes its closed loop abandoned (they would recreate what is removed, or report later), their reports
    dropped meanwhile; then retrieve the errors of the futures left in closed loops, which nobody can await any
    more and which would each log a traceback when collected (at exit)."""
    with _dropped_reports():
        with contextlib.suppress(Exception):
            manager.wait_until_finished()
        for thread in [t for t in threading.enumerate() if t is not threading.current_thread()
                       and type(t).__module__.startswith("orbax.")]:
            with contextlib.suppress(Exception):  # orbax's threads re-raise their error from join
                thread.join(timeout=WAIT_SECONDS)
        _wait_for_tensorstore()
        _retrieve_abandoned()


def _wait_for_tensorstore() -> None:
    """Block until every tensorstore operation still pending in this process has completed (with its error)."""
    deadline = time.monotonic() + WAIT_SECONDS
    for future in [o for o in gc.get_objects() if isinstance(o, ts.Future)]:
        with contextlib.suppress(Exception):
            future.exception(timeout=max(0.0, deadline - time.monotonic()))


def _retrieve_abandoned() -> None:
    """Mark the errors of the finished futures of closed event loops as retrieved (``Future.exception``)."""
    for future in [o for o in gc.get_objects() if isinstance(o, asyncio.Future)]:
        with contextlib.suppress(Exception):
            if future.done() and not future.cancelled() and future.get_loop().is_closed():
                future.exception()


@contextlib.contextmanager
def _dropped_reports():
    """Within: the asyncio loggers' records (futures of the failed save that nobody awaited, reported when
    collected) and the closed-loop reports are dropped."""
    loggers = [logging.getLogger(name) for name in ASYNC_LOGGERS]
    for logger in loggers:
        logger.addFilter(_drop)
    quiet = Quiet()
    try:
        yield
    finally:
        quiet.close()
        for logger in loggers:
            logger.removeFilter(_drop)


def _drop(record: logging.LogRecord) -> bool:
    return False


def not_orbax_error(record: logging.LogRecord) -> bool:
    """A ``logging`` filter dropping orbax's error logs (they carry tracebacks from its threads)."""
    return record.levelno < logging.ERROR or f"{os.sep}orbax{os.sep}" not in record.pathname
