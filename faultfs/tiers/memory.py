"""The memory tier: recently faulted (and read-ahead) blobs held in memory, least recently used
dropped first, bounded in bytes (``--memory-mb``).

It serves the later pieces of a blob the kernel asks for after its fault, and prefetched
blobs, without a thread hop or a store read.

The blobs of one source run are slices of one buffer. Dropping one of them drops its siblings
too, so a run's buffer is held only while all of its blobs are here and the bytes held stay
within the bound (one hot blob cannot keep a whole run alive).
"""

from __future__ import annotations

import collections

from faultfs.tiers.base import BlobKey, Buffer, Capacity, StoreOutcome, TierTag


class MemoryTier:
    name = "memory"

    def __init__(self, capacity: int) -> None:
        self.limit = capacity
        self.size = 0
        self._blobs: collections.OrderedDict[BlobKey, Buffer] = collections.OrderedDict()
        self._runs: dict[int, set[BlobKey]] = {}  # id(shared buffer) -> its blobs

    def open_tag(self, tag: TierTag) -> None:
        return  # nothing is kept per tag

    def forget_tag(self, tag_id: int) -> None:
        for key in [k for k in self._blobs if k[0] == tag_id]:
            self.discard(key)

    def held(self, key: BlobKey) -> Buffer | None:
        """The whole blob if it is here (no I/O; marks it recently used)."""
        data = self._blobs.get(key)
        if data is not None:
            self._blobs.move_to_end(key)
        return data

    def contains(self, key: BlobKey) -> bool:
        return key in self._blobs

    __contains__ = contains

    async def get(self, key: BlobKey, off: int, size: int) -> Buffer | None:
        data = self.held(key)
        return None if data is None else memoryview(data)[off:off + size]

    async def load(self, key: BlobKey) -> Buffer | None:
        return self.held(key)

    async def put(self, key: BlobKey, data: Buffer) -> StoreOutcome:
        return StoreOutcome.STORED if self.keep(key, data) else StoreOutcome.SKIPPED_CACHE_CAP

    def keep(self, key: BlobKey, data: Buffer) -> bool:
        """Hold ``data`` as blob ``key`` (no I/O); False when it is larger than the tier."""
        if len(data) > self.limit:
            return False
        self.discard(key)
        self._blobs[key] = data
        self.size += len(data)
        run = _shared_buffer(data)
        if run is not None:
            self._runs.setdefault(run, set()).add(key)
        while self.size > self.limit:
            self.discard(next(iter(self._blobs)))
        return True

    async def evict(self, key: BlobKey) -> int:
        before = self.size
        self.discard(key)
        return before - self.size

    def discard(self, key: BlobKey) -> None:
        old = self._blobs.pop(key, None)
        if old is None:
            return
        self.size -= len(old)
        run = _shared_buffer(old)
        siblings = self._runs.pop(run, ()) if run is not None else ()
        for sibling in siblings:
            if sibling != key:
                self.discard(sibling)

    def capacity(self) -> Capacity:
        return Capacity(self.size, self.limit)


def _shared_buffer(data: Buffer) -> int | None:
    """The identity of the buffer ``data`` is a part of, when it is only a part of it."""
    if isinstance(data, memoryview) and data.obj is not None and len(data) < len(data.obj):
        return id(data.obj)
    return None
