"""Cross-node single flight: before a node reads blobs from the source it claims their window
in the shared store; a node that finds another's live claim waits for the blobs to land there
instead of fetching them itself (DESIGN §17). The object store is the only coordinator.

A window is ``CLAIM_WINDOW_BYTES`` of adjacent blobs (aligned), so a sequential or prefetched
run costs one claim (two where it straddles a boundary; prefetch runs stop at one), not one a
blob; while the node looks alone, the windows ahead of a sequential reader's prefetch are
claimed before it gets there, off the faults' path (``ahead.py``). A claim says which blobs
of the window its holder fetches, by whom, until when (``claims.Claim``).

Invariants:
- A window's claim object, once made, stays: released, it is a ``published`` marker whose
  ``done`` lists the blobs published under the window's claims (each holder adds what it
  fetched; a takeover carries it on). It is the window's index: a node whose create wins
  (no object) knows nothing of the window was published under a claim and reads the source
  without a GET per blob; one that finds an object loads the blobs its ``done`` names.
  Blobs published without a claim (claims off, a claim request that failed) are not in it:
  a node with claims may fetch such a blob once more and writes its own over it (a claimed
  publish is unconditional: the marker names only what its holder wrote).
- A node holds at most one claim per window; its own later faults of the window share it
  (``_mine``, counted by users) and the last one releases it, after the blobs it fetched are
  published, so a waiter that sees the claim gone finds them (or claims the window itself).
- The claim object says what its holder fetches: a later fault of the holder outside the
  claimed blobs grows the claim to cover them (a conditional replace of its own object, which
  also renews the deadline; behind the fetch when attached to a mount, and deferred while the
  node looks alone: ``upkeep.py``; each grow and renewal also names in ``done`` what the
  claim's faults published so far), and the ``published`` marker a release leaves adds what
  it fetched under the claim, all of it, to ``done``. A
  prefetch run claims to the window's end (its next runs follow), and the last user's
  release of such a claim waits ``IDLE_HOLD_S`` for them before it lets the rest go.
- A claim's deadline is its holder's bound: ``lease`` = three times the node's own estimate
  of the fetch (the fetch, its publish, the waiters' load), plus ``LEASE_SLACK_S``; a live
  holder renews it each time half of it is gone (``_renew``), so only a dead or cut-off one
  lets it pass. After it, any node may take the claim over with a conditional replace, and
  exactly one does; the blob is then fetched at most twice. The taker looks in the store
  for every blob its faults of the window need (``Held.unindexed``: the holder before may
  have published blobs since its last renewal that no ``done`` names yet) and its marker
  names those it found, besides those the claim it replaced named.
- A waiter takes each blob the holder publishes soon after it lands (it polls two of them
  with the claim, and all once one landed: ``poll_blobs``). Its wait is bounded by the claim's
  deadline and, per generation of the claim and since the last blob that landed, by its own
  estimate of fetching the rest itself (``lease`` of its own measurements; before it has
  any, the holder's, read from the claim's deadline, ``LEASE_MAX_S`` at most in all:
  ``patience``). Then, when the holder has not grown or renewed its claim within that
  bound, it takes the claim over (one waiter wins; the others wait on it, a new bound); when
  it has (it lives), the waiter fetches its blobs itself and leaves the claim to its holder,
  which goes on fetching the rest (a takeover of a live holder made both fetch the window's
  next blobs until the holder saw it). A holder that dies just after a renewal costs the
  blobs given up on in that bound, fetched once more by each node that gave up, then its
  claim expires and is taken over. A slow or dead peer costs latency, never a failure or
  wrong bytes.
- Any failure of the store ends the coordination for that fault: the caller fetches from the
  source (the shared tier's back-off keeps later faults from trying meanwhile).
- A claim whose holder is past its deadline is never replaced by it (If-Match); an expired
  claim nobody took over is turned into its marker, or removed when nothing of its window was
  published, by ``faultfs gc``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Iterable

import trio

from faultfs.errors import CorruptionError
from faultfs.iopool import run_in_thread
from faultfs.stats import Stats
from faultfs.tiers.ahead import AheadClaims
from faultfs.tiers.base import Buffer, TierTag, version_hash
from faultfs.tiers.claims import Claim, ClaimStore, claim_key, done_mask, now_ms
from faultfs.tiers.estimate import LEASE_MAX_S, FetchEstimate
from faultfs.tiers.held import Held, claim_span, window_blobs
from faultfs.tiers.mailbox import MAILBOX_PREFIX, Mailbox, stale_mailbox
from faultfs.tiers.upkeep import ALONE_LEASE_S, ClaimUpkeep

log = logging.getLogger("faultfs.shared")

CLAIM_THREADS = 8  # claim requests have threads of their own, apart from loads and publishes
# a waiter looks at the claim this often (doubling; back to the first once a blob landed)
POLL_FIRST_S, POLL_MAX_S = 0.02, 0.2
POLL_PROBE_BLOBS = 2  # and at this many of the blobs it waits for (``poll_blobs``)
# a prefetch's claim to the window's end outlives a pause between its runs by this much: its
# next run rejoins it instead of another node taking the blobs it was about to fetch
IDLE_HOLD_S = 1.0
OCCUPIED_MAX = 1 << 16  # windows remembered as holding an object (a few MiB at most)


def node_id() -> str:
    """This daemon among the nodes: host, process, and a random part (pids repeat)."""
    return f"{socket.gethostname()[:40]}-{os.getpid()}-{secrets.token_hex(4)}"


Loader = Callable[[list[int]], Awaitable[dict[int, Buffer]]]


class ClaimBoard(FetchEstimate, AheadClaims, ClaimUpkeep):
    def __init__(self, store: ClaimStore, stats: Stats, *, node: str | None = None) -> None:
        self.store = store
        self.stats = stats
        self.node = node or node_id()
        self.mode = store.mode
        self.mailbox = Mailbox(store, self.node, stats)  # who waits on whom
        self._mine: dict[tuple[int, int], Held] = {}
        # windows this node is claiming now: its other faults of them wait for the answer
        # rather than find their own node's claim and wait on it as on another node's
        self._claiming: dict[tuple[int, int], trio.Event] = {}
        # windows this node saw an object at, oldest first (``_attempt`` reads them first)
        self._occupied: dict[tuple[int, int], None] = {}
        # claims whose grows wait while this node looks alone (``_join``, ``in_company``)
        self._deferred: dict[int, tuple[TierTag, Held]] = {}
        self._watching = False  # the look at the mailbox while alone runs (upkeep._watch)
        self._limiter: trio.CapacityLimiter | None = None
        FetchEstimate.__init__(self)
        self._init_ahead()
        self.idle_hold_s = IDLE_HOLD_S
        self._nursery: trio.Nursery | None = None

    def attach(self, nursery: trio.Nursery) -> None:
        """Grow claims in ``nursery`` (the mount's), beside the fetch; without it, inline."""
        self._nursery = nursery

    # -- keys --------------------------------------------------------------------------------

    window_blobs = staticmethod(window_blobs)

    def _key(self, tag: TierTag, window: int) -> str:
        from urllib.parse import quote

        fault = tag.key.split(":", 1)[-1] or quote(tag.name, safe="")
        return claim_key(fault, version_hash(tag.version), window)

    async def _io(self, fn, *args):
        if self._limiter is None:
            self._limiter = trio.CapacityLimiter(CLAIM_THREADS)
        return await run_in_thread(self._limiter, fn, *args)

    # -- the fault path ----------------------------------------------------------------------

    async def coordinate(self, tag: TierTag, missing: list[int], load: Loader, *,
                         ahead: bool = False) -> tuple[dict[int, Buffer], list[Held]]:
        """Before blobs ``missing`` of ``tag`` (not staged here) are read from the source:
        claim their windows, or wait for other nodes' claims on them. Returns the blobs found
        in the shared store (``load`` reads them: those the window's index names, those that
        landed while this node waited) and the claims now held, which the caller releases
        (``release``) once it has published what it fetched. Every blob not returned is the
        caller's to fetch: under a claim it holds, or because the wait ended (or a claim
        request failed: then ``load`` was asked for them first). ``ahead``: a prefetch run,
        whose next runs fetch the rest of the window: claim it to the window's end."""
        per = self.window_blobs(tag)
        windows: dict[int, list[int]] = {}
        for index in missing:
            windows.setdefault(index // per, []).append(index)
        got: dict[int, Buffer] = {}
        held: list[Held] = []

        async def one(window: int, need: list[int]) -> None:
            found, mine = await self._window(tag, window, need, load, ahead)
            got.update(found)
            if mine is not None:
                held.append(mine)

        if len(windows) == 1:
            [(window, need)] = windows.items()
            await one(window, need)
        else:
            async with trio.open_nursery() as nursery:
                for window, need in windows.items():
                    nursery.start_soon(one, window, need)
        return got, held

    async def _indexed(self, tag: TierTag, held: Held, need: list[int], load: Loader,
                       *, everything: bool = False) -> dict[int, Buffer]:
        """The blobs of ``need`` that the index of ``held``'s window names (``everything``:
        all of ``need``; so for every fault under a claim taken over from a holder, which
        may have published blobs it never marked); the rest are known absent without a
        request each. Blobs found that way are named by the claim's marker too."""
        everything = everything or held.unindexed
        ask = need if everything else held.claim.published_of(held.window * held.per, need)
        got = await load(ask) if ask else {}
        self.stats.add("shared_index_misses", len(need) - len(ask))
        if everything:
            held.fetched.update(got)
        return got

    async def _window(self, tag: TierTag, window: int, need: list[int], load: Loader,
                      ahead: bool = False) -> tuple[dict[int, Buffer], Held | None]:
        mine = self._mine.get((tag.id, window))
        if mine is not None:
            got = await self._indexed(tag, mine, need, load)
            left = [i for i in need if i not in got]
            return got, (await self._join(tag, mine, left, ahead) if left else None)
        key = self._key(tag, window)
        base = window * self.window_blobs(tag)
        nbytes = len(need) * tag.blob_size
        got: dict[int, Buffer] = {}
        waited_from: float | None = None
        seen_gen: tuple[int, str] | None = None
        progressed = False  # a blob of the current holder's claim landed
        life_at: float | None = None  # when the holder last grew or renewed its claim
        give_up = 0.0
        delay = POLL_FIRST_S
        polls = 0
        force = ""  # the tag of a claim to take over (its blobs are late or missing)
        try:
            while True:
                while (tag.id, window) in self._claiming:
                    await self._claiming[(tag.id, window)].wait()
                mine = self._mine.get((tag.id, window))  # one of our faults claimed meanwhile
                if mine is not None:
                    got.update(await self._indexed(tag, mine, need, load))
                    need = [i for i in need if i not in got]
                    return got, (await self._join(tag, mine, need, ahead) if need else None)
                claiming = self._claiming[(tag.id, window)] = trio.Event()
                try:
                    outcome = await self._attempt(tag, window, key, need, force, ahead)
                finally:
                    del self._claiming[(tag.id, window)]
                    claiming.set()
                loaded, force = bool(force), ""  # a forced takeover follows a load
                if isinstance(outcome, Held):  # the index; after a takeover, every blob
                    got.update(await self._indexed(tag, outcome, need, load, everything=(
                        outcome.claim.gen > 1 and not loaded)))
                    return got, outcome
                claim, etag = outcome
                if claim.published:  # the window's index: load what it names, claim the rest
                    covered = claim.published_of(base, need)
                    got.update(await load(covered) if covered else {})
                    need = [i for i in need if i not in got]
                    if not need:
                        return got, None
                    force = etag
                    continue
                now = time.monotonic()
                if waited_from is None:
                    waited_from = now
                    self.stats.add("claim_waits")
                if seen_gen != (claim.gen, etag):  # a new holder: a new bound; tell it
                    seen_gen = (claim.gen, etag)
                    give_up = now + self.patience(nbytes, claim) * (
                        2 if await self._ring(claim.node) else 1)
                    progressed, life_at = False, None
                deadline = now + max(0.0, claim.deadline_ms / 1000 - time.time())
                # a holder whose blobs keep landing is slow, not dead: its deadline is not
                # held against it; the waiter's own bound (renewed by each blob) still is
                until = give_up if progressed else min(give_up, deadline)
                while True:
                    await trio.sleep(max(0.0, min(delay, until - time.monotonic())))
                    delay = min(POLL_MAX_S, delay * 2)
                    covered = [i for i in need if claim.first <= i < claim.first + claim.count
                               or claim.published_of(base, [i])]
                    polls += 1
                    landed = await poll_blobs(covered, load, polls)
                    if landed:  # the holder's blobs as each is published: it makes progress
                        delay = POLL_FIRST_S  # its next ones follow
                        got.update(landed)
                        need = [i for i in need if i not in got]
                        if not need:
                            return got, None
                        give_up = time.monotonic() + self.patience(len(need) * tag.blob_size,
                                                                   claim)
                        until, progressed = give_up, True
                    seen = await self._io(self.store.read, key)
                    if seen is not None and seen[1] != etag:
                        grown = _grown(claim, seen[0])
                        if grown is not None:  # the holder grew it and renewed its deadline
                            claim, etag, life_at = grown, seen[1], time.monotonic()
                            seen_gen = (claim.gen, etag)
                            now = time.monotonic()
                            deadline = now + max(0.0, claim.deadline_ms / 1000 - time.time())
                            if not self._measured:  # the holder's new estimate is ours
                                give_up = min(waited_from + LEASE_MAX_S, max(
                                    give_up, now + self.patience(len(need) * tag.blob_size,
                                                                 claim)))
                            until = give_up if progressed else min(give_up, deadline)
                    if seen is None or seen[1] != etag:  # released, or someone else's now
                        break
                    if time.monotonic() >= until:
                        break
                if seen is None:
                    got.update(await load(need))
                    need = [i for i in need if i not in got]
                    if not need:
                        return got, None
                    continue  # not all there: claim the rest
                if time.monotonic() >= give_up and not claim.expired(now_ms()):
                    # as long as this node's own fetch would take: it fetches them itself
                    self.stats.add("claim_waits_given_up")
                    named = sum(claim.first <= i < claim.first + claim.count for i in need)
                    # alive: it grew or renewed its claim within this node's own bound (a
                    # blob that landed says it lived when it published, not that it lives)
                    alive = life_at is not None and time.monotonic() - life_at < \
                        self.patience(len(need) * tag.blob_size, claim)
                    log.info("tag %s: window %d is still claimed by %s after %.1f s (%d of "
                             "the %d blobs waited for named by it): %s", tag.name, window,
                             claim.node, time.monotonic() - waited_from, named, len(need),
                             "fetching them here; the claim stays its live holder's" if alive
                             else "taking it over")
                    if alive:  # a takeover would make both fetch the window's next blobs
                        return got, None  # until the holder's next request to its claim
                    force = etag  # no sign of life: one waiter takes it over
                # the claim expired or changed hands: try again (a takeover, or a new wait)
        except OSError as exc:
            self.stats.add("claim_errors")
            log.warning("shared store %s: claims failed (%s): fetching from the source",
                        tag.name, exc.strerror or exc)
            got.update(await load([i for i in need if i not in got]))  # no index: each blob
            return got, None
        finally:
            if waited_from is not None:
                self.stats.add("claim_wait_ms", round(1000 * (time.monotonic() - waited_from)))

    async def _ring(self, holder: str) -> bool:
        """Tell ``holder`` that this node waits on it (it publishes at once then), beside
        the wait when attached to a mount. True the first time: the holder may have held
        its publishes back, and learns of this wait within a look (``heldback.LOOK_S``)
        and a few requests: the wait's bound is doubled that once."""
        alone = not self.mailbox.company
        first = self.mailbox.first(holder)
        if alone:
            self.in_company()
        if not first:
            return False
        if self._nursery is not None:
            self._nursery.start_soon(self._io, self.mailbox.ring, holder)
        else:
            await self._io(self.mailbox.ring, holder)
        return True

    async def _attempt(self, tag: TierTag, window: int, key: str, need: list[int],
                       force: str = "", ahead: bool = False) -> Held | tuple[Claim, str]:
        """Claim the window (create, or take over an expired claim), or say whose it is.
        ``force``: the tag of a live or published claim to take over too (the waiter's
        bound passed, or the blobs of a published one were not all there); a claim that
        replaced it meanwhile is waited on, not taken over."""
        # a window seen with an object (a claim, its marker) is read first, not created:
        # a create there is a request that can only lose (markers stay)
        occupied = bool(force) or (tag.id, window) in self._occupied
        for _ in range(8):  # the claim comes and goes between our requests: try again
            span = claim_span(tag, window, need, ahead)
            claim = self._new_claim(tag, span, gen=1, done=0)
            taken = self._taken.pop((tag.id, window), False)  # (a create ahead just lost)
            etag = None if taken or occupied else await self._io(
                self.store.create, key, claim.encode())
            if etag is not None:
                self.stats.add("claims_won")
                return self._hold(tag, window, key, etag, claim, ahead)
            seen = await self._io(self.store.read, key)
            if seen is None:
                occupied = False  # released meanwhile (or swept): a create may win now
                continue
            self._saw(tag.id, window)
            raw, etag = seen
            try:
                theirs: Claim | None = Claim.decode(raw)
            except CorruptionError as exc:
                log.warning("tag %s: claim object %s is not one (%s): replacing it", tag.name,
                            key, exc)
                theirs = None
            if theirs is not None and force != etag and (theirs.published
                                                         or not theirs.expired(now_ms())):
                return theirs, etag
            claim = self._new_claim(tag, span, gen=(theirs.gen + 1) if theirs else 1,
                                    done=theirs.done if theirs else 0)
            new = await self._io(self.store.replace, key, claim.encode(), etag)
            if new is not None:
                self.stats.add("claims_won")
                held = self._hold(tag, window, key, new, claim, ahead)
                if theirs is None or not theirs.published:
                    self.stats.add("claim_takeovers")
                    log.info("tag %s: took over the expired claim of window %d from %s",
                             tag.name, window, theirs.node if theirs else "?")
                    held.unindexed = True  # its blobs published under no marker yet
                return held
            # another node took it over first: its claim is live, wait on it
        raise OSError(5, "the claim of a window kept changing")

    def _new_claim(self, tag: TierTag, span: tuple[int, int], gen: int, done: int) -> Claim:
        lo, hi = span
        lease = self.lease((hi - lo) * tag.blob_size)
        if self._nursery is not None and not self.mailbox.company:
            lease = max(lease, ALONE_LEASE_S)  # nobody waits on it yet: fewer renewals
        deadline = time.time() + lease
        return Claim(self.node, gen, int(deadline * 1000), lo, hi - lo, done=done)

    def _saw(self, tag_id: int, window: int) -> None:
        """Window ``window`` of tag ``tag_id`` has an object (a claim; later its marker)."""
        self._occupied[(tag_id, window)] = None
        while len(self._occupied) > OCCUPIED_MAX:
            del self._occupied[next(iter(self._occupied))]

    def _hold(self, tag: TierTag, window: int, key: str, etag: str, claim: Claim,
              ahead: bool) -> Held:
        self._saw(tag.id, window)
        held = Held(tag.id, window, key, etag, claim, self.window_blobs(tag), ahead=ahead)
        held.want = held.covers
        held.lease_s = max(0.0, claim.deadline_ms / 1000 - time.time())
        if self._nursery is not None:
            self._nursery.start_soon(self._renew, tag, held)
        self._mine[(tag.id, window)] = held
        self._watch_alone()
        return held

    # -- release -----------------------------------------------------------------------------

    async def release(self, held: list[Held], *, published: bool = True,
                      fetched: Iterable[int] = ()) -> None:
        """The caller is done with these claims, having fetched (and, ``published``,
        published) the blobs ``fetched``: the last user of each turns it into the window's
        marker, ``done`` grown by them; or, when nothing of the window is published, removes
        it (another node may claim at once). A claim made ahead whose blobs are not all
        fetched is held on ``idle_hold_s`` first, for its node's next run. Failures are
        counted, never raised (the claim expires)."""
        indices = list(fetched)
        last: list[Held] = []
        for h in held:
            lo = h.window * h.per
            if published:
                h.fetched.update(i for i in indices if lo <= i < lo + h.per)
            h.users -= 1
            if h.users == 0:
                last.append(h)
        holding = [(h, h.idle) for h in last if published and h.ahead and h.lost is False
                   and any(i not in h.fetched for i in range(*h.covers))]
        if holding:
            with contextlib.suppress(trio.Cancelled):  # unmounting: end them now
                await trio.sleep(self.idle_hold_s)
            # rejoined meanwhile: the last of the new users releases it
            marks = {id(h): idle for h, idle in holding}
            last = [h for h in last if id(h) not in marks
                    or (h.users == 0 and h.idle == marks[id(h)])]
        await self._finish(last)

    async def _finish(self, last: list[Held]) -> None:
        """End the claims ``last`` (no user left): markers, or deleted (``_end``)."""
        with trio.CancelScope(shield=True):
            for h in last:
                if self._mine.get((h.tag_id, h.window)) is h:
                    del self._mine[(h.tag_id, h.window)]
                ending = self._claiming.setdefault((h.tag_id, h.window), trio.Event())
                try:
                    ended = await self._end(h)
                except OSError as exc:
                    self.stats.add("claim_errors")
                    log.warning("releasing claim %s failed (%s): it expires", h.key,
                                exc.strerror or exc)
                    continue
                finally:  # this node's faults of the window see it ended
                    if self._claiming.get((h.tag_id, h.window)) is ending:
                        del self._claiming[(h.tag_id, h.window)]
                    ending.set()
                if ended:  # (a claim taken over meanwhile is the taker's to end)
                    self.stats.add("claims_released")

    async def _end(self, h: Held) -> bool:
        """Replace ``h`` by its window's marker (``done`` and the blobs it fetched) or, when
        nothing of the window is published, delete it; leave it alone when it is no longer
        ours (taken over after its deadline). Whether it was still ours to end."""
        async with h.lock:
            if h.lost:
                return False
            h.lost = True  # ended: no more growing
            self._deferred.pop(id(h), None)
            c = h.claim
            done = c.done | done_mask(h.window * h.per, h.fetched)
            if not done:
                return await self._remove_if(h.key, h.etag)
            lo, hi = (min(h.fetched), max(h.fetched) + 1) if h.fetched else h.covers
            marker = Claim(c.node, c.gen, now_ms(), lo, hi - lo, published=True, done=done)
            if await self._io(self.store.replace, h.key, marker.encode(), h.etag) is None:
                log.info("claim %s was taken over before its end: its %d published blob(s) "
                         "are named by no marker until the taker's", h.key, len(h.fetched))
                return False
            return True

    async def _remove_if(self, key: str, etag: str) -> bool:
        """Delete the claim at ``key`` if it is still the one of ``etag``; whether it was."""
        seen = await self._io(self.store.read, key)
        if seen is not None and seen[1] == etag:
            await self._io(self.store.delete, key)
            return True
        return False


async def poll_blobs(covered: list[int], load: Loader, polls: int) -> dict[int, Buffer]:
    """One look for the blobs ``covered`` (the waiter's, under the holder's claim): the
    first, which a holder fetching in order publishes first, and one more in turn (a
    holder's other order is seen within as many looks as there are blobs); when either
    has landed, all of them. Not a GET of each at every look: on a run of blobs, most
    of those would find nothing yet, and they load the store that serves the holder."""
    if len(covered) <= POLL_PROBE_BLOBS:
        return await load(covered) if covered else {}
    rest = covered[1:]
    probe = [covered[0], rest[polls % len(rest)]]
    landed = await load(probe)
    if landed:
        landed.update(await load([i for i in covered if i not in probe]))
    return landed


def _grown(claim: Claim, raw: bytes) -> Claim | None:
    """The object ``raw`` as ``claim`` grown by its holder (same node and generation, still
    fetching), or None (released, taken over, or not a claim)."""
    try:
        new = Claim.decode(raw)
    except CorruptionError:
        return None
    if new.published or new.node != claim.node or new.gen != claim.gen:
        return None
    return new


def sweep(store: ClaimStore, *, dry_run: bool = False, grace_s: float = 60.0) -> list[str]:
    """Clean the claim prefix (blocking; ``faultfs gc --shared-store``): a claim past its
    deadline by more than ``grace_s`` becomes its window's marker when blobs of the window
    are published (``done``), else it is removed; objects that are not claims are removed,
    and mailboxes rung longer ago than ``grace_s``; markers stay (they are the windows'
    index). The keys changed or removed."""
    from faultfs.tiers.claims import CLAIM_PREFIX

    swept = []
    cutoff = now_ms() - int(grace_s * 1000)
    for key in store.list(CLAIM_PREFIX):
        if ".tmp-" in key:
            continue
        seen = store.read(key)
        if seen is None:
            continue
        if key.startswith(MAILBOX_PREFIX):  # a mailbox: kept while it may still be looked at
            if stale_mailbox(seen[0], cutoff):
                if not dry_run:
                    store.delete(key)
                swept.append(key)
            continue
        try:
            claim: Claim | None = Claim.decode(seen[0])
        except CorruptionError:
            claim = None
        if claim is not None and (claim.published or not claim.expired(cutoff)):
            continue
        if not dry_run:
            if claim is not None and claim.done:
                marker = Claim(claim.node, claim.gen, claim.deadline_ms, claim.first,
                               claim.count, published=True, done=claim.done)
                store.replace(key, marker.encode(), seen[1])
            else:
                store.delete(key)
        swept.append(key)
    return swept
