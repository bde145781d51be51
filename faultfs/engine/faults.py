"""Faults: bring blobs in from the shared tier or the source (one source read per run of
adjacent blobs), hand them to their readers at once, then to the tiers (and publish what
came from the source to the shared tier).

Invariants:
- A failed fault raises (EIO) to every reader that joined it; zeros are never served in place
  of data. A later read tries the source again.
- Concurrent faults of one blob share one source read (``flights``).
- Readers get the bytes as soon as they are read: a blob of a run read from a streaming
  source (``pread_stream``: the S3 and other remote sources) is handed to its readers the
  moment its last byte lands, while the rest of the run is still on the wire; otherwise when
  the source read is done. A reader of a range (``fault_range``) is answered even earlier,
  once its own bytes of the blob have landed (``Flight.show``); the fault it waits for then
  runs in the mount's nursery, beside it. The store write follows (behind the reader when
  the engine is attached to a mount; a streaming run's blob as it lands), the bytes held
  until it is on disk.
- The source side (which runs stream, what a run holds of the data budget, the reads
  themselves) is ``sourcereads``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import trio

from faultfs.buffers import alloc
from faultfs.engine.flights import NOBODY, Flight, Flights
from faultfs.engine.heldback import HeldBack, publish_then_release
from faultfs.engine.sourcereads import SourceReads
from faultfs.engine.tags import Tag
from faultfs.errors import FaultfsError, SourceError
from faultfs.iopool import IoPool, run_in_thread
from faultfs.stats import Stats
from faultfs.tiers.base import BlobKey, Buffer
from faultfs.tiers.claimboard import ClaimBoard, Held
from faultfs.tiers.multilevel import TierStack
from faultfs.tiers.shared import SharedTier

log = logging.getLogger("faultfs.engine")

T = TypeVar("T")

# Source reads a reader waits for, at once, beside the I/O pool: a cold read must not queue
# behind the pool's prefetches and store writes (random readers: one blob each).
DEMAND_LANE = 16
# Prefetch runs that land blob by blob, at once, on threads of their own (``_run``): a window
# keeps about 16 requests in flight (prefetch.GETS_IN_FLIGHT)
AHEAD_LANE = 16
# A reader's fault is split at its offset when the bytes before it would take longer to
# land than a second request costs (at 100 MB/s per connection, 256 KiB is 2.6 ms;
# a request costs ~0.4 ms of CPU and runs beside the other)
SPLIT_MIN = 256 << 10
SPLIT_ALIGN = 64 << 10
SPLIT_LANE_BUSY = 4  # ... and only while fewer reads than this take the demand lane
CLAIM_TRIP_S = 0.002  # a fault's claim step took a request to the shared store (or waited)


def split_at(tag: Tag, index: int, at: int) -> int:
    """Where a fault of blob ``index`` whose reader starts at ``at`` is split in two (0: it
    is not): far enough in that the reader would wait for more than ``SPLIT_MIN`` bytes
    before its own, aligned down, inside the blob's source bytes."""
    at -= at % SPLIT_ALIGN
    if at < SPLIT_MIN:
        return 0
    start, end = tag.layout.source_range(index)
    return at if at < end - start else 0


def count_claim_path(stats: Stats, flights: list[Flight], demand: bool, seconds: float) -> None:
    """A fault's claim requests took ``seconds`` before its source read: on a reader's path
    when a reader waits for the fault (``claim_path_ms``, ``claim_path_faults``)."""
    if seconds >= CLAIM_TRIP_S and (demand or any(
            f.done.statistics().tasks_waiting or f.wait_end != NOBODY for f in flights)):
        stats.add("claim_path_faults")
        stats.add("claim_path_ms", round(1000 * seconds))


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


def _gaps(got: Sequence[Buffer | None]) -> list[tuple[int, int]]:
    """``[lo, hi)`` runs of the positions still missing."""
    runs, lo = [], None
    for i, data in enumerate(got):
        if data is None and lo is None:
            lo = i
        elif data is not None and lo is not None:
            runs.append((lo, i))
            lo = None
    if lo is not None:
        runs.append((lo, len(got)))
    return runs


class Faulter:
    def __init__(self, flights: Flights, tiers: TierStack, pool: IoPool, stats: Stats) -> None:
        self.flights = flights
        self.tiers = tiers
        self.pool = pool
        self.stats = stats
        self.reads = SourceReads(stats)
        self._lanes: tuple[trio.CapacityLimiter, trio.CapacityLimiter] | None = None
        self._nursery: trio.Nursery | None = None
        self._held_back: HeldBack | None = None  # claimed blobs' publishes, while alone

    def attach(self, nursery: trio.Nursery) -> None:
        """Run the faults readers of streaming sources wait for in ``nursery`` (the mount's),
        so a reader can be answered from its blob's head while the rest still lands."""
        self._nursery = nursery
        shared = self.tiers.shared
        if shared is not None and shared.claims is not None:
            self._held_back = HeldBack(shared, shared.claims, self.stats, self._read_back)

    async def fault(self, tag: Tag, index: int) -> Buffer:
        """Blob ``index`` of ``tag``, all of it, from the source (single-flight)."""
        flight = await self._flight(tag, index)
        if not flight.done.is_set():
            await flight.done.wait()
        return self._outcome(tag, index, flight)

    async def fault_range(self, tag: Tag, index: int, off: int, size: int) -> Buffer:
        """Bytes ``[off, off+size)`` of blob ``index`` (inside it), from the source
        (single-flight); from a streaming source as soon as they are in, before the rest of
        the blob (``Flight.show``)."""
        flight = await self._flight(tag, index, streaming=True, at=off)
        await flight.wait_for(off + size, off)
        flight.read = True  # (a prefetch's blob this reader joined: read, not ahead)
        landed = flight.landed(off, off + size) if flight.data is None else None
        if landed is not None:
            self.stats.add("head_reads")
            return landed  # landed before the fault ended (even if it failed)
        data = self._outcome(tag, index, flight)
        self.tiers.mark_read((tag.id, index))  # memory kept it before this reader took it
        return memoryview(data)[off:off + size]

    async def _flight(self, tag: Tag, index: int, *, streaming: bool = False,
                      at: int = 0) -> Flight:
        """The flight of blob ``index``: a read-ahead's or a fault's in progress (joined), or
        a new fault — run here, or (``streaming`` and a mount's nursery) beside the reader
        so it can take the blob's head, or the bytes from ``at`` on (the reader's offset:
        a split fault); done unless it runs beside."""
        key = (tag.id, index)
        data = await self.flights.read_ahead(key)  # a read-ahead of the staged copy
        if data is not None:
            flight = Flight()
            flight.data = data
            flight.done.set()
            return flight
        flight = self.flights.get(key)
        if flight is not None:
            self.stats.add("single_flight_joins")
            return flight
        [flight] = self.flights.claim([key])
        if streaming and self._nursery is not None and self.reads.streams(tag):
            self._nursery.start_soon(self._beside, tag, index, flight, at)
        else:
            await self.fault_run(tag, index, [flight], demand=True)
        return flight

    async def _beside(self, tag: Tag, index: int, flight: Flight, at: int) -> None:
        try:
            await self.fault_run(tag, index, [flight], demand=True, at=at)
        except Exception:  # a background task must never take the mount down
            log.exception("fault of blob %d of tag %s failed", index, tag.name)

    @staticmethod
    def _outcome(tag: Tag, index: int, flight: Flight) -> Buffer:
        if flight.error is not None:
            if isinstance(flight.error, FaultfsError):
                raise FaultfsError(flight.error.message, flight.error.errno)
            raise SourceError(f"fault of {tag.name}/{tag.layout.blob_name(index)} failed: "
                              f"{flight.error}")
        assert flight.data is not None
        return flight.data

    async def fault_run(self, tag: Tag, first: int, flights: list[Flight], *,
                        demand: bool = False, reserved: bool = False,
                        at: int = 0) -> list[Flight]:
        """Fault the claimed blobs ``first ..``: from the shared tier where it has them, the
        rest with ONE source read per run of adjacent blobs (a run costs one request to a
        remote source, not one each); hand each to its readers as soon as it is in, then to
        the tiers. Errors are left in the flights for their readers. ``demand``: a reader
        waits for it; its source read takes a lane of its own (``DEMAND_LANE``), so it never
        queues behind prefetches and store writes in the I/O pool; it waits for room in the
        data budget instead (``--memory-mb``). ``reserved``: the caller took the run's bytes
        from the budget already (a prefetch, when it started). ``at``: where in a single
        blob its reader's bytes start; far enough in, the blob is read in two parts at once,
        from ``at`` and up to it, so the reader waits for one round trip and its own bytes
        (``split``)."""
        count = len(flights)
        keys = [(tag.id, index) for index in range(first, first + count)]
        self.stats.add("faults", count)
        started = time.monotonic()
        got: list[Buffer | None] = [None] * count
        handed = [False] * count
        from_source = [False] * count
        error: BaseException | None = None

        budget = self.tiers.budget
        cs = tag.layout.chunk_size
        pieces = self.reads.in_pieces(tag)
        # what the run's source reads hold against the data budget until its blobs are
        # handed on: each blob's bytes (a buffer for the whole read), or one blob for the
        # whole run where its blobs land one at a time, each into a buffer of its own
        # (``stream_source``); ``holds`` says the same to the prefetch
        owed = [reserved and not pieces] * count
        run_owed = cs if reserved and pieces else 0
        stored = [False] * count  # store writes seen to as the blob landed
        pinned: list[BlobKey] = []  # landed blobs the run holds (``pieces``) until it ends
        tally = self.tiers.landing()  # its blobs landed, and taken in here (``hand``)

        def settle_budget(i: int) -> None:
            if owed[i]:
                owed[i] = False
                budget.give(cs)

        def settle_run() -> None:
            nonlocal run_owed
            if run_owed:
                budget.give(run_owed)
                run_owed = 0

        def hand(i: int, data: Buffer) -> None:
            """Blob ``first + i`` to its readers and to memory, now (on the trio thread, from
            ``run_sync_soon``: it must not raise)."""
            tally[1] += 1
            if handed[i]:
                return
            handed[i] = True
            settle_budget(i)
            got[i] = data
            flights[i].data = data
            try:
                self.tiers.hold(keys[i], data, ahead=not (demand or flights[i].read))
                if pieces:  # the run holds it until it ends: memory must not count it freed
                    self.tiers.pin(keys[i])
                    pinned.append(keys[i])
                stored[i] = self.tiers.store_soon(keys[i], data)
            except Exception:  # the readers still get their bytes
                log.exception("holding blob %s in memory failed", keys[i])
            self.flights.settle([keys[i]], [flights[i]])

        def show(i: int, head: memoryview) -> None:
            """The first bytes of blob ``first + i`` to the readers they serve (on the trio
            thread, from ``run_sync_soon``)."""
            if not handed[i]:
                flights[i].show(head)

        held: list[Held] = []  # claims of this node on the windows it fetches
        shared = self.tiers.shared
        if self._held_back is not None:
            self._held_back.fault_started()
        try:
            if shared is not None:
                if shared.claims is not None and shared.up and tag.id in shared.tags:
                    # the windows' claims say what is published: no GET for each blob
                    asked = time.monotonic()
                    held = await self._coordinate(shared, shared.claims, tag, first, got,
                                                  ahead=not demand)
                    count_claim_path(self.stats, flights, demand, time.monotonic() - asked)
                else:
                    got = await shared.load_run(keys)
            for i, data in enumerate(got):
                if data is not None:  # from the shared tier: no source read for it
                    settle_budget(i)
            token = trio.lowlevel.current_trio_token()
            for lo, hi in _gaps(got):
                read_from = time.monotonic()
                if not reserved and not run_owed:
                    need = cs if pieces else (hi - lo) * cs
                    if demand:  # a reader waits: room once what is in flight or pinned allows
                        await budget.admit(need)
                    budget.take(need)
                    if pieces:
                        run_owed = need
                    else:  # the read's buffer is allocated whole
                        owed[lo:hi] = [True] * (hi - lo)
                if (count == 1 and self.reads.streams(tag) and split_at(tag, first, at)
                        and self._lane_quiet()):
                    datas = await read_split(
                        self, tag, first, split_at(tag, first, at),
                        lambda head: token.run_sync_soon(show, 0, head),
                        lambda part_at, part: token.run_sync_soon(flights[0].show_tail,
                                                                  part_at, part))
                elif self.reads.streams(tag):
                    def landed(j: int, data: Buffer, lo: int = lo) -> None:  # on the pool
                        tally[0] += 1
                        token.run_sync_soon(hand, lo + j, data)

                    def partly(j: int, head: memoryview, lo: int = lo) -> None:  # on the pool
                        token.run_sync_soon(show, lo + j, head)

                    def wanted(j: int, lo: int = lo) -> int:  # on the pool: a plain read
                        return flights[lo + j].wait_end

                    # a prefetch run landing blob by blob holds one blob of the budget:
                    # before each next blob it lets the store writes catch up, blobs that
                    # landed and are not taken in yet counted as waiting (its landed blobs
                    # wait for theirs in memory, counted)
                    paced = pieces and not demand
                    datas = await self._run(demand, self.reads.stream_source, tag, first + lo,
                                            hi - lo, landed, partly, wanted,
                                            self.tiers.wait_for_store if paced else None,
                                            ahead=paced)
                else:
                    datas = await self._run(demand, self.reads.read_source, tag, first + lo,
                                            hi - lo)
                self.reads.count(tag, first + lo, hi - lo)
                if shared is not None and shared.claims is not None:
                    shared.claims.observe((hi - lo) * tag.layout.chunk_size,
                                          time.monotonic() - read_from)
                got[lo:hi] = datas
                from_source[lo:hi] = [True] * (hi - lo)
        except BaseException as exc:
            error = exc
            if not isinstance(exc, Exception):
                raise
            failed = sum(d is None for d in got)
            self.stats.add("fault_errors", failed)
            if not isinstance(exc, FaultfsError):
                log.exception("fault of blobs %d..%d of tag %s failed", first,
                              first + count - 1, tag.name)
        finally:
            settle_run()
            self.tiers.landed(tally)
            if error is not None and not isinstance(error, Exception):
                self.tiers.unpin(pinned)  # cancelled: no store loop follows to let go
            for i, (key, flight, data) in enumerate(zip(keys, flights, got, strict=True)):
                settle_budget(i)
                if handed[i]:
                    continue
                handed[i] = True
                if data is None:
                    flight.error = error if error is not None else SourceError("no bytes")
                else:
                    flight.data = data
                    self.tiers.hold(key, data, ahead=not (demand or flight.read))
                self.flights.settle([key], [flight])
            self.stats.latencies.append(time.monotonic() - started)
            if self._held_back is not None:
                self._held_back.fault_ended()
            if held and error is not None:  # nothing to publish: others may claim at once
                assert shared is not None and shared.claims is not None
                with trio.CancelScope(shield=True):
                    await shared.claims.release(held, published=False)
                held = []
        fresh = []
        try:
            for key, data, new, early in zip(keys, got, from_source, stored, strict=True):
                if data is None:
                    continue
                if not early:
                    await self.tiers.store(key, data)
                if new and shared is not None:
                    fresh.append((key, data))
                    if not held:
                        shared.publish_soon(key, data)
            if held:
                await self._publish_then_release(fresh, held)
        finally:
            self.tiers.unpin(pinned)  # the run lets go of its blobs only now
        return flights

    async def _coordinate(self, shared: SharedTier, board: ClaimBoard, tag: Tag, first: int,
                          got: list[Buffer | None], *, ahead: bool) -> list[Held]:
        """Claim the windows of the blobs in ``got`` still missing (``ahead``, a prefetch:
        to the window's end), or wait for other nodes to bring them; fills ``got`` with what
        the shared store has of them (the windows' index) and what landed meanwhile. The
        claims held."""
        tier_tag = shared.tags.get(tag.id)
        if tier_tag is None:
            return []
        missing = [first + i for i, data in enumerate(got) if data is None]

        async def load(indices: list[int]) -> dict[int, Buffer]:
            datas = await shared.load_run([(tag.id, i) for i in indices])
            return {i: d for i, d in zip(indices, datas, strict=True) if d is not None}

        found, held = await board.coordinate(tier_tag, missing, load, ahead=ahead)
        for index, data in found.items():
            got[index - first] = data
        return held

    async def _publish_then_release(self, fresh: list[tuple[BlobKey, Buffer]],
                                    held: list[Held]) -> None:
        """Publish what this node fetched under its claims, then release them (behind the
        reader when attached; held back while this node looks alone: ``heldback``): a
        waiter that sees a claim gone finds its blobs."""
        shared = self.tiers.shared
        assert shared is not None and shared.claims is not None
        datas = dict(fresh)

        async def publish(key: BlobKey) -> bool:
            return await shared.publish_counted(key, datas.pop(key))

        if self._nursery is None:
            await publish_then_release(shared.claims, list(datas), held, publish)
        elif self._held_back is None or not self._held_back.offer(list(datas), held,
                                                                  self._nursery):
            self._nursery.start_soon(publish_then_release, shared.claims, list(datas), held,
                                     publish)

    async def _read_back(self, key: BlobKey) -> Buffer | None:
        """A blob this node faulted, for its held-back publish: from memory while its store
        write is pending, else verified from the local store; None when it is not there
        (not a read: memory keeps a blob its readers have not read yet as such)."""
        data = self.tiers.peek(key)
        if data is not None:
            return data
        try:
            return (await self.pool.run(self.tiers.read_ahead_blocking, [key]))[0]
        except Exception:  # forgotten, evicted, unreadable: not published
            log.debug("blob %s could not be read back for its publish", key, exc_info=True)
            return None

    def _lane_quiet(self) -> bool:
        """Whether the demand lane has room for a split fault's second read: with many
        readers' faults at once the bandwidth and the CPU bound them, not a round trip,
        and a request more each would only cost."""
        return self._lanes is None or self._lanes[0].borrowed_tokens < SPLIT_LANE_BUSY

    async def _run(self, demand: bool, fn: Callable[..., T], *args: object,
                   ahead: bool = False) -> T:
        """``fn(*args)`` on a worker thread: the demand lane (a reader waits), the ahead
        lane (a prefetch run that may pause for the store writes: it must not hold the
        I/O pool's threads, which those writes need), or the I/O pool."""
        if not demand and not ahead:
            return await self.pool.run(fn, *args)
        if self._lanes is None:  # made inside the trio run that uses them
            self._lanes = (trio.CapacityLimiter(DEMAND_LANE), trio.CapacityLimiter(AHEAD_LANE))
        return await run_in_thread(self._lanes[0 if demand else 1], fn, *args)


async def read_split(faulter: Faulter, tag: Tag, index: int, at: int,
                     head: Callable[[memoryview], None],
                     tail: Callable[[int, memoryview], None]) -> list[Buffer]:
    """Blob ``index`` read in two parts at once on the demand lane, into one buffer:
    ``[at, end)`` (its reader's bytes first, ``tail(at, bytes in so far)``) and
    ``[0, at)`` (``head(bytes in so far)``); the bytes and the requests' count are those
    of one read of the blob, each reader waits for the part its bytes are in."""
    layout = tag.layout
    start, end = layout.source_range(index)
    buf = alloc(layout.chunk_size)
    buf[end - start:] = bytes(layout.chunk_size - (end - start))  # a short final blob

    def part(lo: int, hi: int, tell: Callable[[memoryview], None]) -> None:
        def read() -> None:
            assert tag.source is not None
            tag.source.pread_stream(start + lo, hi - lo, tell, layout.chunk_size,
                                    into=buf[lo:hi])

        faulter.reads.guarded(tag, index, start + lo, start + hi, read)

    faulter.stats.add("split_faults")
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(faulter._run, True, part, at, end - start,
                               lambda got: tail(at, got))
            nursery.start_soon(faulter._run, True, part, 0, at, head)
    except BaseExceptionGroup as group:  # the first failure, as one read would raise it
        failures = [e for e in _leaves(group) if isinstance(e, Exception)]
        if not failures:
            raise
        raise failures[0] from None
    return [buf]

