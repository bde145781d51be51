"""The shuffle record (``<state>.shuffle``): where a shuffled reader is in its epoch, one
ping-pong slot per checkpoint, beside the byte-exact ``.meta`` that has no room for it; and
the commit point of a shuffled checkpoint.

Its byte format (docs/FORMAT-cursors.md, "The shuffle record", version 2): two 128-byte
slots, A at 0 (odd checkpoint epochs) and B at 128 (even ones, and the genesis slot), then a
header that never changes after the file is made: the seed and geometry of the shuffle and
the shard list (its URLs' fingerprint and every shard's size). A slot is the shuffle's place
(64 bytes) and a copy of the ``.meta`` slot of the same checkpoint (64 bytes, byte-exact).

Invariants:
- A slot names the ``.meta`` slot it goes with (``meta_epoch``, that slot's commit number)
  and carries it whole; it is written at its parity position and fsynced *before* that
  ``.meta`` slot is written, and that fsync is the commit: the ``.meta`` slot follows without
  one of its own (one barrier a commit instead of two). A crash before the fsync leaves the
  previous slot, untouched in the other position, as the checkpoint.
- So the record, not the ``.meta``, is the truth of a shuffled checkpoint: its newest valid
  slot. ``settle`` makes the ``.meta`` hold the two slots' copies before anything opens it (a
  ``.meta`` behind its record, or torn, after a power loss is written again from the record
  and fsynced); a ``.meta`` *ahead* of its record, or another checkpoint under the same
  epoch, is refused (``CorruptionError``), never guessed.
- The file is created whole (temporary file, fsync, rename, directory fsync), never grown
  or shrunk; its header is checked (magic, version, CRC, counts against the length) before
  anything in it is used, and each slot as the ``.meta`` slots are (all-zero, bad magic, bad
  version, bad CRC), then its fields (flags, reserved bytes, parity, its ``.meta`` copy).
- All file access goes through a ``FileOps`` seam, so crash tests can tear unsynced writes.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from faultfs.core.coord import U32_MAX, U64_MAX, StreamCoordinate
from faultfs.core.framing import CRC_SIZE, damaged, frame, unframe
from faultfs.core.slots import META_SIZE, DiskSlot, SlotStatus, slot_offset_for_epoch
from faultfs.core.slots import SLOT_SIZE as META_SLOT_SIZE
from faultfs.core.slots import decode_slot as decode_meta_slot
from faultfs.errors import CorruptionError, InvalidInput, SourceError
from faultfs.store.fileops import FileOps, OsFileOps
from faultfs.store.metadata import choose_active
from faultfs.stream.shuffle.plan import Geometry

SLOT_MAGIC = b"FFSS"
HEADER_MAGIC = b"FFSH"
VERSION = 2  # of slots and header; bump on any layout change (the golden test says so).
# Version 1 (64-byte slots without the .meta copy, a commit fsyncing both files) is refused.
PLACE_SIZE = 64  # the shuffle's place in a slot; its .meta copy follows
SLOT_SIZE = PLACE_SIZE + META_SLOT_SIZE
SLOTS_SIZE = 2 * SLOT_SIZE
FLAG_FINISHED = 1  # the reader's part of the epoch is delivered and committed
MAX_SHARDS = 1 << 22  # bounds what a damaged header can make us allocate
MAX_RECORD_BYTES = SLOTS_SIZE + 44 + 8 * MAX_SHARDS
GENESIS = DiskSlot(0, 0, StreamCoordinate(), 0)  # the .meta's fresh state, in slot B
_SLOT = struct.Struct("<4sIQQQQIII8x")  # magic, version, meta_epoch, epoch, window,
# position, dedup_base, generation, flags, reserved: bytes 0..60, then the CRC
_HEAD = struct.Struct("<4sIQQIIQ")  # magic, version, seed, block_bytes, window_blocks,
# shard_count, fingerprint
assert _SLOT.size + CRC_SIZE == PLACE_SIZE


@dataclass(frozen=True)
class ShuffleSlot:
    """Where a shuffled reader's checkpoint is: its epoch, the window of its part of that
    epoch and the positions of that window's permutation consumed (``finished``: the whole
    part, window = the part's window count), the WAL hashes committed before the epoch
    (``dedup_base``) and the partition generation whose plan the epoch follows. ``meta``: in
    a record, the ``.meta`` slot of the same checkpoint (not compared)."""

    meta_epoch: int
    epoch: int
    window: int = 0
    position: int = 0
    dedup_base: int = 0
    generation: int = 0
    finished: bool = False
    meta: DiskSlot | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name, limit in (("meta_epoch", U64_MAX), ("epoch", U64_MAX), ("window", U64_MAX),
                            ("position", U64_MAX), ("dedup_base", U32_MAX),
                            ("generation", U32_MAX)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= limit:
                raise InvalidInput(f"ShuffleSlot.{name}={value!r} out of range 0..{limit}")
        if self.meta is not None and self.meta.epoch != self.meta_epoch:
            raise InvalidInput(f"ShuffleSlot of checkpoint epoch {self.meta_epoch} with the "
                               f".meta slot of epoch {self.meta.epoch}")

    @property
    def offset(self) -> int:
        return 0 if self.meta_epoch % 2 else SLOT_SIZE

    def encode(self) -> bytes:
        """The shuffle's place: the first 64 bytes of a record's slot."""
        return frame(_SLOT.pack(SLOT_MAGIC, VERSION, self.meta_epoch, self.epoch, self.window,
                                self.position, self.dedup_base, self.generation,
                                FLAG_FINISHED if self.finished else 0))

    def with_meta(self, meta: DiskSlot) -> ShuffleSlot:
        """This place as the slot of the checkpoint ``meta``."""
        return ShuffleSlot(meta.epoch, self.epoch, self.window, self.position, self.dedup_base,
                           self.generation, self.finished, meta)

    def slot_bytes(self) -> bytes:
        """The 128 bytes of this slot in a record: the place, then its ``.meta`` slot."""
        if self.meta is None:
            raise InvalidInput("a record's shuffle slot needs its .meta slot")
        return self.encode() + self.meta.encode()


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
    """The bytes of a record holding ``slots`` (at most one of each parity, each with its
    ``.meta`` slot, or none for a genesis slot; a position without one is all zero) and
    ``header``."""
    area = bytearray(SLOTS_SIZE)
    for slot in slots:
        if slot.meta is None and slot.meta_epoch == 0:
            slot = slot.with_meta(GENESIS)
        area[slot.offset : slot.offset + SLOT_SIZE] = slot.slot_bytes()
    return bytes(area) + header.encode()


def meta_bytes(slots: Sequence[ShuffleSlot | None]) -> bytes:
    """The 128-byte ``.meta`` a record's slots stand for: each slot's ``.meta`` copy at its
    parity position, zero where there is none."""
    out = bytearray(META_SIZE)
    for slot in slots:
        if slot is not None and slot.meta is not None:
            at = slot_offset_for_epoch(slot.meta_epoch)
            out[at : at + META_SLOT_SIZE] = slot.meta.encode()
    return bytes(out)


def judge_slot(data: bytes, offset: int) -> tuple[ShuffleSlot | None, str]:
    """A slot, or None and why not: "all-zero", "bad magic", "bad version", "bad crc" (a
    torn write), "bad fields: ..."."""
    if data == bytes(len(data)):
        return None, "all-zero"
    if len(data) != SLOT_SIZE:
        return None, f"bad length {len(data)}"
    magic, version, meta_epoch, epoch, window, position, base, gen, flags = _SLOT.unpack_from(data)
    if magic != SLOT_MAGIC:
        return None, "bad magic"
    if version != VERSION:
        return None, "bad version"
    (crc,) = struct.unpack_from("<I", data, _SLOT.size)
    if zlib.crc32(data[: _SLOT.size]) != crc:
        return None, "bad crc"
    reading = decode_meta_slot(data[PLACE_SIZE:])
    if reading.status is SlotStatus.BAD_CRC:
        return None, "bad crc (its .meta slot)"
    if reading.slot is None:
        return None, f"bad fields: its .meta slot is {reading.describe()}"
    if reading.slot.epoch != meta_epoch:
        return None, (f"bad fields: its .meta slot is of checkpoint epoch {reading.slot.epoch}, "
                      f"not {meta_epoch}")
    if flags & ~FLAG_FINISHED:
        return None, f"bad fields: unknown flags {flags:#x}"
    if data[52:60] != bytes(8):
        return None, "bad fields: reserved bytes are not zero"
    slot = ShuffleSlot(meta_epoch, epoch, window, position, base, gen, bool(flags), reading.slot)
    if slot.offset != offset:
        return None, f"bad fields: checkpoint epoch {meta_epoch} belongs in the other slot"
    return slot, "valid"


def decode_header(data: bytes, where: str) -> ShuffleHeader:
    """The header after a record's slots; CorruptionError naming ``where``."""
    v1 = PLACE_SIZE * 2  # where version 1 had its header
    if data[v1 : v1 + 4] == HEADER_MAGIC and data[v1 + 4 : v1 + 8] == b"\1\0\0\0":
        raise damaged(where, "shuffle record", "version 1 (written by an older faultfs, whose "
                      "commits were not one barrier); this faultfs reads version 2: finish the "
                      "run with that faultfs or start this one with a new state")
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


def newest(slots: list[tuple[ShuffleSlot | None, str]], where: str) -> ShuffleSlot:
    """The checkpoint of a record: its valid slot of the higher epoch (its partner torn by a
    crash before the fsync that would have made it the checkpoint, or the one before it);
    CorruptionError without one, or with two of one epoch."""
    valid = [slot for slot, _ in slots if slot is not None]
    if not valid:
        raise CorruptionError(f"{where}: damaged shuffle record: no valid slot (slot A: "
                              f"{slots[0][1]}, slot B: {slots[1][1]})")
    return max(valid, key=lambda slot: slot.meta_epoch)


def slot_for(slots: list[tuple[ShuffleSlot | None, str]], meta_epoch: int, where: str,
             meta_path: str) -> ShuffleSlot:
    """The slot that goes with the ``.meta`` slot of ``meta_epoch``, which must be the
    record's newest; CorruptionError otherwise."""
    for slot, _ in slots:
        if slot is not None and slot.meta_epoch == meta_epoch:
            if any(s is not None and s.meta_epoch > meta_epoch for s, _ in slots):
                break  # a settled .meta is never behind its record
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


def _read_meta(meta_path: str, ops: FileOps) -> bytes | None:
    if not ops.exists(meta_path):
        return None
    fd = ops.open(meta_path, os.O_RDONLY)
    try:
        return ops.pread(fd, META_SIZE + 1, 0)
    finally:
        ops.close(fd)


def _meta_behind(meta_data: bytes | None, slots: list[tuple[ShuffleSlot | None, str]],
                 where: str, meta_path: str) -> bool:
    """Whether a ``.meta`` (its bytes, read *before* its record: a commit writes the record
    first, so one running meanwhile can only put the record ahead; None: missing) must be
    written again from its record (behind it or torn: a power loss took writes that had no
    fsync of their own); refuses one ahead of it, or whose checkpoint differs from the
    record's slot of the same epoch."""
    top = newest(slots, where)
    if meta_data is None or len(meta_data) != META_SIZE:
        return False  # DualMetadataManager.open makes one or refuses it in its own words
    try:
        active = choose_active(decode_meta_slot(meta_data[:META_SLOT_SIZE]),
                               decode_meta_slot(meta_data[META_SLOT_SIZE:])).slot
    except CorruptionError:
        return True  # both slots torn: the record holds what they were
    same = [s for s, _ in slots if s is not None and s.meta_epoch == active.epoch]
    if active.epoch > top.meta_epoch or (same and same[0].meta != active):
        what = "ahead of" if active.epoch > top.meta_epoch else "another checkpoint than"
        seen = ", ".join(
            f"slot {name} is for checkpoint epoch {s.meta_epoch}" if s else f"slot {name}: {why}"
            for name, (s, why) in zip("AB", slots, strict=True)
        )
        raise CorruptionError(
            f"{where}: no shuffle slot for checkpoint epoch {active.epoch} of {meta_path} "
            f"({seen}; the .meta is {what} its record)"
        )
    return active.epoch < top.meta_epoch or meta_data != meta_bytes([s for s, _ in slots])


def settle(meta_path: str, ops: FileOps | None = None) -> None:
    """Before a shuffled state's ``.meta`` is opened: write it again from its record where a
    power loss left it behind (module doc), and fsync it. Nothing without a record."""
    ops = ops or OsFileOps()
    where = meta_path + ".shuffle"
    meta_data = _read_meta(meta_path, ops)
    data = read_record(where, ops)
    if data is None:
        return
    _, slots = decode(data, where)
    if not _meta_behind(meta_data, slots, where, meta_path):
        return
    fd = ops.open(meta_path, os.O_RDWR)
    try:
        ops.pwrite(fd, meta_bytes([s for s, _ in slots]), 0)
        ops.fsync(fd)
    finally:
        ops.close(fd)


def committed_pair(meta_path: str) -> tuple[DiskSlot, ShuffleSlot] | None:
    """A shuffled state's checkpoint read without changing a file: its record's newest slot
    and the ``.meta`` slot it carries (None: no record). Refuses what ``settle`` refuses."""
    where = meta_path + ".shuffle"
    ops = OsFileOps()
    meta_data = _read_meta(meta_path, ops)
    data = read_record(where, ops)
    if data is None:
        return None
    _, slots = decode(data, where)
    _meta_behind(meta_data, slots, where, meta_path)
    top = newest(slots, where)
    assert top.meta is not None
    return top.meta, top


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
        (``meta_epoch``, the ``.meta`` settled first); CorruptionError if either is damaged
        or they do not pair."""
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
        genesis = genesis.with_meta(GENESIS)
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
        """Write ``slot`` (with its ``.meta`` slot) at its parity position and fsync: the
        commit of that checkpoint, before its ``.meta`` slot is written."""
        if self._fd < 0:
            raise InvalidInput(f"{self.path}: shuffle record is closed")
        data = slot.slot_bytes()
        n = self._ops.pwrite(self._fd, data, slot.offset)
        if n != len(data):
            raise OSError(f"{self.path}: short write of a shuffle slot ({n} of {len(data)})")
        self._ops.fsync(self._fd)

    def journal(self, place: ShuffleSlot) -> Callable[[DiskSlot], None]:
        """What ``DualMetadataManager.commit`` calls with its new ``.meta`` slot: the slot of
        ``place`` at that checkpoint written and fsynced, then made the record's."""
        def write(meta: DiskSlot) -> None:
            slot = place.with_meta(meta)
            self.write(slot)
            self.slot = slot
        return write

    def close(self) -> None:
        if self._fd >= 0:
            self._ops.close(self._fd)
            self._fd = -1


def decode_slot(data: bytes) -> ShuffleSlot:
    """A place travelling as bytes (the PyTorch adapter's receipts: a slot's first 64
    bytes); InvalidInput if damaged."""
    if len(data) != PLACE_SIZE:
        raise InvalidInput(f"a shuffle slot is {PLACE_SIZE} bytes, not {len(data)}")
    magic, version, meta_epoch, epoch, window, position, base, gen, flags = _SLOT.unpack_from(data)
    (crc,) = struct.unpack_from("<I", data, _SLOT.size)
    why = ("bad magic" if magic != SLOT_MAGIC else "bad version" if version != VERSION
           else "bad crc" if zlib.crc32(data[: _SLOT.size]) != crc
           else "bad fields" if flags & ~FLAG_FINISHED or data[52:60] != bytes(8) else "")
    if why:
        raise InvalidInput(f"not a shuffle slot: {why}")
    return ShuffleSlot(meta_epoch, epoch, window, position, base, gen, bool(flags))
