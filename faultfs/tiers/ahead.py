"""Windows claimed ahead of a sequential reader, off its faults' path (DESIGN §17).

A window's claim create is a round trip to the shared store; made by the first fault of the
window, it sits between that fault and its source read, and a prefetch run entering a new
window waits for it with every run of the window behind it. A node that looks alone
(``Mailbox.company`` false: it has met no other node) claims the next windows its sequential
reader's prefetch will reach before the prefetch gets there, in the background; the faults of
a window claimed ahead join the claim (``ClaimBoard._mine``) without a request. A mixin of
``ClaimBoard`` (its keys, its store, its held claims).

Invariants:
- Only a create: a window with any object (another node's live claim, a marker) is left to
  the faults that need it, which read it as before (without a create of their own: the
  create ahead just lost, ``_taken``). A claim made ahead covers its whole
  window (its prefetch will fetch all of it), renewed as any held claim.
- Faults of a window whose create ahead is under way wait for its answer
  (``ClaimBoard._claiming``), as for any create of this node: they never find their own
  node's claim and wait on it as on another's.
- A claim made ahead that no fault joined is ended (deleted: nothing of it was published)
  ``AHEAD_HOLD_S`` after it was made, and at once when the node turns out to be in company
  (another node waited on it, or it on another: the others would wait on a window nobody
  fetches yet): a node claims ahead only what its own reader is about to reach.
- Each window of a tag is tried ahead at most once (``_ahead_to``: the furthest tried): a
  reader moving on by a blob costs no request.
- In company (a node that waited on another, or was told one waits on it) nothing is claimed
  ahead: windows are claimed by the faults that need them, and nodes reading together meet
  on the windows as before.
"""

from __future__ import annotations

import contextlib
import logging
import time

import trio

from faultfs.tiers.base import TierTag

log = logging.getLogger("faultfs.shared")

# a claim made ahead that no fault joined this long after it was made ends (the reader
# stopped, went elsewhere, or is slower than this for two windows)
AHEAD_HOLD_S = 2.0
AHEAD_TICK_S = 0.1  # ... looked at this often (joined? in company?)


class AheadClaims:
    """``claim_ahead``: the mixin's face."""

    def _init_ahead(self) -> None:
        self._ahead_to: dict[int, int] = {}  # tag id: the furthest window tried ahead
        # windows whose create ahead lost: their next fault reads the object, no create
        self._taken: dict[tuple[int, int], bool] = {}
        self.ahead_hold_s = AHEAD_HOLD_S

    def claim_ahead(self, tag: TierTag, last: int) -> int:
        """Claim, in the background, the windows of ``tag`` up to the one of blob ``last``
        that were not tried yet, while this node looks alone; how many were started."""
        nursery = self._nursery
        if nursery is None or self.mailbox.company or tag.num_blobs <= 0:
            return 0
        per = self.window_blobs(tag)
        lo = self._ahead_to.get(tag.id, -1) + 1
        hi = min(last, tag.num_blobs - 1) // per
        if hi < lo:
            return 0
        self._ahead_to[tag.id] = hi
        started = 0
        for window in range(lo, hi + 1):
            if (tag.id, window) in self._mine or (tag.id, window) in self._claiming:
                continue
            event = self._claiming[(tag.id, window)] = trio.Event()
            nursery.start_soon(self._claim_ahead, tag, window, event)
            started += 1
        return started

    async def _claim_ahead(self, tag: TierTag, window: int,
                           event: trio.Event) -> None:
        try:
            await self._ahead_one(tag, window, event)
        except Exception:  # a background task must never take the mount down
            log.exception("tag %s: claiming window %d ahead failed", tag.name, window)

    async def _ahead_one(self, tag: TierTag, window: int,
                         event: trio.Event) -> None:
        per = self.window_blobs(tag)
        span = (window * per, min((window + 1) * per, tag.num_blobs))
        held = None
        try:
            claim = self._new_claim(tag, span, gen=1, done=0)
            key = self._key(tag, window)
            etag = await self._io(self.store.create, key, claim.encode())
            if etag is None:  # another node's claim or a marker: the faults read it
                self._taken[(tag.id, window)] = True
            else:
                self.stats.add("claims_won")
                self.stats.add("claims_ahead")
                held = self._hold(tag, window, key, etag, claim, True)
                held.users = 0  # none yet: the first fault of the window joins it
        except OSError as exc:
            self.stats.add("claim_errors")
            log.warning("shared store %s: claiming window %d ahead failed (%s)", tag.name,
                        window, exc.strerror or exc)
        finally:
            if self._claiming.get((tag.id, window)) is event:
                del self._claiming[(tag.id, window)]
            event.set()
        if held is None:
            return
        made = time.monotonic()
        with contextlib.suppress(trio.Cancelled):  # unmounting: end it now
            while True:
                await trio.sleep(AHEAD_TICK_S)
                if held.idle or held.lost:
                    return  # joined: its last user releases it
                if self.mailbox.company or time.monotonic() - made >= self.ahead_hold_s:
                    break  # others read too (they would wait on it), or no reader came
        log.info("tag %s: window %d was claimed ahead and not read: ending it", tag.name,
                 window)
        await self._finish([held])
