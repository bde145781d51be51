"""Distributed RecordStream readers (rank x worker): every record delivered by exactly one
reader, balanced by bytes over shards of unequal size (jsonl and parquet); one state file per
reader, resumed exactly and without touching other shards; the partition sidecar pinned by a
golden test, refusing a changed world size in one line, and failing clearly when damaged;
repartitioning (4 ranks x 2 workers to 3, from an unpartitioned run, across crashes) never
delivering a committed record twice; a model check over random shards and partitions."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import struct
import tempfile
import threading
import zlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from faultfs.core.coord import StreamCoordinate
from faultfs.core.slots import DiskSlot
from faultfs.errors import CorruptionError, InvalidInput, SourceError
from faultfs.store.metadata import DualMetadataManager
from faultfs.stream import RecordStream
from faultfs.stream import partition as partition_mod
from faultfs.stream import readers as readers_mod
from faultfs.stream.partition import Partition, decode, encode
from faultfs.stream.partition import names as partition_names
from faultfs.stream.partition import repartition as repartition_room
from faultfs.stream.partition import sidecar as sidecar_format
from faultfs.stream.shards import Shard

WORLD, WORKERS = 4, 2
LINES_PER_SHARD = [40, 900, 120, 2600, 15, 700, 300, 1800]  # unequal: shard 3 is ~40 %


def make_jsonl_shards(root: Path, counts=LINES_PER_SHARD, seed=7) -> list[bytes]:
    rng = random.Random(seed)
    records = []
    for k, n in enumerate(counts):
        lines = [
            json.dumps({"s": k, "i": i, "pad": "x" * rng.randrange(0, 90)}).encode()
            for i in range(n)
        ]
        records += lines
        (root / f"part-{k}.jsonl").write_bytes(b"".join(line + b"\n" for line in lines))
    return records


def open_reader(src, state, rank, worker, world=WORLD, workers=WORKERS, **kw):
    return RecordStream(
        src, state, rank=rank, world_size=world, worker=worker, num_workers=workers, **kw
    )


def drain(stream, batch_size, *, stop_after=None):
    """Records of committed batches (committing each); ``stop_after``: batches to commit."""
    out = []
    for batch_id, records in stream.batches(batch_size):
        if stop_after is not None and batch_id > stop_after:
            break
        out += records
        stream.commit(batch_id)
    return out


def read_partition(src, state, world=WORLD, workers=WORKERS, batch=37, **kw):
    parts = {}
    for r in range(world):
        for w in range(workers):
            with open_reader(src, state, r, w, world, workers, **kw) as s:
                parts[(r, w)] = drain(s, batch)
    return parts


# ---------------------------------------------------------------------------------------------
# every record once, balanced by bytes


def test_jsonl_every_record_once_balanced_by_bytes(tmp_path):
    records = make_jsonl_shards(tmp_path)
    src, state = str(tmp_path / "part-*.jsonl"), tmp_path / "run.meta"
    parts = read_partition(src, state, dedup=False)
    # the readers' parts, in reader order, are the input in order: disjoint and complete
    assert [r for i in sorted(parts) for r in parts[i]] == records
    sizes = [p.stat().st_size for p in sorted(tmp_path.glob("part-*.jsonl"))]
    total, readers = sum(sizes), WORLD * WORKERS
    owned = {i: sum(len(r) + 1 for r in part) for i, part in parts.items()}
    longest = max(len(r) + 1 for r in records)
    # a reader owns the lines that start in its byte range: within one line of the average,
    # while a split by shard could not come within a shard (the largest is 3x the average)
    assert max(sizes) > 3 * total / readers
    assert all(abs(n - total / readers) <= longest for n in owned.values()), owned
    # shards are split between readers at record boundaries
    shards_of = {i: {json.loads(r)["s"] for r in part} for i, part in parts.items()}
    assert any(len(v) > 1 for v in shards_of.values())
    assert sum(len(v) for v in shards_of.values()) > len(sizes)
    # one state file per reader, in the seed's byte-exact format, plus the sidecar
    names = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("run.meta"))
    expected = ["run.meta.partition", "run.meta.partition.lock", "run.meta.partition.readers"]
    for r in range(WORLD):
        for w in range(WORKERS):
            expected += [
                f"run.meta.rank-{r}.worker-{w}.meta",
                f"run.meta.rank-{r}.worker-{w}.meta.dedup",
            ]
    assert names == sorted(expected)
    for r in range(WORLD):
        for w in range(WORKERS):
            meta = tmp_path / f"run.meta.rank-{r}.worker-{w}.meta"
            assert meta.stat().st_size == 128
            with DualMetadataManager.open(meta) as m:
                assert m.coord.global_row_idx == len(parts[(r, w)])


def write_parquet_shards(root: Path) -> list[dict]:
    rng = random.Random(11)
    rows_all = []
    for k, (n, group) in enumerate(
        [(50, 10), (700, 64), (90, 30), (2000, 128), (10, 10), (500, 100), (260, 13), (1400, 200)]
    ):
        rows = [
            {"s": k, "i": i, "pad": rng.randbytes(rng.randrange(20, 120)).hex()} for i in range(n)
        ]
        rows_all += rows
        path = root / f"p-{k}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=group, compression="none")
    return rows_all


def test_parquet_split_at_row_groups_every_row_once(tmp_path):
    rows = write_parquet_shards(tmp_path)
    src, state = str(tmp_path / "p-*.parquet"), tmp_path / "run.meta"
    parts = read_partition(src, state, batch=50, dedup=False)
    assert [row for i in sorted(parts) for row in parts[i]] == rows
    reader_of = {(row["s"], row["i"]): i for i, part in parts.items() for row in part}
    readers_of_group, group_bytes = {}, {}
    for path in sorted(tmp_path.glob("p-*.parquet")):
        k = int(path.stem.split("-")[1])
        meta = pq.ParquetFile(path).metadata
        positions = readers_mod.row_group_positions(meta)
        ends = [*positions[1:], path.stat().st_size]
        first = 0
        for g in range(meta.num_row_groups):
            n = meta.row_group(g).num_rows
            readers_of_group[(k, g)] = {reader_of[(k, i)] for i in range(first, first + n)}
            group_bytes[(k, g)] = ends[g] - positions[g]
            first += n
    # a row group belongs to one reader, and every reader has some
    assert all(len(v) == 1 for v in readers_of_group.values())
    assert {next(iter(v)) for v in readers_of_group.values()} == set(parts)
    # balanced by bytes to within a row group (and the footers and magics between them)
    total = sum(p.stat().st_size for p in tmp_path.glob("p-*.parquet"))
    owned = dict.fromkeys(parts, 0)
    for group, readers in readers_of_group.items():
        owned[next(iter(readers))] += group_bytes[group]
    slack = max(group_bytes.values()) + 4096
    assert all(abs(n - total / len(parts)) <= slack for n in owned.values()), owned


def test_world_size_one_is_the_unpartitioned_stream(tmp_path):
    records = make_jsonl_shards(tmp_path, [30, 200, 5])
    src = str(tmp_path / "part-*.jsonl")
    with RecordStream(src, tmp_path / "a.meta") as s:
        a = list(s.batches(17))
        s.commit(a[-1][0])
    with RecordStream(src, tmp_path / "b.meta", rank=0, world_size=1, worker=0, num_workers=1) as s:
        b = list(s.batches(17))
        s.commit(b[-1][0])
    assert a == b
    assert [r for _, batch in a for r in batch] == records
    assert (tmp_path / "a.meta").read_bytes() == (tmp_path / "b.meta").read_bytes()
    assert not list(tmp_path.glob("*.partition*")), "no sidecar, no lock for one reader"


def test_reader_state_template_names_the_state_files(tmp_path):
    records = make_jsonl_shards(tmp_path, [300, 50, 400])
    src = str(tmp_path / "part-*.jsonl")
    template = str(tmp_path / "ckpt-r{rank}-w{worker}.meta")
    parts = read_partition(src, tmp_path / "run.meta", 2, 2, reader_state=template)
    assert [r for i in sorted(parts) for r in parts[i]] == records
    for r in range(2):
        for w in range(2):
            assert (tmp_path / f"ckpt-r{r}-w{w}.meta").stat().st_size == 128
    with pytest.raises(InvalidInput, match=r"must contain \{rank\} and \{worker\}"):
        open_reader(src, tmp_path / "x.meta", 0, 0, reader_state=str(tmp_path / "{rank}.meta"))
    with pytest.raises(InvalidInput, match=r"rank must be an int in 0\.\.3"):
        open_reader(src, tmp_path / "x.meta", 4, 0)
    with pytest.raises(InvalidInput, match="the partition's readers keep their states as"):
        open_reader(src, tmp_path / "run.meta", 0, 0, 2, 2)


def test_concurrent_first_opens_agree_on_one_partition(tmp_path):
    make_jsonl_shards(tmp_path, [500, 20, 900, 60])
    src, state = str(tmp_path / "part-*.jsonl"), tmp_path / "run.meta"
    barrier = threading.Barrier(WORLD * WORKERS)
    plans, errors = {}, []

    def open_one(r, w):
        try:
            barrier.wait()
            with open_reader(src, state, r, w) as s:
                plans[(r, w)] = s.plan.partition
        except Exception as err:  # reported below
            errors.append(err)

    threads = [
        threading.Thread(target=open_one, args=(r, w)) for r in range(WORLD) for w in range(WORKERS)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(set(plans.values())) == 1
    assert partition_mod.load(str(state) + ".partition") == plans[(0, 0)]


# ---------------------------------------------------------------------------------------------
# exact resume per reader, touching only its own shards


def test_resume_per_reader_is_exact_and_opens_only_its_shards(tmp_path, monkeypatch):
    make_jsonl_shards(tmp_path)
    src, state = str(tmp_path / "part-*.jsonl"), tmp_path / "run.meta"
    full = read_partition(src, tmp_path / "ref.meta", dedup=False)
    for r, w in [(1, 1), (3, 0)]:
        with open_reader(src, state, r, w, dedup=False) as s:
            first = drain(s, 23, stop_after=9)
            coord = s.committed_coord
            own = sorted(partition_mod.shard_pieces(s.plan.intervals, len(s.shards)))
        opened: list[int] = []
        real_open = Shard.open

        def counting_open(self, _real=real_open, _log=opened, **kw):
            _log.append(int(Path(self.path).stem.split("-")[1]))
            return _real(self, **kw)

        monkeypatch.setattr(Shard, "open", counting_open)
        with open_reader(src, state, r, w, dedup=False) as s:
            rest = drain(s, 23)
        monkeypatch.setattr(Shard, "open", real_open)
        assert first + rest == full[(r, w)]
        assert opened == [k for k in own if k >= coord.shard_id], "no stat, no other shard"


# ---------------------------------------------------------------------------------------------
# the recorded partition: refused resumes, damage, repartitioning


def test_resume_with_another_world_size_is_refused_in_one_line(tmp_path):
    make_jsonl_shards(tmp_path, [100, 300, 50])
    src, state = str(tmp_path / "part-*.jsonl"), tmp_path / "run.meta"
    for r in range(WORLD):
        with open_reader(src, state, r, 0) as s:
            drain(s, 10, stop_after=2)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(InvalidInput) as err:
        open_reader(src, state, 1, 0, world=3)
    assert str(err.value) == (
        f"state {state}.rank-1.worker-0.meta was written with world_size 4, num_workers 2 "
        f"(recorded in {state}.partition); this run has world_size 3, num_workers 2 — pass "
        "repartition=True to restart from the first record not committed by any reader"
    )
    with pytest.raises(InvalidInput, match="was written with world_size 4, num_workers 2"):
        open_reader(src, state, 0, 0, world=4, workers=3)
    with pytest.raises(InvalidInput, match="was written with world_size 4, num_workers 2"):
        RecordStream(src, state)  # the unpartitioned reader is a partition of 1 x 1 too
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before, "nothing changed"
    with pytest.raises(InvalidInput, match="the partition was made over 3 shards"):
        open_reader(str(tmp_path / "part-[01].jsonl"), state, 0, 0)


def test_the_sidecar_format_is_pinned():
    part = Partition(
        2,
        2,
        1,
        0x1122334455667788,
        (100, 7),
        "",
        ((((0, 0, 0), (0, 50, 0)),), (((0, 50, 0), (1, 3, 2)), ((1, 5, 0), (2, 0, 0)))),
        3,
        0xAABB,
        True,
        (1, 1, 0),
    )
    data = encode(part)
    assert data.hex() == (
        "4646505401000000010000000200000002000000010000000100000001000000000000000200000000000000"
        "88776655443322110300000000000000bbaa0000000000006400000000000000070000000000000001000000"
        "0000000000000000000000000000000000000000320000000000000000000000020000000000000032000000"
        "0000000000000000010000000300000000000000020000000100000005000000000000000000000002000000"
        "00000000000000000000000030b28462"
    ), "format changed: bump partition.sidecar.VERSION"
    assert decode(data, "x") == part


def sidecar_with(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    """``data`` with a field overwritten and the CRC made right again (a hostile file)."""
    body = bytearray(data[:-4])
    struct.pack_into(fmt, body, offset, value)
    return bytes(body) + struct.pack("<I", zlib.crc32(body))


HEAD = sidecar_format._HEAD.size


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: d[:20], "20 bytes, shorter than the 72-byte minimum"),
        (lambda d: b"XXXX" + d[4:], "bad magic b'XXXX'"),
        (lambda d: sidecar_with(d, 4, "<I", 9), "version 9, this faultfs reads version 1"),
        (lambda d: d[:-1] + bytes([d[-1] ^ 1]), "bad checksum"),
        (lambda d: d[:50] + bytes([d[50] ^ 0x40]) + d[51:], "bad checksum"),
        (lambda d: sidecar_with(d, 8, "<I", 6), "unknown flags 0x6"),
        (lambda d: sidecar_with(d, 16, "<I", 2**32 - 1), "world_size 4294967295 x num_workers"),
        (lambda d: sidecar_with(d, 36, "<I", 2**32 - 1), "shard count 4294967295 needs"),
        (lambda d: sidecar_with(d, 40, "<I", 2**32 - 1), "template length 4294967295 needs"),
        (
            lambda d: sidecar_with(d, HEAD + 3 * 8, "<I", 2**32 - 1),
            "reader 0's 4294967295 intervals needs",
        ),
        (lambda d: sidecar_with(d, HEAD + 3 * 8 + 4 + 16, "<I", 9), "is outside the 3 shards"),
        (
            lambda d: sidecar_with(d, HEAD + 3 * 8 + 4 + 16 + 4, "<Q", 2**64 - 1),
            "is outside the 3 shards",
        ),
        (lambda d: sidecar_with(d, HEAD + 3 * 8 + 4, "<I", 2), "empty interval (2, 0, 0).."),
        (lambda d: sidecar_with(d + b"\0" * 4, len(d) - 4, "<I", 0), "4 bytes after the last"),
    ],
)
def test_a_damaged_sidecar_is_a_clear_error(tmp_path, damage, message):
    make_jsonl_shards(tmp_path, [100, 300, 50])
    src, state = str(tmp_path / "part-*.jsonl"), tmp_path / "run.meta"
    open_reader(src, state, 0, 0, world=2, workers=1).close()
    sidecar = Path(f"{state}.partition")
    sidecar.write_bytes(damage(sidecar.read_bytes()))
    with pytest.raises(CorruptionError) as err:
        open_reader(src, state, 0, 0, world=2, workers=1)
    assert str(err.value).startswith(f"{sidecar}: damaged partition record: ")
    assert message in str(err.value)


def test_overlapping_readers_and_odd_files_are_refused(tmp_path):
    make_jsonl_shards(tmp_path, [100, 300])
    src, state = str(tmp_path / "part-*.jsonl"), tmp_path / "run.meta"
    sidecar = Path(f"{state}.partition")
    s = open_reader(src, state, 0, 0, world=2, workers=1)
    part = s.plan.partition
    s.close()
    both = dataclasses.replace(part, readers=(part.readers[0], part.readers[0]))
    sidecar.write_bytes(encode(both))
    with pytest.raises(CorruptionError, match="readers 0 and 1 both own the records at"):
        open_reader(src, state, 0, 0, world=2, workers=1)
    sidecar.unlink()
    sidecar.mkdir()
    with pytest.raises(InvalidInput, match="is not a regular file, not a partition record"):
        open_reader(src, state, 0, 0, world=2, workers=1)
    sidecar.rmdir()
    with open(sidecar, "wb") as f:
        f.truncate(partition_mod.MAX_SIDECAR_BYTES + 1)
    with pytest.raises(CorruptionError, match="more than 67108864"):
        open_reader(src, state, 0, 0, world=2, workers=1)
    sidecar.unlink()
    with open_reader(src, state, 0, 0, world=2, workers=1) as s:  # a new sidecar
        drain(s, 10, stop_after=1)
    sidecar.unlink()
    with pytest.raises(
        CorruptionError, match=r"has commits but its partition record .* is missing"
    ):
        open_reader(src, state, 0, 0, world=2, workers=1)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_decoding_random_damage_raises_only_corruption(data):
    part = Partition(
        1,
        2,
        2,
        5,
        (1000, 3000),
        "r{rank}-{worker}",
        tuple((((0, i * 100, 0), (1, i * 100 + 10, i)),) for i in range(1))
        + tuple((((1, i * 300, 0), (1, i * 300 + 10, 0)),) for i in range(1, 4)),
    )
    raw = bytearray(encode(part))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    fix_crc = data.draw(st.booleans())
    blob = bytes(raw[:cut])
    if fix_crc and len(blob) > 4:
        blob = blob[:-4] + struct.pack("<I", zlib.crc32(blob[:-4]))
    error = None
    try:
        decoded = decode(blob, "x")
    except CorruptionError as err:
        error = str(err)
    if error is None:
        assert encode(decoded) == blob
    else:
        assert error.startswith("x: damaged partition record: ")


def test_meta_image_is_what_the_checkpoint_manager_writes(tmp_path):
    with DualMetadataManager.open(tmp_path / "a.meta"):
        pass
    assert (tmp_path / "a.meta").read_bytes() == partition_mod.meta_image()
    coord = StreamCoordinate(3, 77, 0, 0, 0, 12)
    with DualMetadataManager.open(tmp_path / "b.meta") as m:
        m.commit(9, coord, [1, 2])
    assert (tmp_path / "b.meta").read_bytes() == partition_mod.meta_image(DiskSlot(1, 9, coord, 2))


def commit_some(src, state, world, workers, rng, batch=29, dedup=True):
    committed = []
    for r in range(world):
        for w in range(workers):
            with open_reader(src, state, r, w, world, workers, dedup=dedup) as s:
                committed += drain(s, batch, stop_after=rng.randrange(0, 8))
    return committed


@pytest.mark.parametrize("workers", [1, 2])
def test_repartition_from_4x2_to_3_never_delivers_a_committed_record_twice(tmp_path, workers):
    records = make_jsonl_shards(tmp_path)
    src, state = str(tmp_path / "part-*.jsonl"), tmp_path / "run.meta"
    committed = commit_some(src, state, WORLD, WORKERS, random.Random(3))
    assert committed
    after = read_partition(src, state, 3, workers, repartition=True)
    delivered = committed + [r for i in sorted(after) for r in after[i]]
    assert sorted(delivered) == sorted(records), "every record once, across the repartition"
    # balanced again by bytes over what was left
    left = [sum(len(r) + 1 for r in part) for part in after.values()]
    assert max(left) - min(left) <= 2 * max(len(r) + 1 for r in records)
    names = {p.name for p in tmp_path.iterdir()}
    assert "run.meta.rank-3.worker-0.meta" not in names, "states of gone readers are removed"
    assert ("run.meta.rank-1.worker-1.meta" in names) == (workers == 2)
    assert "run.meta.partition.g2.dedup" in names
    assert not [n for n in names if n.endswith(".fresh")]
    part = partition_mod.load(f"{state}.partition")
    assert (part.generation, part.world_size, part.num_workers, part.pending) == (
        2,
        3,
        workers,
        False,
    )
    assert part.base_count == len(set(committed))
    # repartition=True is a no-op once the recorded partition matches
    with open_reader(src, state, 0, 0, 3, workers, repartition=True) as s:
        assert list(s.batches(10)) == []


def test_a_repartition_while_a_reader_of_the_old_partition_is_open_is_refused(tmp_path):
    """Its uncommitted records would go to a new reader too; once it is closed (or its
    process is gone: the lock goes with it) the repartition runs."""
    records = make_jsonl_shards(tmp_path)
    src, state = str(tmp_path / "part-*.jsonl"), tmp_path / "run.meta"
    committed = commit_some(src, state, WORLD, WORKERS, random.Random(5))
    running = open_reader(src, state, 2, 1)
    sidecar = (tmp_path / "run.meta.partition").read_bytes()
    with pytest.raises(InvalidInput, match=r"readers of the recorded partition \(world_size 4, "
                       r"num_workers 2\) are still open; close them before repartitioning"):
        open_reader(src, state, 0, 0, 3, 1, repartition=True)
    assert (tmp_path / "run.meta.partition").read_bytes() == sidecar, "nothing changed"
    # readers of the recorded partition still open beside it
    with open_reader(src, state, 0, 0) as other:
        assert other.committed_batch_id >= 0
    running.close()
    after = read_partition(src, state, 3, 1, repartition=True)
    delivered = committed + [r for i in sorted(after) for r in after[i]]
    assert sorted(delivered) == sorted(records)


def test_repartition_with_dedup_carries_the_committed_hashes(tmp_path):
    rng = random.Random(5)
    pool = [json.dumps({"v": i}).encode() for i in range(400)]
    for k, n in enumerate([300, 80, 500, 120]):
        (tmp_path / f"part-{k}.jsonl").write_bytes(
            b"".join(rng.choice(pool) + b"\n" for _ in range(n))
        )
    src, state = str(tmp_path / "part-*.jsonl"), tmp_path / "run.meta"
    committed = commit_some(src, state, 2, 2, rng, batch=13)
    after = read_partition(src, state, 3, 1, repartition=True)
    later = [r for part in after.values() for r in part]
    assert not set(later) & set(committed), "no record committed before is delivered again"
    assert set(later) | set(committed) == {
        line for p in tmp_path.glob("part-*.jsonl") for line in p.read_bytes().splitlines()
    }
    # a damaged carried-hash file is a clear error
    base = Path(f"{state}.partition.g2.dedup")
    base.write_bytes(base.read_bytes()[:-8])
    with pytest.raises(CorruptionError, match="carried dedup hashes holds"):
        open_reader(src, state, 0, 0, 3, 1)
    base.write_bytes(b"\0" * (len(set(committed)) * 8))
    with pytest.raises(CorruptionError, match="carried dedup hashes fail their checksum"):
        open_reader(src, state, 0, 0, 3, 1)


def test_repartition_from_an_unpartitioned_run(tmp_path):
    records = make_jsonl_shards(tmp_path, [200, 40, 600])
    src, state = str(tmp_path / "part-*.jsonl"), tmp_path / "run.meta"
    with RecordStream(src, state) as s:
        committed = drain(s, 50, stop_after=5)
    with pytest.raises(InvalidInput) as err:
        open_reader(src, state, 0, 0, 2, 1)
    assert str(err.value) == (
        f"state {state} was written by an unpartitioned stream (world_size 1, num_workers 1); "
        "this run has world_size 2, num_workers 1 — pass repartition=True to restart from the "
        "first record not committed by any reader"
    )
    after = read_partition(src, state, 2, 1, repartition=True)
    assert committed + after[(0, 0)] + after[(1, 0)] == records
    assert not state.exists(), "the unpartitioned state is superseded"


def test_a_repartition_while_the_unpartitioned_reader_is_open_is_refused(tmp_path):
    """An unpartitioned stream holds no readers' lock: a repartition went ahead under it,
    removed its state, and what it committed afterwards (into the removed file) was
    delivered again by the new readers."""
    records = make_jsonl_shards(tmp_path, [200, 40, 600])
    src, state = str(tmp_path / "part-*.jsonl"), tmp_path / "run.meta"
    running = RecordStream(src, state)
    batches = running.batches(50)
    running.commit(next(batches)[0])
    before = sorted((p.name, p.read_bytes()) for p in tmp_path.iterdir())
    with pytest.raises(InvalidInput, match=r"run\.meta: .*open in a stream; close it before "
                       "repartitioning"):
        open_reader(src, state, 0, 0, 2, 1, repartition=True)
    assert sorted((p.name, p.read_bytes()) for p in tmp_path.iterdir()
                  if not p.name.startswith("run.meta.partition.")) == before, "nothing changed"
    assert not (tmp_path / "run.meta.partition").exists()
    batch_id, _ = next(batches)
    running.commit(batch_id)
    running.close()
    after = read_partition(src, state, 2, 1, repartition=True)
    assert records[:100] + after[(0, 0)] + after[(1, 0)] == records


@pytest.mark.parametrize("crash", ["before the sidecar", "after the sidecar"])
def test_a_repartition_interrupted_by_a_crash(tmp_path, monkeypatch, crash):
    records = make_jsonl_shards(tmp_path, [300, 50, 700, 90])
    src, state = str(tmp_path / "part-*.jsonl"), tmp_path / "run.meta"
    committed = commit_some(src, state, 2, 2, random.Random(8))

    class Crash(Exception):
        pass

    real_store, real_roll = repartition_room.store, repartition_room.roll_forward

    def store(path, part):
        if part.pending and crash == "before the sidecar":
            raise Crash
        real_store(path, part)

    def roll_forward(state_, part):
        if crash == "after the sidecar":
            # halfway: one fresh state renamed into place, then the crash
            p = partition_mod.reader_paths(
                state_, part.reader_state, part.world_size, part.num_workers
            )[0]
            os.rename(partition_names.fresh_name(p, part.generation), p)
            raise Crash
        real_roll(state_, part)

    monkeypatch.setattr(repartition_room, "store", store)
    monkeypatch.setattr(repartition_room, "roll_forward", roll_forward)
    with pytest.raises(Crash):
        open_reader(src, state, 0, 0, 3, 1, repartition=True)
    monkeypatch.setattr(repartition_room, "store", real_store)
    monkeypatch.setattr(repartition_room, "roll_forward", real_roll)
    if crash == "before the sidecar":
        # the old partition is whole: its readers resume as if nothing happened
        rest = read_partition(src, state, 2, 2)
        assert sorted(committed + [r for p in rest.values() for r in p]) == sorted(records)
    else:
        with pytest.raises(InvalidInput, match="was written with world_size 3, num_workers 1"):
            open_reader(src, state, 0, 0, 2, 2)  # the next opener finishes the repartition
        after = read_partition(src, state, 3, 1)
        assert sorted(committed + [r for p in after.values() for r in p]) == sorted(records)


def test_parquet_repartition_mid_row_group(tmp_path):
    rows = write_parquet_shards(tmp_path)
    src, state = str(tmp_path / "p-*.parquet"), tmp_path / "run.meta"
    key = lambda row: (row["s"], row["i"])  # noqa: E731
    committed = commit_some(src, state, WORLD, WORKERS, random.Random(2), batch=7, dedup=False)
    after = read_partition(src, state, 3, 1, batch=50, dedup=False, repartition=True)
    delivered = committed + [r for p in after.values() for r in p]
    assert sorted(map(key, delivered)) == sorted(map(key, rows))


def test_a_changed_shard_is_refused_when_its_reader_opens_it(tmp_path):
    make_jsonl_shards(tmp_path, [100, 300])
    src, state = str(tmp_path / "part-*.jsonl"), tmp_path / "run.meta"
    open_reader(src, state, 0, 0, 2, 1).close()
    with (tmp_path / "part-1.jsonl").open("ab") as f:
        f.write(b'{"late": 1}\n')
    with (
        open_reader(src, state, 1, 0, 2, 1) as s,
        pytest.raises(
            SourceError, match=r"part-1\.jsonl: shard is \d+ bytes, but the stream's partition"
        ),
    ):
        list(s.batches(10))


# ---------------------------------------------------------------------------------------------
# a state of another reader


def swap_states(a: Path, b: Path) -> None:
    """Swap two readers' state files (the .meta and its WAL)."""
    for x, y in ((a, b), (Path(f"{a}.dedup"), Path(f"{b}.dedup"))):
        data = x.read_bytes()
        x.write_bytes(y.read_bytes())
        y.write_bytes(data)


def put_checkpoint(path: Path, coord: StreamCoordinate) -> None:
    """Make ``path`` a fresh state whose one commit is at ``coord``."""
    for name in (path, Path(f"{path}.dedup")):
        name.unlink(missing_ok=True)
    with DualMetadataManager.open(path) as m:
        m.commit(1, coord, [])


def refusal(src, state, rank, **kw) -> str:
    """The message a reader's resume is refused with (on opening, or at its first batch)."""
    with pytest.raises(InvalidInput) as err, open_reader(src, state, rank, 0, 2, 1, **kw) as s:
        list(s.batches(7))
    return str(err.value)


def swapped_states_refused(tmp_path, src, state, batch, stops, where, **kw):
    """Two readers of one partition commit ``stops`` batches each, then their state files are
    swapped: each reader refuses the other's checkpoint in one line naming its state, the
    checkpoint's place (``where`` begins it) and itself, and nothing changes; swapped back,
    each resumes exactly. The records each committed, and the rest each read then."""
    committed, paths = {}, {}
    for r in range(2):
        with open_reader(src, state, r, 0, 2, 1, **kw) as s:
            committed[r] = drain(s, batch, stop_after=stops)
            paths[r] = Path(s.state_path)
    swap_states(paths[0], paths[1])
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    for r in range(2):
        message = refusal(src, state, r, **kw)
        assert message.startswith(f"{paths[r]}: checkpoint is at {where}"), message
        assert message.endswith(
            f" of shard 0, outside the records of reader rank {r}, worker 0 (a state of "
            "another reader or partition?)"
        ), message
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before, "nothing changed"
    swap_states(paths[0], paths[1])  # put back: each reader resumes exactly
    return committed, read_partition(src, state, 2, 1, batch=batch, **kw)


@pytest.mark.parametrize("names", ["default", "template"])
def test_a_state_of_another_reader_is_refused_and_nothing_changes(tmp_path, names):
    """Two readers' states swapped (by hand, or by a reader_state template naming each rank's
    file as the other's): rank 0 resumed past its whole part and delivered nothing, rank 1
    restarted its part and repeated the records it had committed."""
    records = make_jsonl_shards(tmp_path, [400])
    src, state = str(tmp_path / "part-*.jsonl"), tmp_path / "run.meta"
    kw = {"reader_state": str(tmp_path / "ck-r{rank}-w{worker}.meta")} if names == "template" else {}
    committed, rest = swapped_states_refused(tmp_path, src, state, 25, 3, "byte ", **kw)
    assert len(committed[0]) == len(committed[1]) == 75
    assert committed[0] + rest[(0, 0)] + committed[1] + rest[(1, 0)] == records


def test_a_resume_past_a_range_end_by_more_than_its_crossing_line_is_refused(
    tmp_path, monkeypatch
):
    """A reader reads the line that crosses its range's end whole, so its checkpoint may lie
    past the end, at that line's end, and no further; a checkpoint before or at a range's start
    is no commit of the range's either."""
    monkeypatch.setattr(readers_mod, "TAIL_READ", 16)  # the crossing line is read in pieces
    records = make_jsonl_shards(tmp_path, [300])
    text = (tmp_path / "part-0.jsonl").read_bytes()
    src, state = str(tmp_path / "part-*.jsonl"), tmp_path / "run.meta"
    with open_reader(src, state, 0, 0, 2, 1) as s:
        end = s.plan.intervals[0][1][1]
    assert text[end - 1 : end] != b"\n", "a line crosses the end of rank 0's range"
    crossing_start = text.rindex(b"\n", 0, end) + 1
    crossing_end = text.index(b"\n", end) + 1  # rank 1's first record starts here
    next_end = text.index(b"\n", crossing_end) + 1
    assert crossing_end - crossing_start > 16
    first_of_rank_1 = text[:crossing_end].count(b"\n")

    def resume(rank: int, offset: int) -> list[bytes]:
        put_checkpoint(Path(f"{state}.rank-{rank}.worker-0.meta"),
                       StreamCoordinate(0, offset, 0, 0, 0, 1))
        with open_reader(src, state, rank, 0, 2, 1, dedup=False) as s:
            return drain(s, 50)

    assert resume(0, crossing_end) == [], "rank 0 is done after the line crossing its end"
    assert resume(0, crossing_start) == [records[first_of_rank_1 - 1]]
    assert resume(1, next_end) == records[first_of_rank_1 + 1 :]
    for rank, offset in ((0, next_end), (1, crossing_start), (1, 1)):
        with pytest.raises(InvalidInput) as err:
            resume(rank, offset)
        assert str(err.value) == (
            f"{state}.rank-{rank}.worker-0.meta: checkpoint is at byte {offset} of shard 0, "
            f"outside the records of reader rank {rank}, worker 0 (a state of another reader "
            "or partition?)"
        )
    # a range that ends at a line start: the reader that ends there has all its records, the
    # next one none of them yet, so its checkpoint cannot be there
    (tmp_path / "even").mkdir()
    write = [b"%09d\n" % i for i in range(100)]
    (tmp_path / "even" / "e.txt").write_bytes(b"".join(write))
    src, state = str(tmp_path / "even" / "e.txt"), tmp_path / "even" / "run.meta"
    with open_reader(src, state, 0, 0, 2, 1) as s:
        assert s.plan.intervals == (((0, 0, 0), (0, 500, 0)),)
    assert resume(0, 500) == []
    assert resume(1, 510) == [w[:-1] for w in write[51:]]
    with pytest.raises(InvalidInput, match=r"checkpoint is at byte 500 of shard 0, outside the "
                       r"records of reader rank 1, worker 0"):
        resume(1, 500)


def test_a_parquet_state_of_another_reader_is_refused(tmp_path):
    rows = [{"i": i, "pad": "x" * (i % 17)} for i in range(400)]
    pq.write_table(
        pa.Table.from_pylist(rows), tmp_path / "p-0.parquet", row_group_size=20, compression="none"
    )
    src, state = str(tmp_path / "p-*.parquet"), tmp_path / "run.meta"
    committed, rest = swapped_states_refused(tmp_path, src, state, 7, 4, "row 8 of row group ")
    assert committed[0] + rest[(0, 0)] + committed[1] + rest[(1, 0)] == rows


# ---------------------------------------------------------------------------------------------
# the model: random shards, partitions, crashes and repartitions


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.lists(st.sampled_from(["", "a", "bb", "c" * 7, "d" * 19, "e" * 40]), max_size=25),
        min_size=1,
        max_size=4,
    ),
    st.sampled_from(["\n", "\r\n"]),
    st.booleans(),
    st.tuples(st.integers(1, 3), st.integers(1, 3)),
    st.tuples(st.integers(1, 3), st.integers(1, 3)),
    st.randoms(use_true_random=False),
)
def test_model_every_record_once_across_crashes_and_repartitions(
    shards, newline, final_newline, first, second, rnd
):
    """Records are the non-empty lines, numbered; readers crash at random points and resume;
    then the partition is replaced by another. Committed records, over all readers and both
    partitions, are every record exactly once."""
    with tempfile.TemporaryDirectory() as d, contextlib.ExitStack() as stack:
        block = readers_mod.LINE_BLOCK
        readers_mod.LINE_BLOCK = 16
        stack.callback(setattr, readers_mod, "LINE_BLOCK", block)
        root = Path(d)
        records, serial = [], 0
        for k, lines in enumerate(shards):
            out = []
            for line in lines:
                if line:
                    line = f"{serial}:{line}"
                    serial += 1
                    records.append(line.encode())
                out.append(line)
            text = newline.join(out) + (newline if final_newline and out else "")
            (root / f"{k}.txt").write_bytes(text.encode())
        src, state = str(root / "*.txt"), root / "s.meta"
        delivered = []
        for world, workers in (first, second):
            for r in range(world):
                for w in range(workers):
                    for attempt in range(6):
                        s = open_reader(
                            src, state, r, w, world, workers, dedup=False, repartition=True
                        )
                        crashed = False
                        for batch_id, recs in s.batches(rnd.randint(1, 4)):
                            if attempt < 5 and rnd.random() < 0.2:
                                crashed = True
                                break
                            delivered += recs
                            s.commit(batch_id)
                        s.close()
                        if not crashed:
                            break
                    if (world, workers) == first and rnd.random() < 0.5:
                        break  # this reader stops early: its rest is left to the repartition
        # the second partition finishes everything not committed under the first
        for r in range(second[0]):
            for w in range(second[1]):
                with open_reader(src, state, r, w, *second, dedup=False) as s:
                    delivered += drain(s, 3)
        assert sorted(delivered) == sorted(records)
        assert len(delivered) == len(set(delivered))
