"""The upkeep of the claims a node holds (a mixin of ``ClaimBoard``, DESIGN §17): a later
fault of the holder outside a claim's blobs grows it, and a live holder renews its deadline.

Invariants:
- A grow or a renewal is a conditional replace of the holder's own object (If-Match on its
  tag): a claim taken over after its deadline is never replaced by its old holder (it is
  ``lost``; the taker fetches from then on). Each one names in ``done`` the blobs the
  claim's faults published so far, so that a node taking a killed holder's claim over
  carries them on in its own (blobs published since the last renewal stay unnamed: the
  taker's faults look for their own in the store, ``Held.unindexed``).
- While the node looks alone (``Mailbox.company`` false: it has met no other node) nobody
  waits on its claims, so a grow is deferred: the claim's ``want`` grows, and the next
  renewal (which covers ``want``) or the moment the node meets another (``in_company``:
  it rang one, or its mailbox was rung) sends it. A node arriving meanwhile waits on the
  blobs the claim names and rings the holder, whose deferred grows then go within a
  mailbox look; the waiter's first bound is doubled for that (``ClaimBoard._ring``).
- A claim renews each time half of its lease is gone, ``RENEW_MIN_S`` apart at least (a
  grow between two renewals keeps the deadline or pushes it on, never brings it nearer:
  the renewal is timed by the deadline before it); a
  settled claim (fetched, publishes held back) or any claim of a node alone doubles its
  lease at each renewal up to ``SETTLED_LEASE_MAX_S``, and a claim made alone starts at
  ``ALONE_LEASE_S``: fewer requests over a long read. What that costs: a node that comes
  to a dead lone holder waits up to that long for a window, or its own estimate of the
  fetch once it has measured its source (never a failure: it then takes the window over).
- In company a claim renews at least every half of its node's own lease for ONE blob,
  whatever its own lease and size (``_renew_in``; ``in_company`` re-times the sleeps under
  way): a waiter whose bound passed takes a renewal within that bound as the sign its holder
  lives, and leaves a live holder its claim (``ClaimBoard._window``); its bound is its own
  lease of the blobs it waits for, one blob at least (renewing by the claim's size let a
  whole-window claim on a slow source renew more slowly than a one-blob waiter's bound,
  which took the live holder over).
- While the node holds claims and looks alone, it looks at its mailbox (``_watch``: soon,
  then every ``LOOK_EVERY_S``), so that a waiter's ring turns it to company pace within a
  look even when no publish of it is held back (a lone holder mid-fetch kept renewing every
  2 s, unseen within a waiter's bound, and was taken over live).
"""

from __future__ import annotations

import logging
import time

import trio

from faultfs.tiers.base import TierTag
from faultfs.tiers.claims import Claim, done_mask, now_ms
from faultfs.tiers.held import Held, claim_span

log = logging.getLogger("faultfs.shared")

RENEW_MIN_S = 0.2  # a holder renews its claim's deadline at most this often
# a settled claim (fetched, publishes held back) doubles its lease at each renewal up to this:
# fewer renewals over a long read; a waiter that has not measured its source waits up to it
# on a dead holder (a live one is rung and publishes)
SETTLED_LEASE_MAX_S = 4.0
# a claim made while its node looks alone (attached to a mount) starts with this lease: a
# lone read of a few seconds renews nothing; a node that comes to a dead lone holder waits
# this long at most, as on a settled claim, or its own estimate once it has one
ALONE_LEASE_S = SETTLED_LEASE_MAX_S
# a node holding claims alone looks at its mailbox this soon, doubling up to every
# LOOK_EVERY_S (one GET each): a waiter's ring reaches it within that
LOOK_FIRST_S = 0.1
LOOK_EVERY_S = 0.5


class ClaimUpkeep:
    """``in_company``: the mixin's face (the board calls ``_join`` and ``_renew``)."""

    async def _join(self, tag: TierTag, mine: Held, need: list[int], ahead: bool) -> Held:
        """A fault of this node shares its claim ``mine``; grown to cover ``need``."""
        mine.users += 1
        mine.idle += 1  # a release holding it on for this fault sees it came
        mine.ahead = mine.ahead or ahead
        lo, hi = claim_span(tag, mine.window, need, ahead)
        first, end = mine.want
        if lo < first or hi > end:
            mine.want = (min(lo, first), max(hi, end))
            if self._nursery is None:
                await self._grow(tag, mine)
            elif self.mailbox.company:
                self._nursery.start_soon(self._grow, tag, mine)
            else:  # alone: nobody waits for them; the next renewal covers them
                self._deferred[id(mine)] = (tag, mine)
                self.stats.add("claims_grow_deferred")
        return mine

    def _watch_alone(self) -> None:
        """Look at this node's mailbox while it holds claims alone (attached to a mount)."""
        if self._nursery is not None and not self.mailbox.company and not self._watching:
            self._watching = True
            self._nursery.start_soon(self._watch)

    async def _watch(self) -> None:
        every = LOOK_FIRST_S
        try:
            while self._mine and not self.mailbox.company:
                await trio.sleep(every)
                every = min(LOOK_EVERY_S, every * 2)
                if self._mine and await self._io(self.mailbox.look):
                    self.in_company()
        except Exception:  # a background task must never take the mount down
            log.exception("looking at this node's mailbox failed")
        finally:
            self._watching = False

    def in_company(self) -> None:
        """This node met another (it rang one, or its mailbox was rung): the grows deferred
        while it looked alone go now, so the others wait for those blobs (trio context)."""
        deferred, self._deferred = self._deferred, {}
        if self._nursery is None:
            return
        for tag, h in deferred.values():
            self._nursery.start_soon(self._grow, tag, h)
        for h in self._mine.values():  # renewals timed by a long lease made alone: re-timed
            if h.renewing is not None:
                h.retime = True
                h.renewing.cancel()

    async def _grow(self, tag: TierTag, h: Held, *, renew: bool = False) -> None:
        """Replace ``h``'s object by one covering ``h.want`` with a renewed deadline (If-Match
        on its tag): waiters then wait for those blobs too, and nobody takes them over.
        ``renew``: the deadline alone, even when it covers them already."""
        async with h.lock:
            lo, hi = h.want
            first, end = h.covers
            if h.lost or (not renew and first <= lo and hi <= end):
                return
            lo, hi = min(lo, first), max(hi, end)
            c = h.claim
            lease = self.lease((hi - lo) * tag.blob_size)
            if renew and (h.settled or not self.mailbox.company):
                # only its publishes are left, or nobody else reads: a longer lease, bounded
                lease = max(lease, min(SETTLED_LEASE_MAX_S, 2 * h.lease_s))
            deadline = now_ms() + int(1000 * lease)
            if not renew:  # a grow never brings the deadline nearer: ``_renew`` sleeps
                deadline = max(deadline, c.deadline_ms)  # until half of the old one is gone
            else:
                h.lease_s = lease
            # what its faults published so far: a taker (this node killed) carries it on
            done = c.done | done_mask(h.window * h.per, h.fetched)
            claim = Claim(self.node, c.gen, deadline, lo, hi - lo, done=done)
            try:
                etag = await self._io(self.store.replace, h.key, claim.encode(), h.etag)
            except OSError as exc:
                self.stats.add("claim_errors")
                log.warning("growing claim %s failed (%s)", h.key, exc.strerror or exc)
                return
            if etag is None:  # taken over after its deadline: the taker fetches from now on
                h.lost = True
                self._deferred.pop(id(h), None)
                if self._mine.get((h.tag_id, h.window)) is h:
                    del self._mine[(h.tag_id, h.window)]
                log.info("tag %s: the claim of window %d was taken over", tag.name, h.window)
                return
            h.etag, h.claim = etag, claim
            self._deferred.pop(id(h), None)
            self.stats.add("claims_renewed" if renew and (lo, hi) == (first, end)
                           else "claims_grown")

    async def _renew(self, tag: TierTag, h: Held) -> None:
        """While this node holds ``h``, renew its deadline each time half its lease is gone: a
        live holder slowed down (a busy machine, a slow publish) keeps its claim, and only a
        dead one (which renews nothing) is taken over after its deadline. In company, at least
        every half of this node's own lease of one blob (``_renew_in``): a waiter reads a
        renewal within its own bound as a sign the holder lives, so neither a long lease made
        alone nor a large claim may hide it (``in_company`` re-times the sleeps under way)."""
        while not h.lost:
            with trio.move_on_after(self._renew_in(tag, h)) as scope:
                h.renewing = scope
                await trio.sleep_forever()
            h.renewing = None
            if h.retime:  # the node met another: its renewals' cadence changed
                h.retime = False
                continue
            await self._grow(tag, h, renew=True)

    def _renew_in(self, tag: TierTag, h: Held) -> float:
        """Seconds until ``h``'s next renewal."""
        wait = h.claim.deadline_ms / 1000 - time.time() - h.lease_s / 2
        if self.mailbox.company:
            wait = min(wait, self.lease(tag.blob_size) / 2)
        return max(RENEW_MIN_S, wait)
