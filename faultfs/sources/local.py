"""Local files as sources: one descriptor read with ``os.pread``, pinned to the file's version.

Invariants:
- Only regular files are sources; anything else is refused when it is opened.
- Every read is checked after it returns against the version pinned at open: a file changed
  during or before the read fails it (``SourceError``), never serving mixed bytes.
"""

from __future__ import annotations

import errno
import os
import stat as stat_mod
import threading

from faultfs.buffers import pread_full
from faultfs.errors import InvalidInput, SourceError
from faultfs.sources.base import SourceVersion


class LocalFileSource:
    """A regular local file, read with ``os.pread``; version = size + mtime_ns."""

    def __init__(self, url: str, path: str) -> None:
        self.url = url
        self.path = os.path.abspath(path)
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise InvalidInput(f"source {url} does not exist", errno.ENOENT) from None
        except PermissionError:
            raise InvalidInput(f"source {url} is not readable (permission denied)", errno.EACCES) from None
        except OSError as exc:
            raise InvalidInput(f"source {url} cannot be opened: {exc.strerror}", exc.errno or errno.EIO) from None
        st = os.fstat(fd)
        if stat_mod.S_ISDIR(st.st_mode):
            os.close(fd)
            raise InvalidInput(f"source {url} is a directory, not a file", errno.EISDIR)
        if not stat_mod.S_ISREG(st.st_mode):
            os.close(fd)
            raise InvalidInput(f"source {url} is not a regular file")
        self._fd = fd
        self._lock = threading.Lock()
        self._stat = st
        self._pinned = (st.st_size, st.st_mtime_ns)

    def version(self) -> SourceVersion:
        try:
            st = os.stat(self.path)
        except OSError as exc:
            raise SourceError(f"source {self.url} vanished: {exc.strerror}") from None
        return SourceVersion(st.st_size, f"mtime_ns:{st.st_mtime_ns}")

    def mtime(self) -> float:
        return self._stat.st_mtime

    def pread(self, off: int, size: int) -> bytes | memoryview:
        try:
            out = pread_full(self._fd, size, off)  # one read into a buffer of our own, no copy
        except OSError as exc:
            raise SourceError(
                f"reading source {self.url} [{off}, {off + size}) failed: {exc.strerror}"
            ) from None
        st = os.fstat(self._fd)  # after the read: a write during it moved mtime or size
        if (st.st_size, st.st_mtime_ns) != self._pinned:
            raise SourceError(
                f"source {self.url} changed under the mount (was {self._pinned[0]} bytes, "
                f"mtime_ns {self._pinned[1]}; now {st.st_size} bytes, mtime_ns {st.st_mtime_ns})")
        return out

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
