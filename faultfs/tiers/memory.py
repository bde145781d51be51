"""The memory tier: recently faulted (and read-ahead) blobs held in memory, least recently used
dropped first, bounded in bytes (``--memory-mb``) together with what the daemon holds for data
elsewhere (``budget.DataBudget``: source reads in flight, publishes waiting).

It serves the later pieces of a blob the kernel asks for after its fault, and prefetched
blobs, without a thread hop or a store read.

The blobs of one source run are slices of one buffer. Dropping one of them drops its siblings
too, so a run's buffer is held only while all of its blobs are here and the bytes held stay
within the bound (one hot blob cannot keep a whole run alive).

A pinned blob (its store write pending: its bytes are held anyway) is never dropped, nor are
the other blobs of its run; it counts against the bound like any other. With everything
pinned the tier may pass the bound until a pin goes (the pins are bounded by their holder).

A blob kept ahead of its readers (prefetched, ``keep(ahead=True)``) and not read yet is
dropped only after every blob read before: a reader slower than its prefetch (h5py decoding
as it reads) has the window's landed blobs waiting here, older than the blobs it just read,
and least-recently-used order would drop the next ones it needs and have them read back
from the store, one for one. The protection ends at the blob's first read, or once the tier
has taken in ``UNREAD_AGE`` times its bound since (a prefetch nobody came back for does not
outstay the blobs readers use).
"""

from __future__ import annotations

import collections

from faultfs.tiers.base import BlobKey, Buffer, Capacity, StoreOutcome, TierTag
from faultfs.tiers.budget import DataBudget

UNREAD_AGE = 2  # an unread blob kept ahead outlasts read ones until this many bounds came in


class MemoryTier:
    name = "memory"

    def __init__(self, capacity: int, budget: DataBudget | None = None) -> None:
        self.limit = capacity
        self.budget = budget if budget is not None else DataBudget(capacity)
        self.size = 0
        self._blobs: collections.OrderedDict[BlobKey, Buffer] = collections.OrderedDict()
        self._runs: dict[int, set[BlobKey]] = {}  # id(shared buffer) -> its blobs
        self._pins: dict[BlobKey, int] = {}  # blobs that must stay (their bytes are held anyway)
        self._unread: dict[BlobKey, int] = {}  # kept ahead, not read yet -> ``_taken`` then
        self._taken = 0  # bytes taken in so far (the clock the protection of unread ages by)
        self.budget.bind(lambda: self.size, self.pinned_bytes, self.shrink)

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
            if self._unread:
                self._unread.pop(key, None)
        return data

    def demote(self, key: BlobKey) -> None:
        """Blob ``key`` is the next to drop (a sequential reader has passed it): the blobs
        prefetched ahead of the reader, which it has not read yet, stay longer. Not a slice
        of a run's buffer: dropping it would drop the run's other blobs, ahead of the
        reader, with it."""
        data = self._blobs.get(key)
        if data is not None:
            self._unread.pop(key, None)  # read or skipped: no longer ahead of its reader
            if _shared_buffer(data) is None:
                self._blobs.move_to_end(key, last=False)

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

    def keep(self, key: BlobKey, data: Buffer, *, ahead: bool = False) -> bool:
        """Hold ``data`` as blob ``key`` (no I/O); False when it is larger than the tier.
        ``ahead``: kept ahead of its readers (a prefetch), dropped after the blobs read."""
        if len(data) > self.limit:
            return False
        self.discard(key)
        self._blobs[key] = data
        self.size += len(data)
        self._taken += len(data)
        if ahead:
            self._unread[key] = self._taken
        run = _shared_buffer(data)
        if run is not None:
            self._runs.setdefault(run, set()).add(key)
        self.shrink()
        return True

    def pin(self, key: BlobKey) -> None:
        self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, key: BlobKey) -> None:
        left = self._pins.get(key, 0) - 1
        if left > 0:
            self._pins[key] = left
            return
        self._pins.pop(key, None)
        self.shrink()
        self.budget.wake()

    def pinned_bytes(self) -> int:
        """Bytes held here that cannot be dropped: pinned blobs and their runs' others."""
        if not self._pins:
            return 0
        return sum(len(data) for key, data in self._blobs.items() if self._pinned(key))

    def shrink(self) -> None:
        """Drop least recently used blobs until the tier fits in what the budget's other
        holders leave, blobs kept ahead and not read yet last; pinned blobs (and their
        runs' other blobs) stay."""
        budget = self.budget
        room = self.limit - budget.outside()
        if self.size > room:
            young = self._taken - UNREAD_AGE * self.limit  # kept ahead since: protected
            for last in (False, True):  # blobs kept ahead and not read yet: last
                for key in list(self._blobs):
                    if self.size <= room:
                        break
                    if key in self._blobs and not self._pinned(key) and (
                            last or not self._unread_ahead(key, young)):
                        self.discard(key)
        budget.note()

    def _unread_ahead(self, key: BlobKey, young: int) -> bool:
        """Whether ``key`` (or another blob of its run, which goes with it) was kept ahead
        of its readers after ``young`` and is not read yet."""
        if not self._unread:
            return False
        if self._unread.get(key, young) > young:
            return True
        run = _shared_buffer(self._blobs[key])
        return run is not None and any(self._unread.get(k, young) > young
                                       for k in self._runs.get(run, ()))

    def _pinned(self, key: BlobKey) -> bool:
        if not self._pins:
            return False
        if key in self._pins:
            return True
        run = _shared_buffer(self._blobs[key])
        return run is not None and any(k in self._pins for k in self._runs.get(run, ()))

    async def evict(self, key: BlobKey) -> int:
        before = self.size
        self.discard(key)
        return before - self.size

    def discard(self, key: BlobKey) -> None:
        """Drop blob ``key`` and the other blobs of its run (pins aside: a blob evicted on
        purpose, e.g. its tag forgotten, goes)."""
        old = self._blobs.pop(key, None)
        if old is None:
            return
        self._unread.pop(key, None)
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
