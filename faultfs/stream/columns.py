"""Columns: parse a whole block of records into one ``pyarrow.Table`` in bulk, row ``i`` from
record ``i`` of the block, so parsed batches keep the coordinates and dedup of raw records.

- ``.jsonl``/``.ndjson``: pyarrow's JSON reader over the block's bytes as they were read (no
  copy, no Python object per record). A record must be one JSON object on its line.
- ``.txt``: one ``text`` column (``string``) holding each line, checked to be UTF-8.
- ``.parquet``: the block's record batch as it is.

Invariants:
- A table has exactly ``block.count`` rows and row ``i`` is record ``i``; nothing is dropped,
  merged or shifted. A record that cannot be a row raises ``RecordParseError`` naming the
  shard, the byte offset (or row group and row) and the record's ``global_row_idx``.
- Flat records of the common shape (the same keys in the same order on every line, each
  column all integers, all booleans or all strings) are parsed in one compiled pass where it
  is built (``_flatjson``, ``flat_table``), ~4x cheaper than pyarrow's reader; it declines
  anything whose table could differ from what pyarrow's reader makes of the same bytes
  (nulls, fractions, nesting, a string pyarrow might read as a timestamp, invalid text...),
  which pyarrow then parses as below: the table is pyarrow's either way (a property test
  holds the two to it).
- The JSON fast path parses the block in one call and is accepted only when every record
  starts with ``{`` and ends with ``}`` and the parser returns one row per record. That
  proves the rows are the records in order: a value cannot continue past a line ending in
  ``}`` into a line starting with ``{`` (after ``}`` JSON allows only ``,``, ``}`` or ``]``, and
  a string cannot hold a raw newline), so no line gives less than one row, and equal counts
  leave exactly one each. Anything else (leading blanks, a BOM, a damaged line) takes the
  exact path: each record wrapped as ``{"r":<record>}`` on its own line, which cannot spill
  into its neighbours either, then a bisection over prefixes to find the first bad record.
"""

from __future__ import annotations

import errno
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from faultfs.errors import InvalidInput
from faultfs.stream.readers import RecordBlock

try:  # the compiled parse of flat records (setup.py); optional: pyarrow's reader parses them
    from faultfs.stream._flatjson import flat as _flat
except ImportError:  # pragma: no cover - built wherever a compiler is
    _flat = None

JSON_CHUNK = 1 << 20  # pyarrow's default JSON block: a 4 MiB read is parsed as 4 chunks in
# parallel; raised for a block whose longest line does not fit (pyarrow needs whole lines)
_BOM = b"\xef\xbb\xbf"
_OPEN, _CLOSE = 0x7B, 0x7D  # "{", "}"
_JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean",
               type(None): "null"}


class RecordParseError(InvalidInput):
    """A record that cannot be parsed into a row (malformed, not an object, a type clash)."""

    def __init__(self, message: str, *, shard: str, global_row_idx: int, where: str) -> None:
        super().__init__(message, errno.EBADMSG)
        self.shard = shard
        self.global_row_idx = global_row_idx
        self.where = where  # "byte offset N" or "row group G, row R"


def import_arrow() -> tuple[Any, Any]:
    try:
        import pyarrow as pa
        import pyarrow.json as paj
    except ImportError:
        raise InvalidInput(
            "parsed batches need pyarrow: pip install 'faultfs[parquet]'"
        ) from None
    return pa, paj


def block_table(block: Any, schema: Any = None, *, threads: bool = True) -> Any:
    """All records of ``block`` as a ``pyarrow.Table`` (``schema``: the columns and types to
    give every table; fields outside it are dropped, missing ones are null); a shuffled
    stream's mixed block (``shuffle.window``) as rows of its window's table. ``threads``:
    JSON parsed on pyarrow's threads (a caller that parses small blocks side by side in
    threads of its own saves their overhead without)."""
    pa, _ = import_arrow()
    if block.kind == "mixed":  # a shuffled window's records, taken from its table
        return block.table(schema)
    if block.kind == "parquet":
        table = pa.Table.from_batches([block.batch])
    elif block.shard.parse_as == "text":
        table = _text_table(block)
    else:
        return _json_table(block, schema, threads)
    return table if schema is None else conform(table, schema)


def take_rows(table: Any, idx: np.ndarray) -> Any:
    """``table.take(idx)`` for an int64-like numpy array of row numbers, the indices handed
    to pyarrow as an Arrow array over the same memory: given a numpy array, pyarrow's
    conversion looks for pandas first and imports it when installed (~0.3 s at the first
    call, in the middle of a stream's first batch)."""
    pa, _ = import_arrow()
    rows = np.ascontiguousarray(idx, dtype=np.int64)
    return table.take(pa.Array.from_buffers(pa.int64(), int(rows.size),
                                            [None, pa.py_buffer(rows)]))


def conform(table: Any, schema: Any) -> Any:
    """``table`` with exactly the columns of ``schema``, cast to its types."""
    pa, _ = import_arrow()
    if table.schema.equals(schema):
        return table
    columns = [
        table[f.name].cast(f.type) if f.name in table.column_names
        else pa.nulls(table.num_rows, f.type)
        for f in schema
    ]
    return pa.Table.from_arrays(columns, schema=schema)


def concat(parts: Sequence[Any]) -> Any:
    """One table of consecutive parts whose inferred columns may differ (a column all null in
    one block, a field absent from another): columns are matched by name and widened."""
    pa, _ = import_arrow()
    if len(parts) == 1:
        return parts[0]
    first = parts[0].schema
    if all(p.schema.equals(first) for p in parts[1:]):
        return pa.concat_tables(parts)
    try:
        return pa.concat_tables(parts, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as err:
        raise InvalidInput(
            f"the records of one batch have columns of clashing types ({err}); pass schema= "
            "to batches() to fix the column types"
        ) from None


# -- text -----------------------------------------------------------------------------------


def _text_table(block: RecordBlock) -> Any:
    pa, _ = import_arrow()
    assert block.starts is not None and block.stops is not None
    lines = block.records
    offsets = np.zeros(block.count + 1, dtype=np.int64)
    np.cumsum(block.stops - block.starts, out=offsets[1:])
    data = b"".join(lines)
    large = offsets[-1] >= 1 << 31
    kind = pa.large_string() if large else pa.string()
    array = pa.Array.from_buffers(
        kind,
        block.count,
        [None, pa.py_buffer(offsets if large else offsets.astype(np.int32)), pa.py_buffer(data)],
    )
    try:
        array.validate(full=True)
    except pa.ArrowInvalid:
        for i, line in enumerate(lines):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as err:
                raise _line_error(block, i, f"is not UTF-8 text ({err.reason})") from None
        raise  # pragma: no cover - every line decodes, yet the array is invalid
    return pa.table({"text": array})


# -- JSON -----------------------------------------------------------------------------------


def _options(
    schema: Any, longest: int, *, wrapped: bool, threads: bool = True
) -> tuple[Any, Any]:
    pa, paj = import_arrow()
    read = paj.ReadOptions(use_threads=threads, block_size=max(JSON_CHUNK, 2 * longest + 64))
    if schema is None:
        return read, None
    if wrapped:
        schema = pa.schema([pa.field("r", pa.struct(list(schema)))])
    return read, paj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")


def flat_table(data: Any, starts: np.ndarray, stops: np.ndarray) -> Any:
    """The records ``data[starts[i]:stops[i]]`` (at least one) as the table pyarrow's JSON
    reader makes of them, from the compiled pass (``_flatjson``), or None where it declines
    them or is not built (module doc)."""
    if _flat is None or not len(starts):
        return None
    pa, _ = import_arrow()
    got = _flat(data, np.ascontiguousarray(starts, dtype=np.int64),
                np.ascontiguousarray(stops, dtype=np.int64))
    if got is None:
        return None
    names, columns = got
    n = len(starts)
    arrays = []
    for kind, values, text in columns:
        if kind == 2:
            arrays.append(pa.Array.from_buffers(
                pa.string(), n, [None, pa.py_buffer(values), pa.py_buffer(text)]))
        else:
            arrays.append(pa.Array.from_buffers(pa.int64() if kind == 0 else pa.bool_(), n,
                                                [None, pa.py_buffer(values)]))
    return pa.Table.from_arrays(arrays, names=names)


def _json_table(block: RecordBlock, schema: Any, threads: bool = True) -> Any:
    pa, paj = import_arrow()
    assert block.starts is not None and block.stops is not None
    if schema is None:
        table = flat_table(block.data, block.starts, block.stops)
        if table is not None:
            return table
    cut = int(block.ends[-1]) - block.data_offset
    longest = int((block.stops - block.starts).max())
    arr = np.frombuffer(block.data, dtype=np.uint8, count=cut)
    if (arr[block.starts] == _OPEN).all() and (arr[block.stops - 1] == _CLOSE).all():
        read, parse = _options(schema, longest, wrapped=False, threads=threads)
        try:
            table = paj.read_json(
                pa.BufferReader(pa.py_buffer(block.data).slice(0, cut)),
                read_options=read,
                parse_options=parse,
            )
        except (pa.ArrowException, ValueError):
            table = None  # the exact path finds the record and says what is wrong
        if table is not None and table.num_rows == block.count:
            return table
    return _json_table_exact(block, schema, longest)


def _parse_wrapped(lines: Sequence[bytes], schema: Any, longest: int) -> tuple[Any, str]:
    """Records wrapped one per line as ``{"r":<record>}``: (table, "") or (None, why not)."""
    pa, paj = import_arrow()
    if not lines:
        return None, "no records"
    data = b'{"r":' + b'}\n{"r":'.join(lines) + b"}\n"
    read, parse = _options(schema, longest + 6, wrapped=True)
    try:
        table = paj.read_json(pa.BufferReader(data), read_options=read, parse_options=parse)
    except (pa.ArrowException, ValueError) as err:
        return None, str(err).removeprefix("JSON parse error: ")
    if table.num_rows != len(lines):
        return None, "a line holds more than one JSON value"
    column = table.column("r")
    if not pa.types.is_struct(column.type) or column.null_count:
        return None, "not a JSON object"
    return table, ""


def _json_table_exact(block: RecordBlock, schema: Any, longest: int) -> Any:
    lines = block.records
    if block.data_offset == 0 and int(block.starts[0]) == 0 and lines[0].startswith(_BOM):
        lines = [lines[0][len(_BOM) :], *lines[1:]]  # a UTF-8 BOM opening the shard
    table, why = _parse_wrapped(lines, schema, longest)
    if table is None:
        raise _first_bad_record(block, lines, schema, longest, why)
    flat = table.flatten()  # columns "r.<name>": one level, nested structs stay
    if not flat.num_columns:  # every record is {}
        return table.drop_columns(["r"])
    return flat.rename_columns([name[2:] for name in flat.column_names])


def _first_bad_record(
    block: RecordBlock, lines: Sequence[bytes], schema: Any, longest: int, why: str
) -> RecordParseError:
    # the smallest prefix that fails: every failure (a syntax error, a value that is not an
    # object, an extra value on a line, a type clash) persists in every longer prefix
    lo, hi = 0, len(lines)  # the prefix of lo records parses, the prefix of hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        table, reason = _parse_wrapped(lines[:mid], schema, longest)
        if table is None:
            hi, why = mid, reason
        else:
            lo = mid
    i = hi - 1
    try:
        value = json.loads(lines[i])
    except (ValueError, RecursionError) as err:
        return _line_error(block, i, f"is not valid JSON ({err})")
    if not isinstance(value, dict):
        kind = _JSON_KINDS.get(type(value), type(value).__name__)
        return _line_error(block, i, f"is a JSON {kind}, not an object")
    return _line_error(
        block,
        i,
        f"cannot be a row ({why}); if its fields clash in type with earlier records, pass "
        "schema= to batches() to fix the column types",
    )


def _line_error(block: RecordBlock, i: int, what: str) -> RecordParseError:
    where = f"byte offset {block.line_offset(i)}"
    row = block.global_start + i
    return RecordParseError(
        f"{block.shard.url}: the record at {where} (global_row_idx {row}) {what}",
        shard=block.shard.url,
        global_row_idx=row,
        where=where,
    )
