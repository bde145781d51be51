"""Writing one dirty blob: a write or a cut journaled and laid over the blob, a chunk written
whole as a direct file, a partial write over a base faulted behind it — and the one retry of
a change whose blob a reset replaced while it waited.

Invariants:
- A write is acknowledged only after its journal record (and a whole chunk's direct file
  before it) was written: it survives a kill -9 of the daemon. A refused one (ENOSPC)
  changes nothing: a chunk it brought into the table with nothing written to it goes again,
  unpinned, never folded into a dirty copy of the source's bytes.
- Writes and folds of one blob are serialised (its lock); a write into a blob nobody holds,
  whose base needs nothing, takes no lock (nothing in it awaits).
- A change that awaited after it was handed its blob (back-pressure, the blob's lock, its
  base's fault) goes on with the blob the table has for its name then (``now``): a reset
  may have dropped the one it was handed, and its record, journaled after the reset's void
  mark, is laid over the reset at a replay. ``retried`` is that retry, for every change.
"""

from __future__ import annotations

import errno
from collections.abc import Awaitable, Callable

from faultfs.core.extents import Ref
from faultfs.engine.writes.base import Bases
from faultfs.engine.writes.checkpoint import Checkpoints
from faultfs.engine.writes.damage import damaged_error
from faultfs.engine.writes.state import TagStates
from faultfs.engine.writes.sync import GroupCommit
from faultfs.engine.writes.table import DirtyBlob, DirtyTable, unwritten
from faultfs.errors import FaultfsError, StoreFull
from faultfs.stats import Stats
from faultfs.store.dirty import DirtyFiles
from faultfs.store.journal import KIND_BLOB, KIND_SIZE, KIND_WRITE, KIND_ZERO, Journal

Attempt = Callable[[DirtyBlob], Awaitable[bool]]


class Handed:
    """The blob a change was handed, which a reset may replace while the change waits
    (``BlobWrites.retried``); ``writer``: a write, counted as the blob's writer."""

    __slots__ = ("blob", "writer")

    def __init__(self, blob: DirtyBlob, *, writer: bool = False) -> None:
        self.blob = blob
        self.writer = writer


class BlobWrites:
    """Writes and cuts of single dirty blobs; see the module docstring for the rules."""

    def __init__(self, table: DirtyTable, states: TagStates, bases: Bases,
                 checkpoints: Checkpoints, sync: GroupCommit, files: DirtyFiles,
                 journal: Journal, stats: Stats) -> None:
        self.table = table
        self.states = states
        self.bases = bases
        self.checkpoints = checkpoints
        self.sync = sync
        self.files = files
        self.journal = journal
        self.stats = stats

    # -- the retry ---------------------------------------------------------------------------

    def now(self, blob: DirtyBlob) -> DirtyBlob:
        """The blob a change handed ``blob`` goes to after an await: ``blob``, or, when a
        reset dropped it meanwhile, the one the table has for its name now, made as a replay
        makes it (the change is journaled after the reset's void mark: a replay lays it over
        the reset). A part of a user blob unlinked meanwhile stays ``blob``: nothing reads
        it, and a replay applies none of its records."""
        tag = blob.tag
        now = self.table.blobs.get((tag.id, blob.name))
        if now is blob or tag.id not in self.states.tags:
            return blob
        if now is None:
            now = self.table.blob_for(tag, blob.name, self.states.tags[tag.id].users.values())
        return blob if now is None else now

    def move(self, handed: Handed) -> None:
        """Hand the change ``handed`` the blob ``now`` gives for its blob (a writer's count
        goes with it; a damaged one refuses the write)."""
        blob = handed.blob
        now = handed.blob = self.now(blob)
        if handed.writer:
            if now is not blob:
                blob.writers -= 1
                now.writers += 1
            if now.damaged:
                raise damaged_error(now)

    async def retried(self, handed: Handed, attempt: Attempt) -> DirtyBlob:
        """Run ``attempt`` on the change's blob until it lands: it returns False, having
        changed nothing, when a reset dropped the blob while it waited; then it runs again on
        the blob the table has for the name now (``move``). The blob it landed in."""
        while not await attempt(handed.blob):
            self.move(handed)
        return handed.blob

    async def locked(self, blob: DirtyBlob, change: Attempt) -> bool:
        """``change(blob)`` under the blob's lock, unless a reset dropped it while this waited
        for the lock (False, nothing changed)."""
        async with blob.locked():
            return self.now(blob) is blob and await change(blob)

    # -- writes ------------------------------------------------------------------------------

    async def write(self, blob: DirtyBlob, off: int, data: bytes) -> None:
        """Write ``data`` at ``off`` of ``blob``, or — when a reset drops ``blob`` while the
        write awaits — of the blob its name has then (``retried``)."""
        if blob.damaged:  # never written over: the user's data may still be recovered
            raise damaged_error(blob)
        handed = Handed(blob, writer=True)
        blob.writers += 1
        try:
            running = self.checkpoints.running
            if running is not None and self.checkpoints.over(2):
                await running.wait()  # back-pressure: memory and journal stay bounded
                self.move(handed)
            blob = handed.blob
            whole = off == 0 and blob.index is not None and len(data) == blob.size
            if whole or not self._fast(blob, off, data):
                await self.retried(handed, lambda b: self._attempt(b, off, data, whole))
            self.stats.add("writes")
            self.stats.add("bytes_written", len(data))
            if whole:
                self.checkpoints.after_direct()
            else:
                self.checkpoints.after_write()
        except BaseException:
            self._drop_unwritten(handed.blob)
            raise
        finally:
            handed.blob.writers -= 1

    async def _attempt(self, blob: DirtyBlob, off: int, data: bytes, whole: bool) -> bool:
        if whole:
            return await self.locked(blob, lambda b: self._write_whole(b, data))
        return self._fast(blob, off, data) or await self.locked(
            blob, lambda b: self._write_locked(b, off, data))

    def _fast(self, blob: DirtyBlob, off: int, data: bytes) -> bool:
        """The common case, written at once: nothing to fault (or its fault runs behind the
        write) and nobody folding the blob. Nothing in it awaits, so no other task comes
        between (the lock would only cost its checkpoint). False, nothing done, else."""
        lock = blob.lock
        if (lock is None or not lock.locked()) and (
                not self.bases.unstaged(blob) or self.bases.behind(blob, off, len(data))):
            self._put_first(blob, off, data)
            return True
        return False

    async def _write_locked(self, blob: DirtyBlob, off: int, data: bytes) -> bool:
        """A partial write under ``blob``'s lock (a fold or another write holds it, or its
        base is faulted first); False, nothing written, when a reset dropped ``blob`` while
        the write waited for its base's fault."""
        whole = False
        if self.bases.unstaged(blob):
            if off == 0 and len(data) >= blob.size:
                whole = True  # a whole blob: no fault needed
            else:
                kept = await self.bases.stage(blob)
                now = self.now(blob)
                if now is not blob:  # the fault pinned the chunk: the base of the new one
                    self.bases.staged_for(blob, now, kept)
                    return False
                self.table.set_base_bytes(blob, kept)
        self._put_first(blob, off, data)
        if whole:  # only once the write is journaled: a refused one changes nothing
            self.table.set_new(blob)
        return True

    async def _write_whole(self, blob: DirtyBlob, data: bytes) -> bool:
        """A write of a whole chunk: its bytes become a direct file (no fault, nothing held
        in memory, no fold to copy them again), journaled by one small record naming it.
        Both are written inline, like an append (a pwrite into the page cache, in order)."""
        tag, seq = blob.tag.name, self.journal.next_seq
        try:
            digest = self.files.write_direct(tag, blob.name, data, seq)
        except OSError as exc:
            code = errno.ENOSPC if exc.errno in (errno.ENOSPC, errno.EDQUOT) else errno.EIO
            raise FaultfsError(f"writing {blob.name} of tag {tag} failed: {exc.strerror}",
                               code) from None
        try:
            got = self.append(KIND_BLOB, tag, blob.name, 0, len(data), digest=digest)
        except BaseException:
            try:  # no record names it: it is nothing (a crash here leaves it to the mount)
                self.files.delete_direct(tag, seq)
            except OSError:
                pass
            raise
        assert got == seq, "the journal handed out another seq than the file's"
        self.sync.unsynced.append((tag, seq))
        self.table.set_direct(blob, seq)
        return True

    def _put_first(self, blob: DirtyBlob, off: int, data: bytes) -> None:
        """``_put`` after this write pinned ``blob``'s staged base (or started its fault): a
        refused write (ENOSPC) lets the pin go again when nothing lies over that base."""
        try:
            self._put(blob, off, data)
        except BaseException:
            self.bases.refused(blob)
            raise

    def _put(self, blob: DirtyBlob, off: int, data: bytes) -> None:
        """Journal a write of ``blob`` and lay it over the blob (its lock held, or no await
        since the caller checked that nobody holds it)."""
        self.append(KIND_WRITE, blob.tag.name, blob.name, off, len(data), data)
        segment, pos, digest = self.journal.last_data
        held = data if type(data) is bytes else bytes(data)
        self.table.touch(blob)
        self.table.write(blob, off, Ref(segment, pos, len(held), digest, 0, len(held), held))

    def _drop_unwritten(self, blob: DirtyBlob) -> None:
        """A write of ``blob`` was refused: a chunk it left with nothing written to (it
        brought it into the table) is taken out again unless another write, a truncate or
        a fold holds it, so the chunk is clean again — never pinned, never folded into a
        dirty copy of the source's bytes that a new version of the source would not
        replace."""
        key = (blob.tag.id, blob.name)
        lock = blob.lock
        if (blob.writers == 1 and self.table.blobs.get(key) is blob and unwritten(blob)
                and (lock is None or not (lock.locked() or lock.statistics().tasks_waiting))):
            self.table.forget(key)

    # -- cuts --------------------------------------------------------------------------------

    async def zero(self, blob: DirtyBlob, off: int, length: int) -> None:
        """Zero bytes ``[off, off+length)`` of ``blob`` (a shrink of the view)."""

        async def change(blob: DirtyBlob) -> bool:
            self.append(KIND_ZERO, blob.tag.name, blob.name, off, length)
            if self.bases.unstaged(blob) and off == 0 and length >= blob.size:
                self.table.set_new(blob)  # zeroed whole: nothing of the source shows
            self.table.zero(blob, off, length)
            self.table.touch(blob)
            return True

        await self.retried(Handed(blob), lambda b: self.locked(b, change))

    async def resize(self, blob: DirtyBlob, size: int) -> None:
        """Give ``blob`` (a user blob's part) size ``size``."""

        async def change(blob: DirtyBlob) -> bool:
            self.append(KIND_SIZE, blob.tag.name, blob.name, 0, size)
            self.table.resize(blob, size)
            return True

        blob = await self.retried(Handed(blob), lambda b: self.locked(b, change))
        self.table.user_changed(blob)

    def append(self, kind: int, tag: str, name: str, off: int, length: int,
               data: bytes = b"", digest: int = 0) -> int:
        """Journal one change (inline: an append to the page cache is a few microseconds a
        KiB, and appends must stay in order)."""
        return append(self.journal, kind, tag, name, off, length, data, digest)


def append(journal: Journal, kind: int, tag: str, name: str, off: int, length: int,
           data: bytes = b"", digest: int = 0) -> int:
    """Append one record to ``journal``, its seq; ENOSPC (nothing appended) when the store
    has no room for it."""
    try:
        return journal.append(kind, tag, name, off, length, data, digest)
    except StoreFull:
        raise FaultfsError("the store has no room for the write", errno.ENOSPC) from None
