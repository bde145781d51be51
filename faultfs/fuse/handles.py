"""The one handle table of a mount: file handle number -> open file (``namespace.OpenFile``).

Directory handles are their inode (a listing needs nothing else). File handle numbers start at
1; a number is given again only after the kernel released it. With a holder (fuse/holder.py),
each number's ``(inode, open flags)`` is kept in the session state before the open is answered,
so a daemon that takes the mount over re-opens every handle the kernel holds (``restore``).
"""

from __future__ import annotations

import errno
import heapq
import logging
import os
from typing import TYPE_CHECKING

from faultfs.errors import FaultfsError
from faultfs.namespace import OpenFile

if TYPE_CHECKING:
    from faultfs.fuse.handover import SessionState

log = logging.getLogger("faultfs.fuse")
# what an open did once and must not do again when a new daemon re-opens its handle
REOPEN_MASK = ~(os.O_CREAT | os.O_EXCL | os.O_TRUNC)


class HandleTable:
    def __init__(self, session: SessionState | None = None) -> None:
        self._open: dict[int, OpenFile] = {}
        self._next = 1
        self._free: list[int] = []  # released numbers, lowest first
        self._session = session

    def add(self, handle: OpenFile, inode: int = 0, flags: int = 0) -> int:
        fh = heapq.heappop(self._free) if self._free else self._take()
        self._open[fh] = handle
        if self._session is not None and not self._session.hold(fh, inode, flags):
            log.debug("file handle %d is not kept across a takeover", fh)
        return fh

    def _take(self) -> int:
        fh = self._next
        self._next += 1
        return fh

    def put(self, fh: int, handle: OpenFile) -> None:
        """Re-open ``fh`` (a handle the kernel held across a takeover)."""
        self._open[fh] = handle
        self._next = max(self._next, fh + 1)

    def restored(self) -> None:
        """Every kept handle is back: the numbers below the highest that are not are free."""
        self._free = [fh for fh in range(1, self._next) if fh not in self._open]
        heapq.heapify(self._free)

    def __getitem__(self, fh: int) -> OpenFile:
        handle = self._open.get(fh)
        if handle is None:
            raise FaultfsError(f"file handle {fh} is not open", errno.EBADF)
        return handle

    def get(self, fh: int | None) -> OpenFile | None:
        return None if fh is None else self._open.get(fh)

    def pop(self, fh: int) -> OpenFile | None:
        handle = self._open.pop(fh, None)
        if handle is not None:
            heapq.heappush(self._free, fh)
            if self._session is not None:
                self._session.let_go(fh)
        return handle

    def __len__(self) -> int:
        return len(self._open)
