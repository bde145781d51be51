"""The data budget of ``--memory-mb`` (tiers/budget.py) with the memory tier: the tier gives
way to reads in flight, pinned blobs stay, a reader's read waits for room and is let in as
soon as something lands, a prefetch never takes room a reader waits for, and a budget of 0
holds nothing back."""

from __future__ import annotations

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
