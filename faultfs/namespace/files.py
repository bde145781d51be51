"""Open files of the tree: what a read, write, truncate, flush or release of each entry does.

Each open returns an ``OpenFile``; the FUSE adapter keeps them in one handle table and only
converts. Chunks, views and pages read through the engine and keep the kernel's page cache;
``.faultfs/stats`` is one snapshot per open (a reader reading in pieces gets one consistent
document); ``.pagemap`` buffers its text and installs it on flush (``engine.pages``).

Invariants:
- Only ``.pagemap`` is writable (writes of data land with copy-on-write, DESIGN §11): any
  other write is EROFS, a write open of ``stats`` EACCES.
- Nothing here blocks the trio thread.
"""

from __future__ import annotations

import errno
import os
from typing import Protocol

from faultfs.core import inodes
from faultfs.core.inodes import (
    KIND_CHUNK,
    KIND_PAGE,
    KIND_PAGEMAP,
    KIND_REGISTRY,
    KIND_VIEW,
    STATS_FILE,
)
from faultfs.core.names import PAGEMAP_NAME
from faultfs.engine import Engine, Tag
from faultfs.errors import FaultfsError
from faultfs.namespace.tree import Attributes, Node, Tree
from faultfs.tiers.base import Buffer


def _read_only() -> FaultfsError:
    return FaultfsError("the tree is read-only", errno.EROFS)


class OpenFile(Protocol):
    keep_cache: bool  # keep the kernel's cached pages of the file across opens
    direct_io: bool  # bypass the page cache (files whose size says nothing of their bytes)

    async def read(self, off: int, size: int) -> Buffer: ...

    async def write(self, off: int, data: bytes) -> int: ...

    async def truncate(self, size: int) -> None: ...

    async def flush(self) -> None: ...

    async def release(self) -> None: ...


class _ReadOnly:
    keep_cache = True
    direct_io = False

    async def write(self, off: int, data: bytes) -> int:
        raise _read_only()

    async def truncate(self, size: int) -> None:
        raise _read_only()

    async def flush(self) -> None:
        return

    async def release(self) -> None:
        return


class BlobFile(_ReadOnly):
    """A chunk, the whole-object view or a page."""

    def __init__(self, engine: Engine, node: Node) -> None:
        assert node.tag is not None
        self.engine = engine
        self.tag: Tag = node.tag
        self.kind = node.kind
        self.index = node.index

    async def read(self, off: int, size: int) -> Buffer:
        if self.kind == KIND_CHUNK:
            return await self.engine.read_blob(self.tag, self.index, off, size)
        if self.kind == KIND_VIEW:
            return await self.engine.read_view(self.tag, off, size)
        return await self.engine.pages.read_page(self.tag, self.index, off, size)


class BytesFile(_ReadOnly):
    """Fixed bytes: a registry entry, or a stats snapshot taken at open."""

    def __init__(self, data: bytes, *, direct_io: bool = False) -> None:
        self.data = data
        self.direct_io = direct_io
        self.keep_cache = not direct_io

    async def read(self, off: int, size: int) -> Buffer:
        return self.data[off:off + size]


class PagemapFile:
    """``<tag>/.pagemap``: a private copy of the text, installed on flush and release."""

    keep_cache = False
    direct_io = True

    def __init__(self, engine: Engine, fh: int) -> None:
        self.pages = engine.pages
        self.fh = fh

    async def read(self, off: int, size: int) -> Buffer:
        return self.pages.handle_read(self.fh, off, size)

    async def write(self, off: int, data: bytes) -> int:
        return self.pages.handle_write(self.fh, off, data)

    async def truncate(self, size: int) -> None:
        self.pages.handle_truncate(self.fh, size)

    async def flush(self) -> None:
        await self.pages.flush(self.fh)

    async def release(self) -> None:
        await self.pages.close(self.fh)


class Files:
    """Opens entries of a ``Tree``."""

    def __init__(self, tree: Tree) -> None:
        self.tree = tree
        self.engine = tree.engine

    async def open(self, inode: int, flags: int) -> OpenFile:
        node = await self.tree.load(inode)
        if node.is_dir:
            raise FaultfsError("is a directory", errno.EISDIR)
        writing = flags & os.O_ACCMODE != os.O_RDONLY
        if inode == STATS_FILE:
            if writing:
                raise FaultfsError("stats are read-only", errno.EACCES)
            return BytesFile(await self.tree.stats_document(), direct_io=True)
        if node.kind == KIND_PAGEMAP:
            assert node.tag is not None
            return PagemapFile(self.engine, await self.engine.pages.open_pagemap(node.tag, flags))
        if writing:
            raise _read_only()
        if node.kind == KIND_REGISTRY:
            return BytesFile(self.engine.registry[self.tree.registry_keys[node.index]])
        if node.kind in (KIND_CHUNK, KIND_VIEW, KIND_PAGE):
            return BlobFile(self.engine, node)
        raise FaultfsError("not a file", errno.EIO)

    async def create(self, parent: int, name: str, flags: int) -> tuple[OpenFile, Attributes]:
        """Only ``<tag>/.pagemap`` can be created: a tag without a map gets one on close."""
        directory = self.tree.node(parent)
        if directory.tag is None or not directory.is_dir or name != PAGEMAP_NAME:
            raise _read_only()
        tag = directory.tag
        await self.engine.pages.load(tag)
        if flags & os.O_EXCL and self.engine.pages.has_pagemap(tag):
            raise FaultfsError(f"{tag.name}/{PAGEMAP_NAME} exists", errno.EEXIST)
        handle = PagemapFile(self.engine, await self.engine.pages.open_pagemap(tag, flags))
        # the map exists once the handle is flushed; its entry is shown from now on
        node = Node(inodes.make(tag.id, KIND_PAGEMAP), KIND_PAGEMAP, tag)
        return handle, self.tree.attributes(node)

    async def change(self, parent: int, name: str) -> None:
        """A request to remove, rename or link ``name`` in ``parent``, or to make an entry
        there: EPERM for what the mount shows (chunks, views, pages, ``.pagemap``, tags,
        ``.faultfs``), EROFS for anything else — never "not implemented"."""
        try:
            await self.tree.lookup(parent, name)
        except FaultfsError as exc:
            if exc.errno != errno.ENOENT:
                raise
            raise _read_only() from None
        raise FaultfsError(f"{name} is part of the mounted tree: it cannot be removed, "
                           "renamed or replaced", errno.EPERM)

    async def set_size(self, inode: int, size: int, handle: OpenFile | None) -> None:
        """``truncate``/``ftruncate``: through the open handle, or (by path) a handle of its
        own, installed at once."""
        node = await self.tree.load(inode)
        if node.kind != KIND_PAGEMAP or node.tag is None:
            raise _read_only()
        if handle is not None:
            await handle.truncate(size)
            return
        own = PagemapFile(self.engine, await self.engine.pages.open_pagemap(node.tag, os.O_RDWR))
        try:
            await own.truncate(size)
            await own.flush()
        finally:
            await own.release()
