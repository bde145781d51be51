"""The fault engine: tags, the hit/fault/store path, single-flight, the I/O pool and stats.

It knows nothing of pyfuse3. Async methods run on the trio thread and never block it: every
source read, store read/write and large hash goes through ``trio.to_thread.run_sync`` with the
I/O pool's ``CapacityLimiter``. Errors are ``FaultfsError`` and carry an errno.

Invariants:
- A read is served from a verified staged blob (hit) or from bytes just read from the source
  (fault); a failed fault raises (EIO) — zeros are never served in place of data.
- Concurrent faults of one blob share one source read (single-flight).
- A fault-ingested blob never takes the last of the store: the reserve, ``--no-store``, the
  256-fault back-off after a full store and the ``--cache-size`` cap decide whether it is kept.
- Registration and recovery are blocking and run before the mount answers.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import resource
import time
from dataclasses import dataclass, field, replace
from urllib.parse import urlsplit

import trio

from faultfs import assimilators, buffers
from faultfs.assimilators.sources import (
    S3_PROTOCOLS,
    Source,
    SourceOptions,
    SourceVersion,
    local_path,
    url_protocol,
)
from faultfs.config import Config
from faultfs.core.chunks import ChunkLayout, zero_fill
from faultfs.core.context import REGISTRY_TAG, FaultContext, is_fault_key
from faultfs.core.names import check_name, check_tag_name
from faultfs.errors import (
    RC_CANNOT_INGEST_PER_BLOB,
    CorruptionError,
    FaultfsError,
    InvalidInput,
    SourceError,
    StoreFull,
)
from faultfs.store.blobfile import FLAG_NO_FAULT, HEADER_LEN
from faultfs.store.blobstore import BlobStore, OpenBlob

log = logging.getLogger("faultfs.engine")

Buffer = bytes | memoryview  # replies are slices of held buffers, not copies

# Store files kept open for hits (about 1.3 KB each): a random reader of staged blobs then
# skips the open and the header read. At most a quarter of the descriptor limit.
OPEN_BLOB_CACHE = 8192
LATENCY_SAMPLES = 2048  # fault latencies kept for percentiles
LOAD_RUN_BYTES = 4 << 20  # adjacent staged blobs read ahead in one trip to the I/O pool
PREFETCH_RUN_BYTES = 8 << 20  # adjacent blobs fetched ahead in one source read: one request



@dataclass
class Tag:
    """One registered source: its context, layout, pinned version and what is staged."""

    id: int
    name: str
    ctx: FaultContext
    layout: ChunkLayout
    version: SourceVersion
    mtime: float
    view_name: str
    shard: int = 0
    source: Source | None = None
    source_error: str = ""
    staged: bytearray = field(default_factory=bytearray)  # one bit per blob
    staged_count: int = 0
    stale_dropped: int = 0
    source_changed: bool = False  # the source differs from what the last mount recorded
    remote: dict = field(default_factory=dict)  # how the source was reached (tag state)
    last_index: int = -1  # the blob read last: sequential readers get prefetch
    window: int = 0  # blobs to prefetch ahead of a sequential reader (grows, resets)

    @property
    def key(self) -> str:
        return self.ctx.key

    @property
    def version_text(self) -> str:
        return self.version.to_text()

    def is_staged(self, index: int) -> bool:
        return bool(self.staged[index >> 3] & (1 << (index & 7)))

    def mark_staged(self, index: int, staged: bool) -> None:
        byte, bit = index >> 3, 1 << (index & 7)
        was = bool(self.staged[byte] & bit)
        if staged and not was:
            self.staged[byte] |= bit
            self.staged_count += 1
        elif was and not staged:
            self.staged[byte] &= ~bit
            self.staged_count -= 1


@dataclass
class RegistrationPlan:
    """A checked registration, not yet persisted."""

    ctx: FaultContext
    source: Source
    version: SourceVersion
    layout: ChunkLayout


class Stats:
    """Counters per stage of the fault path, plus fault latency percentiles."""

    COUNTERS = (
        "reads", "hits", "faults", "fault_errors", "single_flight_joins", "source_reads",
        "source_bytes", "stored", "stored_bytes", "skipped_reserve", "skipped_no_store",
        "skipped_cache_cap", "store_failures", "readthrough_backoff", "evicted", "evicted_bytes",
        "zero_filled_bytes", "bytes_served", "page_reads", "page_slices", "page_errors",
        "stale_blobs_dropped", "corrupt_blobs_dropped", "memory_hits", "prefetches",
        "prefetch_errors", "store_readahead", "dirty_kept", "skipped_dirty",
    )

    def __init__(self) -> None:
        self.counters = dict.fromkeys(self.COUNTERS, 0)
        self.latencies: collections.deque[float] = collections.deque(maxlen=LATENCY_SAMPLES)
        self.started = time.time()

    def add(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    def percentiles(self) -> dict[str, float]:
        if not self.latencies:
            return {"p50_ms": 0.0, "p90_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0}
        data = sorted(self.latencies)

        def pick(q: float) -> float:
            return round(data[min(len(data) - 1, int(q * len(data)))] * 1000, 3)

        return {"p50_ms": pick(0.5), "p90_ms": pick(0.9), "p99_ms": pick(0.99),
                "max_ms": round(data[-1] * 1000, 3)}


class BlobMemory:
    """Recently faulted blobs held in memory, least recently used dropped first.

    Serves the later pieces of a blob the kernel asks for after its fault (and prefetched
    blobs) without a thread hop or a store read. Bounded in bytes.

    The blobs of one source run are slices of one buffer. Dropping one of them drops its
    siblings too, so a run's buffer is held only while all of its blobs are here and the
    bytes held stay within the bound (one hot blob cannot keep a whole run alive)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.size = 0
        self._blobs: collections.OrderedDict[tuple[int, int], Buffer] = collections.OrderedDict()
        self._runs: dict[int, set[tuple[int, int]]] = {}  # id(shared buffer) -> its blobs

    def get(self, key: tuple[int, int]) -> Buffer | None:
        data = self._blobs.get(key)
        if data is not None:
            self._blobs.move_to_end(key)
        return data

    def __contains__(self, key: tuple[int, int]) -> bool:
        return key in self._blobs

    def put(self, key: tuple[int, int], data: Buffer) -> None:
        if len(data) > self.capacity:
            return
        self.discard(key)
        self._blobs[key] = data
        self.size += len(data)
        run = _shared_buffer(data)
        if run is not None:
            self._runs.setdefault(run, set()).add(key)
        while self.size > self.capacity:
            self.discard(next(iter(self._blobs)))

    def discard(self, key: tuple[int, int]) -> None:
        old = self._blobs.pop(key, None)
        if old is None:
            return
        self.size -= len(old)
        run = _shared_buffer(old)
        siblings = self._runs.pop(run, ()) if run is not None else ()
        for sibling in siblings:
            if sibling != key:
                self.discard(sibling)


def _shared_buffer(data: Buffer) -> int | None:
    """The identity of the buffer ``data`` is a part of, when it is only a part of it."""
    if isinstance(data, memoryview) and data.obj is not None and len(data) < len(data.obj):
        return id(data.obj)
    return None


class _Flight:
    """One in-progress fault that later readers of the same blob wait on."""

    __slots__ = ("data", "done", "error", "from_store")

    def __init__(self, from_store: bool = False) -> None:
        self.done = trio.Event()
        self.data: Buffer | None = None
        self.error: BaseException | None = None
        self.from_store = from_store  # a read-ahead of a staged blob, not a fault


class Engine:
    """Tags over one store; see the module docstring for the rules."""

    def __init__(self, store: BlobStore, config: Config,
                 source_options: SourceOptions | None = None) -> None:
        self.store = store
        self.config = config
        self.source_options = source_options or SourceOptions()
        self.stats = Stats()
        self.tags: dict[str, Tag] = {}
        self.tags_by_id: dict[int, Tag] = {}
        self.registry: dict[str, bytes] = {}  # fault key -> canonical context bytes
        self._limiter: trio.CapacityLimiter | None = None
        self._flights: dict[tuple[int, int], _Flight] = {}
        self._open: collections.OrderedDict[tuple[int, int], OpenBlob] = collections.OrderedDict()
        self._in_use: collections.Counter[tuple[int, int]] = collections.Counter()
        self._lru: collections.OrderedDict[tuple[int, int], int] = collections.OrderedDict()
        self._lru_bytes = 0
        self._backoff_left = 0
        self._next_id = 1
        self._pages = None
        self.memory = BlobMemory(config.memory_mb << 20)
        self._inline_read = config.inline_read_kb << 10
        self._open_cap = _open_cap()
        self._storing: dict[tuple[int, int], Buffer] = {}  # faulted, being written to the store
        self._background: trio.Nursery | None = None
        self._store_slots: trio.Semaphore | None = None
        self._prefetching = 0
        self._closing = False

    # -- registration (blocking; before the mount answers) ----------------------------------

    def plan(self, ctx: FaultContext) -> RegistrationPlan:
        """Check a registration without persisting anything: name, assimilator (-20 when it
        cannot ingest per blob), source (exists, is a file), range and chunk size."""
        check_tag_name(ctx.dst)
        if ctx.dst == REGISTRY_TAG:
            raise InvalidInput(f"tag name {ctx.dst!r} is reserved for the registry")
        assimilator = assimilators.get(ctx.format)
        if ctx.on_fault and assimilator.blob_bytes(ctx) == 0:
            raise FaultfsError(
                f"assimilator {ctx.format!r} cannot ingest per blob (result code "
                f"{RC_CANNOT_INGEST_PER_BLOB}): it cannot serve source {ctx.src} on fault",
                errno.ENOTSUP, code=RC_CANNOT_INGEST_PER_BLOB)
        source = assimilator.open(ctx, self.source_options)
        try:
            version = source.version()
            layout = self._layout(ctx, version, assimilator)
        except BaseException:
            source.close()
            raise
        ctx = persistable(ctx)  # the source is open with the real URL; credentials stop here
        old = self.tags.get(ctx.dst)
        if old is not None and old.key != ctx.key:
            source.close()
            raise InvalidInput(f"tag {ctx.dst!r} is registered twice with different sources")
        return RegistrationPlan(ctx, source, version, layout)

    def commit_plan(self, plan: RegistrationPlan, *, shard: int = 0) -> Tag:
        """Persist a checked registration and add its tag."""
        ctx = plan.ctx
        if ctx.dst in self.tags:
            plan.source.close()
            return self.tags[ctx.dst]
        previous = self.store.read_tag_state(ctx.dst)
        if previous is not None and previous.get("key") != ctx.key:
            log.info("tag %s is re-registered with a new context: dropping its old blobs", ctx.dst)
            self._unregister_key(previous.get("key"))
            self.store.forget_tag(ctx.dst)
        self._persist_context(ctx)
        recorded = None
        if previous is not None and previous.get("key") == ctx.key:
            recorded = previous.get("source_version")
        tag = self._add_tag(ctx, plan.layout, plan.version, plan.source, shard=shard,
                            recorded=recorded if isinstance(recorded, str) else None)
        tag.remote = remote_settings(ctx.src, self.source_options)
        self._write_tag_state(tag)
        return tag

    def register(self, ctx: FaultContext, *, shard: int = 0) -> Tag:
        """Register ``ctx`` on-fault: check it, then persist it."""
        return self.commit_plan(self.plan(ctx), shard=shard)

    def _layout(self, ctx: FaultContext, version: SourceVersion, assimilator) -> ChunkLayout:
        size = version.size
        if ctx.range_off > size:
            raise InvalidInput(f"range offset {ctx.range_off} is past the end of {ctx.src} ({size} bytes)")
        end = size if ctx.range_size == 0 else ctx.range_off + ctx.range_size
        if end > size:
            raise InvalidInput(
                f"range {ctx.range_off}:{ctx.range_size} is past the end of {ctx.src} ({size} bytes)")
        chunk = assimilator.blob_bytes(ctx)
        return ChunkLayout(ctx.range_off, end, chunk, ctx.blob_prefix)

    def _persist_context(self, ctx: FaultContext) -> None:
        data = ctx.encode()  # secrets are blanked by encode()
        self.store.put(REGISTRY_TAG, ctx.key, data, flags=FLAG_NO_FAULT, durable=True)
        self.registry[ctx.key] = data

    def _unregister_key(self, key: object) -> None:
        if isinstance(key, str) and is_fault_key(key):
            self.store.delete(REGISTRY_TAG, key)
            self.registry.pop(key, None)

    def _write_tag_state(self, tag: Tag) -> None:
        state = {
            "key": tag.key, "source_version": tag.version_text, "shard": tag.shard,
            "view_name": tag.view_name, "mtime": tag.mtime,
        }
        if tag.remote:
            state["remote"] = tag.remote
        self.store.write_tag_state(tag.name, state)

    def _add_tag(self, ctx: FaultContext, layout: ChunkLayout, version: SourceVersion,
                 source: Source | None, *, shard: int, mtime: float | None = None,
                 view_name: str | None = None, recorded: str | None = None) -> Tag:
        """``recorded``: the source version the tag's state file names, if any."""
        if view_name is None:
            view_name = view_name_for(ctx.src)
        tag = Tag(id=self._next_id, name=ctx.dst, ctx=ctx, layout=layout, version=version,
                  mtime=mtime if mtime is not None else (source.mtime() if source else time.time()),
                  view_name=view_name, shard=shard, source=source,
                  staged=bytearray((layout.num_blobs + 7) // 8))
        self._next_id += 1
        self._scan_staged(tag, trusted=recorded is not None and recorded == tag.version_text)
        self.tags[tag.name] = tag
        self.tags_by_id[tag.id] = tag
        return tag

    def _scan_staged(self, tag: Tag, *, trusted: bool) -> None:
        """Mark the blobs the store holds for this tag (payloads are verified on read).

        ``trusted``: the tag's recorded source version is the current one, so every clean
        blob in its directory was staged from it — a listing and a ``stat`` per blob, no
        header read (a remount with millions of staged blobs opens none of them). Otherwise
        each header is read and blobs of another version are dropped now. Either way a read
        checks the header again and re-faults a blob that is torn, foreign or stale."""
        if trusted:
            for name, size in self.store.scan_blobs(tag.name):
                index = tag.layout.blob_index(name)
                if index is not None:
                    tag.mark_staged(index, True)
                    self._note_stored((tag.id, index), size)
            return
        for name in self.store.list_blobs(tag.name):
            index = tag.layout.blob_index(name)
            if index is None:
                continue
            path = self.store.blob_path(tag.name, name)
            header = self.store.read_header(path)
            if header is None:
                self.store.delete(tag.name, name)
                self.stats.add("corrupt_blobs_dropped")
                continue
            if not header.dirty and header.source_version != tag.version_text:
                self.store.delete(tag.name, name)
                tag.stale_dropped += 1
                self.stats.add("stale_blobs_dropped")
                continue
            tag.mark_staged(index, True)
            if not header.dirty:
                self._note_stored((tag.id, index), os.stat(path).st_blocks * 512)

    def recover(self) -> list[Tag]:
        """Bring back every tag whose context is in the registry (remount with no source)."""
        recovered = []
        for key in sorted(self.store.list_blobs(REGISTRY_TAG)):
            if not is_fault_key(key):
                continue
            data = self.store.read(REGISTRY_TAG, key)
            if data is None:
                log.warning("registry entry %s is damaged: skipped", key)
                continue
            try:
                ctx = FaultContext.decode(data)
            except InvalidInput as exc:
                log.warning("registry entry %s is not a context (%s): skipped", key, exc)
                continue
            if ctx.key != key:
                log.warning("registry entry %s holds a context with key %s: skipped", key, ctx.key)
                continue
            if ctx.dst in self.tags:
                continue
            self.registry[key] = data
            recovered.append(self._recover_tag(ctx))
        return recovered

    def _recover_tag(self, ctx: FaultContext) -> Tag:
        state = self.store.read_tag_state(ctx.dst) or {}
        shard = int(state.get("shard", 0))
        assimilator = assimilators.get(ctx.format)
        recorded = None
        if isinstance(state.get("source_version"), str):
            recorded = SourceVersion.from_text(state["source_version"])
        source: Source | None = None
        error = ""
        recorded_remote = state.get("remote") if isinstance(state.get("remote"), dict) else {}
        options = recovery_options(self.source_options, recorded_remote)
        try:
            source = assimilator.open(ctx, options)
            version = source.version()
        except FaultfsError as exc:
            if recorded is None:
                raise
            error = exc.message
            version = recorded
            log.warning("tag %s: source unavailable (%s); staged blobs still serve", ctx.dst, error)
        layout = self._layout(ctx, version, assimilator)
        tag = self._add_tag(ctx, layout, version, source, shard=shard,
                            mtime=float(state.get("mtime", 0.0)) if source is None else None,
                            view_name=state.get("view_name"),
                            recorded=recorded.to_text() if recorded is not None else None)
        tag.source_error = error
        tag.remote = remote_settings(ctx.src, recovery_options(SourceOptions(), recorded_remote))
        if recorded is not None and recorded != version:
            tag.source_changed = True
            log.warning("tag %s: source %s changed (%s -> %s); %d stale blobs dropped, "
                        "re-faulting from the new version", ctx.dst, ctx.src, recorded.describe(),
                        version.describe(), tag.stale_dropped)
        if recorded != version or "view_name" not in state:
            self._write_tag_state(tag)
        return tag

    def close(self) -> None:
        for blob in self._open.values():
            blob.close()
        self._open.clear()
        for tag in self.tags.values():
            if tag.source is not None:
                tag.source.close()

    # -- the I/O pool -----------------------------------------------------------------------

    @property
    def limiter(self) -> trio.CapacityLimiter:
        if self._limiter is None:
            self._limiter = trio.CapacityLimiter(self.config.io_threads)
        return self._limiter

    async def run_io(self, fn, *args):
        return await trio.to_thread.run_sync(fn, *args, limiter=self.limiter)

    def attach(self, nursery: trio.Nursery) -> None:
        """Run stores and prefetches in ``nursery`` (the mount's), off the reader's path.

        Without it (unit tests, embedding) a fault stores before it returns."""
        self._background = nursery
        self._open_cap = _open_cap()  # the mount has raised the descriptor limit by now
        # a faulted blob waiting for its store write is held in memory: bound those bytes
        budget = (self.config.memory_mb << 20) // 2
        self._store_slots = trio.Semaphore(max(2, budget // max(1, self._max_chunk())))

    def _max_chunk(self) -> int:
        return max((t.layout.chunk_size for t in self.tags.values()), default=1 << 20)

    # -- reads ------------------------------------------------------------------------------

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
        key = (tag.id, index)
        self._note_access(tag, index)
        held = self.memory.get(key) or self._storing.get(key)
        if held is not None:
            if key in self._lru:
                self._lru.move_to_end(key)
            self.stats.add("hits")
            self.stats.add("memory_hits")
            return memoryview(held)[off:off + size]
        flight = self._flights.get(key)
        if flight is not None and flight.from_store:  # being read ahead from the store
            await flight.done.wait()
            if flight.data is not None:
                self.stats.add("hits")
                self.stats.add("memory_hits")
                return memoryview(flight.data)[off:off + size]
        if tag.is_staged(index):
            data = await self._read_staged(tag, index, off, size)
            if data is not None:
                self.stats.add("hits")
                return data
        blob = await self.fault(tag, index)
        return memoryview(blob)[off:off + size]

    async def _read_staged(self, tag: Tag, index: int, off: int, size: int) -> Buffer | None:
        """Bytes of a staged blob, verified block by block; None when it turned out torn,
        foreign or stale (it is dropped and the caller re-faults it)."""
        key = (tag.id, index)
        name = tag.layout.blob_name(index)
        blob = self._open.get(key)
        first_read: Buffer | CorruptionError | None = None
        if blob is None:
            try:  # open and first read together
                blob, first_read = await self._store_read(size, self._open_and_read,
                                                          tag, name, size, off)
            except CorruptionError as exc:
                raise FaultfsError(str(exc), errno.EIO) from None
            if blob is None:
                self._unstage(tag, index)
                return None
            if key in self._open:  # another reader opened it meanwhile
                blob.close()
                blob = self._open[key]
            else:
                self._open[key] = blob
                self._trim_open()
        self._open.move_to_end(key)
        if key in self._lru:
            self._lru.move_to_end(key)
        self._in_use[key] += 1
        try:
            if isinstance(first_read, CorruptionError):
                raise first_read
            if first_read is not None:
                return first_read
            data = blob.pread_view(size, off, nowait=True)  # never blocks: page-cache hits only
            if data is None:
                data = await self._store_read(size, blob.pread_view, size, off)
            return data
        except CorruptionError as exc:
            log.warning("tag %s: %s", tag.name, exc)
            self._drop_open(key)
            try:
                await self.run_io(self.store.discard_damaged, tag.name, name)
            except CorruptionError as dirty:
                raise FaultfsError(str(dirty), errno.EIO) from None
            self._unstage(tag, index)
            return None
        finally:
            self._in_use[key] -= 1
            if not self._in_use[key]:
                del self._in_use[key]
                if key not in self._open:
                    blob.close()

    async def _store_read(self, size: int, fn, *args):
        """``fn(*args)``, a read of ``size`` bytes from the store: on the serving thread when
        it is small (``--inline-read-kb``: a few blocks off the local disk cost less than a
        trip to the I/O pool and back), on the pool otherwise."""
        if size <= self._inline_read:
            return fn(*args)
        return await self.run_io(fn, *args)

    def _unstage(self, tag: Tag, index: int) -> None:
        tag.mark_staged(index, False)
        self._forget_lru((tag.id, index))
        self.stats.add("corrupt_blobs_dropped")

    def _open_and_read(self, tag: Tag, name: str, size: int, off: int, whole: bool = False
                       ) -> tuple[OpenBlob | None, Buffer | CorruptionError | None]:
        """Open a staged blob and read from it (on the pool); a damaged block is returned,
        not raised, so the caller handles it with the blob registered. ``whole``: header
        and payload in one read, for a caller that reads all of it and closes the blob."""
        blob = self.store.open_blob(tag.name, name, source_version=tag.version_text, whole=whole)
        if blob is None:
            return None, None
        try:
            return blob, blob.pread_view(size, off)
        except CorruptionError as exc:
            return blob, exc

    def _trim_open(self) -> None:
        while len(self._open) > self._open_cap:
            key, blob = self._open.popitem(last=False)
            if not self._in_use.get(key):
                blob.close()

    def _drop_open(self, key: tuple[int, int]) -> None:
        blob = self._open.pop(key, None)
        if blob is not None and not self._in_use.get(key):
            blob.close()

    # -- faults -----------------------------------------------------------------------------

    async def fault(self, tag: Tag, index: int) -> Buffer:
        """Bring blob ``index`` in from the source (single-flight) and return all of it.

        Readers get the bytes as soon as the source read is done; the store write follows
        (in the background when the engine is attached to a mount), the bytes held in memory
        until it is on disk, so no reader faults the same blob twice."""
        flight = self._flights.get((tag.id, index))
        while flight is not None and flight.from_store:  # a read-ahead of the staged copy
            await flight.done.wait()
            if flight.data is not None:
                return flight.data
            flight = self._flights.get((tag.id, index))
        if flight is None:
            [flight] = await self._fault_run(tag, index, self._claim(tag, index, 1))
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

    def _claim(self, tag: Tag, first: int, count: int) -> list[_Flight]:
        """Register the flights of blobs ``first .. first+count-1`` now, before any await,
        so no other reader or prefetch starts a second fault of them."""
        flights = []
        for index in range(first, first + count):
            key = (tag.id, index)
            assert key not in self._flights, f"blob {key} claimed twice"
            flight = _Flight()
            self._flights[key] = flight
            flights.append(flight)
        return flights

    async def _fault_run(self, tag: Tag, first: int, flights: list[_Flight]) -> list[_Flight]:
        """Fault the claimed blobs ``first ..`` with ONE source read (a run of adjacent
        blobs costs one request to a remote source, not one each), then hand each to
        readers and to the store. Errors are left in the flights for their readers."""
        count = len(flights)
        self.stats.add("faults", count)
        started = time.monotonic()
        datas: list[Buffer] = []
        try:
            datas = await self.run_io(self._read_source, tag, first, count)
            self._count_source_read(tag, first, count)
            for index, (flight, data) in enumerate(zip(flights, datas, strict=True), first):
                flight.data = data
                self.memory.put((tag.id, index), data)
                if self._background is not None:
                    self._storing[(tag.id, index)] = data
        except BaseException as exc:
            for flight in flights:
                flight.error = exc
            if isinstance(exc, Exception):
                self.stats.add("fault_errors", count)
                if not isinstance(exc, FaultfsError):
                    log.exception("fault of blobs %d..%d of tag %s failed", first,
                                  first + count - 1, tag.name)
            else:
                raise
            datas = []
        finally:
            for index, flight in enumerate(flights, first):
                flight.done.set()
                if self._flights.get((tag.id, index)) is flight:
                    del self._flights[(tag.id, index)]
            self.stats.latencies.append(time.monotonic() - started)
        for index, data in enumerate(datas, first):
            await self._schedule_store(tag, index, data)
        return flights

    async def _schedule_store(self, tag: Tag, index: int, data: Buffer) -> None:
        if self._background is None or self._store_slots is None:
            await self._maybe_store(tag, index, data)
            return
        try:
            await self._store_slots.acquire()  # back-pressure: bounded bytes await storing
        except BaseException:
            self._storing.pop((tag.id, index), None)
            raise
        self._background.start_soon(self._store_in_background, tag, index, data)

    async def _store_in_background(self, tag: Tag, index: int, data: Buffer) -> None:
        key = (tag.id, index)
        try:
            await self._maybe_store(tag, index, data)
        except Exception:
            log.exception("storing blob %d of tag %s failed", index, tag.name)
            self.stats.add("store_failures")
        finally:
            self._storing.pop(key, None)
            assert self._store_slots is not None
            self._store_slots.release()

    def _count_source_read(self, tag: Tag, first: int, count: int) -> None:
        start = tag.layout.source_range(first)[0]
        end = tag.layout.source_range(first + count - 1)[1]
        self.stats.add("source_reads")
        self.stats.add("source_bytes", end - start)
        self.stats.add("zero_filled_bytes", count * tag.layout.chunk_size - (end - start))

    @property
    def pending_stores(self) -> int:
        return len(self._storing)

    async def drain(self) -> bool:
        """Stop prefetching and wait for pending store writes, so an unmount keeps what was
        faulted (the caller bounds the wait with a cancel scope). True when all are written."""
        self._closing = True
        while self._storing or self._prefetching:  # noqa: ASYNC110 - shutdown poll
            await trio.sleep(0.01)
        return not self._storing

    # -- prefetch ---------------------------------------------------------------------------

    def _note_access(self, tag: Tag, index: int) -> None:
        """Track sequential readers of a tag; fault ahead of them in the background.

        A read of the blob last read or of one a few blobs after it is sequential (the kernel's
        readahead arrives slightly out of order); the window then doubles up to the prefetch
        budget. Any other read resets it: random readers get no prefetch. Adjacent blobs
        ahead are fetched in runs of up to ``PREFETCH_RUN_BYTES`` with one source read each."""
        last = tag.last_index
        if index == last:
            return
        sequential = last >= 0 and last < index <= last + 1 + max(1, tag.window)
        tag.last_index = index
        budget = min(self.config.prefetch_mb << 20, (self.config.memory_mb << 20) // 2)
        cs = tag.layout.chunk_size
        limit = budget // cs
        if not sequential or limit <= 0 or self._background is None or self._closing:
            tag.window = 0
            return
        tag.window = min(limit, max(1, tag.window * 2))
        max_run = max(1, PREFETCH_RUN_BYTES // cs)
        max_load = max(1, LOAD_RUN_BYTES // cs)
        run_start, run_len = -1, 0
        load: list[int] = []  # adjacent staged blobs ahead, read from the store in one trip
        for ahead in range(index + 1, min(index + 1 + tag.window, tag.layout.num_blobs) + 1):
            key = (tag.id, ahead)
            free = (ahead < tag.layout.num_blobs and key not in self._flights
                    and key not in self.memory and key not in self._storing
                    and self._prefetching + len(load) + run_len < limit)
            staged = free and tag.is_staged(ahead)
            if load and not (staged and len(load) < max_load):
                self._start_load(tag, load)
                load = []
            if staged:
                load.append(ahead)
            wanted = free and not staged
            if wanted and run_len < max_run:
                if run_len == 0:
                    run_start = ahead
                run_len += 1
                continue
            if run_len:
                self._prefetching += run_len
                flights = self._claim(tag, run_start, run_len)
                self._background.start_soon(self._prefetch, tag, run_start, flights)
            run_start, run_len = (ahead, 1) if wanted else (-1, 0)
        if load:
            self._start_load(tag, load)

    def _start_load(self, tag: Tag, indices: list[int]) -> None:
        """Claim adjacent staged blobs and read them ahead in the background."""
        flights = []
        for index in indices:
            flight = _Flight(from_store=True)
            self._flights[(tag.id, index)] = flight
            flights.append(flight)
        self._prefetching += len(indices)
        self._background.start_soon(self._load_ahead, tag, indices, flights)

    async def _load_ahead(self, tag: Tag, indices: list[int], flights: list[_Flight]) -> None:
        """Read staged blobs ahead of a sequential reader into memory (verified), a run of
        adjacent ones in one trip to the pool, so their reads are served without one. On any
        trouble the readers fall back to the normal path."""
        try:
            datas = await self.run_io(self._load_run, tag, indices)
            for index, flight, data in zip(indices, flights, datas, strict=True):
                if data is not None:
                    flight.data = data
                    self.memory.put((tag.id, index), data)
                    self.stats.add("store_readahead")
        except Exception:  # a background task must never take the mount down
            log.exception("read-ahead of blobs %s of tag %s failed", indices, tag.name)
        finally:
            for index, flight in zip(indices, flights, strict=True):
                flight.done.set()
                key = (tag.id, index)
                if self._flights.get(key) is flight:
                    del self._flights[key]
            self._prefetching -= len(indices)

    def _load_run(self, tag: Tag, indices: list[int]) -> list[Buffer | None]:
        """Whole verified payloads of staged blobs (on the pool); None for one that is gone
        or damaged (its reader then takes the normal path, which drops it)."""
        out: list[Buffer | None] = []
        for index in indices:
            blob, data = self._open_and_read(tag, tag.layout.blob_name(index),
                                             tag.layout.chunk_size, 0, True)
            if blob is not None:
                blob.close()
            out.append(None if isinstance(data, CorruptionError) else data)
        return out

    async def _prefetch(self, tag: Tag, first: int, flights: list[_Flight]) -> None:
        count = len(flights)
        try:
            self.stats.add("prefetches", count)
            await self._fault_run(tag, first, flights)
            if flights[0].error is not None:
                self.stats.add("prefetch_errors", count)
        except Exception:  # a background task must never take the mount down
            log.exception("prefetch of blobs %d.. of tag %s failed", first, tag.name)
            self.stats.add("prefetch_errors", count)
        finally:
            self._prefetching -= count

    def _read_source(self, tag: Tag, first: int, count: int = 1) -> list[Buffer]:
        """Blobs ``first .. first+count-1`` from the source in one read, each zero-filled to
        the chunk size (on the pool)."""
        if tag.source is None:
            raise SourceError(f"source {tag.ctx.src} of tag {tag.name} is unavailable: {tag.source_error}")
        start = tag.layout.source_range(first)[0]
        end = tag.layout.source_range(first + count - 1)[1]
        assimilator = assimilators.get(tag.ctx.format)
        try:
            raw = assimilator.read_blob(tag.source, tag.ctx, start, end)
            if len(raw) != end - start:
                raise SourceError(f"source {tag.ctx.src} returned {len(raw)} of {end - start} bytes")
        except FaultfsError as exc:
            log.error("tag %s: reading %s [%d, %d) failed: %s", tag.name, tag.ctx.src, start, end, exc)
            raise
        except OSError as exc:
            log.error("tag %s: reading %s [%d, %d) failed: %s", tag.name, tag.ctx.src, start, end, exc)
            raise SourceError(f"reading {tag.ctx.src} [{start}, {end}) failed: {exc}") from None
        cs = tag.layout.chunk_size
        if count == 1:
            return [zero_fill(raw, cs)]
        view = memoryview(raw)  # blobs of a run are slices of its one buffer
        return [zero_fill(view[i * cs:(i + 1) * cs], cs) for i in range(count)]

    async def _maybe_store(self, tag: Tag, index: int, data: Buffer) -> None:
        """Apply the store policy (DESIGN §5.3) to the faulted ``data``."""
        if not self.config.store_enabled:
            self.stats.add("skipped_no_store")
            return
        if self._backoff_left > 0:
            self._backoff_left -= 1
            self.stats.add("readthrough_backoff")
            return
        need = len(data) + HEADER_LEN
        victims = self._pick_victims(need)
        if victims is None:
            self.stats.add("skipped_cache_cap")
            return
        key = (tag.id, index)
        name = tag.layout.blob_name(index)
        outcome, stored, kept = await self.run_io(self._store_blocking, tag, name, data, victims)
        for victim_tag, victim_name in kept:  # dirty (user data): never evicted, still staged
            owner = self.tags.get(victim_tag)
            victim = owner.layout.blob_index(victim_name) if owner is not None else None
            if victim is not None:
                owner.mark_staged(victim, True)
            self.stats.add("dirty_kept")
        if outcome == "stored":
            self._drop_open(key)
            tag.mark_staged(index, True)
            self._note_stored(key, stored)
            self.stats.add("stored")
            self.stats.add("stored_bytes", stored)
        elif outcome == "full":
            self.stats.add("store_failures")
            self._backoff_left = self.config.backoff_faults
            log.warning("store %s is full: serving from the source for the next %d faults",
                        self.store.root, self.config.backoff_faults)
        else:
            self.stats.add(outcome)

    def _pick_victims(self, need: int) -> list[tuple[str, str]] | None:
        """Least-recently-used clean blobs to evict so ``need`` more bytes fit the cap.

        Runs on the trio thread, which owns the LRU; None when nothing can make room."""
        cap = self.config.cache_size
        if not cap:
            return []
        if need > cap:
            return None
        victims = []
        while self._lru and self._lru_bytes + need > cap:
            key = next(iter(self._lru))
            if self._in_use.get(key):
                self._lru.move_to_end(key)  # being read right now: pick another
                if all(self._in_use.get(k) for k in self._lru):
                    return None
                continue
            size = self._forget_lru(key)
            self._drop_open(key)
            tag = self.tags_by_id.get(key[0])
            if tag is None:
                continue
            tag.mark_staged(key[1], False)
            victims.append((tag.name, tag.layout.blob_name(key[1])))
            self.stats.add("evicted")
            self.stats.add("evicted_bytes", size)
        return victims if self._lru_bytes + need <= cap else None

    def _store_blocking(self, tag: Tag, name: str, data: Buffer,
                        victims: list[tuple[str, str]]
                        ) -> tuple[str, int, list[tuple[str, str]]]:
        """Evict, check the reserve, write the blob (on the pool): (outcome, bytes stored,
        victims kept because they are dirty). A dirty blob — user data, which the scan at
        mount may have listed without reading its header — is never deleted or replaced."""
        kept = [victim for victim in victims if self.store.is_dirty(*victim)]
        for victim_tag, victim_name in victims:
            if (victim_tag, victim_name) not in kept:
                self.store.delete(victim_tag, victim_name)
        if self.store.free_bytes() - (len(data) + HEADER_LEN) < self.config.reserve_bytes:
            return "skipped_reserve", 0, kept
        if self.store.is_dirty(tag.name, name):
            return "skipped_dirty", 0, kept
        try:
            stored = self.store.put(tag.name, name, data, flags=FLAG_NO_FAULT,
                                    source_version=tag.version_text)
        except StoreFull:
            return "full", 0, kept
        except OSError as exc:
            log.error("storing %s/%s in %s failed: %s", tag.name, name, self.store.root, exc)
            return "store_failures", 0, kept
        return "stored", stored, kept

    def _note_stored(self, key: tuple[int, int], size: int) -> None:
        self._forget_lru(key)
        self._lru[key] = size
        self._lru_bytes += size

    def _forget_lru(self, key: tuple[int, int]) -> int:
        size = self._lru.pop(key, 0)
        self._lru_bytes -= size
        return size

    async def stage(self, tag: Tag, index: int) -> None:
        """The size-0 request: make sure blob ``index`` is staged, serve nothing."""
        if tag.is_staged(index):
            return
        await self.fault(tag, index)

    # -- pages (pagify, DESIGN §6): see faultfs/pages.py -------------------------------------

    @property
    def pages(self):
        if self._pages is None:
            from faultfs.pages import PageService

            self._pages = PageService(self)
        return self._pages

    def has_pagemap(self, tag: Tag) -> bool:
        return self.pages.has_pagemap(tag)

    def num_pages(self, tag: Tag) -> int:
        return self.pages.num_pages(tag)

    def page_size(self, tag: Tag) -> int:
        return self.pages.page_size(tag)

    def pagemap_size(self, tag: Tag) -> int:
        return self.pages.pagemap_size(tag)

    async def read_page(self, tag: Tag, page_id: int, off: int, size: int) -> bytes:
        return await self.pages.read_page(tag, page_id, off, size)

    async def open_pagemap(self, tag: Tag, flags: int) -> int:
        return await self.pages.open_pagemap(tag, flags)

    def pagemap_handle_read(self, fh: int, off: int, size: int) -> bytes:
        return self.pages.handle_read(fh, off, size)

    def pagemap_handle_write(self, fh: int, off: int, buf: bytes) -> int:
        return self.pages.handle_write(fh, off, buf)

    def pagemap_handle_truncate(self, fh: int, size: int) -> None:
        self.pages.handle_truncate(fh, size)

    async def flush_pagemap(self, fh: int) -> None:
        await self.pages.flush(fh)

    async def close_pagemap(self, fh: int) -> None:
        await self.pages.close(fh)

    def write_identity_pagemap(self, tag: Tag, page_size: int) -> None:
        """Blocking (before the mount answers): lay the tag's range over page space."""
        self.pages.write_identity(tag, page_size)

    # -- introspection ----------------------------------------------------------------------

    async def snapshot(self) -> dict:
        """Everything ``faultfs stat`` shows, as plain JSON-able values."""
        free = await self.run_io(self.store.free_bytes)  # statvfs: not on the trio thread
        return {
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.stats.started, 1),
            "store": self.store.root,
            "store_free_bytes": free,
            "reserve_bytes": self.config.reserve_bytes,
            "store_enabled": self.config.store_enabled,
            "cache_size": self.config.cache_size,
            "cached_bytes": self._lru_bytes,
            "io_threads": self.config.io_threads,
            "backoff_faults_left": self._backoff_left,
            "memory_bytes": self.memory.size,
            "read_buffers": buffers.POOL.snapshot(),
            "counters": dict(self.stats.counters),
            "fault_latency": self.stats.percentiles(),
            "tags": {
                t.name: {
                    "source": t.ctx.src, "key": t.key, "chunk_size": t.layout.chunk_size,
                    "blobs": t.layout.num_blobs, "staged_blobs": t.staged_count,
                    "size": t.layout.size, "source_version": t.version_text,
                    "stale_dropped_at_mount": t.stale_dropped, "source_error": t.source_error,
                    "source_changed_at_mount": t.source_changed,
                    "shard": t.shard, "remote": t.remote,
                } for t in self.tags.values()
            },
        }


def remote_settings(src: str, options: SourceOptions) -> dict:
    """What a remount needs to reach a remote source again, recorded in the tag state when
    the tag is registered (a remount never changes it; registering the source again does):
    the S3 endpoint given with ``--s3-endpoint-url`` (S3 sources only) and ``--anon``. Empty
    for a local source. An endpoint carrying credentials (userinfo, a query) is not kept."""
    if local_path(src) is not None:
        return {}
    out: dict = {}
    endpoint = options.s3_endpoint_url
    if endpoint and url_protocol(src) in S3_PROTOCOLS:
        parts = urlsplit(endpoint)
        if parts.username or parts.password or parts.query or parts.fragment:
            log.warning("the S3 endpoint carries credentials: not kept for remounts")
        else:
            out["s3_endpoint_url"] = endpoint
    if options.anon:
        out["anon"] = True
    return out


def recovery_options(options: SourceOptions, recorded: dict) -> SourceOptions:
    """The options a recovered tag opens its source with: the mount's flags first, then what
    the tag was registered with (then, inside the S3 client, the environment)."""
    endpoint = options.s3_endpoint_url or str(recorded.get("s3_endpoint_url") or "")
    return replace(options, s3_endpoint_url=endpoint,
                   anon=options.anon or recorded.get("anon") is True)


def _open_cap() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return OPEN_BLOB_CACHE
    return max(16, min(OPEN_BLOB_CACHE, soft // 4))


def persistable(ctx: FaultContext) -> FaultContext:
    """``ctx`` as it may be hashed and persisted: a remote source URL with the credentials it
    carries (a presigned query, ``user:password@``) replaced by ``***`` (DESIGN §3)."""
    if local_path(ctx.src) is not None:
        return ctx
    from faultfs.assimilators.remote import persistable_src

    src = persistable_src(ctx.src)
    return ctx if src == ctx.src else replace(ctx, src=src)


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


def view_name_for(src: str) -> str:
    """The whole-object view's name: the source's basename."""
    path = local_path(src)
    base = os.path.basename((path if path is not None else src.split("?")[0]).rstrip("/"))
    try:
        return check_name(base, "source basename")
    except InvalidInput:
        return "data"


def default_tag_name(src: str) -> str:
    """A tag name from the source: its basename without the last extension."""
    base = view_name_for(src)
    stem = base.rsplit(".", 1)[0] if "." in base.lstrip(".") else base
    stem = stem.lstrip(".") or "data"
    return stem.replace("..", "_")
