"""The store's lock file: one process owns a store at a time (DESIGN §8).

Invariants:
- The lock is ``flock``ed on ``<store>/lock`` and never waited for: a store another process
  holds is refused at once (StoreBusy, one line naming its pid when the file says it).
- The lock file is never followed through a link, nor opened when it is not a regular file
  (InvalidInput).
- A walk of a store no mount owns (fsck, gc) holds it the way a mount does, so a mount
  started meanwhile is refused rather than blocked.
"""

from __future__ import annotations

import errno
import fcntl
import os

from faultfs.errors import FaultfsError, InvalidInput
from faultfs.store.blobstore import ForeignEntry, open_regular


class StoreBusy(FaultfsError):
    """A live mount owns the store."""

    def __init__(self, message: str) -> None:
        super().__init__(message, errno.EBUSY)


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
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise StoreBusy(f"store {self.root} is in use by pid {owner} (a live mount owns "
                            "it, or another fsck or gc runs): unmount it first") from None
        if writable:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
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
