"""SharedRefresh: the tags other nodes registered in the shared store since this mount, added
to it when a lookup misses (DESIGN §13).

Invariants:
- One look at a time, at most once per ``REFRESH_S``, and none while the shared store is
  failing or the local store is degraded: a lookup of an unknown name costs at most one
  listing of the shared registry per interval, whoever asks.
- A tag forgotten in this mount is not brought back until a remount; one whose entry does
  not import or cannot be served is logged and left out, the others are added.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from faultfs.engine.sharing import SharedRegistry
from faultfs.engine.tags import Recovery, Tag, Tags
from faultfs.errors import FaultfsError
from faultfs.iopool import IoPool
from faultfs.stats import Stats
from faultfs.store.blobstore import BlobStore
from faultfs.tiers.multilevel import TierStack

log = logging.getLogger("faultfs.engine")

REFRESH_S = 5.0  # a lookup of an unknown tag looks in the shared store at most this often


class SharedRefresh:
    """Looks for the tags other nodes registered; see the module docstring for the rules."""

    def __init__(self, sharing: SharedRegistry | None, store: BlobStore, tiers: TierStack,
                 tags: Tags, pool: IoPool, stats: Stats, open_writes: Callable[[Tag], None],
                 forgotten: set[str]) -> None:
        self.sharing = sharing
        self.store = store
        self.tiers = tiers
        self.tags = tags
        self.pool = pool
        self.stats = stats
        self.open_writes = open_writes  # a tag added: its writes (none yet) are opened
        self.forgotten = forgotten  # not brought back by a refresh until a remount
        self._refreshed_at = float("-inf")  # the last look for tags other nodes registered
        self._refreshing: trio.Event | None = None

    async def refresh(self) -> list[str]:
        """Add the tags other nodes registered in the shared store since this mount (at most
        once per ``REFRESH_S``; never while the shared store is failing); their names."""
        sharing, shared = self.sharing, self.tiers.shared
        if sharing is None or shared is None or not shared.up or self.store.degraded:
            return []
        if self._refreshing is not None:
            await self._refreshing.wait()  # one look at a time: its result is everyone's
            return []
        if trio.current_time() - self._refreshed_at < REFRESH_S:
            return []
        self._refreshing = trio.Event()
        try:
            return await self._refresh(sharing)
        finally:
            self._refreshed_at = trio.current_time()
            self._refreshing.set()
            self._refreshing = None

    async def _refresh(self, sharing: SharedRegistry) -> list[str]:
        try:
            entries = await self.pool.run(sharing.fetch)
        except OSError as exc:
            log.warning("shared store %s: looking for new tags failed: %s", sharing.url,
                        exc.strerror or exc)
            self.stats.add("shared_errors")
            return []
        known = self.tags.by_name
        new = {n for n in entries if n not in known and n not in self.forgotten}
        if not new:
            return []

        def prepare() -> list[Recovery]:
            try:
                names = sharing.import_into(self.store, set(known), only=new)
            except FaultfsError as exc:
                log.warning("tags from the shared store: %s", exc.message)
                return []
            out = []
            for name in names:
                try:
                    out.append(self.tags.open_recovered(entries[name].ctx))
                except FaultfsError as exc:
                    log.warning("tag %s from the shared store cannot be served: %s", name,
                                exc.message)
            return out

        added = []
        for rec in await self.pool.run(prepare):
            if rec.ctx.dst in known:
                continue
            self.tags.registry[rec.ctx.key] = entries[rec.ctx.dst].data
            tag = self.tags.add_recovered(rec)
            self.open_writes(tag)
            await self.pool.run(self.tags.record_recovered, tag)
            added.append(tag.name)
        if added:
            log.info("tags registered by other nodes: %s", ", ".join(added))
        return added
