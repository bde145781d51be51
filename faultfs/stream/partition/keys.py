"""Keys and intervals of records, and their split by measure among readers: arithmetic only.

Keys. A record's key is ``(shard_id, pos, row)``. For a line, ``pos`` is the byte offset where
the line starts and ``row`` is 0. For a Parquet row, ``pos`` is the position of its row group
(the byte where its first column chunk starts, made strictly increasing, see
``readers.row_group_positions``) and ``row`` its index in the group. Keys sort records in the
order a stream reads them. The *measure* of a key is its shard's start in the concatenation
of all shards (recorded sizes) plus ``pos``: the byte a split is balanced by.

Invariants:
- A reader owns a sorted list of disjoint half-open key intervals ``[lo, hi)``; the end of
  everything is ``(shard_count, 0, 0)``.
- ``split`` cuts sorted, disjoint intervals into consecutive parts of equal measure, reader i
  getting the measures ``[W*i//readers, W*(i+1)//readers)`` of the total W. A cut falls at a
  byte key ``(shard, pos, 0)``, so each reader owns the records that *start* in its byte range
  (a range that starts mid-line begins at the next line start) and readers differ by less than
  one record in bytes, or one row group for Parquet (a row group belongs to the reader whose
  range holds its start).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

from faultfs.stream.readers import Piece

Key = tuple[int, int, int]  # (shard_id, pos, row): see the module docstring
Interval = tuple[Key, Key]  # [lo, hi)
START: Key = (0, 0, 0)


def _starts(sizes: Sequence[int]) -> list[int]:
    out, at = [], 0
    for size in sizes:
        out.append(at)
        at += size
    return out


def measure(key: Key, starts: Sequence[int], sizes: Sequence[int]) -> int:
    s, pos, _ = key
    if s >= len(sizes):
        return starts[-1] + sizes[-1] if sizes else 0
    return starts[s] + min(pos, sizes[s])


def key_at(x: int, starts: Sequence[int], sizes: Sequence[int]) -> Key:
    """The key of global byte ``x`` (the end key at or past the total)."""
    if x >= starts[-1] + sizes[-1]:
        return (len(sizes), 0, 0)
    s = bisect_right(starts, x) - 1
    return (s, x - starts[s], 0)


def merge(intervals: Sequence[Interval]) -> list[Interval]:
    """Sorted intervals with those that touch or overlap joined."""
    out: list[Interval] = []
    for lo, hi in intervals:
        if out and out[-1][1] >= lo:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def split(
    intervals: Sequence[Interval], readers: int, sizes: Sequence[int]
) -> list[list[Interval]]:
    """Cut sorted, disjoint ``intervals`` into ``readers`` consecutive parts of equal measure
    (reader i gets the measures ``[W*i//readers, W*(i+1)//readers)`` of the total W)."""
    starts = _starts(sizes)
    weights = [
        max(0, measure(hi, starts, sizes) - measure(lo, starts, sizes)) for lo, hi in intervals
    ]
    total = sum(weights)
    bounds = [total * i // readers for i in range(1, readers)]
    out: list[list[Interval]] = [[] for _ in range(readers)]
    reader, cum = 0, 0
    for (lo, hi), w in zip(intervals, weights, strict=True):
        cur = lo
        while reader < readers - 1 and bounds[reader] < cum + w:
            b = bounds[reader]
            if b > cum:
                cut = max(cur, min(hi, key_at(measure(lo, starts, sizes) + b - cum, starts, sizes)))
                if cut > cur:
                    out[reader].append((cur, cut))
                    cur = cut
            reader += 1
        if cur < hi:
            out[reader].append((cur, hi))
        cum += w
    return [merge(part) for part in out]


def shard_pieces(intervals: Sequence[Interval], shard_count: int) -> dict[int, list[Piece]]:
    """A reader's intervals cut at shard boundaries: per shard, its ``[(pos, row), (pos, row)
    or None (to the shard's end))`` pieces, in order."""
    pieces: dict[int, list[Piece]] = {}
    for lo, hi in intervals:
        for s in range(lo[0], min(hi[0], shard_count - 1) + 1):
            a = (lo[1], lo[2]) if s == lo[0] else (0, 0)
            b = (hi[1], hi[2]) if s == hi[0] else None
            if b is not None and b <= a:
                continue
            pieces.setdefault(s, []).append((a, b))
    return pieces
