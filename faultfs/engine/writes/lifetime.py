"""A tag's writes begun from another's and dropped whole: ``faultfs clone`` gives a new tag its
parent's writes as they are at one instant, ``faultfs forget`` drops every write of a tag.

Invariants:
- A clone is its tag at one instant (DESIGN §12): every change of the tag is one change
  (``one_change``, ``engine/changes.py``). The clone folds the tag's blobs while it is
  written, then holds it still — its new changes wait before they start, those under way
  end — folds what was written meanwhile, links the files (a fold replaces a file, never
  writes it in place, so a link keeps this moment), copies the state (reset marks too) and
  lets go. Writers of the tag wait for those folds, the links and one state file, never for
  the first folds, and never while holding a lock.
- A clone of a tag with a damaged blob is refused (it would take the blob's older file).
- A forgotten tag's records are let go by a checkpoint at once, so none is replayed onto a
  later tag of that name.
"""

from __future__ import annotations

from dataclasses import replace

from faultfs.engine.changes import TagChanges
from faultfs.engine.tags import Tag
from faultfs.engine.writes.checkpoint import Checkpoints
from faultfs.engine.writes.damage import Damage
from faultfs.engine.writes.state import TagStates
from faultfs.engine.writes.sync import GroupCommit
from faultfs.engine.writes.table import DirtyTable
from faultfs.iopool import IoPool
from faultfs.store.dirty import DirtyFiles
from faultfs.store.journal import Journal


class TagLifetime:
    """Clones and forgets of an engine's tags' writes; see the module docstring."""

    def __init__(self, table: DirtyTable, states: TagStates, damage: Damage,
                 checkpoints: Checkpoints, sync: GroupCommit, files: DirtyFiles,
                 journal: Journal, pool: IoPool, changes: TagChanges) -> None:
        self.table = table
        self.states = states
        self.damage = damage
        self.checkpoints = checkpoints
        self.sync = sync
        self.files = files
        self.journal = journal
        self.pool = pool
        self.changes = changes

    def has_writes(self, tag: Tag) -> bool:
        tw = self.states.tags.get(tag.id)
        return bool(self.table.dirty_summary(tag)[0]) or (tw is not None and (
            bool(tw.users) or tw.view_size != tag.layout.size))

    async def forget_tag(self, tag: Tag) -> None:
        """Drop every write of ``tag`` and its files (``faultfs forget``); a checkpoint then
        lets the journal go, so no record of it is replayed onto a later tag of that name."""
        for key in [k for k in self.table.blobs if k[0] == tag.id]:
            self.table.forget(key)  # (a direct file goes with the tag's directory)
        self.checkpoints.forget_tag(tag.name)
        self.sync.forget_tag(tag.name)
        self.table.changed.discard(tag.id)
        name = self.states.forget(tag)
        if self.states.writable:
            await self.pool.run(self.files.forget_tag, name)
            await self.checkpoints.checkpoint()

    async def prepare_clone(self, parent: Tag, child: str) -> None:
        """Give tag ``child`` (not registered yet) ``parent``'s writes as they are at one
        instant (DESIGN §12): every dirty blob of the parent folded, its files linked, the
        parent's write state copied — all while the parent is held still
        (``TagChanges.hold``): its changes wait, and those under way end first. Folding one
        blob after another while writes went on let a clone take a write without one
        answered before it. The blobs are folded once before the hold, so under it only
        those written meanwhile are folded again: writers of the tag wait for those folds,
        the links and one state file, never for the bulk."""
        self.damage.refuse_clone(parent)
        await self.checkpoints.fold_tag(parent)
        async with self.changes.hold(parent.id):
            await self.checkpoints.fold_tag(parent)
            self.damage.refuse_clone(parent)  # (also a blob a fold just found damaged)
            ptw = self.states.of(parent)
            # the reset marks too: a file a reset left behind (killed before deleting it) is
            # linked with the others, and a mount of the clone must skip it as the parent's does
            state = replace(ptw.saved(), view_seq=self.journal.last_seq,
                            ancestors=(parent.name, *ptw.ancestors), damaged_blobs={})

            def link() -> None:
                self.files.forget_tag(child)  # a clone that crashed before it was registered
                self.files.link_from(parent.name, child)
                self.files.write_state(child, state)

            await self.pool.run(link)
