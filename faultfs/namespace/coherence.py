"""Coherence of the kernel's caches across the names of a tag's bytes: what a change through one
name drops of the other names' cached pages, what a write through another name may not write
over meanwhile, and how long a change waits.

A tag shows the same bytes under several names (``chunk_N``, the view, ``page:N``, user blobs
under a pagemap) and the kernel caches each name's pages apart: nothing in FUSE lets two
inodes share a page cache. A change through one name (``change``) is therefore made so:
1. it is made (a tag's changes of aliased bytes one at a time), and from then on its bytes
   are *claimed* in the other names' ranges;
2. those ranges' cached pages are dropped (a dirty one, of a shared writable ``mmap``, is
   written back by the kernel first: another WRITE through that name);
3. it is answered. Its claim ends once every drop is done.
A write through another name while a claim stands does not write the claimed bytes: it is a
page written back that was read before the change (its other bytes are the mapping's and
land; those are older than the change), or a write racing the change over the same bytes,
ordered before it. A page written back claims nothing itself — only some of its bytes are
the mapping's — so it never holds back a write made through another name. Without claims, the
write-back of a dirty page of a shared map landed over a write made through another name
after the page was read: a lost write the daemon had answered.

Why the waits are shaped so (fs/fuse): dropping a page locks it, waits for its write-back, and
writes back a dirty one. While a WRITE waits for its answer, the kernel keeps locked the page
it could not fill whole (one it has not read), and a page being written back stays busy —
and readable — until its WRITE is answered. Waiting without end for such a page closes a
circle — two writes through two names of one page, each dropping the other's page — and
wedged the mount. So a drop of pages that another change through that name covers is waited
for without end while that change has not reached its own drops (it gets there without
waiting for this one); once it has, at most ``HELD_WAIT_S`` more: a page a WRITE keeps locked
is one the kernel has not read (it reads it again once let go), and the drop lands then, in
the background. That shortcut counts from the drop's start on its thread (not while it waits
for one), and holds off while a read of those pages is being answered here (``reading``): a
read keeps its pages locked too, its answer may hold bytes from before the change, and it
ends by itself — answering the change before that drop lands served the old bytes to a read
right after it. The one exception: a change that claims its bytes waits for a page being
written back to the end (that page is readable and older than the change); the write-back
waits for nobody longer than ``HELD_WAIT_S``, so it ends. Every wait ends after ``WAIT_S``
(counted, logged): nothing ever wedges. Drops run on threads of their own, never on the
serving thread, so the requests the locked pages wait for are answered meanwhile.

What is left (docs/decisions.md, "Coherence across names"): two shared writable maps of two
names of the same 4 KiB page, written at once, write back whole pages each, and the later
write-back carries the other's bytes as it read them.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import trio

from faultfs.stats import Stats

log = logging.getLogger("faultfs.fuse")

PAGE = 4096  # the kernel's page: what it caches, locks and writes back
WAIT_S = 10.0  # a drop waited for; past it the change is answered (counted, logged)
HELD_WAIT_S = 0.5  # a drop of a page a write through that name holds while it drops (unread)
THREADS = 32  # drops under way at once (a drop stuck on a page holds one until it is let go)

Drop = Callable[[int, int, int], None]  # (inode, offset, length): blocking; length 0 = to the end
Range = tuple[int, int, int]  # (inode, offset, length); length 0: the whole file
Make = Callable[[list[tuple[int, int]]], Awaitable[int]]  # make the change of these byte runs


@dataclass(slots=True, eq=False)
class Flight:
    """A change through ``inode`` under way (bytes ``[lo, hi)``), or a claim of those bytes."""

    inode: int
    lo: int
    hi: int
    dropping: bool = False  # made, and waiting for its drops
    cached: bool = False  # pages written back (its pages are being written back, readable)


class Coherence:
    """The changes under way through the tree's names, the bytes they claim, their drops."""

    def __init__(self, drop: Drop | None, stats: Stats) -> None:
        self.drop = drop
        self.stats = stats
        self.flying: dict[int, list[Flight]] = {}  # inode -> its changes under way
        self.claims: dict[int, list[Flight]] = {}  # inode -> other names' changes' bytes in it
        self._order: dict[int, trio.Lock] = {}  # tag id -> its aliased changes, one at a time
        self._waiting: set[trio.Event] = set()  # drops waiting: woken when a flight moves on
        self.reads: dict[int, list[tuple[int, int]]] = {}  # inode -> pages of reads under way
        # every drop asked for runs, also one no change waits for any more
        self._threads = ThreadPoolExecutor(THREADS, thread_name_prefix="faultfs-drop")

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)

    async def change(self, tag_id: int, inode: int | None, off: int, size: int,
                     others: list[Range], make: Make, *, claim: bool = True) -> int:
        """``make`` the change of bytes ``[off, off+size)`` through ``inode`` (None: no name,
        a reset) that ``others`` show too, as the module docstring says; what ``make``
        returns. ``make`` is handed the runs of those bytes that no other change claims.
        ``claim`` False: pages written back, whose bytes are a mapping's only in part —
        they claim nothing (the rest may be older than what another name wrote)."""
        if self.drop is None or not others:
            return await make([(off, size)])
        mine = None if inode is None else Flight(inode, off, off + size, cached=not claim)
        if mine is not None:
            _add(self.flying, mine)
        try:
            lock = self._order.setdefault(tag_id, trio.Lock())
            async with lock:
                runs = [(off, size)] if mine is None else self._unclaimed(mine)
                made = await make(runs)
                claims = [Flight(i, o, o + s if s > 0 else 1 << 62) for i, o, s in others
                          if claim]
                for claim in claims:
                    _add(self.claims, claim)
            if mine is not None:
                mine.dropping = True
                self._wake()
            await self._drop_all(others, claims, patient=claim)
            return made
        finally:
            if mine is not None:
                _remove(self.flying, mine)
                self._wake()

    def reading(self, inode: int, off: int, size: int) -> tuple[int, int]:
        """A read of ``inode`` starts: until ``read_done``, its pages are locked in the
        kernel, and a drop of them waits for its answer (which may hold bytes from before a
        change: the drop must land after it)."""
        pages = (off // PAGE, (off + max(size, 1) - 1) // PAGE)
        self.reads.setdefault(inode, []).append(pages)
        return pages

    def read_done(self, inode: int, pages: tuple[int, int]) -> None:
        reads = self.reads[inode]
        reads.remove(pages)
        if not reads:
            del self.reads[inode]
        if self._waiting:
            self._wake()

    def _unclaimed(self, mine: Flight) -> list[tuple[int, int]]:
        """The runs of ``mine``'s bytes no other name's change claims now."""
        runs = [(mine.lo, mine.hi)]
        for claim in self.claims.get(mine.inode, ()):
            runs = [piece for lo, hi in runs for piece in _minus(lo, hi, claim.lo, claim.hi)]
        cut = (mine.hi - mine.lo) - sum(hi - lo for lo, hi in runs)
        if cut:
            self.stats.add("coherence_claimed_bytes", cut)
        return [(lo, hi - lo) for lo, hi in runs]

    def _wake(self) -> None:
        for event in self._waiting:
            event.set()

    async def _drop_all(self, others: list[Range], claims: list[Flight], *,
                        patient: bool) -> None:
        """Drop every range of ``others``; the claims go once every drop is done (also one
        this change stopped waiting for: till then a page read before the change may still
        be written back)."""
        self.stats.add("coherence_drops", len(others))
        left = [len(others)]
        token = trio.lowlevel.current_trio_token()

        def one_done() -> None:
            left[0] -= 1
            if not left[0]:
                for claim in claims:
                    _remove(self.claims, claim)

        if len(others) == 1:
            await self._drop(*others[0], token, one_done, patient)
            return
        async with trio.open_nursery() as nursery:
            for inode, off, size in others:
                nursery.start_soon(self._drop, inode, off, size, token, one_done, patient)

    async def _drop(self, inode: int, off: int, size: int, token: trio.lowlevel.TrioToken,
                    then: Callable[[], None], patient: bool) -> None:
        """Drop one range and wait as the module docstring says."""
        assert self.drop is not None
        state: dict = {"done": False, "started": False, "wake": trio.Event()}

        def finished() -> None:
            state["done"] = True
            state["wake"].set()
            then()

        def landed(_: Future) -> None:
            try:
                token.run_sync_soon(finished)
            except trio.RunFinishedError:
                pass  # unmounted meanwhile: nobody waits

        def started() -> None:
            state["started"] = True
            state["wake"].set()

        def run() -> None:
            try:
                token.run_sync_soon(started)
            except trio.RunFinishedError:
                return
            self.drop(inode, off, size)

        self._threads.submit(run).add_done_callback(landed)
        first, last = off // PAGE, (off + size - 1) // PAGE if size > 0 else 1 << 62
        until = trio.current_time() + WAIT_S
        while not state["done"]:
            holders = [f for f in self.flying.get(inode, ())
                       if f.lo // PAGE <= last and first <= (f.hi - 1) // PAGE]
            # a write through that name that drops too may wait on this change's pages
            # (a change that claims its bytes waits for a write-back to the end: the page
            # being written back is readable, old; the write-back waits for nobody long).
            # Not while the drop waits for a thread, or a read of those pages is answered:
            # that read may hold bytes from before the change, and it ends by itself.
            reading = any(a <= last and first <= b for a, b in self.reads.get(inode, ()))
            held = state["started"] and not reading and any(
                f.dropping and not (patient and f.cached) for f in holders)
            wake = state["wake"] = trio.Event()
            self._waiting.add(wake)
            try:
                with trio.move_on_at(min(until, trio.current_time() + HELD_WAIT_S)
                                     if held else until):
                    await wake.wait()
            finally:
                self._waiting.discard(wake)
            if state["done"]:
                return
            if held:
                self.stats.add("coherence_held_pages")
                return
            if trio.current_time() >= until:
                self.stats.add("coherence_waits_cut")
                log.warning("dropping the cached pages of inode %#x [%d, +%d) took over %.0f s: "
                            "the change is answered, the drop lands later", inode, off, size,
                            WAIT_S)
                return


def _add(table: dict[int, list[Flight]], flight: Flight) -> None:
    table.setdefault(flight.inode, []).append(flight)


def _remove(table: dict[int, list[Flight]], flight: Flight) -> None:
    flights = table[flight.inode]
    flights.remove(flight)
    if not flights:
        del table[flight.inode]


def _minus(lo: int, hi: int, cut_lo: int, cut_hi: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` without ``[cut_lo, cut_hi)``: zero, one or two runs."""
    if cut_hi <= lo or hi <= cut_lo:
        return [(lo, hi)]
    return [(a, b) for a, b in ((lo, cut_lo), (cut_hi, hi)) if a < b]
