"""Shuffled RecordStreams (DESIGN §19, faultfs.stream.shuffle): every record once per epoch
(jsonl, txt, Parquet; shards of very different sizes; an empty shard), across ranks and
workers; the same seed gives the same order, another seed or epoch another; a resume at every
batch boundary delivers exactly the rest of the uninterrupted epoch (with and without dedup,
under 1, 2 and 4 readers), reading only the checkpoint's window again; dedup's "first" is the
first in the shuffled order; the shuffle record pinned by golden bytes, refused when damaged,
and recovered whole after a crash at any write of a commit; a state of another seed, epoch,
window or shard list refused in one line naming both; epochs moved on by set_epoch, by
iterating again and by a restart; a repartition inside an epoch never delivering a committed
record again in it."""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import time
import zlib
from collections import Counter
from itertools import pairwise
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from faultfs.cli.checkpoint import describe_checkpoint
from faultfs.core.coord import StreamCoordinate
from faultfs.core.slots import DiskSlot
from faultfs.errors import CorruptionError, InvalidInput
from faultfs.store.fileops import OsFileOps
from faultfs.store.metadata import DualMetadataManager
from faultfs.stream import RecordParseError, RecordStream
from faultfs.stream import shuffle as shuffle_mod
from faultfs.stream.commits import Commits
from faultfs.stream.partition import repartition as repartition_room
from faultfs.stream.readers import LineShardReader
from faultfs.stream.shards import expand_shards
from faultfs.stream.shuffle import (
    Geometry,
    ShuffleHeader,
    ShuffleRecord,
    ShuffleSlot,
    WindowSpec,
    permutation,
)
from faultfs.stream.shuffle import carry as carry_room
from faultfs.stream.shuffle import plan as plan_room
from faultfs.stream.shuffle import record as record_room
from faultfs.stream.shuffle import window as window_room
from faultfs.stream.shuffle.plan import Carried
from faultfs.testing.crashfs import SimDisk, SimOps, SimulatedCrash

COUNTS = [6, 900, 0, 140, 2600, 35]  # very different sizes, and an empty shard
SMALL = [3, 60, 0, 25, 9]
READERS = {1: (1, 1), 2: (2, 1), 4: (2, 2)}  # readers: (world_size, num_workers)
SEED, WINDOW = 11, 2048


def make_lines(root: Path, counts=COUNTS, suffix=".jsonl", dups=0.0, seed=5) -> list[bytes]:
    """Shards ``part-K`` of JSON lines (or text), every record unique unless ``dups``: that
    share of records repeats an earlier one (of any shard)."""
    rng = random.Random(seed)
    records: list[bytes] = []
    for k, n in enumerate(counts):
        lines = []
        for i in range(n):
            if records and rng.random() < dups:
                line = rng.choice(records)
            elif suffix == ".txt":
                line = f"shard {k} line {i} {'y' * rng.randrange(30)}".encode()
            else:
                line = json.dumps({"s": k, "i": i, "pad": "x" * rng.randrange(40)}).encode()
            lines.append(line)
            records.append(line)
        (root / f"part-{k}{suffix}").write_bytes(b"".join(line + b"\n" for line in lines))
    return records


def make_parquet(root: Path, counts=COUNTS, rows_per_group=37) -> list[str]:
    keys = []
    for k, n in enumerate(counts):
        table = pa.table({"s": [k] * n, "i": list(range(n)), "v": [f"v{i % 7}" for i in range(n)]})
        pq.write_table(table, root / f"part-{k}.parquet", row_group_size=rows_per_group)
        keys += [key({"s": k, "i": i, "v": f"v{i % 7}"}) for i in range(n)]
    return keys


def key(record) -> str | bytes:
    return json.dumps(record, sort_keys=True) if isinstance(record, dict) else record


def open_stream(src, state, readers=1, index=0, **kw):
    world, workers = READERS[readers]
    kw.setdefault("seed", SEED)
    kw.setdefault("shuffle_window", WINDOW)
    return RecordStream(src, state, shuffle=True, rank=index // workers, world_size=world,
                        worker=index % workers, num_workers=workers, **kw)


def drain(stream, batch=29, fmt="raw"):
    out = []
    for batch_id, records in stream.batches(batch, format=fmt):
        if fmt == "arrow":
            records = [json.dumps(r).encode() for r in records.to_pylist()]
        out += records
        stream.commit(batch_id)
    return out


def read_epoch(src, state, readers=1, **kw) -> list[list]:
    """One epoch of every reader (each drained, committing every batch)."""
    parts = []
    for i in range(readers):
        with open_stream(src, state, readers, i, **kw) as s:
            parts.append(drain(s))
    return parts


def spearman(values) -> float:
    ranks = np.argsort(np.argsort(np.asarray(values)))
    return float(np.corrcoef(np.arange(len(values)), ranks)[0, 1])


# ---------------------------------------------------------------------------------------------
# every record once per epoch; the same seed, the same order


@pytest.mark.parametrize("kind", ["jsonl", "txt", "parquet"])
@pytest.mark.parametrize("readers", [1, 4])
def test_every_record_once_per_epoch(tmp_path, kind, readers):
    if kind == "parquet":
        records = make_parquet(tmp_path)
    else:
        records = make_lines(tmp_path, suffix="." + kind)
    src, state = str(tmp_path / f"part-*.{kind}"), tmp_path / "run.meta"
    epochs = []
    for epoch in range(2):
        parts = read_epoch(src, state, readers, dedup=False)
        every = [key(r) for part in parts for r in part]
        assert sorted(every) == sorted(records), f"epoch {epoch}: every record once"
        epochs.append(parts)
    assert [key(r) for r in epochs[0][0]] != [key(r) for r in epochs[1][0]], "epochs differ"
    if readers > 1:  # each epoch deals the blocks anew
        assert {key(r) for r in epochs[0][0]} != {key(r) for r in epochs[1][0]}
        sizes = [len(p) for p in epochs[0]]
        assert min(sizes) > 0.5 * max(sizes), sizes
    if kind == "jsonl" and readers == 1:  # sorted by (shard, line): far from sorted now
        order = [(r["s"], r["i"]) for r in map(json.loads, epochs[0][0])]
        assert abs(spearman([s * 10_000 + i for s, i in order])) < 0.2


def test_the_same_seed_gives_the_same_order_another_seed_or_epoch_another(tmp_path):
    make_lines(tmp_path)
    src = str(tmp_path / "part-*.jsonl")

    def order(name, **kw):
        with open_stream(src, tmp_path / name, dedup=False, **kw) as s:
            return drain(s, 500)

    first = order("a.meta")
    assert order("b.meta") == first
    assert order("c.meta", seed=SEED + 1) != first
    assert order("d.meta", epoch=1) != first
    assert order("e.meta", shuffle_window=4 * WINDOW) != first
    # parsed batches are the raw ones parsed: the same rows in the same order
    with open_stream(src, tmp_path / "f.meta", dedup=False) as s:
        parsed = drain(s, 500, fmt="arrow")
    assert [json.loads(r) for r in parsed] == [json.loads(r) for r in first]


def test_records_are_mixed_inside_a_window_and_across_its_blocks(tmp_path):
    """One shard of records in key order, one window of 16 blocks: the delivered order keeps
    no run of consecutive keys (a window's records are mixed, not its blocks alone), and
    its first records come from many of its blocks."""
    n = 4000
    (tmp_path / "part-0.jsonl").write_bytes(
        b"".join(b'{"k": %d}\n' % i for i in range(n)))
    src = str(tmp_path / "part-*.jsonl")
    size = (tmp_path / "part-0.jsonl").stat().st_size
    with open_stream(src, tmp_path / "run.meta", dedup=False, shuffle_window=size + 16) as s:
        keys = [json.loads(r)["k"] for r in drain(s, 100)]
    assert sorted(keys) == list(range(n))
    runs, longest = 1, 1
    for a, b in pairwise(keys):
        runs = runs + 1 if b == a + 1 else 1
        longest = max(longest, runs)
    assert longest < 5, f"a run of {longest} consecutive records"
    assert abs(spearman(keys)) < 0.1
    block = -(-n // 16)  # records a block holds, about
    assert len({k // block for k in keys[:100]}) >= 12, "the first 100 from most blocks"


def test_the_permutation_is_pinned_and_the_python_path_agrees():
    assert permutation(77, 10).tolist() == [5, 0, 6, 9, 2, 7, 1, 8, 4, 3], (
        "the permutation changed: every shuffled checkpoint would resume elsewhere"
    )
    for n in (0, 1, 2, 3, 100, 4097):
        assert np.array_equal(permutation(n * 31, n), plan_room.python_permutation(n * 31, n))
    grid = plan_room.EpochGrid([100, 0, 50, 300], 1, 0, 64)
    assert grid.order.tolist() == [1, 3, 0, 2] and grid.block_count == 8  # shard 1 is empty
    assert [grid.pieces(b) for b in (3, 4, 6, 7)] == [  # a block may span two shards
        [(3, 192, 256)], [(3, 256, None), (0, 0, 20)], [(0, 84, None), (2, 0, 48)],
        [(2, 48, None)]]
    # the blocks' order, dealt to readers like cards: reader 1 of 2 gets 6, 0, 2, 1
    assert grid.block_order().tolist() == [7, 6, 4, 0, 5, 2, 3, 1]
    assert plan_room.reader_windows(grid, Geometry(1, 64, 2), 2, 1)[:] == [
        WindowSpec((0, 6), 4637990535914259977), WindowSpec((1, 2), 11026351218010118502)]


_LINE = st.sampled_from([b"", b"a", b"bb\r", b"{}", b"x" * 70, b"y" * 300, b"\r", b"c\rd"])


@settings(max_examples=150, deadline=None)
@given(st.lists(_LINE, min_size=1, max_size=40), st.sampled_from([b"\n", b"\r\n"]),
       st.booleans(), st.data())
def test_a_windows_block_read_at_once_holds_what_the_shard_reader_reads(
    tmp_path_factory, lines, sep, final, data
):
    """``line_piece`` (a window's block in one read) gives the records, their bounds and
    ends that ``LineShardReader`` gives over the same range — blank lines, "\r\n", lines
    longer than the read's tail, a last line without a terminator — or declines (False);
    with the compiled line scan and with numpy's alike."""
    root = tmp_path_factory.mktemp("piece")
    raw = sep.join(lines) + (sep if final else b"")
    if not raw:
        return
    (root / "a.jsonl").write_bytes(raw)
    shard = expand_shards(str(root / "a.jsonl"), None)[0]
    lo = data.draw(st.integers(0, len(raw) - 1))
    hi = data.draw(st.none() | st.integers(lo + 1, len(raw)))
    hi = None if hi == len(raw) else hi
    tail = data.draw(st.sampled_from([16, 4096]))
    pieces = []
    for scan in {window_room._lines, None}:  # the compiled line scan, and numpy's
        file = shard.open()
        try:
            with pytest.MonkeyPatch.context() as mp:
                # a short tail: lines longer than it (declined); the real one: most lines whole
                mp.setattr(window_room, "TAIL_PEEK", tail)
                mp.setattr(window_room, "_lines", scan)
                pieces.append(window_room.line_piece(shard, 0, file, lo, hi, len(raw)))
        finally:
            file.close()
    reader = LineShardReader(shard, 0, 0, 0, ranges=[(lo, hi, lo == 0)])
    try:
        blocks = list(iter(reader.next_block, None))
    finally:
        reader.close()
    assert len({type(p) for p in pieces}) == 1  # both declined, found nothing, or read
    for piece in pieces:
        if piece is False:
            continue
        want = [r for b in blocks for r in b.records]
        assert (piece.records if piece is not None else []) == want
        if piece is not None:
            assert piece.ends.tolist() == [int(e) for b in blocks for e in b.ends]
            assert [piece.line_offset(i) for i in range(piece.count)] == [
                b.line_offset(i) for b in blocks for i in range(b.count)]


def test_odd_lines_parse_whole_windows_and_a_bad_record_is_named_in_its_shard(tmp_path):
    """CRLF, blank lines, a last line without a terminator: a window is parsed in one go
    from its joined lines; one bad record makes it parse block by block, which names it."""
    rows = [{"k": i, "v": "x" * (i % 13)} for i in range(300)]
    lines = [json.dumps(r).encode() for r in rows]
    (tmp_path / "a.jsonl").write_bytes(b"\r\n".join(lines[:100]) + b"\r\n\r\n")
    (tmp_path / "b.jsonl").write_bytes(b"\n\n".join(lines[100:250]))  # no final newline
    (tmp_path / "c.jsonl").write_bytes(b"\n".join(lines[250:]) + b"\n")
    src = str(tmp_path / "*.jsonl")
    with open_stream(src, tmp_path / "raw.meta", dedup=False, shuffle_window=1024) as s:
        raw = drain(s, 64)
    assert sorted(raw) == sorted(lines)
    with open_stream(src, tmp_path / "parsed.meta", dedup=False, shuffle_window=1024) as s:
        parsed = drain(s, 64, fmt="arrow")
    assert [json.loads(r) for r in parsed] == [json.loads(r) for r in raw]
    bad = lines[:]
    bad[170] = b'{"k": 170, "v": oops}'
    (tmp_path / "b.jsonl").write_bytes(b"\n\n".join(bad[100:250]))
    offset = sum(len(line) + 2 for line in bad[100:170])
    with open_stream(src, tmp_path / "bad.meta", dedup=False, shuffle_window=1 << 16) as s:
        with pytest.raises(RecordParseError) as err:
            drain(s, 64, fmt="arrow")
    assert err.value.shard.endswith("b.jsonl") and err.value.where == f"byte offset {offset}"


# ---------------------------------------------------------------------------------------------
# resume: at every batch boundary, exactly the rest of the epoch


def snapshot(paths: list[str], where: Path) -> None:
    where.mkdir()
    for p in paths:
        if os.path.exists(p):
            shutil.copy(p, where / os.path.basename(p))


def restore(paths: list[str], where: Path) -> None:
    for p in paths:
        saved = where / os.path.basename(p)
        if saved.exists():
            shutil.copy(saved, p)
        elif os.path.exists(p):
            os.unlink(p)


@pytest.mark.parametrize(
    ("kind", "fmt", "dedup", "readers"),
    [("jsonl", "raw", False, 1), ("jsonl", "raw", True, 1), ("jsonl", "raw", False, 2),
     ("jsonl", "raw", True, 2), ("jsonl", "raw", False, 4), ("jsonl", "raw", True, 4),
     ("jsonl", "arrow", True, 2), ("txt", "raw", True, 4), ("parquet", "raw", False, 2)],
)
def test_a_resume_at_every_batch_boundary_delivers_the_rest_of_the_epoch(
    tmp_path, kind, fmt, dedup, readers
):
    if kind == "parquet":
        make_parquet(tmp_path, [n * 3 for n in SMALL], rows_per_group=4)
    else:
        make_lines(tmp_path, SMALL, suffix="." + kind, dups=0.25 if dedup else 0.0)
    src, state = str(tmp_path / f"part-*.{kind}"), str(tmp_path / "run.meta")
    kw = {"dedup": dedup, "shuffle_window": 512}
    for index in range(readers):
        with open_stream(src, state, readers, index, **kw) as s:
            files = [s.state_path + x for x in ("", ".dedup", ".shuffle")]
            out, marks = [], []
            for batch_id, records in s.batches(7, format=fmt):
                out += records if fmt == "raw" else records.to_pylist()
                s.commit(batch_id)
                marks.append(len(out))
                snapshot(files, tmp_path / f"r{index}-b{batch_id}")
        assert marks, "every reader has records (the corpus is dealt in 32-byte blocks)"
        for batch_id, n in enumerate(marks, 1):
            restore(files, tmp_path / f"r{index}-b{batch_id}")
            with open_stream(src, state, readers, index, **kw) as s:
                if n == len(out):  # the epoch's last batch: a restart is in the next epoch
                    assert s.epoch == 1
                    continue
                assert s.epoch == 0
                rest = []
                for b, records in s.batches(7, format=fmt):
                    rest += records if fmt == "raw" else records.to_pylist()
                    s.commit(b)
            assert rest == out[n:], f"reader {index}, resumed after batch {batch_id}"


@pytest.mark.parametrize("readers", [1, 2])
def test_a_resume_inside_a_later_epoch_with_dedup_delivers_the_rest_of_that_epoch(
    tmp_path, readers
):
    """Dedup is per epoch: a restart in epoch 1 holds only epoch 1's committed hashes, so it
    delivers again what epoch 0 delivered, and exactly the uninterrupted run's rest."""
    records = make_lines(tmp_path, SMALL, dups=0.25)
    src, state = str(tmp_path / "part-*.jsonl"), str(tmp_path / "run.meta")
    kw = {"dedup": True, "shuffle_window": 512}
    delivered = set()
    for index in range(readers):
        with open_stream(src, state, readers, index, **kw) as s:
            first = drain(s, 7)
            assert s.epoch == 0
            files = [s.state_path + x for x in ("", ".dedup", ".shuffle")]
        with open_stream(src, state, readers, index, **kw) as s:
            assert s.epoch == 1
            out, marks = [], []
            for batch_id, batch in s.batches(7):
                out += batch
                s.commit(batch_id)
                delivered.update(batch)
                marks.append((batch_id, len(out)))  # batch ids go on across epochs
                snapshot(files, tmp_path / f"r{index}-b{batch_id}")
        if readers == 1:  # with more, each epoch deals every reader another share
            assert sorted(out) == sorted(first) and out != first, "every record again"
        for batch_id, n in marks[:-1]:
            restore(files, tmp_path / f"r{index}-b{batch_id}")
            with open_stream(src, state, readers, index, **kw) as s:
                assert s.epoch == 1
                rest = drain(s, 7)
            assert rest == out[n:], f"reader {index}, resumed in epoch 1 after batch {batch_id}"
    assert delivered == set(records), "epoch 1 delivers every record again"


def test_a_resume_reads_the_checkpoints_window_again_and_nothing_before_it(
    tmp_path, monkeypatch
):
    make_lines(tmp_path, [400, 1300, 200])
    src, state = str(tmp_path / "part-*.jsonl"), tmp_path / "run.meta"
    with open_stream(src, state, dedup=True) as s:
        for batch_id, _ in s.batches(100):
            s.commit(batch_id)
            slot = s._epochs.record.slot
            if slot.window >= 5 and slot.position:  # inside the sixth window or a later one
                break
        windows = s._epochs.windows()
        at, position = s._epochs.record.slot.window, s._epochs.record.slot.position
        expected = next(s.batches(100))[1]
    assert 0 < position
    read, counts, hashed = [], [], []
    real_read, real_hashes = window_room.read_blocks, window_room.span_hashes

    def read_blocks(spec, *args):
        read.append(spec)
        blocks = real_read(spec, *args)
        counts.append(sum(b.count for b in blocks))
        return blocks

    def span_hashes(data, starts, stops, **kw):
        hashed.append(len(starts))
        return real_hashes(data, starts, stops, **kw)

    monkeypatch.setattr(window_room, "read_blocks", read_blocks)
    monkeypatch.setattr(window_room, "span_hashes", span_hashes)
    with open_stream(src, state, dedup=True) as s:
        first = next(s.batches(100))[1]
        assert read[0] == windows[at], "the checkpoint's window, read first"
        assert all(spec in windows[at:] for spec in read), "no earlier window is read"
        # the checkpoint's window hashed whole (and the next one, read ahead), nothing more
        assert counts[0] in hashed and Counter(hashed) <= Counter(counts), (hashed, counts)
    assert first == expected


@pytest.mark.parametrize("near_end", [False, True])
def test_a_restarts_first_batch_parses_its_own_rows_and_starts_no_read_ahead(
    tmp_path, monkeypatch, near_end
):
    """Wherever the checkpoint falls in its window — also a few positions before its end,
    where the first batch crosses into the next window — the first batch after a restart
    parses about its own rows (no window is parsed whole) and no read-ahead runs beside it;
    the batches are those of the uninterrupted run, and read-ahead starts after the first."""
    make_lines(tmp_path, [400, 1300, 200])
    src, state = str(tmp_path / "part-*.jsonl"), tmp_path / "run.meta"
    monkeypatch.setattr(window_room, "FIRST_MIXED", 40)
    kw = {"dedup": False, "shuffle_window": 8192}
    with open_stream(src, state, **kw) as s:
        batches = s.batches(10, format="arrow")
        for batch_id, _ in batches:
            block = s._block
            left = block.window.count - (block.a + s._pos)
            if s._epochs.record.slot.window >= 2 and (0 < left < 10 if near_end else left > 50):
                s.commit(batch_id)
                break
            s.commit(batch_id)
        assert block.window.count > 100, "windows of more rows than the first blocks' twice"
        expected = [next(batches)[1].to_pylist() for _ in range(3)]
    whole, parsed_rows = [], []
    real_parse, real_table = window_room.Window._parse, window_room.block_table

    def parse(self, schema):
        whole.append(self.count)
        return real_parse(self, schema)

    def block_table(block, schema=None, **kw):
        parsed_rows.append(block.count)
        return real_table(block, schema, **kw)

    monkeypatch.setattr(window_room.Window, "_parse", parse)
    monkeypatch.setattr(window_room, "block_table", block_table)
    with open_stream(src, state, **kw) as s:
        batches = s.batches(10, format="arrow")
        got = [next(batches)[1].to_pylist()]
        assert not whole and sum(parsed_rows) <= 10 + 10, (whole, parsed_rows)
        assert not len(s._ahead) and not s._reader.read_ahead, "no read-ahead beside it"
        got += [next(batches)[1].to_pylist() for _ in range(2)]
        assert s._reader.read_ahead, "read-ahead from the second batch on"
    assert got == expected


def test_pace_reads_ahead_only_while_the_consumer_leaves_the_cpu_idle(monkeypatch):
    """Read-ahead of a shuffled stream's raw records costs hand-offs; ``Pace`` wants it once
    the consumer's idle time between batches (away, less the CPU the process used meanwhile)
    is at least half the time taken to make them, and says the same until a batch is made."""
    from faultfs.stream import read_ahead

    clock = {"wall": 0.0, "cpu": 0.0}
    monkeypatch.setattr(read_ahead.time, "perf_counter", lambda: clock["wall"])
    monkeypatch.setattr(read_ahead.time, "process_time", lambda: clock["cpu"])
    pace = read_ahead.Pace()
    pace.start()

    def batch(make: float, away: float, cpu_away: float, decide: bool = False) -> bool | None:
        pace.back()
        said = pace.ahead() if decide else None  # the stream decides as it takes a block
        assert not decide or pace.ahead() == said, "unchanged until a batch is made"
        clock["wall"] += make
        clock["cpu"] += make
        pace.out()
        clock["wall"] += away
        clock["cpu"] += cpu_away
        return said

    assert not batch(0.001, 0.003, 0.003, decide=True), "nothing measured: not ahead"
    for _ in range(4):  # a consumer running Python between batches: no idle time
        batch(0.001, 0.003, 0.003)
    assert not batch(0.001, 0.003, 0.0001, decide=True)
    for _ in range(4):  # a consumer blocked in an fsync or a device: idle
        batch(0.001, 0.003, 0.0001)
    assert batch(0.001, 0.0004, 0.0, decide=True)
    for _ in range(4):  # idle under half the making: on the consumer's thread again
        batch(0.001, 0.0004, 0.0)
    assert not batch(0.001, 0.0, 0.0, decide=True)


def test_a_consumer_that_idles_gets_raw_records_made_ahead_and_the_same_batches(tmp_path):
    """A consumer that sleeps between batches gets the next windows read and cut in threads
    (a quick one has them made on its own thread: the Pace test above); the batches are the
    same either way."""
    make_lines(tmp_path, [3000, 2500, 1800])
    src = str(tmp_path / "part-*.jsonl")

    def run(name: str, sleep: float) -> tuple[list[list[bytes]], int]:
        got, ahead = [], 0
        with open_stream(src, tmp_path / name, dedup=False, shuffle_window=8192) as s:
            for batch_id, records in s.batches(50):
                got.append(records)
                ahead += bool(len(s._ahead)) or bool(s._reader and s._reader.read_ahead)
                s.commit(batch_id)
                time.sleep(sleep)
        return got, ahead

    quick, _ = run("quick.meta", 0.0)
    slow, ahead = run("slow.meta", 0.004)
    assert ahead > len(slow) // 2, f"made ahead at {ahead} of {len(slow)} batches"
    assert slow == quick and sum(map(len, quick)) == 7300


def test_dedup_drops_a_record_where_it_falls_again_in_the_shuffled_order(tmp_path):
    records = make_lines(tmp_path, SMALL * 4, dups=0.3)
    src = str(tmp_path / "part-*.jsonl")
    for readers in (1, 2):
        for epoch in range(2):  # dedup is per epoch: the next one delivers every record again
            every = read_epoch(src, tmp_path / f"all-{readers}.meta", readers, dedup=False)
            firsts = read_epoch(src, tmp_path / f"dedup-{readers}.meta", readers, dedup=True)
            for order, got in zip(every, firsts, strict=True):
                assert got == list(dict.fromkeys(order)), (
                    f"epoch {epoch}: each record at its first place in the reader's order"
                )
            assert {r for part in firsts for r in part} == set(records)
            if readers == 1:
                assert len(firsts[0]) == len(set(records)) < len(records)


# ---------------------------------------------------------------------------------------------
# epochs


def test_epochs_move_on_by_iterating_again_by_set_epoch_and_by_a_restart(tmp_path):
    records = make_lines(tmp_path, SMALL)
    src, state = str(tmp_path / "part-*.jsonl"), tmp_path / "run.meta"
    s = open_stream(src, state, dedup=False, shuffle_window=256)
    assert s.epoch == 0
    s.set_epoch(4)  # at the start of an epoch: any epoch
    first = drain(s, 10)
    assert s.epoch == 4 and sorted(first) == sorted(records)
    second = drain(s, 10)  # iterating again: the next epoch
    assert s.epoch == 5 and sorted(second) == sorted(records) and second != first
    it = s.batches(10)
    batch_id, _ = next(it)
    s.commit(batch_id)
    with pytest.raises(InvalidInput, match="epoch 6 is under way in this stream; it asks for "
                                           "epoch 9 — finish epoch 6 first"):
        s.set_epoch(9)
    s.close()
    # a restart in the middle of epoch 6 continues it; another epoch is refused
    with pytest.raises(InvalidInput, match=r"the state is in epoch 6 \(at window \d+, position "
                                           r"\d+\); this stream asks for epoch 2"):
        open_stream(src, state, dedup=False, shuffle_window=256, epoch=2)
    with open_stream(src, state, dedup=False, shuffle_window=256, epoch=6) as s:
        assert s.epoch == 6
        drain(s, 10)
    # after the epoch's last commit a restart opens the next epoch, at its start
    with open_stream(src, state, dedup=False, shuffle_window=256) as s:
        assert s.epoch == 7
        s.set_epoch(3)
        assert sorted(drain(s, 10)) == sorted(records)


def test_a_reader_with_nothing_in_an_epoch_marks_it_finished(tmp_path):
    make_lines(tmp_path, [2, 1, 0])  # fewer blocks than readers: some parts are empty
    src, state = str(tmp_path / "part-*.jsonl"), tmp_path / "run.meta"
    kw = {"dedup": False, "shuffle_window": 16 * 64, "seed": 3}
    empty = []
    for i in range(4):
        with open_stream(src, state, 4, i, **kw) as s:
            if not drain(s):
                empty.append(i)
                assert s._epochs.record.slot.finished, "marked finished by the stream itself"
    assert empty
    with open_stream(src, state, 4, empty[0], **kw) as s:
        assert s.epoch == 1, "a restart, or a loader's next iteration, moves on"


# ---------------------------------------------------------------------------------------------
# refusals


def test_a_state_of_another_shuffle_or_shard_list_is_refused_in_one_line(tmp_path):
    make_lines(tmp_path, SMALL)
    src, state = str(tmp_path / "part-*.jsonl"), tmp_path / "run.meta"
    with open_stream(src, state) as s:
        batch_id, _ = next(s.batches(5))
        s.commit(batch_id)
    record = f"{state}.shuffle"
    cases = [
        ({"seed": 12}, f"{record}: the state was shuffled with seed {SEED}; this stream has "
                       "seed 12"),
        ({"shuffle_window": 4096}, f"{record}: the state was shuffled in windows of 2048 bytes "
                                   "(16 blocks); this stream has shuffle_window=4096"),
        ({"epoch": 3}, f"{record}: the state is in epoch 0 (at window"),
    ]
    for kw, message in cases:
        with pytest.raises(InvalidInput) as err:
            open_stream(src, state, **kw)
        assert str(err.value).startswith(message) and "\n" not in str(err.value)
    (tmp_path / "part-9.jsonl").write_bytes(b'{"late": 1}\n')
    with pytest.raises(InvalidInput) as err:
        open_stream(src, state)
    assert str(err.value).startswith(
        f"{record}: the state was written over 5 shards of ") and "expand to 6 shards" in str(
        err.value)
    os.unlink(tmp_path / "part-9.jsonl")
    with pytest.raises(InvalidInput, match=r"run.meta is the state of a shuffled stream \(its "
                                           r"shuffle record is .*run.meta.shuffle\); this stream "
                                           "reads in file order"):
        RecordStream(src, state)
    plain = tmp_path / "plain.meta"
    with RecordStream(src, plain) as s:
        drain(s, 5)
    with pytest.raises(InvalidInput, match="plain.meta was written by a stream that reads in "
                                           r"file order; this stream shuffles \(seed 11\)"):
        open_stream(src, plain)
    with pytest.raises(InvalidInput, match="seed, epoch applies to a shuffled stream"):
        RecordStream(src, tmp_path / "x.meta", seed=1, epoch=2)
    with pytest.raises(InvalidInput, match="shuffle_window must be an int of at least 16"):
        open_stream(src, tmp_path / "x.meta", shuffle_window=8)
    assert not (tmp_path / "x.meta").exists()


def test_checkpoint_show_reports_the_shuffle_record(tmp_path, capsys):
    from faultfs.cli import build_parser

    make_lines(tmp_path, SMALL)
    src, state = str(tmp_path / "part-*.jsonl"), tmp_path / "run.meta"
    with open_stream(src, state) as s:
        for batch_id, _ in s.batches(5):
            s.commit(batch_id)
            if batch_id == 3:
                break
        slot = s._epochs.record.slot
    args = build_parser().parse_args(["checkpoint", "show", str(state)])
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert f"shuffle record: {state}.shuffle  seed {SEED}  windows of 16 x 128 bytes" in text
    assert (f"slot A valid    checkpoint epoch 3  epoch 0  window {slot.window}  position "
            f"{slot.position}  dedup_base 0  generation 0") in text
    assert "pairs with the active checkpoint: slot A" in text
    raw = bytearray(Path(f"{state}.shuffle").read_bytes())
    raw[10] ^= 1  # slot A torn: the active checkpoint has no shuffle slot
    Path(f"{state}.shuffle").write_bytes(bytes(raw))
    with pytest.raises(CorruptionError, match="no shuffle slot for checkpoint epoch 3"):
        args.func(args)


# ---------------------------------------------------------------------------------------------
# the shuffle record: golden bytes, damage, crashes


GOLDEN_COORD = StreamCoordinate(3, 0x1122334455667788, 7, 2, 9, 123456789)
GOLDEN_SLOT = ShuffleSlot(3, 2, 5, 77, 1000, 1, False, DiskSlot(3, 42, GOLDEN_COORD, 1000))
GOLDEN_HEADER = ShuffleHeader(Geometry(7, 1 << 20, 16), 0x1122334455667788, (100, 0, 7))


def test_the_shuffle_record_format_is_pinned():
    assert GOLDEN_SLOT.encode().hex() == (
        "46465353" "02000000" "0300000000000000" "0200000000000000" "0500000000000000"
        "4d00000000000000" "e8030000" "01000000" "00000000" "0000000000000000" "416f511f"
    ), "format changed: bump shuffle.record.VERSION"
    # a record's slot: the place, then the .meta slot of its checkpoint, byte for byte
    assert GOLDEN_SLOT.slot_bytes() == GOLDEN_SLOT.encode() + GOLDEN_SLOT.meta.encode()
    assert GOLDEN_HEADER.encode().hex() == (
        "46465348" "02000000" "0700000000000000" "0000100000000000" "10000000" "03000000"
        "8877665544332211" "6400000000000000" "0000000000000000" "0700000000000000" "d3b517a4"
    ), "format changed: bump shuffle.record.VERSION"
    finished = ShuffleSlot(4, 2, 9, 0, 1000, 1, True, DiskSlot(4, 50, GOLDEN_COORD, 1200))
    data = shuffle_mod.image(GOLDEN_HEADER, [GOLDEN_SLOT, finished])
    assert len(data) == 256 + len(GOLDEN_HEADER.encode())
    header, slots = record_room.decode(data, "x")
    assert header == GOLDEN_HEADER and [s for s, _ in slots] == [GOLDEN_SLOT, finished]
    assert [s.meta for s, _ in slots] == [GOLDEN_SLOT.meta, finished.meta]
    # the .meta the record stands for: each copy at its parity position
    assert record_room.meta_bytes([s for s, _ in slots]) == (GOLDEN_SLOT.meta.encode()
                                                             + finished.meta.encode())


def test_a_version_1_record_is_refused_in_one_line(tmp_path):
    make_lines(tmp_path, SMALL)
    src, state = str(tmp_path / "part-*.jsonl"), tmp_path / "run.meta"
    with open_stream(src, state) as s:
        next(s.batches(5))
    record = Path(f"{state}.shuffle")
    v1 = bytes(128) + bytes.fromhex("46465348" "01000000") + record.read_bytes()[264:]
    record.write_bytes(v1)  # the layout of version 1: two 64-byte slots, then the header
    with pytest.raises(CorruptionError, match=r"run.meta.shuffle: damaged shuffle record: "
                                              r"version 1 \(written by an older faultfs"):
        open_stream(src, state)
    assert record.read_bytes() == v1


def test_the_carried_rest_format_is_pinned():
    rest = carry_room.CarriedRecord(
        Carried(2, 5, (WindowSpec((3, 9), 0xABCD, 4),), np.array([1, 0, 0, 0, 0, 1, 0, 0, 0, 0,
                                                                   1], dtype=bool)),
        Geometry(7, 64, 16),
    )
    data = carry_room.encode(rest)
    assert data.hex() == (
        "46465343" "01000000" "02000000" "00000000" "0500000000000000" "0700000000000000"
        "4000000000000000" "10000000" "01000000" "0b00000000000000"
        "cdab000000000000" "0400000000000000" "02000000" "0300000000000000" "0900000000000000"
        "2104" "4bca1fc6"
    ), "format changed: bump shuffle.carry.VERSION"
    back = carry_room.decode_carried(data, "x")
    assert back.geometry == rest.geometry and back.plan.remainders == rest.plan.remainders
    assert back.plan.pool.tolist() == rest.plan.pool.tolist()


def with_crc(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    """``data`` (a record) with a header field overwritten and the header's CRC made right."""
    body = bytearray(data[:-4])
    struct.pack_into(fmt, body, offset, value)
    return bytes(body) + struct.pack("<I", zlib.crc32(body[256:]))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: d[:20], "damaged shuffle record: 20 bytes, shorter than the 300-byte minimum"),
        (lambda d: d[:256] + b"XXXX" + d[260:], "damaged shuffle record: bad magic b'XXXX'"),
        (lambda d: with_crc(d, 260, "<I", 9), "version 9, this faultfs reads version 2"),
        (lambda d: d[:-1] + bytes([d[-1] ^ 1]), "damaged shuffle record: bad checksum"),
        (lambda d: d[:278] + bytes([d[278] ^ 0x40]) + d[279:], "bad checksum"),
        (lambda d: with_crc(d, 284, "<I", 2**32 - 1), "damaged shuffle record: shard count "
                                                      "4294967295"),
        (lambda d: with_crc(d, 284, "<I", 4), "header bytes for 4 shards"),
        (lambda d: with_crc(d, 272, "<Q", 0), "block of 0 bytes"),
        (lambda d: with_crc(d + b"\0" * 8, len(d) - 4, "<Q", 0), "header bytes for 5 shards"),
        # the checkpoint's own slot (B) torn: its partner holds the checkpoint before, which
        # the .meta is ahead of: refused, never used
        (lambda d: d[:134] + bytes([d[134] ^ 1]) + d[135:],
         "no shuffle slot for checkpoint epoch 2 of"),
        (lambda d: d[:128] + bytes(128) + d[256:], "slot B: all-zero"),
        # a bit of the checkpoint's slot's position flipped: its fields look sound, its CRC not
        (lambda d: d[:161] + bytes([d[161] ^ 1]) + d[162:], "slot B: bad crc"),
        # its copy of the .meta slot damaged: that copy's CRC fails
        (lambda d: d[:200] + bytes([d[200] ^ 1]) + d[201:], "slot B: bad crc (its .meta slot)"),
        # both slots damaged: no checkpoint at all
        (lambda d: bytes(8) + d[8:136] + bytes(8) + d[144:], "no valid slot"),
    ],
)
def test_a_damaged_shuffle_record_is_refused(tmp_path, damage, message):
    make_lines(tmp_path, SMALL)
    src, state = str(tmp_path / "part-*.jsonl"), tmp_path / "run.meta"
    with open_stream(src, state) as s:
        for batch_id, _ in s.batches(5):
            s.commit(batch_id)
            if batch_id == 2:
                break
    record = Path(f"{state}.shuffle")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("run")}
    record.write_bytes(damage(record.read_bytes()))
    with pytest.raises(CorruptionError) as err:
        open_stream(src, state)
    assert str(err.value).startswith(f"{record}: ") and message in str(err.value)
    before[record.name] = record.read_bytes()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()
            if p.name.startswith("run")} == before, "a refused open changes nothing"


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_decoding_random_damage_raises_only_corruption(data):
    """Bytes overwritten, cut short, the CRC made right again or not: a shuffle record and a
    carried rest either decode to what encodes back to the same bytes, or are refused as
    damaged; nothing else."""
    rest = carry_room.CarriedRecord(
        Carried(3, 1, (WindowSpec((2, 5), 9, 3), WindowSpec((0,), 4, 1)),
                np.array([0, 1, 0, 1, 1, 0, 0, 1, 0], dtype=bool)),
        Geometry(7, 64, 16),
    )
    kind = data.draw(st.sampled_from(["record", "carry"]))
    good = (shuffle_mod.image(GOLDEN_HEADER, [GOLDEN_SLOT]) if kind == "record"
            else carry_room.encode(rest))
    raw = bytearray(good)
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    blob = bytes(raw[: data.draw(st.integers(0, len(raw)))])
    if data.draw(st.booleans()) and len(blob) > 4:
        start = 256 if kind == "record" and len(blob) > 260 else 0
        blob = blob[:-4] + struct.pack("<I", zlib.crc32(blob[start:-4]))
    error = None
    try:
        if kind == "record":
            header, _ = record_room.decode(blob, "x")
            assert blob[256:] == header.encode()
        else:
            assert carry_room.encode(carry_room.decode_carried(blob, "x")) == blob
    except CorruptionError as err:
        error = str(err)
    assert error is None or error.startswith(f"x: damaged shuffle {kind}: "), error


META = "/sim/s.meta"
RECORD = META + ".shuffle"


def _sim_state(disk: SimDisk) -> tuple:
    """(checkpoint epoch, batch id, coordinate, the shuffle slot's place) recovered from a
    disk, as a shuffled stream opens it."""
    ops = SimOps(disk)
    shuffle_mod.settle(META, ops)  # the .meta slots have no fsync of their own
    meta = DualMetadataManager.open(META, ops=ops)
    try:
        record = ShuffleRecord.open(RECORD, meta.epoch, META, ops=ops)
        slot = record.slot
        record.close()
        return meta.epoch, meta.committed_batch_id, meta.coord, (slot.epoch, slot.window,
                                                                 slot.position)
    finally:
        meta.close()


def _commits(disk: SimDisk, batches: list, crash_at: int | None) -> tuple[list, int, bool]:
    ops = SimOps(disk, crash_at)
    fresh = (0, 0, StreamCoordinate(), (0, 0, 0))
    legal = [fresh]
    try:
        meta = DualMetadataManager.open(META, ops=ops)
        record = ShuffleRecord.create(RECORD, GOLDEN_HEADER, ShuffleSlot(0, 0), ops=ops)
        commits = Commits(meta, record)
        for n, (coord, place) in enumerate(batches, 1):
            batch_id = commits.hand_out(coord, [np.array([n], dtype=np.uint64)],
                                        ShuffleSlot(0, *place))
            before = legal[-1]
            legal = [before, (n, batch_id, coord, place)]
            commits.commit(batch_id)
            legal = [legal[-1]]
        return legal, ops.points, False
    except SimulatedCrash:
        return legal, ops.points, True


def test_a_crash_at_every_write_of_a_shuffled_commit_recovers_the_previous_or_the_new():
    rng = random.Random(99)
    batches = [(StreamCoordinate(1, 10 * n, 0, 0, 0, n), (0, n // 2, 3 * n)) for n in range(1, 6)]
    _, total, crashed = _commits(SimDisk(), batches, None)
    assert not crashed
    for point in range(total):
        for _ in range(10):  # several fates of the unsynced writes at each point
            disk = SimDisk()
            legal, _, crashed = _commits(disk, batches, point)
            assert crashed
            after = disk.crash(rng)
            if META not in after.names or RECORD not in after.names:
                assert legal[0][0] == 0, "only before the first commit may a file be missing"
                continue
            assert _sim_state(after) in legal, point


def test_a_shuffled_commit_is_one_barrier_and_a_meta_left_behind_is_written_again(
    tmp_path, monkeypatch
):
    """A commit fsyncs the record (and, with hashes, the WAL first), never the .meta; a .meta
    that lost its last slots (as a power loss leaves it) is written again from the record by
    the next open, and that open resumes where the uninterrupted stream would have gone on."""
    make_lines(tmp_path, SMALL)
    src = str(tmp_path / "part-*.jsonl")
    synced: list[str] = []
    real = OsFileOps.fsync
    monkeypatch.setattr(OsFileOps, "fsync", lambda self, fd: (
        synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(self, fd))[1])
    for dedup in (False, True):
        state = tmp_path / f"one-{dedup}.meta"
        with open_stream(src, state, dedup=dedup) as s:
            batches = s.batches(4)
            next(batches)
            old_meta = state.read_bytes()
            synced.clear()
            batch_id, _ = next(batches)
            s.commit(batch_id)
            assert synced == [f"{state}.dedup"] * dedup + [f"{state}.shuffle"]
            rest = [r for _, b in batches for r in b]
        state.write_bytes(old_meta)  # the commit's .meta slot never reached the disk
        info, error = describe_checkpoint(str(state))
        assert error is None and "the .meta is behind its record" in info["shuffle"]["note"]
        synced.clear()
        with open_stream(src, state, dedup=dedup) as again:
            assert synced[:1] == [str(state)], "the open writes the .meta again, fsynced"
            assert again.committed_batch_id == batch_id
            assert [r for _, b in again.batches(4) for r in b] == rest
        state.write_bytes(bytes(128))  # both slots lost: the record still holds them
        with open_stream(src, state, dedup=dedup) as again:
            assert again.committed_batch_id == batch_id


# ---------------------------------------------------------------------------------------------
# repartitioning inside an epoch


def test_a_repartition_inside_an_epoch_carries_its_rest_and_no_committed_record_comes_again(
    tmp_path,
):
    records = make_lines(tmp_path, SMALL * 3, dups=0.2)
    unique = set(records)
    src, state = str(tmp_path / "part-*.jsonl"), tmp_path / "run.meta"
    kw = {"dedup": True, "shuffle_window": 512}
    rng = random.Random(4)
    committed = []
    for i in range(4):  # 2 ranks x 2 workers, each stopping somewhere in its part
        with open_stream(src, state, 4, i, **kw) as s:
            stop = rng.randrange(0, 6)
            for batch_id, recs in s.batches(5):
                if batch_id > stop:
                    break
                committed += recs
                s.commit(batch_id)
    assert committed
    with pytest.raises(InvalidInput, match="this run has world_size 3, num_workers 1"):
        RecordStream(src, state, shuffle=True, seed=SEED, rank=0, world_size=3, **kw)
    rest = []
    for r in range(3):  # the first one repartitions; the others find the new partition
        with RecordStream(src, state, shuffle=True, seed=SEED, rank=r, world_size=3,
                          repartition=True, **kw) as s:
            assert s.epoch == 0
            part = drain(s, 5)
        assert len(part) == len(set(part)), "dedup within a reader"
        rest += part
    assert not set(committed) & set(rest), "no record committed in the epoch comes again in it"
    assert set(committed) | set(rest) == unique, "and every record is delivered"
    # the next epoch is the new readers' own: every record once again
    nxt = []
    for r in range(3):
        with RecordStream(src, state, shuffle=True, seed=SEED, rank=r, world_size=3, **kw) as s:
            assert s.epoch == 1
            nxt += drain(s, 5)
    assert set(nxt) == unique


def test_two_repartitions_in_one_epoch_and_the_refusal_across_epochs(tmp_path):
    records = make_lines(tmp_path, SMALL * 3)
    src, state = str(tmp_path / "part-*.jsonl"), tmp_path / "run.meta"
    kw = {"dedup": False, "shuffle_window": 512, "seed": SEED, "shuffle": True}
    delivered = []

    def some(world, stops, **extra):
        for r, stop in enumerate(stops):
            with RecordStream(src, state, rank=r, world_size=world, **kw, **extra) as s:
                for batch_id, recs in s.batches(4):
                    if batch_id > stop:
                        break
                    delivered.extend(recs)
                    s.commit(batch_id)

    some(2, [3, 1])
    some(3, [0, 0, 0], repartition=True)  # carried, and nobody commits under it
    some(2, [2, 0], repartition=True)  # carried again: the rest of the rest
    some(4, [99, 99, 99, 99], repartition=True)
    assert sorted(delivered) == sorted(records) and len(set(delivered)) == len(records)
    # reader 0 finishes its part of epoch 1; reader 1 has begun epoch 1 too: one epoch, fine
    some(4, [99, 1, 0, 0])
    with RecordStream(src, state, rank=0, world_size=4, **kw) as s:
        batch_id, _ = next(s.batches(4))  # reader 0 is in epoch 2 now
        assert s.epoch == 2
        s.commit(batch_id)
    with pytest.raises(InvalidInput, match=r"is in epoch 2, another reader of its partition in "
                                           "epoch 1: a shuffled partition is repartitioned"):
        RecordStream(src, state, rank=0, world_size=2, repartition=True, **kw)


@pytest.mark.parametrize("crash", ["before the sidecar", "after the sidecar"])
def test_a_shuffled_repartition_interrupted_by_a_crash(tmp_path, monkeypatch, crash):
    records = make_lines(tmp_path, SMALL * 2)
    src, state = str(tmp_path / "part-*.jsonl"), tmp_path / "run.meta"
    kw = {"dedup": False, "shuffle_window": 512, "seed": SEED, "shuffle": True}
    committed = []
    for r in range(2):
        with RecordStream(src, state, rank=r, world_size=2, **kw) as s:
            for batch_id, recs in s.batches(4):
                committed += recs
                s.commit(batch_id)
                if batch_id == 2:
                    break

    class Crash(Exception):
        pass

    real_store, real_roll = repartition_room.store, repartition_room.roll_forward

    def store(path, part):
        if part.pending and crash == "before the sidecar":
            raise Crash
        real_store(path, part)

    def roll_forward(state_, part):
        if crash == "after the sidecar":
            raise Crash
        real_roll(state_, part)

    monkeypatch.setattr(repartition_room, "store", store)
    monkeypatch.setattr(repartition_room, "roll_forward", roll_forward)
    with pytest.raises(Crash):
        RecordStream(src, state, rank=0, world_size=3, repartition=True, **kw)
    monkeypatch.undo()
    world = 2 if crash == "before the sidecar" else 3  # the old partition whole, or the new
    rest = []
    for r in range(world):
        with RecordStream(src, state, rank=r, world_size=world, **kw) as s:
            rest += drain(s, 4)
    assert sorted(committed + rest) == sorted(records)
