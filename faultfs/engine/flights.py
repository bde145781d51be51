"""Single-flight: one in-progress fault (or store read-ahead) per blob, which later readers join.

Invariants:
- A blob has at most one flight; flights are claimed before any await, so no second reader or
  prefetch starts a second fault of the same blob.
- ``settle`` is the only way a flight ends: it records the outcome, wakes every waiter and
  removes the flight — on success, on failure and on cancellation alike.
- A read-ahead flight (``from_store``) that ends without data sends its readers down the
  normal path; it never carries an error to them.
"""

from __future__ import annotations

from collections.abc import Iterable

import trio

from faultfs.tiers.base import BlobKey, Buffer


class Flight:
    """One in-progress fault (or read-ahead of a staged blob) that readers wait on."""

    __slots__ = ("data", "done", "error", "from_store")

    def __init__(self, from_store: bool = False) -> None:
        self.done = trio.Event()
        self.data: Buffer | None = None
        self.error: BaseException | None = None
        self.from_store = from_store  # a read-ahead of a staged blob, not a fault


class Flights:
    def __init__(self) -> None:
        self._flights: dict[BlobKey, Flight] = {}

    def __contains__(self, key: BlobKey) -> bool:
        return key in self._flights

    def of_tag(self, tag_id: int) -> bool:
        """Whether a flight of a blob of tag ``tag_id`` is under way."""
        return any(key[0] == tag_id for key in self._flights)

    def __len__(self) -> int:
        return len(self._flights)

    def get(self, key: BlobKey) -> Flight | None:
        return self._flights.get(key)

    def claim(self, keys: Iterable[BlobKey], *, from_store: bool = False) -> list[Flight]:
        """Register flights for ``keys`` now, before any await."""
        flights = []
        for key in keys:
            assert key not in self._flights, f"blob {key} claimed twice"
            flight = self._flights[key] = Flight(from_store)
            flights.append(flight)
        return flights

    def settle(self, keys: Iterable[BlobKey], flights: Iterable[Flight]) -> None:
        """End the flights (their data or error already set): wake readers, forget them."""
        for key, flight in zip(keys, flights, strict=True):
            flight.done.set()
            if self._flights.get(key) is flight:
                del self._flights[key]

    async def read_ahead(self, key: BlobKey) -> Buffer | None:
        """Wait for a read-ahead of ``key`` if one is in flight; its data, or None (no
        read-ahead, or it ended without data: take the normal path)."""
        flight = self._flights.get(key)
        while flight is not None and flight.from_store:
            await flight.done.wait()
            if flight.data is not None:
                return flight.data
            flight = self._flights.get(key)
        return None
