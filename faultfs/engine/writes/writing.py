"""Writes and truncates of what a tag shows: ``chunk_N`` (a fixed size), the view (grows and
shrinks), user blobs (one dirty file, or parts of ``USER_PART``), and the gaps of pages —
each cut into the dirty blobs it lands in and written through ``BlobWrites``.

Invariants:
- Every call is one change of its tag (``one_change``): a clone holds the tag still around it.
- A chunk never grows (EFBIG past its end). A view or a user blob grows to ``MAX_GROWN`` at
  most (or the source's size, when larger): a write that crosses the limit writes what fits
  (a short count), one wholly past it is EFBIG and changes nothing. A user blob made before
  parts holds ``USER_BLOB_MAX`` at most.
- A write across several blobs refused for want of room (ENOSPC) after some pieces landed
  returns the bytes that landed, as a full disk's write does; refused at its first piece it
  is refused whole.
- A shrink of the view zeroes the cut bytes of the source's chunks and of the chunks written
  since, never one piece per chunk of the range; a damaged chunk in the range refuses it
  before anything changes.
"""

from __future__ import annotations

import errno
from collections.abc import Iterable

from faultfs.core.chunks import pieces
from faultfs.engine.changes import TagChanges, one_change
from faultfs.engine.tags import Tag
from faultfs.engine.writes.blobwrite import BlobWrites
from faultfs.engine.writes.state import TagStates
from faultfs.engine.writes.table import VIEW, DirtyBlob, DirtyTable
from faultfs.errors import FaultfsError
from faultfs.store.blobfile import MAX_PAYLOAD
from faultfs.store.journal import KIND_SIZE

USER_BLOB_MAX = MAX_PAYLOAD  # a user blob made before parts is one dirty file: no longer
MAX_GROWN = 1 << 44  # a view or user blob grows to 16 TiB at most (ext4's largest file)


class Writing:
    """Writes and truncates of a tag's entries; see the module docstring for the rules."""

    def __init__(self, table: DirtyTable, states: TagStates, blobs: BlobWrites,
                 changes: TagChanges) -> None:
        self.table = table
        self.states = states
        self.blobs = blobs
        self.changes = changes  # (``one_change``)

    @one_change
    async def write_chunk(self, tag: Tag, index: int, off: int, data: bytes) -> int:
        """Write through ``chunk_N``: a chunk has a fixed size (EFBIG past its end)."""
        self.states.check_writable(tag)
        cs = tag.layout.chunk_size
        if off + len(data) > cs:
            raise FaultfsError(f"chunk {index} of tag {tag.name} is {cs} bytes: a write past "
                               "its end cannot grow it", errno.EFBIG)
        if index >= self.states.num_chunks(tag):
            raise FaultfsError(f"tag {tag.name} has no chunk {index}", errno.ENOENT)
        await self.blobs.write(self.table.chunk_blob(tag, index), off, data)
        self.states.written(tag)
        return len(data)

    @one_change
    async def write_view(self, tag: Tag, off: int, data: bytes) -> int:
        """Write through the whole-object view: it grows past its end (new chunks)."""
        self.states.check_writable(tag)
        tw = self.states.of(tag)
        cs = tag.layout.chunk_size
        end = off + len(data)
        if end > tw.view_size:
            data = _fit(tag, "the view", off, data)
            end = off + len(data)
        index, inner = divmod(off, cs)
        done = len(data)
        if data and inner + len(data) <= cs:  # one chunk (most writes): no slice, no generator
            await self.blobs.write(self.table.chunk_blob(tag, index), inner, data)
        else:
            done = await self._write_run(data, (
                (self.table.chunk_blob(tag, index), inner, length)
                for index, inner, length in pieces(off, len(data), end, cs)))
            end = off + done
        if end > tw.view_size:
            self.blobs.append(KIND_SIZE, tag.name, VIEW, 0, end)
            self.states.set_view_size(tag, tw, end)
        self.states.written(tag)
        return done

    async def _write_run(self, data: bytes,
                         run: Iterable[tuple[DirtyBlob, int, int]]) -> int:
        """Write ``data`` in the pieces ``run`` names, in order: the bytes written. A piece
        refused for want of room (ENOSPC) after others landed ends the run with a short
        count, as a full disk's write does (what landed stays, acknowledged; the caller
        sizes the file by it); refused at the first piece, the write is refused whole."""
        view = memoryview(data)
        at = 0
        for blob, inner, length in run:
            try:
                await self.blobs.write(blob, inner, view[at:at + length])
            except FaultfsError as exc:
                if exc.errno != errno.ENOSPC or at == 0:
                    raise
                break
            at += length
        return at

    @one_change
    async def truncate_view(self, tag: Tag, size: int) -> None:
        """``ftruncate`` of the view: bytes past ``size`` are gone (a later growth reads
        zeros there); growing reads zeros past the old end."""
        self.states.check_writable(tag)
        tw = self.states.of(tag)
        old = tw.view_size
        if size > old:
            _check_growth(tag, "the view", size)
        if size < old:
            cut = self._cut_pieces(tag, size, old)
            for index, _, _ in cut:
                blob = self.table.blobs.get((tag.id, tag.layout.blob_name(index)))
                if blob is not None and blob.damaged:  # refused before anything changes
                    raise FaultfsError(f"dirty blob {blob.name} of tag {tag.name} is damaged "
                                       f"({blob.damaged}): run faultfs fsck", errno.EIO)
            for index, inner, length in cut:
                await self.blobs.zero(self.table.chunk_blob(tag, index), inner, length)
        self.blobs.append(KIND_SIZE, tag.name, VIEW, 0, size)
        self.states.set_view_size(tag, tw, size)
        self.states.written(tag)

    def _cut_pieces(self, tag: Tag, size: int, old: int) -> list[tuple[int, int, int]]:
        """The pieces of view bytes ``[size, old)`` that a shrink must zero: in the
        source's chunks and in chunks written since, never one per chunk of the range (past
        both, a chunk holds no bytes and reads zeros already, however far the view grew)."""
        cs = tag.layout.chunk_size
        first, end = size // cs, -(-old // cs)
        indexes = set(range(first, min(end, tag.layout.num_blobs)))
        indexes.update(blob.index for blob in self.table.of_tag(tag.id)
                       if blob.index is not None and first <= blob.index < end)
        out = []
        for index in sorted(indexes):
            lo, hi = max(size, index * cs), min(old, (index + 1) * cs)
            out.append((index, lo - index * cs, hi - lo))
        return out

    @one_change
    async def write_user(self, tag: Tag, name: str, off: int, data: bytes) -> int:
        """A user blob made before parts is one dirty file, at most ``USER_BLOB_MAX`` bytes
        (what fits is written, a short count; a write wholly past it is EFBIG); one made
        since is cut into parts of ``USER_PART``, each a dirty blob of its own, so a fold
        rewrites only the parts written since the last one."""
        self.states.check_writable(tag)
        uid = self.states.user_uid(tag, name)
        table = self.table
        if uid not in self.states.tags[tag.id].parted:
            if off + len(data) > USER_BLOB_MAX:
                if off >= USER_BLOB_MAX:
                    raise _too_big(tag, name, off + len(data))
                data = data[:USER_BLOB_MAX - off]  # what fits: a short count
            await self.blobs.write(table.user_part_blob(tag, uid, 0), off, data)
        else:
            if data:
                data = _fit(tag, f"user blob {name}", off, data)
            try:
                data = data[:await self._write_run(data, (
                    (table.user_part_blob(tag, uid, k), inner, length) for k, inner, length
                    in pieces(off, len(data), off + len(data), table.user_part)))]
            except BaseException:  # some parts may have grown: work the size out again
                table.set_user_size(tag, uid, None)
                raise
        table.set_user_size(tag, uid, off + len(data), grown=True)
        self.states.written(tag, uid)
        return len(data)

    @one_change
    async def truncate_user(self, tag: Tag, name: str, size: int) -> None:
        self.states.check_writable(tag)
        uid = self.states.user_uid(tag, name)
        table = self.table
        if uid not in self.states.tags[tag.id].parted:
            if size > USER_BLOB_MAX:
                raise _too_big(tag, name, size)
            await self.blobs.resize(table.user_part_blob(tag, uid, 0), size)
        else:
            _check_growth(tag, f"user blob {name}", size)
            part = table.user_part
            last, inner = divmod(size, part)
            if inner == 0 and last:  # the part that holds the last byte is the whole one
                last, inner = last - 1, part
            for k, blob in sorted(table.parts(tag, uid).items()):
                if k > last or (k == last and not size):
                    if blob.size:
                        await self.blobs.resize(blob, 0)
            if size:
                blob = table.user_part_blob(tag, uid, last)
                if blob.size != inner:
                    await self.blobs.resize(blob, inner)
            table.set_user_size(tag, uid, size)
        self.states.written(tag, uid)

    @one_change
    async def write_gap(self, tag: Tag, page: int, off: int, data: bytes) -> None:
        """Bytes written into a gap of page ``page`` (the map has no slice there)."""
        self.states.check_writable(tag)
        await self.blobs.write(self.table.gap_blob(tag, page), off, data)


def _check_growth(tag: Tag, name: str, size: int) -> None:
    """A view or user blob grows to ``MAX_GROWN`` at most (or its source's size, when
    larger): EFBIG past it, nothing changed."""
    if size > max(MAX_GROWN, tag.layout.size):
        raise FaultfsError(f"{name} of tag {tag.name} cannot grow to {size} bytes: a file "
                           f"of the mount holds at most {MAX_GROWN >> 40} TiB", errno.EFBIG)


def _fit(tag: Tag, name: str, off: int, data: bytes) -> bytes:
    """What of a write of ``data`` at ``off`` fits under the growth limit
    (``_check_growth``): a write that crosses it writes what fits, a short count, as a
    file size limit does; one that starts at or past it is EFBIG."""
    limit = max(MAX_GROWN, tag.layout.size)
    if off + len(data) > limit and off < limit:
        return data[:limit - off]
    _check_growth(tag, name, off + len(data))
    return data


def _too_big(tag: Tag, name: str, size: int) -> FaultfsError:
    return FaultfsError(f"user blob {name} of tag {tag.name} cannot grow to {size} bytes: a "
                        f"user blob holds at most {USER_BLOB_MAX >> 20} MiB", errno.EFBIG)
