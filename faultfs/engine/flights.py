"""Single-flight: one in-progress fault (or store read-ahead) per blob, which later readers join.

Invariants:
- A blob has at most one flight; flights are claimed before any await, so no second reader or
  prefetch starts a second fault of the same blob.
- ``settle`` is the only way a flight ends: it records the outcome, wakes every waiter and
  removes the flight — on success, on failure and on cancellation alike.
- A read-ahead flight (``from_store``) that ends without data sends its readers down the
  normal path; it never carries an error to them.
- A fault of a streaming source may show the head of its blob before the blob is whole
  (``partial``: source bytes of the pinned version, exactly as they will be in the blob), and,
  when it was split at a reader's offset (``faults``), the head of its tail too (``tail``,
  from ``tail_at``); a reader waiting for a range (``wait_for``) is woken once the range is in
  one of them, or when the flight settles. Bytes once shown stay valid when the fault fails
  later. ``wait_end`` is the least end a reader waits for, read by the thread the bytes land
  on to decide whether to tell.
"""

from __future__ import annotations

from collections.abc import Iterable

import trio

from faultfs.tiers.base import BlobKey, Buffer

NOBODY = 1 << 62  # ``Flight.wait_end`` when no reader waits for a range


class Flight:
    """One in-progress fault (or read-ahead of a staged blob) that readers wait on."""

    __slots__ = ("_waiters", "data", "done", "error", "from_store", "partial", "read",
                 "tail", "tail_at", "wait_end")

    def __init__(self, from_store: bool = False) -> None:
        self.done = trio.Event()
        self.data: Buffer | None = None
        self.error: BaseException | None = None
        self.from_store = from_store  # a read-ahead of a staged blob, not a fault
        self.partial: memoryview | None = None  # the blob's first bytes, while it lands
        self.tail_at = NOBODY  # where a split fault's second part starts in the blob
        self.tail: memoryview | None = None  # that part's first bytes, while it lands
        self.wait_end = NOBODY  # least end of a range a reader waits for
        self.read = False  # a reader took bytes of it: memory keeps it as read, not ahead
        self._waiters: list[tuple[int, int, trio.Event]] = []

    def landed(self, off: int, end: int) -> memoryview | None:
        """Bytes ``[off, end)`` of the blob if they are in ``partial`` or ``tail``."""
        if self.partial is not None and end <= len(self.partial):
            return self.partial[off:end]
        if self.tail is not None and self.tail_at <= off and end <= self.tail_at + len(self.tail):
            return self.tail[off - self.tail_at:end - self.tail_at]
        return None

    async def wait_for(self, end: int, off: int = 0) -> None:
        """Until bytes ``[off, end)`` of the blob are in ``partial`` or ``tail``, or the
        flight is done."""
        if self.done.is_set() or self.landed(off, end) is not None:
            return
        event = trio.Event()
        self._waiters.append((off, end, event))
        self.wait_end = min(self.wait_end, end)
        try:
            await event.wait()
        finally:
            if not event.is_set():  # cancelled: no longer waiting
                self._waiters.remove((off, end, event))
                self._set_wait_end()

    def show(self, head: memoryview) -> None:
        """The blob's first ``len(head)`` bytes are in: wake the readers they serve."""
        if self.done.is_set() or (self.partial is not None and len(head) <= len(self.partial)):
            return
        self.partial = head
        self._wake()

    def show_tail(self, at: int, head: memoryview) -> None:
        """Bytes ``[at, at + len(head))`` of the blob are in (the part of a split fault that
        starts at ``at``): wake the readers they serve."""
        if self.done.is_set() or (self.tail is not None and len(head) <= len(self.tail)):
            return
        self.tail_at, self.tail = at, head
        self._wake()

    def _wake(self) -> None:
        keep = []
        for off, end, event in self._waiters:
            if self.landed(off, end) is not None:
                event.set()
            else:
                keep.append((off, end, event))
        self._waiters = keep
        self._set_wait_end()

    def _set_wait_end(self) -> None:
        self.wait_end = min((end for _, end, _ in self._waiters), default=NOBODY)

    def _finish(self) -> None:
        self.done.set()  # ``partial`` stays: its readers may not have run yet
        for _, _, event in self._waiters:
            event.set()
        self._waiters = []
        self.wait_end = NOBODY


class Flights:
    def __init__(self) -> None:
        self._flights: dict[BlobKey, Flight] = {}

    def __contains__(self, key: BlobKey) -> bool:
        return key in self._flights

    def of_tag(self, tag_id: int) -> bool:
        """Whether a flight of a blob of tag ``tag_id`` is under way."""
        return any(key[0] == tag_id for key in self._flights)

    def __len__(self) -> int:
        return len(self._flights)

    def get(self, key: BlobKey) -> Flight | None:
        return self._flights.get(key)

    def claim(self, keys: Iterable[BlobKey], *, from_store: bool = False) -> list[Flight]:
        """Register flights for ``keys`` now, before any await."""
        flights = []
        for key in keys:
            assert key not in self._flights, f"blob {key} claimed twice"
            flight = self._flights[key] = Flight(from_store)
            flights.append(flight)
        return flights

    def settle(self, keys: Iterable[BlobKey], flights: Iterable[Flight]) -> None:
        """End the flights (their data or error already set): wake readers, forget them."""
        for key, flight in zip(keys, flights, strict=True):
            flight._finish()
            if self._flights.get(key) is flight:
                del self._flights[key]

    async def read_ahead(self, key: BlobKey) -> Buffer | None:
        """Wait for a read-ahead of ``key`` if one is in flight; its data, or None (no
        read-ahead, or it ended without data: take the normal path)."""
        flight = self._flights.get(key)
        while flight is not None and flight.from_store:
            await flight.done.wait()
            if flight.data is not None:
                return flight.data
            flight = self._flights.get(key)
        return None
