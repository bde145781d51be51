"""A claim this node holds on one window of blobs (``ClaimBoard``, DESIGN §17), and the
window arithmetic every part of the claims shares."""

from __future__ import annotations

from dataclasses import dataclass, field

import trio

from faultfs.tiers.base import TierTag
from faultfs.tiers.claims import Claim

CLAIM_WINDOW_BYTES = 8 << 20  # blobs claimed together: one prefetch run at most
CLAIM_WINDOW_MAX_BLOBS = 4096  # and at most this many (a claim's ``done`` bitmap stays small)


def window_blobs(tag: TierTag) -> int:
    """Blobs of ``tag`` in one claim window."""
    return max(1, min(CLAIM_WINDOW_MAX_BLOBS, CLAIM_WINDOW_BYTES // max(1, tag.blob_size)))


def claim_span(tag: TierTag, window: int, need: list[int], ahead: bool) -> tuple[int, int]:
    """The blobs ``[lo, hi)`` a claim for ``need`` covers: to the window's end ahead."""
    per = window_blobs(tag)
    end = min((window + 1) * per, tag.num_blobs) if ahead else need[-1] + 1
    return need[0], max(end, need[-1] + 1)


@dataclass
class Held:
    """A claim this node holds on one window."""

    tag_id: int
    window: int
    key: str
    etag: str
    claim: Claim
    per: int  # blobs of a window
    users: int = 1
    fetched: set[int] = field(default_factory=set)  # blobs fetched under it (the marker's)
    want: tuple[int, int] = (0, 0)  # the blobs ``[lo, hi)`` it should cover (grown to them)
    lock: trio.Lock = field(default_factory=trio.Lock)  # its replaces (If-Match), one by one
    lost: bool = False  # taken over meanwhile (its deadline passed), or ended: not ours
    ahead: bool = False  # claimed or grown to its window's end by a prefetch run
    idle: int = 0  # releases of its last user: a held-on claim ends if none came since
    lease_s: float = 0.0  # the lease its deadline was last given
    parked: int = 0  # its users whose blobs are fetched and whose publishes are held back
    # taken over from a holder that may have published blobs it never marked: every fault
    # under it looks in the store for its blobs (``ClaimBoard._indexed``)
    unindexed: bool = False
    renewing: trio.CancelScope | None = None  # the sleep until its next renewal ...
    retime: bool = False  # ... cut short to be timed anew (``ClaimUpkeep.in_company``)

    @property
    def settled(self) -> bool:
        """Its blobs fetched, all its users waiting to publish (``heldback``)."""
        return 0 < self.users <= self.parked

    @property
    def covers(self) -> tuple[int, int]:
        return self.claim.first, self.claim.first + self.claim.count
