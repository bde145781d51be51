"""Taking a queued FUSE request without a trip through trio's I/O wait.

pyfuse3's worker loop awaits ``pyfuse3._wait_fuse_readable()`` before each blocking
``fuse_session_receive_buf``: a ``trio.Lock`` and ``trio.lowlevel.wait_readable`` on the
session's ``/dev/fuse`` descriptor, at least two passes of trio's scheduler (and an epoll)
per request even when the kernel already has the next one queued. With several readers the
queue is rarely empty, and those passes were a third of the daemon's CPU per request.

``FastWait`` answers "is a request queued?" with a zero-timeout ``poll`` first: when the
descriptor reports exactly ``POLLIN``, the worker goes straight on to receive it. Nothing runs
between that check and the receive (both happen without an ``await`` in between), so the
receive cannot block the serving thread. Otherwise (nothing queued, an error or a hang-up,
or ``FAST_STREAK`` fast answers in a row, so trio's other tasks still get their turn) it waits
the stock way, and re-checks the descriptor after that wait returns: a worker on the fast path
may have taken the request that woke it, and then it waits again.

The hook is pyfuse3's module global, looked up on each request; it is replaced only while
``pyfuse3.main`` runs, only where it exists as a coroutine function, and only when this
``pyfuse3.init`` opened exactly one new ``/dev/fuse`` descriptor (``session_fd``): polling
any other would tell nothing about the session's queue. Anything else, or
``FAULTFS_FUSE_FASTWAIT=0``, serves through pyfuse3's own wait.
"""

from __future__ import annotations

import inspect
import logging
import select
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

from faultfs.stats import Stats
from faultfs.tiers.uring import fuse_device_fds

log = logging.getLogger("faultfs.mount")

HOOK = "_wait_fuse_readable"
FAST_STREAK = 8  # fast answers in a row before one stock wait lets trio run its other tasks


class FastWait:
    """The replacement wait over one session descriptor. It counts, in ``stats``, requests
    taken without waiting (``fuse_fast_waits``), stock waits (``fuse_waits``) and stock waits
    whose request a fast worker took first (``fuse_waits_lost``)."""

    def __init__(self, fd: int, original: Callable[[], Awaitable[bool]], stats: Stats,
                 streak: int = FAST_STREAK) -> None:
        self._fd = fd
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)
        self._original = original
        self._counters = stats.counters
        self._most = streak
        self._streak = 0

    def queued(self) -> bool:
        """True when a request is queued and nothing else is pending on the descriptor."""
        return self._poll.poll(0) == [(self._fd, select.POLLIN)]

    async def wait(self) -> bool:
        """pyfuse3's contract: True when a request can be received, False to stop."""
        if self._streak < self._most and self.queued():
            self._streak += 1
            self._counters["fuse_fast_waits"] += 1
            return True
        self._streak = 0
        while True:
            self._counters["fuse_waits"] += 1
            if not await self._original():
                return False
            if self._poll.poll(0):  # still there (or an error the receive will report)
                return True
            self._counters["fuse_waits_lost"] += 1


def session_fd(before: list[int]) -> int | None:
    """The descriptor ``pyfuse3.init`` opened: the one ``/dev/fuse`` descriptor not in
    ``before`` (taken just before it), else None."""
    new = sorted(set(fuse_device_fds()) - set(before))
    return new[0] if len(new) == 1 else None


@contextmanager
def installed(module: Any, fd: int | None, stats: Stats,
              enabled: bool = True) -> Iterator[FastWait | None]:
    """Serve ``module`` (pyfuse3) through a FastWait over ``fd`` inside the block."""
    original = getattr(module, HOOK, None)
    if not enabled or fd is None or not inspect.iscoroutinefunction(original):
        if enabled:
            log.debug("serving through pyfuse3's own wait (%s)",
                      "no single session descriptor" if fd is None
                      else f"no coroutine {HOOK} in this pyfuse3")
        yield None
        return
    fast = FastWait(fd, original, stats)
    setattr(module, HOOK, fast.wait)
    try:
        yield fast
    finally:
        setattr(module, HOOK, original)
