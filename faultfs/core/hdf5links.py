"""HDF5 group links, read from bytes a reader was served: the object headers a group's members
start at, in the group's order, so that a reader opening member after member can have the next
ones fetched before it asks (``hdf5/linkwalk.py``).

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

Opening such a group is a chain of small reads, each found in the one before: the group's
object header names the heap and the B-trees indexing its links, a B-tree its root node, a
node the nodes below it, the heap its root block, that one its direct blocks. Each is a round
trip of its own unless what it names is fetched as soon as it is read (``Found.fetch``;
object headers and B-trees: ``core/hdf5index.py``).

Nothing here trusts the bytes: a heap header is taken only when its fields agree (powers of two,
rows within its size, addresses inside the file, no filters); a block only for a heap seen; link
messages are parsed one after another while each is whole and well formed, and the first that
is not ends the block (free space). A wrong guess costs a prefetch, never a byte served. A call
examines ``MAX_PLACES`` places, parses one ``Budget`` of entries (links, messages, pointers,
block addresses: soft links and overlapping structures count too) and names ``MAX_NAMED``
ranges at most, each its first ``MAX_FETCHED`` bytes; it keeps ``MAX_TARGETS`` targets of a
block.

Supported: 8-byte offsets and lengths, no user block (as ``core/hdf5.py``).
"""

from __future__ import annotations

import re
import struct
import zlib
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass, field

from faultfs.core.hdf5 import UNDEFINED
from faultfs.core.hdf5index import (
    HEAP_BYTES,
    MAX_FETCHED,
    Budget,
    Chunk,
    Node,
    header_names,
    messages,
    tree_at,
)

MAX_PLACES = 64  # places that look like a structure examined in one call, at most
MAX_NAMED = 256  # ranges named for fetching by one call, at most
MAX_TARGETS = 4096  # targets kept from one block
NAME_KEPT = 64  # bytes of a link's name kept (its order among links without a creation
# order), then a checksum of the whole name when it is longer
MAX_DIRECT = 1 << 20  # a heap's direct blocks at most this large (HDF5 writes 64 KiB)
MAX_ROWS = 64  # rows of a heap's root indirect block, at most (its offsets are 64 bits)
MAX_BLOCKS = 256  # direct blocks a root indirect block names, at most (HDF5's default: 36)
SNOD_ENTRY = 40
SNOD_MAX = 1 << 15  # entries of a symbol table node at most (twice its group's K)
_PLACES = re.compile(rb"F(?:RHP|HIB|HDB)\x00|SNOD\x01|OHDR\x02|OCHK|BT(?:HD|IN)\x00")
_HEAP = struct.Struct("<BHHBI12QHQQHHQH")  # after the signature, up to the root's rows
# (HEAP_BYTES: with the signature and the checksum, no filters)


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

    def row_size(self, row: int) -> int:
        """The size of each direct block in ``row`` (the first two rows: the start size,
        then doubling)."""
        return self.start if row < 2 else self.start << (row - 1)

    @property
    def direct_rows(self) -> int:
        """Rows of an indirect block that name direct blocks."""
        return (self.max_direct.bit_length() - self.start.bit_length()) + 2

    def block_size(self, offset: int) -> int | None:
        """The size of the direct block at ``offset`` in the heap's space (None: none)."""
        row_start = 0
        for row in range(MAX_ROWS):
            size = self.row_size(row)
            if size > self.max_direct:
                return None
            if offset < row_start + size * self.width:
                return size if (offset - row_start) % size == 0 else None
            row_start += size * self.width
        return None

    def direct_blocks(self, data: bytes | memoryview, at: int, file_size: int,
                      budget: Budget) -> list[tuple[int, int]]:
        """(address, size) of the direct blocks the root indirect block at ``data[at:]``
        names (an empty list unless it is whole there)."""
        head = 4 + 1 + 8 + self.offset_bytes
        rows = min(self.rows, self.direct_rows)
        count = rows * self.width
        if count > MAX_BLOCKS or at + head + 8 * count > len(data) or not budget.take(count):
            return []
        out: list[tuple[int, int]] = []
        for i, (child,) in enumerate(struct.iter_unpack("<Q", data[at + head:at + head + 8 * count])):
            size = self.row_size(i // self.width)
            if child != UNDEFINED and child + size <= file_size:
                out.append((child, min(size, MAX_FETCHED)))
        return out


@dataclass
class Found:
    """What one scan found: heap headers, B-tree nodes (roots named by their trees' headers)
    and continuation chunks
    named (read when they come), what structures name to fetch (``fetch``), and the targets
    of blocks (direct blocks, symbol table nodes): (block, its heap (0: a symbol table
    node), [(the link's creation order or None, its name (``NAME_KEPT``), its object
    header)] in the block's order, whether the block was whole in the bytes)."""

    heaps: list[Heap] = field(default_factory=list)
    nodes: list[tuple[int, Node]] = field(default_factory=list)
    chunks: list[tuple[int, Chunk]] = field(default_factory=list)
    # (a structure's address, the (address, size) of what it names that its reader reads
    # next, whether it was whole in the bytes): an object header's link and attribute
    # indexes and continuation chunks, a B-tree's root, a node's children, a heap's root
    # block, a root indirect block's direct blocks
    fetch: list[tuple[int, list[tuple[int, int]], bool]] = field(default_factory=list)
    targets: list[tuple[int, int, list[tuple[int | None, bytes, int]], bool]] = field(
        default_factory=list)


def _heap_at(view: bytes | memoryview, at: int, base: int, file_size: int) -> Heap | None:
    if at + HEAP_BYTES > len(view):
        return None
    (version, id_len, filters, flags, _max_object, *lengths, width, start, max_direct,
     max_bits, _start_rows, root, rows) = _HEAP.unpack_from(view, at + 4)
    if (version != 0 or filters != 0 or flags > 3 or not 0 < id_len <= 64
            or not 0 < width <= 1 << 16 or width & (width - 1)
            or start < 32 or start & (start - 1) or max_direct < start
            or max_direct & (max_direct - 1) or max_direct > MAX_DIRECT or not 8 <= max_bits <= 64 or rows > MAX_ROWS):
        return None
    if any(a >= file_size and a != UNDEFINED for a in (root, lengths[1], lengths[3])):
        return None
    return Heap(base + at, (max_bits + 7) // 8, bool(flags & 2), width, start, max_direct,
                root, rows)


def _links(view: bytes | memoryview, at: int, end: int, file_size: int, budget: Budget
           ) -> list[tuple[int | None, bytes, int]]:
    """The hard links' (creation order or None, name (its first ``NAME_KEPT`` bytes),
    object header address) of the link messages packed from ``at`` up to ``end``; the first
    message not whole and well formed ends them, as does the call's ``budget``."""
    out: list[tuple[int | None, bytes, int]] = []
    while at + 4 <= end and len(out) < MAX_TARGETS and budget.take(1):
        version, flags = view[at], view[at + 1]
        if version != 1 or flags & 0xE0:
            break
        p = at + 2
        fixed = p + bool(flags & 0x08) + (8 if flags & 0x04 else 0) + bool(flags & 0x10)
        width = 1 << (flags & 3)
        if fixed + width > end:
            break
        kind = 0
        if flags & 0x08:
            kind = view[p]
            p += 1
        order = None
        if flags & 0x04:
            (order,) = struct.unpack_from("<Q", view, p)
            p += 8
        if flags & 0x10:
            if view[p] > 1:
                break
            p += 1
        length = int.from_bytes(view[p:p + width], "little")
        name = bytes(view[p + width:p + width + min(length, NAME_KEPT)])
        if length > NAME_KEPT and p + width + length <= end:  # names sharing a prefix
            name += zlib.crc32(view[p + width:p + width + length]).to_bytes(4, "little")
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
            out.append((order, name, address))
        elif kind == 1 or kind >= 64:  # soft or external: a length and the value
            if p + 2 > end:
                break
            p += 2 + int.from_bytes(view[p:p + 2], "little")
        else:
            break
        at = p
    return out


def _snod(view: bytes | memoryview, at: int, file_size: int, budget: Budget
          ) -> list[tuple[int | None, bytes, int]] | None:
    if at + 8 > len(view) or view[at + 5] != 0:
        return None
    (count,) = struct.unpack_from("<H", view, at + 6)
    if (not 0 < count <= SNOD_MAX or at + 8 + count * SNOD_ENTRY > len(view)
            or not budget.take(count)):
        return None
    out: list[tuple[int | None, bytes, int]] = []
    for i in range(count):
        _name, header, cache = struct.unpack_from("<QQI", view, at + 8 + i * SNOD_ENTRY)
        if cache > 2 or (header >= file_size and header != UNDEFINED):
            return None
        if cache != 2 and header != UNDEFINED:  # (2: a soft link, no header)
            out.append((None, b"", header))
    return out


def link_places(data: bytes | memoryview, base: int, file_size: int,
                heaps: Mapping[int, Heap], nodes: Mapping[int, Node] | None = None,
                chunks: Mapping[int, Chunk] | None = None, *,
                skip: Container[int] = ()) -> Found:
    """The structures of group links whole in ``data`` (the file's bytes from ``base``):
    none at an address in ``skip`` (seen before). ``heaps``: the heaps known by address;
    ``nodes`` the B-tree nodes expected (named by a header or a node above), ``chunks`` the
    continuation chunks (named by a header): a block, node or chunk of none of them is
    passed over; one found here counts too. One ``Budget`` of entries and ``MAX_NAMED``
    ranges to fetch per call."""
    found = Found()
    budget = Budget()
    view = memoryview(data).cast("B") if not isinstance(data, bytes) else data
    known, expected, continued = dict(heaps), dict(nodes or {}), dict(chunks or {})
    named = 0

    def fetch(address: int, ranges: list[tuple[int, int]], whole: bool = True) -> None:
        nonlocal named
        ranges = ranges[:max(0, MAX_NAMED - named)]
        if ranges:
            named += len(ranges)
            found.fetch.append((address, ranges, whole))

    for n, match in enumerate(_PLACES.finditer(view)):
        if n >= MAX_PLACES or budget.entries <= 0:
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
                if heap.root != UNDEFINED:  # an indirect block: its entries; or a block
                    fetch(address, [(heap.root, min(heap.start, MAX_FETCHED))])
        elif kind == b"SNOD":
            links = _snod(view, at, file_size, budget)
            if links:
                found.targets.append((address, 0, links, True))
        elif kind == b"OHDR":
            named_here, more, whole = header_names(view, at, file_size, budget)
            fetch(address, named_here, whole)
            found.chunks += more
            continued.update(more)
        elif kind == b"OCHK":
            chunk = continued.get(address)
            if chunk is not None:
                named_here, more, whole = messages(view, at + 4, at + chunk.length - 4,
                                                   chunk.flags, file_size, budget)
                fetch(address, named_here, whole)
                found.chunks += more
                continued.update(more)
        elif kind == b"BTHD":
            tree = tree_at(view, at, base, file_size)
            if tree is not None and tree.root != UNDEFINED:
                root = Node(tree, tree.depth, tree.root_records)
                expected[tree.root] = root
                found.nodes.append((tree.root, root))
                fetch(address, [(tree.root, min(tree.node_size, MAX_FETCHED))])
        elif kind == b"BTIN":
            node = expected.get(address)
            if node is not None and node.depth >= 1:
                children = node.tree.children(view, at, node.depth, node.records, file_size,
                                              budget)
                size = min(node.tree.node_size, MAX_FETCHED)
                fetch(address, [(child, size) for child, _ in children])
                if node.depth > 1:
                    below = [(child, Node(node.tree, node.depth - 1, held))
                             for child, held in children]
                    found.nodes += below
                    expected.update(below)
        else:
            _heap_block(view, at, address, file_size, known, found, fetch, budget)
    return found


def _heap_block(view: bytes | memoryview, at: int, address: int, file_size: int,
                known: Mapping[int, Heap], found: Found,
                fetch: Callable[[int, list[tuple[int, int]]], None], budget: Budget) -> None:
    """A heap's root indirect block (its direct blocks fetched) or direct block (its links
    kept) at ``view[at:]``."""
    if at + 13 > len(view):
        return
    kind = bytes(view[at:at + 4])
    (owner,) = struct.unpack_from("<Q", view, at + 5)
    heap = known.get(owner)
    if heap is None or at + 13 + heap.offset_bytes > len(view):
        return
    offset = int.from_bytes(view[at + 13:at + 13 + heap.offset_bytes], "little")
    if kind == b"FHIB":
        if address == heap.root and offset == 0 and heap.rows:
            fetch(address, heap.direct_blocks(view, at, file_size, budget))
        return
    size = heap.block_size(offset)
    if size is None:
        return
    start = at + 13 + heap.offset_bytes + (4 if heap.checksummed else 0)
    links = _links(view, start, min(at + size, len(view)), file_size, budget)
    if links:
        found.targets.append((address, owner, links, at + size <= len(view)))
