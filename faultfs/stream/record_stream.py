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
- With ``dedup``, a record whose hash is committed or pending is skipped: it still counts in
  ``global_row_idx`` (raw records scanned), but never reaches a batch.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from faultfs.core.coord import StreamCoordinate
from faultfs.errors import InvalidInput
from faultfs.store.dedup import TwoStageDeduplicator
from faultfs.store.metadata import DualMetadataManager
from faultfs.stream.readers import (
    LineShardReader,
    ParquetShardReader,
    RecordBlock,
    row_bytes,
)
from faultfs.stream.shards import Shard, expand_shards

_hash = xxhash.xxh3_64_intdigest


@dataclass
class _HandedOut:
    """A batch given to the consumer and not yet committed."""

    batch_id: int
    coord: StreamCoordinate  # just after its last record
    hashes: list[int]


class RecordStream:
    """Batches of records (bytes lines or Parquet row dicts) with crash-safe commits.

    >>> stream = RecordStream("data/*.jsonl", "run.meta")        # doctest: +SKIP
    >>> for batch_id, records in stream.batches(1024):           # doctest: +SKIP
    ...     train(records); stream.commit(batch_id)
    """

    def __init__(
        self,
        sources: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
        state: str | os.PathLike[str],
        *,
        dedup: bool = True,
        fs_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.shards: list[Shard] = expand_shards(sources, fs_options)
        self._meta = DualMetadataManager.open(state)
        try:
            coord = self._meta.coord
            if coord.shard_id > len(self.shards):
                raise InvalidInput(
                    f"{self._meta.meta_path}: checkpoint is at shard {coord.shard_id} but the "
                    f"sources expand to {len(self.shards)} shards (different sources?)"
                )
            self.dedup = dedup
            self._dedup = (
                TwoStageDeduplicator.with_committed(self._meta.committed_hashes())
                if dedup
                else TwoStageDeduplicator()
            )
        except BaseException:
            self._meta.close()
            raise
        self._resume = coord
        self._shard_id = coord.shard_id
        self._reader: LineShardReader | ParquetShardReader | None = None
        self._block: RecordBlock | None = None
        # the block's records that will be delivered, their hashes and indices in the block
        self._fresh: list[Any] = []
        self._fresh_hashes: list[int] = []
        self._fresh_idx: np.ndarray = np.empty(0, dtype=np.intp)
        self._pos = 0  # next index into _fresh
        self._position = coord  # just after the last record handed out
        self._scanned = coord.global_row_idx  # raw records scanned, lookahead included
        self._next_batch_id = self._meta.committed_batch_id + 1
        self._handed_out: deque[_HandedOut] = deque()

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

    # -- reading ---------------------------------------------------------------------------

    def _open_reader(self) -> LineShardReader | ParquetShardReader:
        shard = self.shards[self._shard_id]
        resume = self._resume if self._shard_id == self._resume.shard_id else None
        global_start = self._scanned
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

    def _next_block(self) -> bool:
        """Load the next non-empty block into the lookahead buffer; False at the end."""
        while self._shard_id < len(self.shards):
            if self._reader is None:
                self._reader = self._open_reader()
            block = self._reader.next_block()
            if block is not None:
                self._block = block
                self._pos = 0
                self._scanned = block.global_start + len(block.records)
                self._select_fresh(block)
                return True
            self._reader.close()
            self._reader = None
            self._shard_id += 1
        self._block = None
        return False

    def _select_fresh(self, block: RecordBlock) -> None:
        """Decide, once per block, which of its records will be delivered.

        A record is a duplicate iff its hash is committed, pending from an earlier block, or
        appears earlier in this block. Later commits only move hashes from pending to
        committed, and later additions to pending are this block's own first occurrences, so
        the decision stays right however batches of this block are committed.
        """
        n = len(block.records)
        if not self.dedup:
            self._fresh = block.records
            self._fresh_hashes = []
            self._fresh_idx = np.arange(n, dtype=np.intp)
            return
        keys = block.records if block.kind == "lines" else map(row_bytes, block.records)
        hashes = np.fromiter(map(_hash, keys), dtype=np.uint64, count=n)
        # first occurrences in the block, as sorted hashes (sorted probes search much faster)
        unique, first = np.unique(hashes, return_index=True)
        if self._dedup.committed_count:
            first = first[~self._dedup.committed_mask(unique)]
        idx = np.sort(first)
        fresh_hashes = hashes[idx].tolist()
        pending = self._dedup.pending_among(fresh_hashes)
        if pending:
            sel = [j for j, h in enumerate(fresh_hashes) if h not in pending]
            idx = idx[sel]
            fresh_hashes = [fresh_hashes[j] for j in sel]
        records = block.records
        self._fresh = [records[i] for i in idx.tolist()]
        self._fresh_hashes = fresh_hashes
        self._fresh_idx = idx

    def _coord_after(self, block: RecordBlock, i: int) -> StreamCoordinate:
        end = int(block.ends[i])
        global_row_idx = block.global_start + i + 1
        if block.kind == "lines":
            return StreamCoordinate(block.shard_id, end, 0, 0, 0, global_row_idx)
        return StreamCoordinate(block.shard_id, 0, block.row_group_idx, 0, end, global_row_idx)

    def batches(self, batch_size: int) -> Iterator[tuple[int, list[Any]]]:
        """Yield ``(batch_id, records)`` until the sources are exhausted; the last batch may be
        short. Each batch is pending until ``commit`` of its id (or a later one)."""
        if not isinstance(batch_size, int) or batch_size < 1:
            raise InvalidInput(f"batch_size must be a positive int, got {batch_size!r}")
        while True:
            records: list[Any] = []
            hashes: list[int] = []
            last: tuple[RecordBlock, int] | None = None
            while len(records) < batch_size:
                block = self._block
                if block is None or self._pos >= len(self._fresh):
                    if not self._next_block():
                        break
                    continue
                stop = min(len(self._fresh), self._pos + batch_size - len(records))
                records.extend(self._fresh[self._pos : stop])
                if self.dedup:
                    taken = self._fresh_hashes[self._pos : stop]
                    hashes.extend(taken)
                    self._dedup.add_new(taken)
                last = (block, int(self._fresh_idx[stop - 1]))
                self._pos = stop
            if not records:
                return
            assert last is not None
            coord = self._coord_after(*last)
            batch_id = self._next_batch_id
            self._next_batch_id += 1
            self._position = coord
            self._handed_out.append(_HandedOut(batch_id, coord, hashes))
            yield batch_id, records

    # -- committing ------------------------------------------------------------------------

    def commit(self, batch_id: int) -> None:
        """Durably mark every batch up to ``batch_id`` consumed (``commit_gpu_batch``)."""
        if batch_id <= self._meta.committed_batch_id:
            return  # already durable
        if not any(b.batch_id == batch_id for b in self._handed_out):
            raise InvalidInput(f"batch {batch_id} was not handed out by this stream")
        hashes: list[int] = []
        done: list[_HandedOut] = []
        while self._handed_out and self._handed_out[0].batch_id <= batch_id:
            b = self._handed_out.popleft()
            done.append(b)
            hashes.extend(b.hashes)
        try:
            self._meta.commit(batch_id, done[-1].coord, hashes)
        except BaseException:
            self._handed_out.extendleft(reversed(done))
            raise
        if hashes:
            self._dedup.commit(hashes)

    # -- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        self._meta.close()

    def __enter__(self) -> RecordStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
