"""Prefetch: sequential readers of a tag get the blobs ahead of them faulted (or read ahead from
the store) in the background, so their later reads are memory hits.

A read of a blob a few blobs after the one read last is sequential (the kernel's readahead
arrives slightly out of order); the window then opens at once to ``FIRST_WINDOW_BYTES``, its
first ``OPENING_GETS`` blobs fetched one per request so that the reader's next blobs land
soonest, and doubles up to its reach (``__init__``). A read of an earlier blob that is already
here or on its way (the kernel's readahead out of order, a format's metadata read between its
data reads, as HDF5 does) leaves the stream as it is. Any other read resets it: random readers
get no prefetch and fault just their blob. Blobs ahead that are not staged are faulted in runs
the layout can fetch with one source read (``BlobLayout.coalesce``) of ``run_blobs`` each, so
a full window keeps about ``GETS_IN_FLIGHT`` requests in flight, and a run is started only
once that many blobs at the window's end are free (no trickle of one-blob requests as the
reader moves on); each blob of a run reaches its readers as soon as it lands (``faults``).
From an S3 source a run lands blob by blob, each into a buffer of its own, and holds one
blob of memory while it is under way, so the window reaches twice as far (within the data
budget, ``--memory-mb``) in requests twice as large as when a run's buffer is taken whole
(fewer requests: less CPU in the daemon and the endpoint per byte). About half of such
a window has landed and is not yet read at any time (all of it, for a reader slower than
the window): the blobs a sequential reader has passed are the memory tier's first to drop
(``TierStack.passed``), blobs kept ahead and not read yet its last (``MemoryTier.keep``),
the windows stop where what memory keeps ahead of readers and what is on its way would
fill the budget (``room_blobs``; other files' blobs kept ahead take at most half of a
window's room), and staged blobs are read ahead from the store only as far as the
prefetch's share of the budget, so the window's landed blobs are not dropped and read back
before their reader gets to them.
With claims in a shared store, a run also ends at a claim window's end (one claim a run), and
the windows up to two past the prefetch's reach are claimed before it gets there.
Staged blobs are read from the store in runs of up to ``LOAD_RUN_BYTES`` with one trip to the
I/O pool.

Invariants:
- Prefetch claims flights like any fault, so a reader arriving meanwhile joins it.
- A clone's reader is tracked on the clone; what runs ahead of it is its ancestor's clean
  blobs (``Tag.clean``), as its reads are.
- A background task never takes the mount down: its failure is logged and counted, and its
  readers fall back to the normal path.
- Nothing is started once the engine is closing, or without a mount's nursery.
"""

from __future__ import annotations

import logging

import trio

from faultfs.config import Config
from faultfs.engine.faults import Faulter
from faultfs.engine.flights import Flight, Flights
from faultfs.engine.tags import Tag
from faultfs.hdf5 import Hdf5Lookahead
from faultfs.iopool import IoPool
from faultfs.stats import Stats
from faultfs.tiers.budget import PREFETCH_SHARE
from faultfs.tiers.held import CLAIM_WINDOW_BYTES, CLAIM_WINDOW_MAX_BLOBS
from faultfs.tiers.multilevel import TierStack

log = logging.getLogger("faultfs.engine")

LOAD_RUN_BYTES = 4 << 20  # adjacent staged blobs read ahead in one trip to the I/O pool
# A remote request pays a round trip before its first byte and a connection's bandwidth after:
# at 20 ms and 100 MB/s a 2 MiB GET brings ~50 MB/s, so a window keeps many of them in flight.
# Fewer, larger requests cost less CPU each but need more bytes in flight for the same rate.
GETS_IN_FLIGHT = 16  # requests a full window keeps in flight (runs = budget / this) ...
MIN_RUN_BYTES = 2 << 20  # ... each at least this (per-request costs stay small) ...
PREFETCH_RUN_BYTES = 8 << 20  # ... and at most this: adjacent blobs fetched in one request
FIRST_WINDOW_BYTES = 8 << 20  # a reader found sequential gets this much ahead at once ...
OPENING_GETS = 8  # ... its next blobs (up to this many) one request each, the rest in runs
# claim windows of the shared store this many past the prefetch's reach (one window's lead
# is 80 ms of a 100 MB/s reader, less than a create on a busy store)
AHEAD_WINDOWS = 2


class Prefetcher:
    def __init__(self, config: Config, flights: Flights, tiers: TierStack, faulter: Faulter,
                 pool: IoPool, stats: Stats) -> None:
        # --prefetch-mb is what a window holds of memory, within half of the data budget
        # (--memory-mb): where a run's source read holds its bytes whole, the window's
        # reach; where a run lands blob by blob it holds one blob while it lands
        # (``SourceReads.holds``) and about half of the window has landed and is not yet
        # read at any time, so the window reaches twice as far, within the whole budget
        self.budget = min(config.prefetch_mb << 20, tiers.budget.share(PREFETCH_SHARE))
        self.reach = min(2 * self.budget, tiers.budget.limit)
        self.flights = flights
        self.tiers = tiers
        self.faulter = faulter
        self.pool = pool
        self.stats = stats
        self.in_flight = 0  # blobs being prefetched or read ahead
        self.closing = False
        self._nursery: trio.Nursery | None = None
        self.hdf5 = Hdf5Lookahead(
            lambda tag, wanted, urgent: self.start_blobs(tag, [i for i, _ in wanted], urgent),
            stats, self.peek)

    def attach(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery

    def window_bytes(self, tag: Tag) -> int:
        """How far ahead of a reader of ``tag`` the window may reach (``__init__``)."""
        return self.reach if self.faulter.reads.in_pieces(tag) else self.budget

    def room_blobs(self, chunk_size: int) -> int:
        """Blobs that may be kept ahead of their readers in memory or on their way there,
        all windows together: the budget's, less what the readers read meanwhile (where a
        window reaches the whole budget, a reader slower than it has the whole window
        landed and waiting; two such readers would each drop the other's)."""
        blobs = self.tiers.budget.limit // chunk_size
        return max(1, blobs - max(2, blobs // 16))

    def run_blobs(self, chunk_size: int, window: int) -> int:
        """Blobs per prefetch request: a window of ``window`` bytes split in
        ``GETS_IN_FLIGHT``, within [``MIN_RUN_BYTES``, ``PREFETCH_RUN_BYTES``] and it."""
        run = min(PREFETCH_RUN_BYTES, max(MIN_RUN_BYTES, window // GETS_IN_FLIGHT))
        return max(1, min(run, window) // chunk_size)

    def _here(self, tag: Tag, index: int) -> bool:
        key = (tag.id, index)
        return key in self.flights or self.tiers.is_held(key) or self.tiers.contains(key)

    def note_access(self, tag: Tag, index: int) -> None:
        """Track sequential readers of ``tag``; start what runs ahead of them."""
        last = tag.last_index
        if index == last:
            return
        clean = tag.clean
        if self.hdf5.holds_window(tag):  # an HDF5 reader's chunks, not the gaps between
            tag.last_index, tag.window = index, 0
            self.tiers.reader_at((clean.id, index))
            return
        if 0 <= index < last and tag.window and self._here(clean, index):
            return  # a look back at bytes here or on their way: the stream goes on
        sequential = last >= 0 and last < index <= last + 1 + max(1, tag.window)
        streaming = sequential and tag.window > 0  # sequential twice running: claim ahead
        tag.last_index = index
        self.tiers.reader_at((clean.id, index))
        if sequential:
            self.tiers.passed((clean.id, last))
        layout = tag.layout
        cs = layout.chunk_size
        reach = self.window_bytes(clean)
        limit = reach // cs
        nursery = self._nursery
        if not sequential or limit <= 0 or nursery is None or self.closing:
            tag.window = 0
            return
        max_run = self.run_blobs(cs, reach)
        # the window opens with one request for each of the next OPENING_GETS blobs, all at
        # once: each lands a round trip and one blob's transfer after the reader got here,
        # not a whole run's; runs follow them
        singles = OPENING_GETS if tag.window == 0 else 0
        tag.window = min(limit, max(max_run, FIRST_WINDOW_BYTES // cs, tag.window * 2))
        max_load = max(1, LOAD_RUN_BYTES // cs)
        per = self._claim_window(cs)  # a run stops at a claim window's end: one claim each
        if streaming:  # (one random read after another can look sequential once)
            self._claim_ahead(clean, index + tag.window + AHEAD_WINDOWS * per)
        run_start, run_len = -1, 0
        load: list[int] = []  # adjacent staged blobs ahead, read from the store in one trip
        # what memory holds kept ahead of readers and the window's blobs on their way all
        # land in memory: this window's landed blobs count whole, the rest (other files'
        # windows, this file's left behind) take at most half of the room (a reader that
        # stopped must not hold the next ones back until its blobs age out)
        end = min(index + 1 + tag.window, layout.num_blobs)
        share, inside = self.room_blobs(cs), self.tiers.ahead_count(clean.id, index + 1, end)
        room = share - inside - min(self.tiers.ahead_bytes // cs - inside, share // 2)
        coming = 0  # the window's blobs on their way (found so, or started here)
        for ahead in range(index + 1, end):
            if self.in_flight + len(load) + run_len >= limit:
                break  # the budget is taken: what is left waits for a later read
            if coming + len(load) + run_len >= room:
                break  # readers slower than their windows: memory is full of what they read
            key = (clean.id, ahead)
            busy = key in self.flights or self.tiers.is_held(key)
            coming += key in self.flights
            staged = not busy and self.tiers.contains(key)
            near = staged and ahead <= index + self.budget // cs  # what memory can hold
            if load and not (near and len(load) < max_load):
                self._start_load(nursery, clean, load)
                coming += len(load)
                load = []
            if near:
                load.append(ahead)
            wanted = not busy and not staged
            cap = 1 if singles > 0 else max_run
            if wanted and run_len < cap and (run_len == 0 or (
                    layout.coalesce(run_start, run_len + 1) == run_len + 1
                    and ahead % per != 0)):
                if run_len == 0:
                    run_start = ahead
                run_len += 1
                continue
            if run_len:  # a run ended by its size, a blob here or on its way, or the layout
                self._start_fault(nursery, clean, run_start, run_len)
                coming += run_len
                singles -= 1
            run_start, run_len = (ahead, 1) if wanted else (-1, 0)
        # the window's last run only when it is whole or ends the tag: a reader moving on by
        # a blob must not start a request per blob, nor a budget freed by a blob
        if run_len and (run_len == (1 if singles > 0 else max_run)
                        or run_start + run_len == layout.num_blobs):
            self._start_fault(nursery, clean, run_start, run_len)
        if load:
            self._start_load(nursery, clean, load)

    def served(self, tag: Tag, off: int, data: bytes | memoryview) -> None:
        """View bytes of ``tag`` from ``off`` were served: what formats that index their own
        data (HDF5) tell of the reader's next reads (``lookahead.py``). A guess that fails
        costs its prefetch, never the read."""
        try:
            self.hdf5.served(tag, off, data)
        except Exception:
            if not self.stats.counters["hdf5_errors"]:
                log.exception("tag %s: the HDF5 lookahead failed (no more is logged)", tag.name)
            self.stats.add("hdf5_errors")

    def peek(self, tag: Tag, off: int, size: int) -> bytes:
        """View bytes ``[off, off+size)`` of ``tag``'s clean blobs as far as memory holds them
        from ``off`` (a prefix; empty when none): no I/O, no change to what memory keeps."""
        clean, out = tag.clean, []
        for index, inner, length in tag.layout.view_pieces(off, size):
            data = self.tiers.peek((clean.id, index))
            if data is None or len(data) < inner + length:
                break
            out.append(memoryview(data)[inner:inner + length])
        return b"".join(out)

    def start_blobs(self, tag: Tag, indices: list[int], urgent: bool = False) -> int:
        """Fault blobs ``indices`` (ascending) of ``tag`` in the background, adjacent ones
        in one run, those in memory or on their way left out, nearest first, within the
        memory budget and (unless ``urgent``: an index node a reader's pattern waits for)
        the prefetch's reach. Staged ones are read from the store into memory (as the
        window does for a sequential reader), where the HDF5 lookahead can read the index
        nodes among them (``peek``), as far as the prefetch's share of the budget (what
        memory can hold of them: the rest is read when its reader gets there). How many
        started."""
        clean, nursery = tag.clean, self._nursery
        cs = tag.layout.chunk_size
        if nursery is None or self.closing:
            return 0
        reach = self.window_bytes(clean)
        limit, max_run, per = reach // cs, self.run_blobs(cs, reach), self._claim_window(cs)
        if urgent:  # (a node or two: each of its blobs still within the memory budget)
            limit = 1 << 62
        load_limit = limit if urgent else min(limit, max(1, self.budget // cs))
        max_load = max(1, min(LOAD_RUN_BYTES // cs, load_limit))
        started = 0
        run: list[int] = []  # cold blobs: one source read
        load: list[int] = []  # staged blobs: one trip to the store
        for index in [*indices, -1]:
            key = (clean.id, index)
            busy = index < 0 or key in self.flights or self.tiers.is_held(key)
            staged = not busy and self.tiers.contains(key)
            if load and (not staged or index != load[-1] + 1 or len(load) >= max_load):
                if self.in_flight + len(load) > load_limit:
                    break
                started += self._start_load(nursery, clean, load, urgent)
                load = []
            if run and (busy or staged or index != run[-1] + 1 or len(run) >= max_run
                        or index % per == 0
                        or clean.layout.coalesce(run[0], len(run) + 1) <= len(run)):
                if self.in_flight + len(run) > limit:
                    break
                self._start_fault(nursery, clean, run[0], len(run))
                started += len(run)
                run = []
            if staged:
                load.append(index)
            elif not busy:
                run.append(index)
        return started

    def _claim_window(self, chunk_size: int) -> int:
        """Blobs per claim window of the shared store (DESIGN §17); a huge number without."""
        shared = self.tiers.shared
        if shared is None or shared.claims is None:
            return 1 << 62
        return max(1, min(CLAIM_WINDOW_MAX_BLOBS, CLAIM_WINDOW_BYTES // chunk_size))

    def _claim_ahead(self, tag: Tag, last: int) -> None:
        """Claim the shared store's windows up to blob ``last`` (``AHEAD_WINDOWS`` past the
        reach of the prefetch) before the prefetch gets there (``tiers/ahead.py``)."""
        shared = self.tiers.shared
        if shared is None or shared.claims is None or not shared.up:
            return
        tier_tag = shared.tags.get(tag.id)
        if tier_tag is not None:
            shared.claims.claim_ahead(tier_tag, last)

    def _start_fault(self, nursery: trio.Nursery, tag: Tag, first: int, count: int) -> None:
        budget = self.tiers.budget
        holds = self.faulter.reads.holds(tag, count)
        if not budget.fits(holds):
            self.stats.add("prefetch_skipped_memory")  # a later read starts it
            return
        budget.take(holds)  # reserved now: fault_run gives it back
        self.in_flight += count
        flights = self.flights.claim((tag.id, i) for i in range(first, first + count))
        nursery.start_soon(self._prefetch, tag, first, flights)

    async def _prefetch(self, tag: Tag, first: int, flights: list[Flight]) -> None:
        count = len(flights)
        try:
            self.stats.add("prefetches", count)
            await self.faulter.fault_run(tag, first, flights, reserved=True)
            if flights[0].error is not None:
                self.stats.add("prefetch_errors", count)
        except Exception:  # a background task must never take the mount down
            log.exception("prefetch of blobs %d.. of tag %s failed", first, tag.name)
            self.stats.add("prefetch_errors", count)
        finally:
            self.in_flight -= count

    def _start_load(self, nursery: trio.Nursery, tag: Tag, indices: list[int],
                    urgent: bool = False) -> int:
        """Claim adjacent staged blobs and read them ahead in the background, when memory
        has room for them beside what it keeps ahead of readers (else the tier would drop
        those, or these as they come in; ``urgent``: an index node a reader's pattern waits
        for, within the budget alone), their bytes held against the budget until they
        land; how many."""
        size = len(indices) * tag.layout.chunk_size
        budget = self.tiers.budget
        if not budget.fits(size + (0 if urgent else self.tiers.ahead_bytes)):
            self.stats.add("prefetch_skipped_memory")
            return 0
        budget.take(size)  # given back once they are in memory (or failed)
        keys = [(tag.id, index) for index in indices]
        flights = self.flights.claim(keys, from_store=True)
        self.in_flight += len(indices)
        nursery.start_soon(self._load_ahead, tag, keys, flights, size)
        return len(indices)

    async def _load_ahead(self, tag: Tag, keys: list[tuple[int, int]],
                          flights: list[Flight], size: int) -> None:
        """Read staged blobs ahead of a reader into memory (verified), a run of adjacent
        ones in one trip to the pool, so their reads are served without one. On any trouble
        the readers fall back to the normal path."""
        try:
            datas = await self.pool.run(self.tiers.read_ahead_blocking, keys)
            self.tiers.budget.give(size)  # landed: memory counts them from here
            size = 0
            for key, flight, data in zip(keys, flights, datas, strict=True):
                if data is not None:
                    flight.data = data
                    self.tiers.fill(key, data, ahead=True)
                    self.stats.add("store_readahead")
        except Exception:  # a background task must never take the mount down
            log.exception("read-ahead of blobs %s of tag %s failed", keys, tag.name)
        finally:
            if size:  # (failed before they landed)
                self.tiers.budget.give(size)
            self.flights.settle(keys, flights)
            self.in_flight -= len(keys)
