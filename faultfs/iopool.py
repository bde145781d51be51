"""The I/O pool: blocking calls (source reads, store reads and writes, large hashes) run on
worker threads under one ``trio.CapacityLimiter``, never on the trio thread.

The limiter is made on first use, inside the trio run that uses it (a limiter belongs to
one run; a remount in tests starts a new one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import trio

T = TypeVar("T")


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
        return await trio.to_thread.run_sync(fn, *args, limiter=self.limiter)
