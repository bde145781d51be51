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

Opening such a group is a chain of small reads, each found in the one before: the group's
object header (``OHDR``, version 2) holds a Link Info message naming the heap and the
version-2 B-trees indexing the links by name and by creation order (``BTHD``, each naming
its root node); a root node (``BTIN``) names its leaves (``BTLF``); the heap's header names
its root block. Each is a round trip of its own unless what it names is fetched as soon as it
is read (``Found.fetch``). Attribute Info messages (dense attributes, NetCDF-4 global
attributes) name a heap and B-trees the same way, and a continuation message the header's
next chunk (written where the file ended when the header grew: a NetCDF dimension's list of
the variables that use it). Only a B-tree of depth 1 (its root's
children are leaves: up to ~600 links in 512-byte nodes) has its leaves named.

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
MAX_MESSAGES_PARSED = 8192  # link messages parsed in one call, hard or not, at most
NAME_KEPT = 64  # bytes of a link's name kept (the order of links without a creation order)
MAX_DIRECT = 1 << 20  # a heap's direct blocks at most this large (HDF5 writes 64 KiB), and
MAX_FETCHED = 64 << 10  # ... of each block or chunk named, this much is fetched
MAX_ROWS = 64  # rows of a heap's root indirect block, at most (its offsets are 64 bits)
MAX_BLOCKS = 4096  # direct blocks a root indirect block names, at most
SNOD_ENTRY = 40
SNOD_MAX = 1 << 15  # entries of a symbol table node at most (twice its group's K)
_PLACES = re.compile(rb"F(?:RHP|HIB|HDB)\x00|SNOD\x01|OHDR\x02|BT(?:HD|IN)\x00")
_HEAP = struct.Struct("<BHHBI12QHQQHHQH")  # after the signature, up to the root's rows
HEAP_BYTES = 4 + _HEAP.size + 4  # with the checksum (no filters)
_TREE = struct.Struct("<BBIHHBBQHQ")  # a version-2 B-tree's header after the signature
TREE_BYTES = 4 + _TREE.size + 4
MAX_MESSAGES = 256  # messages of an object header's first chunk looked at, at most
INDEX_MESSAGES = (0x02, 0x15)  # Link Info, Attribute Info: a heap and B-trees named
CONTINUATION = 0x10  # an object header's next chunk (a dimension's growing REFERENCE_LIST)


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
                out.append((child, min(size, MAX_FETCHED)))
        return out


@dataclass(frozen=True)
class Tree:
    """A version-2 B-tree's header: what reading its root node needs."""

    address: int
    kind: int
    node_size: int
    record_size: int
    depth: int
    root: int
    root_records: int

    def leaves(self, view: bytes | memoryview, at: int, file_size: int
               ) -> list[tuple[int, int]]:
        """(address, size) of the leaves its root node at ``view[at:]`` names (depth 1; an
        empty list unless the node's pointers are whole there)."""
        n, size = self.root_records, self.record_size
        most = (self.node_size - 10) // size  # records of a leaf, at most ...
        width = (most.bit_length() + 7) // 8  # ... and the bytes that count them
        start = at + 6 + n * size
        if self.depth != 1 or view[at + 5] != self.kind or start + (n + 1) * (
                8 + width) > len(view):
            return []
        out = []
        for i in range(n + 1):
            (child,) = struct.unpack_from("<Q", view, start + i * (8 + width))
            if child + self.node_size <= file_size:
                out.append((child, min(self.node_size, MAX_FETCHED)))
        return out


@dataclass
class Found:
    """What one scan found: heap and B-tree headers, what structures name (``fetch``), and the
    targets of blocks (direct blocks, symbol table nodes): (block, its heap (0: a symbol
    table node), [(the link's creation order or None, its object header)] in the block's
    order, whether the block was whole in the bytes)."""

    heaps: list[Heap] = field(default_factory=list)
    trees: list[Tree] = field(default_factory=list)
    # (a structure's address, the (address, size) of what it names that its reader reads
    # next): an object header's link and attribute indexes, a B-tree's root, a root node's
    # leaves, a heap's root block, a root indirect block's direct blocks
    fetch: list[tuple[int, list[tuple[int, int]]]] = field(default_factory=list)
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


class Budget:
    """Link messages a call of ``link_places`` may still parse, hard or not."""

    __slots__ = ("messages",)

    def __init__(self, messages: int = MAX_MESSAGES_PARSED) -> None:
        self.messages = messages


def _links(view: bytes | memoryview, at: int, end: int, file_size: int, budget: Budget
           ) -> list[tuple[int | None, bytes, int]]:
    """The hard links' (creation order or None, name (its first ``NAME_KEPT`` bytes),
    object header address) of the link messages packed from ``at`` up to ``end``; the first
    message not whole and well formed ends them, as does the call's ``budget``."""
    out: list[tuple[int | None, bytes, int]] = []
    while at + 4 <= end and len(out) < MAX_TARGETS and budget.messages > 0:
        budget.messages -= 1
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


def _snod(view: bytes | memoryview, at: int, file_size: int
          ) -> list[tuple[int | None, bytes, int]] | None:
    if at + 8 > len(view) or view[at + 5] != 0:
        return None
    (count,) = struct.unpack_from("<H", view, at + 6)
    if not 0 < count <= SNOD_MAX or at + 8 + count * SNOD_ENTRY > len(view):
        return None
    out: list[tuple[int | None, bytes, int]] = []
    for i in range(count):
        _name, header, cache = struct.unpack_from("<QQI", view, at + 8 + i * SNOD_ENTRY)
        if cache > 2 or (header >= file_size and header != UNDEFINED):
            return None
        if cache != 2 and header != UNDEFINED:  # (2: a soft link, no header)
            out.append((None, b"", header))
    return out


def _tree_at(view: bytes | memoryview, at: int, base: int, file_size: int) -> Tree | None:
    if at + TREE_BYTES > len(view):
        return None
    (version, kind, node_size, record_size, depth, _split, _merge, root, root_records,
     _total) = _TREE.unpack_from(view, at + 4)
    if (version != 0 or not 1 <= kind <= 11 or not 64 <= node_size <= 1 << 20
            or not 0 < record_size <= node_size // 4 or depth > 16
            or (root != UNDEFINED and root + node_size > file_size)
            or root_records * record_size > node_size or root_records >= MAX_BLOCKS):
        return None
    return Tree(base + at, kind, node_size, record_size, depth, root, root_records)


def _indexes(view: bytes | memoryview, at: int, file_size: int) -> list[tuple[int, int]]:
    """(address, size) of the heaps' and B-trees' headers named by the Link Info and
    Attribute Info messages in the first chunk of the object header at ``view[at:]``, and
    of its continuation chunks."""
    flags = view[at + 5]
    p = at + 6 + (16 if flags & 0x20 else 0) + (4 if flags & 0x10 else 0)
    width = 1 << (flags & 3)
    if p + width > len(view):
        return []
    end = min(len(view), p + width + int.from_bytes(view[p:p + width], "little"))
    p += width
    head = 6 if flags & 0x04 else 4  # type, size, flags (and a creation order)
    out: list[tuple[int, int]] = []
    for _ in range(MAX_MESSAGES):
        if p + head > end:
            break
        kind, size = view[p], int.from_bytes(view[p + 1:p + 3], "little")
        p += head
        if p + size > end:
            break
        if kind == CONTINUATION and size == 16:  # the header's next chunk
            chunk, length = struct.unpack_from("<QQ", view, p)
            out.append((chunk, min(length, MAX_FETCHED)))
        elif kind in INDEX_MESSAGES and size >= 18 and view[p] == 0:
            q = p + 2 + (8 if view[p + 1] & 1 and kind == 0x02 else 0) + (
                2 if view[p + 1] & 1 and kind == 0x15 else 0)
            named = (q + 24 if view[p + 1] & 2 else q + 16)
            if named <= p + size:
                heap, *trees = struct.unpack_from(f"<{(named - q) // 8}Q", view, q)
                out += [(heap, HEAP_BYTES)] + [(t, TREE_BYTES) for t in trees]
        p += size
    return [(a, n) for a, n in out if a != UNDEFINED and a + n <= file_size]


def link_places(data: bytes | memoryview, base: int, file_size: int,
                heaps: Mapping[int, Heap], trees: Mapping[int, Tree] | None = None, *,
                skip: Container[int] = ()) -> Found:
    """The structures of group links whole in ``data`` (the file's bytes from ``base``):
    none at an address in ``skip`` (seen before). ``heaps``: the heaps known by address,
    ``trees`` the B-trees by their root's address (a block or root node of another is
    passed over; one found here counts too)."""
    found = Found()
    budget = Budget()
    view = memoryview(data).cast("B") if not isinstance(data, bytes) else data
    known = dict(heaps)
    roots = dict(trees or {})
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
                if heap.root != UNDEFINED:  # an indirect block: its entries; or a block
                    found.fetch.append((address, [(heap.root, min(heap.start, MAX_FETCHED))]))
            continue
        if kind == b"SNOD":
            links = _snod(view, at, file_size)
            if links:
                found.targets.append((address, 0, links, True))
            continue
        if kind == b"OHDR":
            if indexes := _indexes(view, at, file_size):
                found.fetch.append((address, indexes))
            continue
        if kind == b"BTHD":
            tree = _tree_at(view, at, base, file_size)
            if tree is not None:
                roots[tree.root] = tree
                found.trees.append(tree)
                if tree.root != UNDEFINED:
                    found.fetch.append((address, [(tree.root, min(tree.node_size,
                                                                  MAX_FETCHED))]))
            continue
        if kind == b"BTIN":
            tree = roots.get(address)
            if tree is not None and (leaves := tree.leaves(view, at, file_size)):
                found.fetch.append((address, leaves))
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
                if blocks := heap.direct_blocks(view, at, file_size):
                    found.fetch.append((address, blocks))
            continue
        size = heap.block_size(offset)
        if size is None:
            continue
        start = at + 13 + heap.offset_bytes + (4 if heap.checksummed else 0)
        links = _links(view, start, min(at + size, len(view)), file_size, budget)
        if links:
            found.targets.append((address, owner, links, at + size <= len(view)))
    return found
