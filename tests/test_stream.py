"""RecordStream: records and batches, dedup, commits with prefetch, O(1) resume (counting the
opens and reads made after reopening, for jsonl, txt and parquet, local, memory:// and HTTP
with Range), exactly-once delivery across simulated crashes and a real kill -9."""

from __future__ import annotations

import contextlib
import http.server
import io
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import fsspec
import numpy as np
import pytest
from fsspec.implementations.memory import MemoryFileSystem
from hypothesis import given, settings
from hypothesis import strategies as st

from faultfs.core.coord import StreamCoordinate
from faultfs.errors import InvalidInput, SourceError
from faultfs.store.metadata import DualMetadataManager
from faultfs.stream import RecordStream
from faultfs.stream import readers as readers_mod
from faultfs.stream.shards import Shard

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


def write_lines(path, lines, *, newline="\n", final_newline=True):
    text = newline.join(lines) + (newline if final_newline and lines else "")
    Path(path).write_bytes(text.encode())


def unique_in_order(records):
    seen, out = set(), []
    for r in records:
        key = json.dumps(r, sort_keys=True) if isinstance(r, dict) else r
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def drain(stream, batch_size, *, commit=True):
    out = []
    for batch_id, records in stream.batches(batch_size):
        out.extend(records)
        if commit:
            stream.commit(batch_id)
    return out


# ---------------------------------------------------------------------------------------------
# records, batches and dedup


def test_jsonl_records_are_lines_without_terminator(tmp_path):
    write_lines(tmp_path / "a.jsonl", ['{"x":1}', "", '{"x":2}', '{"x":1}'], newline="\r\n")
    (tmp_path / "b.jsonl").write_bytes(b'{"x":3}\n\n{"x":4}')  # no final newline
    with RecordStream(str(tmp_path / "*.jsonl"), tmp_path / "s.meta") as s:
        assert drain(s, 2) == [b'{"x":1}', b'{"x":2}', b'{"x":3}', b'{"x":4}']
        # 5 raw records scanned (the duplicate counts, blank lines do not)
        assert s.committed_coord == StreamCoordinate(1, 16, 0, 0, 0, 5)
    with RecordStream(str(tmp_path / "*.jsonl"), tmp_path / "t.meta", dedup=False) as s:
        assert drain(s, 3) == [b'{"x":1}', b'{"x":2}', b'{"x":1}', b'{"x":3}', b'{"x":4}']


def test_txt_shards_and_batch_ids(tmp_path):
    write_lines(tmp_path / "1.txt", [f"line {i}" for i in range(7)])
    with RecordStream([tmp_path / "1.txt"], tmp_path / "s.meta") as s:
        got = list(s.batches(3))
    assert [b for b, _ in got] == [1, 2, 3]
    assert [len(r) for _, r in got] == [3, 3, 1]
    assert got[0][1][0] == b"line 0"


def test_sources_keep_given_order_and_sort_each_glob(tmp_path):
    for name in ("b2.txt", "b1.txt", "a.txt"):
        write_lines(tmp_path / name, [name])
    sources = [str(tmp_path / "b*.txt"), str(tmp_path / "a.txt")]
    with RecordStream(sources, tmp_path / "s.meta") as s:
        assert drain(s, 10) == [b"b1.txt", b"b2.txt", b"a.txt"]


def test_long_lines_span_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(readers_mod, "LINE_BLOCK", 16)
    lines = ["x" * 50, "short", "y" * 33, "z"]
    write_lines(tmp_path / "a.txt", lines)
    with RecordStream(str(tmp_path / "a.txt"), tmp_path / "s.meta") as s:
        assert drain(s, 2) == [line.encode() for line in lines]


def _reference_records(data: bytes, start: int, stop: int | None) -> list:
    """The records a line reader must give for the lines that start in ``[start, stop)``:
    each non-empty one, its "\\r\\n" or "\\n" cut off (and a last lone "\\r")."""
    out, pos = [], 0
    pieces = data.split(b"\n")  # only "\n" ends a line (bytes.splitlines would cut at "\r")
    for line in [p + b"\n" for p in pieces[:-1]] + ([pieces[-1]] if pieces[-1] else []):
        begin, pos = pos, pos + len(line)
        if begin < start or (stop is not None and begin >= stop):
            continue
        body = line.rstrip(b"\n")
        if body.endswith(b"\r") and (line.endswith(b"\n") or pos == len(data)):
            body = body[:-1]
        if body:
            out.append(body)
    return out


def _shard_text(lines, final: bool) -> bytes:
    """Lines, blank lines (no record) and lines with a lone "\\r" in them (part of the
    record), each ended by "\\n" or "\\r\\n"; ``final``: the last one too."""
    shapes = {"line": b"%d", "blank": b"", "cr": b"%d\r"}
    text = b"".join((shapes[kind] % i if kind != "blank" else b"")
                    + (b"x" * n if kind != "blank" else b"") + nl.encode()
                    for i, (n, nl, kind) in enumerate(lines))
    return text if final or not text else text.rstrip(b"\r\n")


_LINES = st.lists(st.tuples(st.integers(0, 90), st.sampled_from(["\n", "\r\n"]),
                            st.sampled_from(["line", "blank", "cr"])), max_size=25)


@settings(max_examples=100, deadline=None)
@given(_LINES, st.booleans(), st.integers(1, 64), st.data())
def test_a_line_reader_resumes_only_at_a_line_start(lines, final, first, data):
    """A resume point anywhere in a shard: the records after it when it is 0, just past a
    "\\n" or the shard's end (where every record ends, so every commit); refused anywhere
    else, before a record is given."""
    text = _shard_text(lines, final)
    offset = data.draw(st.integers(0, len(text)))
    old = readers_mod.FIRST_READ
    readers_mod.FIRST_READ = first
    try:
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "a.jsonl"
            path.write_bytes(text)
            reader = readers_mod.LineShardReader(Shard(str(path), "lines"), 0, offset, 0)
            try:
                if offset in (0, len(text)) or text[offset - 1 : offset] == b"\n":
                    got = []
                    while (b := reader.next_block()) is not None:
                        got += b.records
                    assert got == _reference_records(text, offset, None)
                else:
                    with pytest.raises(SourceError, match=f"resumes at byte {offset}, which "
                                       "does not start a line"):
                        reader.next_block()
            finally:
                reader.close()
    finally:
        readers_mod.FIRST_READ = old


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 90), st.sampled_from(["\n", "\r\n"]),
                       st.sampled_from(["line", "blank", "cr"])), max_size=25),
    st.booleans(),
    st.integers(1, 64),
    st.integers(1, 64),
    st.integers(1, 16),
    st.booleans(),
    st.data(),
)
def test_line_reader_gives_every_line_of_its_range_once(lines, final, block, first, tail,
                                                        compiled, data):
    """The line reader against a plain split, for any read sizes: lines longer than a read,
    blank lines, CRLF, no final newline, and ranges starting and ending anywhere; its records
    cut in C (``compiled``) or split in Python, whole or picked (dedup's fresh records)."""
    text = _shard_text(lines, final)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "a.jsonl"
        path.write_bytes(text)
        cut = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=3)))
        bounds = [0, *cut, None]
        ranges = [(bounds[i], bounds[i + 1], bounds[i] == 0) for i in range(len(bounds) - 1)]
        old = (readers_mod.LINE_BLOCK, readers_mod.FIRST_READ, readers_mod.TAIL_READ,
               readers_mod._cut)
        if compiled and readers_mod._cut is None:
            pytest.skip("faultfs.stream._cut is not built (no C compiler at install)")
        readers_mod.LINE_BLOCK, readers_mod.FIRST_READ, readers_mod.TAIL_READ = block, first, tail
        readers_mod._cut = readers_mod._cut if compiled else None
        try:
            shard = Shard(str(path), "lines")
            reader = readers_mod.LineShardReader(shard, 0, 0, 0, ranges=ranges)
            got, ends = [], []
            while (b := reader.next_block()) is not None:
                sel = sorted(set(data.draw(st.lists(st.integers(0, b.count - 1), max_size=5))))
                picked = readers_mod.records_at(b, np.array(sel, dtype=np.intp))
                got += b.records
                assert picked == [b.records[i] for i in sel]
                ends += [int(e) for e in b.ends]
            reader.close()
        finally:
            (readers_mod.LINE_BLOCK, readers_mod.FIRST_READ, readers_mod.TAIL_READ,
             readers_mod._cut) = old
    want = []
    for start, stop, _exact in ranges:
        # an inexact start: the records that start at or after it (a line start at start
        # itself counts only if the byte before it ends a line)
        first_start = start
        if start > 0 and text[start - 1:start] != b"\n":
            nl = text.find(b"\n", start)
            first_start = len(text) if nl < 0 else nl + 1
        want += _reference_records(text, first_start, stop)
    assert got == want
    assert ends == sorted(set(ends)), "each record ends after the one before it"
    assert all(text[e - 1:e] == b"\n" or e == len(text) for e in ends)


def test_prefetched_batches_commit_in_one_checkpoint(tmp_path):
    write_lines(tmp_path / "a.txt", [str(i) for i in range(10)])
    with RecordStream(str(tmp_path / "a.txt"), tmp_path / "s.meta") as s:
        it = s.batches(2)
        b1, b2, b3 = next(it), next(it), next(it)
        s.commit(b2[0])  # covers batches 1 and 2, not 3
        assert s.committed_batch_id == 2
        assert s.committed_coord.global_row_idx == 4
        s.commit(b1[0])  # already durable: no-op
        with pytest.raises(InvalidInput, match="batch 99 was not handed out"):
            s.commit(99)
        assert b3[1] == [b"4", b"5"]
    with DualMetadataManager.open(tmp_path / "s.meta") as m:
        assert m.dedup_count == 4
        assert m.epoch == 1


def test_a_state_open_in_another_stream_is_refused_and_left_alone(tmp_path):
    # Two writers of one checkpoint overwrite each other's slots and WAL: the second one's
    # epoch 2 replaced the first one's, and records the first had committed came again.
    write_lines(tmp_path / "a.txt", [str(i) for i in range(10)])
    src, state = str(tmp_path / "a.txt"), tmp_path / "s.meta"
    with RecordStream(src, state) as first:
        it = first.batches(3)
        first.commit(next(it)[0])
        before = (state.read_bytes(), (tmp_path / "s.meta.dedup").read_bytes())
        with pytest.raises(InvalidInput, match=r"s\.meta: .*open in another stream"):
            RecordStream(src, state)
        child = subprocess.run(
            [PYTHON, "-c", "import sys; from faultfs.stream import RecordStream; "
             "RecordStream(sys.argv[1], sys.argv[2])", src, str(state)],
            env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True)
        assert child.returncode != 0 and "open in another stream" in child.stderr
        assert (state.read_bytes(), (tmp_path / "s.meta.dedup").read_bytes()) == before
        first.commit(next(it)[0])
    with RecordStream(src, state) as again:  # closed: the state is free again
        assert drain(again, 3) == [str(i).encode() for i in range(6, 10)]


def test_duplicate_of_a_batch_committed_after_lookahead_is_still_skipped(tmp_path):
    write_lines(tmp_path / "a.txt", ["a", "b", "c", "d", "a", "b"])
    with RecordStream(str(tmp_path / "a.txt"), tmp_path / "s.meta") as s:
        out = []
        for batch_id, records in s.batches(2):
            out += records
            s.commit(batch_id)
    assert out == [b"a", b"b", b"c", b"d"]


def test_errors_are_clear(tmp_path):
    with pytest.raises(InvalidInput, match="unknown record format"):
        RecordStream(str(tmp_path / "a.csv"), tmp_path / "s.meta")
    with pytest.raises(SourceError, match="glob matches no shard"):
        RecordStream(str(tmp_path / "*.jsonl"), tmp_path / "s.meta")
    s = RecordStream(str(tmp_path / "missing.jsonl"), tmp_path / "s.meta")
    with pytest.raises(SourceError, match=r"missing\.jsonl: no such shard"):
        list(s.batches(1))
    s.close()
    write_lines(tmp_path / "a.txt", ["x"])
    with RecordStream(str(tmp_path / "a.txt"), tmp_path / "s.meta") as s:
        with pytest.raises(InvalidInput, match="batch_size"):
            next(s.batches(0))
    with DualMetadataManager.open(tmp_path / "far.meta") as m:
        m.commit(1, StreamCoordinate(shard_id=5))
    with pytest.raises(InvalidInput, match="checkpoint is at shard 5 but the sources expand to 1"):
        RecordStream(str(tmp_path / "a.txt"), tmp_path / "far.meta")


def test_parquet_without_pyarrow_is_a_clear_error(tmp_path, monkeypatch):
    (tmp_path / "a.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with RecordStream(str(tmp_path / "a.parquet"), tmp_path / "s.meta") as s:
        with pytest.raises(InvalidInput, match=r"needs pyarrow: pip install 'faultfs\[parquet\]'"):
            list(s.batches(1))


# ---------------------------------------------------------------------------------------------
# O(1) resume, counting opens and reads after reopening


class CountingFile(io.BytesIO):
    def __init__(self, data, log, path):
        super().__init__(data)
        self._log, self._path = log, path

    def read(self, n=-1):
        offset = self.tell()
        data = super().read(n)
        self._log.append(("read", self._path, offset, len(data)))
        return data

    def readinto(self, b):
        offset = self.tell()
        n = super().readinto(b)
        self._log.append(("read", self._path, offset, n))
        return n


class CountingMemoryFS(MemoryFileSystem):
    """memory:// that records every open and read (shared store with memory://)."""

    protocol = "countmem"
    log: list = []

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(str(path).replace("countmem://", "memory://", 1))

    def _open(self, path, mode="rb", **kwargs):
        path = self._strip_protocol(path)
        self.log.append(("open", path))
        return CountingFile(bytes(self.store[path].getbuffer()), self.log, path)

    def cat_file(self, path, start=None, end=None, **kwargs):
        path = self._strip_protocol(path)
        data = super().cat_file(path, start, end, **kwargs)
        self.log.append(("read", path, start or 0, len(data)))
        return data


fsspec.register_implementation("countmem", CountingMemoryFS, clobber=True)


@pytest.fixture
def memfs():
    fs = fsspec.filesystem("memory")
    root = f"/rs-{random.getrandbits(40):x}"
    yield fs, root
    with contextlib.suppress(FileNotFoundError):
        fs.rm(root, recursive=True)


def _shard_lines(shard, n):
    return [json.dumps({"shard": shard, "i": i}) for i in range(n)]


def test_jsonl_resume_opens_only_the_resume_shard_and_reads_from_its_offset(memfs, tmp_path):
    fs, root = memfs
    for k in range(4):
        fs.pipe(f"{root}/s{k}.jsonl", ("\n".join(_shard_lines(k, 100)) + "\n").encode())
    src = f"countmem://{root}/s*.jsonl"
    state = tmp_path / "s.meta"
    with RecordStream(src, state) as s:
        it = s.batches(30)
        for _ in range(8):  # 240 records: inside shard 2
            batch_id, _ = next(it)
        s.commit(batch_id)
        coord = s.committed_coord
    assert (coord.shard_id, coord.global_row_idx) == (2, 240)
    CountingMemoryFS.log.clear()
    with RecordStream(src, state) as s:
        first = next(s.batches(5))[1]
    assert json.loads(first[0]) == {"shard": 2, "i": 40}
    opens = [e for e in CountingMemoryFS.log if e[0] == "open"]
    reads = [e for e in CountingMemoryFS.log if e[0] == "read"]
    assert set(opens) <= {("open", f"{root}/s2.jsonl")}, "no earlier shard is opened"
    # the first read starts at the checkpoint offset, but for the byte before it (checked to
    # end a line, never a record); nothing else before the offset is read
    assert reads[0][2] == coord.byte_offset - 1, "the first read starts just before the offset"
    assert all(r[1] == f"{root}/s2.jsonl" and r[2] >= coord.byte_offset for r in reads[1:])


def test_txt_resume_locally_counts_opens_and_bytes(tmp_path, monkeypatch):
    for k in range(3):
        write_lines(tmp_path / f"{k}.txt", [f"{k}-{i}" for i in range(1000)])
    state = tmp_path / "s.meta"
    with RecordStream(str(tmp_path / "*.txt"), state) as s:
        for batch_id, _ in s.batches(100):
            if batch_id == 15:  # 1500 records: halfway through shard 1
                s.commit(batch_id)
                break
    offset = s.committed_coord.byte_offset
    opened, read_bytes = [], []
    real_open = Shard.open

    def counting_open(self, **kw):
        opened.append(Path(self.path).name)
        f = real_open(self, **kw)
        real_read = f.read

        def read(n=-1):
            data = real_read(n)
            read_bytes.append(len(data))
            return data

        f.read = read
        return f

    monkeypatch.setattr(Shard, "open", counting_open)
    with RecordStream(str(tmp_path / "*.txt"), state) as s:
        rest = drain(s, 100)
    assert rest[0] == b"1-500"
    assert len(rest) == 1500
    assert opened == ["1.txt", "2.txt"]
    size1 = (tmp_path / "1.txt").stat().st_size
    size2 = (tmp_path / "2.txt").stat().st_size
    # nothing before the offset is read but the byte before it (checked to end a line)
    assert sum(read_bytes) == (size1 - offset + 1) + size2, "nothing before the offset is read"


def test_parquet_resume_opens_row_group_and_skips_rows(memfs, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    fs, root = memfs
    all_rows = []
    pad = random.Random(5)
    for k in range(3):
        # ~80 KiB incompressible row groups, larger than pyarrow's speculative footer read
        rows = [
            {"shard": k, "i": i, "tag": f"t{i % 5}", "pad": pad.randbytes(1000).hex()}
            for i in range(200)
        ]
        all_rows += rows
        buf = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(rows), buf, row_group_size=40, compression="none")
        fs.pipe(f"{root}/p{k}.parquet", buf.getvalue())
    src = f"countmem://{root}/p*.parquet"
    state = tmp_path / "s.meta"
    with RecordStream(src, state) as s:
        out = []
        for batch_id, records in s.batches(7):
            out += records
            if len(out) >= 287:  # shard 1, row group 2, 7 rows into it
                s.commit(batch_id)
                break
    coord = s.committed_coord
    assert (coord.shard_id, coord.row_group_idx, coord.row_offset_in_page) == (1, 2, 7)
    assert coord.global_row_idx == 287
    CountingMemoryFS.log.clear()
    with RecordStream(src, state) as s:
        rest = drain(s, 7)
    assert out[:287] + rest == all_rows
    assert rest[0]["shard"] == 1
    assert rest[0]["i"] == 87
    touched = list(dict.fromkeys(e[1] for e in CountingMemoryFS.log))  # in order, once each
    assert touched == [f"{root}/p1.parquet", f"{root}/p2.parquet"]
    # reads of shard 1 never touch the column chunks of row groups 0 and 1
    meta = pq.ParquetFile(io.BytesIO(fs.cat(f"{root}/p1.parquet"))).metadata

    def chunk(g, c):
        col = meta.row_group(g).column(c)
        start = col.dictionary_page_offset if col.has_dictionary_page else col.data_page_offset
        return start, start + col.total_compressed_size

    columns = range(meta.num_columns)
    earlier_end = max(chunk(g, c)[1] for g in range(2) for c in columns)
    first_needed = min(chunk(2, c)[0] for c in columns)
    assert earlier_end <= first_needed
    for _, path, offset, n in (e for e in CountingMemoryFS.log if e[0] == "read"):
        if path.endswith("p1.parquet"):
            assert offset >= first_needed, (offset, n)


def test_a_resume_past_the_end_of_a_shrunk_shard_is_refused(tmp_path):
    # The checkpoint points past what the shard now holds: the resume moved on to the next
    # shard, as if the rest of this one had been read.
    write_lines(tmp_path / "a.jsonl", [json.dumps({"a": i}) for i in range(10)])
    write_lines(tmp_path / "b.jsonl", [json.dumps({"b": i}) for i in range(3)])
    src, state = str(tmp_path / "*.jsonl"), tmp_path / "s.meta"
    with RecordStream(src, state) as s:
        s.commit(next(s.batches(8))[0])
    write_lines(tmp_path / "a.jsonl", [json.dumps({"a": i}) for i in range(5)])
    before = state.read_bytes()
    with RecordStream(src, state) as s:
        with pytest.raises(SourceError, match=r"a\.jsonl: the checkpoint resumes at byte 72 "
                           r"but the shard is 45 bytes"):
            next(s.batches(3))
    assert state.read_bytes() == before


@pytest.mark.parametrize("suffix", ["jsonl", "txt"])
def test_a_resume_inside_a_line_of_a_shard_rewritten_to_the_same_size_is_refused(
    tmp_path, suffix
):
    # A committed byte offset is 0, just past a "\n", or the shard's end (a last line without
    # one). The shard was rewritten in place, same size, its lines shifted: the resume started
    # inside a line and delivered the fragment '"ii":7}' as a record.
    write_lines(tmp_path / f"a.{suffix}", [json.dumps({"i": i}) for i in range(10)])
    write_lines(tmp_path / f"b.{suffix}", [json.dumps({"b": i}) for i in range(3)])
    src, state = str(tmp_path / f"*.{suffix}"), tmp_path / "s.meta"
    with RecordStream(src, state) as s:
        s.commit(next(s.batches(4))[0])
    offset = s.committed_coord.byte_offset
    assert (s.committed_coord.shard_id, offset) == (0, 36)
    rewritten = [json.dumps({"i": i}) for i in range(10)]
    rewritten[0], rewritten[9] = '{"i":0}', '{"i":  9}'  # one byte less before the offset
    size = (tmp_path / f"a.{suffix}").stat().st_size
    write_lines(tmp_path / f"a.{suffix}", rewritten)
    assert (tmp_path / f"a.{suffix}").stat().st_size == size
    assert (tmp_path / f"a.{suffix}").read_bytes()[offset - 1 : offset + 7] == b'{"i": 4}'
    before = (state.read_bytes(), (tmp_path / "s.meta.dedup").read_bytes())
    with RecordStream(src, state) as s:
        with pytest.raises(SourceError) as err:
            next(s.batches(3))
    assert str(err.value) == (
        f"{tmp_path / f'a.{suffix}'}: the checkpoint resumes at byte 36, which does not start a "
        "line (the byte before it is not a line end: the shard changed; a stream must resume "
        "over the same bytes)"
    )
    assert (state.read_bytes(), (tmp_path / "s.meta.dedup").read_bytes()) == before
    # a resume at the end of a shard whose last line has no "\n" is not inside a line
    write_lines(tmp_path / f"a.{suffix}", ["x", "y\r\n", "", "z"], newline="\r\n",
                final_newline=False)
    with RecordStream(src, tmp_path / "t.meta") as s:
        s.commit(next(s.batches(3))[0])
        assert s.committed_coord.byte_offset == (tmp_path / f"a.{suffix}").stat().st_size
    with RecordStream(src, tmp_path / "t.meta") as s:
        assert drain(s, 2) == [json.dumps({"b": i}).encode() for i in range(3)]


def test_a_resume_past_the_row_groups_of_a_rewritten_parquet_shard_is_refused(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    def shard(name, n, groups):
        rows = pa.Table.from_pylist([{name: i} for i in range(n)])
        pq.write_table(rows, tmp_path / f"{name}.parquet", row_group_size=n // groups)

    shard("a", 40, 4)
    shard("b", 4, 1)
    src, state = str(tmp_path / "*.parquet"), tmp_path / "s.meta"
    with RecordStream(src, state) as s:
        s.commit(next(s.batches(35))[0])
    assert (s.committed_coord.row_group_idx, s.committed_coord.row_offset_in_page) == (3, 5)
    for n, groups, what in ((20, 2, "row group 3 .* has 2 row groups"),
                            (16, 4, "row 5 of row group 3 .* has 4 rows")):
        shard("a", n, groups)
        with RecordStream(src, state) as s:
            with pytest.raises(SourceError, match=r"a\.parquet: the checkpoint resumes at "
                               + what):
                next(s.batches(3))


def test_parquet_dedup_and_types(tmp_path):
    import datetime
    import decimal

    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {"b": b"\x00\x01", "d": datetime.date(2024, 1, 2), "x": decimal.Decimal("1.50"), "f": 1.0},
        {"b": b"\x00\x02", "d": datetime.date(2024, 1, 2), "x": decimal.Decimal("1.50"), "f": 1.0},
    ]
    pq.write_table(pa.Table.from_pylist(rows * 3), tmp_path / "a.parquet", row_group_size=2)
    with RecordStream(str(tmp_path / "a.parquet"), tmp_path / "s.meta") as s:
        assert drain(s, 4) == rows
        assert s.committed_coord.global_row_idx == 2  # trailing duplicates are not yet scanned


def test_memory_url_resume(memfs, tmp_path):
    fs, root = memfs
    for k in range(3):
        fs.pipe(f"{root}/{k}.txt", "\n".join(f"{k}:{i}" for i in range(40)).encode())
    src = [f"memory://{root}/{k}.txt" for k in range(3)]
    state = tmp_path / "s.meta"
    with RecordStream(src, state) as s:
        it = s.batches(11)
        for _ in range(5):
            batch_id, _ = next(it)
        s.commit(batch_id)
    with RecordStream(src, state) as s:
        rest = drain(s, 11)
    assert rest[0] == b"1:15"
    assert len(rest) == 120 - 55


class RangeHandler(http.server.BaseHTTPRequestHandler):
    """Serves files from ``root`` with HEAD and single-range GET; logs (path, range)."""

    root: Path
    log: list

    def _file(self):
        p = self.root / self.path.lstrip("/").split("?")[0]
        return p.read_bytes() if p.is_file() else None

    def do_HEAD(self):
        data = self._file()
        self.log.append(("HEAD", self.path, None))
        if data is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()

    def do_GET(self):
        data = self._file()
        rng = self.headers.get("Range")
        self.log.append(("GET", self.path, rng))
        if data is None:
            self.send_error(404)
            return
        if rng:
            start, _, end = rng.removeprefix("bytes=").partition("-")
            start = int(start)
            end = min(int(end) if end else len(data) - 1, len(data) - 1)
            body = data[start : end + 1]
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        else:
            body = data
            self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def http_root(tmp_path):
    root = tmp_path / "www"
    root.mkdir()
    handler = type("H", (RangeHandler,), {"root": root, "log": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}", handler.log
    server.shutdown()
    server.server_close()
    thread.join()


def test_http_resume_uses_a_range_read_and_skips_earlier_shards(http_root, tmp_path, monkeypatch):
    root, base, log = http_root
    monkeypatch.setattr(readers_mod, "LINE_BLOCK", 4096)  # several range reads per shard
    for k in range(3):
        write_lines(root / f"{k}.jsonl", _shard_lines(k, 300))
    urls = [f"{base}/{k}.jsonl" for k in range(3)]
    state = tmp_path / "s.meta"
    with RecordStream(urls, state) as s:
        it = s.batches(50)
        for _ in range(9):  # 450 records: shard 1, record 150
            batch_id, _ = next(it)
        s.commit(batch_id)
        coord = s.committed_coord
    assert (coord.shard_id, coord.global_row_idx) == (1, 450)
    log.clear()
    with RecordStream(urls, state) as s:
        rest = drain(s, 50)
    assert json.loads(rest[0]) == {"shard": 1, "i": 150}
    assert len(rest) == 450
    assert not [e for e in log if e[1] == "/0.jsonl"], "shard 0 is never requested"
    gets = [e for e in log if e[0] == "GET" and e[1] == "/1.jsonl"]
    assert gets[0][2].startswith(f"bytes={coord.byte_offset - 1}-")  # and the byte before it
    assert all(int(g[2][6:].split("-")[0]) >= coord.byte_offset for g in gets[1:])
    assert all(g[2] is not None for g in gets), "every GET is a range read"


# ---------------------------------------------------------------------------------------------
# exactly-once delivery


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.lists(st.sampled_from("abcdefghi") | st.just("") | st.text("xyz", max_size=3), max_size=25),
        min_size=1,
        max_size=4,
    ),
    st.integers(1, 6),
    st.integers(0, 3),
    st.randoms(use_true_random=False),
)
def test_exactly_once_across_simulated_crashes(shards, batch_size, lag, rnd):
    """Consumers that prefetch ``lag`` batches ahead of their commits and crash at random
    points (the object is dropped, uncommitted batches are lost) together deliver every unique
    record exactly once, in order."""
    with tempfile.TemporaryDirectory() as d:
        for k, lines in enumerate(shards):
            write_lines(Path(d) / f"{k:02}.txt", lines, final_newline=rnd.random() < 0.5)
        src = str(Path(d) / "*.txt")
        state = Path(d) / "s.meta"
        expected = unique_in_order([line.encode() for lines in shards for line in lines if line])
        delivered = []
        for attempt in range(12):
            s = RecordStream(src, state)
            held = []
            crashed = False
            for batch_id, records in s.batches(batch_size):
                held.append((batch_id, records))
                if len(held) > lag:
                    b, recs = held.pop(0)
                    s.commit(b)
                    delivered += recs
                if attempt < 10 and rnd.random() < 0.2:  # the last runs finish
                    crashed = True
                    break
            if not crashed:
                for b, recs in held:
                    s.commit(b)
                    delivered += recs
            s.close()
            if not crashed:
                break
        assert delivered == expected


CONSUMER = textwrap.dedent(
    """
    import os, sys, time
    from faultfs.stream import RecordStream
    src, state, log = sys.argv[1], sys.argv[2], sys.argv[3]
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    s = RecordStream(src, state)
    held = []
    for batch_id, records in s.batches(37):
        os.write(fd, b"".join(b"%d\\t%s\\n" % (batch_id, r) for r in records))
        held.append(batch_id)
        if len(held) > 2:            # prefetch: commit two batches behind
            s.commit(held.pop(0))
        time.sleep(0.002)  # slow enough to be killed mid-stream
    for b in held:
        s.commit(b)
    s.close()
    os.write(fd, b"DONE\\n")
    """
)


@pytest.mark.slow
def test_exactly_once_across_kill_9_of_a_consumer(tmp_path):
    rng = random.Random(20240607)
    all_records = []
    for k in range(4):
        lines = [f"r{rng.randrange(60000)}" for _ in range(12000)]
        all_records += lines
        write_lines(tmp_path / f"{k}.jsonl", lines)
    expected = unique_in_order([r.encode() for r in all_records])
    src, state = str(tmp_path / "*.jsonl"), tmp_path / "s.meta"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    committed_records = []
    previous = 0
    kills = 0
    for run in range(12):
        log = tmp_path / f"run{run}.log"
        proc = subprocess.Popen([PYTHON, "-c", CONSUMER, src, str(state), str(log)], env=env)
        finished = False
        if run < 4:
            deadline = time.monotonic() + 30
            while not (log.exists() and log.stat().st_size) and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(rng.uniform(0.05, 0.4))
            proc.send_signal(signal.SIGKILL)
            if proc.wait(timeout=30) == -signal.SIGKILL:
                kills += 1
        else:
            assert proc.wait(timeout=60) == 0
            finished = True
        with DualMetadataManager.open(state) as m:
            committed = m.committed_batch_id
        lines = log.read_bytes().splitlines() if log.exists() else []
        finished = finished or (lines[-1:] == [b"DONE"])
        for line in lines:
            if line == b"DONE":
                continue
            batch_id, _, record = line.partition(b"\t")
            if previous < int(batch_id) <= committed:
                committed_records.append(record)
        previous = committed
        if finished:
            break
    assert kills >= 3, "the consumer was killed mid-stream several times"
    assert len(committed_records) == len(set(committed_records)), "no record twice"
    assert committed_records == expected, "every unique record exactly once, in order"


def test_the_compiled_cut_takes_only_native_int64_bounds_inside_the_data():
    """``_cut.cut``: wrong dtypes or shapes are a TypeError (never read as int64), bounds
    outside the data a ValueError; unaligned bounds and any bytes-like data work, and the
    records are bytes of their own."""
    if readers_mod._cut is None:
        pytest.skip("faultfs.stream._cut is not built (no C compiler at install)")
    cut = readers_mod._cut
    data = bytearray(b"hello world")
    assert cut(data, np.array([0, 6]), np.array([5, 11])) == [b"hello", b"world"]
    raw = np.zeros(17, dtype=np.uint8)
    unaligned = raw[1:17].view(np.int64)
    unaligned[:] = [0, 6]
    got = cut(memoryview(bytes(data)), unaligned, np.array([5, 11], dtype=np.int64))
    data[0:5] = b"HELLO"
    assert got == [b"hello", b"world"] and all(type(r) is bytes for r in got)
    for bad in (np.array([0, 0], dtype=np.int32), np.zeros(8, dtype=np.uint8),
                np.array([0], dtype=">i8"), np.zeros((1, 1), dtype=np.int64)):
        with pytest.raises(TypeError):
            cut(data, bad, bad)
    for lo, hi in ((-1, 2), (3, 2), (0, 12), (0, 1 << 62)):
        with pytest.raises(ValueError):
            cut(data, np.array([lo]), np.array([hi]))
    with pytest.raises(ValueError):
        cut(data, np.array([0, 1]), np.array([1]))
    assert cut(b"", np.array([], dtype=np.int64), np.array([], dtype=np.int64)) == []
