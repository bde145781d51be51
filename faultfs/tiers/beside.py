"""Fetching beside the create: a node that looks alone, and whose last creates found their
windows empty, fetches a new window's blobs while the window's create is under way, not after
its round trip (DESIGN §17). A mixin of ``ClaimBoard`` (its store, its held claims, its
nursery).

Invariants:
- Only while the node looks alone (``Mailbox.company`` false), after ``SPECULATE_AFTER``
  creates in a row found their windows empty, and before any create made so has lost or
  failed; never for a window this node is claiming already, never without the mount's
  nursery.
- The fault holds the window at once (``_mine``: its node's other faults join it); growing
  and ending the claim wait for the create's answer (``Held.made``).
- The window is taken as empty, as a won create says it is. A create that loses (another
  node's claim, or a marker a node left) costs the blobs fetched meanwhile once more — one
  window's, once: the node is in company from then on (it publishes at once, claims nothing
  ahead) and never fetches beside a create again. A create that fails (the store) ends the
  hold the same way, without company.
"""

from __future__ import annotations

import logging
import time

import trio

from faultfs.tiers.base import TierTag
from faultfs.tiers.held import Held, claim_span

log = logging.getLogger("faultfs.shared")

# a node that looks alone and has won this many fresh windows in a row fetches a new window's
# blobs while its create is under way, not after it
SPECULATE_AFTER = 2


class BesideClaims:
    """``_speculates`` and ``_speculate``: the mixin's face to ``ClaimBoard._window``."""

    def _init_beside(self) -> None:
        self._fresh_wins = 0  # creates won in a row on windows with no object
        self._speculation_lost = False  # a create made beside its fetch lost: never again

    def _speculates(self, tag: TierTag, window: int) -> bool:
        """Whether this fault fetches its window's blobs beside the window's create: the node
        looks alone (no other node waited on it, nor it on another), its last
        ``SPECULATE_AFTER`` creates all found their windows empty, and no create made so has
        lost yet; nobody of this node is claiming the window already."""
        return (self._nursery is not None and not self.mailbox.company
                and not self._speculation_lost and self._fresh_wins >= SPECULATE_AFTER
                and (tag.id, window) not in self._claiming)

    def _speculate(self, tag: TierTag, window: int, key: str, need: list[int],
                   ahead: bool) -> Held:
        """Hold the window at once and make its create in the background (``_made``): the
        caller fetches meanwhile, without the create's round trip before its source read.
        The window is taken as empty, as a won create says it is. When the create loses
        (another node's claim, or a marker: a node that read the tag before), the blobs of
        the faults under way are fetched once more than needed — one window at most, once:
        this node makes no create so again."""
        assert self._nursery is not None
        claim = self._new_claim(tag, claim_span(tag, window, need, ahead), gen=1, done=0)
        held = Held(tag.id, window, key, "", claim, self.window_blobs(tag), ahead=ahead,
                    made=trio.Event())
        held.want = held.covers
        held.lease_s = max(0.0, claim.deadline_ms / 1000 - time.time())
        self._mine[(tag.id, window)] = held
        self.stats.add("shared_index_misses", len(need))
        self._nursery.start_soon(self._made, tag, held)
        return held

    async def _made(self, tag: TierTag, held: Held) -> None:
        """The create of a window held by ``_speculate``: won, the claim is renewed as any
        other; lost, or failed, the hold ends (nothing is marked; what was fetched is
        published unclaimed) and this node makes no create beside a fetch again."""
        try:
            await self._make(tag, held)
        finally:  # also when cancelled (unmounting): the claim's end waits for this
            if not held.etag:  # not won: not ours
                held.lost = True
                self._speculation_lost = True
            held.made.set()

    async def _make(self, tag: TierTag, held: Held) -> None:
        failed = False
        try:
            etag = await self._io(self.store.create, held.key, held.claim.encode())
        except OSError as exc:
            self.stats.add("claim_errors")
            log.warning("claiming %s failed (%s)", held.key, exc.strerror or exc)
            etag, failed = None, True
        except Exception:  # a background task must never take the mount down
            self.stats.add("claim_errors")
            log.exception("claiming %s failed", held.key)
            etag, failed = None, True
        if etag is not None:
            held.etag = etag
            self.stats.add("claims_won")
            self._fresh_wins += 1
            self._nursery.start_soon(self._renew, tag, held)  # type: ignore[union-attr]
            return
        if self._mine.get((held.tag_id, held.window)) is held:
            del self._mine[(held.tag_id, held.window)]
        if failed:
            return
        self.mailbox.company = True  # another node reads the tag (or did): publish at once
        self.stats.add("claims_lost_beside_fetch")
        log.info("tag %s: window %d was claimed or published by another node while this "
                 "node fetched it (fetched once more); from now on this node claims before "
                 "it fetches", tag.name, held.window)
