"""Resets: ``faultfs reset`` drops the writes of a tag (or of some of its blobs), back to the
source's bytes — one journal record, replayed in order with the writes.

Invariants:
- A reset is answered once its record is appended and the journal synced (durable, as it
  always was), and it is made in memory right after the append, with nothing awaited
  between: a write answered from then on lies over the reset (a blob of its own, its record
  past the reset's), in this mount as at a replay. The record's seq is the void mark of what
  it drops (the tag's, or each blob's, in its write state); a replay makes the same change
  with the same code (``made``), so a crash at any point leaves the tag before the reset or
  after it, never a mix. A reset refused (a name the tag lacks, no room for its record)
  changes nothing.
- The record carries the tag's mtime after the reset (it changes when the bytes do: an
  export's resume, make and rsync tell a changed file by it), so a replay sets the same.
- A dropped blob's pin, count and held bytes go with it at once; its direct file goes once
  no record that names it can be replayed (``DirtyTable.obsolete``), its dirty file after
  the next checkpoint saved the state with the void mark (``DirtyTable.doomed``).
- Every call is one change of its tag (``one_change``).
"""

from __future__ import annotations

import errno
import time

from faultfs.engine.changes import TagChanges, one_change
from faultfs.engine.tags import Tag
from faultfs.engine.writes.blobwrite import append
from faultfs.engine.writes.state import TagStates
from faultfs.engine.writes.sync import GroupCommit
from faultfs.engine.writes.table import DIRECT, DirtyTable, chunk_index, part_name
from faultfs.errors import FaultfsError
from faultfs.store.journal import KIND_RESET, Journal


class Resets:
    """The resets of an engine's tags; see the module docstring for the rules."""

    def __init__(self, table: DirtyTable, states: TagStates, sync: GroupCommit,
                 journal: Journal, changes: TagChanges) -> None:
        self.table = table
        self.states = states
        self.sync = sync
        self.journal = journal
        self.changes = changes  # (``one_change``)

    @one_change
    async def reset(self, tag: Tag, names: list[str] | None = None) -> int:
        """Drop the writes of ``tag`` (of its blobs ``names``: chunks or user blobs): back to
        the source's bytes (a user blob back to empty). The dirty blobs dropped."""
        self.states.check_writable(tag)
        tw = self.states.of(tag)
        # every name is checked before anything changes: a refused reset drops nothing
        for name in names or ():
            if name in tw.users or (tag.id, name) in self.table.blobs:
                continue
            index = chunk_index(tag, name)
            if index is None or index >= self.states.num_chunks(tag):
                raise FaultfsError(f"tag {tag.name} has no blob {name}", errno.ENOENT)
        mtime = tw.mtime_ns
        if self._gone(tag, names) or (names is None and (
                tw.view_size != tag.layout.size or tw.users)):
            mtime = max(time.time_ns(), tw.mtime_ns + 1)  # the bytes change: so does it
        data = "\0".join(names).encode() if names is not None else b""
        seq = append(self.journal, KIND_RESET, tag.name, "", mtime, len(data), data)
        count = self.made(tag, names, seq, mtime)
        await self.sync.sync()  # durable before it is answered, as a reset always was
        return count

    def made(self, tag: Tag, names: list[str] | None, seq: int, mtime: int) -> int:
        """Reset ``seq`` of ``tag`` (of ``names``; None: the whole tag) is made: its void
        marks set, its blobs dropped. The number of dirty blobs dropped."""
        table = self.table
        tw = self.states.of(tag)
        gone = self._gone(tag, names)
        if names is None:
            tw.voided = seq
            tw.view_size, tw.users, tw.parted = tag.layout.size, {}, set()
            tw.damaged_blobs = {}
            table.changed.discard(tag.id)
            self.states.unsaved.add(tag.id)  # (its void mark is saved all the same)
        else:
            for name in names:
                uid = tw.users.get(name)
                key = name if uid is None else part_name(uid, 0)  # one mark: every part
                if uid is not None or (tag.id, name) in table.blobs:
                    tw.voided_blobs[key] = seq
            for _, name in gone:
                tw.damaged_blobs.pop(name, None)
        tw.mtime_ns = max(tw.mtime_ns, mtime)
        for key in gone:
            blob = table.forget(key)
            if blob.base is DIRECT:  # void now: deleted once no record names it
                table.obsolete.append((tag.name, blob.direct))
            table.doomed.append((tag.name, blob.name))
        return len(gone)

    def _gone(self, tag: Tag, names: list[str] | None) -> list[tuple[int, str]]:
        """The keys of the dirty blobs a reset of ``names`` (None: all) drops."""
        table = self.table
        if names is None:
            return [key for key in table.blobs if key[0] == tag.id]
        users = self.states.of(tag).users
        gone: list[tuple[int, str]] = []
        for name in names:
            uid = users.get(name)
            if uid is not None:  # every part of it
                gone += [(tag.id, b.name) for b in table.parts(tag, uid).values()]
            elif (tag.id, name) in table.blobs:
                gone.append((tag.id, name))
        return list(dict.fromkeys(gone))  # (a name given twice is dropped once)
