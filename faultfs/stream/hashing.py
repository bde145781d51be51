"""The xxh3_64 hash of each record of a block, the hash dedup decides by and the WAL keeps.

Two ways to the same numbers:
- ``polars-hash`` (the ``stream`` extra): the block's line records become one Arrow
  ``binary_view`` array over the block's own bytes (no copy: a 16-byte view per record) and
  one call hashes them all, in Rust and without the GIL: ~30 ns per 68-byte record, against
  ~65-90 ns for one Python call per record, which also needs the records as ``bytes``.
- python-xxhash, one call per record: Parquet rows (hashed as their JSON bytes), a block
  larger than a view can address, or where the extra is not installed.

The bulk path is imported by the first caller that may import it (a read-ahead worker), never
on a consumer's way to its first batch; until then the per-record path serves. A process
forked from one that had polars loaded (a PyTorch DataLoader worker, by default) keeps to the
per-record path: polars' thread pool does not survive a fork, and polars can hang in the child.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import numpy as np
import xxhash

from faultfs.stream.readers import row_bytes

_digest = xxhash.xxh3_64_digest  # 8 bytes, big-endian: joined and read as one array
_BIG_U64 = np.dtype(">u8")
_INLINE = 12  # a binary view holds a value of up to 12 bytes itself, else its first 4 bytes
_MAX_OFFSET = (1 << 31) - 1  # a view's offset is an int32

_bulk: Any = None  # (pyarrow, polars, polars_hash) once loaded; False: not installed
_loading = threading.Lock()


def _load_bulk() -> Any:
    global _bulk
    with _loading:
        if _bulk is None:
            try:
                import polars as pl
                import polars_hash as plh
                import pyarrow as pa
            except ImportError:
                _bulk = False
            else:
                _bulk = (pa, pl, plh)
    return _bulk


def _after_fork_in_child() -> None:
    global _bulk, _loading
    _loading = threading.Lock()  # the parent's may have been held by another thread
    if "polars" in sys.modules:
        _bulk = False


os.register_at_fork(after_in_child=_after_fork_in_child)


def per_record_hashes(records: Any) -> np.ndarray:
    """xxh3_64 of each ``bytes`` record, one Python call each."""
    return np.frombuffer(b"".join(map(_digest, records)), dtype=_BIG_U64).astype(np.uint64)


def record_hashes(block: Any, *, may_import: bool = True) -> np.ndarray:
    """The xxh3_64 hash of each record of ``block`` as ``uint64``; in bulk where it can
    (``may_import``: load the bulk path if it is not loaded yet). A shuffled stream's mixed
    block gives its window's hashes (``shuffle.window``)."""
    if block.kind == "mixed":
        hashes: np.ndarray = block.hashes(may_import=may_import)
        return hashes
    if block.kind != "lines":
        return per_record_hashes(map(row_bytes, block.records))
    bulk = _bulk if _bulk is not None or not may_import else _load_bulk()
    if not bulk or len(block.data) > _MAX_OFFSET or sys.byteorder != "little":
        return per_record_hashes(block.records)
    assert block.starts is not None and block.stops is not None
    return bulk_hashes(bulk, block.data, block.starts, block.stops)


def span_hashes(
    data: bytes, starts: np.ndarray, stops: np.ndarray, *, may_import: bool = True
) -> np.ndarray:
    """xxh3_64 of each ``data[starts[i]:stops[i]]`` (in any order), in bulk where it can."""
    bulk = _bulk if _bulk is not None or not may_import else _load_bulk()
    if not bulk or len(data) > _MAX_OFFSET or sys.byteorder != "little":
        return per_record_hashes(
            data[a:b] for a, b in zip(starts.tolist(), stops.tolist(), strict=True)
        )
    return bulk_hashes(bulk, data, starts, stops)


def bulk_hashes(bulk: Any, data: bytes, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """xxh3_64 of ``data[starts[i]:stops[i]]`` for every ``i``, by polars-hash over one Arrow
    ``binary_view`` array whose views point into ``data``."""
    pa, pl, plh = bulk
    frame = pl.from_arrow(pa.table({"r": binary_views(pa, data, starts, stops)}))
    assert isinstance(frame, pl.DataFrame)
    hashes = frame.select(plh.col("r").nchash.xxh3_64()).to_series().to_numpy()
    return np.asarray(hashes, dtype=np.uint64)


def binary_views(pa: Any, data: bytes, starts: np.ndarray, stops: np.ndarray) -> Any:
    """The records ``data[starts[i]:stops[i]]`` as one Arrow ``binary_view`` array whose
    views point into ``data`` (no copy)."""
    n = int(starts.size)
    lengths = stops - starts
    # one 16-byte view per record, as two little-endian uint64 words: (length | first 4
    # bytes << 32) and (buffer 0 | offset << 32); a value of up to 12 bytes is held inline
    views = np.empty((n, 2), dtype=np.uint64)
    short = lengths <= _INLINE
    long: Any = slice(None) if not short.any() else np.flatnonzero(~short)  # the viewed rows
    at = starts[long]
    if at.size:  # every 4 bytes of data as an int, at each byte offset: one gather
        words = np.ndarray((len(data) - 3,), dtype="<u4", buffer=data, strides=(1,))
        views[long, 0] = lengths[long].astype(np.uint64) | words[at].astype(np.uint64) << 32
        views[long, 1] = at.astype(np.uint64) << np.uint64(32)
    if not isinstance(long, slice):  # inline: the value's bytes after its length, zero padded
        raw = np.frombuffer(data, dtype=np.uint8)
        rows = np.flatnonzero(short)
        col = np.arange(_INLINE)
        take = np.minimum(starts[rows, None] + col, raw.size - 1)  # a record has >= 1 byte
        inline = raw[take] * (col < lengths[rows, None])
        as_bytes = views.view(np.uint8).reshape(n, 16)
        as_bytes[rows, :4] = lengths[rows, None].astype("<u4").view(np.uint8).reshape(-1, 4)
        as_bytes[rows, 4:] = inline
    return pa.Array.from_buffers(pa.binary_view(), n,
                                 [None, pa.py_buffer(views), pa.py_buffer(data)])
