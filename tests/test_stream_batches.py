"""Parsed record batches (RecordStream.batches(format="arrow"/"pydict")): a parsed batch is the
per-record parse of the raw batch, with the same ids and coordinates; commits and resume at
every batch boundary are exact, also across formats; dedup by the record's bytes across
batches, blocks and shards; malformed records raise an error naming the shard and the byte
offset and never drop or shift rows; txt and parquet; a memory:// shard. Also the block-wise
dedup structures (DeliveredHashes, first_occurrences) against plain models."""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from faultfs.errors import InvalidInput
from faultfs.stream import RecordParseError, RecordStream, hashing
from faultfs.stream import readers as readers_mod
from faultfs.stream.delivered import DeliveredHashes, first_occurrences
from faultfs.stream.fresh import block_firsts
from faultfs.stream.shards import expand_shards


def write(path, text: bytes | str):
    Path(path).write_bytes(text.encode() if isinstance(text, str) else text)


def jsonl(records, newline="\n"):
    return "".join(json.dumps(r) + newline for r in records)


def drain(stream, batch_size, fmt="raw", *, commit=True, **kw):
    out = []
    for batch_id, batch in stream.batches(batch_size, format=fmt, **kw):
        out.append((batch_id, batch, stream.position))
        if commit:
            stream.commit(batch_id)
    return out


def rows(batches):
    return [row for _, table, _ in batches for row in table.to_pylist()]


def unique_in_order(items):
    seen, out = set(), []
    for item in items:
        if item not in seen:
            seen.add(item)
            out.append(item)
    return out


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of ~200 bytes: every shard spans many blocks and batches straddle them."""
    monkeypatch.setattr(readers_mod, "LINE_BLOCK", 200)


def corpus(n, seed=1, dup_every=4):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i and i % dup_every == 0:
            out.append(out[rng.randrange(len(out))])  # an exact repeat: same bytes
        else:
            out.append({"id": i, "text": "t" * rng.randrange(12), "f": i / 2, "ok": i % 3 == 0})
    return out


# ---------------------------------------------------------------------------------------------
# parsed batches are the per-record parse, with the same ids and coordinates


@pytest.mark.parametrize("dedup", [False, True])
@pytest.mark.parametrize("batch_size", [1, 7, 64, 1000])
def test_arrow_batches_equal_the_per_record_parse(tmp_path, small_blocks, dedup, batch_size):
    recs = corpus(300)
    write(tmp_path / "a.jsonl", jsonl(recs[:120]))
    write(tmp_path / "b.jsonl", "\n" + jsonl(recs[120:250], "\r\n") + "\r\n\n")  # blank lines
    write(tmp_path / "c.jsonl", jsonl(recs[250:]).rstrip("\n"))  # no final newline
    src = str(tmp_path / "*.jsonl")
    with RecordStream(src, tmp_path / "raw.meta", dedup=dedup) as s:
        raw = drain(s, batch_size)
    with RecordStream(src, tmp_path / "arrow.meta", dedup=dedup) as s:
        parsed = drain(s, batch_size, "arrow")
    assert [(b, c) for b, _, c in parsed] == [(b, c) for b, _, c in raw]
    for (_, records, _), (_, table, _) in zip(raw, parsed, strict=True):
        assert isinstance(table, pa.Table)
        assert table.to_pylist() == [json.loads(r) for r in records]
    expected = unique_in_order([json.dumps(r) for r in recs]) if dedup else None
    if dedup:
        assert [json.dumps(r) for r in rows(parsed)] == expected
    else:
        assert rows(parsed) == recs


@pytest.mark.parametrize("dedup", [False, True])
def test_formats_switched_between_batches_keep_the_order(tmp_path, small_blocks, dedup):
    """Blocks read and parsed ahead, then asked for in another format (or schema), still
    come in order, none skipped or repeated, across shards."""
    recs = corpus(400, seed=3)
    write(tmp_path / "a.jsonl", jsonl(recs[:150]))
    write(tmp_path / "b.jsonl", jsonl(recs[150:]))
    src = str(tmp_path / "*.jsonl")
    with RecordStream(src, tmp_path / "raw.meta", dedup=dedup) as s:
        want = [json.loads(r) for _, batch, _ in drain(s, 9) for r in batch]
    schema = pa.schema([("id", pa.int64()), ("text", pa.string())])
    got = []
    with RecordStream(src, tmp_path / "mixed.meta", dedup=dedup) as s:
        for k in range(10_000):
            fmt, kw = [("arrow", {}), ("raw", {}), ("arrow", {"schema": schema}),
                       ("pydict", {})][k % 4]
            batch = next(s.batches(9 + k % 5, format=fmt, **kw), None)
            if batch is None:
                break
            batch_id, records = batch
            if fmt == "raw":
                got += [json.loads(r) for r in records]
            elif fmt == "pydict":
                got += [dict(zip(records, row, strict=True)) for row in zip(*records.values(),
                                                                              strict=True)]
            else:
                got += [{key: r[key] for key in r} for r in records.to_pylist()]
            s.commit(batch_id)
    assert [r["id"] for r in got] == [r["id"] for r in want]


def test_closing_with_blocks_read_ahead_stops_the_workers(tmp_path, small_blocks):
    write(tmp_path / "a.jsonl", jsonl(corpus(300)))
    s = RecordStream(str(tmp_path / "a.jsonl"), tmp_path / "s.meta", dedup=False)
    it = s.batches(4, format="arrow")
    batch_id, _ = next(it)
    assert not s._ahead, "the first block is handed out before any read-ahead starts"
    taken = 4
    while not s._ahead:
        s.commit(batch_id)
        batch_id, _ = next(it)
        taken += 4
    s.commit(batch_id)
    assert len(s._ahead) == 2, "two blocks are read and parsed ahead"
    s.close()
    assert not s._ahead and s._ahead._pool is None and s._reader is None
    assert not [t for t in threading.enumerate() if t.name.startswith("faultfs-stream")]
    with RecordStream(str(tmp_path / "a.jsonl"), tmp_path / "s.meta", dedup=False) as s:
        rest = rows(drain(s, 50, "arrow"))
    assert [r["id"] for r in rest] == [r["id"] for r in corpus(300)][taken:]


@pytest.mark.parametrize(("fmt", "fails"), [("raw", "read"), ("arrow", "read"),
                                            ("arrow", "parse")])
def test_a_failed_read_ahead_ends_the_stream_at_its_block(tmp_path, monkeypatch, small_blocks,
                                                         fmt, fails):
    """A read or parse that fails in a read-ahead worker (dedup on: the workers also decide
    their blocks in turn) is raised when the stream reaches that block: every record before it
    comes out once, in order; the worker after it does not wait for a decision that never
    comes; close returns and a reopened stream resumes from the last commit."""
    recs = corpus(300, seed=5)
    lines = [json.dumps(r) for r in recs]
    if fails == "parse":
        lines[150] = '{"id": 150, "text": oops}'
    write(tmp_path / "a.jsonl", "".join(line + "\n" for line in lines))
    want = unique_in_order(lines)
    real_read = readers_mod.LineShardReader._read
    calls = {"n": 0}

    def failing_read(reader):
        calls["n"] += 1
        if calls["n"] == 9 and fails == "read":
            raise OSError(5, "Input/output error")
        return real_read(reader)

    monkeypatch.setattr(readers_mod.LineShardReader, "_read", failing_read)
    got: list = []

    def consume(stream):
        for batch_id, batch in stream.batches(3, format=fmt):
            got.extend([r.decode() for r in batch] if fmt == "raw" else
                       [json.dumps(r) for r in batch.to_pylist()])
            stream.commit(batch_id)

    s = RecordStream(str(tmp_path / "a.jsonl"), tmp_path / "s.meta")
    with pytest.raises(OSError if fails == "read" else RecordParseError):
        consume(s)
    assert got and got == want[: len(got)]
    s.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("faultfs-stream")]
    monkeypatch.setattr(readers_mod.LineShardReader, "_read", real_read)
    with RecordStream(str(tmp_path / "a.jsonl"), tmp_path / "s.meta") as s:
        rest = [r.decode() for _, b in s.batches(50) for r in b]
    assert got + rest == want


def test_the_first_parsed_batch_with_dedup_imports_no_pandas(tmp_path):
    """Keeping a block's fresh rows hands pyarrow the row numbers as an Arrow array: given a
    numpy array, pyarrow imports pandas where it is installed (~0.3 s in the middle of a
    restart's first batch)."""
    pytest.importorskip("pandas", reason="pyarrow imports pandas only where it is installed")
    recs = corpus(300, seed=2, dup_every=2)
    write(tmp_path / "a.jsonl", jsonl(recs))
    code = textwrap.dedent(f"""
        import sys
        from faultfs.stream import RecordStream
        with RecordStream({str(tmp_path / "a.jsonl")!r}, {str(tmp_path / "s.meta")!r}) as s:
            batch_id, table = next(s.batches(64, format="arrow"))
            assert table.num_rows == 64 and table.column("id").to_pylist()[:2] == [0, 1]
        print("pandas" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.split() == ["False"]


def test_pydict_batches_are_the_arrow_table_as_columns(tmp_path):
    recs = corpus(50)
    write(tmp_path / "a.jsonl", jsonl(recs))
    with RecordStream(str(tmp_path / "a.jsonl"), tmp_path / "a.meta") as s:
        tables = drain(s, 16, "arrow")
    with RecordStream(str(tmp_path / "a.jsonl"), tmp_path / "d.meta") as s:
        dicts = drain(s, 16, "pydict")
    assert [d for _, d, _ in dicts] == [t.to_pydict() for _, t, _ in tables]
    assert set(dicts[0][1]) == {"id", "text", "f", "ok"}


def test_unusual_but_valid_lines_take_the_exact_path(tmp_path, small_blocks):
    lines = [
        '\ufeff{"a": 1}',  # a BOM opening the shard
        '   {"a": 2}',  # leading blanks
        '{"a": 3}   ',  # trailing blanks
        '{"a": 4, "s": "} {"}',  # braces inside a string
        "{}",
        '{"a": 5}',
    ]
    write(tmp_path / "a.jsonl", "\n".join(lines) + "\n")
    with RecordStream(str(tmp_path / "a.jsonl"), tmp_path / "s.meta") as s:
        got = rows(drain(s, 4, "arrow"))
    expected = [json.loads(line.encode()) for line in lines]
    assert [{k: v for k, v in r.items() if v is not None} for r in got] == expected


def test_records_that_are_all_empty_objects(tmp_path):
    write(tmp_path / "a.jsonl", "{}\n{}\n {}\n")
    with RecordStream(str(tmp_path / "a.jsonl"), tmp_path / "s.meta", dedup=False) as s:
        (_, table, _), = drain(s, 10, "arrow")
    assert table.num_rows == 3


def test_columns_that_differ_between_blocks_are_unified_by_name(tmp_path, small_blocks):
    recs = [{"a": None, "b": "x"}] * 12 + [{"a": i, "c": [i]} for i in range(1, 30)]
    write(tmp_path / "a.jsonl", jsonl(recs))
    with RecordStream(str(tmp_path / "a.jsonl"), tmp_path / "s.meta", dedup=False) as s:
        batches = drain(s, 1000, "arrow")
    assert len(batches) == 1
    table = batches[0][1]
    assert table.schema.field("a").type == pa.int64()
    assert table.to_pylist() == [{"a": r.get("a"), "b": r.get("b"), "c": r.get("c")} for r in recs]


def test_a_type_clash_between_blocks_asks_for_a_schema(tmp_path, small_blocks):
    recs = [{"a": i} for i in range(20)] + [{"a": f"s{i}"} for i in range(20)]
    write(tmp_path / "a.jsonl", jsonl(recs))
    with RecordStream(str(tmp_path / "a.jsonl"), tmp_path / "s.meta") as s:
        with pytest.raises(InvalidInput, match="pass schema="):
            drain(s, 1000, "arrow")
    schema = pa.schema([("a", pa.string())])
    with RecordStream(str(tmp_path / "a.jsonl"), tmp_path / "t.meta") as s:
        with pytest.raises(RecordParseError):  # a JSON number is not a string column
            drain(s, 1000, "arrow", schema=schema)
    write(tmp_path / "b.jsonl", jsonl([{"a": str(i), "x": i} for i in range(20)] + [{"b": 1}]))
    with RecordStream(str(tmp_path / "b.jsonl"), tmp_path / "u.meta") as s:
        got = rows(drain(s, 1000, "arrow", schema=schema))
    assert got == [{"a": str(i)} for i in range(20)] + [{"a": None}]


def test_format_and_schema_arguments_are_checked(tmp_path):
    write(tmp_path / "a.jsonl", '{"a":1}\n')
    with RecordStream(str(tmp_path / "a.jsonl"), tmp_path / "s.meta") as s:
        with pytest.raises(InvalidInput, match="format must be one of raw, arrow, pydict"):
            next(s.batches(1, format="pandas"))
        with pytest.raises(InvalidInput, match="schema= applies to parsed batches"):
            next(s.batches(1, schema=pa.schema([("a", pa.int64())])))


# ---------------------------------------------------------------------------------------------
# commits and resume at every batch boundary


@pytest.mark.parametrize("dedup", [False, True])
def test_resume_at_every_batch_boundary_is_exact(tmp_path, small_blocks, dedup):
    recs = corpus(90, seed=3)
    for k in range(3):
        write(tmp_path / f"{k}.jsonl", jsonl(recs[k * 30 : (k + 1) * 30]))
    src = str(tmp_path / "*.jsonl")
    with RecordStream(src, tmp_path / "full.meta", dedup=dedup) as s:
        full = drain(s, 8, "arrow")
    expected = rows(full)
    for k in range(1, len(full) + 1):
        state = tmp_path / f"k{k}.meta"
        with RecordStream(src, state, dedup=dedup) as s:
            head = []
            for batch_id, table in s.batches(8, format="arrow"):
                head += table.to_pylist()
                if batch_id == k:
                    s.commit(batch_id)
                    assert s.committed_coord == full[k - 1][2]
                    break
        with RecordStream(src, state, dedup=dedup) as s:
            rest = drain(s, 8, "arrow")
        assert head + rows(rest) == expected, k
        assert [b for b, _, _ in rest] == [b for b, _, _ in full[k:]]


def test_a_checkpoint_resumes_in_any_format(tmp_path, small_blocks):
    recs = corpus(60, seed=4)
    write(tmp_path / "a.jsonl", jsonl(recs))
    src = str(tmp_path / "a.jsonl")
    with RecordStream(src, tmp_path / "s.meta") as s:
        it = s.batches(9)
        for _ in range(3):
            batch_id, _ = next(it)
            s.commit(batch_id)
    with RecordStream(src, tmp_path / "s.meta") as s:
        it = s.batches(9, format="arrow")
        batch_id, table = next(it)
        s.commit(batch_id)  # switch formats between batches of one stream, mid-block
        batch_id, raw = next(s.batches(9))
        s.commit(batch_id)
        rest = [r for _, t in s.batches(9, format="pydict") for r in zip(*t.values(), strict=True)]
    with RecordStream(src, tmp_path / "all.meta") as s:
        everything = [json.loads(r) for _, b in s.batches(100) for r in b]
    keys = list(everything[0])
    got = table.to_pylist() + [json.loads(r) for r in raw] + [dict(zip(keys, r, strict=True)) for r in rest]
    assert got == everything[27:]


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 12), max_size=30), min_size=1, max_size=3),
    st.integers(1, 5),
    st.integers(0, 2),
    st.randoms(use_true_random=False),
)
def test_exactly_once_in_parsed_batches_across_crashes(shards, batch_size, lag, rnd):
    """Consumers reading parsed batches, prefetching ``lag`` batches and crashing at random
    points, deliver every unique record exactly once, in order, across formats."""
    with tempfile.TemporaryDirectory() as d:
        readers_mod_block = readers_mod.LINE_BLOCK
        readers_mod.LINE_BLOCK = 64
        try:
            for k, values in enumerate(shards):
                write(Path(d) / f"{k}.jsonl", "".join(f'{{"v":{v}}}\n' for v in values))
            src, state = str(Path(d) / "*.jsonl"), Path(d) / "s.meta"
            expected = unique_in_order([v for values in shards for v in values])
            delivered = []
            for attempt in range(12):
                fmt = rnd.choice(["arrow", "pydict", "raw"])
                s = RecordStream(src, state)
                held, crashed = [], False
                for batch_id, batch in s.batches(batch_size, format=fmt):
                    if fmt == "arrow":
                        values = batch.column("v").to_pylist()
                    elif fmt == "pydict":
                        values = batch["v"]
                    else:
                        values = [json.loads(r)["v"] for r in batch]
                    held.append((batch_id, values))
                    if len(held) > lag:
                        b, vs = held.pop(0)
                        s.commit(b)
                        delivered += vs
                    if attempt < 10 and rnd.random() < 0.25:
                        crashed = True
                        break
                if not crashed:
                    for b, vs in held:
                        s.commit(b)
                        delivered += vs
                s.close()
                if not crashed:
                    break
            assert delivered == expected
        finally:
            readers_mod.LINE_BLOCK = readers_mod_block


# ---------------------------------------------------------------------------------------------
# malformed records: a clear error naming shard and offset, never a dropped or shifted row


BAD_LINES = [
    ('{"a": 1', "is not valid JSON"),
    ('{"a": 1} {"a": 2}', "is not valid JSON"),  # two values on one line
    ('{"a": 1}{"a": 2}', "is not valid JSON"),
    ("   ", "is not valid JSON"),  # blank but not empty: a record that is not JSON
    ("[1, 2]", "is a JSON array, not an object"),
    ("3", "is a JSON number, not an object"),
    ("null", "is a JSON null, not an object"),
    ('{"a": "x"}', "cannot be a row"),  # a type clash with the records before it
    ('{"a": 1, "a": 2}', "cannot be a row"),  # a key twice
]


def consume_values(stream, got):
    for batch_id, table in stream.batches(5, format="arrow"):
        got += table.column("a").to_pylist()
        stream.commit(batch_id)


@pytest.mark.parametrize(("bad", "message"), BAD_LINES)
@pytest.mark.parametrize("where", [0, 17, 39])
def test_a_malformed_record_names_shard_and_offset(tmp_path, monkeypatch, bad, message, where):
    if '"x"' in bad:
        where = max(where, 17)  # a type clash needs records before it, in its own block
    else:
        monkeypatch.setattr(readers_mod, "LINE_BLOCK", 200)  # many blocks per shard
    lines = [json.dumps({"a": i}) for i in range(40)]
    lines[where] = bad
    text = "\n".join(lines) + "\n"
    write(tmp_path / "0.jsonl", jsonl([{"a": -1}]))
    write(tmp_path / "1.jsonl", text)
    offset = len("\n".join(lines[:where])) + (1 if where else 0)
    src = str(tmp_path / "*.jsonl")
    with RecordStream(src, tmp_path / "s.meta", dedup=False) as s:
        got: list = []
        with pytest.raises(RecordParseError, match=message) as info:
            consume_values(s, got)
        err = info.value
        assert err.shard.endswith("1.jsonl")
        assert f"1.jsonl: the record at byte offset {offset} (global_row_idx {where + 1})" in str(err)
        assert err.global_row_idx == where + 1
        assert got == [-1, *range(40)][: len(got)], "rows before the bad one are all there, in order"
        assert len(got) <= where + 1
        with pytest.raises(InvalidInput, match="this stream failed earlier"):
            next(s.batches(5, format="arrow"))
        committed = s.committed_coord
    # raw batches of the same shard are unaffected; a resume starts at the last commit
    with RecordStream(src, tmp_path / "s.meta", dedup=False) as s:
        assert s.resumed_from == committed
        raw = [r for _, b in s.batches(100) for r in b]
    assert len(raw) == 41 - committed.global_row_idx
    assert raw[where + 1 - committed.global_row_idx] == bad.encode()


def test_a_multi_line_object_is_refused_not_merged(tmp_path):
    write(tmp_path / "a.jsonl", '{"a": 0}\n{"a":\n 1}\n{"a": 2}\n')
    with RecordStream(str(tmp_path / "a.jsonl"), tmp_path / "s.meta") as s:
        with pytest.raises(RecordParseError, match=r"byte offset 9 \(global_row_idx 1\)"):
            drain(s, 10, "arrow")


def test_miscounted_rows_never_shift_records(tmp_path):
    """A line with two objects and a line of two halves of one give the right row count in
    total; the fast path's checks refuse it and the exact path names the first bad line."""
    text = '{"a": 0}\n{"a": 1}{"a": 2}\n{"a":\n3}\n{"a": 4}\n'
    write(tmp_path / "a.jsonl", text)
    import pyarrow.json as paj

    assert paj.read_json(pa.BufferReader(text.encode())).num_rows == 5  # 5 lines, 5 rows: shifted
    with RecordStream(str(tmp_path / "a.jsonl"), tmp_path / "s.meta") as s:
        with pytest.raises(RecordParseError, match=r"byte offset 9 \(global_row_idx 1\)"):
            drain(s, 10, "arrow")


def test_invalid_utf8_in_a_txt_shard(tmp_path):
    write(tmp_path / "a.txt", b"fine\nalso fine\nbad \xff here\n")
    with RecordStream(str(tmp_path / "a.txt"), tmp_path / "s.meta") as s:
        with pytest.raises(RecordParseError, match=r"byte offset 15 \(global_row_idx 2\) is not UTF-8"):
            drain(s, 10, "arrow")
    with RecordStream(str(tmp_path / "a.txt"), tmp_path / "t.meta") as s:
        assert [r for _, b, _ in drain(s, 10) for r in b][2] == b"bad \xff here"


# ---------------------------------------------------------------------------------------------
# txt and parquet


@pytest.mark.parametrize("dedup", [False, True])
def test_txt_parsed_batches_are_one_text_column(tmp_path, small_blocks, dedup):
    lines = [f"line {i % 17} ünïcode" for i in range(60)] + ["", "last\r"]
    write(tmp_path / "a.txt", "\r\n".join(lines))
    with RecordStream(str(tmp_path / "a.txt"), tmp_path / "r.meta", dedup=dedup) as s:
        raw = drain(s, 7)
    with RecordStream(str(tmp_path / "a.txt"), tmp_path / "a.meta", dedup=dedup) as s:
        parsed = drain(s, 7, "arrow")
    assert [(b, c) for b, _, c in parsed] == [(b, c) for b, _, c in raw]
    for (_, records, _), (_, table, _) in zip(raw, parsed, strict=True):
        assert table.schema == pa.schema([("text", pa.string())])
        assert table.column("text").to_pylist() == [r.decode() for r in records]
    texts = [r["text"] for r in rows(parsed)]
    kept = [line for line in lines if line] if not dedup else unique_in_order(
        [line for line in lines if line])
    assert texts == [t.removesuffix("\r") for t in kept]


def write_parquet(path, recs, row_group_size):
    pq.write_table(pa.Table.from_pylist(recs), path, row_group_size=row_group_size)


@pytest.mark.parametrize("dedup", [False, True])
def test_parquet_parsed_batches_and_resume(tmp_path, monkeypatch, dedup):
    monkeypatch.setattr(readers_mod, "PARQUET_BLOCK_ROWS", 8)  # row groups span blocks
    recs = corpus(100, seed=5)
    write_parquet(tmp_path / "a.parquet", recs[:60], 25)
    write_parquet(tmp_path / "b.parquet", recs[60:], 13)
    src = str(tmp_path / "*.parquet")
    with RecordStream(src, tmp_path / "r.meta", dedup=dedup) as s:
        raw = drain(s, 6)
    with RecordStream(src, tmp_path / "a.meta", dedup=dedup) as s:
        parsed = drain(s, 6, "arrow")
    assert [(b, c) for b, _, c in parsed] == [(b, c) for b, _, c in raw]
    for (_, records, _), (_, table, _) in zip(raw, parsed, strict=True):
        assert table.to_pylist() == records
    for k in (1, 5, len(parsed) - 1):
        state = tmp_path / f"k{k}.meta"
        with RecordStream(src, state, dedup=dedup) as s:
            for batch_id, _ in s.batches(6, format="arrow"):
                if batch_id == k:
                    s.commit(batch_id)
                    break
        with RecordStream(src, state, dedup=dedup) as s:
            rest = drain(s, 6, "arrow")
        assert rows(rest) == rows(parsed[k:])


def test_parquet_schema_selects_and_casts_columns(tmp_path):
    write_parquet(tmp_path / "a.parquet", [{"id": i, "x": str(i)} for i in range(5)], 2)
    schema = pa.schema([("id", pa.float64()), ("missing", pa.string())])
    with RecordStream(str(tmp_path / "a.parquet"), tmp_path / "s.meta") as s:
        got = rows(drain(s, 3, "arrow", schema=schema))
    assert got == [{"id": float(i), "missing": None} for i in range(5)]


# ---------------------------------------------------------------------------------------------
# a shard on memory://, as the other stream tests


@pytest.fixture
def memfs():
    fs = fsspec.filesystem("memory")
    root = f"/rsb-{random.getrandbits(40):x}"
    yield fs, root
    with contextlib.suppress(FileNotFoundError):
        fs.rm(root, recursive=True)


def test_memory_shards_parsed_batches_and_resume(memfs, tmp_path, small_blocks):
    fs, root = memfs
    recs = corpus(80, seed=6)
    fs.pipe(f"{root}/0.jsonl", jsonl(recs[:40]).encode())
    fs.pipe(f"{root}/1.jsonl", jsonl(recs[40:]).encode())
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist([{"id": 1000 + i} for i in range(10)]), buf, row_group_size=4)
    fs.pipe(f"{root}/2.parquet", buf.getvalue())
    src = [f"memory://{root}/*.jsonl", f"memory://{root}/2.parquet"]
    with RecordStream(src, tmp_path / "full.meta", dedup=False) as s:
        full = drain(s, 9, "arrow")
    expected = recs + [{"id": 1000 + i} for i in range(10)]
    got = rows(full)
    assert [r["id"] for r in got] == [r["id"] for r in expected]
    assert got[:80] == recs
    state = tmp_path / "s.meta"
    with RecordStream(src, state, dedup=False) as s:
        it = s.batches(9, format="arrow")
        for _ in range(5):
            batch_id, _ = next(it)
        s.commit(batch_id)
        assert s.committed_coord.shard_id == 1
    with RecordStream(src, state, dedup=False) as s:
        rest = drain(s, 9, "arrow")
    assert rows(rest) == rows(full[5:])


# ---------------------------------------------------------------------------------------------
# the block-wise dedup structures against plain models


def need_bulk():
    """The loaded bulk hash path (polars, polars-hash), or a skip that says what is missing."""
    bulk = hashing._load_bulk()
    if not bulk:
        pytest.skip("the bulk record hashes need the stream extra: pip install "
                    "'faultfs[stream]' (polars, polars-hash)")
    return bulk


@pytest.fixture(params=["bulk", "per-record"])
def hash_path(request, monkeypatch):
    """Both ways to a block's record hashes: polars-hash over Arrow views, and one
    python-xxhash call per record (where the stream extra is not installed)."""
    if request.param == "bulk":
        need_bulk()
    else:
        monkeypatch.setattr(hashing, "_bulk", False)
    return request.param


def test_block_hashes_are_the_xxh3_64_of_each_record(tmp_path, small_blocks, hash_path):
    """The hashes dedup decides by (and the WAL keeps) are xxh3_64 of each record's bytes,
    whatever way they are computed in bulk: short records (held inside an Arrow view), long
    ones, bytes that are not UTF-8, "\r\n" line ends, a last line without a terminator."""
    lines = ([b'{"k": %d}' % i for i in range(50)] + [b"\xff\xfe", b"x" * 300, b'{"k": 0}']
             + [b"a" * n for n in range(1, 15)])
    write(tmp_path / "a.jsonl", b"\n".join(lines[:30]) + b"\n\n" + b"\r\n".join(lines[30:]))
    shard = expand_shards(str(tmp_path / "a.jsonl"), None)[0]
    reader = readers_mod.LineShardReader(shard, 0, 0, 0)
    seen = []
    while (block := reader.next_block()) is not None:
        hashes, unique, first = block_firsts(block)
        assert hashes.dtype == np.uint64
        assert hashes.tolist() == [xxhash.xxh3_64_intdigest(r) for r in block.records]
        assert unique.tolist() == sorted(set(hashes.tolist()))
        assert [hashes[i] for i in first] == list(unique)
        seen += block.records
    reader.close()
    assert seen == lines


def _records_of(min_size: int, max_size: int) -> st.SearchStrategy[list[bytes]]:
    return st.lists(st.binary(min_size=min_size, max_size=max_size)
                    .filter(lambda b: b"\n" not in b), min_size=1, max_size=80)


@settings(max_examples=80, deadline=None)
@given(st.one_of(_records_of(1, 40), _records_of(13, 60), _records_of(1, 12)))
def test_bulk_hashes_are_per_record_hashes(records):
    """Mixed lengths, and blocks whose records are all held in their views (up to 12
    bytes) or none of them (the paths without the other kind); the views they are hashed
    through are a valid Arrow array of exactly the records."""
    bulk = need_bulk()
    data = b"\n".join(records) + b"\n"
    stops = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == 10)
    starts = np.concatenate(([0], stops[:-1] + 1))
    views = hashing.binary_views(bulk[0], data, starts, stops)
    views.validate(full=True)
    assert views.to_pylist() == records
    got = hashing.bulk_hashes(bulk, data, starts, stops)
    assert got.tolist() == hashing.per_record_hashes(records).tolist()
    assert got.tolist() == [xxhash.xxh3_64_intdigest(r) for r in records]


def test_a_forked_child_of_a_polars_process_hashes_per_record(tmp_path):
    """polars' thread pool does not survive a fork (a DataLoader worker): a child forked after
    polars was loaded takes the per-record path, and its hashes are the same."""
    need_bulk()
    recs = [b'{"n": %d}' % i for i in range(500)]
    write(tmp_path / "a.jsonl", b"\n".join(recs) + b"\n")
    shard = expand_shards(str(tmp_path / "a.jsonl"), None)[0]
    reader = readers_mod.LineShardReader(shard, 0, 0, 0)
    block = reader.next_block()
    reader.close()
    want = [xxhash.xxh3_64_intdigest(r) for r in block.records]
    assert hashing.record_hashes(block).tolist() == want  # the parent, in bulk
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running the parent's cleanups
        ok = hashing._bulk is False and hashing.record_hashes(block).tolist() == want
        os.write(write_end, b"ok" if ok else b"no")
        os._exit(0)
    os.close(write_end)
    try:
        assert os.read(read_end, 2) == b"ok"
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)
    assert hashing._bulk  # the parent keeps its bulk path


def test_dedup_streams_agree_on_both_hash_paths(tmp_path, small_blocks, hash_path):
    """A stream with dedup delivers the same records, and commits the same WAL, either way."""
    recs = corpus(400, seed=11, dup_every=3)
    write(tmp_path / "a.jsonl", jsonl(recs[:200]))
    write(tmp_path / "b.jsonl", jsonl(recs[200:]))
    with RecordStream(str(tmp_path / "*.jsonl"), tmp_path / "s.meta") as s:
        got = [r for _, batch, _ in drain(s, 7) for r in batch]
    assert [json.loads(r) for r in got] == [json.loads(r) for r in
                                            unique_in_order([json.dumps(r) for r in recs])]
    wal = np.fromfile(tmp_path / "s.meta.dedup", dtype=np.uint64)
    assert sorted(set(wal.tolist())) == sorted(xxhash.xxh3_64_intdigest(r) for r in got)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**64 - 1) | st.sampled_from([0, 1, 2**63, 2**64 - 1]), max_size=200))
def test_first_occurrences_is_np_unique(values):
    hashes = np.array(values, dtype=np.uint64)
    unique, first = first_occurrences(hashes)
    ref_unique, ref_first = np.unique(hashes, return_index=True)
    assert unique.tolist() == ref_unique.tolist()
    assert first.tolist() == ref_first.tolist()


def test_first_occurrences_with_equal_top_bits():
    # different hashes whose top bits agree take the exact fallback; equal ones stay first-wins
    top = np.uint64(0xABCD) << np.uint64(48)
    hashes = np.array([top | np.uint64(5), top | np.uint64(3), top | np.uint64(5), 7, 7],
                      dtype=np.uint64)
    unique, first = first_occurrences(hashes)
    assert unique.tolist() == sorted({int(h) for h in hashes})
    assert first.tolist() == [3, 1, 0]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(0, 2**64 - 1), max_size=300),
    st.lists(st.lists(st.integers(0, 2**64 - 1) | st.integers(0, 50), max_size=80), max_size=8),
)
def test_delivered_hashes_is_a_set(committed, blocks):
    model = set(committed)
    delivered = DeliveredHashes(np.array(committed, dtype=np.uint64))
    assert len(delivered) == len(model)
    for block in blocks:
        probe = np.array(sorted(set(block)), dtype=np.uint64)
        seen = delivered.contains(probe)
        assert seen.tolist() == [int(h) in model for h in probe]
        delivered.add(probe[~seen])
        model |= set(block)
        assert len(delivered) == len(model)
    everything = np.array(sorted(model), dtype=np.uint64)
    assert delivered.contains(everything).all()


def test_delivered_hashes_grow_past_merges_and_filter_rebuilds():
    rng = np.random.default_rng(9)
    delivered = DeliveredHashes()
    added = []
    for _ in range(40):
        block = np.unique(rng.integers(0, 2**64 - 1, size=5000, dtype=np.uint64))
        seen = delivered.contains(block)
        assert not seen.any()
        delivered.add(block)
        added.append(block)
    everything = np.concatenate(added)
    assert len(delivered) == everything.size
    assert delivered.contains(everything).all()
    others = rng.integers(0, 2**64 - 1, size=20000, dtype=np.uint64)
    assert not delivered.contains(others).any()  # 2**-64 per probe to be wrong
    assert delivered.nbytes < 16 * everything.size


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 3000), st.data())
def test_pick_is_the_records_at_the_indices(n, data):
    """Every way ``pick`` may take (long runs as slices, a few records one by one, a mask
    over all of them) gives the records at ``idx``, in order."""
    items = [b"%d" % i for i in range(n)]
    spread = data.draw(st.sampled_from(["all", "few-gaps", "few-kept", "random", "one"]))
    if spread == "all":
        idx = np.arange(n)
    elif spread == "few-gaps":
        gaps = data.draw(st.sets(st.integers(0, n - 1), max_size=max(1, n // 100)))
        idx = np.array([i for i in range(n) if i not in gaps], dtype=np.intp)
    elif spread == "few-kept":
        idx = np.array(sorted(data.draw(st.sets(st.integers(0, n - 1), max_size=n // 4 + 1))),
                       dtype=np.intp)
    elif spread == "random":
        keep = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
        idx = np.flatnonzero(keep)
    else:
        idx = np.array([data.draw(st.integers(0, n - 1))], dtype=np.intp)
    assert readers_mod.pick(items, idx) == [items[i] for i in idx]
