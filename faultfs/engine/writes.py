"""Writes: copy-on-write over the read-only source (DESIGN §11, §12).

A written blob is *dirty*: its bytes are a base — the clean chunk (staged, pinned), a dirty
file of its own (``store/dirty.py``), a direct file (a write that covered the whole chunk,
written as a file of its own and journaled as one small record), or nothing (a new blob) —
with the writes since its last fold laid over it (an ``ExtentMap`` in memory, each write
also a journal record). A fold writes base + writes as a new dirty file (a direct file with
nothing over it is renamed, not copied) and lets the journal go.

Invariants:
- A write is acknowledged only after its journal record (and a whole-chunk write's direct
  file before it) was written (it survives a kill -9 of the daemon); ``fsync`` makes every
  acknowledged write durable (direct files, then the journal); unmount folds everything
  durably. After any crash each blob is the result of a prefix of its acknowledged writes
  that includes every write before the last completed ``fsync`` (the journal replays in
  order and stops at the first record that does not verify; a dirty file names the last
  record it includes; a direct file that does not verify ends the replay at its record).
- A direct file is deleted only once no record that names it can be replayed: after the
  checkpoint that trimmed the journal past it, or a reset of its blob (durable first).
- The source is never written. A partial write of a chunk that is not staged issues its
  fault (the size-0 request) before it is answered; a write of a whole chunk does not. The
  write waits for neither the fault (it runs behind, ``BASE_FAULTS`` at once; past that the
  write waits) nor the faulted chunk's store write: the base is the source's bytes either
  way, read through the clean path until it is staged and pinned; one the store could not
  keep is clean bytes that a later read faults again (docs/decisions.md).
- Dirty data is never evicted, never replaced by a fault and never re-faulted: a damaged
  dirty file is EIO and is kept. So is a blob whose spilled write no longer verifies in the
  journal: its tag's write state names it at once (durably), folds skip it, the segments
  holding its records (and its direct file) go to ``writes/damaged/`` when the journal lets
  go instead of being deleted, so every other blob is folded and the journal still trims;
  a reset drops it. A replay that stops early keeps what follows (``journal.py``).
- Writes and folds of one blob are serialised (its lock); a read takes the base and the
  writes it sees in one step, so it never mixes two states of a blob. A fold of a blob the
  tables no longer hold (dropped by a reset or an unlink while the fold waited) writes
  nothing: its file would name a seq past the reset's void mark. A write or truncate
  that awaited (back-pressure, the lock, the base's fault) goes on with the blob the tables
  have for its name then (``_now``): a reset may have dropped the one it was handed, and
  its record, past the void mark, is laid over the reset at a replay.
- Bytes in memory are bounded: past ``fold_bytes`` of held writes, every write's bytes are
  let go (*spilled*: the extent keeps where its record's data lies in the journal, and reads
  read them back from there, verified). What a spill cannot let go of (the data of records
  over ``SPILL_RECORD``, whose checksum covers too much to read back per read) is folded.
- The journal and the work of the next checkpoint are bounded: past ``journal_bytes`` on
  disk, ``MAX_RECORDS`` records since the last checkpoint, or blobs written since it whose
  sizes add up to ``FOLD_WORK`` times ``journal_bytes`` or that number ``FOLD_BLOBS`` (what
  the checkpoint — and so an unmount — rewrites), a checkpoint folds every dirty blob and
  trims the journal; past twice that, writers wait for it. A fold rewrites a whole blob, so
  the writes a blob gets between two checkpoints are what its rewrite is shared by (a
  checkpoint per ``fold_bytes`` of writes cost 16x their bytes in folds with a 1 GiB view
  written at random, and two thirds of the write rate). A checkpoint that failed is started
  again by writes no sooner than ``CHECKPOINT_RETRY_S`` later.
- A spilled extent is read back only from a segment that is still there: a read that finds
  its segment trimmed (the blob folded meanwhile) takes the blob's new state.
- A reset takes its blobs out of the tables with its void mark, before anything awaits; while
  it saves its tag's state, the tag's other state saves and user blob table changes wait, and
  no checkpoint runs. One whose save fails changes nothing: what it changed is put back, and
  its blobs return with what was written to their names meanwhile laid over them, as a
  replay applies their records (``_undo_reset``).
- A clone is its tag at one instant (``prepare_clone``): every change of a tag — a write
  (through the view or a page: whole), a truncate, a user blob's create, unlink or rename,
  a reset — is one change (``one_change``, ``engine/changes.py``). The clone folds the
  tag's blobs while it is written, then holds it still — its new changes wait before they
  start, those under way end — folds what was written meanwhile, links the files, copies
  the state (reset marks too) and lets go. Writers of the tag wait for those folds, the
  links and one state file, never for the first folds, and never while holding a lock.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Protocol

import trio

from faultfs.core.chunks import pieces
from faultfs.core.extents import ExtentMap, Ref, lay, spilled
from faultfs.core.names import PAGE_PREFIX, PAGEMAP_NAME, check_name, parse_index
from faultfs.engine.changes import TagChanges, one_change
from faultfs.engine.tags import Tag
from faultfs.errors import CorruptionError, FaultfsError, StoreFull
from faultfs.iopool import IoPool
from faultfs.stats import Stats
from faultfs.store.blobfile import MAX_PAYLOAD
from faultfs.store.dirty import DirtyFiles, folded_seq
from faultfs.store.fileops import FileOps
from faultfs.store.journal import (
    KIND_BLOB,
    KIND_SIZE,
    KIND_WRITE,
    KIND_ZERO,
    Journal,
    Record,
    SegmentGone,
)
from faultfs.store.writestate import WriteState
from faultfs.tiers.base import Buffer

log = logging.getLogger("faultfs.writes")
USER_BLOB_MAX = MAX_PAYLOAD  # a user blob is one dirty file: no longer than any blob

CLEAN, FOLDED, NEW, DIRECT = "clean", "folded", "new", "direct"  # what a dirty blob's base is
USER_PREFIX = "u:"  # dirty files of user blobs are named by id: a rename is a table update
USER_PART = 1 << 20  # a user blob is cut into dirty blobs of this size: u:<id>, u:<id>.1, ...
MAX_GROWN = 1 << 44  # a view or user blob grows to 16 TiB at most (ext4's largest file)
GAP_PREFIX = ".pagegap."  # bytes written into the gaps of page N (hidden, never listed)
FOLD_BYTES = 64 << 20  # written bytes held in memory before they are spilled
JOURNAL_BYTES = 1 << 30  # journal bytes on disk before a checkpoint folds them
MAX_RECORDS = 1 << 17  # records since the last checkpoint before one (~180 B of memory each)
SPILL_RECORD = 1 << 20  # data of records up to this is spilled; longer ones are folded
# blobs written since the last checkpoint whose sizes add up to this many journal bounds, or
# this many blobs, start the next (each fold is a whole blob and an fsync, ~5 ms here: an
# unmount waits for them). Not lower: with 4 KiB writes at random over a view of 8 GiB, a
# bound of 4 journals would fold 4 GiB per ~22 MiB written (4,096 of its 8,192 chunks are
# touched after ~5,700 writes); this one lets the journal fill first.
FOLD_WORK = 8
FOLD_BLOBS = 8192
CHECKPOINT_RETRY_S = 5.0  # after a failed checkpoint, writes start no other for this long
FOLD_AT_ONCE = 4  # blobs a checkpoint folds in parallel (each one fsync on the I/O pool)
SYNC_AT_ONCE = 8  # direct files an fsync syncs in parallel (the file system batches them)
BASE_FAULTS = 16  # size-0 requests at once behind the writes that issued them
DIRECT_FILES = 4096  # direct files not folded yet before a checkpoint renames them
VIEW = ""  # the journal's name for a tag's whole-object view (its size records)


class CleanReads(Protocol):
    """What writes need of the engine's clean path."""

    async def read_clean(self, tag: Tag, index: int, off: int, size: int) -> Buffer: ...

    async def stage_clean(self, tag: Tag, index: int) -> Buffer | None:
        """Fault chunk ``index`` if needed and pin its staged copy; its bytes when it could
        not be kept in the store (the caller then holds them)."""
        ...

    def pin_staged(self, tag: Tag, index: int) -> bool:
        """Pin chunk ``index``'s staged copy when there is one (nothing awaited)."""
        ...

    def pin(self, tag: Tag, index: int) -> None:
        """Pin chunk ``index``'s staged copy, now or whenever a fault stores it."""
        ...

    def unpin(self, tag: Tag, index: int) -> None: ...


@dataclass(eq=False)
class DirtyBlob:
    tag: Tag
    name: str  # its name in the journal and the dirty files: a chunk's, "u:<id>", ".pagegap.N"
    index: int | None  # a chunk's index
    size: int  # payload bytes
    base: str  # CLEAN, FOLDED, NEW or DIRECT
    folded_seq: int = 0  # the last journal record its dirty file includes
    folded_size: int = -1  # FOLDED: its dirty file's payload length (a resize changes size)
    direct: int = 0  # DIRECT: the seq of its direct file (and of the record naming it)
    pending: ExtentMap = field(default_factory=ExtentMap)
    base_bytes: Buffer | None = None  # a clean base the store could not keep
    lock: trio.Lock | None = None
    damaged: str = ""  # its dirty file cannot be read: reads and writes of it fail (EIO)
    writers: int = 0  # writes of it under way (a refused one lets go of a blob none holds)
    cut: int = -1  # the smallest size a resize gave it, -1: none (``_merged``: what shows of
    # the blob a failed reset put back beneath it)

    def locked(self) -> _Holding:
        if self.lock is None:
            self.lock = trio.Lock()
        return _Holding(self.lock)


class _Holding:
    """``async with`` a lock that takes it at once when it is free: trio's ``acquire``
    passes through the scheduler even then, a few times per write."""

    __slots__ = ("lock",)

    def __init__(self, lock: trio.Lock) -> None:
        self.lock = lock

    async def __aenter__(self) -> None:
        try:
            self.lock.acquire_nowait()
        except trio.WouldBlock:
            await self.lock.acquire()

    async def __aexit__(self, *exc: object) -> None:
        self.lock.release()


@dataclass
class TagWrites(WriteState):
    """What a tag's writes changed beyond its blobs (``store/writestate.py``: the view's
    size, the user blobs ...), and what a mount keeps of it in memory only."""

    damaged: str = ""  # why its write state could not be read: it takes no writes
    view_changes: int = 0  # (in memory) sizes set since the mount: a failed reset keeps a new one


class Writes:
    """The dirty blobs of an engine's tags; see the module docstring for the rules."""

    def __init__(self, root: str, clean: CleanReads, pool: IoPool, stats: Stats, *,
                 writable: bool, fold_bytes: int = FOLD_BYTES,
                 journal_bytes: int = JOURNAL_BYTES, ops: FileOps | None = None) -> None:
        self.clean = clean
        self.pool = pool
        self.stats = stats
        self.writable = writable  # False: --read-only, --no-store, a degraded store
        self.fold_bytes = fold_bytes
        self.journal_bytes = journal_bytes
        self.files = DirtyFiles(root, ops, writable=writable)
        self.journal = Journal(os.path.join(self.files.root, "journal"), ops)
        self.blobs: dict[tuple[int, str], DirtyBlob] = {}
        # (tag id, user blob id) -> its dirty blobs by part; and its size, when known
        self._parts: dict[tuple[int, int], dict[int, DirtyBlob]] = {}
        self._user_sizes: dict[tuple[int, int], int] = {}
        self.user_part = USER_PART  # (the writes model cuts smaller parts: few KiB test it all)
        self.tags: dict[int, TagWrites] = {}
        self._names: dict[int, str] = {}  # tag id -> name, for the state files
        self.changed: set[int] = set()  # ids of tags with writes: their views take this path
        # told (synchronously) each time a tag joins ``changed``, before the change is seen:
        # a reader of its own that skips the engine stops serving the tag's clean bytes
        self.on_change: Callable[[int], None] | None = None
        self.held = 0  # bytes of writes held in memory (ExtentMap.held summed)
        self._kept_from = 1  # the first seq the journal keeps (none trimmed up to it yet)
        self._retry_at = 0.0  # a checkpoint that failed is started again no sooner than this
        self._touched: set[tuple[int, str]] = set()  # blobs written since the last checkpoint
        self._fold_work = 0  # their sizes: what the next checkpoint rewrites, about
        self._nursery: trio.Nursery | None = None
        self._base_faults = 0  # size-0 requests running behind the writes that issued them
        self._checkpointing: trio.Event | None = None
        self._direct_count = 0  # blobs whose base is a direct file
        self._unsynced: list[tuple[str, int]] = []  # (tag, seq) of direct files not synced yet
        self._obsolete: list[tuple[str, int]] = []  # (tag, seq) of direct files to delete
        self._syncing = trio.Lock()  # fsyncs one at a time: each covers what came before it
        # every record below this seq (and every direct file it names) was made durable by
        # a sync that succeeded: an fsync that waited behind that sync has nothing left to do
        self._synced_below = 0
        self._keep_segments: set[int] = set()  # hold a damaged blob's records: kept at a trim
        # a tag's state saves one at a time, and a reset and the user blob table's changes
        # hold it for the whole change (a save made meanwhile would write a reset's void
        # marks, durably, while the reset could still fail and put its blobs back)
        self._state_locks: dict[int, trio.Lock] = {}
        self._resets = 0  # resets under way: a checkpoint waits for them (``reset``)
        self._resets_over: trio.Event | None = None
        # every change of a tag is one (``one_change``): a clone holds its tag still
        self.changes = TagChanges()

    # -- recovery (blocking, before the mount answers) ---------------------------------------

    def open_tag(self, tag: Tag) -> None:
        """Bring back what the store remembers of ``tag``'s writes (dirty files, state). A
        damaged write state is kept and reported: the tag's dirty files still read, but the
        tag takes no writes (they would replace the state) until ``faultfs fsck`` is run."""
        try:
            doc = self.files.read_state(tag.name)
            try:
                tw = TagWrites.parse(doc, tag.layout.size)
            except CorruptionError as exc:  # as fsck says it (``store/writestate.py``)
                raise CorruptionError(f"write state of {tag.name}: {exc.message}") from None
        except CorruptionError as exc:
            log.error("tag %s: %s: kept; the tag's writes read, new writes are refused",
                      tag.name, exc)
            tw = TagWrites(view_size=tag.layout.size, damaged=exc.message)
        self.tags[tag.id] = tw
        self._names[tag.id] = tag.name
        # seqs the state names (a reset's void marks, the view's size) are never handed out
        # again, also when a power loss took the journal's records up to them
        self.journal.advance(max(tw.voided, tw.view_seq, *tw.voided_blobs.values()))
        if tw.view_size != tag.layout.size or tw.users:
            self._mark_changed(tag.id)
        ids = set(tw.users.values())
        for name, mark in list(tw.damaged_blobs.items()):
            user = user_key(name)
            if name.startswith(USER_PREFIX) and (user is None or user[0] not in ids):
                del tw.damaged_blobs[name]  # unlinked since: nothing to keep
                continue
            log.error("tag %s: dirty blob %s is damaged (%s): kept, reads of it fail with EIO "
                      "until faultfs reset drops its writes", tag.name, name, mark["reason"])
            try:  # its older file (kept, unused) still names a seq: never handed out again
                older = self.files.header(tag.name, name, tw.ancestors)
            except CorruptionError:
                older = None
            if older is not None:
                self.journal.advance(folded_seq(older))
            self._add(DirtyBlob(tag, name, self._chunk_index(tag, name), mark["size"], FOLDED,
                                1 << 62, folded_size=mark["size"], damaged=mark["reason"]))
        for name in self.files.names(tag.name):
            if name in tw.damaged_blobs:
                continue
            try:
                header = self.files.header(tag.name, name, tw.ancestors)
            except CorruptionError as exc:
                log.error("tag %s: %s: kept, reads of it fail with EIO", tag.name, exc)
                index = self._chunk_index(tag, name)
                size = tag.layout.chunk_size if index is not None else 0
                self._add(DirtyBlob(tag, name, index, size, FOLDED, 1 << 62, folded_size=size,
                                    damaged=exc.message))
                continue
            assert header is not None
            seq = folded_seq(header)
            user = user_key(name)
            if name.startswith(USER_PREFIX) and (user is None or user[0] not in ids):
                continue  # unlinked (the table says so): its file is removed at the next fold
            if seq <= max(tw.voided, tw.voided_blobs.get(void_key(name), 0)):
                continue  # reset
            self.journal.advance(seq)
            self._add(DirtyBlob(tag, name, self._chunk_index(tag, name), header.payload_len,
                                FOLDED, seq, folded_size=header.payload_len))

    def replay(self, tags: dict[str, Tag]) -> int:
        """Apply the journal's records after each blob's dirty file; the records applied.
        A whole-chunk record whose direct file does not verify (a power loss before it was
        synced) ends the replay there, like a torn record."""
        applied = 0
        first: int | None = None

        def accept(rec: Record) -> bool:
            """A whole-chunk record that will be applied needs its file, whole."""
            if rec.kind != KIND_BLOB:
                return True
            tag = tags.get(rec.tag)
            if tag is None or tag.id not in self.tags or self._chunk_index(tag, rec.name) is None:
                return True  # not applied: whether its file is there does not matter
            tw = self.tags[tag.id]
            blob = self.blobs.get((tag.id, rec.name))
            if rec.seq <= max(tw.voided, tw.voided_blobs.get(rec.name, 0),
                              0 if blob is None else blob.folded_seq):
                return True
            return self.files.check_direct(tag.name, rec.name, rec.seq, rec.length, rec.digest)

        def set_aside(blobs: list[tuple[str, int]]) -> None:
            """The whole-chunk records the replay keeps aside: their files go with them (no
            record on disk names them now; a live blob's file stays)."""
            used = {(b.tag.name, b.direct) for b in self.blobs.values() if b.base == DIRECT}
            for tag_name, seq in blobs:
                if tag_name in tags and (tag_name, seq) not in used:
                    self.files.set_aside_direct(tag_name, seq, self.journal.damaged_dir)

        def unused(rec: Record) -> bool:
            """A write whose data does not verify may be passed over when nothing would use
            it: its blob is known damaged, reset since, or gone."""
            return self._damaged_blob(tags, rec) is not None or self._void(tags, rec)

        for rec in self.journal.replay(writable=self.writable, accept=accept,
                                       set_aside=set_aside, damaged=unused):
            first = rec.seq if first is None else first
            kept = self._damaged_blob(tags, rec)
            if kept is not None:  # a damaged blob's record: kept with its segment, not used
                self._keep_segments.add(rec.segment)
                if rec.kind == KIND_BLOB and self.writable:  # and its file, with them
                    self.files.set_aside_direct(kept.tag.name, rec.seq,
                                                self.journal.damaged_dir)
                continue
            if rec.bad_data:
                continue  # void (``unused``): nothing reads it
            found = self._replayed(tags, rec)
            if found is None:
                continue
            tag, blob = found
            if blob is None:
                self._set_view_size(tag, self.tags[tag.id], rec.length)
            else:
                self._apply(blob, rec)
            applied += 1
        self._kept_from = self.journal.next_seq if first is None else first
        aside = self.journal.set_aside
        if aside is not None:
            log.error("the write journal does not verify at byte %d of %s (%s): the %d "
                      "records after it that verify were not replayed; they are kept in %s "
                      "(faultfs fsck lists them)", aside.pos, aside.segment, aside.reason,
                      aside.records, self.journal.damaged_dir)
        self._sort_direct_files(tags)
        return applied

    def _void(self, tags: dict[str, Tag], rec: Record) -> bool:
        """Whether a replay would use nothing of ``rec`` (no side effects, unlike
        ``_replayed``): its tag is not mounted, it was reset, folded already, or its user
        blob was unlinked."""
        tag = tags.get(rec.tag)
        if tag is None or tag.id not in self.tags:
            return True
        tw = self.tags[tag.id]
        if rec.seq <= max(tw.voided, tw.voided_blobs.get(void_key(rec.name), 0)):
            return True
        user = user_key(rec.name)
        if rec.name.startswith(USER_PREFIX) and (user is None or
                                                 user[0] not in set(tw.users.values())):
            return True
        blob = self.blobs.get((tag.id, rec.name))
        return blob is not None and rec.seq <= blob.folded_seq

    def _damaged_blob(self, tags: dict[str, Tag], rec: Record) -> DirtyBlob | None:
        tag = tags.get(rec.tag)
        blob = None if tag is None else self.blobs.get((tag.id, rec.name))
        return blob if blob is not None and blob.damaged else None

    def _note_damaged(self, blob: DirtyBlob, why: str) -> None:
        """``_mark_damaged`` in memory; the caller saves the tag's write state."""
        blob.damaged = why
        tw = self.tags[blob.tag.id]
        tw.damaged_blobs[blob.name] = {"reason": why, "size": blob.size}
        self._mark_changed(blob.tag.id)
        self._keep_segments.update(d.file for _, _, d in blob.pending.items() if isinstance(d, Ref))
        log.error("dirty blob %s of tag %s is damaged (%s): kept, reads of it fail with EIO "
                  "until faultfs reset drops its writes", blob.name, blob.tag.name, why)

    def check_bases(self) -> None:
        """After the replay (blocking, before the tags' new source versions are recorded): a
        chunk whose replayed writes lie over the source's bytes of the last mount, when the
        source changed since, is damaged (kept, EIO; saved now) — never its writes laid over
        the new version. The staged bases of the others are pinned again."""
        hit: set[int] = set()
        for blob in list(self.blobs.values()):
            if blob.base != CLEAN or blob.index is None or blob.damaged:
                continue
            tag = blob.tag
            why = self._lost_base(blob, f"{tag.name}'s source is not the version of the last "
                                        "mount" if tag.source_changed else "")
            if why:
                self._note_damaged(blob, why)
                hit.add(tag.id)
            else:
                self.clean.pin(tag, blob.index)
        for tag_id in sorted(hit):
            tw = self.tags[tag_id]
            if not tw.damaged:
                try:
                    self.files.write_state(self._names[tag_id], tw.saved())
                except OSError as exc:  # the next checkpoint saves it again
                    log.error("keeping the damaged blobs of tag %s: %s", self._names[tag_id],
                              exc.strerror)

    async def _mark_damaged(self, blob: DirtyBlob, why: str) -> None:
        """``blob``'s writes cannot be read back: it reads and takes writes as EIO, is never
        folded or written over, and stays so across mounts — its tag's write state names it
        (saved now), the segments holding its records and its direct file are kept in
        writes/damaged/ when the journal lets them go — until a reset drops it."""
        if blob.damaged:
            return
        self._note_damaged(blob, why)
        try:
            await self._save_state(blob.tag)  # first: a kill after it knows the blob damaged
            if blob.base == DIRECT:  # as a remount will see it: no direct file under it
                self._direct_count -= 1
                seq, blob.base, blob.direct = blob.direct, FOLDED, 0
                await self.pool.run(self.files.set_aside_direct, blob.tag.name, seq,
                                    self.journal.damaged_dir)
        except (OSError, FaultfsError) as exc:  # the next checkpoint saves it again
            log.error("keeping damaged blob %s of tag %s: %s", blob.name, blob.tag.name, exc)

    def _replayed(self, tags: dict[str, Tag], rec: Record) -> tuple[Tag, DirtyBlob | None] | None:
        """What record ``rec`` changes at a replay — its tag and blob (None: the view's size)
        — or None when it is void, folded already, or names nothing mounted."""
        tag = tags.get(rec.tag)
        if tag is None or tag.id not in self.tags:
            return None
        tw = self.tags[tag.id]
        if rec.seq <= tw.voided:
            return None
        if rec.kind == KIND_SIZE and rec.name == VIEW:
            return (tag, None) if rec.seq > tw.view_seq else None
        if rec.seq <= tw.voided_blobs.get(void_key(rec.name), 0):
            return None
        if rec.kind == KIND_BLOB and self._chunk_index(tag, rec.name) is None:
            return None  # only chunks are written so; never a record of ours otherwise
        blob = self._blob_for(tag, rec.name, create=True)
        if blob is None or rec.seq <= blob.folded_seq:
            return None
        return tag, blob

    def _sort_direct_files(self, tags: dict[str, Tag]) -> None:
        """After a replay: direct files no blob uses are deleted — at once when no record on
        disk can name them (past the journal's end), else after the next checkpoint trims
        the journal (a replay before then would look for them)."""
        if not self.writable:
            return
        used = {(b.tag.name, b.direct) for b in self.blobs.values() if b.base == DIRECT}
        for tag in tags.values():
            if tag.id not in self.tags:
                continue
            for seq in self.files.direct_seqs(tag.name):
                if (tag.name, seq) in used:
                    continue
                if seq >= self.journal.next_seq:
                    self.files.delete_direct(tag.name, seq)
                else:
                    self._obsolete.append((tag.name, seq))

    def needs_checkpoint(self) -> bool:
        """Whether the writes found at mount should be folded now (a replay left some)."""
        return bool(self.held or self._direct_count or self._obsolete
                    or any(b.pending for b in self.blobs.values()))

    def _apply(self, blob: DirtyBlob, rec: Record) -> None:
        before = blob.pending.held
        self._user_changed(blob)
        self._touch(blob)
        if rec.kind == KIND_BLOB:  # its file verified (``replay``): the blob is that file
            self._set_direct(blob, rec.seq)
            # after a kill -9 it may be in the page cache only: the next sync (an fsync, the
            # checkpoint before it is renamed) must make it durable like one written now
            self._unsynced.append((blob.tag.name, rec.seq))
        elif rec.kind == KIND_WRITE:  # read back from the journal when it is read
            blob.pending.write(rec.off, rec.data if rec.length > SPILL_RECORD else Ref(
                rec.segment, rec.data_pos, rec.length, rec.data_digest, 0, rec.length, None))
            blob.size = max(blob.size, rec.off + rec.length) if blob.index is None else blob.size
        elif rec.kind == KIND_ZERO:
            blob.pending.zero(rec.off, rec.length)
        else:  # KIND_SIZE of a user blob
            self._resize(blob, rec.length)
        self.held += blob.pending.held - before

    # -- queries -----------------------------------------------------------------------------

    def view_size(self, tag: Tag) -> int:
        tw = self.tags.get(tag.id)
        return tag.layout.size if tw is None else tw.view_size

    def num_chunks(self, tag: Tag) -> int:
        """Chunks of the tag: the source's, and those the view grew past it."""
        cs = tag.layout.chunk_size
        return max(tag.layout.num_blobs, -(-self.view_size(tag) // cs))

    def is_dirty(self, tag: Tag, index: int) -> bool:
        return bool(self.blobs) and (tag.id, tag.layout.blob_name(index)) in self.blobs

    def touches(self, tag: Tag, index: int) -> bool:
        """Whether a read of chunk ``index`` is the writes' (dirty, or past the source)."""
        return index >= tag.layout.num_blobs or self.is_dirty(tag, index)  # cheap when clean

    def mtime_ns(self, tag: Tag) -> int:
        tw = self.tags.get(tag.id)
        return 0 if tw is None else tw.mtime_ns

    def user_names(self, tag: Tag) -> list[str]:
        tw = self.tags.get(tag.id)
        return [] if tw is None else sorted(n for n in tw.users if not n.startswith("."))

    def user_id(self, tag: Tag, name: str) -> int | None:
        tw = self.tags.get(tag.id)
        return None if tw is None else tw.users.get(name)

    def user_name(self, tag: Tag, uid: int) -> str | None:
        tw = self.tags.get(tag.id)
        if tw is None:
            return None
        return next((n for n, i in tw.users.items() if i == uid), None)

    def user_size(self, tag: Tag, name: str) -> int:
        uid = self.user_id(tag, name)
        return 0 if uid is None else self._user_size(tag, uid)

    def _user_size(self, tag: Tag, uid: int) -> int:
        """A user blob's size: its one dirty blob's, or where its last non-empty part ends."""
        key = (tag.id, uid)
        size = self._user_sizes.get(key)
        if size is None:
            parts = self._parts.get(key, {})
            if uid in self.tags[tag.id].parted:
                size = max((k * self.user_part + b.size for k, b in parts.items() if b.size),
                           default=0)
            else:
                size = parts[0].size if 0 in parts else 0
            self._user_sizes[key] = size
        return size

    def damaged_names(self, tag: Tag) -> list[str]:
        """The damaged dirty blobs of a tag (EIO until a reset drops them)."""
        return sorted(b.name for (tag_id, _), b in self.blobs.items()
                      if tag_id == tag.id and b.damaged)

    def dirty_summary(self, tag: Tag) -> tuple[int, int]:
        """``(dirty blobs, bytes)`` of a tag (bytes: sizes of its dirty blobs)."""
        count = size = 0
        for (tag_id, _), blob in self.blobs.items():
            if tag_id == tag.id:
                count += 1
                size += blob.size
        return count, size

    # -- reads -------------------------------------------------------------------------------

    async def read_chunk(self, tag: Tag, index: int, off: int, size: int) -> bytes:
        blob = self.blobs.get((tag.id, tag.layout.blob_name(index)))
        if blob is None:  # an extension chunk past the source that was never written
            return bytes(max(0, min(size, tag.layout.chunk_size - off)))
        return await self._read(blob, off, size)

    async def read_view(self, tag: Tag, off: int, size: int) -> Buffer:
        """View bytes of a tag with writes: chunk by chunk, dirty or clean (a read inside
        one chunk is its bytes as they come, uncopied)."""
        cs = tag.layout.chunk_size
        parts: list[Buffer] = []
        for index, inner, length in pieces(off, size, self.view_size(tag), cs):
            if self.is_dirty(tag, index) or index >= tag.layout.num_blobs:
                parts.append(await self.read_chunk(tag, index, inner, length))
            else:
                parts.append(await self.clean.read_clean(tag, index, inner, length))
        if len(parts) == 1:
            return parts[0]
        return b"".join(parts)

    async def read_user(self, tag: Tag, name: str, off: int, size: int) -> bytes:
        uid = self.user_id(tag, name)
        if uid is None:
            return b""
        parts = self._parts.get((tag.id, uid), {})
        if uid not in self.tags[tag.id].parted:
            return await self._read(parts[0], off, size) if 0 in parts else b""
        out: list[bytes | bytearray] = []  # (bytes: reads are never the fold's buffer)
        for k, inner, length in pieces(off, size, self._user_size(tag, uid), self.user_part):
            blob = parts.get(k)
            data = b"" if blob is None else await self._read(blob, inner, length)
            out.append(data if len(data) == length else bytes(data) + bytes(length - len(data)))
        return out[0] if len(out) == 1 else b"".join(out)

    async def read_gap(self, tag: Tag, page: int, off: int, size: int) -> bytes | None:
        """The bytes written into the gaps of page ``page`` (None when none were)."""
        blob = self.blobs.get((tag.id, f"{GAP_PREFIX}{page}"))
        return None if blob is None else await self._read(blob, off, size)

    async def _read(self, blob: DirtyBlob, off: int, size: int, *,
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

    async def _lay(self, blob: DirtyBlob, pending: ExtentMap, buf: bytearray, off: int) -> None:
        """Lay ``pending`` over ``buf`` (bytes ``[off, off+len(buf))``): the parts taken now,
        in one step, and the spilled ones read back from the journal on the I/O pool."""
        parts = list(pending.pieces(off, len(buf)))
        if not any(spilled(d) for _, _, d in parts):
            lay(buf, off, parts)
            return
        try:
            await self.pool.run(lay, buf, off, parts, self._read_back)
        except CorruptionError as exc:  # kept, never written over: fsck reports it
            await self._mark_damaged(blob, f"a write in the journal does not verify: {exc}")
            raise FaultfsError(f"dirty blob {blob.name} of tag {blob.tag.name} cannot be "
                               f"read: {exc}", errno.EIO) from None

    def _read_back(self, ref: Ref) -> bytes:
        data = self.journal.read_data(ref.file, ref.pos, ref.length, ref.digest)
        return data[ref.lo:ref.hi]

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
            if base != DIRECT:
                break
            try:
                data = await self.pool.run(self.files.read_direct, blob.tag.name, blob.name,
                                           direct, off, size)
            except FileNotFoundError:
                continue
            except (CorruptionError, OSError) as exc:
                raise FaultfsError(f"dirty blob {blob.name} of tag {blob.tag.name} cannot be "
                                   f"read: {exc}", errno.EIO) from None
            if not pending:
                return data
            buf = bytearray(size)
            buf[:len(data)] = data
            await self._lay(blob, pending, buf, off)
            return buf if mutable else bytes(buf)
        else:
            raise FaultfsError(f"dirty blob {blob.name} of tag {blob.tag.name} cannot be read: "
                               "its file keeps moving", errno.EIO)
        pending, base, base_bytes = blob.pending, blob.base, blob.base_bytes  # one state
        buf = bytearray(size)
        if pending.covers(off, size):
            pass  # every byte was written over (a chunk rewritten in pieces): no base read
        elif base == FOLDED:
            try:
                data = await self.pool.run(self.files.read, blob.tag.name, blob.name, off, size)
            except (CorruptionError, OSError) as exc:
                raise FaultfsError(f"dirty blob {blob.name} of tag {blob.tag.name} cannot be "
                                   f"read: {exc}", errno.EIO) from None
            buf[:len(data)] = data
        elif base == CLEAN:
            if base_bytes is not None:
                buf[:] = memoryview(base_bytes)[off:off + size]
            else:
                assert blob.index is not None
                data = await self.clean.read_clean(blob.tag, blob.index, off, size)
                buf[:len(data)] = data
                if blob.base == CLEAN and blob.pending:  # (a fault behind a write that
                    # failed, a replay): kept once the store has it; a chunk nothing was
                    # written over (a refused write's) stays evictable
                    self.clean.pin(blob.tag, blob.index)
        await self._lay(blob, pending, buf, off)
        return buf if mutable else bytes(buf)

    # -- writes ------------------------------------------------------------------------------

    def _check_writable(self, tag: Tag | None = None) -> None:
        if not self.writable:
            raise FaultfsError("this mount is read-only", errno.EROFS)
        tw = None if tag is None else self.tags.get(tag.id)
        if tw is not None and tw.damaged:
            raise FaultfsError(f"tag {tag.name if tag else ''} takes no writes: its write state "
                               f"is damaged ({tw.damaged}); run faultfs fsck", errno.EIO)

    @one_change
    async def write_chunk(self, tag: Tag, index: int, off: int, data: bytes) -> int:
        """Write through ``chunk_N``: a chunk has a fixed size (EFBIG past its end)."""
        self._check_writable(tag)
        cs = tag.layout.chunk_size
        if off + len(data) > cs:
            raise FaultfsError(f"chunk {index} of tag {tag.name} is {cs} bytes: a write past "
                               "its end cannot grow it", errno.EFBIG)
        if index >= self.num_chunks(tag):
            raise FaultfsError(f"tag {tag.name} has no chunk {index}", errno.ENOENT)
        await self._write(self._chunk_blob(tag, index), off, data)
        self._written(tag)
        return len(data)

    @one_change
    async def write_view(self, tag: Tag, off: int, data: bytes) -> int:
        """Write through the whole-object view: it grows past its end (new chunks)."""
        self._check_writable(tag)
        tw = self._tag(tag)
        cs = tag.layout.chunk_size
        end = off + len(data)
        if end > tw.view_size:
            data = self._fit(tag, "the view", off, data)
            end = off + len(data)
        index, inner = divmod(off, cs)
        done = len(data)
        if data and inner + len(data) <= cs:  # one chunk (most writes): no slice, no generator
            await self._write(self._chunk_blob(tag, index), inner, data)
        else:
            done = await self._write_run(data, (
                (self._chunk_blob(tag, index), inner, length)
                for index, inner, length in pieces(off, len(data), end, cs)))
            end = off + done
        if end > tw.view_size:
            self._append(KIND_SIZE, tag.name, VIEW, 0, end)
            self._set_view_size(tag, tw, end)
        self._written(tag)
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
                await self._write(blob, inner, view[at:at + length])
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
        self._check_writable(tag)
        tw = self._tag(tag)
        old = tw.view_size
        if size > old:
            self._check_growth(tag, "the view", size)
        if size < old:
            cut = self._cut_pieces(tag, size, old)
            for index, _, _ in cut:
                blob = self.blobs.get((tag.id, tag.layout.blob_name(index)))
                if blob is not None and blob.damaged:  # refused before anything changes
                    raise FaultfsError(f"dirty blob {blob.name} of tag {tag.name} is damaged "
                                       f"({blob.damaged}): run faultfs fsck", errno.EIO)
            for index, inner, length in cut:
                blob = self._chunk_blob(tag, index)
                while True:
                    async with blob.locked():
                        now = self._now(blob)  # a reset may have dropped it meanwhile
                        if now is blob:
                            self._append(KIND_ZERO, tag.name, blob.name, inner, length)
                            self._apply_zero(blob, inner, length)
                            break
                    blob = now
        self._append(KIND_SIZE, tag.name, VIEW, 0, size)
        self._set_view_size(tag, tw, size)
        self._written(tag)

    def _cut_pieces(self, tag: Tag, size: int, old: int) -> list[tuple[int, int, int]]:
        """The pieces of view bytes ``[size, old)`` that a shrink must zero: in the
        source's chunks and in chunks written since, never one per chunk of the range (past
        both, a chunk holds no bytes and reads zeros already, however far the view grew)."""
        cs = tag.layout.chunk_size
        first, end = size // cs, -(-old // cs)
        indexes = set(range(first, min(end, tag.layout.num_blobs)))
        indexes.update(blob.index for (tag_id, _), blob in self.blobs.items()
                       if tag_id == tag.id and blob.index is not None
                       and first <= blob.index < end)
        out = []
        for index in sorted(indexes):
            lo, hi = max(size, index * cs), min(old, (index + 1) * cs)
            out.append((index, lo - index * cs, hi - lo))
        return out

    @staticmethod
    def _check_growth(tag: Tag, name: str, size: int) -> None:
        """A view or user blob grows to ``MAX_GROWN`` at most (or its source's size, when
        larger): EFBIG past it, nothing changed."""
        if size > max(MAX_GROWN, tag.layout.size):
            raise FaultfsError(f"{name} of tag {tag.name} cannot grow to {size} bytes: a file "
                               f"of the mount holds at most {MAX_GROWN >> 40} TiB", errno.EFBIG)

    @classmethod
    def _fit(cls, tag: Tag, name: str, off: int, data: bytes) -> bytes:
        """What of a write of ``data`` at ``off`` fits under the growth limit
        (``_check_growth``): a write that crosses it writes what fits, a short count, as a
        file size limit does; one that starts at or past it is EFBIG."""
        limit = max(MAX_GROWN, tag.layout.size)
        if off + len(data) > limit and off < limit:
            return data[:limit - off]
        cls._check_growth(tag, name, off + len(data))
        return data

    @one_change
    async def write_user(self, tag: Tag, name: str, off: int, data: bytes) -> int:
        """A user blob made before parts is one dirty file, at most ``USER_BLOB_MAX`` bytes
        (what fits is written, a short count; a write wholly past it is EFBIG); one made
        since is cut into parts of ``USER_PART``, each a dirty blob of its own, so a fold
        rewrites only the parts written since the last one."""
        self._check_writable(tag)
        uid = self._user_uid(tag, name)
        if uid not in self.tags[tag.id].parted:
            if off + len(data) > USER_BLOB_MAX:
                if off >= USER_BLOB_MAX:
                    raise _too_big(tag, name, off + len(data))
                data = data[:USER_BLOB_MAX - off]  # what fits: a short count
            await self._write(self._user_part(tag, uid, 0), off, data)
        else:
            if data:
                data = self._fit(tag, f"user blob {name}", off, data)
            try:
                data = data[:await self._write_run(data, (
                    (self._user_part(tag, uid, k), inner, length) for k, inner, length
                    in pieces(off, len(data), off + len(data), self.user_part)))]
            except BaseException:  # some parts may have grown: work the size out again
                self._user_sizes.pop((tag.id, uid), None)
                raise
        key = (tag.id, uid)
        if key in self._user_sizes:
            self._user_sizes[key] = max(self._user_sizes[key], off + len(data))
        self._written(tag)
        return len(data)

    @one_change
    async def truncate_user(self, tag: Tag, name: str, size: int) -> None:
        self._check_writable(tag)
        uid = self._user_uid(tag, name)
        if uid not in self.tags[tag.id].parted:
            if size > USER_BLOB_MAX:
                raise _too_big(tag, name, size)
            await self._truncate_part(self._user_part(tag, uid, 0), size)
        else:
            self._check_growth(tag, f"user blob {name}", size)
            part = self.user_part
            last, inner = divmod(size, part)
            if inner == 0 and last:  # the part that holds the last byte is the whole one
                last, inner = last - 1, part
            for k, blob in sorted(self._parts.get((tag.id, uid), {}).items()):
                if k > last or (k == last and not size):
                    if blob.size:
                        await self._truncate_part(blob, 0)
            if size:
                blob = self._user_part(tag, uid, last)
                if blob.size != inner:
                    await self._truncate_part(blob, inner)
            self._user_sizes[(tag.id, uid)] = size
        self._written(tag)

    async def _truncate_part(self, blob: DirtyBlob, size: int) -> None:
        while True:
            async with blob.locked():
                now = self._now(blob)  # a reset may have dropped it meanwhile
                if now is blob:
                    self._append(KIND_SIZE, blob.tag.name, blob.name, 0, size)
                    before = blob.pending.held
                    self._resize(blob, size)
                    self.held += blob.pending.held - before
                    break
            blob = now
        self._user_changed(blob)

    @one_change
    async def write_gap(self, tag: Tag, page: int, off: int, data: bytes) -> None:
        """Bytes written into a gap of page ``page`` (the map has no slice there)."""
        self._check_writable(tag)
        key = (tag.id, f"{GAP_PREFIX}{page}")
        blob = self.blobs.get(key)
        if blob is None:
            blob = self._add(DirtyBlob(tag, key[1], None, 0, NEW))
        await self._write(blob, off, data)

    async def _write(self, blob: DirtyBlob, off: int, data: bytes) -> None:
        """Write ``data`` at ``off`` of ``blob``, or — when a reset drops ``blob`` while the
        write awaits — of the blob its name has then (``_now``)."""
        if blob.damaged:  # never written over: the user's data may still be recovered
            raise _damaged(blob)
        blob.writers += 1
        try:
            if self._checkpointing is not None and self._over(2):
                # back-pressure: memory and journal stay bounded
                await self._checkpointing.wait()
                blob = self._moved(blob)
                if blob.damaged:
                    raise _damaged(blob)
            while True:
                if off == 0 and blob.index is not None and len(data) == blob.size:
                    if await self._write_whole(blob, data):
                        return
                else:
                    unstaged = (blob.base == CLEAN and blob.base_bytes is None
                                and not blob.pending)
                    lock = blob.lock
                    if unstaged and (lock is None or not lock.locked()) and self._base_behind(
                            blob, off, len(data)):
                        unstaged = False
                    if not unstaged and (lock is None or not lock.locked()):
                        # the common case: nothing to fault and nobody folding the blob.
                        # Nothing below awaits, so no other task comes between (the lock
                        # would only cost its checkpoint)
                        self._put_first(blob, off, data)
                        break
                    if await self._write_locked(blob, off, data):
                        break
                blob = self._moved(blob)  # dropped by a reset while the write awaited
                if blob.damaged:
                    raise _damaged(blob)
            self.stats.add("writes")
            self.stats.add("bytes_written", len(data))
            if self.held > self.fold_bytes:
                self.spill()
            if self._over(1):
                self.start_checkpoint()
        except BaseException:
            self._drop_unwritten(blob)
            raise
        finally:
            blob.writers -= 1

    async def _write_locked(self, blob: DirtyBlob, off: int, data: bytes) -> bool:
        """The write of ``_write`` under ``blob``'s lock (a fold or another write holds it, or
        its base is faulted first); False, nothing written, when a reset dropped ``blob``
        while the write awaited (``_now``)."""
        async with blob.locked():
            if self._now(blob) is not blob:
                return False
            whole = False
            if blob.base == CLEAN and blob.base_bytes is None and not blob.pending:
                if off == 0 and len(data) >= blob.size:
                    whole = True  # a whole blob: no fault needed
                else:
                    assert blob.index is not None
                    kept = await self.clean.stage_clean(blob.tag, blob.index)
                    now = self._now(blob)
                    if now is not blob:  # the fault pinned the chunk: the base of the new one
                        if now.base == CLEAN and not now.damaged:
                            if now.base_bytes is None:
                                now.base_bytes = kept
                        else:
                            self.clean.unpin(blob.tag, blob.index)
                        return False
                    blob.base_bytes = kept
            self._put_first(blob, off, data)
            if whole:  # only once the write is journaled: a refused one changes nothing
                self._renew(blob)
        return True

    def _now(self, blob: DirtyBlob) -> DirtyBlob:
        """The blob a write or truncate handed ``blob`` goes to after an await: ``blob``, or,
        when a reset dropped it meanwhile, the one the tables have for its name now, made as
        a replay makes it (the change is journaled after the reset's void mark: a replay
        lays it over the reset). A part of a user blob unlinked meanwhile stays ``blob``:
        nothing reads it, and a replay applies none of its records."""
        now = self.blobs.get((blob.tag.id, blob.name))
        if now is blob or blob.tag.id not in self.tags:
            return blob
        if now is None:
            now = self._blob_for(blob.tag, blob.name, create=True)
        return blob if now is None else now

    def _moved(self, blob: DirtyBlob) -> DirtyBlob:
        """``_now`` for a write counted as ``blob``'s writer: it is the new one's instead."""
        now = self._now(blob)
        if now is not blob:
            blob.writers -= 1
            now.writers += 1
        return now

    def _put_first(self, blob: DirtyBlob, off: int, data: bytes) -> None:
        """``_put`` after this write pinned ``blob``'s staged base (or started its fault): a
        refused write (ENOSPC) lets the pin go again when nothing lies over that base, so a
        chunk no write changed stays evictable."""
        try:
            self._put(blob, off, data)
        except BaseException:
            if blob.index is not None and self._bare(blob):
                blob.base_bytes = None
                self.clean.unpin(blob.tag, blob.index)
            raise

    @staticmethod
    def _bare(blob: DirtyBlob) -> bool:
        """Whether ``blob`` lies over its source chunk with nothing written over it (a
        pin of that chunk would only keep it from eviction)."""
        return blob.base == CLEAN and blob.index is not None and not blob.pending

    @classmethod
    def _unwritten(cls, blob: DirtyBlob) -> bool:
        """Whether ``blob`` is a chunk nothing was written to: its source chunk bare, or a
        chunk past the source with nothing in it (it reads as if it were not dirty)."""
        return cls._bare(blob) or (blob.base == NEW and blob.index is not None
                                   and blob.index >= blob.tag.layout.num_blobs
                                   and not blob.pending)

    def _drop_unwritten(self, blob: DirtyBlob) -> None:
        """A write of ``blob`` was refused: a chunk it left with nothing written to (it
        brought it into the tables) is taken out again unless another write, a truncate or
        a fold holds it, so the chunk is clean again — never pinned, never folded into a
        dirty copy of the source's bytes that a new version of the source would not
        replace."""
        key = (blob.tag.id, blob.name)
        lock = blob.lock
        if (blob.writers == 1 and self.blobs.get(key) is blob and self._unwritten(blob)
                and (lock is None or not (lock.locked() or lock.statistics().tasks_waiting))):
            self._forget(key)
            if blob.base == CLEAN:
                self.clean.unpin(blob.tag, blob.index)

    def _renew(self, blob: DirtyBlob) -> None:
        """``blob`` no longer lies over its source chunk (written or zeroed whole): the
        staged copy is evictable again."""
        if blob.base == CLEAN and blob.index is not None:
            self.clean.unpin(blob.tag, blob.index)
        blob.base = NEW

    def _base_behind(self, blob: DirtyBlob, off: int, size: int) -> bool:
        """The size-0 request of a partial write, when the write need not wait for it: the
        chunk's staged copy is pinned now, or its fault is started behind the write (at most
        ``BASE_FAULTS`` at once; past that, and without a nursery, the write waits for it).
        The write is journaled over a base that is the source's bytes either way: a read or a
        fold meanwhile faults it through the same flight, and a fault that fails is EIO to
        them (never zeros) while the write itself stays acknowledged."""
        if off == 0 and size >= blob.size:
            return False  # a whole blob: no base at all (set under the lock, below)
        assert blob.index is not None
        if self.clean.pin_staged(blob.tag, blob.index):
            return True
        if self._nursery is None or self._base_faults >= BASE_FAULTS:
            return False
        self._base_faults += 1
        self._nursery.start_soon(self._fault_base, blob.tag, blob.index, blob.name)
        return True

    async def _fault_base(self, tag: Tag, index: int, name: str) -> None:
        try:
            kept = await self.clean.stage_clean(tag, index)
        except Exception as exc:  # a background task must never take the mount down
            self.stats.add("base_fault_errors")
            log.warning("faulting chunk %d of tag %s beneath a write failed (a read of it "
                        "faults it again): %s", index, tag.name, exc)
            blob = self.blobs.get((tag.id, name))
            if blob is not None:
                await self._base_lost(blob)
            return
        finally:
            self._base_faults -= 1
        # nothing awaited from the pin on: the blob is as it is now
        blob = self.blobs.get((tag.id, name))
        if blob is None or blob.base != CLEAN or self._bare(blob):
            # reset, folded or rewritten whole meanwhile, or its write refused (ENOSPC)
            self.clean.unpin(tag, index)
        elif kept is not None and blob.base_bytes is None:
            blob.base_bytes = kept

    async def _base_lost(self, blob: DirtyBlob) -> bool:
        """Whether ``blob``'s writes lie over source bytes that cannot be read any more: the
        source changed under the mount before its base was staged. Then it is damaged (kept,
        EIO), never its writes laid over the new version's bytes."""
        why = self._lost_base(blob, blob.tag.changed_under_mount)
        if why:
            await self._mark_damaged(blob, why)
        return bool(why)

    @staticmethod
    def _lost_base(blob: DirtyBlob, change: str) -> str:
        """Why ``blob``'s base is gone when the source changed (``change``: how); "" when
        it is not (no change, no clean base under it, or written over whole)."""
        if (not change or blob.damaged or blob.base != CLEAN or blob.base_bytes is not None
                or not blob.pending or blob.pending.covers(0, blob.size)):
            return ""
        return (f"its writes lie over the source's bytes of chunk {blob.index}, which were not "
                f"staged before the source changed ({change}): kept, never laid over the new "
                "version")

    def _over(self, times: int) -> bool:
        """Whether memory or the journal is past ``times`` its bound (a checkpoint is due)."""
        journal = self.journal
        return (self.held > times * self.fold_bytes
                or journal.bytes_on_disk > times * self.journal_bytes
                or self._fold_work > times * FOLD_WORK * self.journal_bytes
                or len(self._touched) > times * FOLD_BLOBS
                or journal.next_seq - self._kept_from > times * MAX_RECORDS)

    def _touch(self, blob: DirtyBlob) -> None:
        key = (blob.tag.id, blob.name)
        if key not in self._touched:
            self._touched.add(key)
            self._fold_work += max(blob.size, 1)

    def spill(self) -> None:
        """Let go of the bytes of every write held in memory: the journal has them."""
        before = self.held
        for blob in self.blobs.values():
            if blob.pending.held:
                self.held -= blob.pending.spill(SPILL_RECORD)
        if self.held < before:
            self.stats.add("spills")
            self.stats.add("spilled_bytes", before - self.held)

    def _put(self, blob: DirtyBlob, off: int, data: bytes) -> None:
        """Journal a write of ``blob`` and lay it over the blob (its lock held, or no await
        since the caller checked that nobody holds it)."""
        self._append(KIND_WRITE, blob.tag.name, blob.name, off, len(data), data)
        segment, pos, digest = self.journal.last_data
        pending = blob.pending
        before = pending.held
        held = data if type(data) is bytes else bytes(data)
        pending.write(off, Ref(segment, pos, len(held), digest, 0, len(held), held))
        self._touch(blob)
        if blob.index is None:
            blob.size = max(blob.size, off + len(data))
        self.held += pending.held - before

    async def _write_whole(self, blob: DirtyBlob, data: bytes) -> bool:
        """A write of a whole chunk: its bytes become a direct file (no fault, nothing held
        in memory, no fold to copy them again), journaled by one small record naming it.
        Both are written inline, like an append (a pwrite into the page cache, in order).
        False, nothing written, when a reset dropped ``blob`` while the write waited for its
        lock (``_now``)."""
        async with blob.locked():
            if self._now(blob) is not blob:
                return False
            tag, seq = blob.tag.name, self.journal.next_seq
            try:
                digest = self.files.write_direct(tag, blob.name, data, seq)
            except OSError as exc:
                code = errno.ENOSPC if exc.errno in (errno.ENOSPC, errno.EDQUOT) else errno.EIO
                raise FaultfsError(f"writing {blob.name} of tag {tag} failed: {exc.strerror}",
                                   code) from None
            try:
                got = self._append(KIND_BLOB, tag, blob.name, 0, len(data), digest=digest)
            except BaseException:
                try:  # no record names it: it is nothing (a crash here leaves it to the mount)
                    self.files.delete_direct(tag, seq)
                except OSError:
                    pass
                raise
            assert got == seq, "the journal handed out another seq than the file's"
            self._unsynced.append((tag, seq))
            self.held -= blob.pending.held
            self._set_direct(blob, seq)
        self.stats.add("writes")
        self.stats.add("bytes_written", len(data))
        if self._direct_count > DIRECT_FILES:
            self.start_checkpoint()
        return True

    def _set_direct(self, blob: DirtyBlob, seq: int) -> None:
        """Blob ``blob`` is now direct file ``seq`` whole: nothing under it or over it (the
        caller counts ``held``)."""
        if blob.base == DIRECT:
            self._obsolete.append((blob.tag.name, blob.direct))  # a record may still name it
        else:
            self._direct_count += 1
            if blob.base == CLEAN and blob.index is not None:
                self.clean.unpin(blob.tag, blob.index)
        blob.pending, blob.base_bytes = ExtentMap(), None
        blob.base, blob.direct = DIRECT, seq

    def _append(self, kind: int, tag: str, name: str, off: int, length: int,
                data: bytes = b"", digest: int = 0) -> int:
        """Journal one change (inline: an append to the page cache is a few microseconds a
        KiB, and appends must stay in order)."""
        try:
            return self.journal.append(kind, tag, name, off, length, data, digest)
        except StoreFull:
            raise FaultfsError("the store has no room for the write", errno.ENOSPC) from None

    def _apply_zero(self, blob: DirtyBlob, off: int, length: int) -> None:
        before = blob.pending.held
        if blob.base == CLEAN and blob.base_bytes is None and not blob.pending and (
                off == 0 and length >= blob.size):
            self._renew(blob)
        blob.pending.zero(off, length)
        self.held += blob.pending.held - before
        self._touch(blob)

    def _resize(self, blob: DirtyBlob, size: int) -> None:
        if size < blob.size:
            # regrown, the bytes past ``size`` read as zeros: the mask reaches as far as the
            # mask of an earlier shrink did (it lies past ``blob.size``, over base bytes that
            # are still in the folded file, and the cut would drop it)
            top = max(blob.size, blob.pending.end)
            blob.pending.cut(size)
            blob.pending.zero(size, top - size)
        blob.size = size
        blob.cut = size if blob.cut < 0 else min(blob.cut, size)

    def _mark_changed(self, tag_id: int) -> None:
        self.changed.add(tag_id)
        if self.on_change is not None:
            self.on_change(tag_id)

    def _set_view_size(self, tag: Tag, tw: TagWrites, size: int) -> None:
        tw.view_size = size
        tw.view_changes += 1
        self._mark_changed(tag.id)

    def _add(self, blob: DirtyBlob) -> DirtyBlob:
        self.blobs[(blob.tag.id, blob.name)] = blob
        user = user_key(blob.name) if blob.index is None else None
        if user is not None:
            self._parts.setdefault((blob.tag.id, user[0]), {})[user[1]] = blob
            self._user_sizes.pop((blob.tag.id, user[0]), None)
        self._mark_changed(blob.tag.id)
        return blob

    def _written(self, tag: Tag) -> None:
        tw = self.tags.get(tag.id)
        (self._tag(tag) if tw is None else tw).mtime_ns = time.time_ns()

    # -- user blobs --------------------------------------------------------------------------

    def check_user_name(self, tag: Tag, name: str) -> None:
        """A user blob may not take the name of anything the tag shows already."""
        check_name(name, "blob name")
        if (name == tag.view_name or name == PAGEMAP_NAME or name.startswith(PAGE_PREFIX)
                or self._chunk_index(tag, name) is not None):
            raise FaultfsError(f"{name} names an entry of tag {tag.name}", errno.EPERM)

    # the user blob table changes with its tag's state lock held, from the check to the
    # save: a reset under way (which may fail and put the table back) is done first

    @one_change
    async def create_user(self, tag: Tag, name: str) -> None:
        self._check_writable(tag)
        self.check_user_name(tag, name)
        async with _Holding(self._state_lock(tag.id)):
            tw = self._tag(tag)
            if name in tw.users:
                raise FaultfsError(f"blob {name} of tag {tag.name} exists", errno.EEXIST)
            before = dict(tw.users), set(tw.parted)
            uid = tw.next_user
            tw.next_user += 1  # (kept past a failed save: an id is never handed out twice)
            tw.users[name] = uid
            tw.parted.add(uid)
            await self._save_users(tag, tw, *before)
            self._add(DirtyBlob(tag, part_name(uid, 0), None, 0, NEW))

    @one_change
    async def unlink_user(self, tag: Tag, name: str) -> None:
        self._check_writable(tag)
        async with _Holding(self._state_lock(tag.id)):
            tw = self._tag(tag)
            before = dict(tw.users), set(tw.parted)
            uid = tw.users.pop(name, None)
            if uid is None:
                raise FaultfsError(f"tag {tag.name} has no blob {name}", errno.ENOENT)
            tw.parted.discard(uid)
            await self._save_users(tag, tw, *before)
        await self._drop_user(tag, uid)

    @one_change
    async def rename_user(self, tag: Tag, old: str, new: str, *, replace: bool = True) -> None:
        """Rename a user blob (replacing a user blob named ``new``; with ``replace`` False,
        EEXIST when there is one): one table update."""
        self._check_writable(tag)
        self.check_user_name(tag, new)
        async with _Holding(self._state_lock(tag.id)):
            tw = self._tag(tag)
            if old not in tw.users:
                raise FaultfsError(f"tag {tag.name} has no blob {old}", errno.ENOENT)
            if not replace and new in tw.users:
                raise FaultfsError(f"blob {new} of tag {tag.name} exists", errno.EEXIST)
            before = dict(tw.users), set(tw.parted)
            replaced = tw.users.pop(new, None)
            tw.users[new] = tw.users.pop(old)
            if replaced is not None:
                tw.parted.discard(replaced)
            await self._save_users(tag, tw, *before)
        if replaced is not None:
            await self._drop_user(tag, replaced)

    @one_change
    async def exchange_users(self, tag: Tag, a: str, b: str) -> None:
        """Swap two user blobs' names (renameat2's RENAME_EXCHANGE): one table update, saved
        as a rename's is, so the swap survives a crash whole or not at all. ENOENT unless
        both exist; nothing is dropped."""
        self._check_writable(tag)
        async with _Holding(self._state_lock(tag.id)):
            tw = self._tag(tag)
            for name in (a, b):
                if name not in tw.users:
                    raise FaultfsError(f"tag {tag.name} has no blob {name}", errno.ENOENT)
            before = dict(tw.users), set(tw.parted)
            tw.users[a], tw.users[b] = tw.users[b], tw.users[a]
            await self._save_users(tag, tw, *before)

    async def _save_users(self, tag: Tag, tw: TagWrites, users: dict[str, int],
                          parted: set[int]) -> None:
        """Save a change of ``tag``'s user blob table (its state lock held), or, when the
        save fails, put the table back as it was (``users``, ``parted``: copies from before
        the change) and save that once more, best effort (a save whose directory fsync
        failed may have replaced the file): a change the caller was told failed is not kept
        in memory, where the tag's next state save would write it."""
        try:
            await self._write_state(tag.id)
        except BaseException as exc:
            tw.users, tw.parted = users, parted
            if isinstance(exc, FaultfsError):  # (cancelled: the save never started)
                await self._save_again(tag, "the user blob table before the failed change")
            raise

    async def _save_again(self, tag: Tag, what: str) -> None:
        """Save ``tag``'s state as it is now over one whose save failed, which may have
        replaced the file before it failed (its directory not synced). Best effort: a save
        that fails before its rename changes nothing; a failure is logged, naming ``what``."""
        try:
            await self._write_state(tag.id)
        except FaultfsError as exc:
            log.error("tag %s: %s was not saved again: %s", tag.name, what, exc.message)

    async def _drop_user(self, tag: Tag, uid: int) -> None:
        """Forget the dirty blobs of user blob ``uid`` (unlinked, or replaced by a rename)
        and delete their files (the state saying it is gone is durable already)."""
        names = {self._forget((tag.id, b.name)).name
                 for b in list(self._parts.get((tag.id, uid), {}).values())}
        for name in names:  # gone: nothing damaged is kept of it (its kept records stay)
            self.tags[tag.id].damaged_blobs.pop(name, None)
        # and the first part's name in any case: an empty blob folded before any record was
        # appended names seq 0, which a mount does not load (its file is only deleted here)
        names.add(part_name(uid, 0))

        def delete() -> None:
            for name in sorted(names):
                self.files.delete(tag.name, name)

        await self.pool.run(delete)

    def _forget(self, key: tuple[int, str]) -> DirtyBlob:
        """Take dirty blob ``key`` out of every table (its held bytes too)."""
        blob = self.blobs.pop(key)
        self.held -= blob.pending.held
        user = user_key(blob.name) if blob.index is None else None
        if user is not None:
            parts = self._parts.get((key[0], user[0]), {})
            parts.pop(user[1], None)
            if not parts:
                self._parts.pop((key[0], user[0]), None)
            self._user_sizes.pop((key[0], user[0]), None)
        return blob

    # -- durability --------------------------------------------------------------------------

    async def fsync(self) -> None:
        """Every write acknowledged so far survives a power loss once this returns."""
        self.stats.add("fsyncs")
        if not await self._sync():
            self.stats.add("fsyncs_joined")

    async def _sync(self) -> bool:
        """Make every write acknowledged so far durable: the direct files written since the
        last sync (``SYNC_AT_ONCE`` at a time, then their directories), then the journal.
        One at a time: a sync that returns covers the files another one took before it.
        Group commit: callers that queue behind a sync are all covered by the next one, so
        N writers fsyncing at once cost two syncs, not N. False when an earlier caller's sync
        already covered this one (nothing was synced for it)."""
        want = self.journal.next_seq  # every change acknowledged before this call lies below
        async with self._syncing:
            if self._synced_below >= want:
                return False
            # no await from here to the take: every direct file named below ``start`` is
            # in ``taken`` (written, recorded and listed with no await between) or synced
            start = self.journal.next_seq
            taken, self._unsynced = self._unsynced, []
            try:
                await self._sync_files(taken)
            except BaseException:
                self._unsynced[:0] = taken  # the next sync tries them again
                raise
            await self.pool.run(self.journal.sync)
            self._synced_below = max(self._synced_below, start)
            return True

    async def _sync_files(self, taken: list[tuple[str, int]]) -> None:
        if not taken:
            return
        paths = [self.files.direct_path(tag, seq) for tag, seq in taken]
        failures: list[Exception] = []

        async def one(group: list[str]) -> None:
            try:
                await self.pool.run(self.files.sync_files, group)
            except Exception as exc:  # raised below, as itself (not as a group)
                failures.append(exc)

        async with trio.open_nursery() as nursery:
            for i in range(min(SYNC_AT_ONCE, len(paths))):
                nursery.start_soon(one, paths[i::SYNC_AT_ONCE])
        try:
            if failures:
                raise failures[0]
            await self.pool.run(self.files.sync_dirs, sorted({tag for tag, _ in taken}))
        except OSError as exc:
            code = errno.ENOSPC if exc.errno in (errno.ENOSPC, errno.EDQUOT) else errno.EIO
            raise FaultfsError(f"syncing the written files failed: {exc.strerror}",
                               code) from None

    def attach(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery

    @property
    def base_faults(self) -> int:
        """Size-0 requests running behind the writes that issued them."""
        return self._base_faults

    def start_checkpoint(self) -> None:
        if (self._checkpointing is None and self._nursery is not None
                and time.monotonic() >= self._retry_at):
            self._nursery.start_soon(self.checkpoint)

    async def checkpoint(self) -> None:
        """Fold every dirty blob with writes in memory into its file, durably, then let the
        journal go up to there. Writers of a blob wait while it is folded."""
        if self._checkpointing is not None:
            await self._checkpointing.wait()
            return
        done = self._checkpointing = trio.Event()
        try:
            while self._resets:  # one may still fail and put its blobs back (``reset``)
                if self._resets_over is None:
                    self._resets_over = trio.Event()
                await self._resets_over.wait()
            self.journal.roll()  # here, where appends happen: records after go to the next
            self._touched.clear()  # written from here on: the next checkpoint's work
            self._fold_work = 0
            await self._sync()  # folded or not, the records (and direct files) are durable
            through = self.journal.last_seq
            failed = await self._fold_all([b for b in self.blobs.values() if b.pending
                                           or b.base != FOLDED or b.size != b.folded_size])
            # (a copy: a clone adds its tag while the saves await; one forgotten meanwhile
            # has left ``changed``)
            for tag_id, tw in list(self.tags.items()):
                tw.view_seq = through
                if tag_id in self.changed:  # a tag nothing was written to keeps no state
                    await self._save_state_id(tag_id)
            # a blob that could not be folded keeps every record after its dirty file's (the
            # others' folds, the states and the trim below them stand: one unreadable base
            # never holds the whole journal)
            through = min([through, *(blob.folded_seq for blob, _ in failed)])
            # a damaged blob's records (no fold took them) are kept, not deleted
            kept = await self.pool.run(functools.partial(
                self.journal.trim, through, keep=frozenset(self._keep_segments)))
            self._keep_segments -= kept
            self._kept_from = max(self._kept_from, through + 1)
            # no record at or below ``through`` can be replayed now (trimmed, or its blob's
            # durable file names a later seq): direct files they named may go
            gone = [(t, q) for t, q in self._obsolete if q <= through]
            self._obsolete = [(t, q) for t, q in self._obsolete if q > through]
            await self.pool.run(self._delete_direct, gone)
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
            self._checkpointing = None
            done.set()

    async def _fold_all(self, blobs: list[DirtyBlob]) -> list[tuple[DirtyBlob, FaultfsError]]:
        """Fold ``blobs``, ``FOLD_AT_ONCE`` at a time, then sync each directory they were
        renamed into once (the journal is trimmed only after): a checkpoint of 64 blobs
        costs 64 file fsyncs in parallel and one directory fsync, not 128 in a row. The
        blobs that could not be folded (their base could not be read, say), with why."""
        limiter = trio.CapacityLimiter(FOLD_AT_ONCE)
        failures: list[tuple[DirtyBlob, FaultfsError]] = []
        folded: set[str] = set()

        async def one(blob: DirtyBlob) -> None:
            if blob.damaged:
                return  # never written over (its tag's state names it: see _mark_damaged)
            async with limiter:
                try:
                    await self.fold(blob, sync_dir=False)
                except FaultfsError as exc:
                    # found so now: kept like the others (above)
                    if not blob.damaged and not await self._base_lost(blob):
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

    def _delete_direct(self, gone: list[tuple[str, int]]) -> None:
        for tag, seq in gone:
            try:
                self.files.delete_direct(tag, seq)
            except OSError as exc:  # left behind: the next mount finds it unused
                log.warning("deleting direct file %d of tag %s failed: %s", seq, tag,
                            exc.strerror)

    async def fold(self, blob: DirtyBlob, *, sync_dir: bool = True) -> None:
        async with blob.locked():
            if self.blobs.get((blob.tag.id, blob.name)) is not blob:
                # dropped while the fold waited (a reset, an unlink): written back, its file
                # would name a seq past the reset's void mark, and a mount would load it
                return
            if not blob.pending and blob.base == FOLDED and blob.size == blob.folded_size:
                return
            if self._unwritten(blob):
                return  # nothing was written to it: no dirty copy of its source chunk
            if not blob.pending and blob.base == DIRECT:
                await self._adopt(blob, sync_dir=sync_dir)
                return
            seq = self.journal.last_seq
            data = await self._read_whole(blob)
            try:
                await self.pool.run(lambda: self.files.write(blob.tag.name, blob.name, data, seq,
                                                             sync_dir=sync_dir))
            except OSError as exc:
                code = errno.ENOSPC if exc.errno in (errno.ENOSPC, errno.EDQUOT) else errno.EIO
                raise FaultfsError(f"folding {blob.name} of tag {blob.tag.name} failed: "
                                   f"{exc.strerror}", code) from None
            self.held -= blob.pending.held
            was_clean = blob.base == CLEAN
            if blob.base == DIRECT:  # its record stays in the journal until a trim
                self._obsolete.append((blob.tag.name, blob.direct))
                self._direct_count -= 1
            blob.base, blob.folded_seq, blob.pending, blob.base_bytes = FOLDED, seq, ExtentMap(), None
            blob.folded_size = len(data)
            blob.direct = 0
            if was_clean and blob.index is not None:
                self.clean.unpin(blob.tag, blob.index)
            self.stats.add("folds")

    async def _adopt(self, blob: DirtyBlob, *, sync_dir: bool) -> None:
        """Fold a direct file with nothing over it: rename it to the blob's dirty file (it
        must be synced first: a rename never makes an unsynced file the blob's)."""
        tag, seq = blob.tag.name, blob.direct
        if (tag, seq) in self._unsynced or self._syncing.locked():
            await self._sync()  # (a sync under way may hold it: wait for that one too)

        def rename() -> None:
            self.files.adopt_direct(tag, blob.name, seq)
            if sync_dir:
                self.files.sync_dirs([tag])

        try:
            await self.pool.run(rename)
        except OSError as exc:
            raise FaultfsError(f"folding {blob.name} of tag {tag} failed: {exc.strerror}",
                               errno.EIO) from None
        blob.base, blob.folded_seq, blob.direct = FOLDED, seq, 0
        blob.folded_size = blob.size
        self._direct_count -= 1
        self.stats.add("folds")

    async def _read_whole(self, blob: DirtyBlob) -> bytes | bytearray:
        return await self._read(blob, 0, blob.size, mutable=True) if blob.size else b""

    async def close(self) -> None:
        """Unmount: everything written is folded and durable."""
        await self.checkpoint()
        await self._sync()
        self.journal.close()

    # -- reset, clone ------------------------------------------------------------------------

    @one_change
    async def reset(self, tag: Tag, names: list[str] | None = None) -> int:
        """Drop the writes of ``tag`` (of its blobs ``names``: chunks or user blobs): back to
        the source's bytes (a user blob back to empty). The dirty blobs dropped. A reset whose
        state save fails changes nothing (``_undo_reset``)."""
        self._check_writable(tag)
        # never beside a checkpoint: its folds could write a blob the reset drops, or one a
        # write makes meanwhile, over the file the dropped blob's records need (and trim
        # them) while the reset may still fail and put the dropped blob back
        while self._checkpointing is not None:
            await self._checkpointing.wait()
        self._resets += 1
        try:
            async with _Holding(self._state_lock(tag.id)):
                count, dropped = await self._reset(tag, names)
            for blob in dropped:
                if blob.base == DIRECT:  # void now (the state says so, durably): no replay needs it
                    await self.pool.run(self._delete_direct, [(tag.name, blob.direct)])
                if (tag.id, blob.name) not in self.blobs:  # a write since owns the name's file
                    await self.pool.run(self.files.delete, tag.name, blob.name)
            return count
        finally:
            self._resets -= 1
            if not self._resets and self._resets_over is not None:
                self._resets_over.set()
                self._resets_over = None

    async def _reset(self, tag: Tag, names: list[str] | None) -> tuple[int, list[DirtyBlob]]:
        """``reset`` with its tag's state lock held: the count and the blobs dropped."""
        tw = self._tag(tag)
        seq = self.journal.last_seq
        # what the reset changes, put back if its save fails (the dicts it changes in place
        # are copied; the others it replaces)
        old = replace(tw, voided_blobs=dict(tw.voided_blobs),
                      damaged_blobs=dict(tw.damaged_blobs))
        was_changed = tag.id in self.changed
        grown_or_users = tw.view_size != tag.layout.size or bool(tw.users)
        if names is None:
            tw.voided = seq
            tw.view_size, tw.users, tw.parted = tag.layout.size, {}, set()
            tw.damaged_blobs = {}
            self.changed.discard(tag.id)
            gone = [key for key in self.blobs if key[0] == tag.id]
        else:
            # every name is checked before anything changes: a refused reset drops nothing
            # (a void mark left in memory would be saved by the next state save, and its
            # blob's writes would be gone at the next mount)
            for name in names:
                if name in tw.users or (tag.id, name) in self.blobs:
                    continue
                index = self._chunk_index(tag, name)
                if index is None or index >= self.num_chunks(tag):
                    raise FaultfsError(f"tag {tag.name} has no blob {name}", errno.ENOENT)
            gone = []
            for name in names:
                uid = tw.users.get(name)
                if uid is not None:  # every part of it: one void mark covers them all
                    tw.voided_blobs[part_name(uid, 0)] = seq
                    parts = [b.name for b in self._parts.get((tag.id, uid), {}).values()]
                    for part in parts:
                        tw.damaged_blobs.pop(part, None)
                    gone += [(tag.id, part) for part in parts]
                    continue
                if (tag.id, name) not in self.blobs:
                    continue  # a chunk that was never written: nothing to drop
                tw.voided_blobs[name] = seq
                tw.damaged_blobs.pop(name, None)
                gone.append((tag.id, name))
        if gone or (names is None and grown_or_users):
            # the bytes changed: so does the mtime (an export's resume, make and rsync
            # tell a changed file by it), durably with the reset
            tw.mtime_ns = max(time.time_ns(), tw.mtime_ns + 1)
        marks = (tw.view_changes, tw.mtime_ns)  # a write since changes them: then they stay
        # out of the tables with the void mark, before anything awaits: a write answered
        # from here on lies over the reset (a blob of its own, its record past the mark), in
        # this mount as at a replay (dropped after the state save, it was read by no one
        # here and replayed after a kill -9)
        dropped = [self._forget(key) for key in gone if key in self.blobs]
        for blob in dropped:
            if blob.base == CLEAN and blob.index is not None:
                self.clean.unpin(tag, blob.index)
            if blob.base == DIRECT:
                self._direct_count -= 1
        try:
            await self._write_state(tag.id)
        except BaseException as exc:
            aside = self._undo_reset(tag, old, was_changed, marks, dropped)
            if isinstance(exc, FaultfsError):  # (cancelled: the save never started)
                await self._after_undo(tag, aside)
            raise
        return len(gone), dropped

    def _undo_reset(self, tag: Tag, old: TagWrites, was_changed: bool,
                    marks: tuple[int, int], dropped: list[DirtyBlob]) -> list[tuple[str, int]]:
        """Put back what a reset whose state save failed changed — the disk still replays
        every write it dropped, and the next state save would write its void marks — and
        only that: a view size or mtime a write set since stays (a replay applies the old
        size records, then the new one), and user blob tables waited for the reset. The
        dropped blobs go back into the tables, pinned and counted as before, with what was
        written to their names since laid over them (``_merged``). The direct files of
        writes whose blob is damaged, to be set aside."""
        tw = self.tags[tag.id]
        tw.voided, tw.voided_blobs = old.voided, old.voided_blobs
        tw.users, tw.parted = old.users, old.parted
        tw.damaged_blobs.update(old.damaged_blobs)
        if tw.view_changes == marks[0]:
            tw.view_size = old.view_size
        if tw.mtime_ns == marks[1]:
            tw.mtime_ns = old.mtime_ns
        if was_changed and tag.id not in self.changed:
            self._mark_changed(tag.id)
        aside: list[tuple[str, int]] = []
        for blob in dropped:
            key = (tag.id, blob.name)
            new = self.blobs.get(key)
            if new is not None:
                self._forget(key)
                if new.base == DIRECT:
                    self._direct_count -= 1  # (counted again below when it stays)
            blob = blob if new is None else self._merged(blob, new, aside)
            self._add(blob)
            self.held += blob.pending.held
            if blob.base == DIRECT:
                self._direct_count += 1
            if blob.index is not None:  # its source chunk is kept while writes lie over it
                if blob.base != CLEAN or blob.damaged:
                    self.clean.unpin(tag, blob.index)
                elif blob.pending:
                    self.clean.pin(tag, blob.index)
        return aside

    def _merged(self, old: DirtyBlob, new: DirtyBlob, aside: list[tuple[str, int]]) -> DirtyBlob:
        """Blob ``old``, dropped by a reset whose save failed, and blob ``new``, made by
        writes to its name since (their records lie after ``old``'s), as one — what a replay
        makes of the old records and then the new ones: ``new`` when nothing beneath it shows
        (a whole-chunk file, a chunk written over whole), else ``old`` with ``new``'s extents
        laid over it; a user blob's part cut since is cut first where its smallest cut was
        (past it, a replay shows nothing of ``old`` either). A damaged ``old`` stays damaged,
        as a replay keeps every record of its name aside: ``new``'s records (and its direct
        file, in ``aside``) are kept with them."""
        if old.damaged:
            self._keep_segments.update(d.file for _, _, d in new.pending.items()
                                       if isinstance(d, Ref))
            if new.base == DIRECT:
                aside.append((new.tag.name, new.direct))
            return old
        if new.index is not None and (new.base == DIRECT or new.pending.covers(0, new.size)):
            if old.base == DIRECT:  # a replay still reads it (its record is kept): until a trim
                self._obsolete.append((old.tag.name, old.direct))
            return new
        if new.cut >= 0:
            self._resize(old, new.cut)
        for start, length, data in new.pending.items():
            if data is None:
                old.pending.zero(start, length)
            else:
                old.pending.write(start, data)
        if old.index is None:  # (a chunk's size is fixed)
            old.size = new.size if new.cut >= 0 else max(old.size, new.size)
        if old.base == CLEAN and old.base_bytes is None:
            old.base_bytes = new.base_bytes
        if new.damaged:
            self._note_damaged(old, new.damaged)
        return old

    async def _after_undo(self, tag: Tag, aside: list[tuple[str, int]]) -> None:
        """After ``_undo_reset``: the state as it is now is saved over the one that failed,
        which may have replaced the file before it failed (its directory not synced) — so
        a kill -9 never replays the reset — and the direct files in ``aside`` are set aside
        with their damaged blob's records. Both best effort: a save that fails before its
        rename changes nothing."""
        await self._save_again(tag, "the state before the failed reset")
        for tag_name, seq in aside:
            try:
                await self.pool.run(self.files.set_aside_direct, tag_name, seq,
                                    self.journal.damaged_dir)
            except OSError as exc:
                log.error("keeping direct file %d of tag %s: %s", seq, tag_name, exc.strerror)

    def has_writes(self, tag: Tag) -> bool:
        tw = self.tags.get(tag.id)
        return bool(self.dirty_summary(tag)[0]) or (tw is not None and (
            bool(tw.users) or tw.view_size != tag.layout.size))

    def dependents(self, tag: Tag) -> list[str]:
        """Clones made of ``tag`` (their dirty files began as links of its files)."""
        return sorted(self._names[tid] for tid, tw in self.tags.items()
                      if tid != tag.id and tag.name in tw.ancestors)

    async def forget_tag(self, tag: Tag) -> None:
        """Drop every write of ``tag`` and its files (``faultfs forget``); a checkpoint then
        lets the journal go, so no record of it is replayed onto a later tag of that name."""
        for key in [k for k in self.blobs if k[0] == tag.id]:
            blob = self._forget(key)
            if blob.base == DIRECT:
                self._direct_count -= 1  # its file goes with the tag's directory
        self._obsolete = [(t, q) for t, q in self._obsolete if t != tag.name]
        self._unsynced = [(t, q) for t, q in self._unsynced if t != tag.name]
        self.tags.pop(tag.id, None)
        self.changed.discard(tag.id)
        name = self._names.pop(tag.id, tag.name)
        if self.writable:
            await self.pool.run(self.files.forget_tag, name)
            await self.checkpoint()

    async def prepare_clone(self, parent: Tag, child: str) -> None:
        """Give tag ``child`` (not registered yet) ``parent``'s writes as they are at one
        instant (DESIGN §12): every dirty blob of the parent folded, its files linked (a fold
        replaces a file, never writes it in place, so a link keeps this moment), the
        parent's write state copied — all while the parent is held still
        (``TagChanges.hold``): its changes wait, and those under way end first. Folding one
        blob after another while writes went on let a clone take a write without one
        answered before it. The blobs are folded once before the hold, so under it only
        those written meanwhile are folded again: writers of the tag wait for those folds,
        the links and one state file, never for the bulk."""
        self._refuse_damaged(parent)
        await self._fold_tag(parent)
        async with self.changes.hold(parent.id):
            await self._fold_tag(parent)
            self._refuse_damaged(parent)  # (also a blob a fold just found damaged)
            ptw = self._tag(parent)
            # the reset marks too: a file a reset left behind (killed before deleting it) is
            # linked with the others, and a mount of the clone must skip it as the parent's does
            state = replace(ptw.saved(), view_seq=self.journal.last_seq,
                            ancestors=(parent.name, *ptw.ancestors), damaged_blobs={})

            def link() -> None:
                self.files.forget_tag(child)  # a clone that crashed before it was registered
                self.files.link_from(parent.name, child)
                self.files.write_state(child, state)

            await self.pool.run(link)

    def _refuse_damaged(self, tag: Tag) -> None:
        damaged = sorted(b.name for b in self.blobs.values() if b.tag.id == tag.id and b.damaged)
        if damaged:  # a clone would take its older file, or none: never a damaged blob's bytes
            raise FaultfsError(f"tag {tag.name} has damaged dirty blobs "
                               f"({', '.join(damaged)}): reset them first", errno.EIO)

    async def _fold_tag(self, tag: Tag) -> None:
        """Fold every dirty blob of ``tag`` (durably); the first failure, raised."""
        failed = await self._fold_all([b for b in self.blobs.values() if b.tag.id == tag.id])
        if failed:
            raise failed[0][1]

    # -- helpers -----------------------------------------------------------------------------

    def _tag(self, tag: Tag) -> TagWrites:
        tw = self.tags.get(tag.id)
        if tw is None:
            tw = self.tags[tag.id] = TagWrites(view_size=tag.layout.size)
            self._names[tag.id] = tag.name
        return tw

    def _chunk_index(self, tag: Tag, name: str) -> int | None:
        prefix = tag.layout.blob_prefix
        return parse_index(name[len(prefix):]) if name.startswith(prefix) else None

    def _chunk_blob(self, tag: Tag, index: int) -> DirtyBlob:
        name = tag.layout.blob_name(index)
        blob = self.blobs.get((tag.id, name))
        if blob is None:
            base = CLEAN if index < tag.layout.num_blobs else NEW
            blob = self._add(DirtyBlob(tag, name, index, tag.layout.chunk_size, base))
        return blob

    def _user_uid(self, tag: Tag, name: str) -> int:
        uid = self.user_id(tag, name)
        if uid is None:
            raise FaultfsError(f"tag {tag.name} has no blob {name}", errno.ENOENT)
        return uid

    def _user_part(self, tag: Tag, uid: int, k: int) -> DirtyBlob:
        blob = self._parts.get((tag.id, uid), {}).get(k)
        if blob is None:
            blob = self._add(DirtyBlob(tag, part_name(uid, k), None, 0, NEW))
        return blob

    def _user_changed(self, blob: DirtyBlob) -> None:
        """A part of a user blob changed size: its size is worked out again when asked."""
        if blob.index is None and blob.name.startswith(USER_PREFIX):
            user = user_key(blob.name)
            if user is not None:
                self._user_sizes.pop((blob.tag.id, user[0]), None)

    def _blob_for(self, tag: Tag, name: str, *, create: bool) -> DirtyBlob | None:
        """The blob a journal record names, or None when it is gone (an unlinked user blob)."""
        blob = self.blobs.get((tag.id, name))
        if blob is not None or not create:
            return blob
        if name.startswith(USER_PREFIX):
            user = user_key(name)
            if user is None or user[0] not in self.tags[tag.id].users.values():
                return None
            blob = DirtyBlob(tag, name, None, 0, NEW)
        elif name.startswith(GAP_PREFIX):
            blob = DirtyBlob(tag, name, None, 0, NEW)  # grows with what was written
        else:
            index = self._chunk_index(tag, name)
            if index is None:
                return None
            base = CLEAN if index < tag.layout.num_blobs else NEW
            blob = DirtyBlob(tag, name, index, tag.layout.chunk_size, base)
        return self._add(blob)

    async def _save_state(self, tag: Tag) -> None:
        await self._save_state_id(tag.id)

    def _state_lock(self, tag_id: int) -> trio.Lock:
        lock = self._state_locks.get(tag_id)
        if lock is None:
            lock = self._state_locks[tag_id] = trio.Lock()
        return lock

    async def _save_state_id(self, tag_id: int) -> None:
        async with _Holding(self._state_lock(tag_id)):
            await self._write_state(tag_id)

    async def _write_state(self, tag_id: int) -> None:
        """Save a tag's write state as it is now (its state lock held)."""
        tw = self.tags[tag_id]
        if tw.damaged:
            return  # never written over: fsck reports it, the user decides
        name = self._names[tag_id]
        state = tw.saved()
        try:
            await self.pool.run(self.files.write_state, name, state)
        except OSError as exc:
            code = errno.ENOSPC if exc.errno in (errno.ENOSPC, errno.EDQUOT) else errno.EIO
            raise FaultfsError(f"saving the writes of tag {name} failed: {exc.strerror}",
                               code) from None



def _damaged(blob: DirtyBlob) -> FaultfsError:
    return FaultfsError(f"dirty blob {blob.name} of tag {blob.tag.name} is damaged "
                        f"({blob.damaged}): run faultfs fsck", errno.EIO)


def _too_big(tag: Tag, name: str, size: int) -> FaultfsError:
    return FaultfsError(f"user blob {name} of tag {tag.name} cannot grow to {size} bytes: a "
                        f"user blob holds at most {USER_BLOB_MAX >> 20} MiB", errno.EFBIG)


def part_name(uid: int, k: int) -> str:
    """The dirty blob of part ``k`` of user blob ``uid`` (part 0's is the blob's old name)."""
    return f"{USER_PREFIX}{uid}" if k == 0 else f"{USER_PREFIX}{uid}.{k}"


def user_key(name: str) -> tuple[int, int] | None:
    """``(user blob id, part)`` of a user blob's dirty blob name, None for any other."""
    if not name.startswith(USER_PREFIX):
        return None
    uid, dot, part = name[len(USER_PREFIX):].partition(".")
    a, b = parse_index(uid), (parse_index(part) if dot else 0)
    return None if a is None or b is None or (dot and b == 0) else (a, b)


def void_key(name: str) -> str:
    """The name a reset marks for ``name``: a user blob's first part for every part."""
    user = user_key(name)
    return name if user is None else part_name(user[0], 0)
