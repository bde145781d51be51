"""Room in a store that several processes fill at once (DESIGN §5.3, §18): whether a faulted
blob may be stored, and which blobs of the protocol's tags make room for it — computed from
the file system, not from one process's memory.

- The reserve is the store file system's free space (``statvfs``) less what is about to be
  written: every process (and a mount) sees the same line.
- The cap (``cache_size``) counts the bytes of the protocol's blob files. Their running total
  lives in one 8-byte file that each process updates under ``flock`` before it writes a blob,
  so concurrent stores cannot overshoot together. When the total says a blob does not fit,
  the holder of the lock walks the blob files and the writers' temporary files (a blob being
  written), takes the true total from them and evicts the least recently used blobs — a
  blob's mtime is its last use: a hit refreshes it at most every ``TOUCH_AFTER_S``. The walk
  replaces the running total, so what a killed process had counted and never wrote (or a
  blob stored twice, or one another tool removed) is drift that costs no blob: the walk
  misses only blobs admitted and not yet begun (one per writing process, for microseconds).
- A store the file system refused (ENOSPC) is left alone for the next ``backoff_faults``
  faults of this process, which read through.

Invariants: only clean blobs of the protocol's tags (``PROTOCOL_TAG_PREFIX``) are ever evicted —
a mount's blobs, dirty data and the journal are the mount's. An evicted blob a reader holds
open stays readable to it (unlink keeps the inode).
"""

from __future__ import annotations

import fcntl
import logging
import os
import struct
import time

from faultfs.core.names import PROTOCOL_TAG_PREFIX
from faultfs.store.blobstore import BlobStore, encode_component

log = logging.getLogger("faultfs.fsspec")

TAG_DIR_PREFIX = encode_component("t-", PROTOCOL_TAG_PREFIX)  # their directories in tags/
USAGE = "fsspec-usage"  # u64 little-endian: bytes of the protocol's blob files
SPACE_LOCK = "fsspec-space.lock"
TOUCH_AFTER_S = 30.0  # a hit moves its blob up the LRU at most this often (one utime)
LOW_WATER = 0.9  # an eviction makes room down to this share of the cap: the next stores need none
BACKOFF_FAULTS = 256  # after ENOSPC, faults served without storing (as the mount, DESIGN §5.3)

SKIPPED_RESERVE = "reserve"
SKIPPED_CAP = "cap"
SKIPPED_BACKOFF = "backoff"


class SharedSpace:
    """The store policy of the processes sharing ``store`` (see the module docstring)."""

    def __init__(self, store: BlobStore, *, reserve_bytes: int, cache_size: int,
                 backoff_faults: int = BACKOFF_FAULTS) -> None:
        self.store = store
        self.reserve_bytes = reserve_bytes
        self.cache_size = cache_size
        self.backoff_faults = backoff_faults
        self.backoff_left = 0
        self.evicted = 0  # blobs this process evicted
        self._lock_path = os.path.join(store.root, SPACE_LOCK)
        self._usage_path = os.path.join(store.root, USAGE)

    def admit(self, need: int) -> str | None:
        """None when a blob of ``need`` bytes may be stored now (counted against the cap
        until ``give_back``), else why not (``SKIPPED_*``)."""
        if self.backoff_left > 0:
            self.backoff_left -= 1
            return SKIPPED_BACKOFF
        if self.store.free_bytes() - need < self.reserve_bytes:
            return SKIPPED_RESERVE
        if not self.cache_size:
            return None
        if need > self.cache_size:
            return SKIPPED_CAP
        with self._locked() as fd:
            total = _read_total(fd)
            if total is None or total + need > self.cache_size:
                total = self._evict(need, total or 0)
                if total + need > self.cache_size:  # what is left is in use: read through
                    _write_total(fd, total)
                    return SKIPPED_CAP
            _write_total(fd, total + need)
        return None

    def give_back(self, need: int) -> None:
        """A blob ``admit`` counted was not stored after all."""
        if not self.cache_size:
            return
        with self._locked() as fd:
            _write_total(fd, max(0, (_read_total(fd) or 0) - need))

    def full(self) -> None:
        """The file system refused a blob for lack of room: read through for a while."""
        self.backoff_left = self.backoff_faults

    def touch(self, path: str, mtime: float) -> None:
        """A hit of the blob file at ``path`` (last modified ``mtime``): it is used now."""
        now = time.time()
        if now - mtime >= TOUCH_AFTER_S:
            try:
                os.utime(path, (now, now), follow_symlinks=False)
            except OSError:
                pass  # evicted meanwhile, or a read-only store: the LRU is a hint

    def usage(self) -> int:
        """Bytes of the protocol's blob files and of blobs being written, walked now."""
        files, writing = self._walk()
        return sum(size for _, size, _ in files) + writing

    def _walk(self) -> tuple[list[tuple[str, int, float]], int]:
        """The protocol's blob files (path, size, mtime), and the bytes of its writers'
        temporary files (blobs being written, or left by a writer killed mid-write until
        their tag is next listed: on disk either way)."""
        tags = os.path.join(self.store.root, "tags")
        found, writing = [], 0
        try:
            dirs = [e for e in os.scandir(tags) if e.name.startswith(TAG_DIR_PREFIX)
                    and e.is_dir(follow_symlinks=False)]
        except FileNotFoundError:
            return [], 0
        for directory in dirs:
            try:
                entries = list(os.scandir(directory.path))
            except (FileNotFoundError, NotADirectoryError):
                continue
            for entry in entries:
                blob = entry.name.startswith("b-")
                if not (blob or _temporary(entry.name)) or not entry.is_file(
                        follow_symlinks=False):
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue  # renamed into place or evicted meanwhile
                if blob:
                    found.append((entry.path, st.st_size, st.st_mtime))
                else:
                    writing += st.st_size
        return found, writing

    def _evict(self, need: int, counted: int) -> int:
        """Walk the blob files; evict the least recently used until ``need`` more bytes fit
        under ``LOW_WATER`` of the cap. ``counted``: the running total, replaced by what
        the walk finds (blob files and blobs being written): the total is healed of drift
        here. Returns the total left."""
        files, writing = self._walk()
        total = sum(size for _, size, _ in files) + writing
        if counted != total:
            log.debug("store %s: the cap's count was %d bytes, the walk found %d",
                      self.store.root, counted, total)
        target = int(self.cache_size * LOW_WATER)
        if total + need <= self.cache_size:
            return total
        for path, size, _ in sorted(files, key=lambda f: f[2]):
            if total + need <= target:
                break
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue  # another process evicted it
            total -= size
            self.evicted += 1
        return total

    def _locked(self) -> _Locked:
        return _Locked(self._lock_path)


class _Locked:
    """``<store>/fsspec-space.lock`` held (``flock``), yielding the usage file's descriptor."""

    def __init__(self, lock_path: str) -> None:
        self._lock_path = lock_path
        self._usage_path = os.path.join(os.path.dirname(lock_path), USAGE)
        self._fds: list[int] = []

    def __enter__(self) -> int:
        lock = os.open(self._lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                       0o600)
        self._fds.append(lock)
        fcntl.flock(lock, fcntl.LOCK_EX)  # held for a few syscalls (or one eviction walk)
        usage = os.open(self._usage_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                        0o600)
        self._fds.append(usage)
        return usage

    def __exit__(self, *exc: object) -> None:
        for fd in reversed(self._fds):
            os.close(fd)
        self._fds.clear()


def _temporary(name: str) -> bool:
    """A writer's temporary file (``BlobWriter.temp_path``)."""
    return name.startswith("t-") and name.endswith(".tmp")


def _read_total(fd: int) -> int | None:
    raw = os.pread(fd, 9, 0)
    return struct.unpack("<Q", raw)[0] if len(raw) == 8 else None


def _write_total(fd: int, total: int) -> None:
    os.pwrite(fd, struct.pack("<Q", total), 0)
