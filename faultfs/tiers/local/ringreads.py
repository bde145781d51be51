"""Staged reads through io_uring (``tiers/uring.py``): a read of an open blob file, and the
first read of one not open yet (the open, the header and the blocks it needs in one trip), so
a miss of the page cache waits for the disk without blocking the serving thread and without a
trip to the I/O pool, and the disk reads of concurrent readers overlap.

Invariants:
- What is returned was verified block by block, as ``OpenBlob`` verifies it; a file that
  reads short is damaged (CorruptionError), never a short answer.
- A file opened here is kept only when the store accepts its header (``accept_blob``);
  anything but a regular file is dropped as foreign, as the blocking path drops it.
- While recent reads were mostly served from the page cache, a read tries ``RWF_NOWAIT``
  first (it costs less than a ring entry); otherwise one read in ``PROBE_EVERY`` does.
"""

from __future__ import annotations

import os
import stat as stat_mod

from faultfs.buffers import alloc
from faultfs.errors import CorruptionError
from faultfs.stats import Stats
from faultfs.store.blobfile import HEADER_LEN, block_size_for, block_span
from faultfs.store.blobstore import FOREIGN_ERRNOS, OPEN_FLAGS, SMALL_READ, BlobStore, OpenBlob
from faultfs.tiers.base import Buffer, TierTag
from faultfs.tiers.uring import RingReader

CACHED_MOSTLY = 0.5  # share of recent reads found in the page cache above which ...
PROBE_EVERY = 16  # ... reads try RWF_NOWAIT first; below it, one read in this many does


class RingReads:
    """Reads of ``store``'s blob files through a ring, counted in ``stats``
    (``ring_reads``)."""

    def __init__(self, store: BlobStore, stats: Stats) -> None:
        self.store = store
        self.stats = stats
        self._cached_score = 0.0  # moving share of probed ring reads the page cache had
        self._probe = PROBE_EVERY

    async def read(self, ring: RingReader, blob: OpenBlob, size: int, off: int) -> Buffer:
        """Payload ``[off, off+size)`` of an open blob read through the ring, verified."""
        plan = blob.span(size, off)
        if not isinstance(plan, tuple):
            return plan
        first, start, want, size = plan
        self._probe -= 1
        if self._cached_score >= CACHED_MOSTLY or self._probe <= 0:
            # reads were mostly page-cache hits lately (or it is time to look again): a
            # RWF_NOWAIT read costs less than a ring entry, and on a miss it has started the
            # disk read that the ring entry then waits for
            data = blob.pread_view(size, off, nowait=True)
            self._probe = PROBE_EVERY
            self._cached_score += ((data is not None) - self._cached_score) / 8
            if data is not None:
                return data
        buf = bytearray(want) if want < SMALL_READ else alloc(want)
        self.stats.add("ring_reads")
        got = await ring.read(blob.fd, buf, HEADER_LEN + start)
        if got != want:
            raise CorruptionError(f"blob {blob.header.name} of tag {blob.header.tag} is "
                                  "truncated")
        return blob.verified(first, start, buf, off, size)

    async def open_and_read(self, ring: RingReader, tag: TierTag, index: int, size: int,
                            off: int
                            ) -> tuple[OpenBlob | None, Buffer | CorruptionError | None]:
        """Open a staged blob and read from it, as ``LocalTier._open_and_read`` does, through
        the ring: the open, then the header and the blocks the read needs (where a blob of the
        tag keeps them) read together. A damaged block is returned, not raised."""
        name = tag.blob_name(index)
        path = self.store.blob_path(tag.name, name)
        self.stats.add("ring_reads")
        try:
            fd = await ring.openat(path, os.O_RDONLY | OPEN_FLAGS)
        except FileNotFoundError:
            return None, None
        except OSError as exc:
            if exc.errno not in FOREIGN_ERRNOS:
                raise
            self.store.drop_foreign(path)
            return None, None
        try:
            st = os.fstat(fd)
            if not stat_mod.S_ISREG(st.st_mode):
                os.close(fd)
                self.store.drop_foreign(path)
                return None, None
            head = bytearray(HEADER_LEN)
            bufs, offs = [head], [0]
            guess = None
            stored = tag.blob_size
            if 0 <= off < stored and size > 0 and st.st_size == HEADER_LEN + stored:
                guess = block_span(block_size_for(stored), stored, off, size)
                bufs.append(bytearray(guess[2]))
                offs.append(HEADER_LEN + guess[1])
            got = await ring.read_many(fd, bufs, offs)
        except BaseException:
            os.close(fd)
            raise
        blob = self.store.accept_blob(fd, st, memoryview(head)[:got[0]], tag.name, name,
                                      source_version=tag.version)
        if blob is None:
            return None, None
        try:
            plan = blob.span(size, off)
            if not isinstance(plan, tuple):
                return blob, plan
            first, start, want, size = plan
            if guess is not None and guess[1:] == (start, want) and got[1] == want:
                return blob, blob.verified(first, start, bufs[1], off, size)
            return blob, await self.read(ring, blob, size, off)
        except CorruptionError as exc:
            return blob, exc
        except BaseException:
            blob.close()
            raise
