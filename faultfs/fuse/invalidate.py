"""Invalidating the kernel's caches when what an entry shows changes under it: the pages of
other names of bytes just written (``drop``, for ``namespace/coherence.py``), every page of a
tag whose pagemap was rewritten, the entry of a tag that is gone.

Notifications never run inside a handler on the trio thread: the kernel may wait there for a
lock a request holds (pyfuse3's note on ``invalidate_inode``). ``drop`` is called on the
coherence module's threads and names a byte range, written as a ``FUSE_NOTIFY_INVAL_INODE``
message straight to the session's device (libfuse's ``fuse_lowlevel_notify_inval_inode`` takes
a range, pyfuse3's ``invalidate_inode`` only whole files); the rest run here, on a thread of
their own, one at a time. Inodes and entries the kernel does not know are skipped.
"""

from __future__ import annotations

import errno
import logging
import os
import struct

import trio

from faultfs.core import inodes
from faultfs.core.inodes import KIND_DIR, KIND_PAGE, KIND_PAGEMAP
from faultfs.core.names import PAGE_PREFIX
from faultfs.engine import Tag
from faultfs.fuse.lowlevel import pyfuse3
from faultfs.namespace import ATTR_TIMEOUT

log = logging.getLogger("faultfs.fuse")

# After a pagemap rewrite, page inodes below this index are invalidated one by one (a few µs
# each, off the trio thread); pages past it rely on their mtime changing (auto_inval_data
# drops their cached data at the next attribute refresh, within ATTR_TIMEOUT).
INVALIDATE_PAGES_MAX = 1 << 20
NOTIFY_INVAL_INODE = 2  # fuse_kernel.h, enum fuse_notify_code
# struct fuse_out_header (len, error = the notify code, unique = 0), then
# struct fuse_notify_inval_inode_out (ino, off, len): len <= 0 drops from off to the end
INVAL_INODE = struct.Struct("<IiQQqq")


class Invalidator:
    def __init__(self) -> None:
        self._one_at_a_time = trio.CapacityLimiter(1)
        self.device_fd: int | None = None  # the session's /dev/fuse descriptor, once mounted

    def drop(self, inode: int, off: int, size: int) -> None:
        """Drop the kernel's cached pages of ``inode`` covering ``[off, off+size)`` (``size``
        0: to the end), dirty ones written back first. Blocking: the kernel locks each page."""
        fd = self.device_fd
        if fd is None:  # not mounted through serve (or no single session descriptor)
            _quietly(pyfuse3.invalidate_inode, inode, False)
            return
        try:
            os.write(fd, INVAL_INODE.pack(INVAL_INODE.size, NOTIFY_INVAL_INODE, 0, inode, off,
                                          size))
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ENOSYS):
                log.debug("dropping pages of inode %#x [%d, +%d): %s", inode, off, size, exc)

    async def pages_changed(self, tag: Tag, before: int, after: int) -> None:
        """A pagemap was replaced: drop what the kernel cached of the tag's pages."""
        await trio.to_thread.run_sync(self._pages, tag.id, before, after,
                                      limiter=self._one_at_a_time)

    async def entry(self, parent: int, name: str) -> None:
        """Drop the kernel's dentry of ``name`` in ``parent`` (a tag that was forgotten)."""
        await trio.to_thread.run_sync(_quietly, pyfuse3.invalidate_entry, parent,
                                      name.encode("utf-8", "surrogateescape"),
                                      limiter=self._one_at_a_time)

    @staticmethod
    def _pages(tag_id: int, before: int, after: int) -> None:
        directory = inodes.make(tag_id, KIND_DIR)
        _quietly(pyfuse3.invalidate_inode, directory, False)
        _quietly(pyfuse3.invalidate_inode, inodes.make(tag_id, KIND_PAGEMAP), True)
        limit = min(before, INVALIDATE_PAGES_MAX)
        for index in range(limit):  # data and sizes of pages that stay or go
            _quietly(pyfuse3.invalidate_inode, inodes.make(tag_id, KIND_PAGE, index), False)
        for index in range(after, limit):  # names that are gone
            _quietly(pyfuse3.invalidate_entry, directory, f"{PAGE_PREFIX}{index}".encode())
        if before > INVALIDATE_PAGES_MAX:
            log.info("pagemap of tag %d changed with %d pages: pages past %d refresh within "
                     "%.0f s", tag_id, before, INVALIDATE_PAGES_MAX, ATTR_TIMEOUT)


def _quietly(fn, *args) -> None:
    try:
        fn(*args)
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.ENOSYS):
            log.debug("invalidating %s%r: %s", fn.__name__, args, exc)
