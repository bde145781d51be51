"""The local tier: staged blobs in the embedded store (a directory of blob files, ``store/``),
read verified block by block and written under the store policy (``tiers/policy.py``).

``LocalTier`` composes its rooms: which blobs are staged (``staged.py``), the blob files kept
open for hits (``openfiles.py``), reads through io_uring (``ringreads.py``); it chooses the
path of each read, and writes and evicts blobs.

Invariants:
- A read is served only from a blob file whose header matched its tag, name and source
  version and whose blocks verified in the same read; a torn, foreign or stale clean blob is
  dropped and reported as a miss (the engine re-faults it). A damaged dirty blob raises EIO.
- Staged reads up to ``RING_READ`` go through io_uring from the serving thread
  (``tiers/uring.py``): a miss of the page cache waits for the disk without blocking the
  thread and without a trip to the I/O pool, so the disk reads of concurrent readers overlap.
  When the thread has nothing else to do (no FUSE request waiting, no ring read in flight), a
  small read (``--inline-read-kb``) blocks it instead: one disk read then costs less than a
  ring entry's wake-ups. Without a ring (``FAULTFS_URING=0``, an old kernel) small reads block
  the thread as before; a larger one first tries ``RWF_NOWAIT`` (served only from the page
  cache, never blocking) before its trip to the I/O pool, and with ``--inline-read-kb 0``
  every staged read that misses the page cache goes to the pool.
- A blob file is never closed while a read of it is in flight.
- Dirty blobs (user data) are never evicted or replaced by a fault.
"""

from __future__ import annotations

import errno
import functools
import logging

import trio

from faultfs.errors import CorruptionError, FaultfsError, StoreFull
from faultfs.iopool import IoPool
from faultfs.stats import Stats
from faultfs.store.blobfile import FLAG_NO_FAULT, HEADER_LEN
from faultfs.store.blobstore import BlobStore, OpenBlob
from faultfs.tiers import uring
from faultfs.tiers.base import BlobKey, Buffer, Capacity, OpenBlobWatcher, StoreOutcome, TierTag
from faultfs.tiers.local.openfiles import OpenBlobs
from faultfs.tiers.local.ringreads import RingReads
from faultfs.tiers.local.staged import ScanResult, StagedSet, scan
from faultfs.tiers.policy import StorePolicy
from faultfs.tiers.uring import RingReader

log = logging.getLogger("faultfs.tiers")

# Staged reads up to this go through io_uring. Larger ones go to the I/O pool: there the
# checksums of a 1 MiB read (~0.2 ms) overlap the serving thread's 1 MiB replies, which on the
# ring would wait for them (seq warm halved, docs/benchmarks.md "Staged reads").
RING_READ = 256 << 10
SCAN_PIECE = 64 << 10  # bitmap bytes open_ahead scans between checkpoints (512 Ki blobs)


class LocalTier:
    name = "local"

    def __init__(self, store: BlobStore, policy: StorePolicy, pool: IoPool, stats: Stats, *,
                 inline_read: int, ring: str = "on", ring_read: int = RING_READ,
                 ring_punt: bool = True) -> None:
        self.store = store
        self.policy = policy
        self.pool = pool
        self.stats = stats
        self.inline_read = inline_read
        # staged reads up to ring_read through io_uring: Config.uring ("on", "always", "off")
        self.use_ring = ring != "off"
        # "on": a small read the serving thread can afford to block on takes the blocking path
        self.block_when_idle = ring != "always"
        self.ring_read = ring_read
        self.ring_punt = ring_punt  # ring reads start in the kernel's worker (Config.uring_punt)
        self._reader: RingReader | None = None
        self._idle = uring.IdleProbe()
        self._ring_reads = RingReads(store, stats)
        self._tags: dict[int, TierTag] = {}
        self._staged: dict[int, StagedSet] = {}
        self._open = OpenBlobs()  # recently read blob files, kept open
        self._pinned: set[BlobKey] = set()  # clean bases of dirty blobs: never evicted
        self._stored = 0  # blobs stored so far: ``get`` drops no copy stored across its read

    def requests_wait_in(self, fd: int) -> None:
        """FUSE requests for this process wait in ``fd`` (not in its ``/dev/fuse``): the idle
        probe of the blocking path polls that."""
        self._idle.use(fd)

    def watch(self, watcher: OpenBlobWatcher | None) -> None:
        """Tell ``watcher`` of every blob file this tier holds open, from now on (those open
        already first) until it lets each go; None stops telling."""
        self._open.watch(watcher)

    # -- tags --------------------------------------------------------------------------------

    def open_tag(self, tag: TierTag, *, trusted: bool = False) -> ScanResult:
        """Mark the blobs the store holds for ``tag`` (blocking; payloads are verified on read).

        ``trusted``: the tag's recorded source version is the current one, so every clean
        blob in its directory was staged from it — a listing and a ``stat`` per blob, no
        header read (a remount with millions of staged blobs opens none of them). Otherwise
        each header is read and blobs of another version are dropped now. Either way a read
        checks the header again and re-faults a blob that is torn, foreign or stale."""
        self._tags[tag.id] = tag
        staged = self._staged[tag.id] = StagedSet(tag.num_blobs)
        result = scan(self.store, self.policy, tag, staged, trusted=trusted)
        self._trim()
        return result

    def _trim(self) -> None:
        """Evict least-recently-used clean blobs until the store is under its cap (blocking,
        at open): a store can be over it when it is opened — a lower ``--cache-size``, a
        blob stored as its daemon died, one kept because its header read as dirty."""
        victims = self.policy.victims(0, lambda key: False)
        if victims:
            named = self._let_go(victims)
            self._settle(named, *_drop_victims(self.store, named))

    def forget_tag(self, tag_id: int) -> None:
        """Stop holding blobs of a tag that is unregistered (its files are the caller's)."""
        staged = self._staged.pop(tag_id, None)
        self._tags.pop(tag_id, None)
        if staged is not None:
            for index in staged.indices():
                self.policy.forget((tag_id, index))
        self._open.forget_tag(tag_id)
        self._pinned = {k for k in self._pinned if k[0] != tag_id}

    def contains(self, key: BlobKey) -> bool:
        staged = self._staged.get(key[0])
        return staged is not None and key[1] in staged

    def staged_count(self, tag_id: int) -> int:
        staged = self._staged.get(tag_id)
        return 0 if staged is None else staged.count

    def touch(self, key: BlobKey) -> None:
        self.policy.touch(key)

    def pin(self, key: BlobKey) -> None:
        """Keep a staged blob out of eviction (it is the base of a dirty blob)."""
        if key in self._pinned:
            return
        self._pinned.add(key)
        self.policy.forget(key)

    def pinned(self, key: BlobKey) -> bool:
        """Whether ``key`` is pinned: the base of a dirty blob, kept out of eviction."""
        return key in self._pinned

    def unpin(self, key: BlobKey) -> None:
        if key in self._pinned:
            self._pinned.discard(key)
            tag = self._tags.get(key[0])
            if tag is not None and self.contains(key):
                self.policy.note_stored(key, tag.blob_size + HEADER_LEN)

    # -- reads -------------------------------------------------------------------------------

    async def get(self, key: BlobKey, off: int, size: int) -> Buffer | None:
        """Bytes of a staged blob, verified block by block; None when it turned out torn,
        foreign or stale (it is dropped and the caller re-faults it)."""
        staged = self._staged.get(key[0])
        if staged is None or key[1] not in staged:
            return None
        stored = self._stored  # a re-fault may store a good copy while this finds a bad one
        ring = self._ring() if self.inline_read and size <= self.ring_read else None
        if (ring is not None and self.block_when_idle and size <= self.inline_read
                and not ring.in_flight and self._idle.idle()):
            ring = None  # nothing else to do meanwhile: one blocking read costs less
        blob = self._open.lookup(key)
        first_read: Buffer | CorruptionError | None = None
        if blob is None:
            tag = self._tags[key[0]]
            try:  # open and first read together
                if ring is not None:
                    blob, first_read = await self._ring_reads.open_and_read(ring, tag, key[1],
                                                                            size, off)
                else:
                    blob, first_read = await self._store_read(
                        size, self._open_and_read, tag, tag.blob_name(key[1]), size, off,
                        False)
            except CorruptionError as exc:
                raise FaultfsError(str(exc), errno.EIO) from None
            if blob is None:
                if self._stored == stored:  # else the caller looks again (CleanReads.blob_bytes)
                    self._unstage(key)
                return None
            blob = self._open.add(key, blob)  # or the one another reader opened meanwhile
        self.policy.touch(key)
        self._open.hold(key)
        try:
            if first_read is not None:
                if isinstance(first_read, CorruptionError):
                    raise first_read
                return first_read
            if ring is not None:
                return await self._ring_reads.read(ring, blob, size, off)
            if size > self.inline_read:  # bound for the pool: page-cache hits need no trip
                data = blob.pread_view(size, off, nowait=True)  # never blocks
                if data is not None:
                    return data
            return await self._store_read(size, blob.pread_view, size, off)  # (blocks either way)
        except CorruptionError as exc:
            tag = self._tags[key[0]]
            log.warning("tag %s: %s", tag.name, exc)
            self._open.drop(key)
            try:
                removed = await self.pool.run(functools.partial(
                    self.store.discard_damaged, tag.name, tag.blob_name(key[1]), ino=blob.ino))
            except CorruptionError as dirty:
                raise FaultfsError(str(dirty), errno.EIO) from None
            if removed and self._stored == stored:  # else another reader dropped it, or
                self._unstage(key)  # a copy was stored meanwhile: the caller looks again
            return None
        finally:
            self._open.release(key, blob)

    async def open_ahead(self, tag_id: int, batch: int = 64) -> int:
        """Open the tag's staged blobs that are not open yet, into the open-file cache's free
        room only (nothing open is let go for them), a batch at a time on one pool thread: a
        watcher's own reader (the fast read path) then serves their first reads too. Returns
        how many it opened."""
        tag, staged = self._tags.get(tag_id), self._staged.get(tag_id)
        if tag is None or staged is None or not staged.count:
            return 0
        opened, todo = 0, []
        for start in range(0, len(staged.bits), SCAN_PIECE):
            # a piece of the bitmap at a time (C speed), checkpoints between: never a hold
            await trio.lowlevel.checkpoint()
            if self._staged.get(tag_id) is not staged:
                return opened  # forgotten meanwhile
            for index in staged.indices(start, start + SCAN_PIECE):
                if len(self._open) + len(todo) >= self._open.cap:
                    return opened + (await self._open_batch(tag, todo) if todo else 0)
                if (tag_id, index) not in self._open:
                    todo.append(index)
                if len(todo) == batch:
                    opened += await self._open_batch(tag, todo)
                    todo = []
        if todo:
            opened += await self._open_batch(tag, todo)
        return opened

    async def _open_batch(self, tag: TierTag, indices: list[int]) -> int:
        blobs = await self.pool.run(self._open_blocking, tag, indices)
        opened = 0
        for index, blob in zip(indices, blobs, strict=True):
            if blob is None:
                continue  # gone, torn or stale (dropped): the next read of it re-faults it
            key = (tag.id, index)
            if (key in self._open or not self.contains(key) or self._tags.get(tag.id) is not tag
                    or len(self._open) >= self._open.cap):
                blob.close()  # read, evicted or forgotten meanwhile, or no room left
                continue
            self._open.add(key, blob)
            opened += 1
        return opened

    def _open_blocking(self, tag: TierTag, indices: list[int]) -> list[OpenBlob | None]:
        out: list[OpenBlob | None] = []
        for index in indices:
            try:
                out.append(self.store.open_blob(tag.name, tag.blob_name(index),
                                                source_version=tag.version))
            except CorruptionError:
                out.append(None)  # a damaged dirty blob: its own read reports it
        return out

    # -- the ring of this trio run (tiers/uring.py; its reads: ringreads.py) -----------------

    def _ring(self) -> RingReader | None:
        """The ring of the running trio run, made on first use; None where it cannot be
        used (off, unavailable, broken, or another run or thread)."""
        reader = self._reader
        if reader is not None and reader.usable():
            return reader
        if not self.use_ring:
            return None
        if reader is not None:
            if not reader.closed and not reader.run_over():
                return None  # another run, on another thread, still has it: blocking path
            reader.close()
            self._reader = None
            if reader.broken:
                self.use_ring = False
                return None
        ring = uring.open_ring()
        if ring is None:
            self.use_ring = False
            return None
        self._reader = RingReader(ring, punt_reads=self.ring_punt)
        return self._reader

    async def load(self, key: BlobKey) -> Buffer | None:
        if not self.contains(key):
            return None
        [data] = await self.pool.run(self.load_blocking, [key])
        return data

    def load_blocking(self, keys: list[BlobKey]) -> list[Buffer | None]:
        """Whole verified payloads of staged blobs (on the pool: header and payload in one
        read each); None for one that is gone or damaged (its reader then takes the normal
        path, which drops it)."""
        out: list[Buffer | None] = []
        for key in keys:
            tag = self._tags[key[0]]
            blob, data = self._open_and_read(tag, tag.blob_name(key[1]), tag.blob_size, 0, True)
            if blob is not None:
                blob.close()
            out.append(None if isinstance(data, CorruptionError) else data)
        return out

    async def _store_read(self, size: int, fn, *args):
        """``fn(*args)``, a read of ``size`` bytes from the store: on the serving thread when
        it is small (``--inline-read-kb``), on the pool otherwise."""
        if size <= self.inline_read:
            return fn(*args)
        return await self.pool.run(fn, *args)

    def _open_and_read(self, tag: TierTag, name: str, size: int, off: int, whole: bool
                       ) -> tuple[OpenBlob | None, Buffer | CorruptionError | None]:
        """Open a staged blob and read from it; a damaged block is returned, not raised, so
        the caller handles it with the blob registered. ``whole``: header and payload in one
        read, for a caller that reads all of it and closes the blob."""
        blob = self.store.open_blob(tag.name, name, source_version=tag.version, whole=whole)
        if blob is None:
            return None, None
        try:
            return blob, blob.pread_view(size, off)
        except CorruptionError as exc:
            return blob, exc

    def _unstage(self, key: BlobKey) -> None:
        self.mark(key, False)
        self.policy.forget(key)
        self.stats.add("corrupt_blobs_dropped")

    def mark(self, key: BlobKey, staged: bool) -> None:
        target = self._staged.get(key[0])
        if target is not None:
            target.mark(key[1], staged)

    # -- writes ------------------------------------------------------------------------------

    async def put(self, key: BlobKey, data: Buffer) -> StoreOutcome:
        """Apply the store policy to a faulted blob and write it (on the pool)."""
        if self.store.degraded and not (self.store.recheck_due
                                        and await self.pool.run(self.store.recheck)):
            return self._count(StoreOutcome.SKIPPED_DEGRADED)
        outcome = self.policy.admit()
        if outcome is not None:
            return self._count(outcome)
        need = len(data) + HEADER_LEN
        victims = self.policy.victims(need, self._open.in_use)
        if victims is None:
            return self._count(StoreOutcome.SKIPPED_CACHE_CAP)
        try:
            return await self._put(key, data, victims)
        finally:
            self.policy.release(need)

    async def _put(self, key: BlobKey, data: Buffer, victims: list[BlobKey]) -> StoreOutcome:
        named = self._let_go(victims)
        tag = self._tags[key[0]]
        outcome, stored, kept, freed = await self.pool.run(
            self._store_blocking, tag, tag.blob_name(key[1]), data, named)
        self._settle(named, kept, freed)
        if outcome is StoreOutcome.STORED:
            self._open.drop(key)
            self.mark(key, True)
            self._stored += 1
            if key not in self._pinned:
                self.policy.note_stored(key, stored)
            self.stats.add("stored_bytes", stored)
        elif outcome is StoreOutcome.FULL:
            self.policy.store_full()
            log.warning("store %s is full: serving from the source for the next %d faults",
                        self.store.root, self.policy.backoff_faults)
        return self._count(outcome)

    def _let_go(self, victims: list[BlobKey]) -> list[tuple[BlobKey, str, str]]:
        """Unmark evicted blobs and close their descriptors: (key, tag name, blob name) of
        each whose tag is still registered, for :func:`_drop_victims`."""
        named = []
        for victim in victims:
            self._open.drop(victim)
            self.mark(victim, False)
            owner = self._tags.get(victim[0])
            if owner is not None:
                named.append((victim, owner.name, owner.blob_name(victim[1])))
        return named

    def _settle(self, named: list[tuple[BlobKey, str, str]], kept: list[BlobKey],
                freed: int) -> None:
        """Count an eviction; the dirty blobs it kept (user data) stay staged."""
        self.stats.add("evicted", len(named) - len(kept))
        self.stats.add("evicted_bytes", freed)
        for victim in kept:
            self.mark(victim, True)
            self.stats.add("dirty_kept")

    def _count(self, outcome: StoreOutcome) -> StoreOutcome:
        self.stats.add(outcome.counter)
        return outcome

    def _store_blocking(self, tag: TierTag, name: str, data: Buffer,
                        victims: list[tuple[BlobKey, str, str]]
                        ) -> tuple[StoreOutcome, int, list[BlobKey], int]:
        """Evict, check the reserve, write the blob: (outcome, bytes stored, victims kept
        because they are dirty, bytes freed). A dirty blob — user data, which the scan at
        mount may have listed without reading its header — is never deleted or replaced."""
        kept, freed = _drop_victims(self.store, victims)
        if not self.policy.fits_reserve(self.store.free_bytes(), len(data) + HEADER_LEN):
            return StoreOutcome.SKIPPED_RESERVE, 0, kept, freed
        try:
            # a free name needs no look for a dirty blob and no atomic replace
            stored = self.store.put_new(tag.name, name, data, flags=FLAG_NO_FAULT,
                                        source_version=tag.version)
            if stored is None:
                if self.store.is_dirty(tag.name, name):
                    return StoreOutcome.SKIPPED_DIRTY, 0, kept, freed
                stored = self.store.put(tag.name, name, data, flags=FLAG_NO_FAULT,
                                        source_version=tag.version)
        except StoreFull:
            return StoreOutcome.FULL, 0, kept, freed
        except OSError as exc:
            log.error("storing %s/%s in %s failed: %s", tag.name, name, self.store.root, exc)
            return StoreOutcome.FAILED, 0, kept, freed
        return StoreOutcome.STORED, stored, kept, freed

    async def evict(self, key: BlobKey) -> int:
        tag = self._tags.get(key[0])
        if tag is None or not self.contains(key):
            return 0
        name = tag.blob_name(key[1])
        if await self.pool.run(self.store.is_dirty, tag.name, name):
            return 0
        self._open.drop(key)
        self.mark(key, False)
        self.policy.forget(key)
        return await self.pool.run(self.store.delete, tag.name, name)

    def capacity(self) -> Capacity:
        return Capacity(self.policy.lru_bytes, self.policy.cache_size)

    # -- lifetime ----------------------------------------------------------------------------

    def raise_open_cap(self) -> None:
        """Re-read the descriptor limit (the mount raises it before serving)."""
        self._open.raise_cap()

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()  # waits for reads in flight: their blobs are still open
            self._reader = None
        self._open.close()


def _drop_victims(store: BlobStore, victims: list[tuple[BlobKey, str, str]]
                  ) -> tuple[list[BlobKey], int]:
    """Delete evicted blobs (blocking), never a dirty one: (the ones kept, bytes freed)."""
    kept, freed = [], 0
    for victim, victim_tag, victim_name in victims:
        if store.is_dirty(victim_tag, victim_name):
            kept.append(victim)
        else:
            freed += store.delete(victim_tag, victim_name)
    return kept, freed
