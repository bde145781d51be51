"""Repartitioning: a new partition of what no reader of the old one committed.

Invariants:
- A repartition reads the committed coordinate of every old reader (no record is read; a
  Parquet coordinate costs that shard's footer), keeps the keys no old reader committed and
  splits them by measure among the new readers. It writes the new readers' fresh states under
  temporary names, then the new sidecar marked *pending* (the commit point), then renames the
  fresh states into place, removes the states of readers that no longer exist, and clears the
  mark. A crash before the commit point leaves the old partition whole; after it, the next
  opener finishes the renames (``roll_forward``), each exactly once (its temporary name is
  gone afterwards).
- It runs holding the partition lock, the readers' lock exclusively, and every old state
  (``locks``): no reader of the old partition is open while it runs.
- The hashes the old readers committed, and those carried into the old generation, are
  carried into the new one, sorted and unique (``committed.load_base``).
- The states of a shuffled stream are refused here: their records are not a prefix of keys.
  ``faultfs.stream.shuffle`` carries the rest of their epoch instead and writes it through
  ``write_replacement``, the same steps, a shuffle record beside each fresh state and the
  rest of the epoch beside the carried hashes (``roll_forward`` renames and removes a
  state's shuffle record with it).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np
import xxhash

from faultfs.errors import CorruptionError, InvalidInput
from faultfs.store.dedup import sorted_unique
from faultfs.store.durable import fsync_dir, write_atomic
from faultfs.store.metadata import WAL_SUFFIX
from faultfs.stream.partition.committed import (
    HASH_DTYPE,
    coordinate_key,
    load_base,
    meta_image,
    read_committed,
    read_hashes,
)
from faultfs.stream.partition.keys import START, Interval, Key, merge, split
from faultfs.stream.partition.locks import claim_states
from faultfs.stream.partition.names import (
    PARTITION_SUFFIX,
    SHUFFLE_SUFFIX,
    base_path,
    carried_path,
    fresh_name,
    reader_paths,
    state_files,
)
from faultfs.stream.partition.sidecar import Partition, store
from faultfs.stream.shards import Shard


def replace_partition(
    shards: Sequence[Shard], state: str, old: Partition, world_size: int, num_workers: int
) -> Partition:
    """Replace ``old`` by a partition of what no old reader committed (holding the lock)."""
    paths = reader_paths(state, old.reader_state, old.world_size, old.num_workers)
    claims = claim_states(paths)
    try:
        shuffled = [p for p in paths if os.path.lexists(p + SHUFFLE_SUFFIX)]
        if shuffled:
            raise InvalidInput(
                f"{shuffled[0]}: the readers of this partition shuffle (its shuffle record is "
                f"{shuffled[0]}{SHUFFLE_SUFFIX}); repartition with shuffle=True and their seed"
            )
        return _replace_claimed(shards, state, old, world_size, num_workers)
    finally:
        for fd in claims:
            os.close(fd)


def _replace_claimed(
    shards: Sequence[Shard], state: str, old: Partition, world_size: int, num_workers: int
) -> Partition:
    """The work of ``replace_partition``, with every old state claimed."""
    sizes = old.shard_sizes
    keys: list[Key] = []
    hashes = [load_base(state, old)] if old.generation else []
    for i, path in enumerate(
        reader_paths(state, old.reader_state, old.world_size, old.num_workers)
    ):
        committed = read_committed(path)
        if committed is None or not committed.anything:
            keys.append(START)
            continue
        key = coordinate_key(committed.coord, shards, path)
        intervals = old.readers[i]
        if key != START and not any(lo[0] <= key[0] <= hi[0] for lo, hi in intervals):
            raise CorruptionError(
                f"{path}: checkpoint is at shard {key[0]}, outside this reader's partition"
            )
        keys.append(key)
        hashes.append(read_hashes(path + WAL_SUFFIX, committed.dedup_count, what="the dedup WAL"))
    rest = merge(
        sorted(
            (max(lo, key), hi)
            for intervals, key in zip(old.readers, keys, strict=True)
            for lo, hi in intervals
            if hi > key
        )
    )
    readers = split(rest, world_size * num_workers, sizes)
    return write_replacement(state, old, world_size, num_workers, readers, hashes)


def write_replacement(
    state: str,
    old: Partition,
    world_size: int,
    num_workers: int,
    readers: Sequence[Sequence[Interval]],
    hashes: Sequence[np.ndarray],
    *,
    files: Sequence[tuple[str, bytes]] = (),
    companions: Callable[[str], Sequence[tuple[str, bytes]]] | None = None,
) -> Partition:
    """Write a repartition and commit it (holding the locks): the carried hashes (``hashes``,
    made sorted and unique) and ``files`` the new generation reads, every new reader's fresh
    state (and its ``companions``: name and bytes of each file beside it) under its
    temporary name, then the sidecar marked pending (the commit point), then
    ``roll_forward``."""
    base = sorted_unique(np.concatenate(hashes)) if hashes else np.empty(0, dtype=np.uint64)
    generation = old.generation + 1
    raw = base.astype(HASH_DTYPE).tobytes()
    if base.size:
        write_atomic(base_path(state, generation), [raw])
    for name, data in files:
        write_atomic(name, [data])
    new_paths = reader_paths(state, old.reader_state, world_size, num_workers)
    for path in new_paths:
        write_atomic(fresh_name(path, generation), [meta_image()], sync_dir=False)
        for name, data in companions(path) if companions is not None else ():
            write_atomic(fresh_name(name, generation), [data], sync_dir=False)
    for directory in {os.path.dirname(os.path.abspath(p)) for p in new_paths}:
        fsync_dir(directory)
    new = Partition(
        generation,
        world_size,
        num_workers,
        old.fingerprint,
        old.shard_sizes,
        old.reader_state,
        tuple(tuple(r) for r in readers),
        int(base.size),
        xxhash.xxh3_64_intdigest(raw) if base.size else 0,
        True,
        (old.world_size, old.num_workers, old.generation),
    )
    store(state + PARTITION_SUFFIX, new)  # the commit point
    roll_forward(state, new)
    return replace(new, pending=False)


def roll_forward(state: str, part: Partition) -> None:
    """Finish a repartition whose sidecar is written (holding the lock): put the fresh states
    in place, remove what the old partition alone used, clear the pending mark."""
    new_paths = reader_paths(state, part.reader_state, part.world_size, part.num_workers)
    for path in new_paths:
        # the shuffle record first: a state renamed into place is read with its record
        for name in (path + SHUFFLE_SUFFIX, path):
            with contextlib.suppress(FileNotFoundError):
                os.rename(fresh_name(name, part.generation), name)
    prev_world, prev_workers, prev_generation = part.previous
    old_paths = (
        reader_paths(state, part.reader_state, prev_world, prev_workers)
        if (prev_world and prev_workers)
        else []
    )
    for path in sorted(set(old_paths) - set(new_paths)):
        for name in state_files(path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)
    if prev_generation != part.generation:
        for name in (base_path(state, prev_generation), carried_path(state, prev_generation)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)
    for directory in {os.path.dirname(os.path.abspath(p)) for p in new_paths + old_paths}:
        fsync_dir(directory)
    store(state + PARTITION_SUFFIX, replace(part, pending=False))
