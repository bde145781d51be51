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
from the store, one for one. The protection ends at the blob's first read, when its reader
passes it, or once the tier has taken in ``UNREAD_AGE`` times its bound since (a prefetch
nobody came back for does not outstay the blobs readers use). When blobs kept ahead must go,
those furthest from where their file's reader is go first; the blob read last goes only
after all of them (the kernel reads a blob in pieces: its reader is likely in the middle of
it).
The two kinds are kept in two orders, so making room walks only the blobs it may drop.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable

from faultfs.tiers.base import BlobKey, Buffer, Capacity, StoreOutcome, TierTag
from faultfs.tiers.budget import DataBudget

UNREAD_AGE = 2  # an unread blob kept ahead outlasts read ones until this many bounds came in


class MemoryTier:
    name = "memory"

    def __init__(self, capacity: int, budget: DataBudget | None = None) -> None:
        self.limit = capacity
        self.budget = budget if budget is not None else DataBudget(capacity)
        self.size = 0
        self._blobs: dict[BlobKey, Buffer] = {}
        # each blob is in one of two orders: read (or kept not ahead), least recently used
        # first; kept ahead and not read yet, in the order kept -> ``_taken`` then
        self._order: collections.OrderedDict[BlobKey, None] = collections.OrderedDict()
        self._ahead: collections.OrderedDict[BlobKey, int] = collections.OrderedDict()
        self._last_read: BlobKey | None = None  # a reader may be in the middle of it
        self._at: dict[int, int] = {}  # tag -> where its reader is (``reader_at``)
        self.ahead_bytes = 0  # of the blobs kept ahead and not read yet
        self._taken = 0  # bytes taken in so far (the clock the protection of unread ages by)
        self._runs: dict[int, set[BlobKey]] = {}  # id(shared buffer) -> its blobs
        self._runs_ahead: dict[int, int] = {}  # id(shared buffer) -> its blobs in ``_ahead``
        self._pins: dict[BlobKey, int] = {}  # blobs that must stay (their bytes are held anyway)
        self.budget.bind(lambda: self.size, self.pinned_bytes, self.shrink)

    def open_tag(self, tag: TierTag) -> None:
        return  # nothing is kept per tag

    def forget_tag(self, tag_id: int) -> None:
        for key in [k for k in self._blobs if k[0] == tag_id]:
            self.discard(key)
        self._at.pop(tag_id, None)

    def held(self, key: BlobKey) -> Buffer | None:
        """The whole blob if it is here (no I/O; marks it recently used, and read)."""
        data = self._blobs.get(key)
        if data is not None:
            if not (self._ahead and self._unprotect(key)):
                self._order.move_to_end(key)
            self._last_read = key
        return data

    def reader_at(self, key: BlobKey) -> None:
        """A file's reader is at blob ``key``: the blobs kept ahead of it that must go go
        furthest from here first."""
        self._at[key[0]] = key[1]

    def ahead_count(self, tag_id: int, lo: int, hi: int) -> int:
        """Blobs ``lo .. hi-1`` of tag ``tag_id`` kept ahead and not read yet."""
        if not self._ahead:
            return 0
        return sum((tag_id, i) in self._ahead for i in range(lo, hi))

    def peek(self, key: BlobKey) -> Buffer | None:
        """The whole blob if it is here, its place in the orders unchanged (not a read)."""
        return self._blobs.get(key)

    def demote(self, key: BlobKey) -> None:
        """Blob ``key`` is the next to drop (a sequential reader has passed it): the blobs
        prefetched ahead of the reader, which it has not read yet, stay longer. Not a slice
        of a run's buffer: dropping it would drop the run's other blobs, ahead of the
        reader, with it."""
        data = self._blobs.get(key)
        if data is None:
            return
        self._unprotect(key)  # (skipped: no longer ahead of its reader)
        if _shared_buffer(data) is None:
            self._order.move_to_end(key, last=False)
        if self._last_read == key:
            self._last_read = None

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
        run = _shared_buffer(data)
        if run is not None:
            self._runs.setdefault(run, set()).add(key)
        if ahead:
            self._ahead[key] = self._taken
            self.ahead_bytes += len(data)
            if run is not None:
                self._runs_ahead[run] = self._runs_ahead.get(run, 0) + 1
        else:
            self._order[key] = None
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
        """Drop blobs until the tier fits in what the budget's other holders leave: blobs
        read, least recently used first (not a slice of a run still ahead, nor the blob
        read last: its reader may be in the middle of it); then blobs kept ahead and not
        read yet, the furthest from where their file's reader is first (a window's runs
        land out of order; blobs a reader skipped lie behind it; two files' readers are
        each at their own place); the blob read last at the very end. Pinned blobs (and
        their runs' other blobs) stay."""
        budget = self.budget
        room = self.limit - budget.outside()
        if self.size > room:
            self._age()
            last = self._last_read
            self._drop(room, list(self._order), lambda key: key == last or self._run_ahead(key))
            if self.size > room:  # (rarely: the prefetch's window stops short of this)
                far = sorted(self._ahead, key=self._distance, reverse=True)
                self._drop(room, [*far, last])
        budget.note()

    def _drop(self, room: int, keys: Iterable[BlobKey | None],
              spare: Callable[[BlobKey], bool] = lambda key: False) -> None:
        """Drop ``keys`` in turn (those still here, not pinned, not ``spare``d) until the
        tier fits in ``room``."""
        for key in keys:
            if self.size <= room:
                return
            if (key is not None and key in self._blobs and not spare(key)
                    and not self._pinned(key)):
                self.discard(key)

    def _age(self) -> None:
        """Blobs kept ahead that nobody read while ``UNREAD_AGE`` times the bound came in
        lose their place: they are the first to drop."""
        young = self._taken - UNREAD_AGE * self.limit
        while self._ahead:
            key, taken = next(iter(self._ahead.items()))
            if taken > young:
                return
            self._unprotect(key)
            self._order.move_to_end(key, last=False)

    def _distance(self, key: BlobKey) -> int:
        """How far blob ``key`` lies from its file's reader (``reader_at``), either way."""
        return abs(key[1] - self._at.get(key[0], key[1]))

    def _unprotect(self, key: BlobKey) -> bool:
        """Move ``key`` (here) from the blobs kept ahead to the end of the blobs read;
        whether it was kept ahead."""
        if self._ahead.pop(key, None) is None:
            return False
        self._order[key] = None
        self.ahead_bytes -= len(self._blobs[key])
        run = _shared_buffer(self._blobs[key])
        if run is not None:
            left = self._runs_ahead.pop(run) - 1
            if left:
                self._runs_ahead[run] = left
        return True

    def _run_ahead(self, key: BlobKey) -> bool:
        """Whether ``key`` is a slice of a run with blobs kept ahead (they go with it)."""
        if not self._runs_ahead:
            return False
        run = _shared_buffer(self._blobs[key])
        return run is not None and run in self._runs_ahead

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
        if key not in self._blobs:
            return
        self._unprotect(key)
        old = self._blobs.pop(key)
        self._order.pop(key, None)
        if self._last_read == key:
            self._last_read = None
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
