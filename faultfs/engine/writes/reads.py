"""Reads of dirty blobs: a blob's base (its clean chunk, its dirty file, its direct file, or
nothing) with its writes laid over it, and the view, user blobs and page gaps assembled from
them.

Invariants:
- A read takes the base and the writes it sees in one step (no await between), so it never
  mixes two states of a blob; a direct file renamed (folded) under the read, or a spilled
  write whose journal segment was trimmed meanwhile, makes it take the blob's new state.
- A spilled write is read back from the journal verified against its record's checksum: one
  that does not verify is EIO and makes its blob damaged (``Damage.mark``), never its older
  bytes, never zeros.
- A damaged blob reads as EIO.
"""

from __future__ import annotations

import errno

from faultfs.core.chunks import pieces
from faultfs.core.extents import ExtentMap, Ref, lay, spilled
from faultfs.engine.tags import Tag
from faultfs.engine.writes.base import Bases, CleanReads
from faultfs.engine.writes.damage import Damage
from faultfs.engine.writes.state import TagStates
from faultfs.engine.writes.table import CLEAN, DIRECT, FOLDED, GAP_PREFIX, DirtyBlob, DirtyTable
from faultfs.errors import CorruptionError, FaultfsError
from faultfs.iopool import IoPool
from faultfs.store.dirty import DirtyFiles
from faultfs.store.journal import Journal, SegmentGone
from faultfs.tiers.base import Buffer


class DirtyReads:
    """Reads of the writes of an engine's tags; see the module docstring for the rules."""

    def __init__(self, table: DirtyTable, states: TagStates, bases: Bases, clean: CleanReads,
                 damage: Damage, files: DirtyFiles, journal: Journal, pool: IoPool) -> None:
        self.table = table
        self.states = states
        self.bases = bases
        self.clean = clean
        self.damage = damage
        self.files = files
        self.journal = journal
        self.pool = pool

    async def read_chunk(self, tag: Tag, index: int, off: int, size: int) -> bytes:
        blob = self.table.blobs.get((tag.id, tag.layout.blob_name(index)))
        if blob is None:  # an extension chunk past the source that was never written
            return bytes(max(0, min(size, tag.layout.chunk_size - off)))
        return await self.read(blob, off, size)

    async def read_view(self, tag: Tag, off: int, size: int) -> Buffer:
        """View bytes of a tag with writes: chunk by chunk, dirty or clean (a read inside
        one chunk is its bytes as they come, uncopied)."""
        cs = tag.layout.chunk_size
        parts: list[Buffer] = []
        for index, inner, length in pieces(off, size, self.states.view_size(tag), cs):
            if self.table.is_dirty(tag, index) or index >= tag.layout.num_blobs:
                parts.append(await self.read_chunk(tag, index, inner, length))
            else:
                parts.append(await self.clean.read_clean(tag, index, inner, length))
        if len(parts) == 1:
            return parts[0]
        return b"".join(parts)

    async def read_user(self, tag: Tag, name: str, off: int, size: int) -> bytes:
        uid = self.states.user_id(tag, name)
        if uid is None:
            return b""
        parts = self.table.parts(tag, uid)
        parted = uid in self.states.tags[tag.id].parted
        if not parted:
            return await self.read(parts[0], off, size) if 0 in parts else b""
        out: list[bytes | bytearray] = []  # (bytes: reads are never the fold's buffer)
        total = self.table.user_size(tag, uid, parted)
        for k, inner, length in pieces(off, size, total, self.table.user_part):
            blob = parts.get(k)
            data = b"" if blob is None else await self.read(blob, inner, length)
            out.append(data if len(data) == length else bytes(data) + bytes(length - len(data)))
        return out[0] if len(out) == 1 else b"".join(out)

    async def read_gap(self, tag: Tag, page: int, off: int, size: int) -> bytes | None:
        """The bytes written into the gaps of page ``page`` (None when none were)."""
        blob = self.table.blobs.get((tag.id, f"{GAP_PREFIX}{page}"))
        return None if blob is None else await self.read(blob, off, size)

    async def read_whole(self, blob: DirtyBlob) -> bytes | bytearray:
        """All of ``blob``, in a buffer of its own (a fold's)."""
        return await self.read(blob, 0, blob.size, mutable=True) if blob.size else b""

    async def read(self, blob: DirtyBlob, off: int, size: int, *,
                   mutable: bool = False) -> bytes | bytearray:
        """Bytes ``[off, off+size)`` of ``blob``: its base with its writes over it.
        ``mutable``: the buffer they were assembled in, uncopied (a fold's)."""
        for _ in range(8):
            try:
                return await self._read_once(blob, off, size, mutable=mutable)
            except SegmentGone:  # folded under the read: its writes are in its file now
                continue
        raise FaultfsError(f"dirty blob {blob.name} of tag {blob.tag.name} cannot be read: "
                           "its writes keep moving", errno.EIO)

    async def _read_once(self, blob: DirtyBlob, off: int, size: int, *,
                         mutable: bool) -> bytes | bytearray:
        if blob.damaged:
            raise FaultfsError(f"dirty blob {blob.name} of tag {blob.tag.name} cannot be read: "
                               f"{blob.damaged}", errno.EIO)
        if off >= blob.size or size <= 0:
            return b""
        size = min(size, blob.size - off)
        for _ in range(8):  # a direct file renamed (folded) under the read: take the new state
            pending, base, direct = blob.pending, blob.base, blob.direct  # one state
            if base is not DIRECT:
                break
            try:
                data = await self.pool.run(self.files.read_direct, blob.tag.name, blob.name,
                                           direct, off, size)
            except FileNotFoundError:
                continue
            except (CorruptionError, OSError) as exc:
                raise _unreadable(blob, exc) from None
            if not pending:
                return data
            buf = bytearray(size)
            buf[:len(data)] = data
            await self._lay(blob, pending, buf, off)
            return buf if mutable else bytes(buf)
        else:
            raise FaultfsError(f"dirty blob {blob.name} of tag {blob.tag.name} cannot be read: "
                               "its file keeps moving", errno.EIO)
        pending, base = blob.pending, blob.base  # one state
        buf = bytearray(size)
        if pending.covers(off, size):
            pass  # every byte was written over (a chunk rewritten in pieces): no base read
        elif base is FOLDED:
            try:
                data = await self.pool.run(self.files.read, blob.tag.name, blob.name, off, size)
            except (CorruptionError, OSError) as exc:
                raise _unreadable(blob, exc) from None
            buf[:len(data)] = data
        elif base is CLEAN:
            clean = await self.bases.read(blob, off, size)
            buf[:len(clean)] = clean
        await self._lay(blob, pending, buf, off)
        return buf if mutable else bytes(buf)

    async def _lay(self, blob: DirtyBlob, pending: ExtentMap, buf: bytearray, off: int) -> None:
        """Lay ``pending`` over ``buf`` (bytes ``[off, off+len(buf))``): the parts taken now,
        in one step, and the spilled ones read back from the journal on the I/O pool."""
        parts = list(pending.pieces(off, len(buf)))
        if not any(spilled(d) for _, _, d in parts):
            lay(buf, off, parts)
            return
        try:
            await self.pool.run(lay, buf, off, parts, self.read_back)
        except CorruptionError as exc:  # kept, never written over: fsck reports it
            await self.damage.mark(blob, f"a write in the journal does not verify: {exc}")
            raise FaultfsError(f"dirty blob {blob.name} of tag {blob.tag.name} cannot be "
                               f"read: {exc}", errno.EIO) from None

    def read_back(self, ref: Ref) -> bytes:
        """A spilled write's bytes, read back from the journal (verified)."""
        data = self.journal.read_data(ref.file, ref.pos, ref.length, ref.digest)
        return data[ref.lo:ref.hi]


def _unreadable(blob: DirtyBlob, exc: Exception) -> FaultfsError:
    return FaultfsError(f"dirty blob {blob.name} of tag {blob.tag.name} cannot be read: "
                        f"{exc}", errno.EIO)
