"""RecordStream: resumable, deduplicating batches of records over multi-shard sources, with
exactly-once delivery of committed unique records across crashes.

Invariants:
- The durable state is one DualMetadataManager checkpoint: the coordinate just after the last
  committed batch, that batch's id, and the xxh3_64 hashes of every record delivered up to it
  (the WAL). Batch ids count from 1; ``committed_batch_id`` 0 means nothing committed.
- ``commit(b)`` writes the coordinate right after batch ``b`` together with the hashes of all
  batches up to ``b``, in one checkpoint; batches handed out after ``b`` stay pending, so a
  consumer may prefetch ahead of its commits.
- Reopening with the same sources and state continues with the first record after the last
  committed batch: the stream opens only shard ``shard_id``, seeks to ``byte_offset`` (lines)
  or opens row group ``row_group_idx`` and skips ``row_offset_in_page`` rows (Parquet). No
  earlier shard is opened, read or hashed. Given the same committed hashes, scanning is
  deterministic, so the batches after a resume are the ones the crashed run would have made.
- With ``dedup``, a record whose hash was committed or handed out before is skipped: it still
  counts in ``global_row_idx`` (raw records scanned), but never reaches a batch. Duplicates
  are decided once per block, with arrays (``DeliveredHashes``).
- Every ``format`` yields the same batches: the same records (a parsed row is its raw
  record, parsed; dedup is by the raw record's bytes), the same batch ids and coordinates,
  so a checkpoint written while reading one format resumes in any other.
- Parsed formats and dedup read ``READ_AHEAD`` blocks ahead, in worker threads: each block
  is split (raw) or parsed (pyarrow parses without the GIL), hashed and decided (dedup), and
  its fresh records picked, while the consumer uses the block before it. The workers take
  turns on the reader, in block order (``_Turns``), and decide their blocks in that order
  too, so each is decided against every block before it; only they touch the reader and the
  delivered set while a read-ahead is in flight. The first block after opening is handed out
  before any read-ahead starts. A block's errors are raised when the stream reaches that
  block, as without read-ahead; ``close`` waits for the workers.
- A partitioned stream (``rank``/``world_size``, ``worker``/``num_workers``) is one reader of
  a partition (``faultfs.stream.partition``): it reads only the shards that hold its records,
  only its records in them, in the same order, and keeps its own state file; with dedup it
  also skips the hashes carried from before the last repartition. Everything above holds per
  reader; dedup is per reader (two readers both deliver a record that is in both parts).
- A partitioned reader resumes only from a checkpoint that can be one of its own commits
  (``resumes_in``): one inside its part, or past the end of one of its ranges by no more than
  the line that crosses that end (that line is read from its end back, only then). Anything
  else (the state of another reader) is refused, naming the state and the reader, before a
  record is delivered: on opening, or when the checkpoint's shard is opened (a Parquet
  checkpoint needs its footer, a line past a range's end its bytes).
- One stream at a time has a state file open (``DualMetadataManager.open(exclusive=True)``):
  a second stream over it, in any process, is refused until the first is closed.
- An error while reading a block (a failed read, a malformed record) ends the stream object:
  records already taken for the unfinished batch would otherwise be lost, so later calls
  refuse; reopening from the checkpoint continues from the last commit.
"""

from __future__ import annotations

import os
import threading
from bisect import bisect_left
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from faultfs.core.coord import StreamCoordinate
from faultfs.errors import InvalidInput
from faultfs.store.metadata import DualMetadataManager
from faultfs.stream.columns import block_table, concat, import_arrow, take_rows
from faultfs.stream.delivered import DeliveredHashes, first_occurrences
from faultfs.stream.hashing import record_hashes
from faultfs.stream.partition import (
    ReaderPlan,
    load_base,
    plan_reader,
    shard_pieces,
)
from faultfs.stream.readers import (
    LineRange,
    LineShardReader,
    ParquetShardReader,
    Piece,
    RecordBlock,
    records_at,
)
from faultfs.stream.shards import Shard, expand_shards

FORMATS = ("raw", "arrow", "pydict")
READ_AHEAD = 2  # blocks on their way: two parses at once keep both of pyarrow's threads
# busy while the next block is read (and with dedup, one block's hashing overlaps another's read)
_NO_HASHES = np.empty(0, dtype=np.uint64)


@dataclass
class _HandedOut:
    """A batch given to the consumer and not yet committed."""

    batch_id: int
    coord: StreamCoordinate  # just after its last record
    hashes: list[np.ndarray]  # of its records, in order (empty without dedup)


def resumes_in(pieces: list[Piece], key: tuple[int, int]) -> bool:
    """Whether a checkpoint at ``key`` (``(byte offset, 0)`` in a line shard, ``(position of
    the row group, rows of it consumed)`` in a Parquet shard) lies in one of ``pieces``: after
    its start, at or before its end. A commit is just after a record the reader owns, whose
    key is at or after its piece's start and before its end, so every checkpoint of a reader
    lies in one of its pieces but one: the line that crosses a piece's end is read whole, and
    the checkpoint after it lies past that end (there ``owns`` of the line ending at the
    checkpoint decides)."""
    return any(a < key and (b is None or key <= b) for a, b in pieces)


def owns(pieces: list[Piece], key: tuple[int, int]) -> bool:
    """Whether the record whose key is ``key`` is in one of ``pieces``."""
    return any(a <= key and (b is None or key < b) for a, b in pieces)


def line_ranges(pieces: list[Piece], resume: int | None) -> list[LineRange]:
    """A line shard's pieces (partition keys) as the byte ranges of the line starts they own,
    from ``resume`` (a line start: the offset just after the last committed record) on."""
    ranges: list[LineRange] = []
    for (a_pos, a_row), b in pieces:
        lo = a_pos + (1 if a_row else 0)  # a line's key is (its first byte, 0)
        stop = None if b is None else b[0] + (1 if b[1] else 0)
        if resume is not None:
            if stop is not None and stop <= resume:
                continue
            if resume >= lo:
                ranges.append((resume, stop, True))
                continue
        ranges.append((lo, stop, lo == 0))
    return ranges


_Firsts = tuple[np.ndarray, np.ndarray, np.ndarray]  # hashes, distinct sorted, first index
# which records of a block are delivered: their indices (None: all), their hashes, their count
_Fresh = tuple[np.ndarray | None, np.ndarray, int]
_View = tuple[str, Any]  # the records' format ("raw" or "arrow") and schema (None for raw)


def block_firsts(block: RecordBlock, *, may_import: bool = True) -> _Firsts:
    """The xxh3_64 hash of each record of ``block``, the distinct hashes (sorted) and the
    index of each one's first occurrence: what dedup needs of a block before it looks at the
    delivered set (``may_import``: see ``record_hashes``)."""
    hashes = record_hashes(block, may_import=may_import)
    unique, first = first_occurrences(hashes)
    return hashes, unique, first


@dataclass(frozen=True)
class _Ahead:
    """A block read ahead: its fresh records (decided in block order) in ``view``."""

    block: RecordBlock | None  # None: the reader's end
    fresh: _Fresh = (None, _NO_HASHES, 0)
    view: _View = ("raw", None)
    records: Any = None


class _Turns:
    """The read-ahead workers' turns on one reader: ticket ``k`` reads the k-th block asked
    for, after ticket ``k - 1`` has read its own; once a read found the reader's end (or
    failed), later tickets read nothing. Dedup decisions take turns the same way
    (``in_order``), so that each block is decided against every block before it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._issued = 0
        self._turn = 0
        self._decided = 0
        self.ended = False

    def issue(self) -> int:
        self._issued += 1
        return self._issued - 1

    def take(self, ticket: int, read: Any) -> Any:
        with self._cond:
            while self._turn != ticket:
                self._cond.wait()
            try:
                if self.ended:
                    return None
                block = read()
                if block is None:
                    self.ended = True
                return block
            except BaseException:
                self.ended = True
                raise
            finally:
                self._turn += 1
                self._cond.notify_all()

    def in_order(self, ticket: int, work: Any) -> Any:
        """``work()`` (None: nothing) once every earlier ticket has passed its own turn
        here; each ticket passes once, also when it fails before it gets here."""
        with self._cond:
            while self._decided != ticket:
                self._cond.wait()
        try:
            return None if work is None else work()
        finally:
            with self._cond:
                self._decided += 1
                self._cond.notify_all()


class RecordStream:
    """Batches of records with crash-safe commits: raw records (``bytes`` lines or Parquet row
    dicts), or parsed in bulk into columns (``format="arrow"``: a ``pyarrow.Table`` per batch;
    ``"pydict"``: a dict of column lists).

    >>> stream = RecordStream("data/*.jsonl", "run.meta")        # doctest: +SKIP
    >>> for batch_id, records in stream.batches(1024):           # doctest: +SKIP
    ...     train(records); stream.commit(batch_id)
    >>> for batch_id, table in stream.batches(1024, format="arrow"):  # doctest: +SKIP
    ...     train(table); stream.commit(batch_id)
    """

    def __init__(
        self,
        sources: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
        state: str | os.PathLike[str],
        *,
        dedup: bool = True,
        fs_options: Mapping[str, Any] | None = None,
        rank: int = 0,
        world_size: int = 1,
        worker: int = 0,
        num_workers: int = 1,
        reader_state: str | os.PathLike[str] | None = None,
        repartition: bool = False,
    ) -> None:
        """``state``: the checkpoint (one unpartitioned reader), or the name the files of a
        partitioned stream start with. ``rank``/``world_size`` and ``worker``/``num_workers``:
        this reader's place in a partition (see ``faultfs.stream.partition``); its state is
        ``<state>.rank-R.worker-W.meta`` unless ``reader_state`` gives a template with
        ``{rank}`` and ``{worker}``. ``repartition``: when the recorded partition has another
        ``world_size`` or ``num_workers``, replace it (otherwise that is refused)."""
        self.shards: list[Shard] = expand_shards(sources, fs_options)
        self.plan: ReaderPlan = plan_reader(
            self.shards,
            state,
            rank=rank,
            world_size=world_size,
            worker=worker,
            num_workers=num_workers,
            reader_state=reader_state,
            repartition=repartition,
        )
        try:
            self._open_state(os.fspath(state), rank, worker, dedup)
        except BaseException:
            self.plan.release()  # a reader that did not open holds no lock
            raise

    def _open_state(self, state: str, rank: int, worker: int, dedup: bool) -> None:
        """The rest of ``__init__``: this reader's checkpoint, resume point and hashes."""
        part = self.plan.partition
        self._pieces = shard_pieces(self.plan.intervals, len(self.shards)) if part else None
        self._own_shards = sorted(self._pieces) if self._pieces is not None else []
        self._meta = DualMetadataManager.open(self.plan.state_path, exclusive=True)
        try:
            coord = self._meta.coord
            if coord.shard_id > len(self.shards):
                raise InvalidInput(
                    f"{self._meta.meta_path}: checkpoint is at shard {coord.shard_id} but the "
                    f"sources expand to {len(self.shards)} shards (different sources?)"
                )
            # a line checkpoint past the end of one of this reader's ranges: its last line is
            # checked when its shard is opened (``_open_reader``)
            self._past_end = False
            if (
                self._pieces is not None
                and coord != StreamCoordinate()
                and coord.shard_id < len(self.shards)
            ):
                pieces = self._pieces.get(coord.shard_id)
                if pieces is None:
                    raise InvalidInput(
                        f"{self._meta.meta_path}: checkpoint is at shard {coord.shard_id}, which "
                        f"holds no records of reader rank {rank}, worker {worker} "
                        "(a state of another reader or partition?)"
                    )
                if self.shards[coord.shard_id].format == "lines":  # Parquet: when opened
                    key = (coord.byte_offset, 0)
                    if not resumes_in(pieces, key):
                        self._past_end = any(b is not None and b < key for _, b in pieces)
                        if not self._past_end:
                            raise self._not_mine(coord)
            self.dedup = dedup
            committed = None
            if dedup and self._meta.dedup_count:
                committed = self._meta.committed_hashes()
            if dedup and part is not None and part.base_count:
                base = load_base(state, part)
                committed = base if committed is None else np.concatenate((base, committed))
            self._delivered = DeliveredHashes(
                committed, copy=False  # a fresh array read from the WAL: sorted in place
            )
        except BaseException:
            self._meta.close()
            raise
        self._resume = coord
        self._shard_id = self._next_shard(coord.shard_id)
        self._reader: LineShardReader | ParquetShardReader | None = None
        self._block: RecordBlock | None = None
        # which of the block's records will be delivered: their indices in the block (None:
        # all of them) and hashes; the records in the format asked for, made once per block
        self._fresh: _Fresh = (None, _NO_HASHES, 0)
        self._view: tuple[str, Any, Any] | None = None  # (format, schema, records)
        # the next blocks of the open reader, each read, decided and made into records ahead
        self._ahead: deque[Future[_Ahead]] = deque()
        self._turns: _Turns | None = None  # the workers' turns on the open reader
        self._pool: ThreadPoolExecutor | None = None
        self._opened = True  # no block handed out yet: the first is read without read-ahead
        self._pos = 0  # next index into the fresh records
        self._position = coord  # just after the last record handed out
        self._scanned = coord.global_row_idx  # raw records scanned, lookahead included
        self._next_batch_id = self._meta.committed_batch_id + 1
        self._handed_out: deque[_HandedOut] = deque()
        self._failed: BaseException | None = None

    # -- state -----------------------------------------------------------------------------

    @property
    def committed_batch_id(self) -> int:
        return self._meta.committed_batch_id

    @property
    def committed_coord(self) -> StreamCoordinate:
        return self._meta.coord

    @property
    def position(self) -> StreamCoordinate:
        """The coordinate just after the last batch handed out."""
        return self._position

    @property
    def resumed_from(self) -> StreamCoordinate:
        return self._resume

    @property
    def state_path(self) -> str:
        """This reader's checkpoint file."""
        return self.plan.state_path

    @property
    def committed_dedup_count(self) -> int:
        """Hashes in this reader's WAL at its last commit (carried hashes not included)."""
        return self._meta.dedup_count

    # -- reading ---------------------------------------------------------------------------

    def _next_shard(self, shard_id: int) -> int:
        """The first shard at or after ``shard_id`` that holds records of this reader."""
        if self._pieces is None:
            return shard_id
        i = bisect_left(self._own_shards, shard_id)
        return self._own_shards[i] if i < len(self._own_shards) else len(self.shards)

    def _not_mine(self, coord: StreamCoordinate) -> InvalidInput:
        """The refusal of a checkpoint that cannot be one of this reader's commits."""
        if self.shards[coord.shard_id].format == "lines":
            where = f"byte {coord.byte_offset}"
        else:
            where = f"row {coord.row_offset_in_page} of row group {coord.row_group_idx}"
        return InvalidInput(
            f"{self._meta.meta_path}: checkpoint is at {where} of shard {coord.shard_id}, "
            f"outside the records of reader rank {self.plan.rank}, worker {self.plan.worker} "
            "(a state of another reader or partition?)"
        )

    def _open_reader(self) -> LineShardReader | ParquetShardReader | None:
        """A reader of the current shard from where this stream resumes in it (None: nothing
        of this shard is left for this reader, known without opening it). A partitioned
        reader's checkpoint is checked here against what opening learns (``resumes_in``)."""
        shard = self.shards[self._shard_id]
        resume = self._resume if self._shard_id == self._resume.shard_id else None
        global_start = self._scanned
        if self._pieces is None:
            if shard.format == "lines":
                return LineShardReader(
                    shard, self._shard_id, resume.byte_offset if resume else 0, global_start
                )
            return ParquetShardReader(
                shard,
                self._shard_id,
                resume.row_group_idx if resume else 0,
                resume.row_offset_in_page if resume else 0,
                global_start,
            )
        assert self.plan.partition is not None
        pieces = self._pieces[self._shard_id]
        size = self.plan.partition.shard_sizes[self._shard_id]
        past_end = resume is not None and self._past_end
        reader: LineShardReader | ParquetShardReader
        if shard.format == "lines":
            ranges = line_ranges(pieces, resume.byte_offset if resume else None)
            if not ranges and not past_end:
                return None
            reader = LineShardReader(
                shard, self._shard_id, 0, global_start, ranges=ranges, expected_size=size
            )
        else:
            reader = ParquetShardReader(
                shard,
                self._shard_id,
                resume.row_group_idx if resume else 0,
                resume.row_offset_in_page if resume else 0,
                global_start,
                pieces=pieces,
                expected_size=size,
            )
        try:
            if past_end:  # only the line that crosses a range's end may lead past it
                assert resume is not None and isinstance(reader, LineShardReader)
                start = reader.line_start(resume.byte_offset)
                if start is None or not owns(pieces, (start, 0)):
                    raise self._not_mine(resume)
            elif isinstance(reader, ParquetShardReader) and resume is not None:
                key = reader.resume_key()  # None: at the start, or refused when read
                if key is not None and not resumes_in(pieces, key):
                    raise self._not_mine(resume)
        except BaseException:
            reader.close()
            raise
        return reader

    def _next_block(self, view: _View) -> bool:
        """Load the next non-empty block into the lookahead buffer; False at the end.
        ``view``: the format (and schema) the records are wanted in, made ahead for the
        blocks after it."""
        while self._shard_id < len(self.shards):
            if self._reader is None:
                self._reader = self._open_reader()
                if self._reader is None:
                    self._shard_id = self._next_shard(self._shard_id + 1)
                    continue
            ahead = self._ahead.popleft().result() if self._ahead else None  # its error
            block = self._reader.next_block() if ahead is None else ahead.block
            if block is not None:
                self._block = block
                self._pos = 0
                self._view = None
                self._scanned = block.global_start + block.count
                self._fresh = self._decide(block) if ahead is None else ahead.fresh
                if ahead is not None and ahead.view[0] == view[0] and ahead.view[1] is view[1]:
                    self._view = (view[0], view[1], ahead.records)
                if self._opened:
                    self._opened = False  # a restart's first batch waits for no read-ahead
                elif view[0] != "raw" or self.dedup:  # raw records alone: no gain ahead
                    self._read_ahead(view)
                return True
            self._wait_ahead()  # the reads after the last block find nothing either
            self._reader.close()
            self._reader = None
            self._shard_id = self._next_shard(self._shard_id + 1)
        self._block = None
        return False

    def _read_ahead(self, view: _View) -> None:
        """Keep ``READ_AHEAD`` blocks of the open reader on their way, each split (raw) or
        parsed (``view``), hashed and decided (dedup), and its fresh records picked; the
        workers read and decide the blocks in turn, in the order they were asked for."""
        reader = self._reader
        assert reader is not None
        if not self._ahead:
            self._turns = _Turns()
        turns = self._turns
        assert turns is not None

        def work(ticket: int) -> _Ahead:
            decided = False
            try:
                block = turns.take(ticket, reader.next_block)
                if block is None:
                    return _Ahead(None)
                table = None if view[0] == "raw" else block_table(block, view[1])
                if self.dedup:
                    firsts = block_firsts(block)
                    decided = True
                    fresh = turns.in_order(ticket, lambda: self._decide(block, firsts))
                else:
                    fresh = self._decide(block)
                return _Ahead(block, fresh, view, self._fresh_records(block, fresh, table))
            finally:
                if not decided:
                    turns.in_order(ticket, None)

        if self._pool is None:
            self._pool = ThreadPoolExecutor(READ_AHEAD, thread_name_prefix="faultfs-stream")
        while len(self._ahead) < READ_AHEAD and not turns.ended:
            self._ahead.append(self._pool.submit(work, turns.issue()))

    def _wait_ahead(self) -> None:
        """Wait for every read-ahead in flight and drop them (their errors with them)."""
        while self._ahead:
            self._ahead.popleft().exception()
        self._turns = None

    def _decide(self, block: RecordBlock, firsts: _Firsts | None = None) -> _Fresh:
        """Which of the block's records will be delivered (``firsts``: its
        ``block_firsts``, made before). Called once per block, in block order.

        A record is a duplicate iff its hash was committed or delivered before this block, or
        appears earlier in this block. The block's first occurrences join the delivered set
        at once: they are handed out next, in order, or lost with this object.
        """
        n = block.count
        if not self.dedup:
            return None, _NO_HASHES, n
        if firsts is None:  # on the consumer's thread: no import on its way to a batch
            firsts = block_firsts(block, may_import=False)
        hashes, unique, first = firsts
        new = ~self._delivered.contains(unique)
        self._delivered.add(unique[new])
        if new.all() and unique.size == n:
            return None, hashes, n
        fresh = np.zeros(n, dtype=bool)
        fresh[first[new]] = True
        idx = np.flatnonzero(fresh)
        return idx, hashes[idx], int(idx.size)

    @staticmethod
    def _fresh_records(block: RecordBlock, fresh: _Fresh, table: Any) -> Any:
        """The fresh records of ``block``: raw (``table`` None) or the rows of ``table``."""
        idx = fresh[0]
        if table is not None:
            return table if idx is None else take_rows(table, idx)
        return block.records if idx is None else records_at(block, idx)

    def _records(self, fmt: str, schema: Any) -> Any:
        """The block's fresh records in ``fmt``: a list (raw) or a table (parsed)."""
        view = self._view
        if view is not None and view[0] == fmt and view[1] is schema:
            return view[2]
        block = self._block
        assert block is not None
        table = None if fmt == "raw" else block_table(block, schema)
        records = self._fresh_records(block, self._fresh, table)
        self._view = (fmt, schema, records)
        return records

    def _coord_after(self, block: RecordBlock, i: int) -> StreamCoordinate:
        end = int(block.ends[i])
        global_row_idx = block.global_start + i + 1
        if block.kind == "lines":
            return StreamCoordinate(block.shard_id, end, 0, 0, 0, global_row_idx)
        return StreamCoordinate(block.shard_id, 0, block.row_group_idx, 0, end, global_row_idx)

    def batches(
        self, batch_size: int, *, format: str = "raw", schema: Any = None
    ) -> Iterator[tuple[int, Any]]:
        """Yield ``(batch_id, records)`` until the sources are exhausted; the last batch may be
        short. Each batch is pending until ``commit`` of its id (or a later one).

        ``format``: ``"raw"`` (a list of ``bytes`` lines, or of Parquet rows as dicts),
        ``"arrow"`` (a ``pyarrow.Table``: jsonl parsed by pyarrow's JSON reader, one column
        per field; txt as one ``text`` column; Parquet columns as stored) or ``"pydict"``
        (that table as a dict of column lists). ``schema`` (a ``pyarrow.Schema``) fixes the
        columns and types of parsed batches; without it they are inferred per block.
        """
        if not isinstance(batch_size, int) or batch_size < 1:
            raise InvalidInput(f"batch_size must be a positive int, got {batch_size!r}")
        if format not in FORMATS:
            raise InvalidInput(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
        parsed = format != "raw"
        if parsed:
            import_arrow()
        if schema is not None and not parsed:
            raise InvalidInput("schema= applies to parsed batches (format='arrow' or 'pydict')")
        view = "arrow" if parsed else "raw"
        while True:
            if self._failed is not None:
                raise InvalidInput(
                    f"this stream failed earlier ({self._failed}); reopen it to resume from "
                    "its last commit"
                )
            try:
                batch = self._assemble(batch_size, view, schema)
            except BaseException as err:
                self._failed = err
                raise
            if batch is None:
                return
            records, hashes, coord = batch
            batch_id = self._next_batch_id
            self._next_batch_id += 1
            self._position = coord
            self._handed_out.append(_HandedOut(batch_id, coord, hashes))
            if format == "pydict":
                records = records.to_pydict()
            yield batch_id, records

    def _assemble(
        self, batch_size: int, view: str, schema: Any
    ) -> tuple[Any, list[np.ndarray], StreamCoordinate] | None:
        parts: list[Any] = []
        hashes: list[np.ndarray] = []
        count = 0
        last: tuple[RecordBlock, int] | None = None
        want: _View = ("raw", None) if view == "raw" else ("arrow", schema)
        while count < batch_size:
            block = self._block
            idx, fresh_hashes, fresh_count = self._fresh
            if block is None or self._pos >= fresh_count:
                if not self._next_block(want):
                    break
                continue
            records = self._records(view, schema)
            start = self._pos
            stop = min(fresh_count, start + batch_size - count)
            if view == "raw":
                parts.append(records if start == 0 and stop == len(records)
                             else records[start:stop])
            else:
                parts.append(records.slice(start, stop - start))
            if self.dedup:
                hashes.append(fresh_hashes[start:stop])
            last = (block, stop - 1 if idx is None else int(idx[stop - 1]))
            count += stop - start
            self._pos = stop
        if not count:
            return None
        assert last is not None
        if view == "raw":
            batch: Any = parts[0] if len(parts) == 1 else [r for p in parts for r in p]
        else:
            batch = concat(parts)
        return batch, hashes, self._coord_after(*last)

    # -- committing ------------------------------------------------------------------------

    def commit(self, batch_id: int) -> None:
        """Durably mark every batch up to ``batch_id`` consumed (``commit_gpu_batch``)."""
        if batch_id <= self._meta.committed_batch_id:
            return  # already durable
        if not any(b.batch_id == batch_id for b in self._handed_out):
            raise InvalidInput(f"batch {batch_id} was not handed out by this stream")
        done: list[_HandedOut] = []
        while self._handed_out and self._handed_out[0].batch_id <= batch_id:
            done.append(self._handed_out.popleft())
        pieces = [h for b in done for h in b.hashes]
        hashes = np.concatenate(pieces) if pieces else _NO_HASHES
        try:
            self._meta.commit(batch_id, done[-1].coord, hashes)
        except BaseException:
            self._handed_out.extendleft(reversed(done))
            raise

    def hand_off(self, batch_id: int) -> tuple[StreamCoordinate, np.ndarray]:
        """Give the commit of batch ``batch_id`` to another owner of this reader's state (the
        PyTorch adapter's main process, which commits with ``DualMetadataManager``): returns
        the coordinate just after the batch and its records' hashes (empty without dedup),
        and forgets the batch here. Batches are handed off in order, oldest first; a stream
        whose batches are handed off must not also ``commit``."""
        if not self._handed_out or self._handed_out[0].batch_id != batch_id:
            oldest = self._handed_out[0].batch_id if self._handed_out else None
            raise InvalidInput(
                f"batch {batch_id} is not the oldest batch handed out (that is {oldest})"
            )
        done = self._handed_out.popleft()
        hashes = np.concatenate(done.hashes) if done.hashes else _NO_HASHES
        return done.coord, hashes

    # -- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        self._wait_ahead()  # the workers may be using the reader
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        self._meta.close()
        self.plan.release()

    def __enter__(self) -> RecordStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
