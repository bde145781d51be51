"""Partitions: which records each distributed reader (``rank`` x ``worker``) of a RecordStream
owns, the sidecar that records it (``<state>.partition``), and repartitioning from the
readers' committed states.

Keys. A record's key is ``(shard_id, pos, row)``. For a line, ``pos`` is the byte offset where
the line starts and ``row`` is 0. For a Parquet row, ``pos`` is the position of its row group
(the byte where its first column chunk starts, made strictly increasing, see
``readers.row_group_positions``) and ``row`` its index in the group. Keys sort records in the
order a stream reads them. The *measure* of a key is its shard's start in the concatenation
of all shards (recorded sizes) plus ``pos``: the byte a split is balanced by.

Invariants:
- A partition gives reader ``i = rank * num_workers + worker`` a sorted list of disjoint
  half-open key intervals; the intervals of all readers are pairwise disjoint (checked when a
  sidecar is decoded), and a reader owns exactly the records whose keys fall in its
  intervals. The first partition covers every key, cut at the measures ``i * total //
  readers``: each reader gets the records that *start* in its byte range (a reader whose range
  starts mid-line skips to the next line start), so readers differ by less than one record in
  bytes, or one row group for Parquet (a row group belongs to the reader whose range holds
  its start).
- ``world_size == num_workers == 1`` without a sidecar is the unpartitioned stream of before:
  its state file is ``state`` itself and nothing else is written. Any other partition, or a
  repartitioned one, is recorded in the sidecar before a reader reads a record.
- The sidecar is written whole (temporary file, fsync, rename, directory fsync, through
  ``faultfs.store.durable``) while holding an exclusive ``flock`` on ``<state>.partition.lock``,
  so the readers of a fresh run, started at once, agree on one partition. Decoding checks the
  magic, version, CRC-32 and every count and bound against the file's length before using
  it; a damaged or hostile file is a CorruptionError naming it, never another exception.
- Repartitioning reads the committed coordinate of every old reader (no record is read; a
  Parquet coordinate costs that shard's footer), keeps the keys no old reader committed and
  splits them by measure among the new readers. It writes the new readers' fresh states under
  temporary names, then the new sidecar marked *pending* (the commit point), then renames the
  fresh states into place, removes the states of readers that no longer exist, and clears the
  mark. A crash before the commit point leaves the old partition whole; after it, the next
  opener finishes the renames, each exactly once (its temporary name is gone afterwards).
- Every open reader of a partition holds a shared ``flock`` on ``<state>.partition.readers``
  (taken while holding the partition lock, released by ``close`` or its process's end); a
  repartition needs it exclusively and is refused while one is held: a reader still running
  would deliver its uncommitted records while a new reader delivers them too. The unpartitioned
  stream of before holds no such lock, so a repartition also takes the exclusive ``flock`` every
  open stream holds on its ``.meta`` (``DualMetadataManager.open(exclusive=True)``) of each old
  state, for as long as it runs, and is refused while one is held.
- Hashes committed by old readers are carried, sorted and unique, into one file
  (``<state>.partition.g<G>.dedup``) whose count and xxh3_64 the sidecar records; every reader
  of generation G with dedup loads it beside its own WAL.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import struct
import zlib
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from itertools import pairwise
from typing import Any

import numpy as np
import xxhash

from faultfs.core.coord import U64_MAX, StreamCoordinate
from faultfs.core.slots import SLOT_SIZE, DiskSlot
from faultfs.errors import CorruptionError, InvalidInput, SourceError
from faultfs.store.dedup import sorted_unique
from faultfs.store.durable import fsync_dir, write_atomic
from faultfs.store.metadata import HASH_SIZE, WAL_SUFFIX, choose_active, read_meta
from faultfs.stream.readers import Piece, import_parquet, row_group_positions
from faultfs.stream.shards import Shard

Key = tuple[int, int, int]  # (shard_id, pos, row): see the module docstring
Interval = tuple[Key, Key]  # [lo, hi)
START: Key = (0, 0, 0)

PARTITION_SUFFIX = ".partition"
LOCK_SUFFIX = ".partition.lock"
READERS_SUFFIX = ".partition.readers"  # every open partitioned reader holds a shared flock
MAGIC = b"FFPT"
VERSION = 1  # bump on any layout change; the golden test says so
FLAG_PENDING = 1  # a repartition whose fresh states may not all be in place yet
MAX_READERS = 1 << 20  # far beyond any cluster; bounds what a damaged header can make us loop over
MAX_SIDECAR_BYTES = 64 << 20  # a real sidecar is ~32 bytes per interval; refuse to slurp more
_HEAD = struct.Struct("<4sIIIIIIIIIIQQQ")
# magic, version, flags, generation, world_size, num_workers, prev_world_size,
# prev_num_workers, prev_generation, shard_count, template_len, fingerprint, base_count,
# base_digest
_KEY = struct.Struct("<IQI")
_COUNT = struct.Struct("<I")
_SIZE = struct.Struct("<Q")
_CRC = struct.Struct("<I")
_HASH_DTYPE = np.dtype("<u8")


@dataclass(frozen=True)
class Partition:
    """A recorded partition (one generation of it)."""

    generation: int
    world_size: int
    num_workers: int
    fingerprint: int  # xxh3_64 of the shard URLs, in order
    shard_sizes: tuple[int, ...]
    reader_state: str  # the reader state template ("" for the default names)
    readers: tuple[tuple[Interval, ...], ...]  # index rank * num_workers + worker
    base_count: int = 0  # hashes carried from before this generation
    base_digest: int = 0  # xxh3_64 of their little-endian bytes
    pending: bool = False
    previous: tuple[int, int, int] = (0, 0, 0)  # world_size, num_workers, generation replaced

    @property
    def reader_count(self) -> int:
        return self.world_size * self.num_workers

    @property
    def total_bytes(self) -> int:
        return sum(self.shard_sizes)


# -- names ----------------------------------------------------------------------------------


def check_template(reader_state: str | os.PathLike[str] | None) -> str:
    """The reader state template (``""``: default names), checked to name every reader apart."""
    if reader_state is None:
        return ""
    template = os.fspath(reader_state)
    if "{rank}" not in template or "{worker}" not in template:
        raise InvalidInput(
            f"reader_state {template!r} must contain {{rank}} and {{worker}}, so that every "
            "reader has its own state file"
        )
    try:
        template.format(rank=0, worker=0)
    except (KeyError, IndexError, ValueError) as err:
        raise InvalidInput(
            f"reader_state {template!r} may only use {{rank}} and {{worker}}: {err}"
        ) from None
    return template


def reader_state_path(
    state: str, template: str, rank: int, worker: int, world_size: int, num_workers: int
) -> str:
    """The state file of one reader: ``state`` itself for one unpartitioned reader, else
    ``<state>.rank-R.worker-W.meta`` or the user's template."""
    if template:
        return template.format(rank=rank, worker=worker)
    if world_size == 1 and num_workers == 1:
        return state
    return f"{state}.rank-{rank}.worker-{worker}.meta"


def reader_paths(state: str, template: str, world_size: int, num_workers: int) -> list[str]:
    return [
        reader_state_path(state, template, r, w, world_size, num_workers)
        for r in range(world_size)
        for w in range(num_workers)
    ]


def base_path(state: str, generation: int) -> str:
    return f"{state}{PARTITION_SUFFIX}.g{generation}{WAL_SUFFIX}"


def _fresh_name(path: str, generation: int) -> str:
    return f"{path}.g{generation}.fresh"


def fingerprint(shards: Sequence[Shard]) -> int:
    """xxh3_64 of the shard URLs in order (URLs are hashed, never stored: they may hold
    credentials)."""
    h = xxhash.xxh3_64()
    for shard in shards:
        h.update(shard.url.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    return h.intdigest()


# -- the sidecar format ----------------------------------------------------------------------


def encode(part: Partition) -> bytes:
    template = part.reader_state.encode("utf-8")
    head = _HEAD.pack(
        MAGIC,
        VERSION,
        FLAG_PENDING if part.pending else 0,
        part.generation,
        part.world_size,
        part.num_workers,
        *part.previous,
        len(part.shard_sizes),
        len(template),
        part.fingerprint,
        part.base_count,
        part.base_digest,
    )
    out = [head, b"".join(_SIZE.pack(s) for s in part.shard_sizes), template]
    for intervals in part.readers:
        out.append(_COUNT.pack(len(intervals)))
        for lo, hi in intervals:
            out.append(_KEY.pack(*lo) + _KEY.pack(*hi))
    body = b"".join(out)
    return body + _CRC.pack(zlib.crc32(body))


def decode(data: bytes, where: str) -> Partition:
    """Parse and check a sidecar; CorruptionError (naming ``where``) for anything wrong."""

    def bad(what: str) -> CorruptionError:
        return CorruptionError(f"{where}: damaged partition record: {what}")

    if len(data) < _HEAD.size + _CRC.size:
        raise bad(f"{len(data)} bytes, shorter than the {_HEAD.size + _CRC.size}-byte minimum")
    (
        magic,
        version,
        flags,
        generation,
        world,
        workers,
        prev_world,
        prev_workers,
        prev_gen,
        shard_count,
        template_len,
        fp,
        base_count,
        base_digest,
    ) = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise bad(f"bad magic {magic!r}")
    if version != VERSION:
        raise bad(f"version {version}, this faultfs reads version {VERSION}")
    (crc,) = _CRC.unpack_from(data, len(data) - _CRC.size)
    if zlib.crc32(data[: -_CRC.size]) != crc:
        raise bad("bad checksum")
    if flags & ~FLAG_PENDING:
        raise bad(f"unknown flags {flags:#x}")
    if not 1 <= world or not 1 <= workers or world * workers > MAX_READERS:
        raise bad(f"world_size {world} x num_workers {workers} readers")
    if not 1 <= shard_count:
        raise bad("no shards")
    end = len(data) - _CRC.size
    off = _HEAD.size

    def need(n: int, what: str) -> None:
        if n > end - off:
            raise bad(f"{what} needs {n} bytes, {end - off} are left")

    need(shard_count * _SIZE.size, f"shard count {shard_count}")
    sizes = tuple(
        s for (s,) in struct.iter_unpack("<Q", data[off : off + shard_count * _SIZE.size])
    )
    off += shard_count * _SIZE.size
    if sum(sizes) > U64_MAX:
        raise bad("shard sizes overflow 64 bits")
    need(template_len, f"template length {template_len}")
    try:
        template = data[off : off + template_len].decode("utf-8")
        if template:
            check_template(template)
    except (UnicodeDecodeError, InvalidInput) as err:
        raise bad(f"reader_state template: {err}") from None
    off += template_len
    readers: list[tuple[Interval, ...]] = []
    for i in range(world * workers):
        need(_COUNT.size, f"reader {i}'s interval count")
        (count,) = _COUNT.unpack_from(data, off)
        off += _COUNT.size
        need(count * 2 * _KEY.size, f"reader {i}'s {count} intervals")
        intervals = []
        for _ in range(count):
            lo = _KEY.unpack_from(data, off)
            hi = _KEY.unpack_from(data, off + _KEY.size)
            off += 2 * _KEY.size
            for key in (lo, hi):
                s, pos, row = key
                if (
                    s > shard_count
                    or (s == shard_count and (pos or row))
                    or (s < shard_count and pos > sizes[s])
                ):
                    raise bad(f"reader {i}: key {key} is outside the {shard_count} shards")
            if not lo < hi:
                raise bad(f"reader {i}: empty interval {lo}..{hi}")
            if intervals and lo < intervals[-1][1]:
                raise bad(f"reader {i}: intervals out of order at {lo}")
            intervals.append((lo, hi))
        readers.append(tuple(intervals))
    if off != end:
        raise bad(f"{end - off} bytes after the last reader")
    every = sorted((iv, i) for i, ivs in enumerate(readers) for iv in ivs)
    for (a, i), (b, j) in pairwise(every):
        if b[0] < a[1]:
            raise bad(f"readers {i} and {j} both own the records at {b[0]}")
    return Partition(
        generation,
        world,
        workers,
        fp,
        sizes,
        template,
        tuple(readers),
        base_count,
        base_digest,
        bool(flags & FLAG_PENDING),
        (prev_world, prev_workers, prev_gen),
    )


def load(path: str) -> Partition | None:
    """The sidecar at ``path``, or None when there is none."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise InvalidInput(f"{path}: cannot open the partition record: {err.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidInput(f"{path} is not a regular file, not a partition record")
        if st.st_size > MAX_SIDECAR_BYTES:
            raise CorruptionError(
                f"{path}: damaged partition record: {st.st_size} bytes, more than "
                f"{MAX_SIDECAR_BYTES}"
            )
        data = os.pread(fd, st.st_size, 0)
    finally:
        os.close(fd)
    return decode(data, path)


def store(path: str, part: Partition) -> None:
    write_atomic(path, [encode(part)])


@contextlib.contextmanager
def locked(state: str) -> Iterator[None]:
    """Hold the partition lock of ``state`` (an exclusive flock; waits for other openers)."""
    path = state + LOCK_SUFFIX
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as err:
        raise InvalidInput(f"{path}: cannot open the partition lock: {err.strerror}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as err:
            raise InvalidInput(
                f"{path}: cannot take the partition lock ({err.strerror}); the state directory "
                "must support flock"
            ) from None
        yield
    finally:
        os.close(fd)


# -- reader states, read-only ----------------------------------------------------------------


@dataclass(frozen=True)
class CommittedState:
    """What one reader's state file says was committed."""

    path: str
    batch_id: int
    coord: StreamCoordinate
    dedup_count: int

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
    return CommittedState(path, slot.committed_batch_id, slot.coord, slot.dedup_count)


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
    return np.frombuffer(data, dtype=_HASH_DTYPE).astype(np.uint64)


def load_base(state: str, part: Partition) -> np.ndarray:
    """The hashes carried into this generation, checked against the sidecar."""
    path = base_path(state, part.generation)
    hashes = read_hashes(path, part.base_count, what="the carried dedup hashes")
    if part.base_count:
        if os.path.getsize(path) != part.base_count * HASH_SIZE:
            raise CorruptionError(f"{path}: not the {part.base_count} hashes the partition records")
        if xxhash.xxh3_64_intdigest(hashes.astype(_HASH_DTYPE).tobytes()) != part.base_digest:
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


# -- keys and splits -------------------------------------------------------------------------


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


def _merge(intervals: Sequence[Interval]) -> list[Interval]:
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
    return [_merge(part) for part in out]


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


# -- opening: the plan of one reader ---------------------------------------------------------


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
) -> ReaderPlan:
    """Find, make or (with ``repartition``) replace the partition this reader belongs to."""
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
                return replace(plan, partition=part, hold=_reading(state, part, False))
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
            hold = _reading(state, part, True)
            try:
                part = _repartition(shards, state, part, world_size, num_workers)
                fcntl.flock(hold, fcntl.LOCK_SH)  # from now on, one reader of the new one
            except BaseException:
                os.close(hold)
                raise
            return replace(plan, partition=part, hold=hold)
        return replace(plan, partition=part, hold=_reading(state, part, False))


def _reading(state: str, part: Partition, replacing: bool) -> int:
    """A descriptor of ``<state>.partition.readers`` holding a shared flock (this reader is
    open), or (``replacing``) an exclusive one, taken only if no reader of ``part`` is open —
    a repartition under running readers would hand their uncommitted records to new ones
    too. Called holding the partition lock, so neither waits for a repartition."""
    path = state + READERS_SUFFIX
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except OSError as err:
        raise InvalidInput(f"{path}: cannot open the readers' lock: {err.strerror}") from None
    try:
        if not replacing:
            fcntl.flock(fd, fcntl.LOCK_SH)
            return fd
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise InvalidInput(
                f"{state}: readers of the recorded partition (world_size {part.world_size}, "
                f"num_workers {part.num_workers}) are still open; close them before "
                "repartitioning") from None
        return fd
    except BaseException:
        os.close(fd)
        raise


def _repartition(
    shards: Sequence[Shard], state: str, old: Partition, world_size: int, num_workers: int
) -> Partition:
    """Replace ``old`` by a partition of what no old reader committed (holding the lock)."""
    claims = _claim_states(reader_paths(state, old.reader_state, old.world_size, old.num_workers))
    try:
        return _replace_partition(shards, state, old, world_size, num_workers)
    finally:
        for fd in claims:
            os.close(fd)


def _claim_states(paths: Sequence[str]) -> list[int]:
    """Descriptors of the existing state files ``paths``, each holding the exclusive flock an
    open stream holds on its ``.meta`` (see the module doc); InvalidInput if a stream has one
    open: it would go on committing into a state the repartition supersedes."""
    claims: list[int] = []
    try:
        for path in paths:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
            except FileNotFoundError:
                continue
            claims.append(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise InvalidInput(
                    f"{path}: this reader's state is open in a stream; close it before "
                    "repartitioning"
                ) from None
            except OSError as err:  # no flock here: no guard, as for the stream itself
                if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise
    except BaseException:
        for fd in claims:
            os.close(fd)
        raise
    return claims


def _replace_partition(
    shards: Sequence[Shard], state: str, old: Partition, world_size: int, num_workers: int
) -> Partition:
    """The work of ``_repartition``, with every old state claimed."""
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
    rest = _merge(
        sorted(
            (max(lo, key), hi)
            for intervals, key in zip(old.readers, keys, strict=True)
            for lo, hi in intervals
            if hi > key
        )
    )
    readers = split(rest, world_size * num_workers, sizes)
    base = sorted_unique(np.concatenate(hashes)) if hashes else np.empty(0, dtype=np.uint64)
    generation = old.generation + 1
    raw = base.astype(_HASH_DTYPE).tobytes()
    if base.size:
        write_atomic(base_path(state, generation), [raw])
    new_paths = reader_paths(state, old.reader_state, world_size, num_workers)
    for path in new_paths:
        write_atomic(_fresh_name(path, generation), [meta_image()], sync_dir=False)
    for directory in {os.path.dirname(os.path.abspath(p)) for p in new_paths}:
        fsync_dir(directory)
    new = Partition(
        generation,
        world_size,
        num_workers,
        old.fingerprint,
        sizes,
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
        with contextlib.suppress(FileNotFoundError):
            os.rename(_fresh_name(path, part.generation), path)
    prev_world, prev_workers, prev_generation = part.previous
    old_paths = (
        reader_paths(state, part.reader_state, prev_world, prev_workers)
        if (prev_world and prev_workers)
        else []
    )
    for path in sorted(set(old_paths) - set(new_paths)):
        for name in (path, path + WAL_SUFFIX):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)
    if prev_generation != part.generation:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(base_path(state, prev_generation))
    for directory in {os.path.dirname(os.path.abspath(p)) for p in new_paths + old_paths}:
        fsync_dir(directory)
    store(state + PARTITION_SUFFIX, replace(part, pending=False))
