"""Shard readers: turn one open shard into blocks of records, each record with the position
just after it, starting from a resume position without touching what lies before it.

Invariants:
- Line shards (.jsonl/.txt) are read in large blocks (``LINE_BLOCK`` bytes: one local read or
  one HTTP/S3 range request each; the first reads after opening are smaller, growing from
  ``FIRST_READ``), never line by line. A record is a line without its
  terminator (``\\n`` or ``\\r\\n``); empty lines are not records. ``ends[i]`` is the byte offset
  just past record ``i``'s terminator, so resuming at it with ``seek`` starts at the next line.
  A block keeps the bytes it was cut from (``data``) and where each record lies in them
  (``starts``/``stops``), so a parser can work on the whole block at once; the records as
  ``bytes`` objects are only made when asked for (``records``).
- Parquet shards are read one row group at a time (``PARQUET_BLOCK_ROWS`` rows per block);
  ``ends[i]`` is the number of rows of that row group consumed after record ``i``. Resuming at
  ``(row_group_idx, row_offset)`` opens that row group and skips ``row_offset`` rows; a row
  group already fully consumed is skipped from the footer alone. A block keeps its Arrow
  record batch; the rows as dicts are only made when asked for.
- ``global_start`` counts raw records before the block: every record, duplicates included.
"""

from __future__ import annotations

import base64
import datetime
import decimal
import json
from operator import itemgetter
from typing import Any

import numpy as np

from faultfs.errors import InvalidInput, SourceError
from faultfs.stream.shards import Shard

LINE_BLOCK = 4 << 20  # large enough that a range request costs far less than its transfer
FIRST_READ = 256 << 10  # the first read after opening a shard: a (re)started stream's first
# batch waits for one small read and its parse, not 4 MiB; reads then grow 4x up to LINE_BLOCK
PARQUET_BLOCK_ROWS = 65536  # rows decoded per block; bounds memory on huge row groups
_NL, _CR = 0x0A, 0x0D


class RecordBlock:
    """Consecutive records of one shard (one row group, or part of one, for Parquet)."""

    __slots__ = (
        "_records",
        "batch",
        "count",
        "data",
        "data_offset",
        "ends",
        "global_start",
        "kind",
        "row_group_idx",
        "shard",
        "shard_id",
        "starts",
        "stops",
        "terminated",
    )

    def __init__(
        self,
        *,
        kind: str,
        shard: Shard,
        shard_id: int,
        ends: np.ndarray,
        global_start: int,
        row_group_idx: int = 0,
        records: list[Any] | None = None,
        data: bytes = b"",
        data_offset: int = 0,
        starts: np.ndarray | None = None,
        stops: np.ndarray | None = None,
        terminated: bool = True,
        batch: Any = None,
    ) -> None:
        self.kind = kind  # "lines" or "parquet"
        self.shard = shard
        self.shard_id = shard_id
        self.ends = ends  # int64 position just after each record (see module doc)
        self.count = int(ends.size)
        self.global_start = global_start
        self.row_group_idx = row_group_idx  # Parquet only; 0 for line shards
        self._records = records
        # lines: the bytes the records were cut from, the file offset of data[0], and each
        # record's [start, stop) in data (terminator excluded)
        self.data = data
        self.data_offset = data_offset
        self.starts = starts
        self.stops = stops
        self.terminated = terminated  # False only for a shard's last line without "\n"
        self.batch = batch  # Parquet: the pyarrow.RecordBatch of these rows

    @property
    def records(self) -> list[Any]:
        """The records: ``bytes`` lines, or Parquet rows as dicts (made on first use)."""
        if self._records is None:
            self._records = self._make_records()
        return self._records

    def _make_records(self) -> list[Any]:
        if self.kind == "parquet":
            rows: list[Any] = self.batch.to_pylist()
            return rows
        assert self.starts is not None and self.stops is not None
        data = self.data
        if not self.terminated:  # one last line without "\n", maybe with a lone "\r"
            return [data[int(self.starts[0]) : int(self.stops[0])]]
        cut = int(self.ends[-1]) - self.data_offset
        if data.find(b"\r", 0, cut) >= 0:  # every "\r\n" in data ends a line
            data = data[:cut].replace(b"\r\n", b"\n")
        lines = data.split(b"\n")
        lines.pop()  # what follows the last terminator (carried to the next block)
        if len(lines) != self.count:  # empty lines are not records
            lengths = np.fromiter(map(len, lines), dtype=np.int64, count=len(lines))
            lines = pick(lines, np.flatnonzero(lengths))
        return lines

    def line_offset(self, i: int) -> int:
        """Lines: the byte offset in the shard where record ``i`` starts."""
        assert self.starts is not None
        return self.data_offset + int(self.starts[i])


def pick(items: list[Any], idx: np.ndarray) -> list[Any]:
    """``[items[i] for i in idx]`` for sorted, distinct ``idx``, copied as runs of consecutive
    indices (few when few records are left out); as long as ``items`` means all of it."""
    if idx.size == len(items):
        return items
    if idx.size <= 1:
        return [items[int(i)] for i in idx]
    breaks = np.flatnonzero(idx[1:] != idx[:-1] + 1) + 1
    if breaks.size * 4 > idx.size:  # mostly short runs: one pass of itemgetter
        return list(itemgetter(*idx.tolist())(items))
    starts = idx[np.concatenate(([0], breaks))].tolist()
    stops = (idx[np.concatenate((breaks - 1, [idx.size - 1]))] + 1).tolist()
    out: list[Any] = []
    for start, stop in zip(starts, stops, strict=True):
        out += items[start:stop]
    return out


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

    def __init__(
        self, shard: Shard, shard_id: int, start_offset: int, global_start: int
    ) -> None:
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
        self._read_size = min(FIRST_READ, LINE_BLOCK)

    def _read(self) -> bytes:
        size = self._read_size
        self._read_size = min(size * 4, LINE_BLOCK)
        try:
            return self._file.read(size)
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
                self._carry = buf[cut:]
                block = self._block(buf, cut, terminated=True)
            else:
                self._eof = True
                if not self._carry:
                    return None
                buf, self._carry = self._carry, b""
                block = self._block(buf, len(buf), terminated=False)
            if block is not None:
                return block
        return None

    def _block(self, buf: bytes, cut: int, *, terminated: bool) -> RecordBlock | None:
        """The records of ``buf[:cut]``: whole lines, or one last line without a terminator."""
        arr = np.frombuffer(buf, dtype=np.uint8, count=cut)
        if terminated:
            stops = np.flatnonzero(arr == _NL)  # each line's "\n"
            ends = stops + 1
            starts = np.empty_like(stops)
            starts[0] = 0
            starts[1:] = ends[:-1]
        else:
            starts = np.zeros(1, dtype=np.intp)
            stops = np.full(1, cut, dtype=np.intp)
            ends = stops
        if buf.find(b"\r", 0, cut) >= 0:  # strip the "\r" of "\r\n" (and of a last lone "\r")
            stops = stops - ((stops > starts) & (arr[stops - 1] == _CR))
        keep = stops > starts
        if not keep.all():  # empty lines are not records
            starts, stops, ends = starts[keep], stops[keep], ends[keep]
        offset = self._offset
        self._offset += cut
        if not ends.size:
            return None
        block = RecordBlock(
            kind="lines",
            shard=self._shard,
            shard_id=self._shard_id,
            ends=ends.astype(np.int64) + offset,
            global_start=self._global,
            data=buf,
            data_offset=offset,
            starts=starts,
            stops=stops,
            terminated=terminated,
        )
        self._global += block.count
        return block

    def close(self) -> None:
        self._file.close()


class ParquetShardReader:
    """Blocks of rows of one .parquet shard, from ``(row_group_idx, row_offset)``."""

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
                if not batch.num_rows:
                    continue
                ends = np.arange(self._row + 1, self._row + 1 + batch.num_rows, dtype=np.int64)
                block = RecordBlock(
                    kind="parquet",
                    shard=self._shard,
                    shard_id=self._shard_id,
                    ends=ends,
                    global_start=self._global,
                    row_group_idx=self._group,
                    batch=batch,
                )
                self._row += block.count
                self._global += block.count
                return block
            self._batches = None
            self._group, self._row = self._group + 1, 0
        return None

    def close(self) -> None:
        self._file.close()
