"""How long a fetch from the source takes this node, by its own measurements: the bound of
its claims' deadlines and of its waits on other nodes' claims (DESIGN §17)."""

from __future__ import annotations

import time

from faultfs.tiers.claims import Claim

LEASE_SLACK_S = 1.0  # a claim outlives its holder's estimate by this (and twice the estimate)
LEASE_MAX_S = 60.0
FIRST_BYTE_S = 0.05  # a source request's first byte, before this node has measured any
FIRST_RATE = 50e6  # bytes per second, likewise


class FetchEstimate:
    """Seconds per byte of this node's source reads (an EWMA after a first byte), and the
    leases and patience derived from it."""

    def __init__(self) -> None:
        self._seconds_per_byte = 1.0 / FIRST_RATE
        self._measured = False  # a source read of this node has set the estimate

    def observe(self, nbytes: int, seconds: float) -> None:
        """A source read of this node: ``nbytes`` in ``seconds`` (the estimate follows it)."""
        if nbytes > 0:
            self._measured = True
            spb = max(0.0, seconds - FIRST_BYTE_S) / nbytes
            self._seconds_per_byte = 0.8 * self._seconds_per_byte + 0.2 * spb

    def lease(self, nbytes: int) -> float:
        """How long fetching ``nbytes`` may take this node, generously."""
        estimate = FIRST_BYTE_S + nbytes * self._seconds_per_byte
        return min(LEASE_MAX_S, 3 * estimate + LEASE_SLACK_S)

    def patience(self, nbytes: int, claim: Claim) -> float:
        """How long to wait on ``claim`` for ``nbytes`` before fetching them here: this
        node's own ``lease``, or, before it has measured its source, the holder's (its
        deadline: the same source, measured there), whichever is longer."""
        own = self.lease(nbytes)
        if self._measured:
            return own
        return max(own, min(LEASE_MAX_S, claim.deadline_ms / 1000 - time.time()))
