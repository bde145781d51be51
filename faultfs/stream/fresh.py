"""The fresh records of a block: which of them a RecordStream delivers, and picking them.

Invariants:
- Without dedup every record of a block is fresh. With dedup a record is a duplicate iff its
  xxh3_64 hash was committed or delivered before its block, or appears earlier in its block:
  it still counts in ``global_row_idx`` (raw records scanned), but never reaches a batch.
- ``Dedup.decide`` is called once per block, in block order (``read_ahead`` keeps that order
  across its workers), so each block is decided against every block before it. A block's
  first occurrences join the delivered set at once: they are handed out next, in order, or
  lost with the stream object.
- The records a block delivers keep the block's order (``fresh_records``): record order is
  decided here and by the order blocks are read.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from faultfs.stream.columns import take_rows
from faultfs.stream.delivered import DeliveredHashes, first_occurrences
from faultfs.stream.hashing import record_hashes
from faultfs.stream.readers import RecordBlock, records_at

NO_HASHES = np.empty(0, dtype=np.uint64)

Firsts = tuple[np.ndarray, np.ndarray, np.ndarray]  # hashes, distinct sorted, first index
# which records of a block are delivered: their indices (None: all), their hashes, their count
Fresh = tuple[np.ndarray | None, np.ndarray, int]


def block_firsts(block: RecordBlock, *, may_import: bool = True) -> Firsts:
    """The xxh3_64 hash of each record of ``block``, the distinct hashes (sorted) and the
    index of each one's first occurrence: what dedup needs of a block before it looks at the
    delivered set (``may_import``: see ``record_hashes``)."""
    hashes = record_hashes(block, may_import=may_import)
    unique, first = first_occurrences(hashes)
    return hashes, unique, first


class Dedup:
    """Which records of each block are fresh: those whose hashes were not delivered before
    (``dedup``), or all of them."""

    def __init__(self, dedup: bool, committed: np.ndarray | None) -> None:
        """``committed``: the hashes committed before the stream opened (a fresh array read
        from the WAL, sorted in place and kept)."""
        self.dedup = dedup
        self._delivered = DeliveredHashes(committed, copy=False)

    def decide(self, block: RecordBlock, firsts: Firsts | None = None) -> Fresh:
        """Which of the block's records will be delivered (``firsts``: its
        ``block_firsts``, made before). Called once per block, in block order.

        A record is a duplicate iff its hash was committed or delivered before this block, or
        appears earlier in this block. The block's first occurrences join the delivered set
        at once: they are handed out next, in order, or lost with this object.
        """
        n = block.count
        if not self.dedup:
            return None, NO_HASHES, n
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


def fresh_records(block: RecordBlock, fresh: Fresh, table: Any) -> Any:
    """The fresh records of ``block``, in the block's order: raw (``table`` None) or the rows
    of ``table``."""
    idx = fresh[0]
    if table is not None:
        return table if idx is None else take_rows(table, idx)
    return block.records if idx is None else records_at(block, idx)
