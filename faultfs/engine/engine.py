"""The Engine: one store's tags, their tiers, the read path's face (its clean reads — hit, join,
or fault — are ``reads``) and the face of the writes over them.

It composes the duties of this package (tags, flights, faults, prefetch, reads, pages,
sharing, stats, writes) and knows nothing of pyfuse3. The namespace and the FUSE layer call
it, never a room behind it: a write, a truncate, a user blob's create, unlink or rename, an fsync, a
reset are thin calls into ``writes/`` (``Writes``), which gets the engine's clean path
(``CleanPath``: its reads, the size-0 request, the pins) for the bases of partial writes.
Async methods run on the trio thread and never block it: source reads, store writes and
reads that may block go to the I/O pool (small staged reads and journal appends excepted,
docs/decisions.md). Errors are ``FaultfsError`` and carry an errno.

Invariants:
- A read is served from a verified staged blob (hit) or from bytes just read from the source
  (fault); a failed fault raises (EIO) — zeros are never served in place of data. A read of
  a blob with writes is the writes' (their base with the writes laid over it).
- Concurrent faults of one blob share one source read (single-flight).
- A fault-ingested blob never takes the last of the store (``tiers/policy.py``).
- A clone's clean chunks are keyed, faulted, staged and pinned as its ancestor's
  (``Tag.clean``): a chunk either reads is one blob, faulted once, stored once.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

import trio

from faultfs.config import Config
from faultfs.core.chunks import here_bits
from faultfs.core.context import FaultContext
from faultfs.core.names import check_tag_name
from faultfs.core.pagemap import MAX_PAGEMAP_TEXT
from faultfs.engine.faults import Faulter
from faultfs.engine.flights import Flights
from faultfs.engine.pages import PAGEMAP_BLOB, PageService
from faultfs.engine.prefetch import Prefetcher
from faultfs.engine.reads import CleanReads
from faultfs.engine.refresh import SharedRefresh
from faultfs.engine.sharing import SharedRegistry
from faultfs.engine.stats import snapshot
from faultfs.engine.tags import RegistrationPlan, Tag, Tags
from faultfs.engine.writes import CleanPath, Writes
from faultfs.errors import FaultfsError
from faultfs.iopool import IoPool
from faultfs.sources import SourceOptions
from faultfs.stats import Stats
from faultfs.store.blobfile import FLAG_DIRTY
from faultfs.store.blobstore import BlobStore
from faultfs.store.fileops import FileOps
from faultfs.tiers.base import Buffer
from faultfs.tiers.claimboard import ClaimBoard
from faultfs.tiers.local import LocalTier
from faultfs.tiers.memory import MemoryTier
from faultfs.tiers.multilevel import TierStack
from faultfs.tiers.policy import StorePolicy
from faultfs.tiers.shared import SharedTier

log = logging.getLogger("faultfs.engine")



class Engine:
    """Tags over one store; see the module docstring for the rules."""

    def __init__(self, store: BlobStore, config: Config,
                 source_options: SourceOptions | None = None, *,
                 writes_ops: FileOps | None = None, sharing: SharedRegistry | None = None,
                 ) -> None:
        self.store = store
        self.config = config
        self.before_snapshot: list[Callable[[], None]] = []  # join others' counts (fast reads)
        self.stats = Stats()
        self.pool = IoPool(config.io_threads)
        self.sharing = sharing  # --shared-store: registrations of every node (DESIGN §13)
        shared = None if sharing is None else SharedTier(sharing.objects, self.stats)
        if shared is not None and sharing is not None and sharing.claim_store is not None:
            shared.claims = ClaimBoard(sharing.claim_store, self.stats)  # (DESIGN §17)
        policy = StorePolicy(store_enabled=config.store_enabled,
                             reserve_bytes=config.reserve_bytes, cache_size=config.cache_size,
                             backoff_faults=config.backoff_faults)
        self.tiers = TierStack(
            MemoryTier(config.memory_mb << 20),
            LocalTier(store, policy, self.pool, self.stats, inline_read=config.inline_read_kb << 10,
                      ring=config.uring, ring_punt=config.uring_punt),
            self.pool, self.stats, shared)
        self._tags = Tags(store, self.tiers, self.stats, source_options or SourceOptions())
        self.flights = Flights()
        self.faults = Faulter(self.flights, self.tiers, self.pool, self.stats)
        self.prefetch = Prefetcher(config, self.flights, self.tiers, self.faults, self.pool,
                                   self.stats)
        self.clean = CleanReads(self.tiers, self.flights, self.faults, self.prefetch, self.stats)
        self._clean = CleanPath(self.tiers, self.faults, self.clean.blob_bytes)
        self.writes = Writes(store.root, self._clean, self.pool, self.stats,
                             # a full store takes writes: each gets ENOSPC until space returns
                             writable=(config.store_enabled and not config.read_only
                                       and (store.writable or store.full)),
                             fold_bytes=config.dirty_mb << 20,
                             journal_bytes=config.journal_mb << 20, ops=writes_ops)
        self._writes_open = False
        self._forgotten: set[str] = set()  # not brought back by a refresh until a remount
        self._refresh = SharedRefresh(sharing, store, self.tiers, self._tags, self.pool,
                                      self.stats, self.writes.open_tag, self._forgotten)
        self._cloning: set[str] = set()  # names of clones being made
        self.pages = PageService(_PageBlobs(self), self.pool, self.stats)

    # -- tags --------------------------------------------------------------------------------

    @property
    def tags(self) -> dict[str, Tag]:
        return self._tags.by_name

    @property
    def tags_by_id(self) -> dict[int, Tag]:
        return self._tags.by_id

    @property
    def registry(self) -> dict[str, bytes]:
        """Fault key -> canonical context bytes of every registered tag."""
        return self._tags.registry

    def plan(self, ctx: FaultContext) -> RegistrationPlan:
        """Check a registration without persisting anything (blocking)."""
        return self._tags.plan(ctx)

    def commit_plan(self, plan: RegistrationPlan, *, shard: int = 0) -> Tag:
        """Persist a checked registration and add its tag (blocking)."""
        known = plan.ctx.dst in self.tags
        tag = self._tags.commit(plan, shard=shard)
        if not known:
            self.writes.open_tag(tag)
        return tag

    def register(self, ctx: FaultContext, *, shard: int = 0) -> Tag:
        return self.commit_plan(self.plan(ctx), shard=shard)  # check, then persist (blocking)

    def recover(self) -> list[Tag]:
        """Bring back every tag the store has registered, and their writes (blocking)."""
        tags = self._tags.recover()
        for tag in tags:
            self.writes.open_tag(tag)
        self.open_writes()
        # only now: a changed source's damage to the writes over it is durable first (a
        # crash before this finds the old version recorded and looks again)
        for tag in tags:
            try:
                self._tags.record_recovered(tag)
            except (FaultfsError, OSError) as exc:  # the next mount records it
                log.error("tag %s: recording its state failed: %s", tag.name, exc)
        return tags

    def open_writes(self) -> None:
        """Replay the write journal over the tags known now (once; blocking)."""
        if not self._writes_open:
            self._writes_open = True
            applied = self.writes.replay(self.tags)
            if applied:
                log.info("replayed %d journal records of writes", applied)
            self.writes.check_bases()

    async def clone_tag(self, parent: Tag, name: str) -> Tag:
        """``faultfs clone``: tag ``name``, a point-in-time copy of ``parent`` (§12). A name
        being cloned to is taken: another clone to it would remove and relink its files."""
        if name in self.tags or name in self._cloning:
            raise FaultfsError(f"tag {name!r} exists", errno.EEXIST)
        check_tag_name(name)
        self._cloning.add(name)
        try:
            await self.writes.prepare_clone(parent, name)
            entry = await self.pool.run(self._tags.clone_entry, parent, name)
            child = self._tags.add_clone(parent, *entry)  # the tables: this thread's alone
            await self.pool.run(self._tags.write_state, child)
            self.writes.open_tag(child, await self.pool.run(self.writes.load_tag, child))
        finally:
            self._cloning.discard(name)
        log.info("tag %s: cloned from %s", name, parent.name)
        return child

    async def refresh_shared(self) -> list[str]:
        """Add the tags other nodes put in the shared store since this mount; their names."""
        return await self._refresh.refresh()

    async def forget_tag(self, tag: Tag, *, keep_blobs: bool = False,
                         discard_writes: bool = False) -> int:
        """``faultfs forget``: stop serving ``tag``; its registry entry goes, and its blobs
        unless ``keep_blobs``. Refused while it has writes (unless ``discard_writes``) or
        clones made of it. The bytes freed."""
        if self.writes.has_writes(tag) and not discard_writes:
            raise FaultfsError(f"tag {tag.name} has writes: give --discard-writes to drop them",
                               errno.EBUSY)
        clones = sorted({*self.writes.dependents(tag),
                         *(t.name for t in self.tags.values() if t.ancestor is tag)})
        if clones:
            raise FaultfsError(f"tag {tag.name} has clones ({', '.join(clones)}): forget them "
                               "first", errno.EBUSY)
        self._tags.detach(tag)  # no new read finds it from here on
        self._forgotten.add(tag.name)
        with trio.move_on_after(30):  # faults and store writes under way end first
            while self.flights.of_tag(tag.id) or self.tiers.pending_of(tag.id):  # noqa: ASYNC110
                await trio.sleep(0.01)
        self.tiers.forget_tag(tag.id)
        self._clean.release(tag)
        await self.writes.forget_tag(tag)
        freed = await self.pool.run(lambda: self._tags.remove(tag, keep_blobs=keep_blobs))
        log.info("tag %s: forgotten (%s)", tag.name,
                 "blobs kept" if keep_blobs else f"{freed} bytes freed")
        return freed

    def is_staged(self, tag: Tag, index: int) -> bool:
        return self.tiers.contains((tag.clean.id, index))  # (a clone's: its ancestor's)

    def staged_count(self, tag: Tag) -> int:
        return self.tiers.local.staged_count(tag.clean.id)

    def chunk_here(self, tag: Tag, index: int) -> bool:
        """Whether a read of chunk ``index`` needs no source: staged, or the writes'."""
        return self.writes.touches(tag, index) or self.is_staged(tag, index)

    def written_chunks(self, tag: Tag, index: int | None = None) -> list[int]:
        """Indexes of the tag's chunks that hold writes, in order (``index``: of that chunk
        alone; a chunk past the source without writes is a hole)."""
        if index is not None:
            return [index] if self.writes.is_dirty(tag, index) else []
        return self.writes.dirty_chunks(tag)

    def here_bitmap(self, tag: Tag) -> bytes:
        """``chunk_here`` of every chunk of ``tag``, one bit each (chunk i: bit ``i % 8``,
        least significant first, of byte ``i // 8``)."""
        return here_bits(self.writes.num_chunks(tag), tag.layout.num_blobs,
                         lambda index: self.chunk_here(tag, index))

    def write_identity_pagemap(self, tag: Tag, page_size: int) -> None:
        """Blocking (before the mount answers): lay the tag's range over page space."""
        self.pages.write_identity(tag, page_size)

    # -- lifetime ----------------------------------------------------------------------------

    def attach(self, nursery: trio.Nursery) -> None:
        """Run stores and prefetches in ``nursery`` (the mount's), off the reader's path;
        without it (unit tests, embedding) a fault stores before it returns."""
        blob = max((t.layout.chunk_size for t in self.tags.values()), default=1 << 20)
        # a faulted blob waiting for its store write is held in memory: bound those bytes
        self.tiers.attach(nursery, blob)
        self.faults.attach(nursery)
        self.prefetch.attach(nursery)
        self.writes.attach(nursery)

    @property
    def pending_stores(self) -> int:
        return self.tiers.pending_stores

    @property
    def busy(self) -> bool:
        """Background work (store writes, prefetches, read-aheads) is still under way."""
        return bool(self.tiers.pending_stores or self.prefetch.in_flight or len(self.flights)
                    or self.writes.base_faults)

    async def drain(self) -> bool:
        """Stop prefetching and wait for pending store writes, so an unmount keeps what was
        faulted (the caller bounds the wait with a cancel scope). True when all are written."""
        self.prefetch.closing = True
        while self.tiers.pending_stores or self.prefetch.in_flight:  # noqa: ASYNC110 - shutdown poll
            await trio.sleep(0.01)
        if self.tiers.shared is not None:
            await self.tiers.shared.drain()  # publishes of what was faulted
        return not self.tiers.pending_stores

    async def close_writes(self) -> None:
        """Unmount: every write folded and durable (the journal emptied)."""
        if self._writes_open:
            await self.writes.close()

    def close(self) -> None:
        self.writes.journal.close()
        self.tiers.close()
        self._tags.close()

    # -- reads -------------------------------------------------------------------------------

    async def read_blob(self, tag: Tag, index: int, off: int, size: int) -> Buffer:
        """Bytes ``[off, off+size)`` of blob ``index`` (clipped to the blob)."""
        cs = tag.layout.chunk_size
        if off >= cs or size <= 0:
            return b""
        size = min(size, cs - off)
        self.stats.add("reads")
        if self.writes.touches(tag, index):
            data: Buffer = await self.writes.read_chunk(tag, index, off, size)
        else:
            data = await self.clean.blob_bytes(tag, index, off, size)
        self.stats.add("bytes_served", len(data))
        return data

    async def read_view(self, tag: Tag, off: int, size: int) -> Buffer:
        """Bytes ``[off, off+size)`` of the whole-object view (exact source bytes)."""
        if tag.id in self.writes.changed:
            self.stats.add("reads")
            data = await self.writes.read_view(tag, off, size)
            self.stats.add("bytes_served", len(data))
            return data
        pieces = tag.layout.view_pieces(off, size)
        if not pieces:
            return b""
        self.stats.add("reads")
        if len(pieces) == 1:
            index, inner, length = pieces[0]
            data = await self.clean.blob_bytes(tag, index, inner, length)
        else:
            data = await self.clean.joined(tag, pieces)
        self.prefetch.served(tag, off, data)  # formats that index their data (HDF5)
        self.stats.add("bytes_served", len(data))
        return data

    # -- writes (DESIGN §11): what the namespace and the FUSE layer call; engine/writes/ -----

    @property
    def writable(self) -> bool:
        """Whether the mount takes writes (not --read-only, --no-store, a degraded store)."""
        return self.writes.writable

    def num_chunks(self, tag: Tag) -> int:
        """Chunks of ``tag``: the source's, and those its view grew past it."""
        return self.writes.num_chunks(tag)

    def view_size(self, tag: Tag) -> int:
        return self.writes.view_size(tag)

    def written_ns(self, tag: Tag) -> int:
        """When ``tag`` was last written (0: never)."""
        return self.writes.mtime_ns(tag)

    def dirty_summary(self, tag: Tag) -> tuple[int, int]:
        """``(dirty blobs, bytes)`` of ``tag``."""
        return self.writes.dirty_summary(tag)

    def has_writes_path(self, tag: Tag) -> bool:
        """Whether ``tag``'s view reads take the writes' path (it has writes, or had)."""
        return tag.id in self.writes.changed

    def watch_writes(self, hook: Callable[[int], None] | None) -> None:
        """Tell ``hook`` a tag's id (synchronously, maybe on an I/O thread) before a change
        that gives it writes is seen; None: stop."""
        self.writes.on_change = hook

    def user_names(self, tag: Tag) -> list[str]:
        return self.writes.user_names(tag)

    def user_id(self, tag: Tag, name: str) -> int | None:
        return self.writes.user_id(tag, name)

    def user_name(self, tag: Tag, uid: int) -> str | None:
        return self.writes.user_name(tag, uid)

    def user_size(self, tag: Tag, name: str) -> int:
        return self.writes.user_size(tag, name)

    def user_held(self, tag: Tag, name: str) -> int:
        return self.writes.user_held(tag, name)  # its blocks: a hole between parts holds none

    async def read_user(self, tag: Tag, name: str, off: int, size: int) -> bytes:
        return await self.writes.read_user(tag, name, off, size)

    async def write_chunk(self, tag: Tag, index: int, off: int, data: bytes) -> int:
        return await self.writes.write_chunk(tag, index, off, data)

    async def write_view(self, tag: Tag, off: int, data: bytes) -> int:
        return await self.writes.write_view(tag, off, data)

    async def write_user(self, tag: Tag, name: str, off: int, data: bytes) -> int:
        return await self.writes.write_user(tag, name, off, data)

    async def truncate_view(self, tag: Tag, size: int) -> None:
        await self.writes.truncate_view(tag, size)

    async def truncate_user(self, tag: Tag, name: str, size: int) -> None:
        await self.writes.truncate_user(tag, name, size)

    async def fsync(self) -> None:
        """Every write acknowledged so far survives a power loss once this returns."""
        await self.writes.fsync()

    async def create_user(self, tag: Tag, name: str, mode: int = 0o644) -> None:
        await self.writes.create_user(tag, name, mode)

    def attrs(self, tag: Tag, uid: int | None) -> tuple[int, int, int, int]:
        """``(mode bits, atime_ns, mtime_ns, ctime_ns)`` of user blob ``uid``, or (None) of
        the tag directory (its times: 0, the tag's)."""
        return self.writes.attrs(tag, uid)

    async def set_attrs(self, tag: Tag, name: str | None, *, mode: int | None = None,
                        atime_ns: int | None = None, mtime_ns: int | None = None) -> None:
        """``chmod``/``utimensat`` of user blob ``name``, or (None) ``chmod`` of the tag
        directory (None: unchanged), durable once answered."""
        await self.writes.set_attrs(tag, name, mode, atime_ns, mtime_ns)

    async def unlink_user(self, tag: Tag, name: str) -> None:
        await self.writes.unlink_user(tag, name)

    async def rename_user(self, tag: Tag, old: str, new: str, *, replace: bool = True) -> None:
        await self.writes.rename_user(tag, old, new, replace=replace)

    async def exchange_users(self, tag: Tag, a: str, b: str) -> None:
        await self.writes.exchange_users(tag, a, b)

    async def hide_user(self, tag: Tag, name: str, uid: int) -> str:
        return await self.writes.hide_user(tag, name, uid)  # unlinked open: its hidden name

    async def reset(self, tag: Tag, names: list[str] | None = None) -> int:
        """``faultfs reset``: drop the writes of ``tag`` (of its blobs ``names``); how many
        dirty blobs were dropped."""
        return await self.writes.reset(tag, names)

    def fold_replayed(self) -> None:
        """Fold what the replay at mount left in the journal, behind the mount (attached)."""
        if self.writes.needs_checkpoint():
            self.writes.start_checkpoint()

    # -- introspection -----------------------------------------------------------------------

    async def snapshot(self) -> dict:
        """Everything ``faultfs stat`` shows, as plain JSON-able values."""
        for hook in self.before_snapshot:
            hook()
        free = await self.pool.run(self.store.free_bytes)  # statvfs: not on the trio thread
        return snapshot(self.config, self.store.root, free, self.stats, self.tiers,
                        self.tags.values(), self.writes, self.store.degraded)


class _PageBlobs:
    """The engine's blobs as pages see them (``engine.pages.PageBlobs``)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._store = engine.store

    async def read_chunk(self, tag: Tag, index: int, off: int, size: int) -> Buffer:
        return await self._engine.read_blob(tag, index, off, size)

    async def read_named(self, tag: Tag, name: str, lo: int, hi: int) -> Buffer | None:
        writes = self._engine.writes
        if writes.user_id(tag, name) is not None:
            return await writes.read_user(tag, name, lo, hi - lo)
        data = await self._engine.pool.run(self._store.read, tag.name, name)
        return None if data is None else memoryview(data)[lo:hi]

    def change(self, tag: Tag) -> AbstractAsyncContextManager[None]:
        return self._engine.writes.changes.change(tag.id)

    async def write_slice(self, tag: Tag, name: str, off: int, data: bytes) -> None:
        writes = self._engine.writes
        index = tag.layout.blob_index(name)
        if index is not None:
            await writes.write_chunk(tag, index, off, data)
        elif writes.user_id(tag, name) is not None:
            await writes.write_user(tag, name, off, data)
        else:
            raise FaultfsError(f"page slice names blob {name} of tag {tag.name}, which cannot "
                               "be written", errno.EIO)

    async def read_gap(self, tag: Tag, page: int, off: int, size: int) -> bytes | None:
        return await self._engine.writes.read_gap(tag, page, off, size)

    async def write_gap(self, tag: Tag, page: int, off: int, data: bytes) -> None:
        await self._engine.writes.write_gap(tag, page, off, data)

    def load_pagemap(self, tag: Tag) -> tuple[bytes, int] | None:
        return self._store.read_with_mtime(tag.name, PAGEMAP_BLOB, max_len=MAX_PAGEMAP_TEXT)

    def save_pagemap(self, tag: Tag, data: bytes) -> int:
        self._store.put(tag.name, PAGEMAP_BLOB, data, flags=FLAG_DIRTY, durable=True)
        sharing = self._engine.sharing
        if sharing is not None:
            try:
                sharing.publish_pagemap(tag.name, data)  # blocking: on the pool, or at mount
                self._engine.stats.add("shared_publishes")
            except OSError as exc:
                self._engine.stats.add("shared_publish_failures")
                log.warning("shared store %s: publishing the pagemap of tag %s failed: %s",
                            sharing.url, tag.name, exc.strerror or exc)
        return self._store.blob_mtime_ns(tag.name, PAGEMAP_BLOB) or time.time_ns()
