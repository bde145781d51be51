"""One reader's plan: find, make or (asked to) replace its partition, and name its state.

Invariants:
- ``world_size == num_workers == 1`` without a sidecar is the unpartitioned stream of before:
  its state file is ``state`` itself, and nothing else is written or locked. Any other
  partition, or a repartitioned one, is recorded in the sidecar before a reader reads a record.
- The first partition covers every key, cut at the measures ``i * total // readers``
  (``keys.split``): a function of the shard URLs, their sizes, ``world_size`` and
  ``num_workers`` alone, so readers that make it at once, or on several nodes, make the same.
- A recorded partition is used only over the same sources (its fingerprint and shard count)
  and reader_state template; another ``world_size`` or ``num_workers`` is refused unless
  ``repartition`` is asked for. A pending repartition is finished (``roll_forward``) before
  anything else, by whoever opens next.
- A plan with a partition is made holding the partition lock (``locks.locked``), and holds
  the readers' lock shared (``ReaderPlan.hold``) until ``release``.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from faultfs.errors import CorruptionError, InvalidInput
from faultfs.stream.partition.committed import read_committed
from faultfs.stream.partition.keys import START, Interval, split
from faultfs.stream.partition.locks import locked, reading
from faultfs.stream.partition.names import PARTITION_SUFFIX, check_template, reader_state_path
from faultfs.stream.partition.repartition import replace_partition, roll_forward
from faultfs.stream.partition.sidecar import MAX_READERS, Partition, fingerprint, load, store
from faultfs.stream.shards import Shard

# replaces a recorded partition (holding its locks): (shards, state, old, world_size,
# num_workers) -> the new partition
Replace = Callable[[Sequence[Shard], str, Partition, int, int], Partition]


@dataclass(frozen=True)
class ReaderPlan:
    """What one reader reads and where it keeps its state."""

    state_path: str
    rank: int
    world_size: int
    worker: int
    num_workers: int
    partition: Partition | None  # None: the unpartitioned stream of before
    sidecar: str
    hold: int = -1  # a descriptor of the readers' lock, held shared while the reader is open

    def release(self) -> None:
        """Let go of the readers' lock (the reader is closed)."""
        if self.hold >= 0:
            os.close(self.hold)
            object.__setattr__(self, "hold", -1)

    @property
    def index(self) -> int:
        return self.rank * self.num_workers + self.worker

    @property
    def intervals(self) -> tuple[Interval, ...]:
        assert self.partition is not None
        return self.partition.readers[self.index]


def _check_int(name: str, value: Any, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise InvalidInput(f"{name} must be an int in {low}..{high}, got {value!r}")


def plan_reader(
    shards: Sequence[Shard],
    state: str | os.PathLike[str],
    *,
    rank: int,
    world_size: int,
    worker: int,
    num_workers: int,
    reader_state: str | os.PathLike[str] | None,
    repartition: bool,
    replace_with: Replace | None = None,
) -> ReaderPlan:
    """Find, make or (with ``repartition``) replace the partition this reader belongs to.
    ``replace_with``: how a partition is replaced (a shuffled stream carries the rest of its
    epoch, ``faultfs.stream.shuffle``); ``replace_partition`` by default."""
    _check_int("world_size", world_size, 1, MAX_READERS)
    _check_int("num_workers", num_workers, 1, MAX_READERS)
    _check_int("rank", rank, 0, world_size - 1)
    _check_int("worker", worker, 0, num_workers - 1)
    if world_size * num_workers > MAX_READERS:
        raise InvalidInput(f"world_size x num_workers must be at most {MAX_READERS}")
    state = os.fspath(state)
    template = check_template(reader_state)
    sidecar = state + PARTITION_SUFFIX
    path = reader_state_path(state, template, rank, worker, world_size, num_workers)
    plan = ReaderPlan(path, rank, world_size, worker, num_workers, None, sidecar)
    if (world_size, num_workers) == (1, 1) and not os.path.lexists(sidecar):
        return plan  # the unpartitioned stream, exactly as before: no sidecar, no lock
    fp = fingerprint(shards)
    with locked(state):
        part = load(sidecar)
        if part is not None and part.pending:
            roll_forward(state, part)
            part = replace(part, pending=False)
        if part is None:
            legacy_path = reader_state_path(state, template, 0, 0, 1, 1)
            legacy = read_committed(legacy_path)
            if legacy is not None and legacy.anything:
                # an unpartitioned run committed here: its partition is one reader over all
                # (the sizes only matter to a repartition: a refusal stats no shard)
                sizes = shard_sizes(shards) if repartition else [0] * len(shards)
                part = Partition(
                    0, 1, 1, fp, tuple(sizes), template, (((START, (len(sizes), 0, 0)),),)
                )
            else:
                own = read_committed(path)
                if own is not None and own.anything:
                    raise CorruptionError(
                        f"state {path} has commits but its partition record {sidecar} is "
                        "missing; restore the record, or remove the state to start over"
                    )
                part = first_partition(
                    shards, shard_sizes(shards), world_size, num_workers, template
                )
                store(sidecar, part)
                return replace(plan, partition=part, hold=reading(state, part, False))
        if part.fingerprint != fp or len(part.shard_sizes) != len(shards):
            raise InvalidInput(
                f"{sidecar}: the partition was made over {len(part.shard_sizes)} shards with "
                f"other names; these sources expand to {len(shards)} (a stream must be "
                "resumed with the same sources)"
            )
        if part.reader_state != template:
            raise InvalidInput(
                f"{sidecar}: the partition's readers keep their states as "
                f"{part.reader_state or 'the default names'!r}; this run gives "
                f"{template or 'the default names'!r}"
            )
        if (part.world_size, part.num_workers) != (world_size, num_workers):
            if not repartition:
                if part.generation:
                    written = (
                        f"state {path} was written with world_size {part.world_size}, "
                        f"num_workers {part.num_workers} (recorded in {sidecar})"
                    )
                else:
                    written = (
                        f"state {reader_state_path(state, template, 0, 0, 1, 1)} was "
                        "written by an unpartitioned stream (world_size 1, num_workers 1)"
                    )
                raise InvalidInput(
                    f"{written}; this run has world_size {world_size}, num_workers "
                    f"{num_workers} — pass repartition=True to restart from the first record "
                    "not committed by any reader"
                )
            hold = reading(state, part, True)
            try:
                part = (replace_with or replace_partition)(
                    shards, state, part, world_size, num_workers
                )
                fcntl.flock(hold, fcntl.LOCK_SH)  # from now on, one reader of the new one
            except BaseException:
                os.close(hold)
                raise
            return replace(plan, partition=part, hold=hold)
        return replace(plan, partition=part, hold=reading(state, part, False))


def first_partition(
    shards: Sequence[Shard],
    sizes: Sequence[int],
    world_size: int,
    num_workers: int,
    template: str,
) -> Partition:
    everything = [(START, (len(sizes), 0, 0))]
    readers = split(everything, world_size * num_workers, sizes)
    return Partition(
        1,
        world_size,
        num_workers,
        fingerprint(shards),
        tuple(sizes),
        template,
        tuple(tuple(r) for r in readers),
    )


def shard_sizes(shards: Sequence[Shard]) -> list[int]:
    """Every shard's size: one open (a stat or a HEAD request) per shard, no read."""
    sizes = []
    for shard in shards:
        f = shard.open()
        try:
            sizes.append(f.size)
        finally:
            f.close()
    return sizes
