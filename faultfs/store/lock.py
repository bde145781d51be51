"""The store's lock file: one process owns a store at a time (DESIGN §8) — a mount for as
long as it serves (``MountLock``, held by ``BlobStore.acquire``), or a walk of a store no
mount owns (``StoreLock``: fsck, gc).

Invariants:
- The lock is ``flock``ed on ``<store>/lock`` and never waited for: a store another process
  holds is refused at once (one line naming its pid when the file says it), so a mount
  started during a walk is refused rather than blocked.
- The holder writes its pid into the file when it can write it.
- The lock file is never followed through a link, nor opened when it is not a regular file
  (InvalidInput).
"""

from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Callable

from faultfs.errors import FaultfsError, InvalidInput
from faultfs.store.entries import ForeignEntry, open_regular


class StoreBusy(FaultfsError):
    """A live mount owns the store."""

    def __init__(self, message: str) -> None:
        super().__init__(message, errno.EBUSY)


def _hold(fd: int, *, writable: bool, refuse: Callable[[str], FaultfsError]) -> None:
    """Lock ``fd`` without waiting; when another process holds it, ``fd`` is closed and
    ``refuse(owner)`` raised. The holder's pid is written when ``writable``."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise refuse(owner) from None
    if writable:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)


class MountLock:
    """The lock a mount holds while it serves: FaultfsError(EBUSY) when another process owns
    the store."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._fd = -1

    def acquire(self, *, writable: bool) -> None:
        """Take the store's lock. A degraded store (not ``writable``) is locked when its lock
        file exists (a read-only one cannot be written by anyone, so there is nothing to
        keep out when it does not)."""
        path = os.path.join(self.root, "lock")
        try:
            fd = open_regular(path, os.O_RDWR if writable else os.O_RDONLY)
            if fd is None and writable:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
                             | os.O_NOFOLLOW, 0o600)
        except ForeignEntry:
            raise InvalidInput(f"store lock {path} is not a regular file", errno.EEXIST) from None
        if fd is None:
            return
        _hold(fd, writable=writable, refuse=lambda owner: FaultfsError(
            f"store {self.root} is in use by pid {owner}: unmount that mount first, "
            "or pick another --store", errno.EBUSY))
        self._fd = fd

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class StoreLock:
    """The store's lock file, ``flock``ed the way ``BlobStore.acquire`` does and never waited
    for: StoreBusy (one line) when a live mount holds it. Held for the walk, so a mount
    started meanwhile is refused at once rather than blocked. Writes its pid when it can (a
    refused mount then names this process)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.path = os.path.join(root, "lock")
        self._fd = -1

    def __enter__(self) -> StoreLock:
        fd, writable = self._open()
        if fd is None:
            return self  # a read-only store without a lock file: nothing can own it
        _hold(fd, writable=writable, refuse=lambda owner: StoreBusy(
            f"store {self.root} is in use by pid {owner} (a live mount owns it, or another "
            "fsck or gc runs): unmount it first"))
        self._fd = fd
        return self

    def _open(self) -> tuple[int | None, bool]:
        try:
            try:
                fd = open_regular(self.path, os.O_RDWR)
                if fd is not None:
                    return fd, True
                return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
                               | os.O_NOFOLLOW, 0o600), True
            except FileExistsError:  # a mount made it a moment ago
                return open_regular(self.path, os.O_RDWR), True
            except OSError as exc:
                if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                    raise
            return open_regular(self.path, os.O_RDONLY), False
        except ForeignEntry:
            raise InvalidInput(f"store lock {self.path} is not a regular file",
                               errno.EEXIST) from None

    def __exit__(self, *exc: object) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
