"""Flat JSON records parsed in one compiled pass (``faultfs.stream._flatjson``, through
``columns.flat_table``): wherever it makes a table, that table is the one pyarrow's JSON reader
makes of the same bytes (the same columns, types and values), for records of the common shape
and for random damage to them; it declines everything whose table could differ (nulls,
fractions, nesting, strings pyarrow may read as timestamps, another key order, invalid text),
and a stream gives the same batches with it and without it."""

from __future__ import annotations

import json
import random

import numpy as np
import pyarrow as pa
import pyarrow.json as paj
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from faultfs.stream import RecordStream
from faultfs.stream import columns as columns_room

if columns_room._flat is None:
    pytest.skip("faultfs.stream._flatjson is not built (no C compiler at install)",
                allow_module_level=True)


def bounds(lines: list[bytes]) -> tuple[bytes, np.ndarray, np.ndarray]:
    data = b"".join(line + b"\n" for line in lines)
    lengths = np.array([len(line) for line in lines], dtype=np.int64)
    stops = np.cumsum(lengths + 1) - 1
    return data, stops - lengths, stops


def pyarrows(data: bytes):
    """pyarrow's table of the lines, or None where it refuses them."""
    try:
        return paj.read_json(pa.BufferReader(data)).combine_chunks()
    except (pa.ArrowException, ValueError):
        return None


def check(lines: list[bytes]):
    """The compiled table of ``lines`` (None: declined); where there is one it is pyarrow's."""
    data, starts, stops = bounds(lines)
    ours = columns_room.flat_table(data, starts, stops)
    if ours is not None:
        theirs = pyarrows(data)
        assert theirs is not None, ("pyarrow refuses what the compiled pass took", lines[:3])
        assert ours.schema.equals(theirs.schema), (ours.schema, theirs.schema)
        assert ours.equals(theirs), lines[:3]
        assert ours.to_pylist() == theirs.to_pylist()
    return ours


KEY = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E, exclude_characters='"\\'),
              min_size=0, max_size=6)
INT = st.integers(-(10**17), 10**17)
TEXT = st.text(max_size=30)  # any code point but surrogates: escapes, controls, non-ASCII


def plain(text: str) -> bool:
    """A string the compiled pass takes (module doc of _flatjson.c)."""
    return "\x00" not in text and not (text[:1].isascii() and text[:1].isdigit())


@settings(max_examples=300, deadline=None)
@given(st.lists(KEY, min_size=1, max_size=5, unique=True),
       st.lists(st.sampled_from(["int", "bool", "str"]), min_size=5, max_size=5),
       st.integers(1, 40), st.randoms(use_true_random=False))
def test_records_of_the_common_shape_make_pyarrows_table(keys, kinds, n, rnd):
    values = {"int": lambda: rnd.randint(-(10**17), 10**17), "bool": lambda: rnd.random() < 0.5,
              "str": lambda: "".join(chr(rnd.choice([rnd.randrange(32, 127), rnd.randrange(0, 32),
                                                     rnd.randrange(128, 0xD800),
                                                     rnd.randrange(0xE000, 0x110000)]))
                                     for _ in range(rnd.randrange(12)))}
    lines, takes = [], True
    for _ in range(n):
        record = {k: values[kind]() for k, kind in zip(keys, kinds, strict=False)}
        takes &= all(plain(v) for v in record.values() if isinstance(v, str))
        sep = rnd.choice([(", ", ": "), (",", ":"), (" ,\t", " : ")])
        text = json.dumps(record, ensure_ascii=rnd.random() < 0.5, separators=sep)
        lines.append(text.encode("utf-8"))
    got = check(lines)
    assert (got is not None) == takes, lines[:3]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.fixed_dictionaries({"id": INT, "text": TEXT, "ok": st.booleans()}),
                min_size=1, max_size=8),
       st.lists(st.tuples(st.integers(0, 10**6), st.binary(min_size=0, max_size=3)),
                min_size=1, max_size=3))
def test_damaged_records_are_declined_or_pyarrows(records, damage):
    """Random bytes written over, into or out of valid records: the compiled pass declines, or
    makes exactly pyarrow's table (never one where pyarrow refuses the bytes)."""
    lines = [json.dumps(r, ensure_ascii=False).encode() for r in records]
    for at, junk in damage:
        i = at % len(lines)
        line = lines[i]
        k = at % (len(line) + 1)
        cut = (at // 7) % 3
        lines[i] = line[:k] + junk + line[k + cut:]
    lines = [line for line in lines if line.strip()] or [b"{}"]
    if any(b"\n" in line for line in lines):
        return  # a line break makes other records, not a damaged one
    check(lines)


@pytest.mark.parametrize("line", [
    b'{"a": null}', b'{"a": 1.5}', b'{"a": 1e3}', b'{"a": 1E3}', b'{"a": {"b": 1}}',
    b'{"a": [1]}', b'{"a": "2020-01-01"}', b'{"a": "\\u0032020-01-01"}', b'{"a": "1 apple"}',
    b'{"a": 1234567890123456789}', b'{"a": 01}', b'{"a": -}', b'{"a": "x\\u0000"}',
    b'{"a": "\\ud800"}', b'{"a": "\\udc00x"}', b'{"a": "\xff"}', b'{"a": "\xed\xa0\x80"}',
    b'{"a": "\xc0\xaf"}', b'{"a": "tab\there"}', b'{"a": "x"} ', b' {"a": "x"}', b'{"a": 1,}',
    b'{"a": 1 "b": 2}', b'{"a": tru}', b'{"a": True}', b'{}', b'{"a": 1, "a": 2}',
    b'{"a\\u0041": 1}', b'{"\xc3\xa9": 1}', b'{"a": "x\\q"}', b'{"a" 1}', b'{a: 1}',
    b'{"a": 1}{"a": 2}', b'[1]', b'{"a": 12abc}', b'{"a": truex}',
])
def test_what_it_declines(line):
    first = b'{"a": 7}' if b'"a": 1' in line or b'"a": -' in line else b'{"a": "v"}'
    for lines in ([line], [first, line]):
        assert check(lines) is None, lines


def test_strings_that_only_look_like_other_values_are_taken_as_strings():
    values = [" 2020-01-01", "+2020-01-01", "-2020-01-01", "T10:00:00", "now", "\t2020-01-01",
              "\uff11\uff12", "inf", "NaN", "true", "null", "", "x" * 300]
    lines = [json.dumps({"a": v}).encode() for v in values]
    table = check(lines)
    assert table is not None and table.column("a").to_pylist() == values


def test_another_key_order_a_missing_or_extra_key_or_kind_declines():
    base = b'{"a": 1, "b": "x"}'
    for other in (b'{"b": "x", "a": 1}', b'{"a": 1}', b'{"a": 1, "b": "x", "c": 2}',
                  b'{"a": "1x", "b": "x"}', b'{"a": 1, "b": true}', b'{"a": 1, "c": "x"}'):
        assert check([base, other]) is None, other
    assert check([base, b'{ "a" :-3 ,"b":"\\"\\\\\\/\\b\\f\\n\\r\\t\\u00e9\\ud83d\\ude00"}']) \
        is not None


def test_a_stream_gives_the_same_batches_with_the_compiled_pass_and_without(
    tmp_path, monkeypatch
):
    rng = random.Random(3)
    for k in range(3):
        with open(tmp_path / f"part-{k}.jsonl", "w") as f:
            for i in range(700):
                f.write(json.dumps({"id": i, "text": "é" * rng.randrange(5) + f"r{k}-{i}",
                                    "even": i % 2 == 0}) + "\n")
    src = str(tmp_path / "part-*.jsonl")

    def read(**kw):
        for name in ("run.meta", "run.meta.dedup", "run.meta.shuffle"):
            (tmp_path / name).unlink(missing_ok=True)
        with RecordStream(src, tmp_path / "run.meta", **kw) as s:
            return [(b, t) for b, t in s.batches(100, format="arrow")]

    calls = []
    real = columns_room._flat

    def counted(*args):
        got = real(*args)
        calls.append(got is not None)
        return got

    monkeypatch.setattr(columns_room, "_flat", counted)
    cases = [{}, {"shuffle": True, "seed": 5, "shuffle_window": 4096}]
    compiled = [read(**kw) for kw in cases]
    assert calls and all(calls), "every block parsed by the compiled pass"
    monkeypatch.setattr(columns_room, "_flat", None)
    for kw, ours in zip(cases, compiled, strict=True):
        theirs = read(**kw)
        assert [b for b, _ in ours] == [b for b, _ in theirs]
        for (_, a), (_, b) in zip(ours, theirs, strict=True):
            assert a.equals(b), kw
