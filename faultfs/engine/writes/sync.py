"""Group commit: ``fsync`` makes every acknowledged write durable — the direct files written since
the last sync, then the journal — and the fsyncs that queue behind a sync are answered by it.

Invariants:
- Syncs run one at a time, and one that returns covers every direct file another took before
  it: the files named below a sync's start seq were written, journaled and listed with no
  await between, so each is in what the sync took or in what an earlier one synced.
- An fsync called before a sync that succeeded took its files has nothing left to do (N
  writers fsyncing at once cost two syncs, not N); a sync that fails hands its files to the
  next one.
"""

from __future__ import annotations

import errno

import trio

from faultfs.errors import FaultfsError
from faultfs.iopool import IoPool
from faultfs.stats import Stats
from faultfs.store.dirty import DirtyFiles
from faultfs.store.journal import Journal

SYNC_AT_ONCE = 8  # direct files an fsync syncs in parallel (the file system batches them)


class GroupCommit:
    """The syncs of a mount's writes; see the module docstring for the rules."""

    def __init__(self, files: DirtyFiles, journal: Journal, pool: IoPool, stats: Stats) -> None:
        self.files = files
        self.journal = journal
        self.pool = pool
        self.stats = stats
        self.unsynced: list[tuple[str, int]] = []  # (tag, seq) of direct files not synced yet
        self.syncing = trio.Lock()  # syncs one at a time: each covers what came before it
        # every record below this seq (and every direct file it names) was made durable by
        # a sync that succeeded: an fsync that waited behind that sync has nothing left to do
        self._synced_below = 0

    async def fsync(self) -> None:
        """Every write acknowledged so far survives a power loss once this returns."""
        self.stats.add("fsyncs")
        if not await self.sync():
            self.stats.add("fsyncs_joined")

    async def sync(self) -> bool:
        """Make every write acknowledged so far durable: the direct files written since the
        last sync (``SYNC_AT_ONCE`` at a time, then their directories), then the journal.
        False when an earlier caller's sync already covered this one (nothing was synced
        for it)."""
        want = self.journal.next_seq  # every change acknowledged before this call lies below
        async with self.syncing:
            if self._synced_below >= want:
                return False
            # no await from here to the take: every direct file named below ``start`` is
            # in ``taken`` (written, recorded and listed with no await between) or synced
            start = self.journal.next_seq
            taken, self.unsynced = self.unsynced, []
            try:
                await self.sync_files(taken)
            except BaseException:
                self.unsynced[:0] = taken  # the next sync tries them again
                raise
            await self.pool.run(self.journal.sync)
            self._synced_below = max(self._synced_below, start)
            return True

    async def sync_files(self, taken: list[tuple[str, int]]) -> None:
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

    def forget_tag(self, name: str) -> None:
        """Tag ``name`` is forgotten: its direct files go with its directory."""
        self.unsynced = [(t, q) for t, q in self.unsynced if t != name]
