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
- Parsed formats and dedup read ahead (``read_ahead``), and so do a shuffled stream's raw
  records while the consumer idles between batches (``read_ahead.Pace``); the first batch
  after opening is made before any read-ahead starts, and ``close`` waits for the workers.
- A partitioned stream (``rank``/``world_size``, ``worker``/``num_workers``) is one reader of
  a partition (``faultfs.stream.partition``) and keeps its own state file; with dedup it
  also skips the hashes carried from before the last repartition. Everything above holds per
  reader; dedup is per reader (two readers both deliver a record that is in both parts).
- One stream at a time has a state file open (``DualMetadataManager.open(exclusive=True)``):
  a second stream over it, in any process, is refused until the first is closed.
- An error while reading a block (a failed read, a malformed record) ends the stream object:
  records already taken for the unfinished batch would otherwise be lost, so later calls
  refuse; reopening from the checkpoint continues from the last commit.
- A shuffled stream (``shuffle=True``, ``faultfs.stream.shuffle``) reads one epoch at a time
  through ``Epochs`` (its opener: the epoch is one source of mixed blocks, whose records are
  in the epoch's seeded order); everything above holds with "the order of the epoch" for
  "the order shards are read". Each batch carries its shuffle slot, committed before its
  ``.meta`` slot; the batch after which nothing of the epoch is left to deliver says so
  (the epoch is finished), and an epoch whose rest held nothing to deliver is marked
  finished by the stream itself when no batch is pending. ``batches()`` after the end of an
  epoch starts the next one (``set_epoch`` picks another); dedup is per epoch.
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
from faultfs.stream.commits import Commits, HandOff, committed_hashes
from faultfs.stream.fresh import NO_HASHES, Dedup, Fresh, fresh_records
from faultfs.stream.opening import ShardOpener
from faultfs.stream.partition import ReaderPlan, fingerprint, plan_reader
from faultfs.stream.read_ahead import ReadAhead, View
from faultfs.stream.readers import LineShardReader, ParquetShardReader, RecordBlock
from faultfs.stream.shards import Shard, expand_shards
from faultfs.stream.shuffle import (
    DEFAULT_WINDOW,
    WINDOW_BLOCKS,
    EpochReader,
    Epochs,
    Geometry,
    MixedBlock,
    ShuffleSlot,
    refuse_unshuffled_state,
    replace_shuffled,
    settle,
)

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
    >>> shuffled = RecordStream("data/*.jsonl", "run.meta", shuffle=True, seed=7)  # doctest: +SKIP
    >>> for epoch in range(3):                                   # doctest: +SKIP
    ...     shuffled.set_epoch(epoch)
    ...     for batch_id, records in shuffled.batches(1024):
    ...         train(records); shuffled.commit(batch_id)
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
        shuffle: bool = False,
        seed: int | None = None,
        epoch: int | None = None,
        shuffle_window: int | None = None,
    ) -> None:
        """``state``: the checkpoint (one unpartitioned reader), or the name the files of a
        partitioned stream start with. ``rank``/``world_size`` and ``worker``/``num_workers``:
        this reader's place in a partition (see ``faultfs.stream.partition``); its state is
        ``<state>.rank-R.worker-W.meta`` unless ``reader_state`` gives a template with
        ``{rank}`` and ``{worker}``. ``repartition``: when the recorded partition has another
        ``world_size`` or ``num_workers``, replace it (otherwise that is refused).

        ``shuffle``: deliver each epoch in a seeded order (``faultfs.stream.shuffle``): the
        shards in a seeded order, cut into blocks, the blocks dealt to the readers and read in
        windows of ``WINDOW_BLOCKS``, each window's records mixed by a seeded permutation; a
        pure function of ``seed`` (default 0), the epoch and the shards with their sizes.
        ``shuffle_window``: a window's bytes (default 1 MiB): what mixes and what a resume
        reads again. ``epoch``: the epoch to read (default: the checkpoint's; another only
        at the start of one). The state keeps a shuffle record, ``<state>.shuffle``."""
        self.shards: list[Shard] = expand_shards(sources, fs_options)
        geometry = _geometry(shuffle, seed, epoch, shuffle_window)
        replace_with = None
        if geometry is not None:
            fp = fingerprint(self.shards)

            def replace_with(shards: Any, state_: str, old: Any, world: int, workers: int) -> Any:
                assert geometry is not None
                return replace_shuffled(shards, state_, old, world, workers, geometry, fp)

        self.plan: ReaderPlan = plan_reader(
            self.shards,
            state,
            rank=rank,
            world_size=world_size,
            worker=worker,
            num_workers=num_workers,
            reader_state=reader_state,
            repartition=repartition,
            replace_with=replace_with,
        )
        try:
            self._open_state(os.fspath(state), dedup, geometry, epoch)
        except BaseException:
            self.plan.release()  # a reader that did not open holds no lock
            raise

    def _open_state(self, state: str, dedup: bool, geometry: Geometry | None,
                    epoch: int | None) -> None:
        """The rest of ``__init__``: this reader's checkpoint, resume point and hashes."""
        if geometry is not None:
            settle(self.plan.state_path)  # a .meta a power loss left behind its record
        self._meta = DualMetadataManager.open(self.plan.state_path, exclusive=True)
        self._epochs: Epochs | None = None
        try:
            coord = self._meta.coord
            self.dedup = dedup
            if geometry is None:
                refuse_unshuffled_state(self.plan)
                self._opener: ShardOpener | Epochs = ShardOpener(
                    self.shards, self.plan, self._meta.meta_path, coord
                )
                committed = (committed_hashes(self._meta, state, self.plan.partition)
                             if dedup else None)
            else:
                self._epochs = Epochs(self.shards, self.plan, self._meta, state, geometry, epoch)
                self._opener = self._epochs
                committed = (self._epochs.committed_hashes(self._meta, state, self.plan)
                             if dedup else None)
                coord = self._epochs.resume_coord
            # the committed hashes: a fresh array read from the WAL, sorted in place
            self._dedup = Dedup(dedup, committed)
        except BaseException:
            if self._epochs is not None:
                self._epochs.close()
            self._meta.close()
            raise
        self._state = state
        self._shard_id = self._opener.first()
        self._reader: LineShardReader | ParquetShardReader | None = None
        self._block: RecordBlock | None = None
        # which of the block's records will be delivered: their indices in the block (None:
        # all of them) and hashes; the records in the format asked for, made once per block
        self._fresh: Fresh = (None, NO_HASHES, 0)
        self._view: tuple[str, Any, Any] | None = None  # (format, schema, records)
        # the next blocks of the open reader, each read, decided and made into records ahead
        self._ahead = ReadAhead(self._dedup)
        self._opened = True  # no batch handed out yet: the first is made without read-ahead
        self._batch_size = 0  # of the batches() under way
        self._pos = 0  # next index into the fresh records
        self._scanned = coord.global_row_idx  # raw records scanned, lookahead included
        self._commits = Commits(
            self._meta, self._epochs.record if self._epochs is not None else None
        )
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
        if self._epochs is not None:
            return self._epochs.resume_coord
        assert isinstance(self._opener, ShardOpener)
        return self._opener.resume

    @property
    def epoch(self) -> int | None:
        """A shuffled stream's epoch: the one ``batches()`` reads (None: not shuffled)."""
        return self._epochs.epoch if self._epochs is not None else None

    def set_epoch(self, epoch: int) -> None:
        """Read epoch ``epoch`` next, from its start: at the start of an epoch (nothing of it
        committed or handed out) or after its end; refused in the middle of one."""
        if self._epochs is None:
            raise InvalidInput("set_epoch applies to a shuffled stream (shuffle=True)")
        _check_u64("epoch", epoch)
        e = self._epochs
        if epoch == e.epoch and not e.exhausted:
            return
        if not (e.exhausted or e.at_start):
            raise InvalidInput(
                f"{e.path}: epoch {e.epoch} is under way in this stream; it asks for epoch "
                f"{epoch} — finish epoch {e.epoch} first"
            )
        self._start_epoch(epoch)

    def _start_epoch(self, epoch: int | None) -> None:
        """Leave the current epoch (its reader closed, its delivered set dropped) for
        ``epoch`` (None: the next), from its start."""
        assert self._epochs is not None
        self._ahead.wait()
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        self._epochs.next_epoch(epoch, self._commits.hashed)
        self._dedup = Dedup(self.dedup, None)  # dedup is per epoch
        self._shard_id = self._opener.first()
        self._block = None
        self._fresh = (None, NO_HASHES, 0)
        self._view = None
        self._pos = 0
        self._scanned = 0
        self._opened = True

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
        while self._shard_id < self._opener.end:
            if self._reader is None:
                self._reader = self._opener.open(self._shard_id, self._scanned)
                if self._reader is None:
                    self._shard_id = self._opener.after(self._shard_id)
                    continue
                if isinstance(self._reader, EpochReader):  # each window made ready ahead
                    self._reader.want = (self.dedup, (view[0] != "raw", view[1]))
                    self._reader.first_block = min(self._reader.first_block, self._batch_size)
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
                # a restart's first batch is made here, with no read-ahead beside it; then
                # parsed and deduplicated blocks are made ahead, a shuffled window's raw
                # records while the consumer idles between batches (``Pace``), and with them
                # the next window read; a file's raw blocks gain nothing ahead
                shuffled = isinstance(self._reader, EpochReader)
                early = not self._opened and (view[0] != "raw" or self.dedup
                                              or (shuffled and self._ahead.pace.ahead()))
                if shuffled:
                    self._reader.read_ahead = early
                if early:
                    self._ahead.start(self._reader, view)
                return True
            self._ahead.wait()  # the reads after the last block find nothing either
            self._reader.close()
            self._reader = None
            self._shard_id = self._opener.after(self._shard_id)
        self._block = None
        return False

    def _records(self, fmt: str, schema: Any, start: int, stop: int) -> Any:
        """The block's fresh records ``[start, stop)`` in ``fmt``: a list (raw) or a table
        (parsed). A shuffled block's raw records, all fresh and not made ahead, are cut for
        these alone: each ``bytes`` is made, used and freed while it is in the cache, where
        the block's whole list would be touched again by each batch's slice and its free."""
        view = self._view
        if view is None or view[0] != fmt or view[1] is not schema:
            block = self._block
            assert block is not None
            if fmt == "raw" and self._fresh[0] is None and isinstance(block, MixedBlock):
                return block.window.records(block.idx[start:stop])
            table = None if fmt == "raw" else block_table(block, schema)
            view = self._view = (fmt, schema, fresh_records(block, self._fresh, table))
        records = view[2]
        if fmt != "raw":
            return records.slice(start, stop - start)
        return records if start == 0 and stop == len(records) else records[start:stop]

    def batches(
        self, batch_size: int, *, format: str = "raw", schema: Any = None
    ) -> Iterator[tuple[int, Any]]:
        """Yield ``(batch_id, records)`` until the sources are exhausted; the last batch may be
        short. Each batch is pending until ``commit`` of its id (or a later one).

        ``format``: ``"raw"`` (a list of ``bytes`` lines, or of Parquet rows as dicts),
        ``"arrow"`` (a ``pyarrow.Table``: jsonl as pyarrow's JSON reader makes it, one column
        per field, flat records in one compiled pass; txt as one ``text`` column; Parquet
        columns as stored) or ``"pydict"``
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
        self._batch_size = batch_size  # a restart's first blocks are this size (shuffled)
        if self._epochs is not None and self._epochs.exhausted:
            self._start_epoch(None)  # iterating again: the next epoch
        self._ahead.pace.start()
        while True:
            if self._failed is not None:
                raise InvalidInput(
                    f"this stream failed earlier ({self._failed}); reopen it to resume from "
                    "its last commit"
                )
            try:
                batch = self._assemble(batch_size, view, schema)
                if batch is None and self._epochs is not None:
                    self._end_epoch()
            except BaseException as err:
                self._failed = err
                raise
            if batch is None:
                return
            records, hashes, coord, slot = batch
            self._opened = False  # the first batch is out: read ahead from the next block on
            batch_id = self._commits.hand_out(coord, hashes, slot)
            if self._epochs is not None:
                self._epochs.handed_out = True
            if format == "pydict":
                records = records.to_pydict()
            self._ahead.pace.out()
            yield batch_id, records
            self._ahead.pace.back()

    def _end_epoch(self) -> None:
        """A shuffled epoch has nothing left: the next ``batches()`` starts another. If this
        stream handed out none of it and no batch is pending, its checkpoint is marked
        finished here (the epoch's rest held nothing to deliver), so that a restart, or a
        DataLoader's next iteration, moves on too."""
        e = self._epochs
        assert e is not None
        e.exhausted = True
        if not e.handed_out and not self._commits.pending:
            slot = e.record.slot
            if not (slot.meta_epoch and slot.finished and slot.epoch == e.epoch):
                self._commits.mark(e.slot_after(0, 0, finished=True))

    def _assemble(
        self, batch_size: int, view: str, schema: Any
    ) -> tuple[Any, list[np.ndarray], StreamCoordinate, ShuffleSlot | None] | None:
        parts: list[Any] = []
        hashes: list[np.ndarray] = []
        count = 0
        last: tuple[Any, int] | None = None
        want: View = ("raw", None) if view == "raw" else ("arrow", schema)
        while count < batch_size:
            block = self._block
            idx, fresh_hashes, fresh_count = self._fresh
            if block is None or self._pos >= fresh_count:
                if not self._next_block(want):
                    break
                continue
            start = self._pos
            stop = min(fresh_count, start + batch_size - count)
            parts.append(self._records(view, schema, start, stop))
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
        slot = None
        if self._epochs is not None:  # the batch ends the epoch if nothing fresh follows it
            if count == batch_size and self._fresh_follows(want):
                slot = self._epochs.slot_after(*last[0].progress_after(last[1]))
            else:
                slot = self._epochs.slot_after(0, 0, finished=True)
        return batch, hashes, _coord_after(*last), slot

    def _fresh_follows(self, want: View) -> bool:
        """Whether a record to deliver follows (the next blocks read as far as it takes)."""
        while self._block is None or self._pos >= self._fresh[2]:
            if not self._next_block(want):
                return False
        return True

    # -- committing ------------------------------------------------------------------------

    def commit(self, batch_id: int) -> None:
        """Durably mark every batch up to ``batch_id`` consumed (``commit_gpu_batch``)."""
        self._commits.commit(batch_id)

    def hand_off(self, batch_id: int) -> HandOff:
        """Give the commit of batch ``batch_id`` to another owner of this reader's state (the
        PyTorch adapter's main process, which commits with ``DualMetadataManager``): returns
        the coordinate just after the batch, its records' hashes (empty without dedup) and,
        shuffled, the shuffle slot to write before it, and forgets the batch here. Batches
        are handed off in order, oldest first; a stream whose batches are handed off must
        not also ``commit``."""
        return self._commits.hand_off(batch_id)

    def close(self) -> None:
        self._ahead.close()  # the workers may be using the reader
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        if self._epochs is not None:
            self._epochs.close()
        self._meta.close()
        self.plan.release()

    def __enter__(self) -> RecordStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _coord_after(block: RecordBlock | MixedBlock, i: int) -> StreamCoordinate:
    """The coordinate just past record ``i`` of ``block``."""
    if isinstance(block, MixedBlock):
        return block.coord_after(i)
    end = int(block.ends[i])
    global_row_idx = block.global_start + i + 1
    if block.kind == "lines":
        return StreamCoordinate(block.shard_id, end, 0, 0, 0, global_row_idx)
    return StreamCoordinate(block.shard_id, 0, block.row_group_idx, 0, end, global_row_idx)


def _check_u64(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 64:
        raise InvalidInput(f"{name} must be an int in 0..2**64-1, got {value!r}")


def _geometry(
    shuffle: bool, seed: int | None, epoch: int | None, window: int | None
) -> Geometry | None:
    """The shuffle asked for (None: file order), its arguments checked."""
    if not shuffle:
        given = [n for n, v in (("seed", seed), ("epoch", epoch), ("shuffle_window", window))
                 if v is not None]
        if given:
            raise InvalidInput(f"{', '.join(given)} applies to a shuffled stream (shuffle=True)")
        return None
    seed = 0 if seed is None else seed
    _check_u64("seed", seed)
    if epoch is not None:
        _check_u64("epoch", epoch)
    window = DEFAULT_WINDOW if window is None else window
    if not isinstance(window, int) or isinstance(window, bool) or window < WINDOW_BLOCKS:
        raise InvalidInput(
            f"shuffle_window must be an int of at least {WINDOW_BLOCKS} bytes, got {window!r}"
        )
    return Geometry.for_window(seed, window)
