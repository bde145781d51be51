"""The pace of response bytes: token buckets per connection and for the whole proxy.

Invariants:
- Response bytes of a client connection, heads included, leave at no more than ``conn_mbps``
  on average, and those of all connections together at no more than ``total_mbps``; each
  bucket lets one pacing piece (about ``PACE_QUANTUM_S`` at its rate) go as a burst.
- A send due sooner than ``MIN_SLEEP_S`` goes at once and its bucket keeps the debt, so sends
  never run further ahead of their schedule than that.
"""

from __future__ import annotations

import asyncio
import time

MB = 1_000_000  # rates are in MB/s of 10^6 bytes, as network links are rated

MAX_PIECE = 1 << 20  # most bytes relayed per read: ~500 reads/s at 500 MB/s, so the Python cost
# of a read stays small beside the copying
MIN_PIECE = 16 << 10  # fewest bytes per paced send, so a slow cap does not wake the loop per packet
PACE_QUANTUM_S = 0.002  # a paced piece lasts this long at its cap: short against any delay worth
# emulating, yet 16 connections at 100 MB/s wake the loop only ~8000 times a second
MIN_SLEEP_S = 0.0005  # a send due sooner than this goes at once (its bucket keeps the debt):
# saves wake-ups, and sends never run further ahead of their schedule than this


class Bucket:
    """A token bucket kept as the time its debt is paid (``due``): simple, exact on average.

    ``reserve(n, now)`` books n bytes and says when they may go: once the bytes booked before
    them are paid, less the burst the bucket holds when full.
    """

    __slots__ = ("_burst_s", "_due", "_per_byte")

    def __init__(self, mbps: float, burst: int) -> None:
        self._per_byte = 1.0 / (mbps * MB)
        self._burst_s = burst * self._per_byte
        self._due = 0.0

    def reserve(self, n: int, now: float) -> float:
        self._due = max(self._due, now) + n * self._per_byte
        return self._due - self._burst_s


def piece_for(mbps: float | None) -> int:
    if not mbps:
        return MAX_PIECE
    return int(min(MAX_PIECE, max(MIN_PIECE, mbps * MB * PACE_QUANTUM_S)))


class Pacing:
    """The pace of one client connection: its own bucket and the proxy's shared one."""

    def __init__(self, conn_mbps: float | None, total_mbps: float | None,
                 total_bucket: Bucket | None) -> None:
        own = Bucket(conn_mbps, piece_for(conn_mbps)) if conn_mbps else None
        self.buckets = [b for b in (own, total_bucket) if b is not None]
        self.piece = min(piece_for(conn_mbps), piece_for(total_mbps))  # bytes per relayed read

    async def wait(self, n: int) -> None:
        """Wait until ``n`` more bytes may go, no sooner than the buckets allow."""
        if self.buckets:
            now = time.monotonic()
            at = max([b.reserve(n, now) for b in self.buckets])
            if at - now > MIN_SLEEP_S:
                await asyncio.sleep(at - now)
