"""Sets of 64-bit record hashes as sorted, unique ``numpy.uint64`` arrays: what a stream's
delivered hashes are kept in (``stream/delivered.py``, ``stream/partition.py``), 8 bytes per
hash where a Python ``set`` of ints costs ~60+.

Invariants:
- Every array these functions take or return is sorted and holds each hash once;
  ``merge_sorted`` takes two such arrays with no hash in common.
- A sort happens in place in the caller's array (``sorted_unique``), never in a copy.
"""

from __future__ import annotations

import numpy as np


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


def isin_sorted(sorted_hashes: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Whether each of ``values`` is in ``sorted_hashes`` (a mask of their shape)."""
    if sorted_hashes.size == 0:
        return np.zeros(values.shape, dtype=bool)
    idx = sorted_hashes.searchsorted(values)
    idx[idx == sorted_hashes.size] = 0
    return sorted_hashes[idx] == values
