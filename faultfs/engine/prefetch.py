"""Prefetch: sequential readers of a tag get the blobs ahead of them faulted (or read ahead from
the store) in the background, so their later reads are memory hits.

A read of the blob last read or of one a few blobs after it is sequential (the kernel's
readahead arrives slightly out of order); the window then doubles up to the prefetch budget.
Any other read resets it: random readers get no prefetch. Blobs ahead that are not staged are
faulted in runs the layout can fetch with one source read (``BlobLayout.coalesce``), up to
``PREFETCH_RUN_BYTES`` each; staged ones are read from the store in runs of up to
``LOAD_RUN_BYTES`` with one trip to the I/O pool.

Invariants:
- Prefetch claims flights like any fault, so a reader arriving meanwhile joins it.
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
from faultfs.iopool import IoPool
from faultfs.stats import Stats
from faultfs.tiers.multilevel import TierStack

log = logging.getLogger("faultfs.engine")

LOAD_RUN_BYTES = 4 << 20  # adjacent staged blobs read ahead in one trip to the I/O pool
PREFETCH_RUN_BYTES = 8 << 20  # adjacent blobs fetched ahead in one source read: one request


class Prefetcher:
    def __init__(self, config: Config, flights: Flights, tiers: TierStack, faulter: Faulter,
                 pool: IoPool, stats: Stats) -> None:
        self.budget = min(config.prefetch_mb << 20, (config.memory_mb << 20) // 2)
        self.flights = flights
        self.tiers = tiers
        self.faulter = faulter
        self.pool = pool
        self.stats = stats
        self.in_flight = 0  # blobs being prefetched or read ahead
        self.closing = False
        self._nursery: trio.Nursery | None = None

    def attach(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery

    def note_access(self, tag: Tag, index: int) -> None:
        """Track sequential readers of ``tag``; start what runs ahead of them."""
        last = tag.last_index
        if index == last:
            return
        sequential = last >= 0 and last < index <= last + 1 + max(1, tag.window)
        tag.last_index = index
        layout = tag.layout
        cs = layout.chunk_size
        limit = self.budget // cs
        nursery = self._nursery
        if not sequential or limit <= 0 or nursery is None or self.closing:
            tag.window = 0
            return
        tag.window = min(limit, max(1, tag.window * 2))
        max_run = max(1, PREFETCH_RUN_BYTES // cs)
        max_load = max(1, LOAD_RUN_BYTES // cs)
        run_start, run_len = -1, 0
        load: list[int] = []  # adjacent staged blobs ahead, read from the store in one trip
        for ahead in range(index + 1, min(index + 1 + tag.window, layout.num_blobs) + 1):
            key = (tag.id, ahead)
            free = (ahead < layout.num_blobs and key not in self.flights
                    and not self.tiers.is_held(key)
                    and self.in_flight + len(load) + run_len < limit)
            staged = free and self.tiers.contains(key)
            if load and not (staged and len(load) < max_load):
                self._start_load(nursery, tag, load)
                load = []
            if staged:
                load.append(ahead)
            wanted = free and not staged
            if wanted and run_len < max_run and (
                    run_len == 0 or layout.coalesce(run_start, run_len + 1) == run_len + 1):
                if run_len == 0:
                    run_start = ahead
                run_len += 1
                continue
            if run_len:
                self._start_fault(nursery, tag, run_start, run_len)
            run_start, run_len = (ahead, 1) if wanted else (-1, 0)
        if load:
            self._start_load(nursery, tag, load)

    def _start_fault(self, nursery: trio.Nursery, tag: Tag, first: int, count: int) -> None:
        self.in_flight += count
        flights = self.flights.claim((tag.id, i) for i in range(first, first + count))
        nursery.start_soon(self._prefetch, tag, first, flights)

    async def _prefetch(self, tag: Tag, first: int, flights: list[Flight]) -> None:
        count = len(flights)
        try:
            self.stats.add("prefetches", count)
            await self.faulter.fault_run(tag, first, flights)
            if flights[0].error is not None:
                self.stats.add("prefetch_errors", count)
        except Exception:  # a background task must never take the mount down
            log.exception("prefetch of blobs %d.. of tag %s failed", first, tag.name)
            self.stats.add("prefetch_errors", count)
        finally:
            self.in_flight -= count

    def _start_load(self, nursery: trio.Nursery, tag: Tag, indices: list[int]) -> None:
        """Claim adjacent staged blobs and read them ahead in the background."""
        keys = [(tag.id, index) for index in indices]
        flights = self.flights.claim(keys, from_store=True)
        self.in_flight += len(indices)
        nursery.start_soon(self._load_ahead, tag, keys, flights)

    async def _load_ahead(self, tag: Tag, keys: list[tuple[int, int]],
                          flights: list[Flight]) -> None:
        """Read staged blobs ahead of a sequential reader into memory (verified), a run of
        adjacent ones in one trip to the pool, so their reads are served without one. On any
        trouble the readers fall back to the normal path."""
        try:
            datas = await self.pool.run(self.tiers.read_ahead_blocking, keys)
            for key, flight, data in zip(keys, flights, datas, strict=True):
                if data is not None:
                    flight.data = data
                    self.tiers.fill(key, data)
                    self.stats.add("store_readahead")
        except Exception:  # a background task must never take the mount down
            log.exception("read-ahead of blobs %s of tag %s failed", keys, tag.name)
        finally:
            self.flights.settle(keys, flights)
            self.in_flight -= len(keys)
