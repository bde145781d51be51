"""Local files as sources: one descriptor read with ``os.pread``, pinned to the file's version.

Large reads of a range that is not in the page cache (``cachestat``) go around it (``O_DIRECT``
into a page-aligned buffer): the disk writes straight into the buffer the blobs are cut from,
and the kernel neither copies the bytes nor fills and manages a second copy of the source in
the page cache — most of a cold sequential read's CPU otherwise (``docs/benchmarks.md``,
"Staged reads"). Where that is not possible (another file system, an unaligned range, a
kernel without ``cachestat``) the read takes the page cache as before.

Invariants:
- Only regular files are sources; anything else (a FIFO, a socket, a device, a directory) is
  refused when it is opened, without blocking.
- Every read is checked after it returns against the version pinned at open (size, mtime,
  ctime): a file changed during or before the read fails it (``SourceChanged``), never serving
  mixed bytes, also when its old mtime was put back.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat as stat_mod
import struct
import threading

from faultfs.buffers import ALIGN, O_DIRECT, alloc, pread_bytes, pread_full
from faultfs.errors import InvalidInput, SourceChanged, SourceError
from faultfs.sources.base import SourceVersion

DIRECT_MIN = 1 << 20  # reads of at least this much of an uncached range skip the page cache
_SYS_CACHESTAT = {"x86_64": 451, "aarch64": 451}.get(os.uname().machine)
_CACHESTAT = struct.Struct("<5Q")


def _cachestat_fn():
    try:
        fn = ctypes.CDLL(None, use_errno=True).syscall
    except OSError:
        return None
    fn.restype = ctypes.c_long
    fn.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_long]
    return fn


_cachestat = _cachestat_fn() if _SYS_CACHESTAT is not None else None


def cached_pages(fd: int, off: int, size: int) -> int | None:
    """Pages of ``fd``'s range ``[off, off+size)`` in the page cache (``cachestat``, which
    reads nothing and starts no readahead); None when the kernel cannot say."""
    if _cachestat is None:
        return None
    rng = struct.pack("<QQ", off, size)
    out = ctypes.create_string_buffer(_CACHESTAT.size)
    if _cachestat(_SYS_CACHESTAT, fd, rng, out, 0) != 0:
        return None
    return _CACHESTAT.unpack(out.raw)[0]


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

    def __init__(self, url: str, path: str, *, direct: bool = True) -> None:
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
        self._direct_fd = -1  # the same file opened O_DIRECT, on first use
        # SourceOptions.local_direct (Config.source_direct); False also once O_DIRECT failed
        self.direct = direct and bool(O_DIRECT) and _cachestat is not None
        self.direct_reads = 0

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
        return self._read(off, size, pooled=True)

    def pread_bytes(self, off: int, size: int) -> bytes:
        """``pread`` into one new ``bytes`` (for readers that keep slices of it, as the record
        streams do): the page cache's copy lands there directly, no pooled buffer between."""
        out = self._read(off, size, pooled=False)
        return out if isinstance(out, bytes) else bytes(out)

    def prefetch(self, off: int, size: int) -> None:
        """Have the kernel read ``[off, off+size)`` into the page cache in the background
        (``POSIX_FADV_WILLNEED``): advice only, it reads nothing here and never fails. A
        reader that jumps between ranges (a shuffled stream's blocks) gets no readahead from
        the kernel otherwise, and waits for each cold range in turn."""
        try:
            os.posix_fadvise(self._fd, off, size, os.POSIX_FADV_WILLNEED)
        except (OSError, AttributeError):  # a closed descriptor, a platform without it
            pass

    def _read(self, off: int, size: int, *, pooled: bool) -> bytes | memoryview:
        try:
            out: bytes | memoryview | None = None
            if self.direct and size >= DIRECT_MIN:
                out = self._pread_direct(off, size)
            if out is None:
                # into a pooled buffer of our own (no copy), or one bytes object
                out = pread_full(self._fd, size, off) if pooled else pread_bytes(self._fd, size, off)
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

    def _pread_direct(self, off: int, size: int) -> memoryview | None:
        """``[off, off+size)`` read around the page cache, or None when it should not be
        (most of it is cached, the file system refuses) — the caller then reads normally."""
        lo = off - off % ALIGN
        hi = -(-(off + size) // ALIGN) * ALIGN
        if cached_pages(self._fd, lo, hi - lo) != 0:
            return None  # (partly) cached, or the kernel cannot say: the page cache serves it
        fd = self._direct_descriptor()
        if fd < 0:
            return None
        buf = alloc(hi - lo)  # a mapping of our own: page-aligned
        got = 0
        try:
            while got < hi - lo:
                n = os.preadv(fd, [buf[got:]], lo + got)
                got += n
                if n == 0 or n % ALIGN:
                    break  # the end of the file
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self.direct = False  # this file system does not take it: never again
            return None
        self.direct_reads += 1
        return buf[off - lo:min(got, off - lo + size)]

    def _direct_descriptor(self) -> int:
        with self._lock:
            if self._direct_fd < 0 and self.direct and self._fd >= 0:
                try:  # the very file of self._fd, not whatever the path names now
                    fd = os.open(f"/proc/self/fd/{self._fd}",
                                 os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | O_DIRECT)
                except OSError:
                    self.direct = False
                    return -1
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino) != (self._stat.st_dev, self._stat.st_ino):
                    os.close(fd)
                    self.direct = False
                    return -1
                self._direct_fd = fd
            return self._direct_fd

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            if self._direct_fd >= 0:
                os.close(self._direct_fd)
                self._direct_fd = -1


def _kind(mode: int) -> str:
    for test, name in ((stat_mod.S_ISFIFO, "a FIFO"), (stat_mod.S_ISSOCK, "a socket"),
                       (stat_mod.S_ISCHR, "a character device"), (stat_mod.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a file"
