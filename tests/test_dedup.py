"""TwoStageDeduplicator: model-checked semantics, partial commits, and the memory budget."""

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from faultfs.store.dedup import TwoStageDeduplicator

hashes = st.integers(0, 2**64 - 1)


def test_committed_and_pending_are_both_duplicates():
    d = TwoStageDeduplicator.with_committed([5, 2**64 - 1])
    assert d.seen(5)
    assert d.seen(2**64 - 1)
    assert not d.seen(6)
    assert d.add(6)
    assert not d.add(6), "pending is a duplicate"
    assert not d.add(5), "committed is a duplicate"
    assert d.is_pending(6)
    assert (d.committed_count, d.pending_count) == (2, 1)
    d.commit()
    assert (d.committed_count, d.pending_count) == (3, 0)
    assert d.seen(6)


def test_partial_commit_moves_only_named_hashes():
    d = TwoStageDeduplicator()
    for h in (1, 2, 3):
        d.add(h)
    d.commit([1, 2])
    assert (d.committed_count, d.pending_count) == (2, 1)
    assert d.is_pending(3)
    with pytest.raises(ValueError, match="without being pending"):
        d.commit([99])


def test_committed_mask_is_vectorised_membership():
    d = TwoStageDeduplicator.with_committed(np.array([10, 30, 2**64 - 1], dtype=np.uint64))
    d.add(20)
    d.commit()
    probe = np.array([0, 10, 20, 25, 30, 2**64 - 1, 2**64 - 2], dtype=np.uint64)
    assert d.committed_mask(probe).tolist() == [False, True, True, False, True, True, False]
    assert TwoStageDeduplicator().committed_mask(probe).tolist() == [False] * 7


def test_with_committed_tolerates_repeats_and_does_not_alias_input():
    src = np.array([3, 1, 3, 2], dtype=np.uint64)
    d = TwoStageDeduplicator.with_committed(src)
    assert d.committed_count == 3
    assert src.tolist() == [3, 1, 3, 2]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(hashes, max_size=20),
    st.lists(st.tuples(st.sampled_from(["add", "commit", "seen"]), hashes), max_size=200),
)
def test_matches_a_set_model(initial, ops):
    d = TwoStageDeduplicator.with_committed(initial)
    committed, pending = set(initial), set()
    for op, h in ops:
        if op == "add":
            assert d.add(h) == (h not in committed and h not in pending)
            if h not in committed:
                pending.add(h)
        elif op == "commit":
            d.commit()
            committed |= pending
            pending = set()
        assert d.seen(h) == (h in committed or h in pending)
    assert d.committed_count == len(committed)
    assert d.pending_count == len(pending)


def test_delta_merges_into_base(monkeypatch):
    import faultfs.store.dedup as mod

    monkeypatch.setattr(mod, "_DELTA_MERGE_FLOOR", 4)
    d = TwoStageDeduplicator()
    rng = np.random.default_rng(0)
    values = rng.integers(0, 2**64 - 1, size=500, dtype=np.uint64).tolist()
    for i, h in enumerate(values):
        d.add(h)
        if i % 7 == 0:
            d.commit()
    d.commit()
    assert d._delta.size <= max(4, d._base.size // 16)
    assert np.all(np.diff(d._base.astype(np.float64)) >= 0)
    assert all(d.seen(h) for h in values)
    assert d.committed_count == len(set(values))


@pytest.mark.slow
def test_ten_million_committed_hashes_fit_24_bytes_each_and_rebuild_fast():
    n = 10_000_000
    wal = np.random.default_rng(1).integers(0, 2**64 - 1, size=n, dtype=np.uint64)
    t0 = time.perf_counter()
    d = TwoStageDeduplicator.with_committed(wal)
    elapsed = time.perf_counter() - t0
    del wal
    assert d.committed_nbytes / n <= 24
    assert elapsed < 5.0, f"rebuild took {elapsed:.2f}s"
    # growing by commits keeps the budget (base + delta, delta <= base/16)
    for seed in (2, 3, 4):
        for h in np.random.default_rng(seed).integers(0, 2**64 - 1, size=10_000, dtype=np.uint64):
            d.add_unchecked(int(h))
        d.commit()
    assert d.committed_nbytes / d.committed_count <= 24
