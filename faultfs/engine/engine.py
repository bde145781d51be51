"""The Engine: one store's tags, their tiers and the read path — hit, join, or fault.

It composes the duties of this package (tags, flights, faults, prefetch, pages, stats) and
knows nothing of pyfuse3. Async methods run on the trio thread and never block it: source
reads, store writes and reads that may block go to the I/O pool (small staged reads excepted,
``tiers/local.py``). Errors are ``FaultfsError`` and carry an errno.

Invariants:
- A read is served from a verified staged blob (hit) or from bytes just read from the source
  (fault); a failed fault raises (EIO) — zeros are never served in place of data.
- Concurrent faults of one blob share one source read (single-flight).
- A fault-ingested blob never takes the last of the store (``tiers/policy.py``).
"""

from __future__ import annotations

import time

import trio

from faultfs.config import Config
from faultfs.core.context import FaultContext
from faultfs.engine.faults import Faulter
from faultfs.engine.flights import Flights
from faultfs.engine.pages import PAGEMAP_BLOB, PageService
from faultfs.engine.prefetch import Prefetcher
from faultfs.engine.stats import snapshot
from faultfs.engine.tags import RegistrationPlan, Tag, Tags
from faultfs.errors import FaultfsError
from faultfs.iopool import IoPool
from faultfs.sources import SourceOptions
from faultfs.stats import Stats
from faultfs.store.blobfile import FLAG_DIRTY
from faultfs.store.blobstore import BlobStore
from faultfs.tiers.base import Buffer
from faultfs.tiers.local import LocalTier
from faultfs.tiers.memory import MemoryTier
from faultfs.tiers.multilevel import TierStack
from faultfs.tiers.policy import StorePolicy


class Engine:
    """Tags over one store; see the module docstring for the rules."""

    def __init__(self, store: BlobStore, config: Config,
                 source_options: SourceOptions | None = None) -> None:
        self.store = store
        self.config = config
        self.stats = Stats()
        self.pool = IoPool(config.io_threads)
        policy = StorePolicy(store_enabled=config.store_enabled,
                             reserve_bytes=config.reserve_bytes, cache_size=config.cache_size,
                             backoff_faults=config.backoff_faults)
        self.tiers = TierStack(
            MemoryTier(config.memory_mb << 20),
            LocalTier(store, policy, self.pool, self.stats, inline_read=config.inline_read_kb << 10),
            self.pool, self.stats)
        self._tags = Tags(store, self.tiers, self.stats, source_options or SourceOptions())
        self.flights = Flights()
        self.faults = Faulter(self.flights, self.tiers, self.pool, self.stats)
        self.prefetch = Prefetcher(config, self.flights, self.tiers, self.faults, self.pool,
                                   self.stats)
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
        return self._tags.commit(plan, shard=shard)

    def register(self, ctx: FaultContext, *, shard: int = 0) -> Tag:
        """Register ``ctx`` on-fault: check it, then persist it (blocking)."""
        return self.commit_plan(self.plan(ctx), shard=shard)

    def recover(self) -> list[Tag]:
        """Bring back every tag the store has registered (blocking)."""
        return self._tags.recover()

    def is_staged(self, tag: Tag, index: int) -> bool:
        return self.tiers.contains((tag.id, index))

    def staged_count(self, tag: Tag) -> int:
        return self.tiers.local.staged_count(tag.id)

    def write_identity_pagemap(self, tag: Tag, page_size: int) -> None:
        """Blocking (before the mount answers): lay the tag's range over page space."""
        self.pages.write_identity(tag, page_size)

    # -- lifetime ----------------------------------------------------------------------------

    def attach(self, nursery: trio.Nursery) -> None:
        """Run stores and prefetches in ``nursery`` (the mount's), off the reader's path.

        Without it (unit tests, embedding) a fault stores before it returns."""
        blob = max((t.layout.chunk_size for t in self.tags.values()), default=1 << 20)
        # a faulted blob waiting for its store write is held in memory: bound those bytes
        self.tiers.attach(nursery, (self.config.memory_mb << 20) // 2, blob)
        self.prefetch.attach(nursery)

    @property
    def pending_stores(self) -> int:
        return self.tiers.pending_stores

    @property
    def busy(self) -> bool:
        """Background work (store writes, prefetches, read-aheads) is still under way."""
        return bool(self.tiers.pending_stores or self.prefetch.in_flight or len(self.flights))

    async def drain(self) -> bool:
        """Stop prefetching and wait for pending store writes, so an unmount keeps what was
        faulted (the caller bounds the wait with a cancel scope). True when all are written."""
        self.prefetch.closing = True
        while self.tiers.pending_stores or self.prefetch.in_flight:  # noqa: ASYNC110 - shutdown poll
            await trio.sleep(0.01)
        return not self.tiers.pending_stores

    def close(self) -> None:
        self.tiers.close()
        self._tags.close()

    async def run_io(self, fn, *args):
        return await self.pool.run(fn, *args)

    # -- reads -------------------------------------------------------------------------------

    async def read_blob(self, tag: Tag, index: int, off: int, size: int) -> Buffer:
        """Bytes ``[off, off+size)`` of blob ``index`` (clipped to the blob)."""
        cs = tag.layout.chunk_size
        if off >= cs or size <= 0:
            return b""
        size = min(size, cs - off)
        self.stats.add("reads")
        data = await self._blob_bytes(tag, index, off, size)
        self.stats.add("bytes_served", len(data))
        return data

    async def read_view(self, tag: Tag, off: int, size: int) -> Buffer:
        """Bytes ``[off, off+size)`` of the whole-object view (exact source bytes)."""
        pieces = tag.layout.view_pieces(off, size)
        if not pieces:
            return b""
        self.stats.add("reads")
        if len(pieces) == 1:
            index, inner, length = pieces[0]
            data = await self._blob_bytes(tag, index, inner, length)
        else:
            parts: list[Buffer] = [b""] * len(pieces)

            async def one(i: int, index: int, inner: int, length: int) -> None:
                parts[i] = await self._blob_bytes(tag, index, inner, length)

            try:
                async with trio.open_nursery() as nursery:
                    for i, (index, inner, length) in enumerate(pieces):
                        nursery.start_soon(one, i, index, inner, length)
            except BaseExceptionGroup as group:
                raise single_error(group) from None
            data = b"".join(parts)
        self.stats.add("bytes_served", len(data))
        return data

    async def _blob_bytes(self, tag: Tag, index: int, off: int, size: int) -> Buffer:
        """Memory (or a pending store write), a read-ahead in flight, the store, the source."""
        key = (tag.id, index)
        self.prefetch.note_access(tag, index)
        for _ in range(2):  # a second look: see below
            held = self.tiers.held(key)
            if held is None and key in self.flights:
                held = await self.flights.read_ahead(key)
            if held is not None:
                self.stats.add("hits")
                self.stats.add("memory_hits")
                return memoryview(held)[off:off + size]
            if not self.tiers.contains(key):
                break
            data = await self.tiers.local.get(key, off, size)
            if data is not None:
                self.stats.add("hits")
                return data
            # The staged copy was damaged and is dropped. Another reader that found it so may
            # have re-faulted and stored it meanwhile: look once more before faulting.
        blob = await self.faults.fault(tag, index)
        return memoryview(blob)[off:off + size]

    # -- introspection -----------------------------------------------------------------------

    async def snapshot(self) -> dict:
        """Everything ``faultfs stat`` shows, as plain JSON-able values."""
        free = await self.pool.run(self.store.free_bytes)  # statvfs: not on the trio thread
        return snapshot(self.config, self.store.root, free, self.stats, self.tiers,
                        self.tags.values(), self.store.degraded)


class _PageBlobs:
    """The engine's blobs as pages see them (``engine.pages.PageBlobs``)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._store = engine.store

    async def read_chunk(self, tag: Tag, index: int, off: int, size: int) -> Buffer:
        return await self._engine.read_blob(tag, index, off, size)

    def read_stored(self, tag: Tag, name: str) -> bytes | None:
        return self._store.read(tag.name, name)

    def load_pagemap(self, tag: Tag) -> tuple[bytes, int] | None:
        return self._store.read_with_mtime(tag.name, PAGEMAP_BLOB)

    def save_pagemap(self, tag: Tag, data: bytes) -> int:
        self._store.put(tag.name, PAGEMAP_BLOB, data, flags=FLAG_DIRTY, durable=True)
        return self._store.blob_mtime_ns(tag.name, PAGEMAP_BLOB) or time.time_ns()


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
