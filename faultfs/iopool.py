"""The I/O pool: blocking calls (source reads, store reads and writes, large hashes) run on
worker threads under one ``trio.CapacityLimiter``, never on the trio thread.

The limiter is made on first use, inside the trio run that uses it (a limiter belongs to
one run; a remount in tests starts a new one).

``run_in_thread`` is the hop itself: ``trio.to_thread.run_sync`` without what the engine does
not use — it names the worker thread twice per call (``pthread_setname_np`` through ctypes;
ours name each thread once, "faultfs io"),
copies the context and sets up ``trio.from_thread``; about a third of a hop's CPU on this
machine, paid on every source read and store write. Like ``to_thread`` without
``abandon_on_cancel``, a call cannot be cancelled while it runs (the task waits for it).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import trio

T = TypeVar("T")
THREAD_NAME = b"faultfs io"  # what ``top -H`` and /proc/PID/task/*/comm show for them
_PR_SET_NAME = 15
_named = threading.local()


def _libc_prctl() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_prctl = _libc_prctl()


def _in_named_thread(fn: Callable[..., T], args: tuple[Any, ...]) -> T:
    """``fn(*args)``; the first call in a worker thread names it (once, not per call)."""
    if not getattr(_named, "done", False):
        _named.done = True
        if _prctl is not None:
            _prctl(_PR_SET_NAME, ctypes.c_char_p(THREAD_NAME), 0, 0, 0)
    return fn(*args)


class IoPool:
    """``await pool.run(fn, *args)``: ``fn(*args)`` on a worker thread, at most ``threads``
    at once."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._limiter: trio.CapacityLimiter | None = None

    @property
    def limiter(self) -> trio.CapacityLimiter:
        if self._limiter is None:
            self._limiter = trio.CapacityLimiter(self.threads)
        return self._limiter

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await run_in_thread(self.limiter, fn, *args)


async def run_in_thread(limiter: trio.CapacityLimiter, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on one of trio's cached worker threads, holding a token of ``limiter``;
    its result or exception here. Not contextvars, not ``trio.from_thread`` inside ``fn``."""
    async with limiter:
        task = trio.lowlevel.current_task()
        token = trio.lowlevel.current_trio_token()

        def deliver(result: Any) -> None:  # on the worker thread, with fn's outcome
            token.run_sync_soon(trio.lowlevel.reschedule, task, result)

        trio.lowlevel.start_thread_soon(lambda: _in_named_thread(fn, args), deliver)
        return await trio.lowlevel.wait_task_rescheduled(  # type: ignore[no-any-return]
            lambda _: trio.lowlevel.Abort.FAILED)
