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
    WritesModel,
    WritesWorld,
    crash_sweep,
    writes_mutant,
)

SETTINGS = settings(
    max_examples=80, stateful_step_count=30, deadline=None, database=None,
    derandomize=bool(os.environ.get("CI")), suppress_health_check=[HealthCheck.too_slow])

test_writes_match_the_chunk_model = WritesModel.TestCase
test_writes_match_the_chunk_model.settings = SETTINGS


def test_a_crash_at_every_write_and_fsync_point_keeps_a_synced_prefix():
    points = crash_sweep(seeds=3)
    assert points > 20  # the script reaches appends, syncs, folds and state files


@pytest.mark.parametrize("kind", ["nosync", "noreplay", "nofold", "nodirectsync",
                                  "nodirectcheck", "nosizefold", "spillzeros"])
def test_the_writes_model_catches_broken_writes(kind):
    hunt = settings(SETTINGS, max_examples=300, derandomize=True,
                    phases=[Phase.explicit, Phase.generate])
    model = WritesModel if kind == "nosizefold" else ChunkWritesModel  # (a user blob's size)
    with writes_mutant(kind), pytest.raises((AssertionError, Flaky)):
        run_state_machine_as_test(model, settings=hunt)


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
