"""The mounted tree (DESIGN §7): which entries exist, what they are, and their attributes.

    <mount>/.faultfs/{stats, registry/fault:<16 hex>}
    <mount>/<tag>/{<view>, .pagemap, chunk_N…, page:N…}

Plain code over the engine, with no pyfuse3: the FUSE adapter only converts. Inodes are
computed (``core.inodes``). A lookup or listing that involves pages loads the tag's pagemap
first (off the trio thread, once per tag), so attributes are then built without I/O.

Invariants:
- Every name a listing shows, lookup finds with the same inode, and the reverse — except a
  chunk past the source that holds no writes (a hole of a grown view): lookup finds it, a
  listing leaves it out, so a listing costs what is there, not what the view's size allows
  (one byte written at 16 TiB listed 16.7 M names).
- Listings stream from any position; a tag with millions of chunks costs nothing per entry.
  A chunk's position is its index (after the fixed entries), so a write during a listing
  moves no other entry.
- An inode that names nothing (an index past the end, a tag gone) is ENOENT.
"""

from __future__ import annotations

import errno
import json
import stat
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from faultfs import metrics
from faultfs.core import inodes
from faultfs.core.inodes import (
    CONTROL_FILE,
    CTL_DIR,
    KIND_CHUNK,
    KIND_DIR,
    KIND_PAGE,
    KIND_PAGEMAP,
    KIND_REGISTRY,
    KIND_USER,
    KIND_VIEW,
    METRICS_FILE,
    REGISTRY_DIR,
    ROOT,
    STATS_FILE,
)
from faultfs.core.names import (
    CTL_NAME,
    MAX_NAME_BYTES,
    PAGE_PREFIX,
    PAGEMAP_NAME,
    XATTR_SOURCE,
    XATTR_STAGED,
    XATTR_TAG,
    is_hidden,
    parse_index,
)
from faultfs.engine import Engine, Tag
from faultfs.errors import FaultfsError

ENTRY_TIMEOUT = 300.0  # the tree's shape never changes while mounted
ATTR_TIMEOUT = 1.0  # st_blocks grows as blobs are staged: let du see it within a second
BLOCK_SIZE = 1 << 17  # st_blksize: tools read in 128 KiB pieces (FUSE's default request)
STATS_NAME, REGISTRY_NAME, METRICS_NAME = "stats", "registry", "metrics"
FIXED_DIRS = (ROOT, CTL_DIR, REGISTRY_DIR)
FIXED = (ROOT, CTL_DIR, REGISTRY_DIR, STATS_FILE, CONTROL_FILE, METRICS_FILE)  # the root's own entries
CONTROL_NAME = "control"  # .faultfs/control: requests to the daemon (reset, clone)


@dataclass(frozen=True, slots=True)
class Node:
    """What an inode is: its kind, its tag (None for the root's fixed entries) and index."""

    inode: int
    kind: int
    tag: Tag | None = None
    index: int = 0

    @property
    def is_dir(self) -> bool:
        return self.inode in FIXED_DIRS or self.kind == KIND_DIR


@dataclass(slots=True)
class Attributes:
    """``stat`` of an entry, as the kernel will see it."""

    inode: int
    mode: int
    size: int = 0
    staged_bytes: int = 0  # st_blocks is this in 512-byte units (rounded up)
    mtime_ns: int = 0
    nlink: int = 1
    atime_ns: int | None = None  # None: the mtime (only a user blob has its own)
    ctime_ns: int | None = None  # likewise
    attr_timeout: float = ATTR_TIMEOUT
    entry_timeout: float = ENTRY_TIMEOUT

    @property
    def blocks(self) -> int:
        """``st_blocks``: the staged bytes in 512-byte units, and never 0 for a non-empty
        file. A file with data and no blocks is one whole hole to archivers (GNU tar -S,
        bsdtar, cp --sparse): they would store zeros without reading a byte."""
        blocks = (self.staged_bytes + 511) // 512
        return max(blocks, 1) if self.size > 0 else blocks


def _missing() -> FaultfsError:
    return FaultfsError("no such entry", errno.ENOENT)


class Tree:
    """Entries and attributes of one mount's tree."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.pages = engine.pages
        self.mounted_at = time.time_ns()
        # .faultfs/registry: entry i is inode (0, KIND_REGISTRY, i), so an index never moves:
        # keys registered later are appended, a forgotten one leaves a hole (None)
        self._registry_keys: list[str | None] = sorted(engine.registry)
        self.stats_size = 0  # bytes of the last stats document: .faultfs/stats' size
        # who serves the mount (the FUSE adapter's): the stats document's "daemon" section
        self.daemon_info: Callable[[], dict] | None = None
        self.metrics_size = 0  # likewise for .faultfs/metrics
        # tag id -> the written chunks past its source, in order: taken when a listing starts
        # (one pass over the dirty blobs), used by the rest of it (a chunk written meanwhile
        # may be missed, as POSIX allows; one reset meanwhile is skipped)
        self._grown: dict[int, list[int]] = {}

    def registry_keys(self) -> list[str | None]:
        """The registry's keys by index, as the engine holds them now (tags registered or
        forgotten while mounted: a live refresh of the shared store, ``faultfs forget``)."""
        live = self.engine.registry
        keys = self._registry_keys
        if len(live) != sum(k is not None for k in keys) or any(
                k is not None and k not in live for k in keys):
            keys[:] = [k if k in live else None for k in keys]
            known = set(keys)
            keys.extend(sorted(k for k in live if k not in known))
        return keys

    def registry_key(self, index: int) -> str:
        keys = self.registry_keys()
        key = keys[index] if 0 <= index < len(keys) else None
        if key is None:
            raise _missing()
        return key

    # -- nodes -------------------------------------------------------------------------------

    def tag_of(self, tag_id: int) -> Tag:
        tag = self.engine.tags_by_id.get(tag_id)
        if tag is None:
            raise _missing()
        return tag

    def node(self, inode: int) -> Node:
        """What ``inode`` is; ENOENT when it names nothing (pages: the map must be loaded)."""
        if inode in FIXED:
            return Node(inode, 0)
        tag_id, kind, index = inodes.split(inode)
        if kind == KIND_REGISTRY:
            if tag_id:
                raise _missing()
            self.registry_key(index)  # ENOENT when it names nothing (now)
            return Node(inode, kind, None, index)
        tag = self.tag_of(tag_id)
        if kind == KIND_CHUNK and index < self.engine.num_chunks(tag):
            return Node(inode, kind, tag, index)
        if kind == KIND_USER and self.engine.user_name(tag, index) is not None:
            return Node(inode, kind, tag, index)
        if kind == KIND_PAGE and index < self.pages.num_pages(tag):
            return Node(inode, kind, tag, index)
        if kind in (KIND_DIR, KIND_VIEW, KIND_PAGEMAP) and not index:
            return Node(inode, kind, tag)  # .pagemap: lookup shows it only when there is one
        raise _missing()

    async def load(self, inode: int) -> Node:
        """``node(inode)``, after loading what its attributes need (a tag's pagemap)."""
        tag_id, kind, _ = inodes.split(inode)
        if kind in (KIND_PAGE, KIND_PAGEMAP) and inode not in FIXED:
            await self.pages.load(self.tag_of(tag_id))
        return self.node(inode)

    async def metrics_document(self) -> bytes:
        """``.faultfs/metrics``: the snapshot in the Prometheus text format."""
        data = metrics.render(await self.engine.snapshot()).encode()
        self.metrics_size = len(data)
        return data

    async def stats_document(self) -> bytes:
        """``.faultfs/stats``: the engine's snapshot as JSON (its size is the file's size)."""
        snap = await self.engine.snapshot()
        if self.daemon_info is not None:
            snap["daemon"] = self.daemon_info()
        data = (json.dumps(snap, indent=1, sort_keys=True) + "\n").encode()
        self.stats_size = len(data)
        return data

    # -- lookups and listings ----------------------------------------------------------------

    async def lookup(self, parent: int, name: str) -> Attributes:
        if len(name.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES:
            raise FaultfsError(f"{name[:40]}... is over {MAX_NAME_BYTES} bytes",
                               errno.ENAMETOOLONG)
        if parent == ROOT:
            if name == CTL_NAME:
                return self.attributes(self.node(CTL_DIR))
            tag = self.engine.tags.get(name)
            if tag is None and await self.engine.refresh_shared():
                tag = self.engine.tags.get(name)  # another node registered it meanwhile
            if tag is None:
                raise _missing()
            return self.attributes(Node(inodes.make(tag.id, KIND_DIR), KIND_DIR, tag))
        if parent == CTL_DIR:
            fixed = {STATS_NAME: STATS_FILE, REGISTRY_NAME: REGISTRY_DIR,
                     CONTROL_NAME: CONTROL_FILE, METRICS_NAME: METRICS_FILE}.get(name)
            if fixed is None:
                raise _missing()
            if fixed == STATS_FILE:
                await self.stats_document()
            elif fixed == METRICS_FILE:
                await self.metrics_document()
            return self.attributes(self.node(fixed))
        if parent == REGISTRY_DIR:
            try:
                index = self.registry_keys().index(name)
            except ValueError:
                raise _missing() from None
            return self.attributes(self.node(inodes.make(0, KIND_REGISTRY, index)))
        directory = self.node(parent)
        if not directory.is_dir or directory.tag is None:
            raise FaultfsError("not a directory", errno.ENOTDIR)
        tag = directory.tag
        if name == PAGEMAP_NAME or name.startswith(PAGE_PREFIX):
            await self.pages.load(tag)  # off the trio thread, once per tag
        return self.attributes(self.node(self._inode_in_tag(tag, name)))

    def _inode_in_tag(self, tag: Tag, name: str) -> int:
        if name == tag.view_name:
            return inodes.make(tag.id, KIND_VIEW)
        if name.startswith(PAGE_PREFIX):
            index = parse_index(name[len(PAGE_PREFIX):])
            if index is None or index >= self.pages.num_pages(tag):
                raise _missing()
            return inodes.make(tag.id, KIND_PAGE, index)
        if name == PAGEMAP_NAME:
            if not self.pages.has_pagemap(tag):
                raise _missing()
            return inodes.make(tag.id, KIND_PAGEMAP)
        engine = self.engine
        index = tag.layout.blob_index(name)
        if index is None and name.startswith(tag.layout.blob_prefix):  # a chunk past the source
            index = parse_index(name[len(tag.layout.blob_prefix):])
            if index is not None and index >= engine.num_chunks(tag):
                index = None
        if index is not None:
            return inodes.make(tag.id, KIND_CHUNK, index)
        uid = None if is_hidden(name) else engine.user_id(tag, name)
        if uid is None:
            raise _missing()
        return inodes.make(tag.id, KIND_USER, uid)

    async def getattr(self, inode: int) -> Attributes:
        if inode == STATS_FILE:
            await self.stats_document()  # its size is what reading it now gives
        elif inode == METRICS_FILE:
            await self.metrics_document()
        return self.attributes(await self.load(inode))

    async def listing(self, inode: int, start: int) -> Iterator[tuple[int, str, Attributes]]:
        """``(position, name, attributes)`` of a directory's entries from ``start``, lazily."""
        directory = self.node(inode)
        if not directory.is_dir:
            raise FaultfsError("not a directory", errno.ENOTDIR)
        if directory.tag is not None:
            await self.pages.load(directory.tag)
            if start == 0 or directory.tag.id not in self._grown:
                self._grown[directory.tag.id] = self._written_past_source(directory.tag)
        elif inode == ROOT and start == 0:
            await self.engine.refresh_shared()  # tags other nodes registered since the mount
        elif inode == CTL_DIR:
            await self.stats_document()
        return self._listing(directory, start)

    def _listing(self, directory: Node, start: int) -> Iterator[tuple[int, str, Attributes]]:
        for pos, name, inode in self._entries(directory, start):
            yield pos, name, self.attributes(self.node(inode))

    def _entries(self, directory: Node, start: int) -> Iterator[tuple[int, str, int]]:
        if directory.inode == ROOT:
            tags = sorted(self.engine.tags.values(), key=lambda t: t.name)
            fixed = [(CTL_NAME, CTL_DIR)] + [(t.name, inodes.make(t.id, KIND_DIR)) for t in tags]
            yield from ((i, n, ino) for i, (n, ino) in enumerate(fixed) if i >= start)
        elif directory.inode == CTL_DIR:
            fixed = [(CONTROL_NAME, CONTROL_FILE), (METRICS_NAME, METRICS_FILE),
                     (REGISTRY_NAME, REGISTRY_DIR), (STATS_NAME, STATS_FILE)]
            yield from ((i, n, ino) for i, (n, ino) in enumerate(fixed) if i >= start)
        elif directory.inode == REGISTRY_DIR:
            yield from ((i, k, inodes.make(0, KIND_REGISTRY, i))
                        for i, k in enumerate(self.registry_keys())
                        if i >= start and k is not None)
        else:
            assert directory.tag is not None
            yield from self._tag_entries(directory.tag, start)

    def _tag_entries(self, tag: Tag, start: int) -> Iterator[tuple[int, str, int]]:
        fixed = [(tag.view_name, inodes.make(tag.id, KIND_VIEW))]
        if self.pages.has_pagemap(tag):
            fixed.append((PAGEMAP_NAME, inodes.make(tag.id, KIND_PAGEMAP)))
        pos = start
        while pos < len(fixed):
            yield (pos, *fixed[pos])
            pos += 1
        engine = self.engine
        n_chunks = engine.num_chunks(tag)
        source = min(tag.layout.num_blobs, n_chunks)
        while pos < len(fixed) + source:
            index = pos - len(fixed)
            yield pos, tag.layout.blob_name(index), inodes.make(tag.id, KIND_CHUNK, index)
            pos += 1
        grown = self._grown.get(tag.id, [])
        for index in grown[bisect_left(grown, max(pos - len(fixed), source)):]:
            if index >= n_chunks:
                break
            if engine.written_chunks(tag, index):  # (not reset since the listing started)
                yield (len(fixed) + index, tag.layout.blob_name(index),
                       inodes.make(tag.id, KIND_CHUNK, index))
        pos = max(pos, len(fixed) + n_chunks)
        n_pages = self.pages.num_pages(tag)
        while pos < len(fixed) + n_chunks + n_pages:
            index = pos - len(fixed) - n_chunks
            yield pos, f"{PAGE_PREFIX}{index}", inodes.make(tag.id, KIND_PAGE, index)
            pos += 1
        users = engine.user_names(tag)
        first = len(fixed) + n_chunks + n_pages
        for k in range(max(0, pos - first), len(users)):
            uid = engine.user_id(tag, users[k])
            assert uid is not None
            yield first + k, users[k], inodes.make(tag.id, KIND_USER, uid)

    def _written_past_source(self, tag: Tag) -> list[int]:
        source = tag.layout.num_blobs
        return [i for i in self.engine.written_chunks(tag) if i >= source]

    # -- extended attributes -----------------------------------------------------------------

    def xattrs(self, node: Node) -> dict[str, bytes]:
        """``user.faultfs.*`` of an entry: what is staged (``st_blocks`` cannot say it for a
        file smaller than a block), and for a tag's files the tag and its source."""
        tag = node.tag
        if tag is None or node.is_dir:
            return {}
        out = {XATTR_TAG: tag.name.encode("utf-8", "surrogateescape")}
        if node.kind == KIND_CHUNK:
            out[XATTR_STAGED] = b"1" if self.engine.chunk_here(tag, node.index) else b"0"
        elif node.kind == KIND_VIEW:
            bits = self.engine.here_bitmap(tag)  # as the control request tells it: dirty too
            here = sum(b.bit_count() for b in bits)
            out[XATTR_STAGED] = f"{here}/{self.engine.num_chunks(tag)}".encode()
        if node.kind in (KIND_CHUNK, KIND_VIEW):
            out[XATTR_SOURCE] = tag.ctx.src.encode("utf-8", "surrogateescape")
        return out

    # -- attributes --------------------------------------------------------------------------

    def attributes(self, node: Node) -> Attributes:
        if node.is_dir:
            if node.tag is None:
                return Attributes(node.inode, stat.S_IFDIR | 0o755, mtime_ns=self.mounted_at,
                                  nlink=2)
            return Attributes(node.inode, stat.S_IFDIR | self.engine.attrs(node.tag, None)[0],
                              mtime_ns=int(node.tag.mtime * 1e9), nlink=2)
        if node.inode == STATS_FILE:
            return Attributes(node.inode, stat.S_IFREG | 0o444, self.stats_size,
                              mtime_ns=time.time_ns(), attr_timeout=0)
        if node.inode == METRICS_FILE:
            return Attributes(node.inode, stat.S_IFREG | 0o444, self.metrics_size,
                              mtime_ns=time.time_ns(), attr_timeout=0)
        if node.inode == CONTROL_FILE:
            return Attributes(node.inode, stat.S_IFREG | 0o600, mtime_ns=self.mounted_at,
                              attr_timeout=0)
        if node.kind == KIND_REGISTRY:
            size = len(self.engine.registry[self.registry_key(node.index)])
            return Attributes(node.inode, stat.S_IFREG | 0o400, size, mtime_ns=self.mounted_at)
        tag = node.tag
        assert tag is not None
        engine = self.engine
        mtime = max(int(tag.mtime * 1e9), engine.written_ns(tag))
        cs = tag.layout.chunk_size
        mode = stat.S_IFREG | (0o644 if engine.writable else 0o444)
        if node.kind == KIND_CHUNK:
            if node.index < tag.layout.num_blobs:
                here = engine.chunk_here(tag, node.index)
            else:  # past the source: held only where written (a hole costs no blocks)
                here = bool(engine.written_chunks(tag, node.index))
            return Attributes(node.inode, mode, cs, cs if here else 0, mtime)
        if node.kind == KIND_VIEW:
            size = engine.view_size(tag)
            staged = engine.staged_count(tag) + engine.dirty_summary(tag)[0]
            return Attributes(node.inode, mode, size, min(size, staged * cs), mtime)
        if node.kind == KIND_USER:
            name = engine.user_name(tag, node.index) or ""
            size = engine.user_size(tag, name)  # blocks: its parts, not its holes
            bits, atime, own_mtime, ctime = engine.attrs(tag, node.index)
            if not engine.writable:
                bits &= ~0o222
            return Attributes(node.inode, stat.S_IFREG | bits, size,
                              min(size, engine.user_held(tag, name)), own_mtime,
                              nlink=0 if is_hidden(name) else 1, atime_ns=atime, ctime_ns=ctime)
        map_mtime = self.pages.pagemap_mtime_ns(tag) or mtime
        if node.kind == KIND_PAGE:
            return Attributes(node.inode, mode, self.pages.page_size(tag),
                              mtime_ns=max(map_mtime, engine.written_ns(tag)))
        return Attributes(node.inode, stat.S_IFREG | 0o644, self.pages.pagemap_size(tag),
                          mtime_ns=map_mtime, attr_timeout=0)  # KIND_PAGEMAP
