"""Checkpoints: every dirty blob folded into its dirty file, durably, then the journal let go;
and the bounds on memory and the journal that start one.

Invariants:
- A fold writes base + writes as a new dirty file (temp file, fsync, rename; the directory
  synced once per checkpoint) naming the last record it includes; a direct file with nothing
  over it is renamed instead (synced first), never copied. Writes and folds of one blob are
  serialised (its lock). A fold of a blob the table no longer holds (dropped by a reset or an
  unlink while the fold waited) writes nothing: its file would name a seq past the reset's
  void mark. A chunk nothing was written to is never folded into a dirty copy of its source.
- The journal is trimmed only below what every fold made durable: a blob that could not be
  folded (its base unreadable for a while) keeps the records after its dirty file, and the
  others' folds, the states and the trim below them stand. A damaged blob is never folded,
  and the segments holding its records are kept (``Damage.keep_segments``).
- Bytes in memory are bounded: past ``fold_bytes`` of held writes every write's bytes are let
  go (spilled: read back from the journal, verified). The journal and the next checkpoint's
  work are bounded: past ``journal_bytes`` on disk, ``MAX_RECORDS`` records since the last
  checkpoint, or blobs written since it whose sizes add up to ``FOLD_WORK`` times
  ``journal_bytes`` or that number ``FOLD_BLOBS``, a checkpoint starts; past twice that,
  writers wait for it. A checkpoint that failed is started again by writes no sooner than
  ``CHECKPOINT_RETRY_S`` later.
- A direct file whose blob left it is deleted only after the trim past its record; the dirty
  file of a blob a reset or an unlink dropped (``DirtyTable.doomed``) only after the states
  were saved without it (a mount before then finds it, and a replay drops it again), and
  not when a blob has its name again (a write since: its file is that blob's).
"""

from __future__ import annotations

import errno
import functools
import logging
import time

import trio

from faultfs.engine.tags import Tag
from faultfs.engine.writes.base import Bases
from faultfs.engine.writes.damage import Damage
from faultfs.engine.writes.reads import DirtyReads
from faultfs.engine.writes.state import TagStates
from faultfs.engine.writes.sync import GroupCommit
from faultfs.engine.writes.table import DIRECT, FOLDED, DirtyBlob, DirtyTable, unwritten
from faultfs.errors import FaultfsError
from faultfs.iopool import IoPool
from faultfs.stats import Stats
from faultfs.store.dirty import DirtyFiles
from faultfs.store.journal import Journal

log = logging.getLogger("faultfs.writes")
FOLD_BYTES = 64 << 20  # written bytes held in memory before they are spilled
JOURNAL_BYTES = 1 << 30  # journal bytes on disk before a checkpoint folds them
MAX_RECORDS = 1 << 17  # records since the last checkpoint before one (~180 B of memory each)
# blobs written since the last checkpoint whose sizes add up to this many journal bounds, or
# this many blobs, start the next (each fold is a whole blob and an fsync, ~5 ms here: an
# unmount waits for them). Not lower: with 4 KiB writes at random over a view of 8 GiB, a
# bound of 4 journals would fold 4 GiB per ~22 MiB written (4,096 of its 8,192 chunks are
# touched after ~5,700 writes); this one lets the journal fill first.
FOLD_WORK = 8
FOLD_BLOBS = 8192
CHECKPOINT_RETRY_S = 5.0  # after a failed checkpoint, writes start no other for this long
FOLD_AT_ONCE = 4  # blobs a checkpoint folds in parallel (each one fsync on the I/O pool)
DIRECT_FILES = 4096  # direct files not folded yet before a checkpoint renames them


class Checkpoints:
    """Folds, checkpoints and the bounds of a mount's writes; see the module docstring."""

    def __init__(self, table: DirtyTable, states: TagStates, damage: Damage, bases: Bases,
                 reads: DirtyReads, sync: GroupCommit, files: DirtyFiles, journal: Journal,
                 pool: IoPool, stats: Stats, *, fold_bytes: int, journal_bytes: int) -> None:
        self.table = table
        self.states = states
        self.damage = damage
        self.bases = bases
        self.reads = reads
        self.sync = sync
        self.files = files
        self.journal = journal
        self.pool = pool
        self.stats = stats
        self.fold_bytes = fold_bytes
        self.journal_bytes = journal_bytes
        self.nursery: trio.Nursery | None = None
        self.running: trio.Event | None = None  # set when the checkpoint under way ends
        self.kept_from = 1  # the first seq the journal keeps (none trimmed up to it yet)
        self._retry_at = 0.0  # a checkpoint that failed is started again no sooner than this
        self._deleting: set[tuple[str, str]] = set()  # dirty files (tag, name) being deleted
        self._deleted = trio.Event()  # ... set once they are gone

    # -- bounds ------------------------------------------------------------------------------

    def over(self, times: int) -> bool:
        """Whether memory or the journal is past ``times`` its bound (a checkpoint is due)."""
        journal, table = self.journal, self.table
        return (table.held > times * self.fold_bytes
                or journal.bytes_on_disk > times * self.journal_bytes
                or table.fold_work > times * FOLD_WORK * self.journal_bytes
                or len(table.touched) > times * FOLD_BLOBS
                or journal.next_seq - self.kept_from > times * MAX_RECORDS)

    def after_write(self) -> None:
        """A write was journaled: spill past the memory bound, start a checkpoint past the
        others."""
        if self.table.held > self.fold_bytes:
            self.spill()
        if self.over(1):
            self.start()

    def after_direct(self) -> None:
        """A chunk was written whole: past ``DIRECT_FILES`` of those, a checkpoint renames
        them."""
        if self.table.direct_count > DIRECT_FILES:
            self.start()

    def spill(self) -> None:
        """Let go of the bytes of every write held in memory: the journal has them."""
        let_go = self.table.spill()
        if let_go:
            self.stats.add("spills")
            self.stats.add("spilled_bytes", let_go)

    def start(self) -> None:
        """Start a checkpoint behind the caller (in the mount's nursery), unless one runs or
        one failed a moment ago."""
        if (self.running is None and self.nursery is not None
                and time.monotonic() >= self._retry_at):
            self.nursery.start_soon(self.checkpoint)

    # -- checkpoints -------------------------------------------------------------------------

    async def checkpoint(self) -> None:
        """Fold every dirty blob with writes in memory into its file, durably, then let the
        journal go up to there. Writers of a blob wait while it is folded."""
        if self.running is not None:
            await self.running.wait()
            return
        done = self.running = trio.Event()
        try:
            self.journal.roll()  # here, where appends happen: records after go to the next
            self.table.untouch_all()  # written from here on: the next checkpoint's work
            await self.sync.sync()  # folded or not, the records (and direct files) are durable
            through = self.journal.last_seq
            failed = await self.fold_all([b for b in self.table if b.pending
                                          or b.base is not FOLDED or b.size != b.folded_size])
            # (a copy: a clone adds its tag while the saves await; one forgotten meanwhile
            # has left ``changed``)
            doomed = len(self.table.doomed)  # files the saves below drop (more may come)
            unsaved = set(self.states.unsaved)
            for tag_id in list(self.states.tags):
                # a tag nothing was written to keeps no state
                if tag_id in self.table.changed or tag_id in unsaved:
                    await self.states.save(tag_id)
            self.states.unsaved -= unsaved
            # a blob that could not be folded keeps every record after its dirty file's (the
            # others' folds, the states and the trim below them stand: one unreadable base
            # never holds the whole journal)
            through = min([through, *(blob.folded_seq for blob, _ in failed)])
            # a damaged blob's records (no fold took them) are kept, not deleted
            keep = self.damage.keep_segments
            kept = await self.pool.run(functools.partial(
                self.journal.trim, through, keep=frozenset(keep)))
            keep -= kept
            self.kept_from = max(self.kept_from, through + 1)
            # no record at or below ``through`` can be replayed now (trimmed, or its blob's
            # durable file names a later seq): direct files they named may go
            table = self.table
            gone = [(t, q) for t, q in table.obsolete if q <= through]
            table.obsolete = [(t, q) for t, q in table.obsolete if q > through]
            await self.pool.run(self.delete_direct, gone)
            gone_files, self.table.doomed = (self.table.doomed[:doomed],
                                             self.table.doomed[doomed:])
            await self._delete_doomed(gone_files)
            self.stats.add("checkpoints")
            if failed:
                blob, exc = failed[0]
                raise FaultfsError(f"{len(failed)} dirty blob(s) not folded, kept in the "
                                   f"journal (first: {blob.name} of tag {blob.tag.name}: "
                                   f"{exc.message})", exc.errno)
        except FaultfsError as exc:
            self._retry_at = time.monotonic() + CHECKPOINT_RETRY_S
            log.error("checkpoint of the writes failed (kept in the journal): %s", exc)
        except Exception:  # a background task must never take the mount down
            self._retry_at = time.monotonic() + CHECKPOINT_RETRY_S
            log.exception("checkpoint of the writes failed (kept in the journal)")
        finally:
            self.running = None
            done.set()

    async def fold_all(self, blobs: list[DirtyBlob]) -> list[tuple[DirtyBlob, FaultfsError]]:
        """Fold ``blobs``, ``FOLD_AT_ONCE`` at a time, then sync each directory they were
        renamed into once (the journal is trimmed only after): a checkpoint of 64 blobs
        costs 64 file fsyncs in parallel and one directory fsync, not 128 in a row. The
        blobs that could not be folded (their base could not be read, say), with why."""
        limiter = trio.CapacityLimiter(FOLD_AT_ONCE)
        failures: list[tuple[DirtyBlob, FaultfsError]] = []
        folded: set[str] = set()

        async def one(blob: DirtyBlob) -> None:
            if blob.damaged:
                return  # never written over (its tag's state names it: see ``Damage``)
            async with limiter:
                try:
                    await self.fold(blob, sync_dir=False)
                except FaultfsError as exc:
                    # found so now: kept like the others (above)
                    if not blob.damaged and not await self.bases.lost(blob):
                        failures.append((blob, exc))
                else:
                    folded.add(blob.tag.name)

        async with trio.open_nursery() as nursery:
            for blob in blobs:
                nursery.start_soon(one, blob)
        try:
            await self.pool.run(self.files.sync_dirs, sorted(folded))
        except OSError as exc:
            raise FaultfsError(f"syncing the folded writes failed: {exc.strerror}") from None
        return failures

    async def fold_tag(self, tag: Tag) -> None:
        """Fold every dirty blob of ``tag`` (durably); the first failure, raised."""
        failed = await self.fold_all(self.table.of_tag(tag.id))
        if failed:
            raise failed[0][1]

    async def _delete_doomed(self, doomed: list[tuple[str, str]]) -> None:
        """Delete the dirty files of dropped blobs whose names no blob has again. The names
        are checked here, on the loop's thread (the table changes under a thread that walks
        it); a fold of a blob that takes such a name meanwhile waits until its file is gone,
        so a deletion never removes the new blob's file."""
        live = {(b.tag.name, b.name) for b in self.table}
        doomed = [d for d in doomed if d not in live]
        if not doomed:
            return
        self._deleting, done = set(doomed), trio.Event()
        self._deleted = done
        try:
            await self.pool.run(self._delete_files, doomed)
        finally:
            self._deleting = set()
            done.set()

    def _delete_files(self, doomed: list[tuple[str, str]]) -> None:
        for tag, name in doomed:
            try:
                self.files.delete(tag, name)
            except OSError as exc:  # left behind: void at the next mount, which dooms it again
                log.warning("deleting dirty file %s of tag %s failed: %s", name, tag,
                            exc.strerror)

    def delete_direct(self, gone: list[tuple[str, int]]) -> None:
        for tag, seq in gone:
            try:
                self.files.delete_direct(tag, seq)
            except OSError as exc:  # left behind: the next mount finds it unused
                log.warning("deleting direct file %d of tag %s failed: %s", seq, tag,
                            exc.strerror)

    async def fold(self, blob: DirtyBlob, *, sync_dir: bool = True) -> None:
        async with blob.locked():
            if self.table.blobs.get((blob.tag.id, blob.name)) is not blob:
                # dropped while the fold waited (a reset, an unlink): written back, its file
                # would name a seq past the reset's void mark, and a mount would load it
                return
            if not blob.pending and blob.base is FOLDED and blob.size == blob.folded_size:
                return
            if unwritten(blob):
                return  # nothing was written to it: no dirty copy of its source chunk
            while (blob.tag.name, blob.name) in self._deleting:  # a dropped blob's file
                await self._deleted.wait()
            if not blob.pending and blob.base is DIRECT:
                await self._adopt(blob, sync_dir=sync_dir)
                return
            seq = self.journal.last_seq
            data = await self.reads.read_whole(blob)
            try:
                await self.pool.run(lambda: self.files.write(blob.tag.name, blob.name, data, seq,
                                                             sync_dir=sync_dir))
            except OSError as exc:
                code = errno.ENOSPC if exc.errno in (errno.ENOSPC, errno.EDQUOT) else errno.EIO
                raise FaultfsError(f"folding {blob.name} of tag {blob.tag.name} failed: "
                                   f"{exc.strerror}", code) from None
            self.table.set_folded(blob, seq, len(data))
            self.stats.add("folds")

    async def _adopt(self, blob: DirtyBlob, *, sync_dir: bool) -> None:
        """Fold a direct file with nothing over it: rename it to the blob's dirty file (it
        must be synced first: a rename never makes an unsynced file the blob's)."""
        tag, seq = blob.tag.name, blob.direct
        if (tag, seq) in self.sync.unsynced or self.sync.syncing.locked():
            await self.sync.sync()  # (a sync under way may hold it: wait for that one too)

        def rename() -> None:
            self.files.adopt_direct(tag, blob.name, seq)
            if sync_dir:
                self.files.sync_dirs([tag])

        try:
            await self.pool.run(rename)
        except OSError as exc:
            raise FaultfsError(f"folding {blob.name} of tag {tag} failed: {exc.strerror}",
                               errno.EIO) from None
        self.table.set_folded(blob, seq, blob.size, renamed=True)
        self.stats.add("folds")

    async def close(self) -> None:
        """Unmount: everything written is folded and durable."""
        await self.checkpoint()
        await self.sync.sync()
        self.journal.close()

    def forget_tag(self, name: str) -> None:
        """Tag ``name`` is forgotten: its direct files go with its directory."""
        self.table.obsolete = [(t, q) for t, q in self.table.obsolete if t != name]
