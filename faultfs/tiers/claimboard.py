"""Cross-node single flight: before a node reads blobs from the source it claims their window
in the shared store; a node that finds another's live claim waits for the blobs to land there
instead of fetching them itself (DESIGN §17). The object store is the only coordinator.

A window is ``CLAIM_WINDOW_BYTES`` of adjacent blobs (aligned), so a sequential or prefetched
run costs one claim (two where it straddles a boundary; prefetch runs stop at one), not one a
blob. A claim says which blobs of the window its holder fetches, by whom, until when
(``claims.Claim``).

Invariants:
- A node holds at most one claim per window; its own later faults of the window share it
  (``_mine``, counted by users) and the last one releases it, after the blobs it fetched are
  published, so a waiter that sees the claim gone finds them (or claims the window itself).
- A claim's deadline is its holder's bound: ``lease`` = three times the node's own estimate
  of the fetch (the fetch, its publish, the waiters' load), plus ``LEASE_SLACK_S``. After it, any node may take the claim over with a
  conditional replace, and exactly one does; the blob is then fetched at most twice.
- A waiter takes each blob the holder publishes as soon as it lands (it polls them with the
  claim). Its wait is bounded by the claim's deadline and, per generation of the claim and
  since the last blob that landed, by its own estimate of fetching the rest itself (``lease``
  of its own measurements): then it
  takes the claim over (one waiter wins; the others wait on it, a new bound). A slow or dead
  peer costs latency, never a failure or wrong bytes, and a blob is fetched twice at most.
- Any failure of the store ends the coordination for that fault: the caller fetches from the
  source (the shared tier's back-off keeps later faults from trying meanwhile).
- A claim whose holder is past its deadline is never deleted by it unless it is still the
  object it wrote (checked first); expired claims nobody needs are removed by ``faultfs gc``.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from faultfs.errors import CorruptionError
from faultfs.iopool import run_in_thread
from faultfs.stats import Stats
from faultfs.tiers.base import Buffer, TierTag, version_hash
from faultfs.tiers.claims import Claim, ClaimStore, claim_key

log = logging.getLogger("faultfs.shared")

CLAIM_WINDOW_BYTES = 8 << 20  # blobs claimed together: one prefetch run at most
CLAIM_THREADS = 8  # claim requests have threads of their own, apart from loads and publishes
LEASE_SLACK_S = 1.0  # a claim outlives its holder's estimate by this (and twice the estimate)
LEASE_MAX_S = 60.0
# a released claim stays this long marked published: a node whose miss came just before the
# publish (its claim request after it) finds the blobs instead of claiming the window again
LINGER_S = 3.0
POLL_FIRST_S, POLL_MAX_S = 0.02, 0.2  # a waiter looks at the claim this often (doubling)
FIRST_BYTE_S = 0.05  # a source request's first byte, before this node has measured any
FIRST_RATE = 50e6  # bytes per second, likewise


def node_id() -> str:
    """This daemon among the nodes: host, process, and a random part (pids repeat)."""
    return f"{socket.gethostname()[:40]}-{os.getpid()}-{secrets.token_hex(4)}"


@dataclass
class Held:
    """A claim this node holds on one window."""

    tag_id: int
    window: int
    key: str
    etag: str
    claim: Claim
    users: int = 1


Loader = Callable[[list[int]], Awaitable[dict[int, Buffer]]]


class ClaimBoard:
    def __init__(self, store: ClaimStore, stats: Stats, *, node: str | None = None) -> None:
        self.store = store
        self.stats = stats
        self.node = node or node_id()
        self.mode = store.mode
        self._mine: dict[tuple[int, int], Held] = {}
        # windows this node is claiming now: its other faults of them wait for the answer
        # rather than find their own node's claim and wait on it as on another node's
        self._claiming: dict[tuple[int, int], trio.Event] = {}
        self._limiter: trio.CapacityLimiter | None = None
        self._seconds_per_byte = 1.0 / FIRST_RATE
        self.linger_s = LINGER_S

    # -- estimates ---------------------------------------------------------------------------

    def observe(self, nbytes: int, seconds: float) -> None:
        """A source read of this node: ``nbytes`` in ``seconds`` (the estimate follows it)."""
        if nbytes > 0:
            spb = max(0.0, seconds - FIRST_BYTE_S) / nbytes
            self._seconds_per_byte = 0.8 * self._seconds_per_byte + 0.2 * spb

    def lease(self, nbytes: int) -> float:
        """How long fetching ``nbytes`` may take this node, generously."""
        estimate = FIRST_BYTE_S + nbytes * self._seconds_per_byte
        return min(LEASE_MAX_S, 3 * estimate + LEASE_SLACK_S)

    # -- keys --------------------------------------------------------------------------------

    @staticmethod
    def window_blobs(tag: TierTag) -> int:
        return max(1, CLAIM_WINDOW_BYTES // max(1, tag.blob_size))

    def _key(self, tag: TierTag, window: int) -> str:
        from urllib.parse import quote

        fault = tag.key.split(":", 1)[-1] or quote(tag.name, safe="")
        return claim_key(fault, version_hash(tag.version), window)

    async def _io(self, fn, *args):
        if self._limiter is None:
            self._limiter = trio.CapacityLimiter(CLAIM_THREADS)
        return await run_in_thread(self._limiter, fn, *args)

    # -- the fault path ----------------------------------------------------------------------

    async def coordinate(self, tag: TierTag, missing: list[int], load: Loader
                         ) -> tuple[dict[int, Buffer], list[Held]]:
        """Before blobs ``missing`` of ``tag`` are read from the source: claim their windows,
        or wait for other nodes' claims on them. Returns the blobs that landed in the shared
        store meanwhile (``load`` reads them) and the claims now held, which the caller
        releases (``release``) once it has published what it fetched. Every blob not returned
        is the caller's to fetch: under a claim it holds, or because the wait ended."""
        per = self.window_blobs(tag)
        windows: dict[int, list[int]] = {}
        for index in missing:
            windows.setdefault(index // per, []).append(index)
        got: dict[int, Buffer] = {}
        held: list[Held] = []

        async def one(window: int, need: list[int]) -> None:
            found, mine = await self._window(tag, window, need, load)
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

    async def _window(self, tag: TierTag, window: int, need: list[int], load: Loader
                      ) -> tuple[dict[int, Buffer], Held | None]:
        mine = self._mine.get((tag.id, window))
        if mine is not None:
            mine.users += 1
            return {}, mine
        key = self._key(tag, window)
        nbytes = len(need) * tag.blob_size
        got: dict[int, Buffer] = {}
        waited_from: float | None = None
        seen_gen: tuple[int, str] | None = None
        progressed = False  # a blob of the current holder's claim landed
        give_up = 0.0
        delay = POLL_FIRST_S
        force = ""  # the tag of a claim to take over (its blobs are late or missing)
        try:
            while True:
                while (tag.id, window) in self._claiming:
                    await self._claiming[(tag.id, window)].wait()
                mine = self._mine.get((tag.id, window))  # one of our faults claimed meanwhile
                if mine is not None:
                    mine.users += 1
                    return got, mine
                claiming = self._claiming[(tag.id, window)] = trio.Event()
                try:
                    outcome = await self._attempt(tag, window, key, need, force)
                finally:
                    del self._claiming[(tag.id, window)]
                    claiming.set()
                loaded, force = bool(force), ""  # a forced takeover follows a load
                if isinstance(outcome, Held):
                    if outcome.claim.gen > 1 and not loaded:  # a takeover: some may have landed
                        got.update(await load(need))
                        need = [i for i in need if i not in got]
                    return got, outcome
                claim, etag = outcome
                if claim.published:  # its blobs are in the store (those it fetched)
                    covered = [i for i in need if claim.first <= i < claim.first + claim.count]
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
                if seen_gen != (claim.gen, etag):  # a new holder: a new bound
                    seen_gen = (claim.gen, etag)
                    give_up = now + self.lease(nbytes)
                    progressed = False
                deadline = now + max(0.0, claim.deadline_ms / 1000 - time.time())
                # a holder whose blobs keep landing is slow, not dead: its deadline is not
                # held against it; the waiter's own bound (renewed by each blob) still is
                until = give_up if progressed else min(give_up, deadline)
                while True:
                    await trio.sleep(max(0.0, min(delay, until - time.monotonic())))
                    delay = min(POLL_MAX_S, delay * 2)
                    covered = [i for i in need if claim.first <= i < claim.first + claim.count]
                    landed = await load(covered) if covered else {}
                    if landed:  # the holder's blobs as each is published: it makes progress
                        got.update(landed)
                        need = [i for i in need if i not in got]
                        if not need:
                            return got, None
                        give_up = time.monotonic() + self.lease(len(need) * tag.blob_size)
                        until, progressed = give_up, True
                    seen = await self._io(self.store.read, key)
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
                if time.monotonic() >= give_up and not claim.expired(_now_ms()):
                    # as long as this node's own fetch would take: one waiter takes it over
                    self.stats.add("claim_waits_given_up")
                    log.info("tag %s: window %d is still claimed by %s after %.1f s: "
                             "taking it over", tag.name, window, claim.node,
                             time.monotonic() - waited_from)
                    force = etag
                # the claim expired or changed hands: try again (a takeover, or a new wait)
        except OSError as exc:
            self.stats.add("claim_errors")
            log.warning("shared store %s: claims failed (%s): fetching from the source",
                        tag.name, exc.strerror or exc)
            return got, None
        finally:
            if waited_from is not None:
                self.stats.add("claim_wait_ms", round(1000 * (time.monotonic() - waited_from)))

    async def _attempt(self, tag: TierTag, window: int, key: str, need: list[int],
                       force: str = "") -> Held | tuple[Claim, str]:
        """Claim the window (create, or take over an expired claim), or say whose it is.
        ``force``: the tag of a live or published claim to take over too (the waiter's
        bound passed, or the blobs of a published one were not all there); a claim that
        replaced it meanwhile is waited on, not taken over."""
        for _ in range(8):  # the claim comes and goes between our requests: try again
            claim = self._new_claim(tag, need, gen=1)
            etag = await self._io(self.store.create, key, claim.encode())
            if etag is not None:
                self.stats.add("claims_won")
                return self._hold(tag, window, key, etag, claim)
            seen = await self._io(self.store.read, key)
            if seen is None:
                continue  # released meanwhile
            raw, etag = seen
            try:
                theirs: Claim | None = Claim.decode(raw)
            except CorruptionError as exc:
                log.warning("tag %s: claim object %s is not one (%s): replacing it", tag.name,
                            key, exc)
                theirs = None
            if theirs is not None and force != etag and (theirs.published
                                                         or not theirs.expired(_now_ms())):
                return theirs, etag
            claim = self._new_claim(tag, need, gen=(theirs.gen + 1) if theirs else 1)
            new = await self._io(self.store.replace, key, claim.encode(), etag)
            if new is not None:
                self.stats.add("claims_won")
                if theirs is None or not theirs.published:
                    self.stats.add("claim_takeovers")
                    log.info("tag %s: took over the expired claim of window %d from %s",
                             tag.name, window, theirs.node if theirs else "?")
                return self._hold(tag, window, key, new, claim)
            # another node took it over first: its claim is live, wait on it
        raise OSError(5, "the claim of a window kept changing")

    def _new_claim(self, tag: TierTag, need: list[int], gen: int) -> Claim:
        deadline = time.time() + self.lease(len(need) * tag.blob_size)
        return Claim(self.node, gen, int(deadline * 1000), need[0], need[-1] - need[0] + 1)

    def _hold(self, tag: TierTag, window: int, key: str, etag: str, claim: Claim) -> Held:
        held = Held(tag.id, window, key, etag, claim)
        self._mine[(tag.id, window)] = held
        return held

    # -- release -----------------------------------------------------------------------------

    async def release(self, held: list[Held], *, published: bool = True) -> None:
        """The caller is done with these claims: the last user of each marks it published
        (``published``: what it fetched is in the store) for ``linger_s``, then removes it;
        or removes it at once (the fetch failed: another node may claim now). Failures are
        counted, never raised (the claim expires)."""
        markers: list[tuple[str, str]] = []
        with trio.CancelScope(shield=True):
            for h in held:
                h.users -= 1
                if h.users > 0:
                    continue
                if self._mine.get((h.tag_id, h.window)) is h:
                    del self._mine[(h.tag_id, h.window)]
                ending = self._claiming.setdefault((h.tag_id, h.window), trio.Event())
                try:
                    marker = await self._end(h, published)
                except OSError as exc:
                    self.stats.add("claim_errors")
                    log.warning("releasing claim %s failed (%s): it expires", h.key,
                                exc.strerror or exc)
                    continue
                finally:  # this node's faults of the window see it ended
                    if self._claiming.get((h.tag_id, h.window)) is ending:
                        del self._claiming[(h.tag_id, h.window)]
                    ending.set()
                self.stats.add("claims_released")
                if marker is not None:
                    markers.append((h.key, marker))
        if not markers:
            return
        try:
            await trio.sleep(self.linger_s)
        finally:
            with trio.CancelScope(shield=True):
                for key, etag in markers:
                    await self._remove_if(key, etag)

    async def _end(self, h: Held, published: bool) -> str | None:
        """Mark ``h`` published (its new tag) or delete it (None); leave it alone when it is
        no longer ours (taken over after its deadline)."""
        if published:
            c = h.claim
            done = Claim(c.node, c.gen, _now_ms() + int(self.linger_s * 1000) + 1000, c.first,
                         c.count, published=True)
            return await self._io(self.store.replace, h.key, done.encode(), h.etag)
        await self._remove_if(h.key, h.etag)
        return None

    async def _remove_if(self, key: str, etag: str) -> None:
        """Delete the claim at ``key`` if it is still the one of ``etag``."""
        try:
            seen = await self._io(self.store.read, key)
            if seen is not None and seen[1] == etag:
                await self._io(self.store.delete, key)
        except OSError as exc:
            self.stats.add("claim_errors")
            log.warning("removing claim %s failed (%s): it expires", key, exc.strerror or exc)


def _now_ms() -> int:
    return int(time.time() * 1000)


def sweep(store: ClaimStore, *, dry_run: bool = False, grace_s: float = 60.0) -> list[str]:
    """Remove claims past their deadline by more than ``grace_s`` and objects under the claim
    prefix that are not claims (blocking; ``faultfs gc --shared-store``). The keys removed."""
    from faultfs.tiers.claims import CLAIM_PREFIX

    removed = []
    cutoff = _now_ms() - int(grace_s * 1000)
    for key in store.list(CLAIM_PREFIX):
        if ".tmp-" in key:
            continue
        seen = store.read(key)
        if seen is None:
            continue
        try:
            stale = Claim.decode(seen[0]).expired(cutoff)
        except CorruptionError:
            stale = True
        if stale:
            if not dry_run:
                store.delete(key)
            removed.append(key)
    return removed
