"""Repartitioning a shuffled stream: the rest of the epoch its readers are in, carried to the
new readers (``replace_shuffled``), and the byte format of that rest
(``<state>.partition.gG.shuffle``, docs/FORMAT-cursors.md).

Invariants:
- Every old reader's checkpoint is read (its ``.meta`` slot and shuffle slot, read-only; no
  record is read). The readers with commits must be in one epoch E — inside it, or done
  with it (then at the start of E + 1); a reader without commits is taken to be at the start
  of E. Anything else is refused: the rest would span two epochs.
- The rest of E is what no old reader committed: the window each had begun, from the
  position it had reached (a *remainder*: its blocks, its permutation key, that position),
  the windows carried over an earlier repartition that nobody began (remainders still), and
  the blocks of every window nobody began (the *pool*). The new readers deal the remainders
  and then the pool's blocks (``plan.reader_windows``): every record of E not committed is
  in exactly one new reader's windows, at the same place of the same permutation, so no
  committed record comes again in E. Later epochs follow the new readers' pure plan.
- With the rest, the hashes committed in E (by every old reader since the start of E, and
  those carried into the old generation when it carried E) are carried into the new
  generation's ``.dedup`` file, so dedup in the rest of E sees every record delivered in E.
- The files are written as a partition's repartition writes them (``partition.repartition``):
  the carried hashes, the rest, the new readers' fresh states and shuffle records under
  temporary names, then the sidecar marked pending (the commit point), then the renames.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from faultfs.core.framing import CRC_SIZE, damaged, frame, unframe
from faultfs.errors import CorruptionError, InvalidInput
from faultfs.store.metadata import WAL_SUFFIX
from faultfs.stream.partition import (
    SHUFFLE_SUFFIX,
    Partition,
    carried_path,
    claim_states,
    first_partition,
    load_base,
    read_committed,
    read_hashes,
    reader_paths,
    write_replacement,
)
from faultfs.stream.shards import Shard
from faultfs.stream.shuffle.plan import Carried, EpochGrid, Geometry, WindowSpec, reader_windows
from faultfs.stream.shuffle.record import (
    ShuffleHeader,
    ShuffleSlot,
    committed_pair,
    decode,
    image,
    read_record,
)

MAGIC = b"FFSC"
VERSION = 1  # bump on any layout change; the golden test says so
MAX_CARRIED_BYTES = 256 << 20  # a bitmap of 2**31 blocks; refuse to slurp more
_HEAD = struct.Struct("<4sIIIQQQIIQ")  # magic, version, generation, reserved, epoch, seed,
# block_bytes, window_blocks, remainder_count, block_count
_REM = struct.Struct("<QQI")  # key, start, block count


# -- the format -------------------------------------------------------------------------------


@dataclass(frozen=True)
class CarriedRecord:
    """A carried rest with the geometry it was cut with (checked against the stream's)."""

    plan: Carried
    geometry: Geometry


def encode(rec: CarriedRecord) -> bytes:
    c, g = rec.plan, rec.geometry
    out = [_HEAD.pack(MAGIC, VERSION, c.generation, 0, c.epoch, g.seed, g.block_bytes,
                      g.window_blocks, len(c.remainders), int(c.pool.size))]
    for w in c.remainders:
        out.append(_REM.pack(w.key, w.start, len(w.blocks)))
        out.append(struct.pack(f"<{len(w.blocks)}Q", *w.blocks))
    out.append(np.packbits(c.pool.astype(np.uint8), bitorder="little").tobytes())
    return frame(b"".join(out))


def decode_carried(data: bytes, where: str) -> CarriedRecord:
    """Parse and check a carried rest; CorruptionError (naming ``where``) for anything wrong."""

    def bad(what: str) -> CorruptionError:
        return damaged(where, "shuffle carry", what)

    (_, _, generation, reserved, epoch, seed, block_bytes, window_blocks, rem_count,
     block_count) = unframe(data, where, "shuffle carry", _HEAD, MAGIC, VERSION)
    if reserved or not block_bytes or not window_blocks:
        raise bad(f"block of {block_bytes} bytes, window of {window_blocks} blocks, "
                  f"reserved {reserved}")
    end = len(data) - CRC_SIZE
    off = _HEAD.size
    seen = np.zeros(block_count, dtype=bool) if block_count <= 8 * end else None
    if seen is None:
        raise bad(f"block count {block_count} needs more than the {end} bytes there are")
    remainders = []
    for i in range(rem_count):
        if _REM.size > end - off:
            raise bad(f"remainder {i} needs {_REM.size} bytes, {end - off} are left")
        key, start, n = _REM.unpack_from(data, off)
        off += _REM.size
        if not 1 <= n <= window_blocks or 8 * n > end - off:
            raise bad(f"remainder {i}: {n} blocks")
        blocks = struct.unpack_from(f"<{n}Q", data, off)
        off += 8 * n
        for b in blocks:
            if b >= block_count or seen[b]:
                raise bad(f"remainder {i}: block {b} is outside the {block_count} blocks or "
                          "named twice")
            seen[b] = True
        remainders.append(WindowSpec(tuple(blocks), key, start))
    nbytes = -(-block_count // 8)
    if end - off != nbytes:
        raise bad(f"{end - off} bytes for the pool of {block_count} blocks ({nbytes} needed)")
    pool = np.unpackbits(np.frombuffer(data, dtype=np.uint8, count=nbytes, offset=off),
                         count=None, bitorder="little")
    if pool[block_count:].any():
        raise bad("pool bits past the last block")
    pool = pool[:block_count].astype(bool)
    if (pool & seen).any():
        raise bad(f"block {int(np.flatnonzero(pool & seen)[0])} is in a remainder and the pool")
    return CarriedRecord(Carried(generation, epoch, tuple(remainders), pool),
                         Geometry(seed, block_bytes, window_blocks))


def load_carried(state: str, part: Partition, geometry: Geometry) -> Carried | None:
    """The rest carried into ``part``'s generation, checked against ``geometry`` (None: none)."""
    path = carried_path(state, part.generation)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size > MAX_CARRIED_BYTES:
            raise damaged(path, "shuffle carry", f"{size} bytes, more than {MAX_CARRIED_BYTES}")
        data = os.pread(fd, size, 0)
    finally:
        os.close(fd)
    rec = decode_carried(data, path)
    if rec.plan.generation != part.generation:
        raise damaged(path, "shuffle carry",
                      f"generation {rec.plan.generation}, the partition's is {part.generation}")
    if rec.geometry != geometry:
        raise InvalidInput(f"{path}: the carried epoch was cut with seed {rec.geometry.seed}, "
                           f"{rec.geometry.window_bytes}-byte windows; this stream has seed "
                           f"{geometry.seed}, {geometry.window_bytes}-byte windows")
    return rec.plan


# -- the repartition --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Reader:
    """What one old reader committed."""

    path: str
    slot: ShuffleSlot | None  # None: nothing committed (no state, or a fresh one)
    header: ShuffleHeader | None  # None: no shuffle record
    dedup_count: int
    genesis_epoch: int = 0  # the epoch a reader without commits was made for

    @property
    def epoch(self) -> int:
        """The epoch it is in: after a finished one, the next (at its start)."""
        assert self.slot is not None
        return self.slot.epoch + 1 if self.slot.finished else self.slot.epoch


def _read_reader(path: str) -> _Reader:
    """An old reader's committed slot and shuffle slot, read without changing a file (the
    record's checkpoint: its ``.meta`` may be behind it after a power loss)."""
    pair = committed_pair(path)
    if pair is None:
        committed = read_committed(path)
        if committed is not None and committed.anything:
            raise InvalidInput(f"{path}: this reader's state was written by a stream that "
                               "reads in file order; it cannot be carried into a shuffled one")
        return _Reader(path, None, None, 0)
    meta, slot = pair
    header, _ = decode(read_record(path + SHUFFLE_SUFFIX) or b"", path + SHUFFLE_SUFFIX)
    if not meta.epoch:
        return _Reader(path, None, header, 0, slot.epoch)
    return _Reader(path, slot, header, meta.dedup_count)


def _rest(
    readers: list[_Reader], old: Partition, state: str, geometry: Geometry
) -> tuple[int, Carried | None, list[np.ndarray]]:
    """(the epoch the new readers start in, the rest of it carried or None, the hashes
    committed in it) from the old readers' checkpoints."""
    carried_old = load_carried(state, old, geometry) if old.generation else None
    committed = [r for r in readers if r.slot is not None]
    idle = [r for r in readers if r.slot is None]
    epochs = [r.epoch for r in committed]
    if idle and carried_old is not None:
        epochs.append(carried_old.epoch)  # its readers without commits owe their share
    if not epochs:
        return max((r.genesis_epoch for r in readers), default=0), None, []
    epoch = min(epochs)
    for r in committed:
        assert r.slot is not None
        if r.epoch != epoch and not (r.epoch == epoch + 1 and r.slot.finished):
            raise InvalidInput(
                f"{r.path} is in epoch {r.epoch}, another reader of its partition in epoch "
                f"{epoch}: a shuffled partition is repartitioned inside one epoch; finish "
                f"epoch {epoch} with the recorded partition first"
            )
    if carried_old is not None and carried_old.epoch != epoch:
        carried_old = None
    grid = EpochGrid(old.shard_sizes, geometry.seed, epoch, geometry.block_bytes)
    pool = np.zeros(grid.block_count, dtype=bool)
    remainders: list[WindowSpec] = []
    for i, r in enumerate(readers):
        at, pos = 0, 0
        if r.slot is not None:
            if r.epoch != epoch:
                continue  # done with the epoch
            if not r.slot.finished:
                at, pos = r.slot.window, r.slot.position
        windows = reader_windows(grid, geometry, old.world_size * old.num_workers, i, carried_old)
        for k in range(at, len(windows)):
            w = windows[k]
            start = max(w.start, pos) if k == at else w.start
            if start:
                remainders.append(replace(w, start=start))
            else:
                pool[list(w.blocks)] = True
    begun = carried_old is not None or any(
        r.slot is not None and r.slot.epoch == epoch for r in committed
    )
    if not remainders and not pool.any():
        return epoch + 1, None, []  # every reader is done with the epoch
    if not begun:
        return epoch, None, []  # nobody began it: the new readers' own plan
    hashes = []
    for r in committed:
        assert r.slot is not None
        if r.slot.epoch == epoch and r.dedup_count > r.slot.dedup_base:
            every = read_hashes(r.path + WAL_SUFFIX, r.dedup_count, what="the dedup WAL")
            hashes.append(every[r.slot.dedup_base :])
    if carried_old is not None and old.base_count:
        hashes.append(load_base(state, old))
    return epoch, Carried(old.generation + 1, epoch, tuple(remainders), pool), hashes


def replace_shuffled(
    shards: Sequence[Shard],
    state: str,
    old: Partition,
    world_size: int,
    num_workers: int,
    geometry: Geometry,
    fingerprint: int,
) -> Partition:
    """Replace the partition of a shuffled stream (holding its locks, see
    ``partition.plan_reader``): the new readers take the rest of the epoch the old ones are
    in (module doc)."""
    old_paths = reader_paths(state, old.reader_state, old.world_size, old.num_workers)
    claims = claim_states(old_paths)
    try:
        readers = [_read_reader(p) for p in old_paths]
        for r in readers:
            if r.header is not None and (r.header.geometry, r.header.fingerprint) != (
                geometry, fingerprint
            ):
                g = r.header.geometry
                raise InvalidInput(
                    f"{r.path}: this reader shuffles with seed {g.seed}, "
                    f"{g.window_bytes}-byte windows; this stream has seed {geometry.seed}, "
                    f"{geometry.window_bytes}-byte windows"
                )
        epoch, carried, hashes = _rest(readers, old, state, geometry)
        generation = old.generation + 1
        files = []
        if carried is not None:
            files.append((carried_path(state, generation),
                          encode(CarriedRecord(carried, geometry))))
        header = ShuffleHeader(geometry, fingerprint, tuple(old.shard_sizes))
        genesis = image(header, [ShuffleSlot(0, epoch, generation=generation)])
        # the partition's intervals are not what a shuffled reader reads (the plan deals the
        # blocks), but the sidecar keeps a valid partition of every record
        even = first_partition(shards, old.shard_sizes, world_size, num_workers,
                               old.reader_state)
        return write_replacement(
            state, old, world_size, num_workers, even.readers, hashes, files=files,
            companions=lambda path: [(path + SHUFFLE_SUFFIX, genesis)],
        )
    finally:
        for fd in claims:
            os.close(fd)
