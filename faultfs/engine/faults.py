"""Faults: bring blobs in from the shared tier or the source (one source read per run of
adjacent blobs), hand them to their readers at once, then to the tiers (and publish what
came from the source to the shared tier).

Invariants:
- A failed fault raises (EIO) to every reader that joined it; zeros are never served in place
  of data. A later read tries the source again.
- Concurrent faults of one blob share one source read (``flights``).
- Readers get the bytes as soon as the source read is done; the store write follows (behind
  the reader when the engine is attached to a mount), the bytes held until it is on disk.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from faultfs.engine.flights import Flight, Flights
from faultfs.engine.tags import Tag
from faultfs.errors import FaultfsError, SourceChanged, SourceError
from faultfs.iopool import IoPool
from faultfs.stats import Stats
from faultfs.tiers.base import Buffer
from faultfs.tiers.multilevel import TierStack

log = logging.getLogger("faultfs.engine")


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
        self._told_unavailable: set[int] = set()  # tags whose unreachable source was logged

    async def fault(self, tag: Tag, index: int) -> Buffer:
        """Blob ``index`` of ``tag``, all of it, from the source (single-flight)."""
        key = (tag.id, index)
        data = await self.flights.read_ahead(key)  # a read-ahead of the staged copy
        if data is not None:
            return data
        flight = self.flights.get(key)
        if flight is None:
            [flight] = await self.fault_run(tag, index, self.flights.claim([key]))
        else:
            self.stats.add("single_flight_joins")
            await flight.done.wait()
        if flight.error is not None:
            if isinstance(flight.error, FaultfsError):
                raise FaultfsError(flight.error.message, flight.error.errno)
            raise SourceError(f"fault of {tag.name}/{tag.layout.blob_name(index)} failed: "
                              f"{flight.error}")
        assert flight.data is not None
        return flight.data

    async def fault_run(self, tag: Tag, first: int, flights: list[Flight]) -> list[Flight]:
        """Fault the claimed blobs ``first ..``: from the shared tier where it has them, the
        rest with ONE source read per run of adjacent blobs (a run costs one request to a
        remote source, not one each); then hand each to readers and to the tiers. Errors are
        left in the flights for their readers."""
        count = len(flights)
        keys = [(tag.id, index) for index in range(first, first + count)]
        self.stats.add("faults", count)
        started = time.monotonic()
        got: list[Buffer | None] = [None] * count
        from_source = [False] * count
        error: BaseException | None = None
        try:
            shared = self.tiers.shared
            if shared is not None:
                got = await shared.load_run(keys)
            for lo, hi in _gaps(got):
                datas = await self.pool.run(self.read_source, tag, first + lo, hi - lo)
                self._count_source_read(tag, first + lo, hi - lo)
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
            for key, flight, data in zip(keys, flights, got, strict=True):
                if data is None:
                    flight.error = error if error is not None else SourceError("no bytes")
                else:
                    flight.data = data
                    self.tiers.hold(key, data)
            self.flights.settle(keys, flights)
            self.stats.latencies.append(time.monotonic() - started)
        for key, data, fresh in zip(keys, got, from_source, strict=True):
            if data is None:
                continue
            await self.tiers.store(key, data)
            if fresh and self.tiers.shared is not None:
                self.tiers.shared.publish_soon(key, data)
        return flights

    def read_source(self, tag: Tag, first: int, count: int = 1) -> Sequence[Buffer]:
        """Blobs ``first .. first+count-1`` from the source, each zero-filled to the blob size
        (blocking: on the pool)."""
        if tag.source is None:
            if tag.id not in self._told_unavailable:
                self._told_unavailable.add(tag.id)  # once per tag: not a line per read
                log.error("tag %s: blob %s is not staged here or in a shared store, and the "
                          "source is unreachable from this node (%s): reads of it fail (EIO)",
                          tag.name, tag.layout.blob_name(first), tag.source_error)
            raise SourceError(f"source {tag.ctx.src} of tag {tag.name} is unavailable: "
                              f"{tag.source_error}")
        layout = tag.layout
        start = layout.source_range(first)[0]
        end = layout.source_range(first + count - 1)[1]
        try:
            blobs = tag.assimilator.read_blobs(tag.source, tag.ctx, layout, first, count)
        except SourceChanged as exc:
            if not tag.changed_under_mount:
                log.warning("tag %s: %s; its unstaged blobs fail until a remount re-faults "
                            "them from the new version", tag.name, exc)
            tag.changed_under_mount = exc.message
            raise
        except FaultfsError as exc:
            log.error("tag %s: reading %s [%d, %d) failed: %s", tag.name, tag.ctx.src, start,
                      end, exc)
            raise
        except OSError as exc:
            log.error("tag %s: reading %s [%d, %d) failed: %s", tag.name, tag.ctx.src, start,
                      end, exc)
            raise SourceError(f"reading {tag.ctx.src} [{start}, {end}) failed: {exc}") from None
        if len(blobs) != count or any(len(b) != layout.chunk_size for b in blobs):
            raise SourceError(f"assimilator {tag.ctx.format!r} returned blobs of the wrong size "
                              f"for {tag.ctx.src} [{start}, {end})")
        return blobs

    def _count_source_read(self, tag: Tag, first: int, count: int) -> None:
        start = tag.layout.source_range(first)[0]
        end = tag.layout.source_range(first + count - 1)[1]
        self.stats.add("source_reads")
        self.stats.add("source_bytes", end - start)
        self.stats.add("zero_filled_bytes", count * tag.layout.chunk_size - (end - start))
