"""The committed state of a partition's readers, read without changing a file.

Their slots and WAL hashes, the hashes carried into a generation, the key a committed
coordinate stands at; and the bytes of a fresh state.

Invariants:
- Nothing here writes: a state file is read with ``read_meta`` and its slots judged as
  ``DualMetadataManager.open`` judges them (``choose_active``). A missing state has committed
  nothing.
- ``meta_image`` is byte for byte what ``DualMetadataManager`` writes for a fresh state (or
  one whose first commit is ``slot``), so a state made from it opens like one it made.
- Hashes committed by old readers are carried, sorted and unique, into one file
  (``<state>.partition.g<G>.dedup``) whose count and xxh3_64 the sidecar records; every reader
  of generation G with dedup loads it beside its own WAL (``load_base``), checked against
  both.
- A committed coordinate's key costs no record read: a line coordinate is its byte offset,
  a Parquet one costs that shard's footer (``coordinate_key``).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from faultfs.core.coord import StreamCoordinate
from faultfs.core.slots import SLOT_SIZE, DiskSlot
from faultfs.errors import CorruptionError, SourceError
from faultfs.store.metadata import HASH_SIZE, choose_active, read_meta
from faultfs.stream.partition.keys import START, Key
from faultfs.stream.partition.names import base_path
from faultfs.stream.partition.sidecar import Partition
from faultfs.stream.readers import import_parquet, row_group_positions
from faultfs.stream.shards import Shard

HASH_DTYPE = np.dtype("<u8")  # the carried hashes, as the WAL keeps them: little-endian


@dataclass(frozen=True)
class CommittedState:
    """What one reader's state file says was committed."""

    path: str
    batch_id: int
    coord: StreamCoordinate
    dedup_count: int
    epoch: int = 0  # the slot's commit number (0: nothing committed)

    @property
    def anything(self) -> bool:
        return bool(self.batch_id or self.dedup_count or self.coord != StreamCoordinate())


def read_committed(path: str) -> CommittedState | None:
    """The committed slot of a state file without changing it (None when it does not exist)."""
    try:
        a, b = read_meta(path)
    except SourceError as err:
        if err.errno == errno.ENOENT:
            return None
        raise
    try:
        slot = choose_active(a, b).slot
    except CorruptionError as err:
        raise CorruptionError(f"{path}: {err.message}") from None
    return CommittedState(path, slot.committed_batch_id, slot.coord, slot.dedup_count,
                          slot.epoch)


def read_hashes(path: str, count: int, *, what: str) -> np.ndarray:
    """The first ``count`` hashes of a hash file (a WAL or a carried base)."""
    if not count:
        return np.empty(0, dtype=np.uint64)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CorruptionError(f"{path}: {what} is missing ({count} hashes expected)") from None
    try:
        data = os.pread(fd, count * HASH_SIZE, 0)
    finally:
        os.close(fd)
    if len(data) != count * HASH_SIZE:
        raise CorruptionError(
            f"{path}: {what} holds {len(data) // HASH_SIZE} hashes, {count} expected"
        )
    return np.frombuffer(data, dtype=HASH_DTYPE).astype(np.uint64)


def load_base(state: str, part: Partition) -> np.ndarray:
    """The hashes carried into this generation, checked against the sidecar."""
    path = base_path(state, part.generation)
    hashes = read_hashes(path, part.base_count, what="the carried dedup hashes")
    if part.base_count:
        if os.path.getsize(path) != part.base_count * HASH_SIZE:
            raise CorruptionError(f"{path}: not the {part.base_count} hashes the partition records")
        if xxhash.xxh3_64_intdigest(hashes.astype(HASH_DTYPE).tobytes()) != part.base_digest:
            raise CorruptionError(f"{path}: carried dedup hashes fail their checksum")
    return hashes


def meta_image(slot: DiskSlot | None = None) -> bytes:
    """The 128 bytes of a .meta holding only ``slot`` (epoch 1, in slot A) or, without one, a
    fresh file: exactly what ``DualMetadataManager`` writes (a test pins it)."""
    genesis = DiskSlot(0, 0, StreamCoordinate(), 0).encode()
    if slot is None:
        return bytes(SLOT_SIZE) + genesis
    assert slot.epoch == 1
    return slot.encode() + genesis


def parquet_positions(shard: Shard) -> list[int]:
    pq = import_parquet()
    f = shard.open()
    try:
        try:
            meta = pq.ParquetFile(f).metadata
        except Exception as err:
            raise SourceError(f"{shard.url}: not a readable Parquet file: {err}") from err
        return row_group_positions(meta)
    finally:
        f.close()


def coordinate_key(coord: StreamCoordinate, shards: Sequence[Shard], where: str) -> Key:
    """The key of the first record a committed coordinate has not consumed."""
    if coord == StreamCoordinate():
        return START
    s = coord.shard_id
    if s >= len(shards):
        if s == len(shards):
            return (s, 0, 0)
        raise CorruptionError(f"{where}: checkpoint is at shard {s} of {len(shards)}")
    if shards[s].format == "lines":
        return (s, coord.byte_offset, 0)
    positions = parquet_positions(shards[s])
    if coord.row_group_idx >= len(positions):
        raise CorruptionError(
            f"{where}: checkpoint is at row group {coord.row_group_idx} of "
            f"{shards[s].url}, which has {len(positions)}"
        )
    return (s, positions[coord.row_group_idx], coord.row_offset_in_page)
