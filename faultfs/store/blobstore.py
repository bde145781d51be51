"""The embedded store: staged blobs as self-describing files under one local directory.
``BlobStore`` is its face: it makes or checks the store (a full or read-only one is
*degraded*: served, never written), takes its lock, lists tags and blobs, keeps tag states,
and hands the reads of blob files to its ``BlobOpener``, their writes to its ``BlobWriter``.

Layout under the store root (this class writes ``lock``, ``tags/`` and ``log/``):

    lock                      flock()ed by the one process that owns the store; holds its pid
    tags/t-<tag>/b-<blob>     blob files (names percent-encoded; h-<sha256> when too long):
                              staged chunks, and the tag's pagemap (blob ``pagemap``, dirty)
    tags/t-<tag>/tag.json     per-tag state (``tagstate.py``: fault key, source version,
                              shard, view name, mtime, how a remote source was reached)
    tags/t-__cae_on_fault/    registry entries, blobs ``fault:<key>`` (``registry.py``)
    writes/                   the writes: journal, dirty files, write states (``dirty.py``,
                              ``journal.py``, ``writestate.py``; not this class's)
    log/faultfs.log           the daemon's log when it runs in the background

Its rooms: ``entries.py`` (names and safe opens), ``blobread.py`` (blob files opened and read,
verified), ``blobwrite.py`` (writes into the tags' directories), ``lock.py`` (the lock file).

Invariants:
- No tag or blob name can escape the root: every path component is derived by encoding.
- A blob file is served only after ``decode_header`` accepted it and its tag, name and
  source version match what is asked; every read verifies the blocks it returns.
- Nothing is written to a degraded store. One degraded by a full file system is probed
  again (``recheck``) and is itself again once it can be written.
- Blocking: every method does file I/O. The tiers call them on the I/O pool, except small
  reads of staged blobs, which run on the serving thread (``tiers/local/``); the engine
  calls them on the I/O pool too, or before the mount answers.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import secrets
import time
from urllib.parse import unquote

from faultfs.errors import CorruptionError, FaultfsError, InvalidInput
from faultfs.store import entries
from faultfs.store.blobfile import MAX_PAYLOAD, BlobHeader
from faultfs.store.blobread import SMALL_READ, BlobOpener, OpenBlob
from faultfs.store.blobwrite import BlobWriter
from faultfs.store.entries import (
    DEGRADED_ERRNOS,
    FOREIGN_ERRNOS,
    OPEN_FLAGS,
    PRIVATE,
    TAG_STATE,
    ForeignEntry,
    encode_component,
    open_regular,
    real_dir,
    remove_entry,
    tighten,
    unlink_quietly,
)
from faultfs.store.lock import MountLock

__all__ = [  # the store's face: the rooms' names its callers use are handed on from here
    "FOREIGN_ERRNOS", "OPEN_FLAGS", "SMALL_READ", "BlobStore", "OpenBlob", "encode_component",
]

MAX_TAG_STATE = 1 << 20  # a tag state of more than this is not one we wrote
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)  # degraded by these, a store may recover
RECHECK_S = 5.0  # a full store is probed again at most this often (on a fault it skips)
log = logging.getLogger("faultfs.store")


class BlobStore:
    """Staged blobs under ``root``; see the module docstring for the layout.

    ``create=False`` touches nothing: ``create()`` makes (or checks) the directories later,
    once everything else of a mount has been validated."""

    def __init__(self, root: str, *, create: bool = True) -> None:
        self.root = os.path.abspath(os.path.expanduser(root))
        self._lock = MountLock(self.root)
        self._writer = BlobWriter(self.root)
        self._opener = BlobOpener(self.root, drop_foreign=self.drop_foreign)
        self.degraded = ""  # why nothing can be written (a full or read-only file system)
        self.degraded_errno = 0
        self._checked_at = 0.0  # when a full store was last found so (``recheck``)
        if create:
            self.create()

    def create(self) -> None:
        """Make the store's directories (0700) or check them; find out whether it can be
        written. A store on a full or read-only file system is *degraded* (``degraded``
        says why): what is staged is served, nothing is written. Anything else that keeps
        it from being used is InvalidInput."""
        if os.path.lexists(self.root) and not os.path.isdir(self.root):
            raise InvalidInput(f"store {self.root} is not a directory", errno.ENOTDIR)
        for sub in ("", "tags", "log"):
            path = os.path.join(self.root, sub) if sub else self.root
            if sub and os.path.islink(path):
                raise InvalidInput(f"store {path} is a symbolic link: faultfs does not follow "
                                   "links inside its store", errno.ELOOP)
            try:
                os.makedirs(path, mode=PRIVATE, exist_ok=True)
                tighten(path)
            except OSError as exc:
                if exc.errno in DEGRADED_ERRNOS and os.path.isdir(os.path.join(self.root, "tags")):
                    self._degrade(exc)
                    return
                raise InvalidInput(f"store {self.root} cannot be created: {exc.strerror}",
                                   exc.errno or errno.EIO) from None
        try:
            self._probe()
        except OSError as exc:
            if exc.errno in DEGRADED_ERRNOS:
                self._degrade(exc)
                return
            raise InvalidInput(f"store {self.root} is not writable: {exc.strerror}",
                               exc.errno or errno.EACCES) from None

    def _probe(self) -> None:
        """Create, write and remove a file at the root (OSError when it cannot)."""
        probe = os.path.join(self.root, f".probe-{secrets.token_hex(4)}")
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, b"x")  # a full file system may still create an empty file
            finally:
                os.close(fd)
        finally:
            unlink_quietly(probe)

    def _degrade(self, exc: OSError) -> None:
        self.degraded = exc.strerror or str(exc)
        self.degraded_errno = exc.errno or errno.EROFS
        self._checked_at = time.monotonic()

    @property
    def full(self) -> bool:
        """Degraded because its file system is full (bytes, inodes, quota): space may come
        back (``recheck``), unlike a read-only file system's."""
        return self.degraded_errno in FULL_ERRNOS

    @property
    def recheck_due(self) -> bool:
        """Whether a store degraded by a full file system is due to be probed again."""
        return self.full and time.monotonic() - self._checked_at >= RECHECK_S

    def recheck(self) -> bool:
        """Blocking: whether a store degraded by a full file system can be written again
        (tried at most every ``RECHECK_S``); when it can, it is degraded no more."""
        if not self.recheck_due:
            return False
        self._checked_at = time.monotonic()
        try:
            self._probe()
        except OSError:
            return False
        log.warning("store %s can be written again: faults are stored from now on", self.root)
        self.degraded, self.degraded_errno = "", 0
        return True

    @property
    def writable(self) -> bool:
        return not self.degraded

    def _require_writable(self) -> None:
        if self.degraded:
            raise FaultfsError(f"store {self.root} cannot be written: {self.degraded}",
                               self.degraded_errno)

    @property
    def direct(self) -> bool:
        """New clean blobs of whole pages are written around the page cache
        (``store/direct.py``); False: never (``Config.store_direct``), or once the file system
        refused it."""
        return self._writer.direct

    @direct.setter
    def direct(self, on: bool) -> None:
        self._writer.direct = on

    # -- ownership ---------------------------------------------------------------------------

    def acquire(self) -> None:
        """Take the store's lock; FaultfsError(EBUSY) when another process owns it. A degraded
        store is locked when its lock file exists (a read-only one cannot be written by
        anyone, so there is nothing to keep out when it does not)."""
        self._lock.acquire(writable=self.writable)

    def release(self) -> None:
        self._lock.release()

    # -- paths -------------------------------------------------------------------------------

    def tag_dir(self, tag: str) -> str:
        return entries.tag_dir(self.root, tag)

    def blob_path(self, tag: str, name: str) -> str:
        return entries.blob_path(self.root, tag, name)

    def list_tags(self) -> list[str]:
        base = os.path.join(self.root, "tags")
        out = []
        for entry in sorted(os.listdir(base)):
            if entry.startswith("t-"):
                out.append(unquote(entry[2:]))
        return out

    def list_blobs(self, tag: str) -> list[str]:
        """Names of the blob files in ``tag`` (not verified)."""
        return [name for name, _ in self.scan_blobs(tag)]

    def scan_blobs(self, tag: str) -> list[tuple[str, int]]:
        """``(name, file bytes)`` of the blob files in ``tag`` (not verified): one
        directory listing and a ``stat`` per file, no file is opened (except the rare blob
        whose name is too long for a file name). Removes temporary files left by a crash."""
        directory = self.tag_dir(tag)
        if not real_dir(directory):
            return []  # a link or a file where the tag's directory should be: nothing staged
        try:
            listed = list(os.scandir(directory))
        except FileNotFoundError:
            return []
        found = []
        for entry in listed:
            if not entry.is_file(follow_symlinks=False):
                continue  # foreign (FIFO, link, directory): absent; dropped when it is opened
            if entry.name.startswith("b-"):
                name = unquote(entry.name[2:])
            elif entry.name.startswith("h-"):
                header = self.read_header(entry.path)
                if header is None or header.tag != tag:
                    continue
                name = header.name
            elif entry.name.startswith("t-") and entry.name.endswith(".tmp"):
                try:  # a temporary file left by a crash: never renamed, never valid
                    os.unlink(entry.path)
                except FileNotFoundError:
                    pass
                continue
            else:
                continue
            try:
                size = entry.stat(follow_symlinks=False).st_size
            except FileNotFoundError:
                continue
            found.append((name, size))
        return found

    # -- blobs -------------------------------------------------------------------------------

    def put(self, tag: str, name: str, payload: bytes | memoryview, *, flags: int,
            source_version: str = "", durable: bool | None = None) -> int:
        """Stage ``payload`` as blob ``(tag, name)``, replacing any; returns bytes written
        to disk (``BlobWriter.put``: durable when dirty; StoreFull when full)."""
        self._require_writable()
        return self._writer.put(tag, name, payload, flags=flags, source_version=source_version,
                                durable=durable)

    def put_new(self, tag: str, name: str, payload: bytes | memoryview, *, flags: int,
                source_version: str = "") -> int | None:
        """Stage a clean blob straight under its free name; None (nothing written) when it
        cannot be (``BlobWriter.put_new``): the caller then takes ``put``."""
        self._require_writable()
        return self._writer.put_new(tag, name, payload, flags=flags,
                                    source_version=source_version)

    def temp_path(self, tag: str) -> str:
        """A fresh temporary name in ``tag``'s directory for ``publish``
        (``BlobWriter.temp_path``)."""
        self._require_writable()
        return self._writer.temp_path(tag)

    def publish(self, tag: str, name: str, payload: bytes | memoryview, tmp: str, *,
                source_version: str = "") -> int:
        """Stage a clean blob atomically for readers in other processes, through ``tmp``;
        bytes written (``BlobWriter.publish``: fsynced, renamed; StoreFull when full)."""
        self._require_writable()
        return self._writer.publish(tag, name, payload, tmp, source_version=source_version)

    def read_header(self, path: str) -> BlobHeader | None:
        """The verified header of a blob file; None when it is absent, damaged or foreign."""
        return self._opener.read_header(path)

    def open_blob(self, tag: str, name: str, *, source_version: str | None = None,
                  whole: bool = False, path: str | None = None) -> OpenBlob | None:
        """A blob whose header verifies, open for reads verified block by block; None when
        it is absent, foreign, torn or stale (``BlobOpener.open_blob``; ``path``: its file,
        ``blob_path(tag, name)``, when the caller has it)."""
        return self._opener.open_blob(tag, name, source_version=source_version, whole=whole,
                                      path=path)

    def accept_blob(self, fd: int, st: os.stat_result, head: bytes | bytearray | memoryview,
                    tag: str, name: str, *, source_version: str | None = None,
                    loaded: memoryview | None = None) -> OpenBlob | None:
        """The blob file open as ``fd`` as an OpenBlob when its header ``head`` verifies
        (``BlobOpener.accept_blob``); else ``fd`` is closed and None returned."""
        return self._opener.accept_blob(fd, st, head, tag, name, source_version=source_version,
                                        loaded=loaded)

    def discard_damaged(self, tag: str, name: str, *, ino: int | None = None) -> bool:
        """Delete a clean blob that failed verification; CorruptionError for a dirty one
        (``BlobOpener.discard_damaged``)."""
        return self._opener.discard_damaged(tag, name, ino=ino)

    def read(self, tag: str, name: str, *, max_len: int = MAX_PAYLOAD,
             source_version: str | None = None) -> bytes | None:
        """The whole verified payload of a blob, or None (``BlobOpener.read``)."""
        return self._opener.read(tag, name, max_len=max_len, source_version=source_version)

    def read_with_mtime(self, tag: str, name: str, *, max_len: int = MAX_PAYLOAD
                        ) -> tuple[bytes, int] | None:
        """The whole verified payload of a blob and its file's mtime (ns), or None
        (``BlobOpener.read_with_mtime``)."""
        return self._opener.read_with_mtime(tag, name, max_len=max_len)

    def is_dirty(self, tag: str, name: str) -> bool:
        """Whether the blob on disk is dirty (user data: never evicted, never replaced by a
        fault); False when it is absent or its header is damaged."""
        return self._opener.is_dirty(tag, name)

    def drop_foreign(self, path: str) -> None:
        """Something other than a regular file stands where a blob file should: it is absent
        (removed, so the blob re-faults and can be stored)."""
        if self.writable:
            remove_entry(path)

    def blob_mtime_ns(self, tag: str, name: str) -> int | None:
        try:
            return os.stat(self.blob_path(tag, name)).st_mtime_ns
        except OSError:
            return None

    def file_bytes(self, tag: str, name: str) -> int:
        """Bytes of a blob file, header included (0 when it is absent): what ``put`` returned
        for it, and what a ``--cache-size`` cap counts."""
        try:
            return os.stat(self.blob_path(tag, name)).st_size
        except OSError:
            return 0

    def delete(self, tag: str, name: str) -> int:
        """Remove a blob; returns the bytes freed (0 also when a degraded store cannot)."""
        path = self.blob_path(tag, name)
        try:
            size = os.lstat(path).st_size
            os.unlink(path)
        except FileNotFoundError:
            return 0
        except OSError as exc:
            if exc.errno in DEGRADED_ERRNOS:
                return 0
            raise
        return size

    # -- per-tag state -----------------------------------------------------------------------

    def write_tag_state(self, tag: str, state: dict) -> None:
        self._require_writable()
        self._writer.write_tag_state(tag, state)

    def read_tag_state(self, tag: str) -> dict | None:
        path = os.path.join(self.tag_dir(tag), TAG_STATE)
        try:
            fd = open_regular(path)
        except ForeignEntry:
            raise CorruptionError(f"tag state {path} is not a regular file") from None
        if fd is None:
            return None
        try:
            with os.fdopen(fd, "rb") as f:
                doc = json.loads(f.read(MAX_TAG_STATE))
        except ValueError:
            raise CorruptionError(f"tag state {path} is not valid JSON") from None
        if not isinstance(doc, dict):
            raise CorruptionError(f"tag state {path} is not a JSON object")
        return doc

    def forget_tag(self, tag: str) -> None:
        """Remove a tag and every blob in it."""
        self._writer.forget_tag(tag)

    # -- space -------------------------------------------------------------------------------

    def free_bytes(self) -> int:
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize
