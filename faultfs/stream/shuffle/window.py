"""Windows: a shuffled reader's blocks read, their records numbered and mixed, and handed out
in that mixed order as blocks the stream's face takes like any other (``MixedBlock``).

Invariants:
- A window's records are numbered in its blocks' order (``WindowSpec.blocks``) and, within
  a block, in file order; the block's pieces are read as the stream's own shard readers read
  a range (a line that crosses a block's end is read whole by the block it starts in; a
  Parquet row group by the block that holds its position): a line piece in one read and one
  scan (``line_piece``; the scan compiled where it is built, ``scan_lines``), the shard
  reader where one read does not settle it. Position ``q`` of the window delivers record
  ``order[q]``, ``order`` the window key's ``permutation``: record order is decided here.
- ``MixedBlock`` ``k`` of a window holds positions ``[a, b)``; its records, hashes and parsed
  rows are those of its window at ``order[a:b]``, so dedup decides them in the mixed order
  (the first occurrence of a record is the first in the shuffled order), and a batch's
  coordinate is that of its last record. The window is read, hashed and parsed once.
- ``EpochReader`` hands out the windows of one reader's epoch from a resume point (a window
  and a position in it): only that window is read again, nothing before it. Once the
  stream says so (``read_ahead``: after a restart's first batch), while a window is handed
  out the next one is read (and hashed, with dedup) in a thread (the reads take turns in
  window order): memory is two windows of bytes, and a window's parsed table. The first
  ``FIRST_MIXED`` positions after opening are handed out in blocks of the stream's batch
  size (``first_block``) at most, also where they cross into the next window, so a
  restart's first batch parses only about its own rows wherever the checkpoint falls in
  its window.
  The kernel is asked to read the local pieces of the next ``ADVISED_AHEAD`` windows into the
  page cache in the background (advice: what is read, and when, does not change).
- A line window's records are cut from one buffer that joins its blocks' lines (a line
  without a terminator, a shard's last, gets one in the buffer), so a mixed block's records
  are one compiled cut, and a parsed window one parse of the buffer (by the read-ahead worker
  that first needs it), whose rows each mixed block takes; where that parse fails the window
  is parsed block by block, which names the shard and offset of a bad record.
"""

from __future__ import annotations

import threading
from bisect import bisect_right
from collections import OrderedDict, deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from faultfs.core.coord import StreamCoordinate
from faultfs.sources import local_path
from faultfs.stream.columns import block_table, concat, take_rows
from faultfs.stream.hashing import record_hashes, span_hashes
from faultfs.stream.readers import (
    LINE_BLOCK,
    TAIL_PEEK,
    LineShardReader,
    ParquetShardReader,
    RecordBlock,
    check_size,
    open_parquet,
)
from faultfs.stream.shards import Shard, ShardFile
from faultfs.stream.shuffle.plan import EpochGrid, WindowSpec, permutation

try:  # the compiled cut and line scan (setup.py); optional: the same records by slicing
    import faultfs.stream._cut as _compiled
except ImportError:  # pragma: no cover - built wherever a compiler is
    _compiled = None
_cut = getattr(_compiled, "cut", None)
_lines = getattr(_compiled, "lines", None)  # a build older than the scan has none

MIXED_BLOCK = 65536  # positions per mixed block: what one read-ahead step makes
FIRST_MIXED = 4096  # the first positions after opening, in blocks of at most this many (the
# next window's first ones too, where a restart's first batch crosses into it): a restart's
# first batch parses these rows, not a whole window's
WINDOWS_AHEAD = 1  # windows read ahead: the next window is read while this one is used
ADVISED_AHEAD = 2  # windows past the one being read whose local pieces the kernel is asked to
# read into the page cache (``ShardFiles.advise``): their cold pages arrive in parallel, in
# the background, instead of one piece's disk latency after another
OPEN_SHARDS = 64  # shards a reader keeps open between blocks (an S3 shard's open is a HEAD)
PARSE_THREADS_FROM = 2 << 20  # a smaller window is parsed on its worker's thread alone (the
# read-ahead's two workers parse two at once): pyarrow's threads cost ~20 % more CPU on 1 MiB


class ShardFiles:
    """The shards a reader's windows read, each opened once and kept open for the next
    blocks (at most ``OPEN_SHARDS``), with its Parquet footer read once. One thread at a
    time uses it."""

    def __init__(self, shards: Sequence[Shard]) -> None:
        self._shards = shards
        self._open: OrderedDict[int, tuple[ShardFile, Any]] = OrderedDict()

    def get(self, shard_id: int) -> tuple[ShardFile, Any]:
        """The open shard and its ``pq.ParquetFile`` (None for a line shard)."""
        if shard_id in self._open:
            self._open.move_to_end(shard_id)
            return self._open[shard_id]
        shard = self._shards[shard_id]
        file = shard.open()
        try:
            parquet = open_parquet(shard, file) if shard.format == "parquet" else None
        except BaseException:
            file.close()
            raise
        self._open[shard_id] = (file, parquet)
        while len(self._open) > OPEN_SHARDS:
            self._open.popitem(last=False)[1][0].close()
        return file, parquet

    def advise(self, spec: WindowSpec, grid: EpochGrid) -> None:
        """Ask the kernel to read the pieces of a window's blocks in local line shards into
        the page cache in the background (``ShardFile.prefetch``; advice: it changes what is
        read nowhere). A shuffled reader jumps between blocks, where the kernel's readahead,
        made for a file read in order, does not help."""
        for b in spec.blocks:
            for shard_id, lo, hi in grid.pieces(b):
                shard = self._shards[shard_id]
                if shard.format != "lines" or local_path(shard.url) is None:
                    continue
                start = lo - 1 if lo else 0  # line_piece's read
                end = grid.sizes[shard_id] if hi is None else hi + TAIL_PEEK
                self.get(shard_id)[0].prefetch(start, end - start)

    def close(self) -> None:
        while self._open:
            self._open.popitem()[1][0].close()


def read_blocks(
    spec: WindowSpec, grid: EpochGrid, shards: Sequence[Shard], files: ShardFiles
) -> list[RecordBlock]:
    """The record blocks of a window's blocks, in its numbering order (module doc)."""
    out: list[RecordBlock] = []
    for b in spec.blocks:
        for shard_id, lo, hi in grid.pieces(b):
            shard = shards[shard_id]
            file, parquet = files.get(shard_id)
            size = grid.sizes[shard_id]
            if shard.format == "lines":
                piece = line_piece(shard, shard_id, file, lo, hi, size)
                if piece is not False:
                    if piece is not None:
                        out.append(piece)
                    continue
            reader: LineShardReader | ParquetShardReader
            if shard.format == "lines":
                reader = LineShardReader(
                    shard, shard_id, 0, 0, ranges=[(lo, hi, lo == 0)], expected_size=size,
                    file=file, first_read=LINE_BLOCK,
                )
            else:
                reader = ParquetShardReader(
                    shard, shard_id, 0, 0, 0, pieces=[((lo, 0), None if hi is None else (hi, 0))],
                    expected_size=size, file=file, parquet=parquet,
                )
            try:
                while (block := reader.next_block()) is not None:
                    out.append(block)
            finally:
                reader.close()
    return out


def line_piece(shard: Shard, shard_id: int, file: ShardFile, lo: int, hi: int | None,
               size: int) -> RecordBlock | bool | None:
    """The lines that start in ``[lo, hi)`` of a line shard (``hi`` None: its end) from one
    read, as one block over that read's bytes (no copy: the window joins its blocks' records
    anyway); None when none starts there. False where one read does not settle it (the
    line that crosses ``lo`` or ``hi`` reaches past the read, or the shard's last line has
    no terminator): ``LineShardReader`` then reads the piece, as it reads any range."""
    check_size(shard, file, size)
    end = size if hi is None else hi
    start = lo - 1 if lo else 0  # a line starts at lo when the byte before it is a "\n"
    want = min(end + (0 if hi is None else TAIL_PEEK), size) - start
    if file.tell() != start:
        file.seek(start)
    buf = file.read(want)
    if len(buf) != want:
        return False
    found = scan_lines(buf, bool(lo), end - start)
    if found is None:
        return False
    starts, stops, ends = found
    if not ends.size:
        return None
    return RecordBlock(
        kind="lines", shard=shard, shard_id=shard_id, ends=ends + start, global_start=0,
        data=buf, data_offset=start, starts=starts, stops=stops,
    )


def scan_lines(buf: bytes, skip: bool, end: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The lines of ``buf`` that start before ``end``: int64 ``(starts, stops, ends)``, line
    ``i`` being ``buf[starts[i]:stops[i]]`` without its terminator (nor the "\r" of a
    "\r\n") and ``ends[i]`` just past its "\n"; blank lines left out. ``skip``: the first
    line is the tail of one that starts before ``buf`` (the lines begin after the first
    "\n"). None where ``buf`` does not settle it: ``skip`` and no "\n", or a line that
    starts before ``end`` has no "\n" in ``buf``. One compiled pass where it is built
    (``_cut.lines``, without the GIL), else numpy: the same lines."""
    if _lines is not None:
        got = _lines(buf, skip, end)
        if got is None:
            return None
        starts, stops, ends = (np.frombuffer(b, dtype=np.int64) for b in got)
        return starts, stops, ends
    arr = np.frombuffer(buf, dtype=np.uint8)
    nl = np.flatnonzero(arr == 10).astype(np.int64)  # each line's "\n"
    if skip and not nl.size:
        return None
    first = int(nl[0]) + 1 if skip else 0
    ends = nl[nl >= first] + 1
    starts = np.empty_like(ends)
    if ends.size:
        starts[0] = first
        starts[1:] = ends[:-1]
    k = int(np.searchsorted(starts, end))
    tail = int(ends[k - 1]) if k else first  # the next line's start
    if k == ends.size and tail < min(end, len(buf)):
        return None  # a line that starts before end has no "\n" in buf
    starts, ends = starts[:k], ends[:k]
    stops = ends - 1
    if buf.find(b"\r", first, tail) >= 0:  # strip the "\r" of "\r\n"
        stops = stops - ((stops > starts) & (arr[np.maximum(stops - 1, 0)] == 13))
    keep = stops > starts
    if not keep.all():  # empty lines are not records
        starts, stops, ends = starts[keep], stops[keep], ends[keep]
    return starts, stops, ends


class _Source:
    """What a window keeps of one record block: enough for coordinates and, for a line
    block, to be made again from the joined buffer (a block-by-block parse)."""

    __slots__ = ("block", "cut", "data_offset", "ends", "first", "head", "joined_at", "kind",
                 "row_group_idx", "shard", "shard_id", "terminated")

    def __init__(self, block: RecordBlock, first: int, joined_at: int) -> None:
        self.kind = block.kind
        self.shard = block.shard
        self.shard_id = block.shard_id
        self.row_group_idx = block.row_group_idx
        self.ends = block.ends
        self.first = first  # the window's number of its first record
        self.joined_at = joined_at  # where its bytes start in the joined buffer (lines)
        # lines: its bytes in the buffer are those of its records, from the first one's start
        self.head = 0 if block.starts is None else int(block.starts[0])
        self.data_offset = block.data_offset + self.head
        self.terminated = block.terminated
        self.cut = int(block.ends[-1]) - self.data_offset
        self.block: RecordBlock | None = None if block.kind == "lines" else block


class Window:
    """One window's records, numbered, and the permutation they are delivered in."""

    def __init__(
        self, index: int, spec: WindowSpec, blocks: list[RecordBlock], global_zero: int
    ) -> None:
        self.index = index
        self.spec = spec
        self.count = sum(b.count for b in blocks)
        self.order = permutation(spec.key, self.count)
        self.global_zero = global_zero  # global_row_idx just after position q: zero + q + 1
        self._lock = threading.Lock()
        self._hashes: np.ndarray | None = None
        self._table: tuple[Any, Any] | None = None  # (schema, table)
        self._records: list[Any] | None = None
        self.lines = all(b.kind == "lines" for b in blocks)
        self._sources: list[_Source] = []
        firsts, at, parts, starts, stops = [], 0, [], [], []
        joined_at = 0
        for b in blocks:
            src = _Source(b, at, joined_at)
            self._sources.append(src)
            firsts.append(at)
            at += b.count
            if self.lines:
                assert b.starts is not None and b.stops is not None
                parts.append(memoryview(b.data)[src.head : src.head + src.cut])
                starts.append(b.starts + (joined_at - src.head))
                stops.append(b.stops + (joined_at - src.head))
                joined_at += src.cut
                if not b.terminated:  # a shard's last line: terminated in the buffer
                    parts.append(b"\n")
                    joined_at += 1
        self._firsts = firsts
        if self.lines:
            self.data = b"".join(parts)
            self.starts = np.concatenate(starts) if starts else np.empty(0, dtype=np.int64)
            self.stops = np.concatenate(stops) if stops else np.empty(0, dtype=np.int64)
            self.starts = self.starts.astype(np.int64, copy=False)
            self.stops = self.stops.astype(np.int64, copy=False)

    # -- what a position holds -------------------------------------------------------------

    def records(self, idx: np.ndarray) -> list[Any]:
        """The records numbered ``idx``, in that order: ``bytes`` lines, or Parquet rows."""
        if self.lines:
            starts, stops = self.starts[idx], self.stops[idx]
            if _cut is not None:
                out: list[Any] = _cut(self.data, starts, stops)
                return out
            data = self.data
            return [data[a:b] for a, b in zip(starts.tolist(), stops.tolist(), strict=True)]
        with self._lock:
            if self._records is None:
                every: list[Any] = []
                for src in self._sources:
                    assert src.block is not None
                    every += src.block.records
                self._records = every
        every = self._records
        return [every[i] for i in idx.tolist()]

    def hashes(self, *, may_import: bool = True) -> np.ndarray:
        """The xxh3_64 hash of every record, by number (made once)."""
        with self._lock:
            if self._hashes is None:
                if self.lines:
                    self._hashes = span_hashes(self.data, self.starts, self.stops,
                                               may_import=may_import)
                else:
                    parts = [record_hashes(self._block(i), may_import=may_import)
                             for i in range(len(self._sources))]
                    self._hashes = (np.concatenate(parts) if parts
                                    else np.empty(0, dtype=np.uint64))
            return self._hashes

    def table(self, schema: Any) -> Any:
        """Every record parsed, by number, as one ``pyarrow.Table`` (made once per schema)."""
        with self._lock:
            if self._table is None or self._table[0] is not schema:
                self._table = (schema, self._parse(schema))
            return self._table[1]

    def _parse(self, schema: Any) -> Any:
        """Every record parsed (a window of no record is never parsed: it has no block)."""
        assert self._sources
        if self.lines and len({s.shard.parse_as for s in self._sources}) == 1:
            try:  # one array a column: a take from many chunks concatenates them each time
                threads = len(self.data) > PARSE_THREADS_FROM
                return block_table(self._whole_block(), schema, threads=threads).combine_chunks()
            except Exception:  # parsed block by block below, which names the bad record
                pass
        tables = [block_table(self._block(i), schema) for i in range(len(self._sources))]
        return concat(tables).combine_chunks()

    def _whole_block(self) -> RecordBlock:
        """The joined buffer as one line block, for one parse of the whole window (its
        offsets are the buffer's, not a shard's: an error is found again block by block)."""
        ends = self.stops + 1
        ends[-1] = len(self.data)  # all of the buffer is whole lines
        return RecordBlock(
            kind="lines", shard=self._sources[0].shard, shard_id=0, ends=ends, global_start=0,
            data=self.data, data_offset=0, starts=self.starts, stops=self.stops,
        )

    def _block(self, i: int) -> RecordBlock:
        """Record block ``i`` as it was read (a line block made again from the buffer)."""
        src = self._sources[i]
        if src.block is not None:
            return src.block
        lo, hi, at = src.first, src.first + int(src.ends.size), src.joined_at
        return RecordBlock(
            kind="lines", shard=src.shard, shard_id=src.shard_id, ends=src.ends,
            global_start=self.global_zero + lo, data=self.data[at : at + src.cut],
            data_offset=src.data_offset, starts=self.starts[lo:hi] - at,
            stops=self.stops[lo:hi] - at, terminated=src.terminated,
        )

    def coord_after(self, number: int, global_row_idx: int) -> StreamCoordinate:
        """The coordinate just after record ``number`` (in its shard), with
        ``global_row_idx``: where a batch ending with it resumes in file terms."""
        k = bisect_right(self._firsts, number) - 1
        src = self._sources[k]
        end = int(src.ends[number - src.first])
        if src.kind == "lines":
            return StreamCoordinate(src.shard_id, end, 0, 0, 0, global_row_idx)
        return StreamCoordinate(src.shard_id, 0, src.row_group_idx, 0, end, global_row_idx)

    def rows(self, idx: np.ndarray, schema: Any) -> Any:
        """The records numbered ``idx``, in that order, parsed: taken from the window's table
        (parsed once, in file order: a parse of the lines as read and a take of the rows cost
        ~450 + 20 ns a record here, joining the lines in the mixed order and parsing them
        ~800). A few rows (``FIRST_MIXED`` at most, under half the window: a restart's first
        mixed block) of a line window not parsed yet are parsed from their own lines joined;
        where that fails, the window's table names the bad record."""
        few = int(idx.size) <= FIRST_MIXED and int(idx.size) * 2 < self.count
        if (few and self._table is None and self.lines
                and len({s.shard.parse_as for s in self._sources}) == 1):
            lengths = self.stops[idx] - self.starts[idx]
            stops = np.cumsum(lengths + 1) - 1  # each line and its "\n"
            block = RecordBlock(
                kind="lines", shard=self._sources[0].shard, shard_id=0, ends=stops + 1,
                global_start=0, data=b"\n".join(self.records(idx)) + b"\n", data_offset=0,
                starts=stops - lengths, stops=stops,
            )
            try:  # on this thread alone: a hand-off to pyarrow's threads costs a restart
                # more than the parse of a few rows, on a busy host several times more
                return block_table(block, schema, threads=False)
            except Exception:  # the window's table, parsed block by block, names the record
                pass
        return take_rows(self.table(schema), idx)

    def prepare(self, hashes: bool, parse: tuple[bool, Any]) -> None:
        """Make the hashes and the parsed table ahead, as the stream will want them."""
        if hashes:
            self.hashes()
        del parse  # parsed by the read-ahead workers, two at once, not by the window's reader


class MixedBlock:
    """Positions ``[a, b)`` of a window: its records in the mixed order, as a block."""

    kind = "mixed"
    __slots__ = ("_records", "a", "count", "global_start", "idx", "window")

    def __init__(self, window: Window, a: int, b: int) -> None:
        self.window = window
        self.a = a
        self.count = b - a
        self.idx = window.order[a:b]
        self.global_start = window.global_zero + a
        self._records: list[Any] | None = None

    @property
    def records(self) -> list[Any]:
        if self._records is None:
            self._records = self.window.records(self.idx)
        return self._records

    def records_at(self, sel: np.ndarray) -> list[Any]:
        if self._records is not None:
            return [self._records[i] for i in sel.tolist()]
        return self.window.records(self.idx[sel])

    def hashes(self, *, may_import: bool = True) -> np.ndarray:
        return self.window.hashes(may_import=may_import)[self.idx]

    def table(self, schema: Any) -> Any:
        return self.window.rows(self.idx, schema)

    def coord_after(self, i: int) -> StreamCoordinate:
        return self.window.coord_after(int(self.idx[i]), self.global_start + i + 1)

    def progress_after(self, i: int) -> tuple[int, int]:
        """(window, position) just after record ``i``: the next window's start after the last."""
        q = self.a + i + 1
        w = self.window
        return (w.index, q) if q < w.count else (w.index + 1, 0)


class EpochReader:
    """The mixed blocks of one reader's epoch, from a window and a position in it."""

    def __init__(
        self,
        shards: Sequence[Shard],
        grid: EpochGrid,
        windows: Sequence[WindowSpec],
        first: int,
        position: int,
        global_row_idx: int,
    ) -> None:
        """``first``/``position``: where the epoch resumes (positions of window ``first``
        consumed); ``global_row_idx``: records scanned before that point."""
        self.shards = shards
        self.grid = grid
        self.windows = windows
        self._files = ShardFiles(shards)
        self._next = first  # the window taken next
        self._resume: int | None = position  # where the first window taken starts
        # the reads take turns in window order (the files are one reader's), and each
        # window's global_row_idx follows from the count of the one before
        self._turns = threading.Condition()
        self._turn = first
        self._advised = first  # the next window whose pieces the kernel is told of
        if first < len(windows):
            position = max(position, windows[first].start)
        self._zero = global_row_idx - position  # global_zero of the window read next
        self._window: Window | None = None
        self._pos = 0
        self._first_left = FIRST_MIXED  # of the first positions after opening: small blocks
        self.first_block = FIRST_MIXED  # their size: the stream's batch size, where smaller
        self._ahead: deque[Future[Window]] = deque()  # windows _next.. being read, in order
        self._submitted = first
        # the next window read in a thread while this one is used: set by the stream once a
        # restart's first batch is out (that batch shares the CPU and the GIL with no read)
        self.read_ahead = False
        self._pool: ThreadPoolExecutor | None = None
        # what each window read ahead is made ready for: (its hashes, (parsed, schema))
        self.want: tuple[bool, tuple[bool, Any]] = (False, (False, None))

    def _read(self, index: int, *, ahead: bool = False) -> Window:
        """Window ``index``, read in its turn; made ready (``want``) if read ahead."""
        with self._turns:
            while self._turn != index:
                self._turns.wait()
        try:
            spec = self.windows[index]
            self._advise(index)  # its pieces read in parallel, if not told of before
            blocks = read_blocks(spec, self.grid, self.shards, self._files)
            if ahead:  # not before a restart's first batch
                self._advise(index + ADVISED_AHEAD)
            zero = self._zero
            if index + 1 < len(self.windows):
                self._zero = zero + sum(b.count for b in blocks) - self.windows[index + 1].start
        finally:
            with self._turns:
                self._turn += 1
                self._turns.notify_all()
        window = Window(index, spec, blocks, zero)
        if ahead:
            window.prepare(*self.want)
        return window

    def _advise(self, last: int) -> None:
        """Tell the kernel of the windows up to ``last`` not told of yet (in a read's turn:
        the files are one thread's at a time)."""
        last = min(last, len(self.windows) - 1)
        while self._advised <= last:
            self._files.advise(self.windows[self._advised], self.grid)
            self._advised += 1

    def _read_ahead(self) -> None:
        """Keep the next window being read in a thread."""
        while self._submitted < len(self.windows) and len(self._ahead) < WINDOWS_AHEAD:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(WINDOWS_AHEAD, thread_name_prefix="faultfs-window")
            self._ahead.append(self._pool.submit(self._read, self._submitted, ahead=True))
            self._submitted += 1

    def next_block(self) -> MixedBlock | None:
        """The next positions of the epoch (None: its end); the next window read ahead once
        ``read_ahead`` is set (module doc)."""
        if self.read_ahead:
            self._read_ahead()
        while True:
            window = self._window
            if window is None:
                if self._next >= len(self.windows):
                    return None
                if self._ahead:
                    window = self._ahead.popleft().result()
                else:  # nothing read ahead (the first window): read here
                    window = self._read(self._next)
                start = window.spec.start if self._resume is None else self._resume
                self._resume = None
                self._window, self._pos = window, max(start, window.spec.start)
                self._next += 1
                self._submitted = max(self._submitted, self._next)
                if self.read_ahead:
                    self._read_ahead()
            if self._pos < window.count:
                a = self._pos
                step = min(self._first_left, self.first_block) if self._first_left else MIXED_BLOCK
                self._pos = min(window.count, a + step)
                self._first_left = max(0, self._first_left - (self._pos - a))
                return MixedBlock(window, a, self._pos)
            self._window = None

    @property
    def window_count(self) -> int:
        return len(self.windows)

    def close(self) -> None:
        """Wait for the windows being read ahead (they use the files), then close them."""
        while self._ahead:
            self._ahead.popleft().exception()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        self._files.close()
        self._window = None
