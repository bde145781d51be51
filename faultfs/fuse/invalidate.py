"""Invalidating the kernel's caches when what an entry shows changes under it (a pagemap
rewrite changes every page of its tag).

Notifications run on a thread of their own, one at a time — never inside a handler on the
trio thread: the kernel may wait for the directory lock there and deadlock (pyfuse3's note on
``invalidate_inode``). Inodes and entries the kernel does not know are skipped.
"""

from __future__ import annotations

import errno
import logging

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


class Invalidator:
    def __init__(self) -> None:
        self._one_at_a_time = trio.CapacityLimiter(1)

    async def pages_changed(self, tag: Tag, before: int, after: int) -> None:
        """A pagemap was replaced: drop what the kernel cached of the tag's pages."""
        await trio.to_thread.run_sync(self._pages, tag.id, before, after,
                                      limiter=self._one_at_a_time)

    async def inodes(self, stale: list[int]) -> None:
        """Drop the kernel's cached data of ``stale`` inodes (awaited by a write's handler:
        the serving thread keeps answering meanwhile, so a read the kernel waits on can
        complete and nothing deadlocks)."""
        await trio.to_thread.run_sync(self._inodes, stale, limiter=self._one_at_a_time)

    async def entry(self, parent: int, name: str) -> None:
        """Drop the kernel's dentry of ``name`` in ``parent`` (a tag that was forgotten)."""
        await trio.to_thread.run_sync(_quietly, pyfuse3.invalidate_entry, parent,
                                      name.encode("utf-8", "surrogateescape"),
                                      limiter=self._one_at_a_time)

    @staticmethod
    def _inodes(stale: list[int]) -> None:
        for inode in stale:
            _quietly(pyfuse3.invalidate_inode, inode, False)

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
