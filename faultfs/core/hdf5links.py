"""HDF5 group links, read from bytes a reader was served: the object headers a group's members
start at, in the group's order, so that a reader opening member after member can have the next
ones fetched before it asks (``engine/linkwalk.py``).

A group stores its links in one of two ways, and both name each member's object header:
- "old-style" (h5py's default): symbol table nodes (``SNOD``), each with up to 16 entries of
  40 bytes (name offset, object header address, cache type, scratch), in name order;
- "new-style" (a file that tracks creation order: every NetCDF-4 file; ``track_order``;
  ``libver="latest"``): past 8 links, "dense" storage in a fractal heap (``FRHP``), whose
  managed objects are link messages packed in direct blocks (``FHDB``), reached from its root
  indirect block (``FHIB``) once it has more than one. A link message: version 1, flags,
  then (by the flags) the link type, its creation order (8 bytes), the name's character set,
  the name's length (1, 2, 4 or 8 bytes), the name, and for a hard link the object header's
  address. xarray and h5py walk such a group by creation order.

Nothing here trusts the bytes: a heap header is taken only when its fields agree (powers of two,
rows within its size, addresses inside the file, no filters); a block only for a heap seen; link
messages are parsed one after another while each is whole and well formed, and the first that
is not ends the block (free space). A wrong guess costs a prefetch, never a byte served. A call
examines ``MAX_PLACES`` places at most and keeps ``MAX_TARGETS`` targets of each block.

Supported: 8-byte offsets and lengths, no user block (as ``core/hdf5.py``).
"""

from __future__ import annotations

import re
import struct
from collections.abc import Container, Mapping
from dataclasses import dataclass, field

UNDEFINED = (1 << 64) - 1
MAX_PLACES = 64  # places that look like a structure examined in one call, at most
MAX_TARGETS = 4096  # targets kept from one block
MAX_ROWS = 64  # rows of a heap's root indirect block, at most (its offsets are 64 bits)
MAX_BLOCKS = 4096  # direct blocks a root indirect block names, at most
SNOD_ENTRY = 40
SNOD_MAX = 1 << 15  # entries of a symbol table node at most (twice its group's K)
_PLACES = re.compile(rb"F(?:RHP|HIB|HDB)\x00|SNOD\x01")
_HEAP = struct.Struct("<BHHBI12QHQQHHQH")  # after the signature, up to the root's rows
HEAP_BYTES = 4 + _HEAP.size + 4  # with the checksum (no filters)


@dataclass(frozen=True)
class Heap:
    """A fractal heap's header: what reading its blocks needs."""

    address: int
    offset_bytes: int  # the width of a block's offset in the heap
    checksummed: bool  # its direct blocks carry a checksum
    width: int  # blocks per row
    start: int  # the first rows' block size
    max_direct: int  # the largest direct block's size
    root: int  # its root block
    rows: int  # rows of its root indirect block (0: the root is a direct block)

    @property
    def direct_rows(self) -> int:
        """Rows of an indirect block that name direct blocks."""
        return (self.max_direct.bit_length() - self.start.bit_length()) + 2

    def block_size(self, offset: int) -> int | None:
        """The size of the direct block at ``offset`` in the heap's space (None: none)."""
        row_start = 0
        for row in range(MAX_ROWS):
            size = self.start if row < 2 else self.start << (row - 1)
            if size > self.max_direct:
                return None
            if offset < row_start + size * self.width:
                return size if (offset - row_start) % size == 0 else None
            row_start += size * self.width
        return None

    def direct_blocks(self, data: bytes | memoryview, at: int, file_size: int
                      ) -> list[tuple[int, int]]:
        """(address, size) of the direct blocks the root indirect block at ``data[at:]``
        names (an empty list unless it is whole there)."""
        head = 4 + 1 + 8 + self.offset_bytes
        rows = min(self.rows, self.direct_rows)
        count = rows * self.width
        if count > MAX_BLOCKS or at + head + 8 * count > len(data):
            return []
        out: list[tuple[int, int]] = []
        for i, (child,) in enumerate(struct.iter_unpack("<Q", data[at + head:at + head + 8 * count])):
            row = i // self.width
            size = self.start if row < 2 else self.start << (row - 1)
            if child != UNDEFINED and child + size <= file_size:
                out.append((child, size))
        return out


@dataclass
class Found:
    """What one scan found: heap headers, root indirect blocks with their direct blocks, and the
    targets of blocks (direct blocks, symbol table nodes): (block, its heap (0: a symbol
    table node), [(the link's creation order or None, its object header)] in the block's
    order, whether the block was whole in the bytes)."""

    heaps: list[Heap] = field(default_factory=list)
    roots: list[tuple[int, list[tuple[int, int]]]] = field(default_factory=list)
    targets: list[tuple[int, int, list[tuple[int | None, int]], bool]] = field(
        default_factory=list)


def _heap_at(view: bytes | memoryview, at: int, base: int, file_size: int) -> Heap | None:
    if at + HEAP_BYTES > len(view):
        return None
    (version, id_len, filters, flags, _max_object, *lengths, width, start, max_direct,
     max_bits, _start_rows, root, rows) = _HEAP.unpack_from(view, at + 4)
    if (version != 0 or filters != 0 or flags > 3 or not 0 < id_len <= 64
            or not 0 < width <= 1 << 16 or width & (width - 1)
            or start < 32 or start & (start - 1) or max_direct < start
            or max_direct & (max_direct - 1) or not 8 <= max_bits <= 64 or rows > MAX_ROWS):
        return None
    if any(a >= file_size and a != UNDEFINED for a in (root, lengths[1], lengths[3])):
        return None
    return Heap(base + at, (max_bits + 7) // 8, bool(flags & 2), width, start, max_direct,
                root, rows)


def _links(view: bytes | memoryview, at: int, end: int, file_size: int
           ) -> list[tuple[int | None, int]]:
    """The hard links' (creation order or None, object header address) of the link
    messages packed from ``at`` up to ``end``; the first message not whole and well formed
    ends them."""
    out: list[tuple[int | None, int]] = []
    while at + 4 <= end and len(out) < MAX_TARGETS:
        version, flags = view[at], view[at + 1]
        if version != 1 or flags & 0xE0:
            break
        p = at + 2
        kind = 0
        if flags & 0x08:
            kind = view[p]
            p += 1
        order = None
        if flags & 0x04:
            if p + 8 > end:
                break
            (order,) = struct.unpack_from("<Q", view, p)
            p += 8
        if flags & 0x10:
            if view[p] > 1:
                break
            p += 1
        width = 1 << (flags & 3)
        if p + width > end:
            break
        length = int.from_bytes(view[p:p + width], "little")
        p += width + length
        if length == 0 or p > end:
            break
        if kind == 0:
            if p + 8 > end:
                break
            (address,) = struct.unpack_from("<Q", view, p)
            p += 8
            if address >= file_size:
                break
            out.append((order, address))
        elif kind == 1 or kind >= 64:  # soft or external: a length and the value
            if p + 2 > end:
                break
            p += 2 + int.from_bytes(view[p:p + 2], "little")
        else:
            break
        at = p
    return out


def _snod(view: bytes | memoryview, at: int, file_size: int
          ) -> list[tuple[int | None, int]] | None:
    if at + 8 > len(view) or view[at + 5] != 0:
        return None
    (count,) = struct.unpack_from("<H", view, at + 6)
    if not 0 < count <= SNOD_MAX or at + 8 + count * SNOD_ENTRY > len(view):
        return None
    out: list[tuple[int | None, int]] = []
    for i in range(count):
        _name, header, cache = struct.unpack_from("<QQI", view, at + 8 + i * SNOD_ENTRY)
        if header >= file_size or cache > 2:
            return None
        out.append((None, header))
    return out


def link_places(data: bytes | memoryview, base: int, file_size: int,
                heaps: Mapping[int, Heap], *, skip: Container[int] = ()) -> Found:
    """The heap headers, root indirect blocks' direct blocks and blocks' link targets whole
    in ``data`` (the file's bytes from ``base``); none at an address in ``skip`` (seen
    before). ``heaps``: the heaps known (a block of another is passed over; one found here
    counts too)."""
    found = Found()
    view = memoryview(data).cast("B") if not isinstance(data, bytes) else data
    known = dict(heaps)
    for n, match in enumerate(_PLACES.finditer(view)):
        if n >= MAX_PLACES:
            break
        at = match.start()
        address = base + at
        if address in skip:
            continue
        kind = bytes(view[at:at + 4])
        if kind == b"FRHP":
            heap = _heap_at(view, at, base, file_size)
            if heap is not None:
                known[heap.address] = heap
                found.heaps.append(heap)
            continue
        if kind == b"SNOD":
            links = _snod(view, at, file_size)
            if links:
                found.targets.append((address, 0, links, True))
            continue
        if at + 13 > len(view):
            continue
        (owner,) = struct.unpack_from("<Q", view, at + 5)
        heap = known.get(owner)
        if heap is None:
            continue
        offset = int.from_bytes(view[at + 13:at + 13 + heap.offset_bytes], "little")
        if kind == b"FHIB":
            if address == heap.root and offset == 0 and heap.rows:
                blocks = heap.direct_blocks(view, at, file_size)
                if blocks:
                    found.roots.append((address, blocks))
            continue
        size = heap.block_size(offset)
        if size is None:
            continue
        start = at + 13 + heap.offset_bytes + (4 if heap.checksummed else 0)
        links = _links(view, start, min(at + size, len(view)), file_size)
        if links:
            found.targets.append((address, owner, links, at + size <= len(view)))
    return found
