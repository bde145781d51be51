"""Claims on in-flight faults shared by the processes of one store (DESIGN §18): before a
process reads a blob from the source it holds the blob's claim, an ``flock``ed file under
``<store>/claims/``; another process that wants the same blob waits for the blob to be
published instead of reading the source a second time.

Invariants:
- A claim is held by at most one process: the holder locked the file *and* the file is the
  one the name points to now (a holder unlinks its file before unlocking, so a waiter that
  locked an unlinked file looks again).
- The kernel drops the lock of a process that dies (kill -9 included): nothing waits on a
  dead holder. The holder records its temporary blob file in the claim before writing it;
  the next holder removes that file, so a crash mid-fault leaves no lost space.
- Nobody waits for ever: ``acquire`` gives up after its deadline (the caller then reads
  through, storing nothing).
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from collections.abc import Callable
from urllib.parse import quote

from faultfs.store.blobstore import FOREIGN_ERRNOS

CLAIMS = "claims"
MAX_RECORD = 4096  # a claim file holds one path: more than this is not one we wrote
FIRST_WAIT_S = 0.002  # a wait for another process's fault starts this short, doubling ...
LONGEST_WAIT_S = 0.05  # ... up to this: a published blob is seen within 50 ms


class Claim:
    """A held claim: ``record`` the temporary file before writing it, ``release`` after the
    blob is published (or given up)."""

    def __init__(self, fd: int, path: str) -> None:
        self._fd = fd
        self.path = path

    def record(self, tmp: str) -> None:
        data = tmp.encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)

    def release(self) -> None:
        if self._fd < 0:
            return
        try:
            os.unlink(self.path)  # before the unlock: see the module's invariants
        except FileNotFoundError:
            pass
        finally:  # any other failure still unlocks (the lock must not outlive the claim)
            os.close(self._fd)
            self._fd = -1


class Claims:
    """The claims directory of the store at ``root``."""

    def __init__(self, root: str) -> None:
        self.root = os.path.join(root, CLAIMS)
        self._tags = os.path.join(os.path.realpath(root), "tags") + os.sep
        os.makedirs(self.root, mode=0o700, exist_ok=True)

    def path(self, tag: str, name: str) -> str:
        return os.path.join(self.root, quote(f"{tag}.{name}", safe=""))

    def try_claim(self, tag: str, name: str) -> Claim | None:
        """The claim on blob ``(tag, name)`` if no other process holds it, else None."""
        path = self.path(tag, name)
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
                             | os.O_NONBLOCK, 0o600)
            except OSError as exc:
                if exc.errno in FOREIGN_ERRNOS:  # something else stands there: remove it
                    _remove(path)
                    continue
                raise
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return None
            try:
                same = os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # its holder was done and removed it: take the name again
                os.close(fd)
                continue
            _drop_left_behind(fd, self._tags)
            return Claim(fd, path)

    def acquire(self, tag: str, name: str, *, done: Callable[[], bool],
                deadline_s: float) -> Claim | None:
        """The claim on ``(tag, name)``, waiting while another process holds it; None when
        ``done()`` says the blob arrived meanwhile, or after ``deadline_s``."""
        wait = FIRST_WAIT_S
        give_up = time.monotonic() + deadline_s
        while True:
            claim = self.try_claim(tag, name)
            if claim is not None:
                return claim
            if done() or time.monotonic() >= give_up:
                return None
            time.sleep(wait)
            wait = min(wait * 2, LONGEST_WAIT_S)

    def sweep(self) -> int:
        """Release the claims of processes that died (their temporary files go): how many."""
        swept = 0
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return 0
        for entry in names:
            path = os.path.join(self.root, entry)
            try:
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue  # a live holder
            _drop_left_behind(fd, self._tags)
            try:
                if os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                    os.unlink(path)
                    swept += 1
            except FileNotFoundError:
                pass
            os.close(fd)
        return swept


def _drop_left_behind(fd: int, tags: str) -> None:
    """A claim file that still names a temporary file was left by a holder that died
    mid-fault: remove that file (only a temporary blob file under the store's ``tags/``)."""
    tmp = os.pread(fd, MAX_RECORD, 0).decode(errors="replace")
    if (tmp and os.path.realpath(tmp).startswith(tags)
            and os.path.basename(tmp).startswith("t-") and tmp.endswith(".tmp")):
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno not in (errno.EISDIR, errno.EPERM, errno.EACCES):
                raise
    os.ftruncate(fd, 0)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except IsADirectoryError:
        os.rmdir(path)
    except FileNotFoundError:
        pass
