"""Reading staged blob files: a file is served only after its header verified and named the
blob asked for, staged from the source version asked for (``BlobOpener``); then every read of
it (``OpenBlob``) verifies the blocks it returns — from the file, from the page cache only
(never blocking), or from a payload loaded whole.

Invariants:
- No byte is returned before every block it lies in passed its checksum (CorruptionError
  otherwise); a file shorter than its header says is damaged, never a short read.
- A file that fails (torn, foreign, of another blob, stale) is absent to the reader: a clean
  one is deleted so it re-faults (unless it was replaced meanwhile: inodes are compared); a
  damaged *dirty* one raises CorruptionError instead — user data is reported, never
  re-faulted or dropped.
- ``nowait`` reads never block: served from the page cache (``RWF_NOWAIT``) or not at all.
- A header's length is never trusted for an allocation: whole reads are bounded by the
  caller's ``max_len``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import xxhash

from faultfs.buffers import pread_full
from faultfs.errors import CorruptionError
from faultfs.store.blobfile import HEADER_LEN, MAX_PAYLOAD, BlobHeader, block_span, decode_header
from faultfs.store.entries import (
    DEGRADED_ERRNOS,
    ForeignEntry,
    blob_path,
    open_regular,
    open_regular_stat,
)

NOWAIT_MAX = 256 << 10  # cached reads up to this size are served on the event loop's thread
SMALL_READ = 256 << 10  # below this a read returns its own bytes (no pooled mapping: buffers.py)
WHOLE_READ_MAX = 64 << 20  # open_blob(whole=True) reads header and payload at once up to this
_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", None)
_xxh3 = xxhash.xxh3_64_intdigest  # the block checksum (blobfile.BlobHeader.check_blocks)


@dataclass
class OpenBlob:
    """A blob file held open for preads; every read verifies the blocks it touches."""

    fd: int
    header: BlobHeader
    loaded: memoryview | None = None  # the stored payload, when opened ``whole``
    ino: int | None = None  # the file's inode: which file a damaged read came from
    mtime: float = 0.0  # the file's mtime when opened (its last use, for an LRU)

    def pread(self, size: int, off: int, *, nowait: bool = False) -> bytes | None:
        """Payload bytes ``[off, off+size)``; CorruptionError if a block fails its checksum.

        ``nowait``: read only what is already in the page cache (``RWF_NOWAIT``) and return
        None instead of blocking — this form may run on the event loop's thread."""
        h = self.header
        if not nowait and self.loaded is None and 0 <= off < h.payload_len and 0 < size \
                and not h.all_zero:
            bs = h.block_size
            first = off // bs
            start = first * bs
            want = min(start + bs, h.stored_len) - start
            lo = off - start
            size = min(size, h.payload_len - off)
            if lo + size <= want:
                # the common small read, within one block: one pread, one checksum, one slice
                data = os.pread(self.fd, want, HEADER_LEN + start)
                if len(data) != want:
                    raise CorruptionError(f"blob {h.name} of tag {h.tag} is truncated")
                if _xxh3(data) != h.block_sums[first]:
                    h.check_blocks(first, data)  # raises, naming the block
                return data if lo == 0 and size == want else data[lo:lo + size]
            # over several blocks: the bytes asked for read into the bytes returned (one
            # copy), the parts of the end blocks around them read apart, all checked
            data = os.pread(self.fd, size, HEADER_LEN + off)
            head, tail = self._edges(off, size)
            if len(data) != size:
                raise CorruptionError(f"blob {h.name} of tag {h.tag} is truncated")
            self._check_around(off, memoryview(data), head, tail)
            return data
        data = self.pread_view(size, off, nowait=nowait)
        return None if data is None else bytes(data)

    def preadinto(self, out: memoryview, off: int) -> int:
        """Payload bytes from ``off`` read straight into ``out`` (as many as fit, clipped to
        the blob), every block they lie in checked; how many. CorruptionError if a block
        fails its checksum (``out`` then holds nothing to use)."""
        h = self.header
        size = min(len(out), h.payload_len - off)
        if size <= 0:
            return 0
        if h.all_zero or self.loaded is not None:
            data = self.pread_view(size, off)
            assert data is not None
            out[:size] = data
            return size
        bs = h.block_size
        start = off // bs * bs
        head = bytearray(off - start)
        end = off + size
        tail = bytearray(min(-(-end // bs) * bs, h.stored_len) - end)
        got = os.preadv(self.fd, [head, out[:size], tail], HEADER_LEN + start)
        if got != len(head) + size + len(tail):
            raise CorruptionError(f"blob {h.name} of tag {h.tag} is truncated")
        self._check_around(off, out[:size], head, tail)
        return size

    def _edges(self, off: int, size: int) -> tuple[bytes, bytes]:
        """The parts of the blocks around payload ``[off, off+size)`` outside it: the first
        block's before it, the last block's after it."""
        h = self.header
        bs = h.block_size
        start, end = off // bs * bs, off + size
        stop = min(-(-end // bs) * bs, h.stored_len)
        head = os.pread(self.fd, off - start, HEADER_LEN + start) if off > start else b""
        tail = os.pread(self.fd, stop - end, HEADER_LEN + end) if stop > end else b""
        if len(head) != off - start or len(tail) != stop - end:
            raise CorruptionError(f"blob {h.name} of tag {h.tag} is truncated")
        return head, tail

    def _check_around(self, off: int, body: memoryview, head: bytes | bytearray,
                      tail: bytes | bytearray) -> None:
        """Check the blocks ``head + body + tail`` make up (``body``: payload from ``off``;
        ``head``, ``tail``: the rest of its first and last blocks) without joining them."""
        h = self.header
        bs, sums = h.block_size, h.block_sums
        end = off + len(body)
        first, last = off // bs, (end - 1) // bs
        if first == last:
            if _sum(head, body, tail) != sums[first]:
                h.check_blocks(first, b"".join((head, body, tail)))
            return
        cut = (first + 1) * bs - off  # where the second block starts in body
        if _sum(head, body[:cut], b"") != sums[first]:
            h.check_blocks(first, b"".join((head, body[:cut])))
        for i in range(first + 1, last):
            at = cut + (i - first - 1) * bs
            if _xxh3(body[at:at + bs]) != sums[i]:
                h.check_blocks(i, body[at:at + bs])
        at = last * bs - off
        if _sum(b"", body[at:], tail) != sums[last]:
            h.check_blocks(last, b"".join((body[at:], tail)))

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


def _sum(head: bytes | bytearray, body: memoryview, tail: bytes | bytearray) -> int:
    """The block checksum of ``head + body + tail``, without joining them."""
    if not head and not tail:
        return _xxh3(body)
    state = xxhash.xxh3_64(head)
    state.update(body)
    state.update(tail)
    return state.intdigest()


class BlobOpener:
    """Blob files of the store at ``root`` opened and read whole, verified; ``drop_foreign``
    removes what is not a file where one should be (when the store may be written)."""

    def __init__(self, root: str, *, drop_foreign: Callable[[str], None]) -> None:
        self.root = root
        self._drop_foreign = drop_foreign

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
                  whole: bool = False, path: str | None = None) -> OpenBlob | None:
        """Open a blob whose header verifies, or None when it is absent, foreign, torn or
        stale (a clean one is then deleted, so it re-faults). Payload blocks are verified
        by each read (``OpenBlob.pread``).

        ``whole``: read header and payload in one request (one disk read instead of two, for
        a caller about to read all of it); the blob's reads are then served from memory.
        ``path``: the blob's file, when the caller has it (``blob_path(root, tag, name)``).

        Raises CorruptionError only for a damaged *dirty* blob: user data that is gone
        must be reported, not silently re-faulted."""
        path = path or blob_path(self.root, tag, name)
        try:
            opened = open_regular_stat(path)
        except ForeignEntry:
            self._drop_foreign(path)
            return None
        if opened is None:
            return None
        fd, st = opened
        try:
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
        try:
            header = decode_header(bytes(head), file_size=st.st_size)
            if header.tag != tag or header.name != name:
                raise CorruptionError(f"blob {name} of tag {tag} holds blob {header.name!r} "
                                      f"of tag {header.tag!r}")
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
            # stale: staged from another version of the source
            self._discard(blob_path(self.root, tag, name), st.st_ino)
            return None
        return OpenBlob(fd, header, loaded, st.st_ino, st.st_mtime)

    def discard_damaged(self, tag: str, name: str, *, ino: int | None = None) -> bool:
        """Delete a blob that failed verification — unless it is dirty (user data), which
        raises CorruptionError instead: it cannot be re-faulted, so it must be reported.

        ``ino``: the inode that was found damaged. A blob file replaced since (a concurrent
        re-fault stored a good copy) is another inode and is left alone. True when the
        damaged file was removed by this call."""
        path = blob_path(self.root, tag, name)
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

    def is_dirty(self, tag: str, name: str) -> bool:
        """Whether the blob on disk is dirty (user data: never evicted, never replaced by a
        fault). Reads its header; False when it is absent or its header is damaged."""
        header = self.read_header(blob_path(self.root, tag, name))
        return header is not None and header.dirty


def _check_len(blob: OpenBlob, max_len: int) -> None:
    if blob.header.payload_len > max_len:
        raise CorruptionError(f"blob {blob.header.name} of tag {blob.header.tag} claims "
                              f"{blob.header.payload_len} bytes, over its limit of {max_len}")
