"""The thin pyfuse3 adapter: inode numbers, attributes, directory listings, one errno boundary.

Inodes are computed, not allocated: ``(tag_id << 40) | (kind << 36) | index``. A tag with
millions of chunks costs no memory per entry, listings stream from any offset, and ``forget``
has nothing to release. Every handler converts arguments, awaits the engine and builds the
reply; the only exception it raises is ``pyfuse3.FUSEError`` — anything unexpected is logged
with its traceback and becomes EIO, so one bad request never kills the daemon.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import stat
import time

import pyfuse3
import trio

from faultfs.engine import Engine, Tag
from faultfs.errors import FaultfsError

log = logging.getLogger("faultfs.fuse")

ROOT = pyfuse3.ROOT_INODE
CTL_DIR, STATS_FILE, REGISTRY_DIR = 2, 3, 4
STATS_HANDLES = 1 << 61  # file handles of .faultfs/stats count up from here (pagemaps: 1 << 62)
CTL_NAME = ".faultfs"
PAGEMAP_NAME = ".pagemap"
PAGE_PREFIX = "page:"

KIND_DIR, KIND_CHUNK, KIND_VIEW, KIND_PAGE, KIND_PAGEMAP, KIND_REGISTRY = 1, 2, 3, 4, 5, 6
INDEX_BITS, KIND_BITS = 36, 4
INDEX_MASK = (1 << INDEX_BITS) - 1

ENTRY_TIMEOUT = 300.0  # the tree's shape never changes while mounted
ATTR_TIMEOUT = 1.0  # st_blocks grows as blobs are staged: let du see it within a second
# After a pagemap rewrite, page inodes below this index are invalidated one by one (a few µs
# each, off the trio thread); pages past it rely on their mtime changing (auto_inval_data
# drops their cached data at the next attribute refresh, within ATTR_TIMEOUT).
INVALIDATE_PAGES_MAX = 1 << 20


def make_inode(tag_id: int, kind: int, index: int = 0) -> int:
    return (tag_id << (INDEX_BITS + KIND_BITS)) | (kind << INDEX_BITS) | index


def split_inode(inode: int) -> tuple[int, int, int]:
    return (inode >> (INDEX_BITS + KIND_BITS), (inode >> INDEX_BITS) & 0xF, inode & INDEX_MASK)


def fuse_boundary(fn):
    """Turn engine errors into their errno and anything unexpected into a logged EIO."""

    @functools.wraps(fn)
    async def wrapper(*args, **kwargs):
        try:
            return await fn(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except FaultfsError as exc:
            log.debug("%s: %s", fn.__name__, exc)
            raise pyfuse3.FUSEError(exc.errno) from None
        except Exception:
            log.exception("unexpected error in %s", fn.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper


class FaultOperations(pyfuse3.Operations):
    """pyfuse3 operations over an ``Engine``."""

    def __init__(self, engine: Engine) -> None:
        super().__init__()
        self.engine = engine
        self.uid = os.getuid()
        self.gid = os.getgid()
        self.mounted_at = time.time_ns()
        self.registry_keys = sorted(engine.registry)
        self._stats_open: dict[int, bytes] = {}  # open handles of .faultfs/stats
        self._stats_fh = STATS_HANDLES
        self._invalidations = trio.CapacityLimiter(1)  # one notifier thread at a time
        engine.pages.subscribe(self._pages_changed)

    # -- naming ------------------------------------------------------------------------------

    def _tag_of(self, tag_id: int) -> Tag:
        tag = self.engine.tags_by_id.get(tag_id)
        if tag is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return tag

    def _sorted_tags(self) -> list[Tag]:
        return sorted(self.engine.tags.values(), key=lambda t: t.name)

    def _tag_entries(self, tag: Tag, start: int):
        """``(position, name, inode)`` of a tag directory, from ``start``, lazily."""
        fixed = [(tag.view_name, make_inode(tag.id, KIND_VIEW))]
        if self.engine.has_pagemap(tag):
            fixed.append((PAGEMAP_NAME, make_inode(tag.id, KIND_PAGEMAP)))
        pos = start
        while pos < len(fixed):
            yield (pos, *fixed[pos])
            pos += 1
        n_chunks = tag.layout.num_blobs
        while pos < len(fixed) + n_chunks:
            index = pos - len(fixed)
            yield pos, tag.layout.blob_name(index), make_inode(tag.id, KIND_CHUNK, index)
            pos += 1
        n_pages = self.engine.num_pages(tag)
        while pos < len(fixed) + n_chunks + n_pages:
            index = pos - len(fixed) - n_chunks
            yield pos, f"{PAGE_PREFIX}{index}", make_inode(tag.id, KIND_PAGE, index)
            pos += 1

    def _lookup_in_tag(self, tag: Tag, name: str) -> int:
        if name == tag.view_name:
            return make_inode(tag.id, KIND_VIEW)
        if name.startswith(PAGE_PREFIX):
            digits = name[len(PAGE_PREFIX):]
            if digits.isascii() and digits.isdigit() and (digits == "0" or digits[0] != "0"):
                index = int(digits)
                if index < self.engine.num_pages(tag):
                    return make_inode(tag.id, KIND_PAGE, index)
            raise pyfuse3.FUSEError(errno.ENOENT)
        if name == PAGEMAP_NAME and self.engine.has_pagemap(tag):
            return make_inode(tag.id, KIND_PAGEMAP)
        index = tag.layout.blob_index(name)
        if index is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return make_inode(tag.id, KIND_CHUNK, index)

    # -- attributes --------------------------------------------------------------------------

    def _attr(self, inode: int) -> pyfuse3.EntryAttributes:
        attr = pyfuse3.EntryAttributes()
        attr.st_ino = inode
        attr.st_uid = self.uid
        attr.st_gid = self.gid
        attr.entry_timeout = ENTRY_TIMEOUT
        attr.attr_timeout = ATTR_TIMEOUT
        attr.st_blksize = 1 << 17
        mtime = self.mounted_at
        size, blocks = 0, 0
        if inode in (ROOT, CTL_DIR, REGISTRY_DIR):
            attr.st_mode = stat.S_IFDIR | 0o755
            attr.st_nlink = 2
        elif inode == STATS_FILE:
            attr.st_mode = stat.S_IFREG | 0o444
            attr.attr_timeout = 0
        else:
            tag_id, kind, index = split_inode(inode)
            if kind == KIND_REGISTRY:
                if index >= len(self.registry_keys):
                    raise pyfuse3.FUSEError(errno.ENOENT)
                attr.st_mode = stat.S_IFREG | 0o400
                size = len(self.engine.registry[self.registry_keys[index]])
            else:
                tag = self._tag_of(tag_id)
                mtime = int(tag.mtime * 1e9)
                cs = tag.layout.chunk_size
                if kind == KIND_DIR:
                    attr.st_mode = stat.S_IFDIR | 0o755
                    attr.st_nlink = 2
                elif kind == KIND_CHUNK:
                    if index >= tag.layout.num_blobs:
                        raise pyfuse3.FUSEError(errno.ENOENT)
                    attr.st_mode = stat.S_IFREG | 0o444
                    size = cs
                    blocks = cs if tag.is_staged(index) else 0
                elif kind == KIND_VIEW:
                    attr.st_mode = stat.S_IFREG | 0o444
                    size = tag.layout.size
                    blocks = min(size, tag.staged_count * cs)
                elif kind == KIND_PAGE:
                    if index >= self.engine.num_pages(tag):
                        raise pyfuse3.FUSEError(errno.ENOENT)
                    attr.st_mode = stat.S_IFREG | 0o444
                    size = self.engine.page_size(tag)
                    mtime = self.engine.pages.pagemap_mtime_ns(tag) or mtime
                elif kind == KIND_PAGEMAP:
                    attr.st_mode = stat.S_IFREG | 0o644
                    size = self.engine.pagemap_size(tag)
                    mtime = self.engine.pages.pagemap_mtime_ns(tag) or mtime
                    attr.attr_timeout = 0
                else:
                    raise pyfuse3.FUSEError(errno.ENOENT)
        attr.st_size = size
        attr.st_blocks = (blocks + 511) // 512
        attr.st_atime_ns = attr.st_mtime_ns = attr.st_ctime_ns = mtime
        return attr

    # -- handlers ----------------------------------------------------------------------------

    @fuse_boundary
    async def lookup(self, parent_inode, name, ctx=None):
        text = os.fsdecode(name)
        if parent_inode == ROOT:
            if text == CTL_NAME:
                return self._attr(CTL_DIR)
            tag = self.engine.tags.get(text)
            if tag is None:
                raise pyfuse3.FUSEError(errno.ENOENT)
            return self._attr(make_inode(tag.id, KIND_DIR))
        if parent_inode == CTL_DIR:
            if text == "stats":
                return self._attr(STATS_FILE)
            if text == "registry":
                return self._attr(REGISTRY_DIR)
            raise pyfuse3.FUSEError(errno.ENOENT)
        if parent_inode == REGISTRY_DIR:
            try:
                index = self.registry_keys.index(text)
            except ValueError:
                raise pyfuse3.FUSEError(errno.ENOENT) from None
            return self._attr(make_inode(0, KIND_REGISTRY, index))
        tag_id, kind, _ = split_inode(parent_inode)
        if kind != KIND_DIR:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        tag = self._tag_of(tag_id)
        if text == PAGEMAP_NAME or text.startswith(PAGE_PREFIX):
            await self.engine.pages.load(tag)  # off the trio thread, once per tag
        return self._attr(self._lookup_in_tag(tag, text))

    @fuse_boundary
    async def getattr(self, inode, ctx=None):
        await self._pages_loaded(inode)
        return self._attr(inode)

    async def _pages_loaded(self, inode: int) -> None:
        """Load the pagemap of a page or .pagemap inode's tag before its attributes are built."""
        tag_id, kind, _ = split_inode(inode)
        if kind in (KIND_PAGE, KIND_PAGEMAP):
            await self.engine.pages.load(self._tag_of(tag_id))

    async def forget(self, inode_list):
        return  # computed inodes: nothing was allocated, nothing to release

    @fuse_boundary
    async def opendir(self, inode, ctx):
        if inode in (ROOT, CTL_DIR, REGISTRY_DIR) or split_inode(inode)[1] == KIND_DIR:
            return inode
        raise pyfuse3.FUSEError(errno.ENOTDIR)

    @fuse_boundary
    async def readdir(self, fh, start_id, token):
        if fh == ROOT:
            entries = [(CTL_NAME, CTL_DIR)]
            entries += [(t.name, make_inode(t.id, KIND_DIR)) for t in self._sorted_tags()]
            listing = ((i, n, ino) for i, (n, ino) in enumerate(entries) if i >= start_id)
        elif fh == CTL_DIR:
            entries = [("registry", REGISTRY_DIR), ("stats", STATS_FILE)]
            listing = ((i, n, ino) for i, (n, ino) in enumerate(entries) if i >= start_id)
        elif fh == REGISTRY_DIR:
            listing = ((i, k, make_inode(0, KIND_REGISTRY, i))
                       for i, k in enumerate(self.registry_keys) if i >= start_id)
        else:
            tag = self._tag_of(split_inode(fh)[0])
            await self.engine.pages.load(tag)
            listing = self._tag_entries(tag, start_id)
        for pos, name, inode in listing:
            if not pyfuse3.readdir_reply(token, os.fsencode(name), self._attr(inode), pos + 1):
                break

    @fuse_boundary
    async def open(self, inode, flags, ctx):
        if inode in (ROOT, CTL_DIR, REGISTRY_DIR):
            raise pyfuse3.FUSEError(errno.EISDIR)
        writing = flags & os.O_ACCMODE != os.O_RDONLY
        kind = split_inode(inode)[1]
        if inode == STATS_FILE:
            if writing:
                raise pyfuse3.FUSEError(errno.EACCES)
            # one snapshot per open: a reader reading in pieces gets one consistent document
            self._stats_fh += 1
            self._stats_open[self._stats_fh] = await self.stats_bytes()
            return pyfuse3.FileInfo(fh=self._stats_fh, direct_io=True, keep_cache=False)
        if kind == KIND_DIR:
            raise pyfuse3.FUSEError(errno.EISDIR)
        if writing and kind != KIND_PAGEMAP:
            raise pyfuse3.FUSEError(errno.EROFS)
        await self._pages_loaded(inode)
        self._attr(inode)  # ENOENT for an index that does not exist
        if kind == KIND_PAGEMAP:
            fh = await self.engine.open_pagemap(self._tag_of(split_inode(inode)[0]), flags)
            return pyfuse3.FileInfo(fh=fh, direct_io=True, keep_cache=False)
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    @fuse_boundary
    async def read(self, fh, off, size):
        if fh in self._stats_open:
            return self._stats_open[fh][off:off + size]
        if fh >= 1 << 62:  # a pagemap handle (see Engine.open_pagemap)
            return self.engine.pagemap_handle_read(fh, off, size)
        tag_id, kind, index = split_inode(fh)
        if kind == KIND_REGISTRY:
            return self.engine.registry[self.registry_keys[index]][off:off + size]
        tag = self._tag_of(tag_id)
        if kind == KIND_CHUNK:
            return await self.engine.read_blob(tag, index, off, size)
        if kind == KIND_VIEW:
            return await self.engine.read_view(tag, off, size)
        if kind == KIND_PAGE:
            return await self.engine.read_page(tag, index, off, size)
        raise pyfuse3.FUSEError(errno.EIO)

    @fuse_boundary
    async def create(self, parent_inode, name, mode, flags, ctx):
        """Only ``<tag>/.pagemap`` can be created: a tag without a map gets one on close."""
        tag_id, kind, _ = split_inode(parent_inode)
        if parent_inode in (ROOT, CTL_DIR, REGISTRY_DIR) or kind != KIND_DIR:
            raise pyfuse3.FUSEError(errno.EROFS)
        if os.fsdecode(name) != PAGEMAP_NAME:
            raise pyfuse3.FUSEError(errno.EROFS)
        tag = self._tag_of(tag_id)
        await self.engine.pages.load(tag)
        if flags & os.O_EXCL and self.engine.has_pagemap(tag):
            raise pyfuse3.FUSEError(errno.EEXIST)
        fh = await self.engine.open_pagemap(tag, flags)
        info = pyfuse3.FileInfo(fh=fh, direct_io=True, keep_cache=False)
        return info, self._attr(make_inode(tag.id, KIND_PAGEMAP))

    async def _pages_changed(self, tag: Tag, before: int, after: int) -> None:
        """A pagemap was replaced: drop what the kernel cached of the tag's pages."""
        await trio.to_thread.run_sync(self._invalidate_pages, tag.id, before, after,
                                      limiter=self._invalidations)

    @staticmethod
    def _invalidate_pages(tag_id: int, before: int, after: int) -> None:
        """Blocking, on a thread (never inside a handler on the trio thread: the kernel may
        wait for the directory lock there). Inodes and entries it does not know are skipped."""
        directory = make_inode(tag_id, KIND_DIR)

        def quietly(fn, *args) -> None:
            try:
                fn(*args)
            except OSError as exc:
                if exc.errno not in (errno.ENOENT, errno.ENOSYS):
                    log.debug("invalidating %s%r: %s", fn.__name__, args, exc)

        quietly(pyfuse3.invalidate_inode, directory, False)
        quietly(pyfuse3.invalidate_inode, make_inode(tag_id, KIND_PAGEMAP), True)
        limit = min(before, INVALIDATE_PAGES_MAX)
        for index in range(limit):  # data and sizes of pages that stay or go
            quietly(pyfuse3.invalidate_inode, make_inode(tag_id, KIND_PAGE, index), False)
        for index in range(after, limit):  # names that are gone
            quietly(pyfuse3.invalidate_entry, directory, f"{PAGE_PREFIX}{index}".encode())
        if before > INVALIDATE_PAGES_MAX:
            log.info("pagemap of tag %d changed with %d pages: pages past %d refresh within "
                     "%.0f s", tag_id, before, INVALIDATE_PAGES_MAX, ATTR_TIMEOUT)

    @fuse_boundary
    async def write(self, fh, off, buf):
        if fh >= 1 << 62:
            return self.engine.pagemap_handle_write(fh, off, buf)
        raise pyfuse3.FUSEError(errno.EROFS)

    @fuse_boundary
    async def setattr(self, inode, attr, fields, fh, ctx):
        await self._pages_loaded(inode)
        if fields.update_size and split_inode(inode)[1] == KIND_PAGEMAP:
            if fh is not None:
                self.engine.pagemap_handle_truncate(fh, attr.st_size)
            else:  # truncate(2) by path: through a handle of its own, installed at once
                await self._truncate_pagemap(inode, attr.st_size)
            return self._attr(inode)
        if fields.update_size or fields.update_mode or fields.update_uid or fields.update_gid:
            raise pyfuse3.FUSEError(errno.EROFS)
        return self._attr(inode)

    async def _truncate_pagemap(self, inode: int, size: int) -> None:
        tag = self._tag_of(split_inode(inode)[0])
        fh = await self.engine.open_pagemap(tag, os.O_RDWR)
        try:
            self.engine.pagemap_handle_truncate(fh, size)
            await self.engine.flush_pagemap(fh)
        finally:
            await self.engine.close_pagemap(fh)

    @fuse_boundary
    async def release(self, fh):
        if self._stats_open.pop(fh, None) is not None:
            return
        if fh >= 1 << 62:
            await self.engine.close_pagemap(fh)

    async def releasedir(self, fh):
        return

    @fuse_boundary
    async def flush(self, fh):
        if fh >= 1 << 62:
            await self.engine.flush_pagemap(fh)

    @fuse_boundary
    async def statfs(self, ctx):
        st = await self.engine.run_io(os.statvfs, self.engine.store.root)
        out = pyfuse3.StatvfsData()
        out.f_bsize = st.f_bsize
        out.f_frsize = st.f_frsize
        out.f_blocks = st.f_blocks
        out.f_bfree = st.f_bfree
        out.f_bavail = st.f_bavail
        out.f_files = st.f_files
        out.f_ffree = st.f_ffree
        out.f_favail = st.f_favail
        out.f_namemax = 255
        return out

    async def stats_bytes(self) -> bytes:
        snap = await self.engine.snapshot()
        return (json.dumps(snap, indent=1, sort_keys=True) + "\n").encode()
