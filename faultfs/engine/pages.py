"""PageService: the pages of a tag in the mount — its pagemap (load, cache, rewrite) and page reads.

A tag's pagemap is blob ``pagemap`` of the tag in the store (a user-written, dirty, durable
blob holding the text of docs/FORMAT-pagemap.md). Pages reach blobs only through the narrow
``PageBlobs`` protocol (chunk reads through the fault path, the tag's other stored blobs, the
stored map); like the engine this knows nothing of pyfuse3 and raises ``FaultfsError``.

Invariants:
- The map is loaded lazily, once per tag, on the I/O pool (parsing a large map takes seconds)
  and cached parsed; concurrent first uses share one load. A rewrite replaces the cached map
  itself, and a load that raced a rewrite never installs the older map (a generation check).
- Reading a page plans the slices of the requested window, fetches each blob they name once
  (chunk blobs of the tag through the fault path, any other blob from the store; at most
  ``PAGE_FETCHES`` at a time) and copies the slices over zeros in bounded steps, so one
  reader of a page of many slices cannot starve the mount. A slice that cannot be read fails
  the whole read with EIO: zeros are never served in place of data.
- ``.pagemap`` handles buffer text in memory (at most ``MAX_PAGEMAP_TEXT`` bytes each). A
  handle that was written or truncated is validated with ``parse_strict`` when the writer
  flushes (close): a malformed map is refused with EINVAL and the stored map stays; a valid one
  replaces the blob atomically (temp + fsync + rename), then subscribers (the FUSE adapter,
  which invalidates the kernel's caches) are told how many pages there were and are.
- The stored text is exactly what the writer wrote; reading ``.pagemap`` returns it verbatim.
- Only ``write_identity`` and the sync fallback of the size queries block the calling thread;
  the adapter awaits ``load`` first, so the fallback never runs on the trio thread in a mount.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Protocol

import trio
import trio.lowlevel

from faultfs.core.inodes import MAX_INDEX
from faultfs.core.pagemap import (
    EMPTY_PAGEMAP,
    MAX_PAGEMAP_TEXT,
    PageMap,
    identity,
    parse,
    parse_strict,
)
from faultfs.core.pagify import plan_page, window_size
from faultfs.engine.tags import Tag
from faultfs.errors import FaultfsError, InvalidInput
from faultfs.iopool import IoPool
from faultfs.stats import Stats
from faultfs.tiers.base import Buffer

log = logging.getLogger("faultfs.pages")

PAGEMAP_BLOB = "pagemap"  # DESIGN §2: the pagemap is blob "pagemap" of its tag
# A hostile map with tiny pages over a huge range shows only as many pages as an inode can
# number (core.inodes), rather than colliding inode numbers.
MAX_PAGES_SHOWN = MAX_INDEX + 1

PAGE_FETCHES = 8  # blobs one page read fetches at once: the I/O pool stays open to others
ASSEMBLE_STEP = 4096  # slices copied between checkpoints of the serving thread
# subscriber(tag, pages_before, pages_after), awaited after a map is replaced in a mount.
ChangeListener = Callable[["Tag", int, int], Awaitable[None]]


@dataclass
class _Loaded:
    """What the store holds for one tag's pagemap, parsed."""

    present: bool  # the blob exists (possibly unusable: then pagemap is EMPTY_PAGEMAP)
    pagemap: PageMap
    text_size: int  # bytes of stored text: the size of <tag>/.pagemap
    mtime_ns: int  # when the map was written: the mtime of .pagemap and of every page


_ABSENT = _Loaded(False, EMPTY_PAGEMAP, 0, 0)


@dataclass
class _Handle:
    """One open ``<tag>/.pagemap``: a private copy of the text, written back on flush."""

    tag: Tag
    writable: bool
    buf: bytearray
    dirty: bool = False  # written or truncated since the last flush


@dataclass
class _TagPages:
    """Per-tag state: the cached map, the load in flight and the writer lock."""

    loaded: _Loaded | None = None
    generation: int = 0  # bumped by every rewrite; a load from an older one is discarded
    loading: trio.Event | None = None
    write_lock: trio.Lock = field(default_factory=trio.Lock)


class PageBlobs(Protocol):
    """What pages need of the engine's blobs. The blocking calls run on the I/O pool."""

    async def read_chunk(self, tag: Tag, index: int, off: int, size: int) -> Buffer:
        """Bytes of chunk ``index`` through the fault path."""
        ...

    async def read_named(self, tag: Tag, name: str, lo: int, hi: int) -> Buffer | None:
        """Bytes ``[lo, hi)`` of another blob of the tag (a user blob, or one stored by
        name); None when there is none. FaultfsError when it is damaged user data."""
        ...

    def change(self, tag: Tag) -> AbstractAsyncContextManager[None]:
        """Around a page write: its slices and gaps are one change of the tag (a clone
        holds all of them or none)."""
        ...

    async def write_slice(self, tag: Tag, name: str, off: int, data: bytes) -> None:
        """Write bytes a page maps onto blob ``name`` (a chunk or a user blob)."""
        ...

    async def read_gap(self, tag: Tag, page: int, off: int, size: int) -> bytes | None:
        """Bytes written into the gaps of page ``page`` (None: none were)."""
        ...

    async def write_gap(self, tag: Tag, page: int, off: int, data: bytes) -> None:
        """Keep bytes written where the map has no slice (they read back, survive remounts)."""
        ...

    def load_pagemap(self, tag: Tag) -> tuple[bytes, int] | None:
        """The stored map's text and when it was written (ns), or None (blocking)."""
        ...

    def save_pagemap(self, tag: Tag, data: bytes) -> int:
        """Replace the stored map atomically and durably; when it was written (blocking)."""
        ...


class PageService:
    """Pages and pagemaps of an engine's tags; see the module docstring for the rules."""

    def __init__(self, blobs: PageBlobs, pool: IoPool, stats: Stats) -> None:
        self.blobs = blobs
        self.pool = pool
        self.stats = stats
        self._tags: dict[int, _TagPages] = {}
        self._handles: dict[int, _Handle] = {}
        self._next_fh = 1
        self._listeners: list[ChangeListener] = []

    def subscribe(self, listener: ChangeListener) -> None:
        """Call ``listener(tag, pages_before, pages_after)`` after every rewrite of a map."""
        self._listeners.append(listener)

    # -- loading ----------------------------------------------------------------------------

    def _state(self, tag: Tag) -> _TagPages:
        state = self._tags.get(tag.id)
        if state is None:
            state = self._tags[tag.id] = _TagPages()
        return state

    def _read_blocking(self, tag: Tag) -> _Loaded:
        """Read and parse the stored map (blocking: on the pool, or the sync fallback)."""
        try:  # payload blocks are verified by the read
            stored = self.blobs.load_pagemap(tag)
            if stored is None:
                return _ABSENT
            data, mtime_ns = stored
        except FaultfsError as exc:  # a damaged dirty blob: shown, unusable, rewritable
            log.error("tag %s: pagemap blob is damaged (%s): no pages are shown", tag.name, exc)
            return _Loaded(True, EMPTY_PAGEMAP, 0, time.time_ns())
        try:
            pagemap = parse(data.decode("utf-8"))
        except UnicodeDecodeError:
            pagemap = EMPTY_PAGEMAP
        if pagemap.empty:
            log.warning("tag %s: stored pagemap is malformed: no pages are shown", tag.name)
        elif pagemap.num_pages > MAX_PAGES_SHOWN:
            log.warning("tag %s: pagemap has %d pages; only the first %d are shown",
                        tag.name, pagemap.num_pages, MAX_PAGES_SHOWN)
        return _Loaded(True, pagemap, len(data), mtime_ns)

    async def load(self, tag: Tag) -> PageMap:
        """The tag's parsed map (EMPTY_PAGEMAP when it has none), loading it once."""
        return (await self._load(tag)).pagemap

    async def _load(self, tag: Tag) -> _Loaded:
        state = self._state(tag)
        while state.loaded is None:
            if state.loading is not None:
                await state.loading.wait()
                continue
            state.loading = event = trio.Event()
            generation = state.generation
            try:
                loaded = await self.pool.run(self._read_blocking, tag)
                if state.generation == generation and state.loaded is None:
                    state.loaded = loaded
            finally:
                state.loading = None
                event.set()
        return state.loaded

    def _cached(self, tag: Tag) -> _Loaded:
        """The cached map, or (a fallback outside the mount's request path) a blocking load."""
        state = self._state(tag)
        if state.loaded is None:
            log.debug("tag %s: pagemap loaded synchronously", tag.name)
            state.loaded = self._read_blocking(tag)
        return state.loaded

    # -- what the tree shows ------------------------------------------------------------------

    def has_pagemap(self, tag: Tag) -> bool:
        return self._cached(tag).present

    def num_pages(self, tag: Tag) -> int:
        return min(self._cached(tag).pagemap.num_pages, MAX_PAGES_SHOWN)

    def page_size(self, tag: Tag) -> int:
        return self._cached(tag).pagemap.page_size

    def pagemap_size(self, tag: Tag) -> int:
        return self._cached(tag).text_size

    def pagemap_mtime_ns(self, tag: Tag) -> int:
        """When the map was last written (0 without one): the mtime of pages and .pagemap.

        A rewrite changes it, so the kernel drops cached page data at its next attribute
        refresh even where no explicit invalidation reached it."""
        return self._cached(tag).mtime_ns

    # -- page reads ---------------------------------------------------------------------------

    async def read_page(self, tag: Tag, page_id: int, off: int, size: int) -> bytes:
        """Bytes ``[off, off+size)`` of page ``page_id`` (clipped to the page size).

        Each blob the window's slices name is fetched once (the span of it they cover), by
        at most ``PAGE_FETCHES`` at a time, then the slices are copied into place with a
        checkpoint every ``ASSEMBLE_STEP``: a page of many slices never fills the I/O pool
        or holds the serving thread, so other readers of the mount keep being served."""
        pagemap = await self.load(tag)
        if pagemap.empty or not 0 <= page_id < min(pagemap.num_pages, MAX_PAGES_SHOWN):
            raise FaultfsError(f"tag {tag.name} has no page {page_id}", errno.ENOENT)
        window = window_size(pagemap, off, size)
        if window == 0:
            return b""
        stats = self.stats
        stats.add("page_reads")
        slices = plan_page(pagemap, page_id, off, window)
        stats.add("page_slices", len(slices))
        spans: dict[str, list[int]] = {}  # blob -> [lo, hi) of it the slices cover
        for piece in slices:
            span = spans.get(piece.blob_name)
            end = piece.blob_off + piece.size
            if span is None:
                spans[piece.blob_name] = [piece.blob_off, end]
            else:
                span[0], span[1] = min(span[0], piece.blob_off), max(span[1], end)
        fetched: dict[str, Buffer] = {}
        errors: list[str] = []
        todo = iter(spans.items())

        async def fetcher() -> None:
            for name, (lo, hi) in todo:
                try:
                    fetched[name] = await self._read_span(tag, name, lo, hi)
                except FaultfsError as exc:
                    errors.append(exc.message)
                except Exception as exc:
                    log.exception("tag %s page %d: reading %s failed", tag.name, page_id, name)
                    errors.append(f"{name}: {exc}")

        if len(spans) == 1:
            await fetcher()
        elif spans:
            # No cancellation on the first failure: a fault other readers may have joined
            # must finish, or they would see a spurious error.
            async with trio.open_nursery() as nursery:
                for _ in range(min(PAGE_FETCHES, len(spans))):
                    nursery.start_soon(fetcher)
        gaps = await self.blobs.read_gap(tag, page_id, off, window)
        dst = bytearray(window)  # gaps read as zero, or as what was written there
        if gaps:
            dst[:len(gaps)] = gaps
        short = False
        for k, piece in enumerate(slices):
            if errors:
                break
            data = fetched[piece.blob_name]
            lo = spans[piece.blob_name][0]
            part = memoryview(data)[piece.blob_off - lo:piece.blob_off - lo + piece.size]
            if len(part) != piece.size:
                short = True  # the blob is shorter than the map says: the page fails
                break
            dst[piece.dst_off:piece.dst_off + piece.size] = part
            if k % ASSEMBLE_STEP == ASSEMBLE_STEP - 1:
                await trio.lowlevel.checkpoint()
        if errors or short:
            stats.add("page_errors")
            reason = errors[0] if errors else "a slice is shorter than the pagemap says"
            log.error("tag %s: page %d [%d, %d) failed: %s", tag.name, page_id, off,
                      off + window, reason)
            raise FaultfsError(f"page {page_id} of tag {tag.name}: {reason}", errno.EIO)
        return bytes(dst)

    async def write_page(self, tag: Tag, page_id: int, off: int, data: bytes) -> int:
        """Write bytes ``[off, off+len(data))`` of page ``page_id``: each slice's bytes go to
        its blob (copy-on-write); bytes over gaps are kept for the page (``write_gap``)."""
        pagemap = await self.load(tag)
        if pagemap.empty or not 0 <= page_id < min(pagemap.num_pages, MAX_PAGES_SHOWN):
            raise FaultfsError(f"tag {tag.name} has no page {page_id}", errno.ENOENT)
        if off + len(data) > pagemap.page_size:
            raise FaultfsError(f"page {page_id} of tag {tag.name} is {pagemap.page_size} bytes: "
                               "a write past its end cannot grow it", errno.EFBIG)
        covered = 0  # bytes of the window [0, len(data)) up to which slices or gaps were written
        async with self.blobs.change(tag):
            for piece in plan_page(pagemap, page_id, off, len(data)):
                if piece.dst_off > covered:
                    await self.blobs.write_gap(tag, page_id, off + covered,
                                               data[covered:piece.dst_off])
                await self.blobs.write_slice(tag, piece.blob_name, piece.blob_off,
                                             data[piece.dst_off:piece.dst_off + piece.size])
                covered = piece.dst_off + piece.size
            if covered < len(data):
                await self.blobs.write_gap(tag, page_id, off + covered, data[covered:])
        return len(data)

    def cached_map(self, tag: Tag) -> PageMap | None:
        """The tag's map if it is loaded (no I/O), else None."""
        state = self._tags.get(tag.id)
        return None if state is None or state.loaded is None else state.loaded.pagemap

    async def _read_span(self, tag: Tag, name: str, lo: int, hi: int) -> Buffer:
        """Bytes ``[lo, hi)`` of one blob a page needs: a chunk through the fault path, else a
        stored blob. May be shorter (the blob is); the page then fails."""
        index = tag.layout.blob_index(name)
        if index is not None:
            return await self.blobs.read_chunk(tag, index, lo, hi - lo)
        data = await self.blobs.read_named(tag, name, lo, hi)
        if data is None:
            raise FaultfsError(f"blob {name} of tag {tag.name} does not exist", errno.EIO)
        return data

    # -- .pagemap handles ---------------------------------------------------------------------

    async def open_pagemap(self, tag: Tag, flags: int) -> int:
        """A handle on ``<tag>/.pagemap`` holding the stored text (none with O_TRUNC)."""
        writable = flags & os.O_ACCMODE != os.O_RDONLY
        truncate = writable and bool(flags & os.O_TRUNC)
        buf = bytearray()
        if not truncate:
            await self._load(tag)
            data = await self.pool.run(self._stored_text, tag)
            buf = bytearray(data)
        handle = _Handle(tag, writable, buf, dirty=truncate)
        fh = self._next_fh
        self._next_fh += 1
        self._handles[fh] = handle
        return fh

    def _stored_text(self, tag: Tag) -> bytes:
        try:
            stored = self.blobs.load_pagemap(tag)
        except FaultfsError:
            return b""  # damaged: reads empty, and a rewrite replaces it
        return stored[0] if stored is not None else b""

    def _handle(self, fh: int) -> _Handle:
        handle = self._handles.get(fh)
        if handle is None:
            raise FaultfsError(f"pagemap handle {fh} is not open", errno.EBADF)
        return handle

    def handle_read(self, fh: int, off: int, size: int) -> bytes:
        return bytes(self._handle(fh).buf[off:off + size])

    def handle_write(self, fh: int, off: int, buf: bytes) -> int:
        handle = self._handle(fh)
        if not handle.writable:
            raise FaultfsError("pagemap handle is read-only", errno.EBADF)
        end = off + len(buf)
        if off < 0 or end > MAX_PAGEMAP_TEXT:
            raise FaultfsError(f"a pagemap is at most {MAX_PAGEMAP_TEXT} bytes", errno.EFBIG)
        if off > len(handle.buf):
            handle.buf.extend(bytes(off - len(handle.buf)))
        handle.buf[off:end] = buf
        handle.dirty = True
        return len(buf)

    def handle_truncate(self, fh: int, size: int) -> None:
        handle = self._handle(fh)
        if not handle.writable:
            raise FaultfsError("pagemap handle is read-only", errno.EBADF)
        if not 0 <= size <= MAX_PAGEMAP_TEXT:
            raise FaultfsError(f"a pagemap is at most {MAX_PAGEMAP_TEXT} bytes", errno.EFBIG)
        if size < len(handle.buf):
            del handle.buf[size:]
        else:
            handle.buf.extend(bytes(size - len(handle.buf)))
        handle.dirty = True

    async def flush(self, fh: int) -> None:
        """Install the handle's text if it changed: EINVAL (nothing changes) when malformed."""
        handle = self._handles.get(fh)
        if handle is None or not handle.dirty:
            return
        handle.dirty = False  # a refused text is refused once; a later write re-arms it
        await self._commit(handle.tag, bytes(handle.buf))

    async def close(self, fh: int) -> None:
        """Release a handle; text written after the last flush is installed (errors logged)."""
        try:
            await self.flush(fh)
        except FaultfsError as exc:
            log.warning("pagemap written at release was refused: %s", exc)
        finally:
            self._handles.pop(fh, None)

    async def _commit(self, tag: Tag, data: bytes) -> None:
        state = self._state(tag)
        async with state.write_lock:
            previous = await self._load(tag)
            before = previous.pagemap
            pagemap = await self.pool.run(_validate, tag.name, data)
            loaded = await self.pool.run(self._store_blocking, tag, data, pagemap)
            # File times are coarse (a jiffy): two rewrites must still differ, or the kernel's
            # mtime check (auto_inval_data) would keep the older pages' cached data.
            loaded.mtime_ns = max(loaded.mtime_ns, previous.mtime_ns + 1)
            state.generation += 1
            state.loaded = loaded
            log.info("tag %s: pagemap replaced (%d pages of %d bytes, %d extents)", tag.name,
                     pagemap.num_pages, pagemap.page_size, len(pagemap.extents))
            old_pages = min(before.num_pages, MAX_PAGES_SHOWN)
            new_pages = min(pagemap.num_pages, MAX_PAGES_SHOWN)
            for listener in self._listeners:
                await listener(tag, old_pages, new_pages)

    def _store_blocking(self, tag: Tag, data: bytes, pagemap: PageMap) -> _Loaded:
        """Replace the stored map atomically and durably (blocking)."""
        return _Loaded(True, pagemap, len(data), self.blobs.save_pagemap(tag, data))

    # -- identity maps (--page-size) ----------------------------------------------------------

    def write_identity(self, tag: Tag, page_size: int) -> None:
        """Blocking, before the mount serves: store the identity map of the tag's range, so
        ``page:N`` is bytes ``[N*ps, (N+1)*ps)`` of it (zero-padded at the end)."""
        layout = tag.layout
        pagemap = identity(page_size, layout.size, layout.chunk_size, layout.blob_prefix)
        data = pagemap.serialize().encode("utf-8")
        state = self._state(tag)
        state.generation += 1
        try:
            stored = self.blobs.load_pagemap(tag)
        except FaultfsError:
            stored = None  # damaged: replaced below
        if stored is not None and stored[0] == data:  # a remount with the same --page-size
            state.loaded = _Loaded(True, pagemap, len(data), stored[1])
            return
        state.loaded = self._store_blocking(tag, data, pagemap)
        log.info("tag %s: identity pagemap written (%d pages of %d bytes)", tag.name,
                 pagemap.num_pages, page_size)


def _validate(tag_name: str, data: bytes) -> PageMap:
    """``data`` as a map a writer may install; InvalidInput (EINVAL) with the reason if not."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidInput(f"tag {tag_name}: pagemap is not UTF-8 (byte {exc.start})") from None
    try:
        return parse_strict(text)
    except InvalidInput as exc:
        raise InvalidInput(f"tag {tag_name}: {exc.message}; the old pagemap stays") from None
