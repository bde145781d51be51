"""Shard readers: turn one open shard into blocks of records, each record with the position
just after it, starting from a resume position without touching what lies before it.

Invariants:
- Line shards (.jsonl/.txt) are read in large blocks (``LINE_BLOCK`` bytes: one local read or
  one HTTP/S3 range request each; the first reads after opening are smaller, growing from
  ``FIRST_READ``), never line by line. A record is a line without its
  terminator (``\\n`` or ``\\r\\n``); empty lines are not records. ``ends[i]`` is the byte offset
  just past record ``i``'s terminator, so resuming at it with ``seek`` starts at the next line.
  A resume point is therefore 0, just past a ``\\n``, or the shard's end (a last line without
  one); a resume anywhere else inside the shard is refused (``SourceError``: the shard changed),
  seen in the byte before it, which the first read takes too (no read is added).
  A block keeps the bytes it was cut from (``data``) and where each record lies in them
  (``starts``/``stops``), so a parser can work on the whole block at once; the records as
  ``bytes`` objects are only made when asked for (``records``).
- Parquet shards are read one row group at a time (``PARQUET_BLOCK_ROWS`` rows per block);
  ``ends[i]`` is the number of rows of that row group consumed after record ``i``. Resuming at
  ``(row_group_idx, row_offset)`` opens that row group and skips ``row_offset`` rows; a row
  group already fully consumed is skipped from the footer alone. A block keeps its Arrow
  record batch; the rows as dicts are only made when asked for.
- A partitioned reader reads only its part of a shard (``faultfs.stream.partition``): the
  lines that start in its byte ranges (a range that starts mid-line begins at the next line
  start; a line that straddles a range's end is read whole, by the range it starts in), and
  the rows of the row groups whose start lies in its ranges. Every record of a shard is in
  exactly one reader's part, whatever the ranges.
- ``global_start`` counts raw records before the block: every record, duplicates included.
"""

from __future__ import annotations

import base64
import datetime
import decimal
import json
from collections import deque
from itertools import compress
from operator import itemgetter
from typing import Any

import numpy as np

from faultfs.errors import InvalidInput, SourceError
from faultfs.stream.shards import Shard, ShardFile

LINE_BLOCK = 4 << 20  # large enough that a range request costs far less than its transfer
FIRST_READ = 256 << 10  # the first read after opening a shard: a (re)started stream's first
# batch waits for one small read and its parse, not 4 MiB; reads then grow 4x up to LINE_BLOCK
TAIL_PEEK = 4 << 10  # a range's reads go this far past its end: the line that straddles it is
# usually whole in the same read (a shuffled stream reads many small ranges, one per block)
TAIL_READ = 64 << 10  # past the end of a partitioned reader's range only the line straddling
# it is read, in reads of this size
PARQUET_BLOCK_ROWS = 65536  # rows decoded per block; bounds memory on huge row groups
_NL, _CR = 0x0A, 0x0D


try:  # the compiled cut (setup.py); optional: the same records from a split and a pick
    from faultfs.stream._cut import cut as _cut
except ImportError:  # pragma: no cover - built wherever a compiler is
    _cut = None


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
        if _cut is not None:  # one pass over the bounds the block already has
            return self._cut(self.starts, self.stops)
        if not self.terminated:  # one last line without "\n", maybe with a lone "\r"
            return [data[int(self.starts[0]) : int(self.stops[0])]]
        if data.find(b"\r") >= 0:  # every "\r\n" in data ends a line (blank ones too)
            data = data.replace(b"\r\n", b"\n")
        lines = data.split(b"\n")
        lines.pop()  # what follows the last terminator (carried to the next block)
        if len(lines) != self.count:  # empty lines are not records
            lengths = np.fromiter(map(len, lines), dtype=np.int64, count=len(lines))
            lines = pick(lines, np.flatnonzero(lengths))
        return lines

    def _cut(self, starts: np.ndarray, stops: np.ndarray) -> list[bytes]:
        """The records ``data[starts[i]:stops[i]]``, cut in C (``_cut`` takes int64 only)."""
        assert _cut is not None
        return _cut(self.data, starts.astype(np.int64, copy=False),
                    stops.astype(np.int64, copy=False))

    def line_offset(self, i: int) -> int:
        """Lines: the byte offset in the shard where record ``i`` starts."""
        assert self.starts is not None
        return self.data_offset + int(self.starts[i])


def records_at(block: Any, idx: np.ndarray) -> list[Any]:
    """``block.records`` at the sorted, distinct indices ``idx``. A line block not split yet
    cuts just those records from its bytes (one C pass: no ``bytes`` made for the others); a
    shuffled stream's mixed block cuts them from its window."""
    if block.kind == "mixed":
        records: list[Any] = block.records_at(idx)
        return records
    if _cut is None or block.kind != "lines" or block._records is not None:
        return pick(block.records, idx)
    assert block.starts is not None and block.stops is not None
    return block._cut(block.starts[idx], block.stops[idx])


def pick(items: list[Any], idx: np.ndarray) -> list[Any]:
    """``[items[i] for i in idx]`` for sorted, distinct ``idx``; as long as ``items`` means all
    of it. Whichever of three ways is cheapest for how ``idx`` is spread (for 62 K records,
    10 % left out at random: 0.63 ms against 0.94 with slices): a few long runs are copied as
    slices, few records one by one, and the rest in one pass of ``compress`` over a mask."""
    n = len(items)
    if idx.size == n:
        return items
    if idx.size <= 1:
        return [items[int(i)] for i in idx]
    breaks = np.flatnonzero(idx[1:] != idx[:-1] + 1) + 1
    if breaks.size * 32 < n:  # a few long runs
        starts = idx[np.concatenate(([0], breaks))].tolist()
        stops = (idx[np.concatenate((breaks - 1, [idx.size - 1]))] + 1).tolist()
        out: list[Any] = []
        for start, stop in zip(starts, stops, strict=True):
            out += items[start:stop]
        return out
    if idx.size * 2 < n:  # few records kept
        return list(itemgetter(*idx.tolist())(items))
    keep = np.zeros(n, dtype=np.uint8)
    keep[idx] = 1
    return list(compress(items, keep.tobytes()))


def import_parquet() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise InvalidInput(
            "reading .parquet shards needs pyarrow: pip install 'faultfs[parquet]'"
        ) from None
    return pq


def open_parquet(shard: Shard, file: ShardFile) -> Any:
    """A ``pq.ParquetFile`` over an open shard (its footer read), or SourceError."""
    pq = import_parquet()
    try:
        return pq.ParquetFile(file)
    except Exception as err:
        raise SourceError(f"{shard.url}: not a readable Parquet file: {err}") from err


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


LineRange = tuple[int, "int | None", bool]  # start, stop (None: the shard's end), exact


def check_size(shard: Shard, file: Any, expected: int | None) -> None:
    if expected is not None and file.size != expected:
        raise SourceError(
            f"{shard.url}: shard is {file.size} bytes, but the stream's partition was made "
            f"when it was {expected} (the sources changed; a stream must resume over the "
            "same bytes)"
        )


class LineShardReader:
    """Blocks of lines of one .jsonl/.txt shard: from ``start_offset``, or over ``ranges``
    (a partitioned reader's part of the shard): the records that *start* in each
    ``[start, stop)``, in order. A range that is not ``exact`` (``start`` not known to be a
    line start) begins at the first line start at or after ``start``: one byte before it is
    read, and everything up to the next ``\\n``. An ``exact`` start inside the shard (a resume
    point) must follow a ``\\n``: the byte before it is read with it and checked. Reads stop
    ``TAIL_PEEK`` bytes past ``stop`` (the line that straddles it is usually whole there; the
    lines after it are dropped), then only that line is read to its end (``TAIL_READ`` at a
    time)."""

    def __init__(
        self,
        shard: Shard,
        shard_id: int,
        start_offset: int,
        global_start: int,
        *,
        ranges: list[LineRange] | None = None,
        expected_size: int | None = None,
        file: ShardFile | None = None,
        first_read: int = FIRST_READ,
    ) -> None:
        """``file``: the shard already open (kept open by ``close``: its opener owns it);
        ``first_read``: the size of the first read of each range (reads grow 4x from it up to
        ``LINE_BLOCK``)."""
        self._shard = shard
        self._shard_id = shard_id
        self._owns_file = file is None
        self._file = shard.open() if file is None else file
        self._global = global_start
        self._ranges = deque(ranges if ranges is not None else [(start_offset, None, True)])
        self._offset = 0  # file offset of the next line start: the next read begins there
        self._need = 0  # the next read's least size (a line longer than the last read)
        self._stop: int | None = None  # records must start before it
        self._skip = False  # drop bytes through the next "\n" first (a range's inexact start)
        self._after_nl = False  # the first byte read must be "\n" and is dropped (a resume point)
        self._eof = False
        self._done = True  # the current range has no more records
        self._first_read = min(first_read, LINE_BLOCK)
        self._read_size = self._first_read
        try:
            check_size(shard, self._file, expected_size)
            self._start_range()
        except BaseException:
            self.close()
            raise

    def _start_range(self) -> bool:
        if not self._ranges:
            return False
        start, stop, exact = self._ranges.popleft()
        if exact and start > self._file.size:  # a resume point (lines start at or before EOF)
            raise SourceError(
                f"{self._shard.url}: the checkpoint resumes at byte {start} but the shard is "
                f"{self._file.size} bytes (the sources changed; a stream must resume over "
                "the same bytes)"
            )
        self._skip = not exact and start > 0
        # a resume point inside the shard was committed just past a "\n" (a last line without
        # one ends at the shard's end): anything else means the bytes under it changed
        self._after_nl = exact and 0 < start < self._file.size
        pos = start - 1 if self._skip or self._after_nl else start  # where _read begins
        self._offset, self._need, self._stop = pos, 0, stop
        self._eof = self._done = False
        self._read_size = self._first_read
        return True

    def _read(self) -> bytes:
        """The bytes from ``_offset`` on: one read, into one ``bytes`` (the partial line at
        the end of a read is read again at the start of the next, never copied onto it)."""
        size = self._read_size
        self._read_size = min(size * 4, LINE_BLOCK)
        pos = self._offset
        if self._stop is not None:
            if pos < self._stop:
                size = min(size, self._stop - pos + TAIL_PEEK)
            else:
                size = min(size, TAIL_READ)
        size = max(size, self._need)
        self._need = 0
        try:
            if pos != self._file.tell():
                self._file.seek(pos)
            return self._file.read(size)
        except OSError as err:
            raise SourceError(f"{self._shard.url}: read failed at {pos}: {err}") from err

    def next_block(self) -> RecordBlock | None:
        while True:
            if self._done:
                if not self._start_range():
                    return None
                continue
            if self._eof or (
                self._stop is not None and not self._skip and self._offset >= self._stop
            ):
                self._done = True  # the next line starts at or past the range's end
                continue
            buf = self._read()
            if not buf:
                self._eof = True
                continue
            at_eof = self._file.tell() >= self._file.size
            if self._after_nl:
                if buf[0] != _NL:
                    raise SourceError(
                        f"{self._shard.url}: the checkpoint resumes at byte {self._offset + 1}, "
                        "which does not start a line (the byte before it is not a line end: the "
                        "shard changed; a stream must resume over the same bytes)"
                    )
                self._after_nl = False
                self._offset += 1
                if len(buf) == 1:
                    self._eof = at_eof
                    continue
                buf = buf[1:]
            if self._skip:
                nl = buf.find(b"\n")
                self._offset += len(buf) if nl < 0 else nl + 1
                if nl < 0:
                    self._eof = at_eof
                    continue
                self._skip = False
                if nl + 1 == len(buf):
                    self._eof = at_eof
                    continue
                buf = buf[nl + 1 :]
            cut = buf.rfind(b"\n") + 1
            if cut:
                block = self._block(buf, cut, terminated=True)
            elif at_eof:  # the shard's last line, without a terminator
                self._eof = True
                block = self._block(buf, len(buf), terminated=False)
            else:  # a line longer than this read: read it again, whole
                self._need = 2 * len(buf) + TAIL_READ
                continue
            if block is not None:
                return block

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
        if self._stop is not None and ends.size and starts[-1] >= self._stop - offset:
            k = int(np.searchsorted(starts, self._stop - offset))  # the records of this range
            starts, stops, ends = starts[:k], stops[:k], ends[:k]
            self._done = True
            if k:  # the lines past the range are not this block's: records split data whole
                buf = buf[: int(ends[-1])]
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

    def line_start(self, end: int) -> int | None:
        """Where the line that ends at ``end`` starts, or None if no line ends there (a line
        ends just past its ``\\n``, or at the shard's end). Reads that line backwards from
        ``end``, ``TAIL_READ`` bytes at a time, and nothing before it: a resume point's last
        record is checked at the cost of that record."""
        size = self._file.size
        if not 0 < end <= size:
            return None
        hi = end
        while hi > 0:
            lo = max(0, hi - TAIL_READ)
            try:
                self._file.seek(lo)
                buf = self._file.read(hi - lo)
            except OSError as err:
                raise SourceError(f"{self._shard.url}: read failed at {lo}: {err}") from err
            if len(buf) != hi - lo:
                raise SourceError(
                    f"{self._shard.url}: read at {lo} returned {len(buf)} of {hi - lo} bytes"
                )
            if hi == end:
                if buf[-1] != _NL and end != size:
                    return None
                if buf[-1] == _NL:  # its own terminator
                    buf = buf[:-1]
            nl = buf.rfind(b"\n")
            if nl >= 0:
                return lo + nl + 1
            hi = lo
        return 0

    def close(self) -> None:
        if self._owns_file:
            self._file.close()


def row_group_positions(meta: Any) -> list[int]:
    """Where each row group of a Parquet file starts (its first column chunk's first page),
    made strictly increasing (a group that starts at or before the previous one is placed one
    byte after it), so positions sort row groups in file order. The partition key of a row is
    ``(shard, position of its group, row in the group)``."""
    out: list[int] = []
    prev = -1
    for g in range(meta.num_row_groups):
        rg = meta.row_group(g)
        starts = []
        for c in range(rg.num_columns):
            col = rg.column(c)
            page = col.dictionary_page_offset if col.has_dictionary_page else None
            page = page or col.data_page_offset
            if page is not None:
                starts.append(int(page))
        start = min(starts) if starts else prev + 1
        prev = start if start > prev else prev + 1
        out.append(prev)
    return out


Piece = tuple[tuple[int, int], "tuple[int, int] | None"]  # [(pos, row), (pos, row) or None)


class ParquetShardReader:
    """Blocks of rows of one .parquet shard, from ``(row_group_idx, row_offset)``; with
    ``pieces`` (a partitioned reader's part, in partition keys) only the rows whose key
    ``(position of the row group, row)`` falls in a piece. Which rows of which group are read
    is decided from the footer alone: a group with nothing left to read is never opened."""

    def __init__(
        self,
        shard: Shard,
        shard_id: int,
        row_group_idx: int,
        row_offset: int,
        global_start: int,
        *,
        pieces: list[Piece] | None = None,
        expected_size: int | None = None,
        file: ShardFile | None = None,
        parquet: Any = None,
    ) -> None:
        """``file`` and ``parquet``: the shard already open, and its ``pq.ParquetFile`` (its
        footer read once), kept open by ``close``: their opener owns them."""
        import_parquet()  # refused here, before the shard is opened, without pyarrow
        self._shard = shard
        self._shard_id = shard_id
        self._owns_file = file is None
        self._file = shard.open() if file is None else file
        try:
            check_size(shard, self._file, expected_size)
            if parquet is not None:
                self._pf = parquet
            else:
                self._pf = open_parquet(shard, self._file)
        except BaseException:
            self.close()
            raise
        self._start = (row_group_idx, row_offset)
        self._pieces = pieces
        self._segments: deque[tuple[int, int, int | None]] | None = None  # (group, lo, hi)
        self._group = row_group_idx
        self._row = row_offset  # rows of the current group already consumed
        self._stop_row = 0  # rows of the current group to consume
        self._batches: Any = None
        self._skip = 0  # rows still to skip at the start of the open row group
        self._global = global_start

    def resume_key(self) -> tuple[int, int] | None:
        """The resume point as a partition key, ``(position of its row group, rows of it
        consumed)`` (from the footer read on opening); None at the shard's start or past its
        row groups (``next_block`` refuses that)."""
        g0, r0 = self._start
        meta = self._pf.metadata
        if (g0, r0) == (0, 0) or g0 >= meta.num_row_groups:
            return None
        return row_group_positions(meta)[g0], r0

    def _plan(self) -> deque[tuple[int, int, int | None]]:
        meta = self._pf.metadata
        g0, r0 = self._start
        if (g0, r0) != (0, 0):  # a resume point: inside a row group the footer must have
            groups = meta.num_row_groups
            if g0 >= groups:
                raise SourceError(
                    f"{self._shard.url}: the checkpoint resumes at row group {g0} but the "
                    f"shard has {groups} row groups (the sources changed; a stream must "
                    "resume over the same bytes)"
                )
            rows = meta.row_group(g0).num_rows
            if r0 > rows:
                raise SourceError(
                    f"{self._shard.url}: the checkpoint resumes at row {r0} of row group {g0} "
                    f"but that group has {rows} rows (the sources changed; a stream must "
                    "resume over the same bytes)"
                )
        if self._pieces is None:
            return deque((g, r0 if g == g0 else 0, None) for g in range(g0, meta.num_row_groups))
        segments: deque[tuple[int, int, int | None]] = deque()
        for g, pos in enumerate(row_group_positions(meta)):
            if g < g0:
                continue
            n = meta.row_group(g).num_rows
            for (a_pos, a_row), b in self._pieces:
                if a_pos > pos or (b is not None and b[0] < pos):
                    continue
                lo = a_row if a_pos == pos else 0
                hi = n if b is None or b[0] > pos else min(b[1], n)
                if g == g0:
                    lo = max(lo, r0)
                if lo < hi:
                    segments.append((g, lo, hi))
        return segments

    def next_block(self) -> RecordBlock | None:
        if self._segments is None:
            self._segments = self._plan()
        meta = self._pf.metadata
        while self._batches is not None or self._segments:
            if self._batches is None:
                g, lo, hi = self._segments.popleft()
                n = meta.row_group(g).num_rows
                hi = n if hi is None else min(hi, n)
                if lo >= hi:
                    continue  # consumed: the footer says so
                self._batches = self._pf.iter_batches(
                    batch_size=PARQUET_BLOCK_ROWS, row_groups=[g], use_threads=False
                )
                self._group, self._row, self._skip, self._stop_row = g, lo, lo, hi
            for batch in self._batches:
                if self._skip >= batch.num_rows:
                    self._skip -= batch.num_rows
                    continue
                if self._skip:
                    batch = batch.slice(self._skip)
                    self._skip = 0
                if batch.num_rows > self._stop_row - self._row:
                    batch = batch.slice(0, self._stop_row - self._row)
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
                if self._row >= self._stop_row:
                    self._batches = None  # the rest of the group is not this reader's
                return block
            self._batches = None
        return None

    def close(self) -> None:
        if self._owns_file:
            self._file.close()
