"""What an open file of the tree is (``OpenFile``), and the defaults most have (``PlainFile``:
read-only, nothing to flush or release)."""

from __future__ import annotations

import errno
from typing import Protocol

from faultfs.errors import FaultfsError
from faultfs.tiers.base import Buffer


def read_only() -> FaultfsError:
    return FaultfsError("the tree is read-only", errno.EROFS)


class OpenFile(Protocol):
    keep_cache: bool  # keep the kernel's cached pages of the file across opens
    direct_io: bool  # bypass the page cache (files whose size says nothing of their bytes)

    async def read(self, off: int, size: int) -> Buffer: ...

    async def write(self, off: int, data: bytes, *, cached: bool = False) -> int:
        """``cached``: pages the kernel cached written back (a shared writable map's)."""
        ...

    async def truncate(self, size: int) -> None: ...

    async def fsync(self) -> None: ...

    async def flush(self) -> None: ...

    async def release(self) -> None: ...


class PlainFile:
    """Defaults: read-only, nothing to flush or release."""

    keep_cache = True
    direct_io = False

    async def write(self, off: int, data: bytes, *, cached: bool = False) -> int:
        raise read_only()

    async def truncate(self, size: int) -> None:
        raise read_only()

    async def fsync(self) -> None:
        return

    async def flush(self) -> None:
        return

    async def release(self) -> None:
        return
