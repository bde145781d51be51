"""The one handle table of a mount: file handle number -> open file (``namespace.OpenFile``).

Directory handles are their inode (a listing needs nothing else). File handle numbers count
up from 1 and are never reused while the mount lives.
"""

from __future__ import annotations

import errno
import itertools

from faultfs.errors import FaultfsError
from faultfs.namespace import OpenFile


class HandleTable:
    def __init__(self) -> None:
        self._open: dict[int, OpenFile] = {}
        self._numbers = itertools.count(1)

    def add(self, handle: OpenFile) -> int:
        fh = next(self._numbers)
        self._open[fh] = handle
        return fh

    def __getitem__(self, fh: int) -> OpenFile:
        handle = self._open.get(fh)
        if handle is None:
            raise FaultfsError(f"file handle {fh} is not open", errno.EBADF)
        return handle

    def get(self, fh: int | None) -> OpenFile | None:
        return None if fh is None else self._open.get(fh)

    def pop(self, fh: int) -> OpenFile | None:
        return self._open.pop(fh, None)

    def __len__(self) -> int:
        return len(self._open)
