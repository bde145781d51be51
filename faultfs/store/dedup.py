"""TwoStageDeduplicator: which 64-bit record hashes have been delivered (committed or pending).

Invariants:
- A hash is a duplicate iff it is in the committed stage or the pending stage.
- The committed stage only grows, and only by ``commit``: what a checkpoint has made durable.
  The pending stage holds hashes of batches handed out but not yet committed.
- Committed hashes live in a sorted, unique ``numpy.uint64`` array (``_base``, 8 bytes per hash)
  plus one small sorted delta array; the delta is merged into the base once it outgrows
  1/16 of it, so memory stays under 24 bytes per committed hash even during a merge and
  lookups are two binary searches. A Python ``set`` of ints costs ~60+ bytes per hash.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

_EMPTY = np.empty(0, dtype=np.uint64)
# the delta is merged into the base when larger than base/16 (amortised O(16) moves per hash)
# or than this floor, below which merging a small base is cheap anyway
_DELTA_MERGE_FLOOR = 1 << 16
_DELTA_MERGE_FRACTION = 16


def sorted_unique(hashes: np.ndarray) -> np.ndarray:
    """Sort in place (the caller owns ``hashes``) and drop repeats."""
    hashes.sort()
    if hashes.size > 1:
        repeats = hashes[1:] == hashes[:-1]
        if repeats.any():
            hashes = hashes[np.concatenate(([True], ~repeats))]
    return hashes


def merge_sorted(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Union of two sorted unique arrays whose elements are disjoint."""
    if a.size == 0:
        return b
    if b.size == 0:
        return a
    merged = np.concatenate((a, b))
    merged.sort(kind="stable")  # timsort: two sorted runs merge in linear time
    return merged


def _contains(sorted_hashes: np.ndarray, value: np.uint64) -> bool:
    i = int(sorted_hashes.searchsorted(value))
    return i < sorted_hashes.size and sorted_hashes[i] == value


def isin_sorted(sorted_hashes: np.ndarray, values: np.ndarray) -> np.ndarray:
    if sorted_hashes.size == 0:
        return np.zeros(values.shape, dtype=bool)
    idx = sorted_hashes.searchsorted(values)
    idx[idx == sorted_hashes.size] = 0
    return sorted_hashes[idx] == values


class TwoStageDeduplicator:
    """Committed + pending sets of xxh3_64 record hashes."""

    __slots__ = ("_base", "_delta", "_pending")

    def __init__(self) -> None:
        self._base: np.ndarray = _EMPTY
        self._delta: np.ndarray = _EMPTY
        self._pending: set[int] = set()

    @classmethod
    def with_committed(cls, hashes: Iterable[int] | np.ndarray) -> TwoStageDeduplicator:
        """A deduplicator whose committed stage is ``hashes`` (e.g. the recovered WAL)."""
        dedup = cls()
        if isinstance(hashes, np.ndarray):
            owned = np.array(hashes, dtype=np.uint64, copy=True)
        else:
            owned = np.fromiter(hashes, dtype=np.uint64)
        dedup._base = sorted_unique(owned.ravel())
        return dedup

    # -- queries ---------------------------------------------------------------------------

    def seen(self, h: int) -> bool:
        """True if ``h`` is committed or pending."""
        if h in self._pending:
            return True
        value = np.uint64(h)
        return _contains(self._base, value) or (
            self._delta.size > 0 and _contains(self._delta, value)
        )

    def committed_mask(self, hashes: np.ndarray) -> np.ndarray:
        """Vectorised committed-stage membership of a ``uint64`` array (pending not consulted)."""
        mask = isin_sorted(self._base, hashes)
        if self._delta.size:
            mask |= isin_sorted(self._delta, hashes)
        return mask

    def is_pending(self, h: int) -> bool:
        return h in self._pending

    def pending_among(self, hashes: Iterable[int]) -> set[int]:
        """The members of ``hashes`` that are pending (one C-level pass)."""
        return self._pending.intersection(hashes) if self._pending else set()

    @property
    def committed_count(self) -> int:
        return int(self._base.size + self._delta.size)

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    @property
    def committed_nbytes(self) -> int:
        """Bytes held by the committed stage."""
        return int(self._base.nbytes + self._delta.nbytes)

    # -- updates ---------------------------------------------------------------------------

    def add(self, h: int) -> bool:
        """Record ``h`` as pending; False (and nothing changes) if it was already seen."""
        if self.seen(h):
            return False
        self._pending.add(h)
        return True

    def add_unchecked(self, h: int) -> None:
        """Record ``h`` as pending; the caller has established it is new."""
        self._pending.add(h)

    def add_new(self, hashes: Iterable[int]) -> None:
        """Record ``hashes`` as pending; the caller has established they are all new."""
        self._pending.update(hashes)

    def commit(self, hashes: Iterable[int] | None = None) -> None:
        """Move pending hashes to the committed stage: all of them, or only ``hashes``
        (each must be pending) when a consumer commits an earlier batch than it holds."""
        if hashes is None:
            moving = self._pending
            self._pending = set()
        else:
            moving = set(hashes)
            missing = moving - self._pending
            if missing:
                raise ValueError(f"{len(missing)} hashes committed without being pending")
            self._pending -= moving
        if not moving:
            return
        new = np.fromiter(moving, dtype=np.uint64, count=len(moving))
        new.sort()
        self._delta = merge_sorted(self._delta, new)
        if self._delta.size > max(_DELTA_MERGE_FLOOR, self._base.size // _DELTA_MERGE_FRACTION):
            self._base = merge_sorted(self._base, self._delta)
            self._delta = _EMPTY
