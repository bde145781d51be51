"""Publishes of claimed blobs, held back while this node looks alone (DESIGN §17).

A node that fetched blobs under its claims publishes them, then releases the claims (their
markers name the blobs). Publishing at once costs a lone node: the PUTs compete with its
own source reads for the network, the store and the CPU, and nobody is waiting for them. So
a node that has met no other node (``Mailbox.company``) holds them back, claims still held,
and sends them once its faults have been idle for ``IDLE_S`` — or at once when another node
waits on one of its claims: a waiter rings the holder's mailbox, and a node holding claims
alone looks at its mailbox (one GET) 0.1, 0.3 and 0.7 s after its first claim, then every
0.5 s (``ClaimUpkeep._watch``), so a waiter waits that much longer at most, once; and a
holder killed early in a read that others share loses little of what it held back (the
others fetch that again). Held back are the keys, not the bytes: a publish reads its blob
back from the local store (memory while its store write is pending), so waiting publishes
take nothing from the memory budget the reads need.

Invariants:
- Held-back blobs count as pending publishes (``SharedTier.reserve``): ``faultfs stat``
  shows them, an unmount sends them (``SharedTier.flushing``) and waits for them, bounded.
- Their claims stay held (renewed) until the blobs are published: a node that comes meanwhile
  waits on them (and rings), it never finds a window free and fetches it again. A claim all
  of whose users are held back here is *settled* (``Held.settled``): each renewal doubles
  its lease, up to ``SETTLED_LEASE_MAX_S``, so a long read renews it a few times, not every
  half lease. At most
  ``HOLD_MAX`` claims' blobs are held back (each held claim is renewed: a request every
  half lease); past it the oldest go at once.
- A blob that cannot be read back (evicted, damaged, its tag forgotten) is not published and
  not named by its window's marker: another node fetches it (never a wrong byte: the local
  store verifies what it returns).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import trio

from faultfs.stats import Stats
from faultfs.tiers.base import BlobKey, Buffer
from faultfs.tiers.claimboard import ClaimBoard, Held
from faultfs.tiers.shared import SharedTier

log = logging.getLogger("faultfs.engine")

IDLE_S = 0.2  # faults idle this long: the source path is free, held-back publishes go
TICK_S = 0.1  # the faults (idle?), the mailbox's news and the mount (ending?) seen this often
HOLD_MAX = 64  # claims whose publishes are held back at once (512 MiB of 1 MiB blobs)
SENDING = 8  # held-back blobs read back and published at once

Entry = tuple[list[BlobKey], list[Held]]
Reader = Callable[[BlobKey], Awaitable[Buffer | None]]


class HeldBack:
    def __init__(self, shared: SharedTier, board: ClaimBoard, stats: Stats,
                 read_back: Reader) -> None:
        self.shared = shared
        self.board = board
        self.stats = stats
        self.read_back = read_back  # a staged blob's verified bytes, or None
        self.entries: list[Entry] = []
        self.faults = 0  # fault runs under way on this node
        self.idle_since = time.monotonic()
        self._running = False
        self._sending: trio.CapacityLimiter | None = None

    def fault_started(self) -> None:
        self.faults += 1

    def fault_ended(self) -> None:
        self.faults -= 1
        if self.faults == 0:
            self.idle_since = time.monotonic()

    def _idle(self) -> bool:
        return self.faults == 0 and time.monotonic() - self.idle_since >= IDLE_S

    def offer(self, keys: list[BlobKey], held: list[Held], nursery: trio.Nursery) -> bool:
        """Hold back the publishes of blobs ``keys`` (fetched under ``held``, being stored
        here); False when they must go now (this node is in company, or unmounting)."""
        if self.board.mailbox.company or self.shared.flushing:
            return False
        self.shared.reserve(len(keys))
        self.entries.append((keys, held))
        for h in held:
            h.parked += 1  # all its users parked here: renewed with a longer lease
        self.stats.add("shared_publishes_held", len(keys))
        while len({id(h) for _, hs in self.entries for h in hs}) > HOLD_MAX:
            # too many claims held (each renewed): the oldest blobs go now
            nursery.start_soon(self._send, [self.entries.pop(0)], "too many held back")
        if not self._running:
            self._running = True
            nursery.start_soon(self._run)
        return True

    async def _run(self) -> None:
        """Send the held-back publishes when the faults are idle, another node waits, or
        the mount ends."""
        try:  # the board looks at the mailbox while claims are held alone (upkeep._watch)
            while self.entries:
                await trio.sleep(TICK_S)
                wanted = self.board.mailbox.company
                if wanted or self.shared.flushing or self._idle():
                    entries, self.entries = self.entries, []
                    await self._send(entries, "another node waits" if wanted else
                                     "unmounting" if self.shared.flushing else "faults idle")
        except Exception:  # a background task must never take the mount down
            log.exception("held-back publishes failed")
        finally:
            self._running = False

    async def _send(self, entries: list[Entry], why: str) -> None:
        log.info("publishing %d held-back blob(s): %s", sum(len(k) for k, _ in entries), why)
        if self._sending is None:
            self._sending = trio.CapacityLimiter(SENDING)
        sending = self._sending

        async def one(key: BlobKey) -> bool:
            async with sending:
                data = await self.read_back(key)
                if data is None:
                    self.shared.unreserve()
                    return False
                return await self.shared.publish_reserved(key, data)

        async with trio.open_nursery() as nursery:
            for keys, held in entries:
                for h in held:
                    h.parked -= 1
                nursery.start_soon(publish_then_release, self.board, keys, held, one)


async def publish_then_release(board: ClaimBoard, keys: list[BlobKey], held: list[Held],
                               publish: Callable[[BlobKey], Awaitable[bool]]) -> None:
    """Publish what this node fetched under its claims (``publish``: whether the blob is in
    the store now), then release the claims: the windows' markers name what is there."""
    stored: list[int] = []

    async def one(key: BlobKey) -> None:
        if await publish(key):
            stored.append(key[1])

    try:
        async with trio.open_nursery() as nursery:
            for key in keys:
                nursery.start_soon(one, key)
    except Exception:  # a background task must never take the mount down
        log.exception("publishing claimed blobs failed")
        board.stats.add("shared_publish_failures")
    finally:
        await board.release(held, fetched=stored)
