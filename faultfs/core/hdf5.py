"""HDF5's chunk index, read from bytes a reader was served: where a chunked dataset's chunks lie.

An HDF5 file (signature at offset 0) indexes the chunks of a dataset stored with the default
(earliest) file format in a version-1 B-tree whose nodes are ``TREE`` records: node type 1 (raw
data chunks), a level (0: its children are chunks), the entries used, the siblings' addresses,
then ``key, child, key, child, ..., key``. A chunk's key holds its stored size (after the
filters), a filter mask and its offsets in the dataset (rank + 1 numbers, the last one 0); its
child is the chunk's file address; the last key bounds the node. A reader (h5py) reads a node
before the chunks it indexes, so the node's bytes pass through the daemon first; from them the
daemon knows the exact byte ranges of the chunks the reader may read next
(``hdf5/lookahead.py``).

Nothing here trusts the bytes: a node is taken only when it fits in the bytes given and every
field is consistent (the rank found by trying each, keys in order, each trailing offset zero,
children and siblings inside the file). Anything else in the bytes (compressed data that
happens to hold ``TREE``) is no node. A wrong guess could only cost a prefetch, never a byte
served, as the caller uses the index for prefetch alone. And the bytes cannot make a call
costly: it examines ``MAX_CANDIDATES`` places at most and parses ``MAX_KEYS`` keys at most
over all of them and every rank tried (``Budget``; bytes made of many overlapping "nodes" of
thousands of entries each cost seconds of the serving thread per read before it).

A group written the same way (h5py's default, "old-style" groups) indexes its members in a
version-1 B-tree of type 0: ``key, child, ..., key`` with 8-byte keys (offsets of names in the
group's local heap); a leaf's children are symbol table nodes (``SNOD``), 8 members each by
default, which h5py reads one after another to list the group (``GroupNode``). Listing a
group of a large file is then one round trip per symbol table node, each in its own part of
the file; knowing them from their leaf lets the daemon fetch them together.

Supported: 8-byte file offsets and lengths (every file h5py writes by default) and no user
block (base address 0). Files written with ``libver="latest"`` index chunks otherwise (fixed
and extensible arrays, version-2 B-trees): no node is found in them, and reads of them get the
plain sequential prefetch.
"""

from __future__ import annotations

import itertools
import re
import struct
from collections.abc import Container
from dataclasses import dataclass

SIGNATURE = b"\x89HDF\r\n\x1a\n"
UNDEFINED = (1 << 64) - 1  # HDF5's undefined address
MAX_RANK = 32  # HDF5's limit on a dataset's rank
MAX_CANDIDATES = 64  # places that look like a node examined in one call, at most ...
MATCHES_SEEN = 8  # ... (of each kind) and places passed over, this many times as many
MAX_KEYS = 16384  # ... and keys parsed (a real node of 64 entries costs ~100 over its ranks)
NODE_HEADER = 24  # "TREE", type, level, entries used, left and right sibling
_NODE = re.compile(rb"TREE\x01")  # a node of a chunk index (type 1)
_ANY_NODE = re.compile(rb"TREE[\x00\x01]")  # ... or of a group (type 0)
MAX_GROUP_ENTRIES = 4096  # a group node's children at most (h5py's: 32)
_HEAD = struct.Struct("<4sBBHQQ")


@dataclass(frozen=True)
class ChunkNode:
    """A node of a chunk index: at level 0 its children are chunks (``sizes`` their stored
    sizes), above it they are the nodes below."""

    address: int
    level: int
    children: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def chunks(self) -> list[tuple[int, int]]:
        """(address, size) of each chunk of a leaf; nothing for a node above the leaves."""
        return list(zip(self.children, self.sizes, strict=True)) if self.level == 0 else []


def addresses_fit(head: bytes) -> bool:
    """Whether ``head`` (a file's first bytes) is an HDF5 superblock with 8-byte offsets and
    lengths at offset 0: the files whose chunk index ``chunk_nodes`` reads."""
    if len(head) < 16 or not head.startswith(SIGNATURE):
        return False
    version = head[8]
    if version in (0, 1):
        return head[13] == 8 and head[14] == 8
    if version in (2, 3):
        return head[9] == 8 and head[10] == 8
    return False


class Budget:
    """Keys a call of ``chunk_nodes`` may still parse; ``spent`` once they ran out."""

    __slots__ = ("keys",)

    def __init__(self, keys: int = MAX_KEYS) -> None:
        self.keys = keys

    @property
    def spent(self) -> bool:
        return self.keys <= 0


@dataclass(frozen=True)
class GroupNode:
    """A node of a group's index: at level 0 its children are symbol table nodes (each
    naming up to 8 of the group's members, in name order), above it the nodes below; the
    siblings at its level (``UNDEFINED``: none) chain the leaves in order."""

    address: int
    level: int
    children: tuple[int, ...]
    right: int


def chunk_nodes(data: bytes | memoryview, base: int, file_size: int, *,
                skip: Container[int] = (), limit: int = MAX_CANDIDATES,
                budget: Budget | None = None,
                groups: list[GroupNode] | None = None,
                groups_known: Container[int] = ()) -> list[ChunkNode]:
    """The chunk-index nodes whole in ``data``, which holds the file's bytes from ``base``;
    none at an address in ``skip`` (read before), and no more than ``limit`` places that
    look like one examined and ``budget``'s keys parsed (bytes made to hold many cost a
    bounded time; the caller sees ``budget.spent``). ``groups``: the group-index nodes found
    in the same scan (none at an address in ``groups_known``) are added to it, their places
    under a ``limit`` of their own (a read over many groups' nodes still finds the chunk
    index after them)."""
    found: list[ChunkNode] = []
    budget = budget if budget is not None else Budget()
    view = memoryview(data).cast("B") if not isinstance(data, bytes) else data
    pattern = _NODE if groups is None else _ANY_NODE
    examined = [0, 0]  # places that look like a chunk node, a group node
    kinds = 1 if groups is None else 2
    for seen, match in enumerate(pattern.finditer(view)):
        at = match.start()
        group = view[at + 4] == 0
        if budget.spent or min(examined[:kinds]) >= limit or seen >= MATCHES_SEEN * limit:
            break
        if examined[group] >= limit or base + at in (groups_known if group else skip):
            continue
        examined[group] += 1
        if group:
            node = group_node_at(memoryview(view)[at:], base + at, file_size, budget)
            if node is not None and groups is not None:
                groups.append(node)
            continue
        chunk = _node_at(view, at, base, file_size, budget)
        if chunk is not None:
            found.append(chunk)
    return found


def group_extent(head: bytes | memoryview) -> int | None:
    """The bytes of the group-index node whose first ``NODE_HEADER`` bytes are ``head``, or
    None when ``head`` is no such node's header."""
    if len(head) < NODE_HEADER or bytes(head[:5]) != b"TREE\x00":
        return None
    entries: int = _HEAD.unpack_from(head, 0)[3]
    return NODE_HEADER + 16 * entries + 8


def group_node_at(data: bytes | memoryview, base: int, file_size: int,
                  budget: Budget | None = None) -> GroupNode | None:
    """The group-index node at the first byte of ``data`` (the file's bytes from ``base``),
    if one is there whole and consistent: children and siblings inside the file, children
    distinct, none the node itself."""
    if len(data) < NODE_HEADER or bytes(data[:5]) != b"TREE\x00":
        return None
    _, _, level, entries, left, right = _HEAD.unpack_from(data, 0)
    if not 0 < entries <= MAX_GROUP_ENTRIES or len(data) < NODE_HEADER + 16 * entries + 8:
        return None
    if any(s != UNDEFINED and not 0 < s < file_size for s in (left, right)):
        return None
    if budget is not None:
        budget.keys -= entries
        if budget.keys < 0:
            return None
    children = struct.unpack_from(f"<{2 * entries}Q", data, NODE_HEADER + 8)[::2]
    if any(not 0 < c < file_size for c in children) or base in children:
        return None
    if len(set(children)) != entries:
        return None
    return GroupNode(base, level, children, right)


def node_extent(head: bytes | memoryview) -> int | None:
    """The most bytes a chunk-index node whose first ``NODE_HEADER`` bytes are ``head`` can
    span (its rank, which sets its keys' size, is not in the header: the largest), or None
    when ``head`` is no such node's header."""
    if len(head) < NODE_HEADER or _NODE.match(bytes(head[:5])) is None:
        return None
    entries: int = _HEAD.unpack_from(head, 0)[3]
    return NODE_HEADER + (entries + 1) * (8 + 8 * (MAX_RANK + 1)) + entries * 8


def node_at(data: bytes | memoryview, base: int, file_size: int) -> ChunkNode | None:
    """The chunk-index node at the first byte of ``data`` (the file's bytes from ``base``), if
    one is there whole; a node above the leaves names them before the reader reads them."""
    view = memoryview(data).cast("B") if not isinstance(data, bytes) else data
    if _NODE.match(view) is None:
        return None
    return _node_at(view, 0, base, file_size, Budget())


def _node_at(data: bytes | memoryview, at: int, base: int, file_size: int,
             budget: Budget) -> ChunkNode | None:
    if at + NODE_HEADER > len(data):
        return None
    _, _, level, entries, left, right = _HEAD.unpack_from(data, at)
    if entries == 0:  # a 16-bit count: no upper bound to check
        return None
    if any(s != UNDEFINED and s >= file_size for s in (left, right)):
        return None
    nodes = [n for rank in range(1, MAX_RANK + 1)
             if (n := _parse(data, at, base, file_size, level, entries, rank, budget))
             is not None]
    if budget.spent:
        return None  # not every reading was tried: none is sure
    return nodes[0] if len(nodes) == 1 else None  # two readings of one node: neither


def _parse(data: bytes | memoryview, at: int, base: int, file_size: int, level: int,
           entries: int, rank: int, budget: Budget) -> ChunkNode | None:
    key_len = 8 + 8 * (rank + 1)
    end = at + NODE_HEADER + (entries + 1) * key_len + entries * 8
    if end > len(data):
        return None
    key = struct.Struct(f"<II{rank + 1}Q")
    pos = at + NODE_HEADER
    children: list[int] = []
    sizes: list[int] = []
    last: tuple[int, ...] | None = None
    for i in range(entries + 1):
        budget.keys -= 1
        if budget.keys < 0:
            return None
        size, _mask, *offsets = key.unpack_from(data, pos)
        if offsets[-1] != 0 and i < entries:  # a chunk starts at its datatype's first byte
            return None
        coords = tuple(offsets[:-1])
        if last is not None and (coords < last if i == entries else coords <= last):
            return None  # keys ascend (the last one bounds the node: it may repeat)
        last = coords
        pos += key_len
        if i == entries:
            break
        (child,) = struct.unpack_from("<Q", data, pos)
        pos += 8
        if level == 0 and not (0 < size and child + size <= file_size):
            return None
        if not 0 < child < file_size:
            return None
        children.append(child)
        sizes.append(size)
    if level == 0:  # a leaf's chunks never overlap
        spans = sorted(zip(children, sizes, strict=True))
        if any(a + n > b for (a, n), (b, _) in itertools.pairwise(spans)):
            return None
    return ChunkNode(base + at, level, tuple(children), tuple(sizes))
