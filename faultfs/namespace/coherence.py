"""Coherence of the kernel's caches across the names of a tag's bytes: which pages of the other
names a write drops, and how long it waits for that.

A tag shows the same bytes under several names (``chunk_N``, the view, ``page:N``, user blobs
under a pagemap) and the kernel caches each name's pages apart. A write through one name is
answered only after the other names' pages of the bytes it wrote were dropped, so a read or a
shared ``mmap`` of any name then sees the new bytes. When another name of those bytes is open
for writing (a shared writable ``mmap`` of it may hold dirty pages), its pages are dropped
*before* the write as well: the kernel writes a dirty page back before it drops it, so the
older bytes of that mapping land before this write, not over it afterwards.

Why the waits are shaped so (fs/fuse): dropping a range of a name's pages locks each page in
turn, waits for its writeback, and writes back a dirty one (one more WRITE to answer). While
the kernel waits for the answer to a WRITE it holds locked the page it could not fill whole
(a partial page it has not read), and a page being written back stays busy until its WRITE is
answered. So dropping pages of a name that another write is writing at that moment can wait on
that write, which may be waiting the same way on this one — two writers through two names of
one page, or a dirty page of a shared mapping written back while another name of it is written.
Waiting for that without end was the mount-wide deadlock this module exists to prevent.
- Pages that another write in flight through the same name may hold are dropped one by one and
  waited for at most ``HELD_WAIT_S``: a page a WRITE holds locked is one the kernel has not
  read (it reads it again once unlocked), so it shows no old bytes; the drop goes on in the
  background and lands when the page is let go. Every other page is waited for — a lock on
  it is a READ's, answered without waiting for this write — at most ``WAIT_S``, then counted
  and logged: nothing ever wedges on a drop.
- Drops run on threads of their own (``THREADS`` at once), never on the serving thread, so the
  requests the locked pages wait for are answered meanwhile.
- What remains (docs/decisions.md, "Coherence across names"): writes through two names *into
  the same 4 KiB page at the same moment*, or stores into a shared writable mapping of one name
  made while another name's write of the same page is under way, may leave one name showing
  the page without the other's bytes until that page is dropped again; writes of disjoint
  pages, and every sequence of writes that do not overlap in time, are exact.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import trio

from faultfs.stats import Stats

log = logging.getLogger("faultfs.fuse")

PAGE = 4096  # the kernel's page: what it caches, locks and writes back
WAIT_S = 10.0  # a drop the write waits for; past it the write is answered (counted, logged)
HELD_WAIT_S = 0.25  # a drop of pages another write of that name holds (they show no old bytes)
THREADS = 32  # drops under way at once (a drop stuck on a page holds one until it is let go)
SPLIT_MAX = 64  # held pages dropped one by one at most; past it, as one range

Drop = Callable[[int, int, int], None]  # (inode, offset, length): blocking; length 0 = to the end
Range = tuple[int, int, int]  # (inode, offset, length)


@dataclass(slots=True, eq=False)
class InFlight:
    """One write being answered through ``inode``: the bytes ``[lo, hi)`` it writes."""

    inode: int
    lo: int
    hi: int


class Coherence:
    """The drops writes make of other names' pages, and the writes in flight that shape them."""

    def __init__(self, drop: Drop | None, stats: Stats) -> None:
        self.drop = drop
        self.stats = stats
        self.flying: dict[int, list[InFlight]] = {}  # inode -> its writes being answered
        # every drop asked for runs, also one no write waits for any more
        self._threads = ThreadPoolExecutor(THREADS, thread_name_prefix="faultfs-drop")

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)

    def begin(self, inode: int, off: int, size: int) -> InFlight:
        """A write through ``inode`` starts (its pages may be held until it is answered)."""
        flight = InFlight(inode, off, off + size)
        self.flying.setdefault(inode, []).append(flight)
        return flight

    def end(self, flight: InFlight) -> None:
        flights = self.flying[flight.inode]
        flights.remove(flight)
        if not flights:
            del self.flying[flight.inode]

    async def drop_ranges(self, ranges: list[Range]) -> None:
        """Drop the kernel's pages of every range (dirty ones written back first), waiting as
        the module docstring says."""
        if self.drop is None or not ranges:
            return
        plan = [step for r in ranges for step in self._plan(r)]
        self.stats.add("coherence_drops", len(plan))
        if len(plan) == 1:
            await self._drop_one(*plan[0])
            return
        async with trio.open_nursery() as nursery:
            for step in plan:
                nursery.start_soon(self._drop_one, *step)

    def _plan(self, r: Range) -> list[tuple[int, int, int, float]]:
        """``r`` cut into (inode, offset, length, wait): the pages other writes in flight
        through that name hold, one by one with the short wait, the rest with the long."""
        inode, off, size = r
        flights = self.flying.get(inode)
        if not flights or size <= 0:
            return [(inode, off, size, WAIT_S)]
        first, last = off // PAGE, (off + size - 1) // PAGE
        held: set[int] = set()
        for f in flights:
            lo, hi = max(first, f.lo // PAGE), min(last, (f.hi - 1) // PAGE)
            held.update(range(lo, hi + 1))
            if len(held) > SPLIT_MAX:
                return [(inode, off, size, HELD_WAIT_S)]
        if not held:
            return [(inode, off, size, WAIT_S)]
        steps: list[tuple[int, int, int, float]] = []
        run = -1  # first page of the run of pages no write holds, or -1
        for page in range(first, last + 2):
            if page <= last and page not in held:
                if run < 0:
                    run = page
                continue
            if run >= 0:
                lo, hi = max(off, run * PAGE), min(off + size, page * PAGE)
                steps.append((inode, lo, hi - lo, WAIT_S))
                run = -1
            if page <= last:
                lo, hi = max(off, page * PAGE), min(off + size, (page + 1) * PAGE)
                steps.append((inode, lo, hi - lo, HELD_WAIT_S))
        return steps

    async def _drop_one(self, inode: int, off: int, size: int, wait: float) -> None:
        assert self.drop is not None
        done = trio.Event()
        token = trio.lowlevel.current_trio_token()

        def finished(_: Future) -> None:
            try:
                token.run_sync_soon(done.set)
            except trio.RunFinishedError:
                pass  # unmounted meanwhile: nobody waits

        self._threads.submit(self.drop, inode, off, size).add_done_callback(finished)
        with trio.move_on_after(wait) as scope:
            await done.wait()
        if scope.cancelled_caught:
            if wait >= WAIT_S:
                self.stats.add("coherence_waits_cut")
                log.warning("dropping the cached pages of inode %#x [%d, +%d) took over %.0f s: "
                            "the write is answered, the drop goes on", inode, off, size, wait)
            else:
                self.stats.add("coherence_held_pages")
