"""Resets: ``faultfs reset`` drops the writes of a tag (or of some of its blobs), back to the
source's bytes, with a void mark in the tag's write state; and, when that state's save fails,
puts back all it changed.

Invariants:
- A reset takes its blobs out of the table with its void mark, before anything awaits: a
  write answered from then on lies over the reset (a blob of its own, its record past the
  mark), in this mount as at a replay.
- While it saves its tag's state, the tag's other state saves and user blob table changes
  wait (its state lock), and no checkpoint runs (``Checkpoints.no_checkpoint``).
- One whose save fails changes nothing: what it changed is put back — void marks, user blob
  table, damaged marks, the view's size and mtime unless a write set them since — and its
  blobs return, counted and pinned as before, with what was written to their names meanwhile
  laid over them, as a replay applies their records (``_merged``).
- A dropped blob's files go only once the state with the void mark is durable.
- Every call is one change of its tag (``one_change``).
"""

from __future__ import annotations

import errno
import logging
import time
from dataclasses import replace

from faultfs.engine.changes import TagChanges, one_change
from faultfs.engine.tags import Tag
from faultfs.engine.writes.base import CleanReads
from faultfs.engine.writes.checkpoint import Checkpoints
from faultfs.engine.writes.damage import Damage
from faultfs.engine.writes.state import TagStates, TagWrites
from faultfs.engine.writes.table import (
    CLEAN,
    DIRECT,
    DirtyBlob,
    DirtyTable,
    chunk_index,
    part_name,
    resize,
)
from faultfs.errors import FaultfsError
from faultfs.iopool import IoPool
from faultfs.store.dirty import DirtyFiles
from faultfs.store.journal import Journal

log = logging.getLogger("faultfs.writes")


class Resets:
    """The resets of an engine's tags; see the module docstring for the rules."""

    def __init__(self, table: DirtyTable, states: TagStates, damage: Damage,
                 checkpoints: Checkpoints, clean: CleanReads, files: DirtyFiles,
                 journal: Journal, pool: IoPool, changes: TagChanges) -> None:
        self.table = table
        self.states = states
        self.damage = damage
        self.checkpoints = checkpoints
        self.clean = clean
        self.files = files
        self.journal = journal
        self.pool = pool
        self.changes = changes  # (``one_change``)

    @one_change
    async def reset(self, tag: Tag, names: list[str] | None = None) -> int:
        """Drop the writes of ``tag`` (of its blobs ``names``: chunks or user blobs): back to
        the source's bytes (a user blob back to empty). The dirty blobs dropped. A reset whose
        state save fails changes nothing (``_undo``)."""
        self.states.check_writable(tag)
        async with self.checkpoints.no_checkpoint():
            async with self.states.lock(tag.id):
                count, dropped = await self._reset(tag, names)
            for blob in dropped:
                if blob.base is DIRECT:  # void now (the state says so, durably): no replay needs it
                    await self.pool.run(self.checkpoints.delete_direct, [(tag.name, blob.direct)])
                if (tag.id, blob.name) not in self.table.blobs:  # a write since owns the file
                    await self.pool.run(self.files.delete, tag.name, blob.name)
            return count

    async def _reset(self, tag: Tag, names: list[str] | None) -> tuple[int, list[DirtyBlob]]:
        """``reset`` with its tag's state lock held: the count and the blobs dropped."""
        table = self.table
        tw = self.states.of(tag)
        seq = self.journal.last_seq
        # what the reset changes, put back if its save fails (the dicts it changes in place
        # are copied; the others it replaces)
        old = replace(tw, voided_blobs=dict(tw.voided_blobs),
                      damaged_blobs=dict(tw.damaged_blobs))
        was_changed = tag.id in table.changed
        grown_or_users = tw.view_size != tag.layout.size or bool(tw.users)
        if names is None:
            tw.voided = seq
            tw.view_size, tw.users, tw.parted = tag.layout.size, {}, set()
            tw.damaged_blobs = {}
            table.changed.discard(tag.id)
            gone = [key for key in table.blobs if key[0] == tag.id]
        else:
            # every name is checked before anything changes: a refused reset drops nothing
            # (a void mark left in memory would be saved by the next state save, and its
            # blob's writes would be gone at the next mount)
            for name in names:
                if name in tw.users or (tag.id, name) in table.blobs:
                    continue
                index = chunk_index(tag, name)
                if index is None or index >= self.states.num_chunks(tag):
                    raise FaultfsError(f"tag {tag.name} has no blob {name}", errno.ENOENT)
            gone = []
            for name in names:
                uid = tw.users.get(name)
                if uid is not None:  # every part of it: one void mark covers them all
                    tw.voided_blobs[part_name(uid, 0)] = seq
                    parts = [b.name for b in table.parts(tag, uid).values()]
                    for part in parts:
                        tw.damaged_blobs.pop(part, None)
                    gone += [(tag.id, part) for part in parts]
                    continue
                if (tag.id, name) not in table.blobs:
                    continue  # a chunk that was never written: nothing to drop
                tw.voided_blobs[name] = seq
                tw.damaged_blobs.pop(name, None)
                gone.append((tag.id, name))
        if gone or (names is None and grown_or_users):
            # the bytes changed: so does the mtime (an export's resume, make and rsync
            # tell a changed file by it), durably with the reset
            tw.mtime_ns = max(time.time_ns(), tw.mtime_ns + 1)
        marks = (tw.view_changes, tw.mtime_ns)  # a write since changes them: then they stay
        # out of the table with the void mark, before anything awaits: a write answered from
        # here on lies over the reset (a blob of its own, its record past the mark), in this
        # mount as at a replay (dropped after the state save, it was read by no one here and
        # replayed after a kill -9); their pins and counts go with them
        dropped = [table.forget(key) for key in gone if key in table.blobs]
        try:
            await self.states.write(tag.id)
        except BaseException as exc:
            aside = self._undo(tag, old, was_changed, marks, dropped)
            if isinstance(exc, FaultfsError):  # (cancelled: the save never started)
                await self._after_undo(tag, aside)
            raise
        return len(gone), dropped

    def _undo(self, tag: Tag, old: TagWrites, was_changed: bool, marks: tuple[int, int],
              dropped: list[DirtyBlob]) -> list[tuple[str, int]]:
        """Put back what a reset whose state save failed changed — the disk still replays
        every write it dropped, and the next state save would write its void marks — and
        only that: a view size or mtime a write set since stays (a replay applies the old
        size records, then the new one), and user blob tables waited for the reset. The
        dropped blobs go back into the table, pinned and counted as before, with what was
        written to their names since laid over them (``_merged``). The direct files of
        writes whose blob is damaged, to be set aside."""
        table = self.table
        tw = self.states.tags[tag.id]
        tw.voided, tw.voided_blobs = old.voided, old.voided_blobs
        tw.users, tw.parted = old.users, old.parted
        tw.damaged_blobs.update(old.damaged_blobs)
        if tw.view_changes == marks[0]:
            tw.view_size = old.view_size
        if tw.mtime_ns == marks[1]:
            tw.mtime_ns = old.mtime_ns
        if was_changed and tag.id not in table.changed:
            table.mark_changed(tag.id)
        aside: list[tuple[str, int]] = []
        for blob in dropped:
            key = (tag.id, blob.name)
            new = table.blobs.get(key)
            if new is not None:
                table.forget(key)
            blob = blob if new is None else self._merged(blob, new, aside)
            table.add(blob)
            if blob.index is not None:  # its source chunk is kept while writes lie over it
                if blob.base is not CLEAN or blob.damaged:
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
        file, in ``aside``) are kept with them. Both are out of the table: what is done to
        them is counted when the one returned is added back."""
        if old.damaged:
            self.damage.keep_records(new)
            if new.base is DIRECT:
                aside.append((new.tag.name, new.direct))
            return old
        if new.index is not None and (new.base is DIRECT or new.pending.covers(0, new.size)):
            if old.base is DIRECT:  # a replay still reads it (its record is kept): until a trim
                self.table.obsolete.append((old.tag.name, old.direct))
            return new
        if new.cut >= 0:
            resize(old, new.cut)
        for start, length, data in new.pending.items():
            if data is None:
                old.pending.zero(start, length)
            else:
                old.pending.write(start, data)
        if old.index is None:  # (a chunk's size is fixed)
            old.size = new.size if new.cut >= 0 else max(old.size, new.size)
        if old.base is CLEAN and old.base_bytes is None:
            self.table.set_base_bytes(old, new.base_bytes)
        if new.damaged:
            self.damage.note(old, new.damaged)
        return old

    async def _after_undo(self, tag: Tag, aside: list[tuple[str, int]]) -> None:
        """After ``_undo``: the state as it is now is saved over the one that failed, which
        may have replaced the file before it failed (its directory not synced) — so a kill -9
        never replays the reset — and the direct files in ``aside`` are set aside with their
        damaged blob's records. Both best effort: a save that fails before its rename
        changes nothing."""
        await self.states.write_again(tag, "the state before the failed reset")
        for tag_name, seq in aside:
            try:
                await self.pool.run(self.files.set_aside_direct, tag_name, seq,
                                    self.journal.damaged_dir)
            except OSError as exc:
                log.error("keeping direct file %d of tag %s: %s", seq, tag_name, exc.strerror)

