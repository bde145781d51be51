"""DeliveredHashes: which xxh3_64 record hashes a RecordStream has delivered, decided a whole
block of records at a time with numpy (no Python object per hash).

Why not a committed set and a pending one (the two-stage set ``faultfs.store.dedup`` held
once): a pending stage is a Python ``set`` of ints, filled and drained one hash at a time;
the stream does not need one to decide duplicates. A batch handed out is either covered by a later ``commit`` (which
commits every batch up to its id) or lost with the process, and a reopened stream starts from
the WAL. So within one stream the duplicates are exactly the hashes committed at open plus
every hash delivered since; the hashes a commit writes are kept with each handed-out batch.

Invariants:
- The set is one sorted, unique ``uint64`` array (``_base``) plus one smaller sorted delta,
  disjoint from it and merged into it once it outgrows 1/4 of it (or ``_DELTA_FLOOR``): 8 bytes
  per hash, and up to 2 more for a moment while merging.
- A bit filter of ``2**k`` bits indexed by the top ``k`` bits of a hash has the bit of every
  member set, with ``2**k`` between 8 and 32 bits per member (at least ``2**_MIN_FILTER_BITS``;
  1 to 4 bytes per hash): a probe whose bit is clear is not a member, so only the probes whose
  bit is set (members, and 3-12 % false positives) are looked up by binary search.
"""

from __future__ import annotations

import numpy as np

from faultfs.store.dedup import isin_sorted, merge_sorted, sorted_unique

_EMPTY = np.empty(0, dtype=np.uint64)
_DELTA_FLOOR = 1 << 16  # below this a merge into the base is cheap anyway
_DELTA_FRACTION = 4  # merge the delta when larger than base/4: ~5 moves per hash, and the
# per-block merge into the delta stays small next to a block's own sort
_MIN_FILTER_BITS = 16  # 8 KiB: the filter of a small stream
_FILTER_BITS_PER_HASH = 16  # built with 16-32 bits per member, rebuilt larger below 8
_MAX_FILTER_BITS = 36  # 16 bits for each of the 2**32 hashes a checkpoint can hold
_SET_CHUNK = 1 << 18  # hashes whose filter bits are set at once
_U3, _U7 = np.uint64(3), np.uint64(7)


def first_occurrences(hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct values of ``hashes`` (a ``uint64`` array), sorted, and the index of the
    first occurrence of each: ``np.unique(hashes, return_index=True)``, about twice as fast.

    One in-place sort of keys that hold the top bits of each hash and its index in the low
    bits: equal hashes end up adjacent, in index order. Two different hashes with the same
    top bits (about 2e-4 per 64 K-record block) are detected and left to ``np.unique``.
    """
    n = int(hashes.size)
    index_bits = max(1, (n - 1).bit_length())
    if n > 1 and index_bits <= 32:
        low = np.uint64((1 << index_bits) - 1)
        keys = (hashes & ~low) | np.arange(n, dtype=np.uint64)
        keys.sort()
        pos = (keys & low).astype(np.intp)
        by_hash = hashes[pos]
        same = by_hash[1:] == by_hash[:-1]
        if not (((keys[1:] ^ keys[:-1]) <= low) & ~same).any():
            first = np.empty(n, dtype=bool)
            first[0] = True
            np.logical_not(same, out=first[1:])
            return by_hash[first], pos[first]
    unique, index = np.unique(hashes, return_index=True)
    return unique, index.astype(np.intp)


class DeliveredHashes:
    """A set of 64-bit hashes, queried and grown one sorted array at a time."""

    __slots__ = ("_base", "_delta", "_filter", "_filter_bits")

    def __init__(self, hashes: np.ndarray | None = None, *, copy: bool = True) -> None:
        """A set holding ``hashes`` (e.g. the committed hashes read from a WAL); with
        ``copy=False`` the set sorts the array in place and keeps it."""
        if hashes is None:
            self._base = _EMPTY
        else:
            self._base = sorted_unique(np.array(hashes, dtype=np.uint64, copy=copy).ravel())
        self._delta = _EMPTY
        self._filter = np.zeros(0, dtype=np.uint8)
        self._filter_bits = 0
        self._rebuild_filter()

    def __len__(self) -> int:
        return int(self._base.size + self._delta.size)

    @property
    def nbytes(self) -> int:
        """Bytes held: the sorted arrays and the filter."""
        return int(self._base.nbytes + self._delta.nbytes + self._filter.nbytes)

    # -- the filter ------------------------------------------------------------------------

    def _rebuild_filter(self) -> None:
        want = max(_MIN_FILTER_BITS, (len(self) * _FILTER_BITS_PER_HASH).bit_length())
        if self._filter_bits:
            want = max(want, self._filter_bits + 2)
        self._filter_bits = min(want, _MAX_FILTER_BITS)
        self._filter = np.zeros(1 << (self._filter_bits - 3), dtype=np.uint8)
        self._set_bits(self._base)
        self._set_bits(self._delta)

    def _bit_positions(self, hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        top = hashes >> np.uint64(64 - self._filter_bits)
        return (top >> _U3).astype(np.intp), (top & _U7).astype(np.uint8)

    def _set_bits(self, hashes: np.ndarray) -> None:
        for i in range(0, hashes.size, _SET_CHUNK):  # bounds the temporaries of a rebuild
            byte, bit = self._bit_positions(hashes[i : i + _SET_CHUNK])
            np.bitwise_or.at(self._filter, byte, np.left_shift(np.uint8(1), bit))

    def _maybe(self, hashes: np.ndarray) -> np.ndarray:
        byte, bit = self._bit_positions(hashes)
        return np.asarray((np.right_shift(self._filter[byte], bit) & 1).astype(bool))

    # -- queries and updates ---------------------------------------------------------------

    def contains(self, hashes: np.ndarray) -> np.ndarray:
        """Membership of each element of a ``uint64`` array (fastest when it is sorted)."""
        hit = self._maybe(hashes)
        if hit.any():
            candidates = np.flatnonzero(hit)
            probe = hashes[candidates]
            found = isin_sorted(self._base, probe)
            if self._delta.size:
                found |= isin_sorted(self._delta, probe)
            hit[candidates] = found
        return hit

    def add(self, hashes: np.ndarray) -> None:
        """Add sorted, distinct ``uint64`` hashes, none of them a member yet."""
        if not hashes.size:
            return
        self._delta = merge_sorted(self._delta, hashes)
        if self._delta.size > max(_DELTA_FLOOR, self._base.size // _DELTA_FRACTION):
            self._base = merge_sorted(self._base, self._delta)
            self._delta = _EMPTY
        if len(self) * 8 > (1 << self._filter_bits):
            self._rebuild_filter()  # at least 4x larger: rebuilt O(log n) times
        else:
            self._set_bits(hashes)
