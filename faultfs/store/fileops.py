"""The file-operation seam of the durable formats (checkpoints, the write journal, dirty blob
files): ``OsFileOps`` over the real file system; ``faultfs.testing.crashfs`` a disk that
forgets or tears what was not fsynced at a simulated crash.

Every write that must survive a crash goes through one of these, so a test can crash at any
write or fsync and check what a reboot would find.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Protocol

from faultfs.errors import FaultfsError, InvalidInput


class FileOps(Protocol):
    """The file operations a durable format needs; ``OsFileOps`` is the real thing."""

    def exists(self, path: str) -> bool: ...
    def open(self, path: str, flags: int, mode: int = 0o600) -> int: ...
    def close(self, fd: int) -> None: ...
    def pread(self, fd: int, size: int, offset: int) -> bytes: ...
    def pwrite(self, fd: int, data: bytes, offset: int) -> int: ...
    def fsync(self, fd: int) -> None: ...
    def ftruncate(self, fd: int, length: int) -> None: ...
    def size(self, fd: int) -> int: ...
    def rename(self, src: str, dst: str) -> None: ...
    def fsync_dir(self, path: str) -> None: ...
    def unlink(self, path: str) -> None: ...
    def listdir(self, path: str) -> list[str]: ...
    def makedirs(self, path: str) -> None: ...


class OsFileOps:
    """FileOps over the real file system. ``links=False`` (the store's journal and dirty
    files): a symbolic link where a file is opened is refused, never followed — a link
    planted in the store would have the daemon truncate and write its target."""

    nofollow = 0  # (a subclass that makes no ``__init__`` call follows links)
    what = "checkpoint file"  # what the files are, for the one-line errors

    def __init__(self, *, links: bool = True, what: str = "checkpoint file") -> None:
        self.nofollow = 0 if links else os.O_NOFOLLOW
        self.what = what

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        """Regular files only, opened without blocking (a FIFO's open would block forever)
        and, with ``links=False``, without following a symbolic link."""
        try:
            fd = os.open(path, flags | os.O_CLOEXEC | os.O_NONBLOCK | self.nofollow, mode)
        except IsADirectoryError:
            raise InvalidInput(f"{path} is a directory, not a {self.what}", errno.EISDIR) from None
        except OSError as exc:
            if exc.errno == errno.ELOOP and self.nofollow:
                raise InvalidInput(f"{path} is a symbolic link, not a {self.what}: faultfs "
                                   "never follows a link inside its store; move it away",
                                   errno.ELOOP) from None
            raise
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            what = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            raise InvalidInput(f"{path} is {what}, not a {self.what}",
                               errno.EISDIR if stat.S_ISDIR(st.st_mode) else errno.EINVAL)
        return fd

    def close(self, fd: int) -> None:
        os.close(fd)

    def pread(self, fd: int, size: int, offset: int) -> bytes:
        return os.pread(fd, size, offset)

    def pwrite(self, fd: int, data: bytes, offset: int) -> int:
        return os.pwrite(fd, data, offset)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def ftruncate(self, fd: int, length: int) -> None:
        os.ftruncate(fd, length)

    def size(self, fd: int) -> int:
        return os.fstat(fd).st_size

    def rename(self, src: str, dst: str) -> None:
        os.rename(src, dst)

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | self.nofollow)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def listdir(self, path: str) -> list[str]:
        try:
            return os.listdir(path)
        except FileNotFoundError:
            return []

    def makedirs(self, path: str) -> None:
        """Every missing directory of ``path`` made 0700 (``os.makedirs`` gives its mode to
        the last one only)."""
        missing = []
        while path and not os.path.isdir(path):
            missing.append(path)
            path = os.path.dirname(path)
        for directory in reversed(missing):
            try:
                os.mkdir(directory, 0o700)
            except FileExistsError:
                pass


def free_name(ops: FileOps, directory: str, name: str) -> str:
    """``name``, or ``name.1``, ``name.2`` … when something stands there already."""
    candidate, n = name, 0
    while ops.exists(os.path.join(directory, candidate)) or os.path.islink(
            os.path.join(directory, candidate)):
        n += 1
        candidate = f"{name}.{n}"
    return candidate


def kept_dir(ops: FileOps, path: str) -> str:
    """Directory ``path`` (``writes/damaged/``), made if missing; never through a link or
    over another entry (a one-line error instead)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        ops.makedirs(path)
        return path
    if not stat.S_ISDIR(mode):
        raise FaultfsError(f"{path} is not a directory (faultfs keeps the writes it could not "
                           "use there): move it away", errno.EIO)
    return path
