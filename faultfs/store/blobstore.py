"""The embedded store: staged blobs as self-describing files under one local directory.

Layout under the store root:

    lock                      flock()ed by the one process that owns the store; holds its pid
    tags/t-<tag>/b-<blob>     blob files (names percent-encoded; h-<sha256> when too long)
    tags/t-<tag>/tag.json     per-tag state (source version, fault key, shard index)
    log/faultfs.log           the daemon's log when it runs in the background

Invariants:
- No tag or blob name can escape the root: every path component is derived by encoding.
- A blob file is served only after ``decode_header`` accepted it and its tag, name and
  source version match what is asked; a payload is verified once per open handle.
- Blocking: every method does file I/O. The tiers call them on the I/O pool, except small
  reads of staged blobs, which run on the serving thread (``tiers/local.py``).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import secrets
import stat as stat_mod
from dataclasses import dataclass
from urllib.parse import quote, unquote

from faultfs.buffers import pread_full
from faultfs.errors import CorruptionError, FaultfsError, InvalidInput, StoreFull
from faultfs.store import direct
from faultfs.store.blobfile import (
    FLAG_DIRTY,
    HEADER_LEN,
    MAX_PAYLOAD,
    BlobHeader,
    block_span,
    decode_header,
    encode_header,
)
from faultfs.store.durable import fsync_dir, write_atomic, write_parts

NOWAIT_MAX = 256 << 10  # cached reads up to this size are served on the event loop's thread
SMALL_READ = 256 << 10  # below this a read returns its own bytes (no pooled mapping: buffers.py)
WHOLE_READ_MAX = 64 << 20  # open_blob(whole=True) reads header and payload at once up to this
_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", None)
MAX_ENCODED_NAME = 240  # NAME_MAX is 255: leave room for the "b-" prefix and margin
TAG_STATE = "tag.json"
MAX_TAG_STATE = 1 << 20  # a tag state of more than this is not one we wrote


def encode_component(prefix: str, name: str) -> str:
    """A file name for ``name`` under ``prefix``: percent-encoded (no name can escape a
    directory), or ``h-<sha256>`` when too long (the header then says the name)."""
    encoded = quote(name, safe="")
    if len(encoded) > MAX_ENCODED_NAME:
        return "h-" + hashlib.sha256(name.encode("utf-8", "surrogateescape")).hexdigest()
    return prefix + encoded


@dataclass
class OpenBlob:
    """A blob file held open for preads; every read verifies the blocks it touches."""

    fd: int
    header: BlobHeader
    loaded: memoryview | None = None  # the stored payload, when opened ``whole``
    ino: int | None = None  # the file's inode: which file a damaged read came from

    def pread(self, size: int, off: int, *, nowait: bool = False) -> bytes | None:
        """Payload bytes ``[off, off+size)``; CorruptionError if a block fails its checksum.

        ``nowait``: read only what is already in the page cache (``RWF_NOWAIT``) and return
        None instead of blocking — this form may run on the event loop's thread."""
        data = self.pread_view(size, off, nowait=nowait)
        return None if data is None else bytes(data)

    def pread_view(self, size: int, off: int, *, nowait: bool = False
                   ) -> bytes | memoryview | None:
        """As ``pread``, without copying: the buffer the blocks were read into, or a slice
        of it (which keeps all of it alive)."""
        plan = self.span(size, off)
        if not isinstance(plan, tuple):
            return plan
        first, start, want, size = plan
        if nowait:
            if want > NOWAIT_MAX or _RWF_NOWAIT is None:
                return None
            buf = bytearray(want)
            try:
                got = os.preadv(self.fd, [buf], HEADER_LEN + start, _RWF_NOWAIT)
            except (BlockingIOError, OSError):
                return None
            if got != want:
                return None  # partly cached: let the blocking path read it
            return self.verified(first, start, buf, off, size)
        if want < SMALL_READ:
            data: bytes | memoryview = os.pread(self.fd, want, HEADER_LEN + start)
        else:
            data = pread_full(self.fd, want, HEADER_LEN + start)
        if len(data) != want:
            raise CorruptionError(f"blob {self.header.name} of tag {self.header.tag} is truncated")
        return self.verified(first, start, data, off, size)

    def span(self, size: int, off: int
             ) -> tuple[int, int, int, int] | bytes | memoryview:
        """What a read of payload ``[off, off+size)`` needs from the file: ``(first block,
        payload offset of that block, bytes to read, size clipped to the blob)`` — or the
        answer itself when no read is needed (past the end, an all-zero blob, a loaded one)."""
        h = self.header
        if off >= h.payload_len or size <= 0:
            return b""
        size = min(size, h.payload_len - off)
        if h.all_zero:
            return bytes(size)
        first, start, want = block_span(h.block_size, h.stored_len, off, size)
        if self.loaded is not None:
            return self.verified(first, start, self.loaded[start:start + want], off, size)
        return first, start, want, size

    def verified(self, first: int, start: int, data: bytes | bytearray | memoryview, off: int,
                 size: int) -> bytes | memoryview:
        """Payload ``[off, off+size)`` out of ``data`` (whole blocks from block ``first``, at
        payload offset ``start``), once every block passed its checksum (CorruptionError if
        one does not)."""
        self.header.check_blocks(first, data)
        if start == off and len(data) == size and not isinstance(data, bytearray):
            return data
        return memoryview(data)[off - start:off - start + size]

    def close(self) -> None:
        self.loaded = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class ForeignEntry(Exception):
    """Something other than a regular file (a FIFO, a directory, a symbolic link, a device)
    stands where a store file should be."""


OPEN_FLAGS = os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK  # see open_regular
FOREIGN_ERRNOS = (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.EOPNOTSUPP)  # a link, a directory, a socket


def open_regular(path: str, flags: int = os.O_RDONLY) -> int | None:
    """A descriptor of the regular file ``path`` names, never following a symbolic link and
    never blocking (a FIFO's open would); None when it is absent. ForeignEntry for anything
    else, so no hostile entry in the store can hang a request or lead outside the store."""
    try:
        fd = os.open(path, flags | OPEN_FLAGS)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in FOREIGN_ERRNOS:
            raise ForeignEntry(path) from None
        raise
    if not stat_mod.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ForeignEntry(path)
    return fd


def remove_entry(path: str) -> None:
    """Remove whatever is at ``path`` (not what a link points to)."""
    try:
        if stat_mod.S_ISDIR(os.lstat(path).st_mode):
            import shutil

            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass


# The file system refuses writes but the staged blobs can still be read: mount degraded.
DEGRADED_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS}
PRIVATE = 0o700  # the store names sources and tags: for its owner only (files 0600)


class BlobStore:
    """Staged blobs under ``root``; see the module docstring for the layout.

    ``create=False`` touches nothing: ``create()`` makes (or checks) the directories later,
    once everything else of a mount has been validated."""

    def __init__(self, root: str, *, create: bool = True) -> None:
        self.root = os.path.abspath(os.path.expanduser(root))
        self._lock_fd = -1
        self._real_dirs: set[str] = set()  # tag directories this process made or checked
        # new clean blobs of whole pages are written around the page cache (store.direct);
        # False: never (Config.store_direct), or once the file system refused it
        self.direct = True
        self.degraded = ""  # why nothing can be written (a full or read-only file system)
        self.degraded_errno = 0
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
                _tighten(path)
            except OSError as exc:
                if exc.errno in DEGRADED_ERRNOS and os.path.isdir(os.path.join(self.root, "tags")):
                    self._degrade(exc)
                    return
                raise InvalidInput(f"store {self.root} cannot be created: {exc.strerror}",
                                   exc.errno or errno.EIO) from None
        probe = os.path.join(self.root, f".probe-{secrets.token_hex(4)}")
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, b"x")  # a full file system may still create an empty file
            finally:
                os.close(fd)
                os.unlink(probe)
        except OSError as exc:
            if exc.errno in DEGRADED_ERRNOS:
                _unlink_quietly(probe)
                self._degrade(exc)
                return
            raise InvalidInput(f"store {self.root} is not writable: {exc.strerror}",
                               exc.errno or errno.EACCES) from None

    def _degrade(self, exc: OSError) -> None:
        self.degraded = exc.strerror or str(exc)
        self.degraded_errno = exc.errno or errno.EROFS

    @property
    def writable(self) -> bool:
        return not self.degraded

    def _require_writable(self) -> None:
        if self.degraded:
            raise FaultfsError(f"store {self.root} cannot be written: {self.degraded}",
                               self.degraded_errno)

    # -- ownership ---------------------------------------------------------------------------

    def acquire(self) -> None:
        """Take the store's lock; FaultfsError(EBUSY) when another process owns it. A degraded
        store is locked when its lock file exists (a read-only one cannot be written by
        anyone, so there is nothing to keep out when it does not)."""
        path = os.path.join(self.root, "lock")
        try:
            fd = open_regular(path, os.O_RDWR if self.writable else os.O_RDONLY)
            if fd is None and self.writable:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
                             | os.O_NOFOLLOW, 0o600)
        except ForeignEntry:
            raise InvalidInput(f"store lock {path} is not a regular file", errno.EEXIST) from None
        if fd is None:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise FaultfsError(
                f"store {self.root} is in use by pid {owner}: unmount that mount first, "
                "or pick another --store", errno.EBUSY) from None
        if self.writable:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def release(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    # -- paths -------------------------------------------------------------------------------

    def tag_dir(self, tag: str) -> str:
        return os.path.join(self.root, "tags", encode_component("t-", tag))

    def blob_path(self, tag: str, name: str) -> str:
        return os.path.join(self.tag_dir(tag), encode_component("b-", name))

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
        if not self._real_dir(directory):
            return []  # a link or a file where the tag's directory should be: nothing staged
        try:
            entries = list(os.scandir(directory))
        except FileNotFoundError:
            return []
        found = []
        for entry in entries:
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
        """Stage ``payload`` as blob ``(tag, name)``; returns bytes written to disk.

        Clean blobs are written without fsync unless ``durable``: they can always be
        re-faulted, and a torn one fails verification. Dirty blobs are always fsynced.
        Raises StoreFull on ENOSPC/EDQUOT (nothing partial is left behind)."""
        self._require_writable()
        header, with_payload = encode_header(tag, name, payload, flags=flags,
                                             source_version=source_version)
        self._make_tag_dir(tag)
        if durable is None:
            durable = bool(flags & FLAG_DIRTY)
        parts = [header, payload] if with_payload else [header]
        path = self.blob_path(tag, name)
        try:
            try:
                write_atomic(path, parts, mode=0o600, durable=durable)
            except IsADirectoryError:  # a foreign directory stands there: the blob replaces it
                remove_entry(path)
                write_atomic(path, parts, mode=0o600, durable=durable)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StoreFull(f"store {self.root} is full") from None
            raise
        return len(header) + (len(payload) if with_payload else 0)

    def put_new(self, tag: str, name: str, payload: bytes | memoryview, *, flags: int,
                source_version: str = "") -> int | None:
        """Stage a clean blob whose name is free, straight under its name: one create, a
        ``pwrite`` of the header and one of the payload (one ``pwritev`` around the page
        cache when the payload is page-aligned whole pages: ``store/direct.py``), one close —
        no temporary file, no rename, no fsync. None (nothing written) when the name is taken
        or the tag's directory was not made or checked by this store: the caller then
        decides (a dirty blob there is never replaced) and takes ``put``. A crash mid-write
        leaves a short or unsynced file, which fails verification like any unsynced clean
        blob and is faulted again."""
        self._require_writable()
        directory = self.tag_dir(tag)
        if flags & FLAG_DIRTY or directory not in self._real_dirs:
            return None
        header, with_payload = encode_header(tag, name, payload, flags=flags,
                                             source_version=source_version)
        path = self.blob_path(tag, name)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            return None
        except FileNotFoundError:  # the directory went away: put() makes it again
            self._real_dirs.discard(directory)
            return None
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StoreFull(f"store {self.root} is full") from None
            raise
        try:
            view = memoryview(payload)
            around = with_payload and self.direct and direct.aligned(view)
            if around and not direct.write_blob(fd, header, view):
                self.direct = around = False  # the file system refuses O_DIRECT: never again
            if not around:
                write_parts(fd, [header, payload] if with_payload else [header])
        except OSError as exc:
            os.close(fd)
            _unlink_quietly(path)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StoreFull(f"store {self.root} is full") from None
            raise
        os.close(fd)
        return len(header) + (len(payload) if with_payload else 0)

    def read_header(self, path: str) -> BlobHeader | None:
        """The verified header of a blob file; None when it is absent, damaged or foreign."""
        try:
            fd = open_regular(path)
        except ForeignEntry:
            return None
        if fd is None:
            return None
        try:
            return decode_header(os.pread(fd, HEADER_LEN, 0), file_size=os.fstat(fd).st_size)
        except CorruptionError:
            return None
        finally:
            os.close(fd)

    def open_blob(self, tag: str, name: str, *, source_version: str | None = None,
                  whole: bool = False) -> OpenBlob | None:
        """Open a blob whose header verifies, or None when it is absent, foreign, torn or
        stale (a clean one is then deleted, so it re-faults). Payload blocks are verified
        by each read (``OpenBlob.pread``).

        ``whole``: read header and payload in one request (one disk read instead of two, for
        a caller about to read all of it); the blob's reads are then served from memory.

        Raises CorruptionError only for a damaged *dirty* blob: user data that is gone
        must be reported, not silently re-faulted."""
        path = self.blob_path(tag, name)
        try:
            fd = open_regular(path)
        except ForeignEntry:
            self.drop_foreign(path)
            return None
        if fd is None:
            return None
        try:
            st = os.fstat(fd)
            loaded: memoryview | None = None
            if whole and HEADER_LEN <= st.st_size <= HEADER_LEN + WHOLE_READ_MAX:
                raw = pread_full(fd, st.st_size, 0)
                head: bytes | bytearray | memoryview = raw[:HEADER_LEN]
                loaded = raw[HEADER_LEN:] if len(raw) == st.st_size else None
                if loaded is None:
                    head = b""  # shorter than it was a moment ago: torn
            else:
                head = os.pread(fd, HEADER_LEN, 0)
        except BaseException:
            os.close(fd)
            raise
        return self.accept_blob(fd, st, head, tag, name, source_version=source_version,
                                loaded=loaded)

    def accept_blob(self, fd: int, st: os.stat_result, head: bytes | bytearray | memoryview,
                    tag: str, name: str, *, source_version: str | None = None,
                    loaded: memoryview | None = None) -> OpenBlob | None:
        """The blob file open as ``fd`` (``st``: its ``fstat``; ``head``: its first
        ``HEADER_LEN`` bytes, fewer when it is shorter) as an OpenBlob, when its header
        verifies and names blob ``name`` of ``tag`` staged from ``source_version``.
        Otherwise ``fd`` is closed, a damaged or stale clean file deleted, and None returned;
        CorruptionError for a damaged dirty one (as ``open_blob``)."""
        path = self.blob_path(tag, name)
        try:
            header = decode_header(bytes(head), file_size=st.st_size)
            if header.tag != tag or header.name != name:
                raise CorruptionError(f"{path} holds blob {header.name!r} of tag {header.tag!r}")
        except CorruptionError:
            os.close(fd)
            self.discard_damaged(tag, name, ino=st.st_ino)
            return None
        except BaseException:
            os.close(fd)
            raise
        if (source_version is not None and not header.dirty
                and header.source_version != source_version):
            os.close(fd)
            self._discard(path, st.st_ino)  # stale: staged from another version of the source
            return None
        return OpenBlob(fd, header, loaded, st.st_ino)

    def drop_foreign(self, path: str) -> None:
        """Something other than a regular file stands where a blob file should: it is absent
        (removed, so the blob re-faults and can be stored)."""
        if self.writable:
            remove_entry(path)

    def discard_damaged(self, tag: str, name: str, *, ino: int | None = None) -> bool:
        """Delete a blob that failed verification — unless it is dirty (user data), which
        raises CorruptionError instead: it cannot be re-faulted, so it must be reported.

        ``ino``: the inode that was found damaged. A blob file replaced since (a concurrent
        re-fault stored a good copy) is another inode and is left alone. True when the
        damaged file was removed by this call."""
        path = self.blob_path(tag, name)
        if self.is_dirty(tag, name):
            raise CorruptionError(f"dirty blob {name} of tag {tag} is damaged: {path}")
        return self._discard(path, ino)

    def _discard(self, path: str, ino: int | None = None) -> bool:
        try:
            if ino is not None and os.lstat(path).st_ino != ino:
                return False  # replaced meanwhile: not the file that was found bad
            os.unlink(path)
        except FileNotFoundError:
            return False
        except OSError as exc:
            if exc.errno in DEGRADED_ERRNOS:
                return False  # a read-only store keeps it; it is re-faulted on every read
            raise
        return True

    def read(self, tag: str, name: str, *, max_len: int = MAX_PAYLOAD,
             source_version: str | None = None) -> bytes | None:
        """The whole verified payload of a blob, or None (also when its header claims more
        than ``max_len`` bytes: the caller's own limit, so a hostile length is never
        allocated)."""
        blob = self.open_blob(tag, name, source_version=source_version, whole=True)
        if blob is None:
            return None
        try:
            _check_len(blob, max_len)
            return blob.pread(blob.header.payload_len, 0)
        except CorruptionError:
            self.discard_damaged(tag, name, ino=blob.ino)
            return None
        finally:
            blob.close()

    def read_with_mtime(self, tag: str, name: str, *, max_len: int = MAX_PAYLOAD
                        ) -> tuple[bytes, int] | None:
        """The whole verified payload of a blob and its file's mtime (ns), or None when it is
        absent. CorruptionError for a damaged dirty blob (a damaged clean one is dropped),
        and for one whose header claims more than ``max_len`` bytes."""
        blob = self.open_blob(tag, name)
        if blob is None:
            return None
        try:
            _check_len(blob, max_len)
            mtime_ns = os.fstat(blob.fd).st_mtime_ns
            return blob.pread(blob.header.payload_len, 0) or b"", mtime_ns
        except CorruptionError:
            self.discard_damaged(tag, name, ino=blob.ino)
            return None
        finally:
            blob.close()

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

    def is_dirty(self, tag: str, name: str) -> bool:
        """Whether the blob on disk is dirty (user data: never evicted, never replaced by a
        fault). Reads its header; False when it is absent or its header is damaged."""
        header = self.read_header(self.blob_path(tag, name))
        return header is not None and header.dirty

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
        directory = self._make_tag_dir(tag)
        data = json.dumps(state, sort_keys=True, indent=1).encode()
        write_atomic(os.path.join(directory, TAG_STATE), [data], mode=0o600)

    def _make_tag_dir(self, tag: str) -> str:
        """The tag's directory, made (0700) if needed; whatever else stands there (a link, a
        file) is removed first, so no write lands outside the store."""
        directory = self.tag_dir(tag)
        if not self._real_dir(directory):
            remove_entry(directory)
        os.makedirs(directory, mode=PRIVATE, exist_ok=True)
        self._real_dirs.add(directory)
        return directory

    @staticmethod
    def _real_dir(path: str) -> bool:
        try:
            return stat_mod.S_ISDIR(os.lstat(path).st_mode)
        except FileNotFoundError:
            return False

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
        import shutil

        self._real_dirs.discard(self.tag_dir(tag))
        shutil.rmtree(self.tag_dir(tag), ignore_errors=True)
        fsync_dir(os.path.join(self.root, "tags"))

    # -- space -------------------------------------------------------------------------------

    def free_bytes(self) -> int:
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize


def _tighten(path: str) -> None:
    """Make a store directory private (an older faultfs made them 0755)."""
    st = os.lstat(path)
    if st.st_uid == os.geteuid() and stat_mod.S_IMODE(st.st_mode) != PRIVATE:
        os.chmod(path, PRIVATE)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _check_len(blob: OpenBlob, max_len: int) -> None:
    if blob.header.payload_len > max_len:
        raise CorruptionError(f"blob {blob.header.name} of tag {blob.header.tag} claims "
                              f"{blob.header.payload_len} bytes, over its limit of {max_len}")
