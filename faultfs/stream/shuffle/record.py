"""The shuffle record (``<state>.shuffle``): where a shuffled reader is in its epoch, one
ping-pong slot per checkpoint, beside the byte-exact ``.meta`` that has no room for it.

Its byte format (docs/FORMAT-cursors.md, "The shuffle record"): two 64-byte slots, A at 0
(odd checkpoint epochs) and B at 64 (even ones, and the genesis slot), then a header that
never changes after the file is made: the seed and geometry of the shuffle and the shard
list (its URLs' fingerprint and every shard's size).

Invariants:
- A slot names the ``.meta`` slot it goes with (``meta_epoch``, that slot's commit number)
  and is written, at its parity position, and fsynced *before* that ``.meta`` slot: a crash
  between the two leaves the previous ``.meta`` slot active and its shuffle slot untouched
  (in the other position). So the state of a checkpoint is its ``.meta`` slot and the shuffle
  slot with the same ``meta_epoch``; any other pairing is refused (``CorruptionError``),
  never guessed.
- The file is created whole (temporary file, fsync, rename, directory fsync), never grown
  or shrunk; its header is checked (magic, version, CRC, counts against the length) before
  anything in it is used, and each slot as the ``.meta`` slots are (all-zero, bad magic, bad
  version, bad CRC), then its fields (flags, reserved bytes, parity).
- All file access goes through a ``FileOps`` seam, so crash tests can tear unsynced writes.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from faultfs.core.coord import U32_MAX, U64_MAX
from faultfs.core.framing import CRC_SIZE, damaged, frame, unframe
from faultfs.errors import CorruptionError, InvalidInput, SourceError
from faultfs.store.fileops import FileOps, OsFileOps
from faultfs.stream.shuffle.plan import Geometry

SLOT_MAGIC = b"FFSS"
HEADER_MAGIC = b"FFSH"
VERSION = 1  # of slots and header; bump on any layout change (the golden test says so)
SLOT_SIZE = 64
SLOTS_SIZE = 2 * SLOT_SIZE
FLAG_FINISHED = 1  # the reader's part of the epoch is delivered and committed
MAX_SHARDS = 1 << 22  # bounds what a damaged header can make us allocate
MAX_RECORD_BYTES = SLOTS_SIZE + 44 + 8 * MAX_SHARDS
_SLOT = struct.Struct("<4sIQQQQIII8x")  # magic, version, meta_epoch, epoch, window,
# position, dedup_base, generation, flags, reserved: bytes 0..60, then the CRC
_HEAD = struct.Struct("<4sIQQIIQ")  # magic, version, seed, block_bytes, window_blocks,
# shard_count, fingerprint
assert _SLOT.size + CRC_SIZE == SLOT_SIZE


@dataclass(frozen=True)
class ShuffleSlot:
    """Where a shuffled reader's checkpoint is: its epoch, the window of its part of that
    epoch and the positions of that window's permutation consumed (``finished``: the whole
    part, window = the part's window count), the WAL hashes committed before the epoch
    (``dedup_base``) and the partition generation whose plan the epoch follows."""

    meta_epoch: int
    epoch: int
    window: int = 0
    position: int = 0
    dedup_base: int = 0
    generation: int = 0
    finished: bool = False

    def __post_init__(self) -> None:
        for name, limit in (("meta_epoch", U64_MAX), ("epoch", U64_MAX), ("window", U64_MAX),
                            ("position", U64_MAX), ("dedup_base", U32_MAX),
                            ("generation", U32_MAX)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= limit:
                raise InvalidInput(f"ShuffleSlot.{name}={value!r} out of range 0..{limit}")

    @property
    def offset(self) -> int:
        return 0 if self.meta_epoch % 2 else SLOT_SIZE

    def encode(self) -> bytes:
        return frame(_SLOT.pack(SLOT_MAGIC, VERSION, self.meta_epoch, self.epoch, self.window,
                                self.position, self.dedup_base, self.generation,
                                FLAG_FINISHED if self.finished else 0))


@dataclass(frozen=True)
class ShuffleHeader:
    """What never changes in a shuffled stream's state: its shuffle and its shards."""

    geometry: Geometry
    fingerprint: int  # xxh3_64 of the shard URLs (partition.fingerprint)
    sizes: tuple[int, ...]

    def encode(self) -> bytes:
        g = self.geometry
        body = _HEAD.pack(HEADER_MAGIC, VERSION, g.seed, g.block_bytes, g.window_blocks,
                          len(self.sizes), self.fingerprint)
        return frame(body + struct.pack(f"<{len(self.sizes)}Q", *self.sizes))


def image(header: ShuffleHeader, slots: Sequence[ShuffleSlot]) -> bytes:
    """The bytes of a record holding ``slots`` (at most one of each parity; a position
    without one is all zero) and ``header``."""
    area = bytearray(SLOTS_SIZE)
    for slot in slots:
        area[slot.offset : slot.offset + SLOT_SIZE] = slot.encode()
    return bytes(area) + header.encode()


def judge_slot(data: bytes, offset: int) -> tuple[ShuffleSlot | None, str]:
    """A slot, or None and why not: "all-zero", "bad magic", "bad version", "bad crc" (a
    torn write), "bad fields: ..."."""
    if data == bytes(SLOT_SIZE):
        return None, "all-zero"
    magic, version, meta_epoch, epoch, window, position, base, gen, flags = _SLOT.unpack_from(data)
    if magic != SLOT_MAGIC:
        return None, "bad magic"
    if version != VERSION:
        return None, "bad version"
    (crc,) = struct.unpack_from("<I", data, _SLOT.size)
    if zlib.crc32(data[: _SLOT.size]) != crc:
        return None, "bad crc"
    if flags & ~FLAG_FINISHED:
        return None, f"bad fields: unknown flags {flags:#x}"
    if data[52:60] != bytes(8):
        return None, "bad fields: reserved bytes are not zero"
    slot = ShuffleSlot(meta_epoch, epoch, window, position, base, gen, bool(flags))
    if slot.offset != offset:
        return None, f"bad fields: checkpoint epoch {meta_epoch} belongs in the other slot"
    return slot, "valid"


def decode_header(data: bytes, where: str) -> ShuffleHeader:
    """The header after a record's slots; CorruptionError naming ``where``."""
    _, _, seed, block_bytes, window_blocks, shard_count, fp = unframe(
        data, where, "shuffle record", _HEAD, HEADER_MAGIC, VERSION, at=SLOTS_SIZE
    )
    head = len(data) - SLOTS_SIZE
    if not 1 <= shard_count <= MAX_SHARDS:
        raise damaged(where, "shuffle record", f"shard count {shard_count}")
    if head != _HEAD.size + 8 * shard_count + CRC_SIZE:
        raise damaged(where, "shuffle record", f"{head} header bytes for {shard_count} shards")
    if not block_bytes or not window_blocks:
        raise damaged(where, "shuffle record",
                      f"block of {block_bytes} bytes, window of {window_blocks} blocks")
    sizes = struct.unpack_from(f"<{shard_count}Q", data, SLOTS_SIZE + _HEAD.size)
    if sum(sizes) > U64_MAX:
        raise damaged(where, "shuffle record", "shard sizes overflow 64 bits")
    return ShuffleHeader(Geometry(seed, block_bytes, window_blocks), fp, tuple(sizes))


def decode(data: bytes, where: str) -> tuple[ShuffleHeader, list[tuple[ShuffleSlot | None, str]]]:
    """A record's header and its two slots as judged (A, B)."""
    header = decode_header(data, where)
    return header, [judge_slot(data[:SLOT_SIZE], 0), judge_slot(data[SLOT_SIZE:SLOTS_SIZE],
                                                                  SLOT_SIZE)]


def slot_for(slots: list[tuple[ShuffleSlot | None, str]], meta_epoch: int, where: str,
             meta_path: str) -> ShuffleSlot:
    """The slot that goes with the ``.meta`` slot of ``meta_epoch``, or CorruptionError."""
    for slot, _ in slots:
        if slot is not None and slot.meta_epoch == meta_epoch:
            return slot
    seen = ", ".join(
        f"slot {name} is for checkpoint epoch {slot.meta_epoch}" if slot else f"slot {name}: {why}"
        for name, (slot, why) in zip("AB", slots, strict=True)
    )
    raise CorruptionError(
        f"{where}: no shuffle slot for checkpoint epoch {meta_epoch} of {meta_path} ({seen})"
    )


def read_record(path: str, ops: FileOps | None = None) -> bytes | None:
    """The bytes of a record (None: there is none); a file too large is refused unread."""
    ops = ops or OsFileOps()
    if not ops.exists(path):
        return None
    fd = ops.open(path, os.O_RDONLY)
    try:
        size = ops.size(fd)
        if size > MAX_RECORD_BYTES:
            raise CorruptionError(
                f"{path}: damaged shuffle record: {size} bytes, more than {MAX_RECORD_BYTES}"
            )
        data = ops.pread(fd, size, 0)
    finally:
        ops.close(fd)
    if len(data) != size:
        raise SourceError(f"{path}: short read of the shuffle record")
    return data


class ShuffleRecord:
    """An open shuffle record: its header, the slot of the open checkpoint, and ``write``."""

    def __init__(self, path: str, ops: FileOps, fd: int, header: ShuffleHeader,
                 slot: ShuffleSlot) -> None:
        self.path = path
        self.header = header
        self.slot = slot
        self._ops = ops
        self._fd = fd

    @classmethod
    def open(cls, path: str, meta_epoch: int, meta_path: str, *,
             ops: FileOps | None = None) -> ShuffleRecord:
        """The record at ``path`` with the slot of ``meta_path``'s active checkpoint
        (``meta_epoch``); CorruptionError if either is damaged or they do not pair."""
        ops = ops or OsFileOps()
        data = read_record(path, ops)
        if data is None:
            raise CorruptionError(f"{path}: the shuffle record of {meta_path} is missing")
        header, slots = decode(data, path)
        slot = slot_for(slots, meta_epoch, path, meta_path)
        fd = ops.open(path, os.O_RDWR)
        return cls(path, ops, fd, header, slot)

    @classmethod
    def create(cls, path: str, header: ShuffleHeader, genesis: ShuffleSlot, *,
               ops: FileOps | None = None) -> ShuffleRecord:
        """Make a record holding ``genesis`` (for a fresh checkpoint, ``meta_epoch`` 0),
        whole: a temporary file, fsync, rename, directory fsync."""
        ops = ops or OsFileOps()
        tmp = path + ".tmp"
        fd = ops.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            ops.pwrite(fd, image(header, [genesis]), 0)
            ops.fsync(fd)
        finally:
            ops.close(fd)
        ops.rename(tmp, path)
        ops.fsync_dir(os.path.dirname(os.path.abspath(path)))
        return cls(path, ops, ops.open(path, os.O_RDWR), header, genesis)

    def write(self, slot: ShuffleSlot) -> None:
        """Write ``slot`` at its parity position and fsync: before the ``.meta`` slot of
        ``slot.meta_epoch`` is written."""
        if self._fd < 0:
            raise InvalidInput(f"{self.path}: shuffle record is closed")
        data = slot.encode()
        n = self._ops.pwrite(self._fd, data, slot.offset)
        if n != len(data):
            raise OSError(f"{self.path}: short write of a shuffle slot ({n} of {len(data)})")
        self._ops.fsync(self._fd)

    def committed(self, slot: ShuffleSlot) -> None:
        """The ``.meta`` slot ``slot`` goes with is written: it is the record's slot now."""
        self.slot = slot

    def close(self) -> None:
        if self._fd >= 0:
            self._ops.close(self._fd)
            self._fd = -1


def committed_slot(path: str, meta_epoch: int, meta_path: str) -> ShuffleSlot | None:
    """The slot of ``meta_path``'s checkpoint ``meta_epoch`` in the record at ``path``, read
    without changing a file (None: there is no record)."""
    data = read_record(path)
    if data is None:
        return None
    _, slots = decode(data, path)
    return slot_for(slots, meta_epoch, path, meta_path)


def decode_slot(data: bytes) -> ShuffleSlot:
    """A slot travelling as bytes (the PyTorch adapter's receipts); InvalidInput if damaged."""
    if len(data) != SLOT_SIZE:
        raise InvalidInput(f"a shuffle slot is {SLOT_SIZE} bytes, not {len(data)}")
    meta_epoch = int.from_bytes(data[8:16], "little")
    slot, why = judge_slot(data, 0 if meta_epoch % 2 else SLOT_SIZE)
    if slot is None:
        raise InvalidInput(f"not a shuffle slot: {why}")
    return slot
