"""Local files as sources: one descriptor read with ``os.pread``, pinned to the file's version.

Invariants:
- Only regular files are sources; anything else (a FIFO, a socket, a device, a directory) is
  refused when it is opened, without blocking.
- Every read is checked after it returns against the version pinned at open (size, mtime,
  ctime): a file changed during or before the read fails it (``SourceChanged``), never serving
  mixed bytes, also when its old mtime was put back.
"""

from __future__ import annotations

import errno
import os
import stat as stat_mod
import threading

from faultfs.buffers import pread_full
from faultfs.errors import InvalidInput, SourceChanged, SourceError
from faultfs.sources.base import SourceVersion


def file_version(st: os.stat_result) -> SourceVersion:
    """A local file's version: size, modification time, change time, device and inode.

    The change time is what ``utime`` cannot set: a file rewritten in place and given its old
    mtime back (``cp -p``, ``rsync -t``, ``tar x``, ``os.utime``) still has a new ctime; a file
    replaced by another under the same name has another inode."""
    return SourceVersion(st.st_size, f"mtime_ns:{st.st_mtime_ns};ctime_ns:{st.st_ctime_ns};"
                                     f"ino:{st.st_dev}:{st.st_ino}")


class LocalFileSource:
    """A regular local file, read with ``os.pread`` on one descriptor, pinned to its version
    (``file_version``) when opened."""

    def __init__(self, url: str, path: str) -> None:
        self.url = url
        self.path = os.path.abspath(path)
        try:
            # not a FIFO, socket or device: opening one could block or have side effects
            st = os.stat(self.path)
            if stat_mod.S_ISDIR(st.st_mode):
                raise InvalidInput(f"source {url} is a directory, not a file", errno.EISDIR)
            if not stat_mod.S_ISREG(st.st_mode):
                raise InvalidInput(f"source {url} is not a regular file ({_kind(st.st_mode)})")
            # O_NONBLOCK: a FIFO swapped in after the check must not block the open either
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            raise InvalidInput(f"source {url} does not exist", errno.ENOENT) from None
        except PermissionError:
            raise InvalidInput(f"source {url} is not readable (permission denied)", errno.EACCES) from None
        except OSError as exc:
            raise InvalidInput(f"source {url} cannot be opened: {exc.strerror}", exc.errno or errno.EIO) from None
        st = os.fstat(fd)
        if not stat_mod.S_ISREG(st.st_mode):
            os.close(fd)
            raise InvalidInput(f"source {url} is not a regular file ({_kind(st.st_mode)})")
        self._fd = fd
        self._lock = threading.Lock()
        self._stat = st
        self.pinned = file_version(st)

    def version(self) -> SourceVersion:
        """What the path names now (another file, after a replacement, has another inode)."""
        try:
            st = os.stat(self.path)
        except OSError as exc:
            raise SourceError(f"source {self.url} vanished: {exc.strerror}") from None
        return file_version(st)

    def mtime(self) -> float:
        return self._stat.st_mtime

    def pread(self, off: int, size: int) -> bytes | memoryview:
        try:
            out = pread_full(self._fd, size, off)  # one read into a buffer of our own, no copy
        except OSError as exc:
            raise SourceError(
                f"reading source {self.url} [{off}, {off + size}) failed: {exc.strerror}"
            ) from None
        now = file_version(os.fstat(self._fd))  # after the read: a write during it counts
        if now != self.pinned:
            raise SourceChanged(
                f"source {self.url} changed under the mount (was {self.pinned.describe()}; "
                f"now {now.describe()})")
        return out

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def _kind(mode: int) -> str:
    for test, name in ((stat_mod.S_ISFIFO, "a FIFO"), (stat_mod.S_ISSOCK, "a socket"),
                       (stat_mod.S_ISCHR, "a character device"), (stat_mod.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a file"
