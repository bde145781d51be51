"""A chunk's fault in flight in one process, and the source read that fills it (DESIGN §5,
§18): the thread-side counterpart of the mount's ``engine/flights.py`` and split faults
(``engine/faults.py``), without trio. A reader waits for *its* bytes of the chunk, not for
the whole chunk: it is answered once they have landed, while the rest is still on the wire;
a reader far into a cold chunk has the chunk read in two parts at once, from its offset and
up to it, so it waits for one round trip and its own bytes.

Invariants:
- Bytes shown (``Landing.show``) are source bytes of the pinned version exactly as they will
  be in the blob (the source checks its pin before any body byte is handed on, and a retry
  asks only for what did not land yet); once shown they stay valid, even when the fault
  fails later.
- A landing ends once, with the chunk's whole bytes or an error (``finish``, ``fail``);
  every reader waiting is woken then. A reader whose bytes never landed gets the error:
  never zeros, and never a wait that outlasts the source's own bounded tries.
- A split read's two parts read disjoint ranges of one buffer; the buffer is returned only
  once both have ended (a failed part's error raised after the other ended too), so no
  part writes into bytes someone else holds.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable

from faultfs.buffers import alloc
from faultfs.errors import SourceError
from faultfs.sources import Source

# A reader's fault is split at its offset when the bytes before it would take longer to land
# than a second request costs (at 100 MB/s per connection, 256 KiB is 2.6 ms; a request costs
# ~0.4 ms of CPU and runs beside the other): the mount's rule (engine/faults.py)
SPLIT_MIN = 256 << 10
SPLIT_ALIGN = 64 << 10
SPLIT_LANE = 8  # second parts of split faults at once, per process ...
SPLIT_LANE_BUSY = 4  # ... and a fault is split only while fewer than this run
PIECE = 256 << 10  # a streaming read tells its progress this often (its first piece: 128 KiB)

Show = Callable[[int, memoryview], None]


def split_at(at: int, length: int) -> int:
    """Where a fault of a chunk of ``length`` bytes whose reader starts at ``at`` is split in
    two (0: it is not): far enough in that the reader would wait for more than
    ``SPLIT_MIN`` bytes before its own, aligned down, inside the chunk."""
    at -= at % SPLIT_ALIGN
    return at if SPLIT_MIN <= at < length else 0


class Landing:
    """One chunk's fault in flight: readers wait for a range of it (``range``)."""

    __slots__ = ("_cond", "_data", "_error", "_parts")

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._parts: dict[int, memoryview] = {}  # where a part starts: its bytes in so far
        self._data: bytes | memoryview | None = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._data is not None or self._error is not None

    def show(self, at: int, head: memoryview) -> None:
        """Bytes ``[at, at + len(head))`` of the chunk are in: wake the readers they serve."""
        with self._cond:
            if self.done():
                return
            old = self._parts.get(at)
            if old is None or len(head) > len(old):
                self._parts[at] = head
                self._cond.notify_all()

    def finish(self, data: bytes | memoryview) -> None:
        """The whole chunk is in."""
        with self._cond:
            if not self.done():
                self._data = data
                self._parts = {}
                self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """The fault failed: readers of bytes that did not land get ``error``."""
        with self._cond:
            if not self.done():
                self._error = error
                self._cond.notify_all()

    def range(self, off: int, end: int) -> tuple[bytes | memoryview, bool]:
        """Bytes ``[off, end)`` of the chunk once they are in, and whether they came before
        the whole chunk; the fault's error if it ended without them."""
        with self._cond:
            while True:
                if self._data is not None:
                    return memoryview(self._data)[off:end], False
                for at, part in self._parts.items():
                    if at <= off and end <= at + len(part):
                        return part[off - at:end - at], True
                if self._error is not None:
                    raise self._error
                self._cond.wait()


class SplitLane:
    """The threads that read the second parts of split faults (beside the pool, which may be
    full of the faults that wait for them), and how many do so now."""

    def __init__(self, threads: int = SPLIT_LANE) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(threads,
                                                           thread_name_prefix="faultfs-split")
        self._busy = 0
        self._lock = threading.Lock()

    def take(self) -> bool:
        """A place for one more second part, if the lane is quiet enough."""
        with self._lock:
            if self._busy >= SPLIT_LANE_BUSY:
                return False
            self._busy += 1
            return True

    def run(self, fn: Callable[[], None]) -> concurrent.futures.Future[None]:
        """``fn`` on the lane (after ``take``); its place is given back when it ends."""
        def part() -> None:
            try:
                fn()
            finally:
                with self._lock:
                    self._busy -= 1

        return self._pool.submit(part)


def read_chunk(source: Source, start: int, length: int, show: Show, *, at: int = 0,
               lane: SplitLane | None = None) -> tuple[bytes | memoryview, bool]:
    """Source bytes ``[start, start + length)`` (fewer at the source's end), each part told
    to ``show(where in the chunk, its bytes in so far)`` as it lands; and whether the read
    was split. With ``at`` (see ``split_at``) and a place on ``lane``, it is, in two parts
    read at once: ``[at, length)`` here, ``[0, at)`` on the lane."""
    stream = getattr(source, "pread_stream", None)
    if stream is None:  # a source that reads whole ranges only (a local file): one piece
        data = source.pread(start, length)
        show(0, memoryview(data))
        return data, False
    buf = alloc(length)
    if not at or lane is None or not lane.take():
        return stream(start, length, lambda got: show(0, got), PIECE, into=buf), False
    head = lane.run(lambda: _fill(stream, start, buf[:at], lambda got: show(0, got)))
    try:
        _fill(stream, start + at, buf[at:], lambda got: show(at, got))
    finally:
        failed = head.exception()  # waits: the buffer is ours again only once both ended
    if failed is not None:
        raise failed
    return buf, True


def _fill(stream: Callable[..., memoryview], start: int, into: memoryview,
          tell: Callable[[memoryview], None]) -> None:
    got = stream(start, len(into), tell, PIECE, into=into)
    if len(got) != len(into):  # the caller checks a whole read's length; a part's, here
        raise SourceError(f"a source returned {len(got)} bytes of [{start}, "
                          f"{start + len(into)}): it changed or was cut short")
