"""RecordStream: resumable, deduplicating batches of records over multi-shard sources.

Committed unique records are delivered exactly once across crashes. The face assembles
batches from blocks of records; its collaborators keep the rest, each with its invariants:
``opening`` (which shards, in what order, each opened at its resume point; a partitioned
reader's checkpoint checked against its part), ``fresh`` (which records of a block are
delivered: dedup), ``read_ahead`` (the next blocks made in worker threads) and ``commits``
(the batches handed out and their commits into the checkpoint).

Invariants:
- Reopening with the same sources and state continues with the first record after the last
  committed batch (``opening``). Given the same committed hashes, scanning is deterministic,
  so the batches after a resume are the ones the crashed run would have made.
- Records are delivered in the order shards are read (``ShardOpener.first``/``after``) and,
  within a shard, in the order of its blocks and of each block's fresh records
  (``fresh_records``): the two places that decide the order.
- Every ``format`` yields the same batches: the same records (a parsed row is its raw
  record, parsed; dedup is by the raw record's bytes), the same batch ids and coordinates,
  so a checkpoint written while reading one format resumes in any other.
- Parsed formats and dedup read ahead (``read_ahead``); the first block after opening is
  handed out before any read-ahead starts, and ``close`` waits for the workers.
- A partitioned stream (``rank``/``world_size``, ``worker``/``num_workers``) is one reader of
  a partition (``faultfs.stream.partition``) and keeps its own state file; with dedup it
  also skips the hashes carried from before the last repartition. Everything above holds per
  reader; dedup is per reader (two readers both deliver a record that is in both parts).
- One stream at a time has a state file open (``DualMetadataManager.open(exclusive=True)``):
  a second stream over it, in any process, is refused until the first is closed.
- An error while reading a block (a failed read, a malformed record) ends the stream object:
  records already taken for the unfinished batch would otherwise be lost, so later calls
  refuse; reopening from the checkpoint continues from the last commit.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from faultfs.core.coord import StreamCoordinate
from faultfs.errors import InvalidInput
from faultfs.store.metadata import DualMetadataManager
from faultfs.stream.columns import block_table, concat, import_arrow
from faultfs.stream.commits import Commits, committed_hashes
from faultfs.stream.fresh import NO_HASHES, Dedup, Fresh, fresh_records
from faultfs.stream.opening import ShardOpener
from faultfs.stream.partition import ReaderPlan, plan_reader
from faultfs.stream.read_ahead import ReadAhead, View
from faultfs.stream.readers import LineShardReader, ParquetShardReader, RecordBlock
from faultfs.stream.shards import Shard, expand_shards

FORMATS = ("raw", "arrow", "pydict")


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
            self._open_state(os.fspath(state), dedup)
        except BaseException:
            self.plan.release()  # a reader that did not open holds no lock
            raise

    def _open_state(self, state: str, dedup: bool) -> None:
        """The rest of ``__init__``: this reader's checkpoint, resume point and hashes."""
        self._meta = DualMetadataManager.open(self.plan.state_path, exclusive=True)
        try:
            coord = self._meta.coord
            self._opener = ShardOpener(self.shards, self.plan, self._meta.meta_path, coord)
            self.dedup = dedup
            self._dedup = Dedup(
                dedup,  # the committed hashes: a fresh array read from the WAL, sorted in place
                committed_hashes(self._meta, state, self.plan.partition) if dedup else None,
            )
        except BaseException:
            self._meta.close()
            raise
        self._shard_id = self._opener.first()
        self._reader: LineShardReader | ParquetShardReader | None = None
        self._block: RecordBlock | None = None
        # which of the block's records will be delivered: their indices in the block (None:
        # all of them) and hashes; the records in the format asked for, made once per block
        self._fresh: Fresh = (None, NO_HASHES, 0)
        self._view: tuple[str, Any, Any] | None = None  # (format, schema, records)
        # the next blocks of the open reader, each read, decided and made into records ahead
        self._ahead = ReadAhead(self._dedup)
        self._opened = True  # no block handed out yet: the first is read without read-ahead
        self._pos = 0  # next index into the fresh records
        self._scanned = coord.global_row_idx  # raw records scanned, lookahead included
        self._commits = Commits(self._meta)
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
        return self._commits.position

    @property
    def resumed_from(self) -> StreamCoordinate:
        return self._opener.resume

    @property
    def state_path(self) -> str:
        """This reader's checkpoint file."""
        return self.plan.state_path

    @property
    def committed_dedup_count(self) -> int:
        """Hashes in this reader's WAL at its last commit (carried hashes not included)."""
        return self._meta.dedup_count

    # -- reading ---------------------------------------------------------------------------

    def _next_block(self, view: View) -> bool:
        """Load the next non-empty block into the lookahead buffer; False at the end.
        ``view``: the format (and schema) the records are wanted in, made ahead for the
        blocks after it."""
        while self._shard_id < len(self.shards):
            if self._reader is None:
                self._reader = self._opener.open(self._shard_id, self._scanned)
                if self._reader is None:
                    self._shard_id = self._opener.after(self._shard_id)
                    continue
            ahead = self._ahead.next()  # its error, raised here
            block = self._reader.next_block() if ahead is None else ahead.block
            if block is not None:
                self._block = block
                self._pos = 0
                self._view = None
                self._scanned = block.global_start + block.count
                self._fresh = self._dedup.decide(block) if ahead is None else ahead.fresh
                if ahead is not None and ahead.view[0] == view[0] and ahead.view[1] is view[1]:
                    self._view = (view[0], view[1], ahead.records)
                if self._opened:
                    self._opened = False  # a restart's first batch waits for no read-ahead
                elif view[0] != "raw" or self.dedup:  # raw records alone: no gain ahead
                    self._ahead.start(self._reader, view)
                return True
            self._ahead.wait()  # the reads after the last block find nothing either
            self._reader.close()
            self._reader = None
            self._shard_id = self._opener.after(self._shard_id)
        self._block = None
        return False

    def _records(self, fmt: str, schema: Any) -> Any:
        """The block's fresh records in ``fmt``: a list (raw) or a table (parsed)."""
        view = self._view
        if view is not None and view[0] == fmt and view[1] is schema:
            return view[2]
        block = self._block
        assert block is not None
        table = None if fmt == "raw" else block_table(block, schema)
        records = fresh_records(block, self._fresh, table)
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
            batch_id = self._commits.hand_out(coord, hashes)
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
        want: View = ("raw", None) if view == "raw" else ("arrow", schema)
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
        self._commits.commit(batch_id)

    def hand_off(self, batch_id: int) -> tuple[StreamCoordinate, np.ndarray]:
        """Give the commit of batch ``batch_id`` to another owner of this reader's state (the
        PyTorch adapter's main process, which commits with ``DualMetadataManager``): returns
        the coordinate just after the batch and its records' hashes (empty without dedup),
        and forgets the batch here. Batches are handed off in order, oldest first; a stream
        whose batches are handed off must not also ``commit``."""
        return self._commits.hand_off(batch_id)

    # -- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        self._ahead.close()  # the workers may be using the reader
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        self._meta.close()
        self.plan.release()

    def __enter__(self) -> RecordStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
