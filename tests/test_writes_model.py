"""Writes against the chunk model (``faultfs.testing.writes_model``): remounts, kill -9 and
power loss at random steps, a crash at every write and fsync point of a fixed script, and
the model against deliberately broken writes (each must be caught)."""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.errors import Flaky
from hypothesis.stateful import run_state_machine_as_test

from faultfs.testing.writes_model import (
    CS,
    ChunkWritesModel,
    SpillingWritesModel,
    SpillWritesModel,
    WritesModel,
    WritesWorld,
    crash_sweep,
    writes_mutant,
)

SETTINGS = settings(
    max_examples=80, stateful_step_count=30, deadline=None, database=None,
    derandomize=bool(os.environ.get("CI")), suppress_health_check=[HealthCheck.too_slow])

test_writes_match_the_chunk_model = SpillingWritesModel.TestCase
test_writes_match_the_chunk_model.settings = SETTINGS


@pytest.mark.parametrize("behind", [False, True], ids=["faulted-first", "faulted-behind"])
def test_a_crash_at_every_write_and_fsync_point_keeps_a_synced_prefix(behind):
    """``faulted-behind``: a partial write's size-0 request runs behind it and each step's
    end stops it, landed or not (a kill before the base was staged)."""
    points = crash_sweep(seeds=3 if not behind else 2, behind=behind)
    assert points > 20  # the script reaches appends, syncs, folds and state files


@pytest.mark.parametrize("then", ["kill", "power"])
def test_a_write_acknowledged_before_its_base_faulted_survives_a_stop(then):
    """The base fault behind a partial write never lands (the step ends first): after a kill
    the write is there, over the source's bytes; after an fsync it survives a power loss."""
    from faultfs.engine.writes import BASE_FAULTS

    for seed in range(4):
        world = WritesWorld(3 * CS, CS, behind=True)
        try:
            rng = random.Random(seed)
            for index in range(3):
                world.write_chunk(index, rng.randrange(CS - 64), rng.randbytes(64))
            assert BASE_FAULTS >= 3
            assert not any(world.engine.is_staged(world.tag, i) for i in range(3)), \
                "the bases were never faulted"
            if then == "power":
                world.fsync()
            world.remount(then, rng)
            world.check_view(0, 3 * CS)
            world.remount("clean")
            world.check_view(0, 3 * CS)
        finally:
            world.close()


@pytest.mark.parametrize("kind", ["nosync", "noreplay", "nofold", "nodirectsync",
                                  "nosizefold", "spillzeros"])
def test_the_writes_model_catches_broken_writes(kind):
    hunt = settings(SETTINGS, max_examples=300, derandomize=True,
                    phases=[Phase.explicit, Phase.generate])
    # (a user blob's size; a spill)
    model = {"nosizefold": WritesModel, "spillzeros": SpillWritesModel}.get(kind, ChunkWritesModel)
    with writes_mutant(kind), pytest.raises((AssertionError, Flaky)):
        run_state_machine_as_test(model, settings=hunt)


@pytest.mark.parametrize("kind", ["nodirectcheck", "nodirectsync", "nosync"])
@pytest.mark.parametrize("behind", [False, True], ids=["faulted-first", "faulted-behind"])
def test_the_crash_sweep_catches_broken_durability(kind, behind):
    """The fixed script's crash at every write and fsync point catches what breaks the
    durability of writes, deterministically. ``nodirectcheck`` (a replay that trusts a torn
    whole-chunk file) is caught here and not by the random hunt above: it needs a power loss
    to tear an unsynced direct file, which the hunt reached or missed depending on which
    tests ran before it in the same process (after tests/test_operations.py's parser test it
    missed it, on the tree before this test too)."""
    with writes_mutant(kind), pytest.raises(AssertionError):
        crash_sweep(seeds=3 if not behind else 2, behind=behind)


@pytest.mark.parametrize("then", ["fsync", "checkpoint"])
@pytest.mark.parametrize("size", [100, CS], ids=["journal-record", "whole-chunk"])
def test_writes_found_after_a_kill_are_made_durable_by_the_next_sync(then, size):
    """Found by the model: what a kill -9 left (journal records, the segment's name, a
    whole-chunk write's direct file) is in the page cache only; the next fsync (or the
    checkpoint that folds it) must sync it, or a power loss then loses a write that was
    fsynced (or leaves the chunk a file of zeros)."""
    for seed in range(8):
        world = WritesWorld(1, CS)
        try:
            world.write_chunk(0, 0, random.Random(seed).randbytes(size))
            world.remount("kill")
            getattr(world, then)()
            world.remount("power", random.Random(seed))  # settle: the write is there
        finally:
            world.close()


def test_a_crash_at_every_point_of_a_reset_rename_or_unlink_leaves_the_tag_whole():
    """Resets, creates, renames, exchanges and unlinks between writes: a crash at every
    point, as a kill and as a power loss, brings the tag back whole at one step — never a
    mix (``faultfs/testing/table_sweep.py``)."""
    from faultfs.testing.table_sweep import table_crash_sweep

    assert table_crash_sweep(seeds=2) > 30
