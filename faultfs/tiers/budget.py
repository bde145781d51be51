"""The data budget: what the daemon holds for file data, against ``--memory-mb``.

Counted: blobs in the memory tier (which includes every blob waiting for its store write:
those are pinned there, since dropping them would free nothing), the bytes of source reads
in flight (a run's buffer is allocated whole before its first byte lands; a run received
blob by blob, each into a buffer of its own, holds one blob), and blobs waiting
to be published to the shared store. The memory tier is what gives way: it drops its least
recently used unpinned blobs until it fits in what the others leave (``MemoryTier.shrink``).

Invariants:
- Only the trio thread changes it (``take`` when a source read starts, ``give`` as each blob
  of it is handed on (a run received blob by blob: as it ends) or the read fails; pins come
  and go with store writes).
- A source read a reader waits for is admitted (``admit``) only when its bytes fit beside
  what cannot be dropped (reads in flight, pinned blobs, publishes); otherwise it waits until
  something lands, is stored or is published (each calls ``wake``) — all of which happens
  without it, so it never deadlocks; it also looks again every ``RECHECK_S``, so that a
  holder that frees room without a ``wake`` costs a reader that long, never a hang (a
  publish that ended woke nobody once: readers waited forever behind a burst of them). A
  read larger than the whole budget is admitted when nothing else is held; a budget of 0
  (``--memory-mb 0``: no memory tier) holds no read back.
- Prefetches start only when they fit and no reader waits for room (``fits``): a reader is
  never kept waiting behind a prefetch for memory.
- The other holders bound themselves within it: the prefetch window at half, the store
  writes waiting at a quarter, the publishes waiting at a quarter; the recycled free read
  buffers (not data) at a quarter of it beside.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

# shares of the budget each holder bounds itself to (the memory tier takes what is left)
PREFETCH_SHARE = 2  # 1/2: the prefetch window's source reads in flight
STORE_SHARE = 4  # 1/4: blobs waiting for their store write (pinned in the memory tier)
PUBLISH_SHARE = 4  # 1/4: blobs waiting to be published to the shared store
FREE_BUFFERS_SHARE = 4  # 1/4: recycled read buffers kept mapped (buffers.POOL), not data
RECHECK_S = 1.0  # a read waiting for room looks again this often, woken or not


class DataBudget:
    """Bytes held for data; the memory tier makes room, readers' reads wait for it."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0  # bytes of source reads started and not yet handed on
        self.peak = 0  # the most held at once, for ``faultfs stat``
        self.waits = 0  # reads that waited for room (counted for ``faultfs stat``)
        self._others: list[Callable[[], int]] = []
        self._tier: Callable[[], int] = lambda: 0  # bytes in the memory tier
        self._pinned: Callable[[], int] = lambda: 0  # of them, those that cannot be dropped
        self._shrink: Callable[[], None] = lambda: None  # the tier makes room
        self._waiters: list[trio.Event] = []

    def bind(self, tier_bytes: Callable[[], int], pinned: Callable[[], int],
             shrink: Callable[[], None]) -> None:
        self._tier, self._pinned, self._shrink = tier_bytes, pinned, shrink

    def count(self, held: Callable[[], int]) -> None:
        """Count what ``held()`` says is held (e.g. publishes waiting) against the budget."""
        self._others.append(held)

    def outside(self) -> int:
        """Bytes held for data outside the memory tier."""
        return self.in_flight + sum(held() for held in self._others)

    def fixed(self) -> int:
        """Bytes that cannot be dropped to make room: outside the tier, and pinned in it."""
        return self.outside() + self._pinned()

    def fits(self, n: int) -> bool:
        """Whether a prefetch of ``n`` bytes may start now."""
        return not self._waiters and self.fixed() + n <= self.limit

    async def admit(self, n: int) -> None:
        """Wait until a read a reader waits for, of ``n`` bytes, fits. A budget of 0 (no
        memory tier: ``--memory-mb 0``) holds no read back."""
        while self.limit and self.fixed() + n > self.limit and self.fixed() > 0:
            event = trio.Event()
            self._waiters.append(event)
            self.waits += 1
            try:
                with trio.move_on_after(RECHECK_S):
                    await event.wait()
            finally:
                if event in self._waiters:
                    self._waiters.remove(event)

    def take(self, n: int) -> None:
        self.in_flight += n
        self._shrink()  # notes the peak

    def give(self, n: int) -> None:
        self.in_flight -= n
        self.wake()

    def wake(self) -> None:
        """Something landed, was stored or was published: the waiting reads look again."""
        waiters, self._waiters = self._waiters, []
        for event in waiters:
            event.set()

    def note(self) -> None:
        self.peak = max(self.peak, self._tier() + self.outside())

    def share(self, part: int) -> int:
        """``limit / part``: what a holder bounds itself to."""
        return self.limit // part
