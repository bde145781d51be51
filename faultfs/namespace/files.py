"""Open files of the tree: what a read, write, truncate, fsync, flush or release of each entry
does, and what creating, removing and renaming entries does.

Each open returns an ``OpenFile``; the FUSE adapter keeps them in one handle table and only
converts. Chunks, views, pages and user blobs read and write through the engine (writes are
copy-on-write, ``engine/writes/``) and keep the kernel's page cache; ``.faultfs/stats`` is
one snapshot per open; ``.pagemap`` buffers its text and installs it on flush
(``engine.pages``); ``.faultfs/control`` takes one request per open (``namespace/control``).

Invariants:
- A write through one name is seen through every other name of the same bytes: the kernel's
  cached pages of those bytes in the other inodes that were opened are dropped before the
  write is answered (``namespace/coherence.py`` says how, and how long a write waits).
- Writes are refused with EROFS on a read-only, read-through or degraded mount; a chunk's
  size is fixed (EFBIG past its end); what the mount shows cannot be removed or renamed
  (EPERM); only user blobs can. A rename flag is honoured or refused, never ignored.
- A user blob unlinked or replaced while a file has it open lives on under a hidden name
  (``Engine.hide_user``) and is read, written and stat'ed through its descriptors until the
  last one closes, which unlinks it — as POSIX keeps an open file (atomic-rename writers:
  editors, rsync, pip). A crash meanwhile drops it at the next mount.
- Nothing here blocks the trio thread.
"""

from __future__ import annotations

import collections
import errno
import os
from collections.abc import Awaitable, Callable, Iterable

from faultfs.core import inodes
from faultfs.core.chunks import pieces
from faultfs.core.inodes import (
    CONTROL_FILE,
    KIND_CHUNK,
    KIND_DIR,
    KIND_PAGE,
    KIND_PAGEMAP,
    KIND_REGISTRY,
    KIND_USER,
    KIND_VIEW,
    METRICS_FILE,
    ROOT,
    STATS_FILE,
)
from faultfs.core.names import PAGEMAP_NAME
from faultfs.engine import Engine, Tag
from faultfs.errors import FaultfsError
from faultfs.namespace.coherence import Coherence, Range
from faultfs.namespace.control import ControlFile
from faultfs.namespace.handle import OpenFile, PlainFile, read_only
from faultfs.namespace.tree import Attributes, Node, Tree
from faultfs.tiers.base import Buffer

RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2  # renameat2's flags (linux/fs.h; WHITEOUT is 4)
INVALIDATE_MAX = 4096  # ranges of other names dropped after one write at most (past it: mtime)


class BlobFile(PlainFile):
    """A chunk, the whole-object view, a page or a user blob."""

    def __init__(self, files: Files, node: Node) -> None:
        assert node.tag is not None
        self.files = files
        self.engine = files.engine
        self.tag: Tag = node.tag
        self.kind = node.kind
        self.index = node.index
        self.inode = node.inode
        files.live[self.tag.id] += 1
        files.open_count[self.inode] += 1
        self._released = False

    async def release(self) -> None:
        if not self._released:
            self._released = True
            self.files.live[self.tag.id] -= 1
            self.files.open_count[self.inode] -= 1
            if not self.files.open_count[self.inode]:
                del self.files.open_count[self.inode]
                await self.files.last_closed(self.tag, self.inode, self.index)

    def _user(self) -> str:
        name = self.engine.user_name(self.tag, self.index)
        if name is None:
            raise FaultfsError("the blob was removed", errno.ENOENT)
        return name

    async def read(self, off: int, size: int) -> Buffer:
        coherence = self.files.coherence
        pages = coherence.reading(self.inode, off, size)
        try:
            if self.kind == KIND_CHUNK:
                return await self.engine.read_blob(self.tag, self.index, off, size)
            if self.kind == KIND_VIEW:
                return await self.engine.read_view(self.tag, off, size)
            if self.kind == KIND_USER:
                return await self.engine.read_user(self.tag, self._user(), off, size)
            return await self.engine.pages.read_page(self.tag, self.index, off, size)
        finally:
            coherence.read_done(self.inode, pages)

    async def write(self, off: int, data: bytes, *, cached: bool = False) -> int:
        return await self.files.write(self, off, data, self._write, cached=cached)

    async def _write(self, off: int, data: bytes) -> int:
        if self.kind == KIND_CHUNK:
            return await self.engine.write_chunk(self.tag, self.index, off, data)
        if self.kind == KIND_VIEW:
            return await self.engine.write_view(self.tag, off, data)
        if self.kind == KIND_USER:
            return await self.engine.write_user(self.tag, self._user(), off, data)
        return await self.engine.pages.write_page(self.tag, self.index, off, data)

    async def truncate(self, size: int) -> None:
        engine = self.engine
        if self.kind == KIND_VIEW:
            old = engine.view_size(self.tag)
            await self.files.resize(self, old, size,
                                    lambda: engine.truncate_view(self.tag, size))
        elif self.kind == KIND_USER:
            name = self._user()
            old = engine.user_size(self.tag, name)
            await self.files.resize(self, old, size,
                                    lambda: engine.truncate_user(self.tag, name, size))
        elif self.kind != KIND_CHUNK or size != self.tag.layout.chunk_size:
            raise FaultfsError("chunks and pages have a fixed size", errno.EPERM)

    async def fsync(self) -> None:
        await self.engine.fsync()


class BytesFile(PlainFile):
    """Fixed bytes: a registry entry, or a stats snapshot taken at open."""

    def __init__(self, data: bytes, *, direct_io: bool = False) -> None:
        self.data = data
        self.direct_io = direct_io
        self.keep_cache = not direct_io

    async def read(self, off: int, size: int) -> Buffer:
        return self.data[off:off + size]


class PagemapFile(PlainFile):
    """``<tag>/.pagemap``: a private copy of the text, installed on flush and release."""

    keep_cache = False
    direct_io = True

    def __init__(self, engine: Engine, fh: int) -> None:
        self.pages = engine.pages
        self.fh = fh

    async def read(self, off: int, size: int) -> Buffer:
        return self.pages.handle_read(self.fh, off, size)

    async def write(self, off: int, data: bytes, *, cached: bool = False) -> int:
        return self.pages.handle_write(self.fh, off, data)

    async def truncate(self, size: int) -> None:
        self.pages.handle_truncate(self.fh, size)

    async def flush(self) -> None:
        await self.pages.flush(self.fh)

    async def release(self) -> None:
        await self.pages.close(self.fh)


class Files:
    """Opens entries of a ``Tree``, and creates, removes and renames them."""

    def __init__(self, tree: Tree) -> None:
        self.tree = tree
        self.engine = tree.engine
        self.invalidate_entry: Callable[[int, str], Awaitable[None]] | None = None
        # inodes whose pages the kernel may cache: opened since they were last invalidated
        # (a closed file's cache, once invalidated, stays empty until it is opened again)
        self.opened: set[int] = set()
        self.open_count: collections.Counter[int] = collections.Counter()  # inode -> handles
        self.coherence = Coherence(None, self.engine.stats)  # its drop: the FUSE adapter's
        self.live: collections.Counter[int] = collections.Counter()  # tag id -> open files
        self.hidden: dict[int, str] = {}  # inode -> hidden name of a user blob unlinked open

    async def open(self, inode: int, flags: int) -> OpenFile:
        node = await self.tree.load(inode)
        if node.is_dir:
            raise FaultfsError("is a directory", errno.EISDIR)
        # O_TRUNC changes the file whatever the access mode, as on a local file system
        # (Linux truncates on O_RDONLY|O_TRUNC and asks for write permission; the kernel
        # hands O_TRUNC to this open, atomic_o_trunc): it is a write here too
        truncating = bool(flags & os.O_TRUNC)
        writing = flags & os.O_ACCMODE != os.O_RDONLY or truncating
        if inode == STATS_FILE:
            if writing:
                raise FaultfsError("stats are read-only", errno.EACCES)
            return BytesFile(await self.tree.stats_document(), direct_io=True)
        if inode == METRICS_FILE:
            if writing:
                raise FaultfsError("metrics are read-only", errno.EACCES)
            return BytesFile(await self.tree.metrics_document(), direct_io=True)
        if inode == CONTROL_FILE:
            return ControlFile(self)
        if node.kind == KIND_PAGEMAP:
            assert node.tag is not None
            return PagemapFile(self.engine, await self.engine.pages.open_pagemap(node.tag, flags))
        if node.kind == KIND_REGISTRY:
            if writing:
                raise read_only()
            return BytesFile(self.engine.registry[self.tree.registry_key(node.index)])
        if node.kind in (KIND_CHUNK, KIND_VIEW, KIND_PAGE, KIND_USER):
            if writing and not self.engine.writable:
                raise read_only()
            if truncating and node.kind in (KIND_CHUNK, KIND_PAGE):
                # a fixed size: refused as truncate(2) of it is, before anything changes
                # (`printf x > chunk_7` must not leave x over the old tail and succeed)
                raise FaultfsError("chunks and pages have a fixed size: O_TRUNC is refused",
                                   errno.EPERM)
            self.opened.add(inode)
            handle = BlobFile(self, node)
            if truncating:  # a view or a user blob is emptied as by ftruncate(0)
                try:
                    await handle.truncate(0)
                except BaseException:
                    await handle.release()
                    raise
            return handle
        raise FaultfsError("not a file", errno.EIO)

    async def create(self, parent: int, name: str, flags: int,
                     mode: int = 0o644) -> tuple[OpenFile, Attributes]:
        """``<tag>/.pagemap`` (a tag without a map gets one on close), or a user blob with
        permission bits ``mode`` (kept, shown, changed only by ``chmod``)."""
        directory = self.tree.node(parent)
        if directory.tag is None or not directory.is_dir:
            raise read_only()
        tag = directory.tag
        if name == PAGEMAP_NAME:
            await self.engine.pages.load(tag)
            if flags & os.O_EXCL and self.engine.pages.has_pagemap(tag):
                raise FaultfsError(f"{tag.name}/{PAGEMAP_NAME} exists", errno.EEXIST)
            handle = PagemapFile(self.engine, await self.engine.pages.open_pagemap(tag, flags))
            # the map exists once the handle is flushed; its entry is shown from now on
            node = Node(inodes.make(tag.id, KIND_PAGEMAP), KIND_PAGEMAP, tag)
            return handle, self.tree.attributes(node)
        if not self.engine.writable:
            raise read_only()
        await self.engine.create_user(tag, name, mode)
        uid = self.engine.user_id(tag, name)
        assert uid is not None
        node = Node(inodes.make(tag.id, KIND_USER, uid), KIND_USER, tag, uid)
        self.opened.add(node.inode)
        return BlobFile(self, node), self.tree.attributes(node)

    async def remove(self, parent: int, name: str) -> None:
        """``unlink``: a user blob goes; what the mount shows cannot (EPERM)."""
        node = await self._existing(parent, name)
        if node.kind != KIND_USER:
            raise self._fixed(name)
        assert node.tag is not None
        if self.open_count.get(node.inode):
            await self._hide(node, name)
        else:
            await self.engine.unlink_user(node.tag, name)

    async def _hide(self, node: Node, name: str) -> None:
        """Unlink user blob ``name`` (``node``: the blob it names) while it is open: hidden
        until its last close, or unlinked now if that came while it was hidden."""
        assert node.tag is not None
        hidden = await self.engine.hide_user(node.tag, name, node.index)
        self.hidden[node.inode] = hidden
        if not self.open_count.get(node.inode):  # closed meanwhile: its release found none
            await self.last_closed(node.tag, node.inode, node.index)

    async def last_closed(self, tag: Tag, inode: int, uid: int) -> None:
        """The last descriptor of user blob ``uid`` closed: if it was unlinked, it goes now."""
        hidden = self.hidden.pop(inode, None)
        if hidden is not None and self.engine.user_id(tag, hidden) == uid:
            await self.engine.unlink_user(tag, hidden)

    async def rename(self, parent: int, name: str, new_parent: int, new_name: str,
                     flags: int = 0) -> None:
        """``rename``/``renameat2``: a user blob is renamed within its tag, replacing a user
        blob of the new name, or with RENAME_NOREPLACE refused (EEXIST) when anything has
        that name; with RENAME_EXCHANGE it swaps names with the user blob there (both must
        exist: ENOENT). What the mount shows is never moved (EPERM). A flag is honoured or
        refused (EINVAL: RENAME_WHITEOUT, both flags, any unknown), never ignored."""
        if flags & ~(RENAME_NOREPLACE | RENAME_EXCHANGE) or flags == (RENAME_NOREPLACE
                                                                     | RENAME_EXCHANGE):
            raise FaultfsError(f"rename flags {flags:#x} are not supported (only "
                               "RENAME_NOREPLACE or RENAME_EXCHANGE)", errno.EINVAL)
        node = await self._existing(parent, name)
        if node.kind != KIND_USER:
            raise self._fixed(name)
        if new_parent != parent:
            raise FaultfsError("a blob stays in its tag", errno.EXDEV)
        assert node.tag is not None
        engine = self.engine
        if flags & RENAME_EXCHANGE:
            if (await self._existing(new_parent, new_name)).kind != KIND_USER:
                raise self._fixed(new_name)
            await engine.exchange_users(node.tag, name, new_name)
        elif flags & RENAME_NOREPLACE:
            if await self._exists(new_parent, new_name):
                raise FaultfsError(f"{new_name} exists", errno.EEXIST)
            await engine.rename_user(node.tag, name, new_name, replace=False)
        else:
            target = await self._user_at(new_parent, new_name)
            if target is not None and self.open_count.get(target.inode) and target.inode != node.inode:
                # the replaced blob is open: the new name gets the renamed blob at once (one
                # record), then the old name, holding the replaced one now, is unlinked so
                await engine.exchange_users(node.tag, name, new_name)
                await self._hide(target, name)
            else:
                await engine.rename_user(node.tag, name, new_name)

    async def _user_at(self, parent: int, name: str) -> Node | None:
        """The user blob ``name`` names, else None."""
        if not await self._exists(parent, name):
            return None
        node = await self._existing(parent, name)
        return node if node.kind == KIND_USER else None

    async def change(self, parent: int, name: str) -> None:
        """``mkdir``, ``mknod``, ``symlink``, ``link``: a tag holds files only. EEXIST for a
        name the tree has, EPERM for a new one (EROFS only on a mount that takes no writes:
        "read-only" on a writable mount reads as a mount gone bad) — never "not
        implemented"."""
        if await self._exists(parent, name):
            raise FaultfsError(f"{name} exists", errno.EEXIST)
        if not self.engine.writable:
            raise read_only()
        raise FaultfsError(f"{name}: a tag holds files only, no directories, links or "
                           "special files", errno.EPERM)

    async def remove_dir(self, parent: int, name: str) -> None:
        """``rmdir``: a directory of the tree is never empty (a tag has its view; ``faultfs
        forget`` removes one), so ENOTEMPTY, as for any full directory; ENOTDIR for a file."""
        if not (await self._existing(parent, name)).is_dir:
            raise FaultfsError(f"{name} is not a directory", errno.ENOTDIR)
        raise FaultfsError(f"{name} is not empty", errno.ENOTEMPTY)

    async def _existing(self, parent: int, name: str) -> Node:
        return self.tree.node((await self.tree.lookup(parent, name)).inode)

    async def _exists(self, parent: int, name: str) -> bool:
        try:
            await self.tree.lookup(parent, name)
        except FaultfsError as exc:
            if exc.errno != errno.ENOENT:
                raise
            return False
        return True

    @staticmethod
    def _fixed(name: str) -> FaultfsError:
        return FaultfsError(f"{name} is part of the mounted tree: it cannot be removed, "
                            "renamed or replaced", errno.EPERM)

    async def set_attrs(self, inode: int, *, mode: int | None, atime_ns: int | None,
                        mtime_ns: int | None) -> None:
        """``chmod``/``utimensat``: a user blob keeps what it is given (durably); anything
        else takes only what it has already (its mode, its times are the tag's), EPERM for a
        change — never a success that changes nothing — but a directory's times, which are
        accepted and not kept (``rsync -a dir/ T/`` sets them after the files)."""
        node = await self.tree.load(inode)
        if node.kind == KIND_USER and node.tag is not None:
            name = self.engine.user_name(node.tag, node.index)
            if name is None:
                raise FaultfsError("the blob was removed", errno.ENOENT)
            if (atime_ns, mtime_ns) == (None, None) and mode in (
                    None, self.engine.attrs(node.tag, node.index)[0]):
                return  # nothing changes: fine on any mount
            if not self.engine.writable:
                raise read_only()
            await self.engine.set_attrs(node.tag, name, mode=mode, atime_ns=atime_ns,
                                        mtime_ns=mtime_ns)
            return
        now = self.tree.attributes(node)
        if node.kind == KIND_DIR and node.tag is not None and mode is not None:
            if mode != now.mode & 0o7777:  # a tag directory's mode is kept, as a blob's
                if not self.engine.writable:
                    raise read_only()
                await self.engine.set_attrs(node.tag, None, mode=mode)
            mode = None
        if mode is not None and mode != now.mode & 0o7777:
            raise FaultfsError("only a user blob's mode can change: the rest is the "
                               "mount's", errno.EPERM)
        if node.is_dir:
            return  # a directory's times are its tag's: `rsync -a dir/ T/` sets them last
        if (atime_ns, mtime_ns) != (None, None) and {atime_ns, mtime_ns} - {None, now.mtime_ns}:
            raise FaultfsError("only a user blob's times can be set: the rest are its "
                               "tag's", errno.EPERM)

    async def set_size(self, inode: int, size: int, handle: OpenFile | None) -> None:
        """``truncate``/``ftruncate``: through the open handle, or (by path) a handle of its
        own (a pagemap's is installed at once)."""
        node = await self.tree.load(inode)
        if node.tag is None:
            raise read_only()
        if handle is None:
            handle = await self.open(inode, os.O_RDWR)
            try:
                await handle.truncate(size)
                await handle.flush()
            finally:
                await handle.release()
            return
        await handle.truncate(size)

    # -- coherence (namespace/coherence.py) ---------------------------------------------------

    async def forgotten(self, tag: Tag) -> None:
        """The kernel forgets the directory of a tag that is gone."""
        self.opened = {i for i in self.opened if inodes.split(i)[0] != tag.id}
        self.live.pop(tag.id, None)
        if self.invalidate_entry is not None:
            await self.invalidate_entry(ROOT, tag.name)

    async def invalidate_tag(self, tag: Tag) -> None:
        """Everything the kernel cached of ``tag``'s files (a reset changed all of them)."""
        stale = [(i, 0, 0) for i in self.opened if inodes.split(i)[0] == tag.id]

        async def made(runs: list[tuple[int, int]]) -> int:
            return 0  # (the reset is made already)

        await self.coherence.change(tag.id, None, 0, 0, stale, made)
        self._dropped(stale)

    async def write(self, file: BlobFile, off: int, data: bytes,
                    apply: Callable[[int, bytes], Awaitable[int]], *, cached: bool) -> int:
        """``apply`` the write of ``data`` at ``off`` through ``file`` with the other names
        of those bytes kept coherent (``namespace/coherence.py``: bytes another change
        through them claims at that moment are not written; ``cached``, pages written back,
        claims none of its own)."""
        aliases = self.aliases(file, off, len(data))
        if not aliases:
            return await apply(off, data)  # no other name of these bytes is cached: no work

        async def made(runs: list[tuple[int, int]]) -> int:
            if runs == [(off, len(data))]:
                return await apply(off, data)
            for lo, length in runs:  # (rare: copies are fine)
                got = await apply(lo, data[lo - off:lo - off + length])
                if got < length:  # a short count (a full store): what landed, before it
                    return lo - off + got
            return len(data)

        n = await self.coherence.change(file.tag.id, file.inode, off, len(data), aliases, made,
                                        claim=not cached)
        self._dropped(aliases)
        return n

    async def resize(self, file: BlobFile, old: int, new: int,
                     apply: Callable[[], Awaitable[None]]) -> None:
        """``apply`` a resize of ``file`` from ``old`` to ``new`` bytes with the other names
        of the bytes it changes kept coherent."""
        lo, hi = min(old, new), max(old, new)
        aliases = self.aliases(file, lo, hi - lo)

        async def made(runs: list[tuple[int, int]]) -> int:
            await apply()
            return 0

        await self.coherence.change(file.tag.id, None, lo, hi - lo, aliases, made)
        self._dropped(aliases)

    def _dropped(self, done: list[Range]) -> None:
        """Inodes no handle has open were dropped whole: they cache nothing now, and the next
        write need not drop them again (``faultfs warm`` opens every chunk once)."""
        for inode, _, size in done:
            if size <= 0 and not self.open_count.get(inode):
                self.opened.discard(inode)

    def aliases(self, file: BlobFile, off: int, size: int) -> list[Range]:
        """The cached ranges of other names that show bytes ``[off, off+size)`` of ``file``:
        a range of a name open now, the whole of one opened before and closed since."""
        opened = self.opened
        if size <= 0 or not opened or (len(opened) == 1 and file.inode in opened):
            return []  # no other name is open to cache anything (the usual case)
        out: list[Range] = []
        whole: set[int] = set()
        for inode, lo, length in self._names_of(file, off, size):
            if inode == file.inode or inode not in opened or inode in whole:
                continue
            if self.open_count.get(inode):
                out.append((inode, lo, length))
            else:
                whole.add(inode)
                out.append((inode, 0, 0))
            if len(out) >= INVALIDATE_MAX:
                break
        return out

    def _names_of(self, file: BlobFile, off: int, size: int) -> Iterable[Range]:
        """(inode, offset, length) of every name that shows bytes ``[off, off+size)`` of
        ``file`` (``file`` itself included, for a page that maps the same bytes twice)."""
        tag = file.tag
        cs = tag.layout.chunk_size
        view = inodes.make(tag.id, KIND_VIEW)
        pagemap = self.engine.pages.cached_map(tag)
        blob_ranges: list[tuple[str, int, int]] = []  # (blob name, off, size) written
        if file.kind == KIND_CHUNK:
            yield view, file.index * cs + off, size
            blob_ranges.append((tag.layout.blob_name(file.index), off, size))
        elif file.kind == KIND_VIEW:
            if size // cs > len(self.opened):  # (a view grown far: only chunks opened count)
                ends = off // cs, (off + size - 1) // cs
                spans = []
                for i in sorted(self.opened):
                    tag_id, kind, index = inodes.split(i)
                    if tag_id == tag.id and kind == KIND_CHUNK and ends[0] <= index <= ends[1]:
                        lo, hi = max(off, index * cs), min(off + size, (index + 1) * cs)
                        spans.append((index, lo - index * cs, hi - lo))
            else:
                spans = pieces(off, size, off + size, cs)
            for index, inner, length in spans:
                yield inodes.make(tag.id, KIND_CHUNK, index), inner, length
                blob_ranges.append((tag.layout.blob_name(index), inner, length))
        elif file.kind == KIND_USER:
            name = self.engine.user_name(tag, file.index)
            if name is not None:
                blob_ranges.append((name, off, size))
        elif pagemap is not None:  # a page: the blobs its slices name
            for piece in pagemap.to_page(file.index):
                lo, hi = max(off, piece.dst_off), min(off + size, piece.dst_off + piece.size)
                if lo >= hi:
                    continue
                inner = piece.blob_off + lo - piece.dst_off
                blob_ranges.append((piece.blob_name, inner, hi - lo))
                index = tag.layout.blob_index(piece.blob_name)
                if index is not None:
                    yield inodes.make(tag.id, KIND_CHUNK, index), inner, hi - lo
                    yield view, index * cs + inner, hi - lo
                else:
                    uid = self.engine.user_id(tag, piece.blob_name)
                    if uid is not None:
                        yield inodes.make(tag.id, KIND_USER, uid), inner, hi - lo
        if pagemap is not None and not pagemap.empty:
            for name, lo, length in blob_ranges:
                for ref in pagemap.iter_from_page(name, lo, length):
                    yield inodes.make(tag.id, KIND_PAGE, ref.page_id), ref.dst_off, ref.size
