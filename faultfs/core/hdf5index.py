"""HDF5's version-2 object headers and B-trees, read from bytes a reader was served: what each
names that its reader reads next (``core/hdf5links.py`` finds them; ``hdf5/linkwalk.py``
fetches what they name as soon as they are read).

- A version-2 object header (``OHDR``) or its continuation chunk (``OCHK``) holds messages:
  a type, a size, flags (and a creation order when the header's flags say so). A Link Info
  message names the group's fractal heap and the B-trees indexing its links by name and by
  creation order; an Attribute Info message the same for dense attributes; a continuation
  message the header's next chunk (written where the file ended when the header grew: a
  NetCDF dimension's list of the variables that use it).
- A version-2 B-tree's header (``BTHD``) names its root node and how many records it holds;
  an internal node (``BTIN``) holds its records, then a pointer to each child: its address,
  how many records the child holds (in as many bytes as the largest leaf's count needs),
  and, below a node deeper than 1, how many its subtree holds (in as many bytes as the
  largest such subtree's count needs: ``Tree.widths``). A node's record count comes from
  the pointer to it (the header's, for the root), so a node is read only once that pointer
  was (``Node``).

Nothing here trusts the bytes: fields are checked against the file and each other, a call
parses a bounded number of entries (``Budget``), and what a structure names is fetched by its
first ``MAX_FETCHED`` bytes.

Supported: 8-byte offsets and lengths (as ``core/hdf5.py``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from faultfs.core.hdf5 import UNDEFINED

MAX_FETCHED = 64 << 10  # bytes fetched of each block, node or chunk a structure names
MAX_ENTRIES = 8192  # entries (messages, pointers, block addresses) parsed in one call
MAX_CHILDREN = 4096  # records of a B-tree node, at most
MAX_DEPTH = 16
NODE_PREFIX = 10  # a B-tree node's signature, version, type and checksum
_TREE = struct.Struct("<BBIHHBBQHQ")  # a version-2 B-tree's header after the signature
TREE_BYTES = 4 + _TREE.size + 4
HEAP_BYTES = 146  # a fractal heap's header without filters (``core/hdf5links.py``): its
# signature, 138 bytes of fields with 8-byte offsets and lengths, a checksum
INDEX_MESSAGES = (0x02, 0x15)  # Link Info, Attribute Info: a heap and B-trees named
CONTINUATION = 0x10


class Budget:
    """Entries a call may still parse (``MAX_ENTRIES``): every message, pointer, block
    address or symbol table entry counts, whatever it names."""

    __slots__ = ("entries",)

    def __init__(self, entries: int = MAX_ENTRIES) -> None:
        self.entries = entries

    def take(self, n: int) -> bool:
        """Spend ``n`` entries; False (nothing spent) when fewer are left."""
        if n > self.entries:
            return False
        self.entries -= n
        return True


def _bytes_for(count: int) -> int:
    """The bytes HDF5 stores a count of at most ``count`` in."""
    return (max(count, 1).bit_length() - 1) // 8 + 1


@dataclass(frozen=True)
class Tree:
    """A version-2 B-tree's header: what reading its nodes needs."""

    address: int
    kind: int
    node_size: int
    record_size: int
    depth: int
    root: int
    root_records: int

    def widths(self) -> tuple[int, list[int]] | None:
        """The bytes of a pointer's record count, and of its subtree's count at each depth
        (0 at depth 0: a leaf's pointer has none); None when the geometry holds no record."""
        most = (self.node_size - NODE_PREFIX) // self.record_size  # a leaf's records
        count = _bytes_for(most)
        total, below = [0], most  # records under a node of each depth, at most
        for depth in range(1, self.depth + 1):
            pointer = 8 + count + total[depth - 1]
            records = (self.node_size - NODE_PREFIX - pointer) // (self.record_size + pointer)
            if records <= 0:
                return None
            below = (records + 1) * below + records
            total.append(_bytes_for(below))
        return count, total

    def children(self, view: bytes | memoryview, at: int, depth: int, records: int,
                 file_size: int, budget: Budget) -> list[tuple[int, int]]:
        """(address, records) of the children the node of ``depth`` holding ``records`` at
        ``view[at:]`` points to (an empty list unless its pointers are whole there)."""
        widths = self.widths()
        if widths is None or not 1 <= depth <= self.depth or at + 6 > len(view):
            return []
        count, total = widths
        pointer = 8 + count + (total[depth - 1] if depth > 1 else 0)
        start = at + 6 + records * self.record_size
        if (view[at + 4] != 0 or view[at + 5] != self.kind
                or start + (records + 1) * pointer > len(view) or not budget.take(records + 1)):
            return []
        out: list[tuple[int, int]] = []
        for i in range(records + 1):
            p = start + i * pointer
            (child,) = struct.unpack_from("<Q", view, p)
            held = int.from_bytes(view[p + 8:p + 8 + count], "little")
            if child + self.node_size <= file_size and held < MAX_CHILDREN:
                out.append((child, held))
        return out


@dataclass(frozen=True)
class Node:
    """An internal node expected at an address: its tree, depth and records."""

    tree: Tree
    depth: int
    records: int


def tree_at(view: bytes | memoryview, at: int, base: int, file_size: int) -> Tree | None:
    """The version-2 B-tree header whole at ``view[at:]``, if it is one."""
    if at + TREE_BYTES > len(view):
        return None
    (version, kind, node_size, record_size, depth, _split, _merge, root, root_records,
     _total) = _TREE.unpack_from(view, at + 4)
    if (version != 0 or not 1 <= kind <= 11 or not 64 <= node_size <= 1 << 20
            or not 0 < record_size <= node_size // 4 or depth > MAX_DEPTH
            or (root != UNDEFINED and root + node_size > file_size)
            or root_records * record_size > node_size or root_records >= MAX_CHILDREN):
        return None
    return Tree(base + at, kind, node_size, record_size, depth, root, root_records)


@dataclass(frozen=True)
class Chunk:
    """A continuation chunk of an object header: its length, and the header's flags (its
    messages' layout)."""

    length: int
    flags: int


Named = tuple[list[tuple[int, int]], list[tuple[int, Chunk]], bool]


def header_names(view: bytes | memoryview, at: int, file_size: int, budget: Budget) -> Named:
    """What the version-2 object header at ``view[at:]`` names in its first chunk: the
    (address, size) to fetch (heaps' and B-trees' headers, continuation chunks), the
    continuation chunks with what reading them needs, and whether the chunk was whole in
    ``view`` (one cut at its end is read again when more of it comes)."""
    if at + 7 > len(view):
        return [], [], False
    flags = view[at + 5]
    p = at + 6 + (16 if flags & 0x20 else 0) + (4 if flags & 0x10 else 0)
    width = 1 << (flags & 3)
    if p + width > len(view):
        return [], [], False
    end = p + width + int.from_bytes(view[p:p + width], "little")
    return messages(view, p + width, end, flags, file_size, budget)


def messages(view: bytes | memoryview, p: int, end: int, flags: int, file_size: int,
             budget: Budget) -> Named:
    """What the messages from ``p`` to ``end`` of a header (or continuation chunk) whose
    flags are ``flags`` name (``header_names``)."""
    whole = end <= len(view)
    end = min(end, len(view))
    head = 6 if flags & 0x04 else 4  # type, size, flags (and a creation order)
    out: list[tuple[int, int]] = []
    chunks: list[tuple[int, Chunk]] = []
    while p + head <= end and budget.take(1):
        kind, size = view[p], int.from_bytes(view[p + 1:p + 3], "little")
        p += head
        if p + size > end:
            break
        if kind == CONTINUATION and size == 16:  # the header's next chunk
            chunk, length = struct.unpack_from("<QQ", view, p)
            if chunk != UNDEFINED and 4 < length and chunk + length <= file_size:
                out.append((chunk, min(length, MAX_FETCHED)))
                chunks.append((chunk, Chunk(length, flags)))
        elif kind in INDEX_MESSAGES and size >= 18 and view[p] == 0:
            q = p + 2 + (8 if view[p + 1] & 1 and kind == 0x02 else 0) + (
                2 if view[p + 1] & 1 and kind == 0x15 else 0)
            named = q + 24 if view[p + 1] & 2 else q + 16
            if named <= p + size:
                heap, *trees = struct.unpack_from(f"<{(named - q) // 8}Q", view, q)
                out += [(a, n) for a, n in [(heap, HEAP_BYTES), *((t, TREE_BYTES) for t in trees)]
                        if a != UNDEFINED and a + n <= file_size]
        p += size
    return out, chunks, whole
