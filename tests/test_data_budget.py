"""The data budget of ``--memory-mb`` (tiers/budget.py) with the memory tier: the tier gives
way to reads in flight, pinned blobs stay, a reader's read waits for room and is let in as
soon as something lands, a prefetch never takes room a reader waits for, and a budget of 0
holds nothing back."""

from __future__ import annotations

import pytest
import trio

from faultfs.tiers.budget import DataBudget
from faultfs.tiers.memory import MemoryTier

MiB = 1 << 20


def blob(n: int = 1) -> memoryview:
    return memoryview(bytearray(n * MiB))


def test_the_tier_gives_way_to_reads_in_flight_and_keeps_pinned_blobs():
    tier = MemoryTier(4 * MiB)
    for i in range(4):
        assert tier.keep((1, i), blob())
    tier.pin((1, 0))  # its store write is pending: dropping it would free nothing
    tier.budget.take(2 * MiB)  # a run of two blobs starts
    assert tier.size == 2 * MiB and (1, 0) in tier and (1, 1) not in tier
    assert tier.budget.peak == 4 * MiB
    tier.budget.take(3 * MiB)  # over: only the pinned blob is left
    assert tier.size == MiB and (1, 0) in tier
    tier.budget.give(5 * MiB)
    tier.unpin((1, 0))
    assert tier.budget.fixed() == 0


def test_a_readers_read_waits_for_room_and_goes_once_a_read_lands():
    tier = MemoryTier(4 * MiB)
    budget = tier.budget
    order = []

    async def main():
        budget.take(3 * MiB)  # a prefetch run in flight
        assert not budget.fits(2 * MiB)

        async def reader():
            await budget.admit(2 * MiB)
            order.append("admitted")

        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(reader)
                await trio.sleep(0.05)
                assert order == [], "no room: it waits"
                assert not budget.fits(MiB), "a prefetch does not take room a reader waits for"
                order.append("landed")
                budget.give(3 * MiB)
        assert budget.waits == 1

    trio.run(main)
    assert order == ["landed", "admitted"]


def test_a_read_larger_than_the_budget_goes_when_nothing_is_held_and_zero_holds_nothing():
    async def main():
        with trio.fail_after(5):
            await DataBudget(MiB).admit(8 * MiB)  # nothing held: it goes
            none = DataBudget(0)
            none.take(64 * MiB)
            await none.admit(8 * MiB)  # --memory-mb 0: no memory tier, nothing held back

    trio.run(main)


class _SlowObjects:
    """An object store whose puts take ``put_s`` each (a publish under way)."""

    put_s = 0.3

    def __init__(self, root: str) -> None:
        from faultfs.tiers.objects import LocalObjects

        self._objects = LocalObjects(root)
        self.url = root

    def put(self, key: str, data: bytes, *, create: bool = False) -> bool:
        import time

        time.sleep(self.put_s)
        return self._objects.put(key, data, create=create)


def test_a_readers_read_waiting_behind_publishes_goes_as_soon_as_they_end(tmp_path):
    """Blobs waiting to be published to the shared store count against the budget; a
    reader's read that does not fit beside them goes as soon as they are published. (A
    publish that ended woke nobody once: with nothing else in flight, a node's readers
    waited for room forever after a burst of publishes, and its mount hung.)"""
    from faultfs.iopool import IoPool
    from faultfs.stats import Stats
    from faultfs.store.blobstore import BlobStore
    from faultfs.tiers.base import TierTag
    from faultfs.tiers.local import LocalTier
    from faultfs.tiers.multilevel import TierStack
    from faultfs.tiers.policy import StorePolicy
    from faultfs.tiers.shared import SharedTier

    stats, pool = Stats(), IoPool(8)
    shared = SharedTier(_SlowObjects(str(tmp_path / "shared")), stats)  # type: ignore[arg-type]
    policy = StorePolicy(store_enabled=True, reserve_bytes=0, cache_size=0, backoff_faults=0)
    tiers = TierStack(MemoryTier(4 * MiB), LocalTier(BlobStore(str(tmp_path / "store")), policy,
                                                     pool, stats, inline_read=0),
                      pool, stats, shared)
    tag = TierTag(1, "t", "v", 8, MiB, lambda i: f"chunk_{i}", lambda n: None,
                  "fault:0123456789abcdef")
    shared.open_tag(tag)
    budget = tiers.budget
    times = {}

    async def main():
        async with trio.open_nursery() as nursery:
            for i in range(4):  # the whole budget waits to be published (claimed blobs)
                nursery.start_soon(shared.publish_counted, (1, i), blob())
            await trio.sleep(0.05)
            assert budget.fixed() == 4 * MiB and not budget.fits(MiB)
            started = trio.current_time()
            with trio.fail_after(5):
                await budget.admit(MiB)
            times["admitted"] = trio.current_time() - started

    trio.run(main)
    assert shared.waiting == 0 and stats.counters["shared_publishes"] == 4
    # the puts take 0.3 s (four at once); the wait ends with them, not at the recheck (1 s)
    assert 0.2 < times["admitted"] < 0.8, times


def test_blobs_a_sequential_reader_passed_drop_before_those_ahead_of_it():
    tier = MemoryTier(4 * MiB)
    for i in range(4):  # 0 and 1 read; 2 and 3 prefetched, not read yet
        assert tier.keep((1, i), blob())
    tier.held((1, 0))
    tier.held((1, 1))  # the reader's reads refreshed them: they are the most recent now
    tier.demote((1, 1))  # ... but it has moved on past them
    tier.demote((1, 0))
    tier.budget.take(2 * MiB)  # a run starts: two blobs must go
    assert (1, 2) in tier and (1, 3) in tier and (1, 0) not in tier and (1, 1) not in tier
    tier.demote((9, 9))  # not here: nothing happens


def test_blobs_kept_ahead_and_not_read_drop_after_every_blob_read():
    """A reader slower than its prefetch: the window's landed blobs are older than the blobs
    it just read, and least-recently-used order would drop the next ones it needs (each then
    read back from the store: one for one in an h5py read of a 256 MiB dataset). When blobs
    kept ahead must go, the furthest ahead go first; the blob read last (its reader is
    likely in the middle of it: the kernel reads a blob in pieces) goes after all of them."""
    tier = MemoryTier(6 * MiB)
    for i in range(4):  # prefetched ahead of the reader, in the order they landed
        assert tier.keep((1, 10 + i), blob(), ahead=True)
    for i in range(2):  # the reader's own blobs (and its file's metadata), read since
        assert tier.keep((1, i), blob())
        tier.held((1, i))
    tier.held((1, 10))  # it reached the first blob of the window: its first piece served
    tier.reader_at((1, 10))
    tier.budget.take(2 * MiB)  # room for two blobs is needed: the blobs read before go
    assert (1, 0) not in tier and (1, 1) not in tier
    assert all((1, 10 + i) in tier for i in range(4))
    tier.budget.take(2 * MiB)  # more than what was read: the furthest ahead go
    assert (1, 13) not in tier and (1, 12) not in tier
    assert (1, 10) in tier and (1, 11) in tier
    tier.budget.take(MiB)  # and only then the blob being read
    assert (1, 11) not in tier and (1, 10) in tier
    tier.budget.take(MiB)
    assert tier.size == 0


def test_a_blob_kept_ahead_loses_its_place_when_passed_or_when_nobody_came_for_it():
    tier = MemoryTier(4 * MiB)
    assert tier.keep((1, 0), blob(), ahead=True)
    assert tier.keep((1, 1), blob(), ahead=True)
    tier.demote((1, 0))  # the reader moved past it without reading it
    assert tier.keep((2, 0), blob())
    tier.held((2, 0))
    tier.budget.take(2 * MiB)
    assert (1, 0) not in tier and (2, 0) in tier and (1, 1) in tier
    tier.budget.give(2 * MiB)
    # a prefetch nobody came back for: once twice the tier's bound has come in since, it
    # goes in least-recently-used order like any other blob
    for i in range(8):
        assert tier.keep((3, i), blob())
        tier.held((3, i))
        if i < 5:
            assert (1, 1) in tier, i
    assert (1, 1) not in tier


def test_a_run_slice_read_stays_while_a_sibling_is_kept_ahead_and_unread():
    """The blobs of one source run are slices of one buffer and drop together: a read one
    whose sibling is ahead and unread is not dropped before other blobs read."""
    run = memoryview(bytearray(2 * MiB))
    tier = MemoryTier(4 * MiB)
    assert tier.keep((1, 0), run[:MiB], ahead=True)
    assert tier.keep((1, 1), run[MiB:], ahead=True)
    tier.held((1, 0))  # read: (1, 1) still ahead
    assert tier.keep((2, 0), blob())
    tier.held((2, 0))
    tier.held((1, 0))  # the run's read blob is the most recent
    tier.budget.take(2 * MiB)
    assert (1, 0) in tier and (1, 1) in tier and (2, 0) not in tier


@pytest.mark.parametrize("run", [1, 32])  # blobs of their own (S3); slices of runs (a file)
def test_making_room_walks_only_the_blobs_it_may_drop(monkeypatch, run):
    """64 KiB blobs under a 64 MiB budget, memory holding mostly a window kept ahead and
    not read: each blob a reader reads makes room by walking the blobs read, not every
    blob kept ahead (it did: ~960 checks of a blob, each walking its run, per keep)."""
    from faultfs.tiers import memory

    cs = 64 << 10
    tier = MemoryTier(1024 * cs)
    index = 0
    for _ in range(960 // run):
        buf = memoryview(bytearray(run * cs))
        for j in range(run):
            assert tier.keep((1, index), buf[j * cs:(j + 1) * cs] if run > 1 else buf,
                             ahead=True)
            index += 1
    tier.pin((9, 0))  # a fault's blob waiting for its store write
    tier.keep((9, 0), memoryview(bytearray(cs)))
    checks = 0
    shared = memory._shared_buffer

    def counted(data):
        nonlocal checks
        checks += 1
        return shared(data)

    monkeypatch.setattr(memory, "_shared_buffer", counted)
    reads = 200
    for i in range(reads):  # a reader's own blobs (another file, its metadata), read
        tier.keep((2, i), memoryview(bytearray(cs)))
        tier.held((2, i))
    assert checks / reads < 20, f"{checks / reads:.0f} blob checks per keep"
    assert all((1, i) in tier for i in range(960)), "a blob kept ahead went first"


def test_two_files_readers_each_keep_the_blobs_next_to_them():
    """Blobs kept ahead go furthest from their own file's reader first, not by index
    alone (a reader deep into one file lost its whole window, its next blob first, before
    a reader at the start of another lost any; a review); a look back at a blob behind the
    reader (an index node read again) does not move it (it did, a second review)."""
    tier = MemoryTier(11 * MiB)
    for key in [(1, 990), (1, 1000), (2, 0)]:  # file 1's reader is at blob 1000, 2's at 0
        tier.keep(key, blob())
        tier.held(key)
        tier.reader_at(key)
    for i in range(1, 5):  # their windows land interleaved
        assert tier.keep((1, 1000 + i), blob(), ahead=True)
        assert tier.keep((2, i), blob(), ahead=True)
    tier.held((1, 990))  # the look back
    tier.budget.take(6 * MiB)
    a = [i for i in range(1, 5) if (1, 1000 + i) in tier]
    b = [i for i in range(1, 5) if (2, i) in tier]
    assert a == [1, 2] and b == [1, 2], (a, b)
    tier.budget.give(6 * MiB)
    assert tier.keep((1, 1003), blob(), ahead=True)  # read ahead from the store: it stays
    assert (1, 1003) in tier


def test_blobs_a_reader_skipped_go_before_those_next_to_it():
    tier = MemoryTier(8 * MiB)
    tier.keep((1, 0), blob())
    tier.held((1, 0))
    for i in range(1, 8):  # the window lands
        tier.keep((1, i), blob(), ahead=True)
    for i in (2, 4, 6):  # the reader reads every other blob, passing the one before
        tier.demote((1, i - 2))
        tier.held((1, i))
        tier.reader_at((1, i))
    for i in range(8, 12):  # the window moves on
        tier.keep((1, i), blob(), ahead=True)
    assert (1, 1) not in tier and (1, 7) in tier and (1, 8) in tier


def test_a_look_at_a_blob_that_is_not_a_read_leaves_its_place(tmp_path):
    """A publish's read back of a blob (``TierStack.peek``) is not a reader's read."""
    from faultfs.store.blobstore import BlobStore
    from faultfs.testing.fakes import engine_for

    engine = engine_for(BlobStore(str(tmp_path / "store")), memory_mb=8)
    try:
        tiers = engine.tiers
        tiers.memory.keep((1, 0), blob(), ahead=True)
        tiers.memory.keep((1, 1), blob())
        tiers.memory.held((1, 1))
        assert tiers.peek((1, 0)) is not None
        assert (1, 0) in tiers.memory._ahead and tiers.memory._last_read == (1, 1)
    finally:
        engine.close()
