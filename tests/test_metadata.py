"""DualMetadataManager: every recovery case, corruption, WAL truncation, and crash simulation.

The crash simulator is an in-memory disk (``SimDisk``) implementing the manager's FileOps
seam: each file keeps its durable bytes and a list of writes since its last fsync; names keep
a durable map and a list of creations/renames since the last directory fsync. A "crash" at a
chosen write or fsync point builds the disk a reboot would see: every unsynced write is
independently applied, dropped or torn (a random mix of old and new bytes), and a prefix of
the unsynced name operations survives. Recovery must yield the previous commit or the new one.
"""

from __future__ import annotations

import os
import random
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from faultfs.core.coord import StreamCoordinate
from faultfs.core.slots import SLOT_SIZE, DiskSlot
from faultfs.errors import CorruptionError, InvalidInput
from faultfs.store.fileops import OsFileOps
from faultfs.store.metadata import DualMetadataManager, read_meta
from faultfs.testing.crashfs import SimDisk, SimOps, SimulatedCrash

C1 = StreamCoordinate(0, 100, 0, 0, 0, 10)
C2 = StreamCoordinate(1, 200, 0, 0, 0, 20)


def slot_bytes(epoch, batch=0, coord=C1, count=0):
    return DiskSlot(epoch, batch, coord, count).encode()


def write_meta(path, a=bytes(64), b=bytes(64)):
    path.write_bytes(a + b)


# ---------------------------------------------------------------------------------------------
# real file system


def test_fresh_open_creates_128_zero_bytes_and_empty_wal(tmp_path):
    meta = tmp_path / "s.meta"
    with DualMetadataManager.open(meta) as m:
        assert m.is_fresh
        assert (m.epoch, m.committed_batch_id, m.coord, m.dedup_count) == (
            0, 0, StreamCoordinate(), 0,
        )
        assert m.recovery.active is None
        assert len(m.committed_hashes()) == 0
    raw = meta.read_bytes()
    assert raw[:64] == bytes(64)
    assert raw[64:] == DiskSlot(0, 0, StreamCoordinate(), 0).encode(), "genesis slot B"
    assert (tmp_path / "s.meta.dedup").read_bytes() == b""
    assert not (tmp_path / "s.meta.tmp").exists()


def test_commit_round_trip_and_ping_pong(tmp_path):
    meta = tmp_path / "s.meta"
    with DualMetadataManager.open(meta) as m:
        s1 = m.commit(1, C1, [1, 2, 3])
        assert (s1.epoch, s1.offset) == (1, 0)
        assert meta.stat().st_size == 128
        s2 = m.commit(2, C2, [2**64 - 1])
        assert (s2.epoch, s2.offset) == (2, 64)
        s3 = m.commit(5, C1, [])
        assert (s3.epoch, s3.offset) == (3, 0)
        assert meta.stat().st_size == 128
    raw = meta.read_bytes()
    assert raw[:64] == s3.encode()
    assert raw[64:] == s2.encode()
    wal = (tmp_path / "s.meta.dedup").read_bytes()
    assert wal == struct.pack("<4Q", 1, 2, 3, 2**64 - 1)
    with DualMetadataManager.open(meta) as m:
        assert (m.epoch, m.committed_batch_id, m.coord, m.dedup_count) == (3, 5, C1, 4)
        assert m.committed_hashes().tolist() == [1, 2, 3, 2**64 - 1]
        assert m.committed_hashes(2).tolist() == [3, 2**64 - 1]  # a shuffled epoch's own
        assert m.committed_hashes(4).tolist() == m.committed_hashes(9).tolist() == []
        assert m.recovery.active == "A"


def test_directory_is_fsynced_when_files_are_created(tmp_path):
    calls = []

    class Recording(OsFileOps):
        def fsync_dir(self, path):
            calls.append(path)
            super().fsync_dir(path)

    DualMetadataManager.open(tmp_path / "s.meta", ops=Recording()).close()
    assert calls == [str(tmp_path)]
    DualMetadataManager.open(tmp_path / "s.meta", ops=Recording()).close()
    assert calls == [str(tmp_path)], "reopening creates nothing, so no directory fsync"


def test_commit_fsyncs_wal_before_slot(tmp_path):
    events = []

    class Recording(OsFileOps):
        def pwrite(self, fd, data, offset):
            events.append(("write", len(data)))
            return super().pwrite(fd, data, offset)

        def fsync(self, fd):
            events.append(("fsync",))
            super().fsync(fd)

    m = DualMetadataManager.open(tmp_path / "s.meta", ops=Recording())
    events.clear()
    m.commit(1, C1, [7, 8])
    assert events == [("write", 16), ("fsync",), ("write", 64), ("fsync",)]
    m.close()


# ---------------------------------------------------------------------------------------------
# recovery cases


def test_higher_epoch_wins_either_slot(tmp_path):
    meta = tmp_path / "s.meta"
    write_meta(meta, slot_bytes(3, 30, C1), slot_bytes(2, 20, C2))
    with DualMetadataManager.open(meta) as m:
        assert (m.epoch, m.committed_batch_id, m.coord, m.recovery.active) == (3, 30, C1, "A")
    write_meta(meta, slot_bytes(3, 30, C1), slot_bytes(4, 40, C2))
    with DualMetadataManager.open(meta) as m:
        assert (m.epoch, m.committed_batch_id, m.coord, m.recovery.active) == (4, 40, C2, "B")


@pytest.mark.parametrize("damage", ["crc", "magic", "version", "zero"])
def test_torn_slot_falls_back_to_partner(tmp_path, damage):
    meta = tmp_path / "s.meta"
    newer = bytearray(slot_bytes(4, 40, C2))
    if damage == "crc":
        newer[30] ^= 0xFF
    elif damage == "magic":
        newer[0:4] = b"JUNK"
    elif damage == "version":
        newer[4] = 9
    else:
        newer[:] = bytes(64)
    write_meta(meta, slot_bytes(3, 30, C1), bytes(newer))
    with DualMetadataManager.open(meta) as m:
        assert (m.epoch, m.committed_batch_id, m.coord) == (3, 30, C1)
        assert m.recovery.active == "A"
        # the next commit (epoch 4) overwrites the torn slot B
        m.commit(41, C2)
    with DualMetadataManager.open(meta) as m:
        assert (m.epoch, m.committed_batch_id) == (4, 41)


def test_torn_slot_a_falls_back_to_slot_b(tmp_path):
    meta = tmp_path / "s.meta"
    torn = bytearray(slot_bytes(5, 50, C1))
    torn[50:] = bytes(14)
    write_meta(meta, bytes(torn), slot_bytes(4, 40, C2))
    with DualMetadataManager.open(meta) as m:
        assert (m.epoch, m.committed_batch_id, m.recovery.active) == (4, 40, "B")


def test_two_zero_slots_are_fresh(tmp_path):
    meta = tmp_path / "s.meta"
    write_meta(meta)
    with DualMetadataManager.open(meta) as m:
        assert m.is_fresh
        assert m.recovery.active is None


def test_torn_first_commit_falls_back_to_genesis(tmp_path):
    # epoch 1 goes to slot A; a crash tearing it leaves A garbage and the genesis slot B
    meta = tmp_path / "s.meta"
    DualMetadataManager.open(meta).close()
    torn = bytearray(slot_bytes(1, 1, C1, 3))
    torn[20:] = bytes(44)
    with meta.open("r+b") as f:
        f.write(bytes(torn))
    (tmp_path / "s.meta.dedup").write_bytes(struct.pack("<3Q", 1, 2, 3))
    with DualMetadataManager.open(meta) as m:
        assert m.is_fresh
        assert m.recovery.active is None
        assert "genesis" in m.recovery.reason
    assert (tmp_path / "s.meta.dedup").read_bytes() == b""


def test_garbage_slot_a_with_zero_slot_b_is_corruption(tmp_path):
    # our writer never leaves this (a new file has the genesis slot in B)
    meta = tmp_path / "s.meta"
    torn = bytearray(slot_bytes(1, 1, C1, 3))
    torn[20:] = bytes(44)
    write_meta(meta, bytes(torn), bytes(64))
    with pytest.raises(CorruptionError, match=r"no valid slot: slot A is bad crc.*slot B is all-zero"):
        DualMetadataManager.open(meta)


def test_same_epoch_in_both_slots_is_corruption(tmp_path):
    meta = tmp_path / "s.meta"
    write_meta(meta, slot_bytes(3, 1), slot_bytes(3, 2))
    with pytest.raises(CorruptionError, match="both slots hold epoch 3"):
        DualMetadataManager.open(meta)


def test_slot_in_wrong_position_is_corruption(tmp_path):
    meta = tmp_path / "s.meta"
    write_meta(meta, slot_bytes(2), bytes(64))
    with pytest.raises(CorruptionError, match="slot A holds epoch 2, which belongs in slot B"):
        DualMetadataManager.open(meta)


@pytest.mark.parametrize(
    ("a", "b", "match"),
    [
        (b"\x01" * 64, b"\x02" * 64, "no valid slot: slot A is bad magic"),
        (bytes(64), b"garbage!" * 8, "slot B is bad magic"),
        (b"LMDL" + bytes(60), b"LMDL" + bytes(60), "slot A is bad version"),
    ],
)
def test_no_valid_slot_in_nonzero_file_is_corruption(tmp_path, a, b, match):
    meta = tmp_path / "s.meta"
    write_meta(meta, a, b)
    with pytest.raises(CorruptionError, match=match):
        DualMetadataManager.open(meta)
    assert meta.read_bytes() == a + b, "a corrupt checkpoint is never rewritten"


@pytest.mark.parametrize("size", [0, 64, 127, 129, 4096])
def test_meta_of_wrong_size_is_corruption(tmp_path, size):
    meta = tmp_path / "s.meta"
    meta.write_bytes(b"\x00" * size)
    with pytest.raises(CorruptionError, match=f"must be 128 bytes, is {size}"):
        DualMetadataManager.open(meta)
    with pytest.raises(CorruptionError, match=f"is {size}"):
        read_meta(str(meta))


def test_wal_shorter_than_dedup_count_is_corruption(tmp_path):
    meta = tmp_path / "s.meta"
    write_meta(meta, slot_bytes(1, 1, C1, 4))
    (tmp_path / "s.meta.dedup").write_bytes(bytes(24))
    with pytest.raises(CorruptionError, match="24 bytes but the checkpoint commits 4 hashes"):
        DualMetadataManager.open(meta)
    assert (tmp_path / "s.meta.dedup").stat().st_size == 24, "nothing changed"


def test_a_wal_with_hashes_but_no_meta_is_refused_and_kept(tmp_path):
    # The .meta is gone (deleted, not copied along): opening made a fresh one and cut the
    # WAL's committed hashes to nothing, so every record would come again.
    wal = tmp_path / "s.meta.dedup"
    wal.write_bytes(bytes(range(80)))
    with pytest.raises(CorruptionError, match=r"s\.meta\.dedup: dedup WAL holds 80 bytes "
                       r"but its checkpoint .*s\.meta is missing"):
        DualMetadataManager.open(tmp_path / "s.meta")
    assert wal.read_bytes() == bytes(range(80)), "nothing changed"
    assert sorted(os.listdir(tmp_path)) == ["s.meta.dedup"]
    wal.write_bytes(b"")  # an empty WAL commits nothing: a fresh start
    with DualMetadataManager.open(tmp_path / "s.meta") as m:
        assert m.is_fresh


def test_a_refused_open_creates_nothing(tmp_path):
    meta = tmp_path / "s.meta"
    write_meta(meta, b"\xff" * 64, b"\xff" * 64)
    with pytest.raises(CorruptionError, match="no valid slot"):
        DualMetadataManager.open(meta)
    assert sorted(os.listdir(tmp_path)) == ["s.meta"], "no WAL made for a corrupt checkpoint"
    other = tmp_path / "o"
    other.mkdir()
    (other / "s.meta.dedup").mkdir()
    with pytest.raises(InvalidInput, match=r"s\.meta\.dedup is a directory"):
        DualMetadataManager.open(other / "s.meta")
    assert sorted(os.listdir(other)) == ["s.meta.dedup"], "no .meta made beside a bad WAL"


def test_dedup_count_overwritten_with_u32_max_is_detected(tmp_path):
    meta = tmp_path / "s.meta"
    raw = bytearray(slot_bytes(1, 1, C1, 2))
    raw[56:60] = struct.pack("<I", 2**32 - 1)  # the CRC catches the overwrite...
    write_meta(meta, bytes(raw))
    (tmp_path / "s.meta.dedup").write_bytes(bytes(16))
    with pytest.raises(CorruptionError, match="no valid slot: slot A is bad crc"):
        DualMetadataManager.open(meta)
    # ...and a slot that claims 2**32-1 hashes with a valid CRC meets the WAL length check
    write_meta(meta, slot_bytes(1, 1, C1, 2**32 - 1))
    with pytest.raises(CorruptionError, match="checkpoint commits 4294967295 hashes"):
        DualMetadataManager.open(meta)


def test_wal_is_truncated_to_committed_hashes(tmp_path):
    meta = tmp_path / "s.meta"
    with DualMetadataManager.open(meta) as m:
        m.commit(1, C1, [10, 20])
    wal = tmp_path / "s.meta.dedup"
    with wal.open("ab") as f:
        f.write(struct.pack("<Q", 30) + b"\x99\x99\x99")  # uncommitted append, torn
    with DualMetadataManager.open(meta) as m:
        assert m.dedup_count == 2
        assert m.committed_hashes().tolist() == [10, 20]
        m.commit(2, C2, [40])
    assert wal.read_bytes() == struct.pack("<3Q", 10, 20, 40)


def test_commit_refuses_bad_values_and_changes_nothing(tmp_path):
    meta = tmp_path / "s.meta"
    with DualMetadataManager.open(meta) as m:
        m.commit(1, C1, [1])
        before = meta.read_bytes()
        with pytest.raises(InvalidInput, match="committed_batch_id"):
            m.commit(-1, C1, [2])
        assert meta.read_bytes() == before
        assert m.epoch == 1
    assert (tmp_path / "s.meta.dedup").read_bytes() == struct.pack("<Q", 1)


def test_commit_past_u32_hashes_is_refused(tmp_path):
    meta = tmp_path / "s.meta"
    nearly_full = 2**32 - 2
    write_meta(meta, slot_bytes(1, 1, C1, nearly_full))
    with (tmp_path / "s.meta.dedup").open("wb") as f:
        f.truncate(nearly_full * 8)  # sparse: 32 GiB of zeros that take no space
    with DualMetadataManager.open(meta) as m:
        with pytest.raises(InvalidInput, match="dedup WAL would hold 4294967297 hashes"):
            m.commit(2, C1, [1, 2, 3])
        assert m.epoch == 1
    assert meta.read_bytes()[:64] == slot_bytes(1, 1, C1, nearly_full)


def test_closed_manager_refuses_commit(tmp_path):
    m = DualMetadataManager.open(tmp_path / "s.meta")
    m.close()
    with pytest.raises(InvalidInput, match="closed"):
        m.commit(1, C1)


def test_read_meta_missing_file(tmp_path):
    with pytest.raises(Exception, match="no such checkpoint file"):
        read_meta(str(tmp_path / "nope.meta"))


# ---------------------------------------------------------------------------------------------
# crash simulation


META = "/sim/s.meta"


def _state(m):
    return (m.epoch, m.committed_batch_id, m.coord, m.committed_hashes().tolist())


def _run(disk, commits, crash_at):
    """Open and apply ``commits``; return the states a crash may legally leave behind."""
    ops = SimOps(disk, crash_at)
    fresh = (0, 0, StreamCoordinate(), [])
    legal = [fresh]
    try:
        m = DualMetadataManager.open(META, ops=ops)
        legal = [_state(m)]
        for batch_id, coord, hashes in commits:
            before = _state(m)
            new = (before[0] + 1, batch_id, coord, before[3] + list(hashes))
            legal = [before, new]
            m.commit(batch_id, coord, hashes)
            legal = [new]
        return legal, ops.points, False
    except SimulatedCrash:
        return legal, ops.points, True


def _recover(disk):
    m = DualMetadataManager.open(META, ops=SimOps(disk))
    state = _state(m)
    m.close()
    return state


commit_lists = st.lists(
    st.tuples(
        st.integers(0, 2**64 - 1),
        st.builds(StreamCoordinate, st.integers(0, 9), st.integers(0, 2**40)),
        st.lists(st.integers(0, 2**64 - 1), max_size=5),
    ),
    min_size=1,
    max_size=5,
)


def test_crash_at_every_point_of_every_commit_recovers_previous_or_new():
    rng = random.Random(1234)
    commits = [
        (1, C1, [11, 12, 13]),
        (2, C2, []),
        (3, StreamCoordinate(2, 7), [14]),
        (9, StreamCoordinate(3, 8), [15, 16]),
    ]
    _, total, crashed = _run(SimDisk(), commits, None)
    assert not crashed
    for point in range(total):
        for _ in range(12):  # several fates of the unsynced writes per point
            disk = SimDisk()
            legal, _, crashed = _run(disk, commits, point)
            assert crashed
            recovered = _recover(disk.crash(rng))
            assert recovered in legal, (point, recovered, legal)


@settings(max_examples=150, deadline=None)
@given(commit_lists, st.integers(0, 60), st.integers(0, 2**32), st.integers(0, 60))
def test_crash_anywhere_then_crash_during_recovery(commits, point, seed, second_point):
    rng = random.Random(seed)
    disk = SimDisk()
    legal, _, _ = _run(disk, commits, point)
    after = disk.crash(rng)
    # a second crash while recovering (it truncates the WAL) must not lose the commit either
    ops = SimOps(after, second_point)
    try:
        DualMetadataManager.open(META, ops=ops).close()
    except SimulatedCrash:
        after = after.crash(rng)
    recovered = _recover(after)
    assert recovered in legal
    # and the recovered checkpoint accepts further commits that themselves survive
    m = DualMetadataManager.open(META, ops=SimOps(after))
    m.commit(7, C2, [1, 2])
    expected = _state(m)
    m.close()
    assert _recover(after.crash(rng)) == expected


def test_every_crash_leaves_meta_128_bytes_or_absent():
    rng = random.Random(7)
    commits = [(1, C1, [1]), (2, C2, [2])]
    _, total, _ = _run(SimDisk(), commits, None)
    for point in range(total):
        disk = SimDisk()
        _run(disk, commits, point)
        after = disk.crash(rng)
        if META in after.names:
            assert len(after.inodes[after.names[META]].current) == 128


def test_sim_disk_drops_unsynced_writes():
    disk = SimDisk({"/f": b"old!"})
    ops = SimOps(disk)
    fd = ops.open("/f", os.O_RDWR)
    ops.pwrite(fd, b"new!", 0)
    seen = {disk.crash(random.Random(s)).inodes[1].current.decode("latin1") for s in range(40)}
    assert {"old!", "new!"} <= seen
    assert len(seen) > 2  # dropped, applied, torn
    ops.fsync(fd)
    assert all(bytes(disk.crash(random.Random(s)).inodes[1].current) == b"new!" for s in range(5))


def test_slot_size_constant():
    assert SLOT_SIZE * 2 == 128


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_checkpoint_that_is_not_a_file_is_a_clear_error_at_once(tmp_path, kind):
    import time

    from faultfs.store.metadata import read_meta

    path = tmp_path / "x.meta"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
    started = time.monotonic()
    for call in (lambda: read_meta(str(path)), lambda: DualMetadataManager.open(path)):
        with pytest.raises(InvalidInput, match="not a checkpoint file") as info:
            call()
        assert ("a directory" in info.value.message) == (kind == "directory")
    assert time.monotonic() - started < 5
