"""Sorted hash arrays (``faultfs.store.dedup``): the set operations a stream's delivered hashes
are built from, against Python sets (their model)."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from faultfs.store.dedup import isin_sorted, merge_sorted, sorted_unique

hashes = st.lists(st.integers(0, 2**64 - 1), max_size=200)


def _array(values: list[int]) -> np.ndarray:
    return np.array(values, dtype=np.uint64)


@settings(max_examples=200, deadline=None)
@given(hashes, hashes, hashes)
def test_sorted_hash_arrays_match_a_set_model(a, b, probes):
    left = sorted_unique(_array(a))
    assert left.tolist() == sorted(set(a))
    right = sorted_unique(_array([h for h in b if h not in set(a)]))
    merged = merge_sorted(left, right)
    assert merged.tolist() == sorted(set(a) | set(b))
    mask = isin_sorted(merged, _array(probes))
    assert mask.tolist() == [p in set(a) | set(b) for p in probes]


def test_the_edges_of_the_hash_range_and_empty_arrays():
    top = 2**64 - 1
    assert sorted_unique(_array([top, 0, top])).tolist() == [0, top]
    empty = sorted_unique(_array([]))
    assert merge_sorted(empty, _array([3])).tolist() == [3]
    assert isin_sorted(empty, _array([0, top])).tolist() == [False, False]
    assert isin_sorted(_array([5, top]), _array([top, 6, 5])).tolist() == [True, False, True]
