"""The commit side of a RecordStream: the batches it handed out, committed into its checkpoint.

Invariants:
- The durable state is one DualMetadataManager checkpoint: the coordinate just after the last
  committed batch, that batch's id, and the xxh3_64 hashes of every record delivered up to it
  (the WAL). Batch ids count from 1; ``committed_batch_id`` 0 means nothing committed, and a
  reopened stream hands out ``committed_batch_id + 1`` next.
- ``commit(b)`` writes the coordinate right after batch ``b`` together with the hashes of all
  batches up to ``b``, in one checkpoint; batches handed out after ``b`` stay pending, so a
  consumer may prefetch ahead of its commits. A commit that fails leaves them all pending.
- ``hand_off`` gives the commit of the oldest pending batch to another owner of the state
  (the PyTorch adapter's main process) and forgets it here.
- A shuffled stream's batch carries its shuffle slot (``faultfs.stream.shuffle``); its commit
  writes that slot, with a copy of the ``.meta`` slot it goes with, into the shuffle record,
  fsynced, *before* that ``.meta`` slot: the record's fsync is the commit, so a crash before
  it leaves the previous checkpoint whole and the ``.meta`` slot needs no fsync of its own.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from faultfs.core.coord import StreamCoordinate
from faultfs.errors import InvalidInput
from faultfs.store.metadata import DualMetadataManager
from faultfs.stream.fresh import NO_HASHES
from faultfs.stream.partition import Partition, load_base
from faultfs.stream.shuffle import ShuffleRecord, ShuffleSlot


@dataclass
class _HandedOut:
    """A batch given to the consumer and not yet committed."""

    batch_id: int
    coord: StreamCoordinate  # just after its last record
    hashes: list[np.ndarray]  # of its records, in order (empty without dedup)
    shuffle: ShuffleSlot | None = None  # a shuffled stream's place after it


class HandOff(NamedTuple):
    """A batch's commit given to another owner of the state (``Commits.hand_off``)."""

    coord: StreamCoordinate
    hashes: np.ndarray
    shuffle: ShuffleSlot | None  # for the shuffle record; its meta_epoch set when committed


def committed_hashes(
    meta: DualMetadataManager, state: str, part: Partition | None
) -> np.ndarray | None:
    """The hashes committed before a stream opens (None: none): those carried into its
    partition's generation, then its WAL's."""
    committed = None
    if meta.dedup_count:
        committed = meta.committed_hashes()
    if part is not None and part.base_count:
        base = load_base(state, part)
        committed = base if committed is None else np.concatenate((base, committed))
    return committed


class Commits:
    """The batches a stream handed out and has not committed yet, over its checkpoint."""

    def __init__(self, meta: DualMetadataManager, record: ShuffleRecord | None = None) -> None:
        """``record``: a shuffled stream's shuffle record, written before each ``.meta`` slot."""
        self._meta = meta
        self._record = record
        self.position = meta.coord  # just after the last record handed out
        self._next_batch_id = meta.committed_batch_id + 1
        self._handed_out: deque[_HandedOut] = deque()
        self.hashed = 0  # hashes of the batches handed out since the stream opened

    @property
    def pending(self) -> int:
        """Batches handed out and neither committed nor handed off."""
        return len(self._handed_out)

    def hand_out(
        self, coord: StreamCoordinate, hashes: list[np.ndarray], shuffle: ShuffleSlot | None = None
    ) -> int:
        """The id of a new batch whose last record ends at ``coord``, pending until
        committed (``hashes``: of its records, in order; empty without dedup; ``shuffle``: a
        shuffled stream's slot after it)."""
        batch_id = self._next_batch_id
        self._next_batch_id += 1
        self.position = coord
        self.hashed += sum(int(h.size) for h in hashes)
        self._handed_out.append(_HandedOut(batch_id, coord, hashes, shuffle))
        return batch_id

    def _write(self, batch_id: int, coord: StreamCoordinate, hashes: np.ndarray,
               shuffle: ShuffleSlot | None) -> None:
        """One checkpoint: the shuffle slot (if any), then the WAL and the ``.meta`` slot."""
        if shuffle is None:
            self._meta.commit(batch_id, coord, hashes)
            return
        assert self._record is not None
        self._meta.commit(batch_id, coord, hashes, journal=self._record.journal(shuffle))

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
        hashes = np.concatenate(pieces) if pieces else NO_HASHES
        try:
            self._write(batch_id, done[-1].coord, hashes, done[-1].shuffle)
        except BaseException:
            self._handed_out.extendleft(reversed(done))
            raise

    def mark(self, shuffle: ShuffleSlot) -> None:
        """Commit a shuffled stream's new place without a batch (the end of an epoch whose
        rest held no record to deliver); only with no batch pending."""
        assert not self._handed_out
        self._write(self._meta.committed_batch_id, self._meta.coord, NO_HASHES, shuffle)

    def hand_off(self, batch_id: int) -> HandOff:
        """Give the commit of batch ``batch_id`` to another owner of this reader's state (the
        PyTorch adapter's main process, which commits with ``DualMetadataManager``): returns
        the coordinate just after the batch, its records' hashes (empty without dedup) and a
        shuffled stream's slot after it, and forgets the batch here. Batches are handed off
        in order, oldest first; a stream whose batches are handed off must not also
        ``commit``."""
        if not self._handed_out or self._handed_out[0].batch_id != batch_id:
            oldest = self._handed_out[0].batch_id if self._handed_out else None
            raise InvalidInput(
                f"batch {batch_id} is not the oldest batch handed out (that is {oldest})"
            )
        done = self._handed_out.popleft()
        hashes = np.concatenate(done.hashes) if done.hashes else NO_HASHES
        return HandOff(done.coord, hashes, done.shuffle)
