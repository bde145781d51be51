"""Damaged dirty blobs: a blob whose writes cannot be read back is kept, reported, and stops
being read, written, folded or cloned (EIO) until a reset drops it.

Invariants:
- Dirty data is never evicted, never replaced by a fault and never re-faulted: a damaged
  dirty file is EIO and is kept. So is a blob whose spilled write no longer verifies in the
  journal: its tag's write state names it at once (durably, before the read that found it
  returns), folds skip it, and the segments holding its records (``keep_segments``) and its
  direct file go to ``writes/damaged/`` when the journal lets go instead of being deleted,
  so every other blob is folded and the journal still trims.
- A clone of a tag with a damaged blob is refused: it would take the blob's older file.
"""

from __future__ import annotations

import errno
import logging

from faultfs.core.extents import Ref
from faultfs.engine.tags import Tag
from faultfs.engine.writes.state import TagStates
from faultfs.engine.writes.table import DIRECT, DirtyBlob, DirtyTable
from faultfs.errors import FaultfsError
from faultfs.iopool import IoPool
from faultfs.store.dirty import DirtyFiles
from faultfs.store.journal import Journal, Record

log = logging.getLogger("faultfs.writes")


class Damage:
    """The damaged blobs of the mount; see the module docstring for the rules."""

    def __init__(self, table: DirtyTable, states: TagStates, files: DirtyFiles,
                 journal: Journal, pool: IoPool) -> None:
        self.table = table
        self.states = states
        self.files = files
        self.journal = journal
        self.pool = pool
        self.keep_segments: set[int] = set()  # hold a damaged blob's records: kept at a trim

    def note(self, blob: DirtyBlob, why: str) -> None:
        """``mark`` in memory; the caller saves the tag's write state."""
        blob.damaged = why
        tw = self.states.tags[blob.tag.id]
        tw.damaged_blobs[blob.name] = {"reason": why, "size": blob.size}
        self.table.mark_changed(blob.tag.id)
        self.keep_records(blob)
        log.error("dirty blob %s of tag %s is damaged (%s): kept, reads of it fail with EIO "
                  "until faultfs reset drops its writes", blob.name, blob.tag.name, why)

    def keep_records(self, blob: DirtyBlob) -> None:
        """The segments holding ``blob``'s pending records are kept when the journal trims."""
        self.keep_segments.update(d.file for _, _, d in blob.pending.items()
                                  if isinstance(d, Ref))

    async def mark(self, blob: DirtyBlob, why: str) -> None:
        """``blob``'s writes cannot be read back: it reads and takes writes as EIO, is never
        folded or written over, and stays so across mounts — its tag's write state names it
        (saved now), the segments holding its records and its direct file are kept in
        writes/damaged/ when the journal lets them go — until a reset drops it."""
        if blob.damaged:
            return
        self.note(blob, why)
        try:
            await self.states.save(blob.tag.id)  # first: a kill after it knows it damaged
            if blob.base is DIRECT:  # as a remount will see it: no direct file under it
                seq = self.table.leave_direct(blob)
                await self.pool.run(self.files.set_aside_direct, blob.tag.name, seq,
                                    self.journal.damaged_dir)
        except (OSError, FaultfsError) as exc:  # the next checkpoint saves it again
            log.error("keeping damaged blob %s of tag %s: %s", blob.name, blob.tag.name, exc)

    def blob_of(self, tags: dict[str, Tag], rec: Record) -> DirtyBlob | None:
        """The damaged blob a journal record names (its records are kept, never applied)."""
        tag = tags.get(rec.tag)
        blob = None if tag is None else self.table.blobs.get((tag.id, rec.name))
        return blob if blob is not None and blob.damaged else None

    def refuse_clone(self, tag: Tag) -> None:
        damaged = sorted(b.name for b in self.table.of_tag(tag.id) if b.damaged)
        if damaged:  # a clone would take its older file, or none: never a damaged blob's bytes
            raise FaultfsError(f"tag {tag.name} has damaged dirty blobs "
                               f"({', '.join(damaged)}): reset them first", errno.EIO)


def damaged_error(blob: DirtyBlob) -> FaultfsError:
    return FaultfsError(f"dirty blob {blob.name} of tag {blob.tag.name} is damaged "
                        f"({blob.damaged}): run faultfs fsck", errno.EIO)
