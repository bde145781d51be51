"""The partition sidecar (``<state>.partition``): the record of who owns which records.

Its byte format (``encode``, ``decode``; docs/FORMAT-cursors.md), and reading and writing it
whole.

Invariants:
- A partition gives reader ``i = rank * num_workers + worker`` a sorted list of disjoint
  half-open key intervals (``keys``); the intervals of all readers are pairwise disjoint
  (checked when a sidecar is decoded), and a reader owns exactly the records whose keys fall
  in its intervals.
- The sidecar is written whole (temporary file, fsync, rename, directory fsync, through
  ``faultfs.store.durable``), and only while holding the partition lock (``locks.locked``).
  Decoding checks the magic, version, CRC-32 and every count and bound against the file's
  length before using it; a damaged or hostile file is a CorruptionError naming it, never
  another exception.
- The shard URLs are recorded only as their hash (``fingerprint``): they may hold credentials.
"""

from __future__ import annotations

import os
import stat
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import xxhash

from faultfs.core.coord import U64_MAX
from faultfs.core.framing import CRC_SIZE, damaged, frame, unframe
from faultfs.errors import CorruptionError, InvalidInput
from faultfs.store.durable import write_atomic
from faultfs.stream.partition.keys import Interval
from faultfs.stream.partition.names import check_template
from faultfs.stream.shards import Shard

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


def fingerprint(shards: Sequence[Shard]) -> int:
    """xxh3_64 of the shard URLs in order (URLs are hashed, never stored: they may hold
    credentials)."""
    h = xxhash.xxh3_64()
    for shard in shards:
        h.update(shard.url.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    return h.intdigest()



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
    return frame(b"".join(out))


def decode(data: bytes, where: str) -> Partition:
    """Parse and check a sidecar; CorruptionError (naming ``where``) for anything wrong."""

    def bad(what: str) -> CorruptionError:
        return damaged(where, "partition record", what)

    (
        _,
        _,
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
    ) = unframe(data, where, "partition record", _HEAD, MAGIC, VERSION)
    if flags & ~FLAG_PENDING:
        raise bad(f"unknown flags {flags:#x}")
    if not 1 <= world or not 1 <= workers or world * workers > MAX_READERS:
        raise bad(f"world_size {world} x num_workers {workers} readers")
    if not 1 <= shard_count:
        raise bad("no shards")
    end = len(data) - CRC_SIZE
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

