"""The tiers of a mount composed nearest first: memory, the local store, then (with
``--shared-store``) the shared store of every node (DESIGN §5.1, §13).

A faulted blob is held in memory at once and written to the local store behind the reader
(in the mount's nursery, when one is attached), its bytes held until they are on disk so no
reader faults the same blob twice (pinned in the memory tier meanwhile); the bytes waiting
for their store write are bounded (``attach``), and so are the publishes waiting, both within
the data budget of ``--memory-mb`` (tiers/budget.py). A blob read ahead from a farther tier
fills the nearer ones.

Invariants:
- ``held`` answers from memory or from a pending store write, with no I/O and no await.
- ``drain`` returns once every pending store write is done; a store failure is counted and
  logged, never raised to a reader (the reader already has its bytes).
"""

from __future__ import annotations

import logging
import time

import trio

from faultfs.iopool import IoPool
from faultfs.stats import Stats
from faultfs.tiers.base import BlobKey, Buffer, TierTag
from faultfs.tiers.budget import PUBLISH_SHARE, STORE_SHARE
from faultfs.tiers.local import LocalTier, ScanResult
from faultfs.tiers.memory import MemoryTier
from faultfs.tiers.shared import SharedTier

log = logging.getLogger("faultfs.tiers")

STORE_PAUSE_POLL_S = 0.002  # a run paused for the store writes looks again this often ...
STORE_PAUSE_MAX_S = 10.0  # ... and goes on after this (a stuck store must not stall reads)


class TierStack:
    def __init__(self, memory: MemoryTier, local: LocalTier, pool: IoPool, stats: Stats,
                 shared: SharedTier | None = None) -> None:
        self.memory = memory
        self.budget = memory.budget
        self.local = local
        self.shared = shared
        if shared is not None:  # publishes waiting hold their blobs: within the budget
            shared.budget = min(shared.budget, self.budget.share(PUBLISH_SHARE))
            self.budget.count(lambda: shared.waiting)
            shared.freed = self.budget.wake  # a publish that ends makes room
        self.pool = pool
        self.stats = stats
        self._pending: dict[BlobKey, Buffer] = {}  # faulted, being written to the local tier
        self._waiters: dict[BlobKey, trio.Event] = {}  # who waits for a pending store write
        self._background: trio.Nursery | None = None
        self._slots: trio.Semaphore | None = None
        self._slot_count = 0  # (read by worker threads: ``wait_for_store``)
        self._landing: dict[int, list[int]] = {}  # source reads' tallies (``landing``)
        self.store_pauses_cut = 0  # pauses for the store writes that ran out of time

    def open_tag(self, tag: TierTag, *, trusted: bool = False) -> ScanResult:
        self.memory.open_tag(tag)
        if self.shared is not None:
            self.shared.open_tag(tag)
        return self.local.open_tag(tag, trusted=trusted)

    def forget_tag(self, tag_id: int) -> None:
        self.memory.forget_tag(tag_id)
        self.local.forget_tag(tag_id)
        if self.shared is not None:
            self.shared.tags.pop(tag_id, None)

    def attach(self, nursery: trio.Nursery, blob_size: int) -> None:
        """Write faulted blobs to the store in ``nursery`` (the mount's), off the reader's path,
        with at most a quarter of the data budget in blobs of ``blob_size`` (two at least)
        waiting for their write. Without it (unit tests, embedding) a fault stores before it
        returns."""
        self._background = nursery
        budget = self.budget.share(STORE_SHARE)
        self._slot_count = max(2, budget // max(1, blob_size))
        self._slots = trio.Semaphore(self._slot_count)
        self.local.raise_open_cap()
        if self.shared is not None:
            self.shared.attach(nursery)

    # -- reads -------------------------------------------------------------------------------

    def held(self, key: BlobKey) -> Buffer | None:
        """The whole blob when memory holds it or its store write is pending (no I/O)."""
        data = self.memory.held(key)
        if data is None:
            data = self._pending.get(key)
        if data is not None:
            self.local.touch(key)
        return data

    @property
    def ahead_bytes(self) -> int:
        """Bytes memory holds kept ahead of their readers and not read yet (all files)."""
        return self.memory.ahead_bytes

    def ahead_count(self, tag_id: int, lo: int, hi: int) -> int:
        """Blobs ``lo .. hi-1`` of a tag that memory keeps ahead of their reader."""
        return self.memory.ahead_count(tag_id, lo, hi)

    def reader_at(self, key: BlobKey) -> None:
        """A file's reader is at blob ``key`` (the prefetch's stream: a look back at a blob
        behind it is not a move): what memory drops of the blobs kept ahead goes by it."""
        self.memory.reader_at(key)

    def peek(self, key: BlobKey) -> Buffer | None:
        """As ``held``, not a read: memory's orders stay as they are."""
        data = self.memory.peek(key)
        return self._pending.get(key) if data is None else data

    def mark_read(self, key: BlobKey) -> None:
        """A reader took blob ``key`` from its flight, not from memory: memory holds it as
        read (no longer ahead of its readers) and recently used."""
        self.memory.held(key)

    def is_held(self, key: BlobKey) -> bool:
        return key in self.memory or key in self._pending

    def contains(self, key: BlobKey) -> bool:
        """Staged in a store tier (a read may still find it damaged: then it is a miss)."""
        return self.local.contains(key)

    async def get(self, key: BlobKey, off: int, size: int) -> Buffer | None:
        """Bytes of a blob from the nearest tier that has it, or None."""
        data = self.held(key)
        if data is not None:
            return memoryview(data)[off:off + size]
        return await self.local.get(key, off, size)

    def read_ahead_blocking(self, keys: list[BlobKey]) -> list[Buffer | None]:
        """Whole blobs from the local store (blocking, on the pool); the caller fills memory."""
        return self.local.load_blocking(keys)

    def passed(self, key: BlobKey) -> None:
        """A sequential reader has moved past blob ``key``: memory drops it before the blobs
        ahead of the reader it has not read yet."""
        self.memory.demote(key)

    def fill(self, key: BlobKey, data: Buffer, *, ahead: bool = False) -> None:
        """Hold a blob read from a farther tier in the nearer one (memory); ``ahead``: read
        ahead of its readers (``MemoryTier.keep``)."""
        self.memory.keep(key, data, ahead=ahead)

    # -- faulted blobs -----------------------------------------------------------------------

    def hold(self, key: BlobKey, data: Buffer, *, ahead: bool = False) -> None:
        """Keep a just-faulted blob where readers find it at once, until it is stored
        (pinned in memory until then: its bytes are held either way); ``ahead``: faulted
        ahead of its readers (``MemoryTier.keep``)."""
        self.memory.pin(key)  # first: the tier must not drop it to make room for it
        self.memory.keep(key, data, ahead=ahead)
        self._pending[key] = data

    async def store(self, key: BlobKey, data: Buffer) -> None:
        """Write a held blob to the local store: behind the reader when attached."""
        if self._background is None or self._slots is None:
            try:
                await self.local.put(key, data)
            finally:
                self._done(key)
            return
        try:
            await self._slots.acquire()  # back-pressure: bounded bytes await storing
        except BaseException:
            self._done(key)
            raise
        self._background.start_soon(self._store_behind, key, data)

    def pin(self, key: BlobKey) -> None:
        """A held blob its holder still references: memory keeps it (dropping it would free
        nothing) and counts it, until ``unpin``."""
        self.memory.pin(key)

    def unpin(self, keys: list[BlobKey]) -> None:
        for key in keys:
            self.memory.unpin(key)

    def landing(self) -> list[int]:
        """A source read's tally of blobs landed (counted by its worker thread) and taken
        in (handed to memory and the store queue, counted on the trio thread), until
        ``landed``: the ones between wait for their store write too (``wait_for_store``)."""
        tally = [0, 0]
        self._landing[id(tally)] = tally
        return tally

    def landed(self, tally: list[int]) -> None:
        self._landing.pop(id(tally), None)

    def _waiting(self) -> int:
        """Blobs waiting for their store write: queued, or landed and not taken in yet."""
        return len(self._pending) + sum(got - taken
                                        for got, taken in list(self._landing.values()))

    def wait_for_store(self) -> None:
        """(Blocking, on a worker thread) Wait while more blobs wait for their store write
        than it has slots for: a run that lands blob by blob pauses between blobs so that a
        store slower than the source does not fill memory with them (a reader waiting for
        the next blob waits for the store, as a reader's own fault waits for room in the
        budget); after ``STORE_PAUSE_MAX_S`` it goes on (a stuck store must not stall
        reads for good). Blobs landed that the trio thread has not taken in yet count as
        waiting: the queue does not show them yet, and a busy trio thread would let the
        runs land more."""
        slots = self._slot_count
        if not slots or self._waiting() <= slots:
            return
        deadline = time.monotonic() + STORE_PAUSE_MAX_S
        while self._waiting() > slots:
            if time.monotonic() >= deadline:
                self.store_pauses_cut += 1  # (a worker thread's count: a hint, not exact)
                log.warning("the store writes have not caught up in %.0f s: a prefetch run "
                            "goes on without them", STORE_PAUSE_MAX_S)
                return
            time.sleep(STORE_PAUSE_POLL_S)

    def store_soon(self, key: BlobKey, data: Buffer) -> bool:
        """See that a held blob is written to the store behind the caller, without waiting
        for a slot: at once if one is free, else as soon as one is (a run's blobs as each
        lands, while the run goes on — a run that waited for its own blobs' slots while
        paused for the store writes would wait for itself). False without a background
        nursery: the caller is to ``store`` it."""
        if self._background is None or self._slots is None:
            return False
        try:
            self._slots.acquire_nowait()
        except trio.WouldBlock:
            self._background.start_soon(self.store, key, data)  # it waits for the slot
        else:
            self._background.start_soon(self._store_behind, key, data)
        return True

    async def _store_behind(self, key: BlobKey, data: Buffer) -> None:
        try:
            await self._put_quietly(key, data)
        finally:
            assert self._slots is not None
            self._slots.release()

    async def _put_quietly(self, key: BlobKey, data: Buffer) -> None:
        """Store a pending blob in the background, then end its pending state; a failure is
        logged and counted (a background task must never take the mount down)."""
        try:
            await self.local.put(key, data)
        except Exception:
            log.exception("storing blob %s failed", key)
            self.stats.add("store_failures")
        finally:
            self._done(key)

    def _done(self, key: BlobKey) -> None:
        self._pending.pop(key, None)
        self.memory.unpin(key)
        waiter = self._waiters.pop(key, None)
        if waiter is not None:
            waiter.set()

    def stage_behind(self, key: BlobKey, data: Buffer) -> bool:
        """See that a just-faulted blob ends up in the local store, behind the caller: after
        its pending store write, once more if that one did not keep it (a store write the
        policy skipped). False without a background nursery: the caller stores it itself."""
        if self._background is None:
            return False
        self._background.start_soon(self._stage_after, key, data)
        return True

    async def _stage_after(self, key: BlobKey, data: Buffer) -> None:
        await self.wait_stored(key)
        if self.local.contains(key) or key in self._pending:
            return
        self.memory.pin(key)  # as ``hold`` does: ``_done`` lets go of it
        self._pending[key] = data  # drain waits for it too
        await self._put_quietly(key, data)

    async def wait_stored(self, key: BlobKey) -> None:
        """Return once the pending store write of ``key`` is over (at once when none is),
        woken by its end rather than by polling."""
        if key not in self._pending:
            return
        waiter = self._waiters.get(key)
        if waiter is None:
            waiter = self._waiters[key] = trio.Event()
        await waiter.wait()

    def pending_of(self, tag_id: int) -> bool:
        return any(key[0] == tag_id for key in self._pending)

    @property
    def pending_stores(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        self.local.close()
