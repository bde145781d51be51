"""Shard readers: turn one open shard into blocks of records, each record with the position
just after it, starting from a resume position without touching what lies before it.

Invariants:
- Line shards (.jsonl/.txt) are read in large blocks (``LINE_BLOCK`` bytes: one local read or
  one HTTP/S3 range request each), never line by line. A record is a line without its
  terminator (``\\n`` or ``\\r\\n``); empty lines are not records. ``ends[i]`` is the byte offset
  just past record ``i``'s terminator, so resuming at it with ``seek`` starts at the next line.
- Parquet shards are read one row group at a time (``PARQUET_BLOCK_ROWS`` rows per block);
  ``ends[i]`` is the number of rows of that row group consumed after record ``i``. Resuming at
  ``(row_group_idx, row_offset)`` opens that row group and skips ``row_offset`` rows; a row
  group already fully consumed is skipped from the footer alone.
- ``global_start`` counts raw records before the block: every record, duplicates included.
"""

from __future__ import annotations

import base64
import datetime
import decimal
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from faultfs.errors import InvalidInput, SourceError
from faultfs.stream.shards import Shard

LINE_BLOCK = 4 << 20  # large enough that a range request costs far less than its transfer
PARQUET_BLOCK_ROWS = 65536  # rows decoded per block; bounds memory on huge row groups


@dataclass
class RecordBlock:
    """Consecutive records of one shard (one row group for Parquet)."""

    records: list[Any]
    ends: np.ndarray  # int64 position just after each record (see module doc)
    shard_id: int
    row_group_idx: int  # Parquet only; 0 for line shards
    global_start: int
    kind: str  # "lines" or "parquet"


def import_parquet() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise InvalidInput(
            "reading .parquet shards needs pyarrow: pip install 'faultfs[parquet]'"
        ) from None
    return pq


def _json_default(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"$bytes": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, (datetime.date, datetime.time, datetime.timedelta, decimal.Decimal)):
        return {"$" + type(value).__name__: str(value)}
    return {"$" + type(value).__name__: repr(value)}


def row_bytes(row: dict[str, Any]) -> bytes:
    """The canonical bytes of a Parquet row, hashed for dedup: compact UTF-8 JSON with sorted
    keys; bytes, dates, times and decimals are tagged objects (see docs/FORMAT-cursors.md)."""
    return json.dumps(
        row, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=_json_default
    ).encode("utf-8")


class LineShardReader:
    """Blocks of lines of one .jsonl/.txt shard, from ``start_offset``."""

    def __init__(self, shard: Shard, shard_id: int, start_offset: int, global_start: int) -> None:
        self._shard = shard
        self._shard_id = shard_id
        self._file = shard.open()
        try:
            if start_offset:
                self._file.seek(start_offset)
        except BaseException:
            self._file.close()
            raise
        self._offset = start_offset  # file offset of the first byte of ``_carry``
        self._carry = b""  # an incomplete last line waiting for the next read
        self._global = global_start
        self._eof = False

    def _read(self) -> bytes:
        try:
            return self._file.read(LINE_BLOCK)
        except OSError as err:
            raise SourceError(f"{self._shard.url}: read failed at {self._offset}: {err}") from err

    def next_block(self) -> RecordBlock | None:
        while not self._eof:
            data = self._read()
            if data:
                buf = self._carry + data if self._carry else data
                cut = buf.rfind(b"\n") + 1
                if cut == 0:
                    self._carry = buf  # a line longer than a block: keep reading
                    continue
                complete, self._carry = buf[:cut], buf[cut:]
                lines = complete.split(b"\n")
                lines.pop()  # the empty piece after the final terminator
            else:
                self._eof = True
                if not self._carry:
                    return None
                complete, self._carry = self._carry, b""
                lines = [complete]  # a last line without terminator
            block = self._block(lines, terminated=bool(data), has_cr=b"\r" in complete)
            if block is not None:
                return block
        return None

    def _block(
        self, lines: list[bytes], *, terminated: bool, has_cr: bool
    ) -> RecordBlock | None:
        lengths = np.fromiter(map(len, lines), dtype=np.int64, count=len(lines))
        ends = np.cumsum(lengths + (1 if terminated else 0)) + self._offset
        self._offset = int(ends[-1])
        if has_cr:
            lines = [line[:-1] if line.endswith(b"\r") else line for line in lines]
        if not all(lines):  # drop empty lines: they are not records
            keep = [i for i, line in enumerate(lines) if line]
            lines = [lines[i] for i in keep]
            ends = ends[keep]
            if not lines:
                return None
        block = RecordBlock(lines, ends, self._shard_id, 0, self._global, "lines")
        self._global += len(lines)
        return block

    def close(self) -> None:
        self._file.close()


class ParquetShardReader:
    """Blocks of rows (dicts) of one .parquet shard, from ``(row_group_idx, row_offset)``."""

    def __init__(
        self, shard: Shard, shard_id: int, row_group_idx: int, row_offset: int, global_start: int
    ) -> None:
        pq = import_parquet()
        self._shard = shard
        self._shard_id = shard_id
        self._file = shard.open()
        try:
            self._pf = pq.ParquetFile(self._file)
        except Exception as err:
            self._file.close()
            raise SourceError(f"{shard.url}: not a readable Parquet file: {err}") from err
        self._group = row_group_idx
        self._row = row_offset  # rows of the current group already consumed
        self._batches: Any = None
        self._skip = 0  # rows still to skip at the start of the open row group
        self._global = global_start

    def next_block(self) -> RecordBlock | None:
        meta = self._pf.metadata
        while self._group < meta.num_row_groups:
            if self._batches is None:
                if self._row >= meta.row_group(self._group).num_rows:
                    self._group, self._row = self._group + 1, 0  # consumed: footer says so
                    continue
                self._batches = self._pf.iter_batches(
                    batch_size=PARQUET_BLOCK_ROWS, row_groups=[self._group], use_threads=False
                )
                self._skip = self._row
            for batch in self._batches:
                if self._skip >= batch.num_rows:
                    self._skip -= batch.num_rows
                    continue
                if self._skip:
                    batch = batch.slice(self._skip)
                    self._skip = 0
                rows = batch.to_pylist()
                if not rows:
                    continue
                ends = np.arange(self._row + 1, self._row + 1 + len(rows), dtype=np.int64)
                block = RecordBlock(
                    rows, ends, self._shard_id, self._group, self._global, "parquet"
                )
                self._row += len(rows)
                self._global += len(rows)
                return block
            self._batches = None
            self._group, self._row = self._group + 1, 0
        return None

    def close(self) -> None:
        self._file.close()
