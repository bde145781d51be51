"""The read path of clean blobs: memory, a read-ahead in flight, the store, the source (a hit,
a join or a fault), for the engine's reads of chunks and of the whole-object view.

Invariants:
- A read is served from memory, a verified staged blob or bytes just read from the source; a
  failed fault raises (EIO), never zeros.
- Every access is told to the prefetch once (``Prefetcher.note_access``).
- A view read over several blobs is joined in a pooled buffer (``buffers.alloc``): a fresh
  ``bytes`` of a megabyte is a fresh mapping, faulted in page by page and unmapped after its
  reply. What memory holds is taken at once; the rest is faulted together.
"""

from __future__ import annotations

import trio

from faultfs.buffers import SMALL, alloc
from faultfs.engine.faults import Faulter
from faultfs.engine.flights import Flights
from faultfs.engine.prefetch import Prefetcher
from faultfs.engine.tags import Tag
from faultfs.errors import FaultfsError
from faultfs.stats import Stats
from faultfs.tiers.base import Buffer
from faultfs.tiers.multilevel import TierStack

JOIN_ROUND = 64 << 10  # a large read over several blobs is joined in a pooled buffer of this multiple


class CleanReads:
    """Bytes of a tag's clean blobs (a clone's from where its ancestor has them)."""

    def __init__(self, tiers: TierStack, flights: Flights, faults: Faulter,
                 prefetch: Prefetcher, stats: Stats) -> None:
        self.tiers = tiers
        self.flights = flights
        self.faults = faults
        self.prefetch = prefetch
        self.stats = stats

    async def joined(self, tag: Tag, pieces: list[tuple[int, int, int]]) -> Buffer:
        """A view read over several blobs, in one buffer from the pool (a fresh ``bytes`` of
        a megabyte is a fresh mapping, faulted in page by page and unmapped after its
        reply): pieces memory holds are taken at once, the others faulted together."""
        size = sum(length for _, _, length in pieces)
        out = alloc(size if size < SMALL else -(-size // JOIN_ROUND) * JOIN_ROUND)[:size]
        missing: list[tuple[int, int, int, int]] = []
        pos = 0
        for index, inner, length in pieces:
            self.prefetch.note_access(tag, index)
            held = self._held(tag.clean, index, inner, length)
            if held is None:
                missing.append((pos, index, inner, length))
            else:
                out[pos:pos + length] = held
            pos += length
        if not missing:
            return out

        async def one(at: int, index: int, inner: int, length: int) -> None:
            got = await self.blob_bytes(tag, index, inner, length, noted=True)
            out[at:at + len(got)] = got

        try:
            async with trio.open_nursery() as nursery:
                for piece in missing:
                    nursery.start_soon(one, *piece)
        except BaseExceptionGroup as group:
            raise single_error(group) from None
        return out

    def _held(self, tag: Tag, index: int, off: int, size: int) -> Buffer | None:
        """Bytes of clean blob ``index`` that memory holds (or a pending store write), or
        None, at no wait."""
        held = self.tiers.held((tag.id, index))
        return None if held is None else self._memory_hit(held, off, size)

    def _memory_hit(self, held: Buffer, off: int, size: int) -> Buffer:
        self.stats.add("hits")
        self.stats.add("memory_hits")
        return memoryview(held)[off:off + size]

    async def blob_bytes(self, tag: Tag, index: int, off: int, size: int, *,
                         noted: bool = False) -> Buffer:
        """Memory (or a pending store write), a read-ahead in flight, the store, the source:
        the clean chunk, a clone's from where its ancestor has it (``Tag.clean``).
        ``noted``: the prefetch was told of the access already."""
        if not noted:
            self.prefetch.note_access(tag, index)
        tag = tag.clean
        key = (tag.id, index)
        for _ in range(2):  # a second look: see below
            held = self.tiers.held(key)
            if held is None and key in self.flights:
                held = await self.flights.read_ahead(key)
                self.tiers.mark_read(key)  # (memory kept it ahead before it came here)
            if held is not None:
                return self._memory_hit(held, off, size)
            if not self.tiers.contains(key):
                break
            data = await self.tiers.local.get(key, off, size)
            if data is not None:
                self.stats.add("hits")
                return data
            # The staged copy was damaged and is dropped. Another reader that found it so may
            # have re-faulted and stored it meanwhile: look once more before faulting.
        return await self.faults.fault_range(tag, index, off, size)


def single_error(group: BaseExceptionGroup) -> BaseException:
    """The error a reader should see for a group of concurrent failures: a cancellation or
    a non-library error if there is one (they must propagate), else the first FaultfsError."""
    flat: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                walk(inner)
        else:
            flat.append(exc)

    walk(group)
    for exc in flat:
        if not isinstance(exc, FaultfsError):
            return group
    return flat[0]
