"""HDF5 link walk: a reader opening a group's members one after another (xarray opening a
NetCDF-4 file, h5py visiting datasets) gets the next members' object headers fetched together,
found in the group's own links (DESIGN §15, issue 46).

A group's links name each member's object header (``core/hdf5links.py``): its symbol table
nodes (old-style groups) or the link messages in its fractal heap's direct blocks (new-style,
every NetCDF-4 file). Headers lie where they were written — in a file of large variables,
each a few MiB from the next — so opening every member is one round trip per few members,
and a whole-object view's blob window fetches the data between. Every small read served is
scanned for those structures; the links seen are kept in the group's order (creation order
where the links carry it, else their order in the file). A reader that steps to the next
member's header ``WALK_STEPS`` times in a row (a read holding a header among the ``SLACK``
after the last one reached; reads of other bytes between — attributes, a dimension's header,
the data — neither count nor break the walk) is walking: the headers of the next
``AHEAD_TARGETS`` members are fetched. A heap's root indirect block names its direct blocks:
a reader that reads it lists or looks up links, and the direct blocks are fetched with it.

Invariants:
- Used for prefetch alone: a wrong guess costs a fetch, never a byte served.
- Only reads of ``NODE_READ`` bytes at most are scanned (a header read, with the kernel's
  pages around it); larger reads are of data and cost no scan.
- Bounded per file: ``MAX_KEPT`` targets, ``MAX_HEAPS`` heaps, ``MAX_BLOCKS`` blocks seen.
"""

from __future__ import annotations

import bisect

from faultfs.core.hdf5index import Chunk, Node
from faultfs.core.hdf5links import Heap, link_places

NODE_READ = 32 << 10  # reads scanned: this long at most (a header's pages, not data)
WALK_STEPS = 2  # steps to the next member in a row that make a walk (one lookup may meet one)
SLACK = 8  # a step may pass over this many members (read with the kernel's pages before)
AHEAD_TARGETS = 64  # members' headers fetched ahead of a walking reader
TARGET_BYTES = 512  # bytes of a header fetched from its address (its blob, and the next one
# when the header's first bytes cross into it)
MAX_KEPT = 1 << 12  # targets kept per file (~250 bytes each) ...
MAX_ADDED = 1 << 10  # ... added after one read, at most
MAX_HEAPS = 256  # heap headers kept per file, and groups ranked
MAX_BLOCKS = 1 << 12  # blocks seen whole (passed over when read again)
PAGE = 4096
MAX_PAGES = 1 << 12  # pages of small reads remembered (a header read before its link was seen)
WALKING_READS = 8  # reads after a walk's last step during which the reader still walks


Key = tuple[int, int, int | bytes] | tuple[int, int, int, int]


def _key(group: int, order: int | None, name: bytes, block: int, i: int) -> Key:
    """A link's place in its group's order: by creation order when it has one, else by
    name (h5py iterates such a group by name), else (a symbol table node's entry) by its
    node's address and its place in it. A group's keys sort together."""
    if order is not None:
        return (group, 0, order)
    if name:
        return (group, 1, name)
    return (group, 2, block, i)


class LinkWalk:
    """The links of one file's groups seen so far, and where its reader walks them."""

    def __init__(self) -> None:
        self.heaps: dict[int, Heap] = {}
        self.nodes: dict[int, Node] = {}  # version-2 B-tree nodes named, not read yet ...
        self.chunks: dict[int, Chunk] = {}  # ... and object header continuation chunks
        self.groups: dict[int, int] = {0: 0}  # a heap's address (0: symbol table nodes) -> rank
        self.seen: set[int] = set()  # blocks taken whole, and root indirect blocks read
        self.keys: list[Key] = []  # the targets' keys, sorted ...
        self.header: dict[Key, int] = {}  # ... each one's object header
        self.addresses: list[int] = []  # the headers' addresses, sorted ...
        self.key_of: dict[int, Key] = {}  # ... and each one's (first) key
        self.read: set[Key] = set()  # the members whose headers a read held
        self.pages: dict[int, None] = {}  # the pages small reads held, the last MAX_PAGES
        self.frontier: Key | None = None  # the first member of the walk not read yet
        self.steps = 0  # steps to the frontier in a row
        self.since_step = WALKING_READS + 1  # reads since the last step

    def served(self, data: bytes | memoryview, base: int, off: int, end: int,
               file_size: int) -> list[tuple[int, int]]:
        """A read of ``[off, end)`` was served (``data``: its bytes, and small reads around
        them, from ``base``): (address, size) of the blocks to fetch and of the headers of
        the next members when its reader walks a group."""
        self.since_step += 1
        if end - off > NODE_READ or len(data) > 2 * NODE_READ:
            return []
        for page in range(off // PAGE, -(-end // PAGE)):
            self.pages[page] = None
        while len(self.pages) > MAX_PAGES:
            del self.pages[next(iter(self.pages))]
        found = link_places(data, base, file_size, self.heaps, self.nodes, self.chunks,
                            skip=self.seen)
        out: list[tuple[int, int]] = []
        for heap in found.heaps:
            if len(self.heaps) < MAX_HEAPS:
                self.heaps[heap.address] = heap
        for address, node in found.nodes:  # read when they come
            if len(self.nodes) < MAX_BLOCKS:
                self.nodes[address] = node
        for address, chunk in found.chunks:
            if len(self.chunks) < MAX_BLOCKS:
                self.chunks[address] = chunk
        for address, ranges, whole in found.fetch:  # what a structure names: fetched once
            out.extend(ranges)
            if whole:
                self._seen(address)
        room = MAX_ADDED
        for block, owner, links, whole in found.targets:
            room -= self._add(block, owner, links, room)
            if whole:
                self._seen(block)
        if self._stepped(off, end):
            out.extend((a, TARGET_BYTES) for a in self.ahead())
        return out

    @property
    def walking(self) -> bool:
        """Whether the reader walks a group now: ``WALK_STEPS`` steps in a row, the last
        one within ``WALKING_READS`` reads (a reader that went on to the members' data has
        stopped)."""
        return self.steps >= WALK_STEPS and self.since_step <= WALKING_READS

    def _seen(self, block: int) -> None:
        if len(self.seen) < MAX_BLOCKS:
            self.seen.add(block)

    def _add(self, block: int, owner: int, links: list[tuple[int | None, bytes, int]],
             room: int) -> int:
        """Keep ``links`` of a block, ``room`` new ones at most; how many were new."""
        group = self.groups.get(owner)
        if group is None:
            if len(self.groups) > MAX_HEAPS:
                return 0
            group = self.groups[owner] = len(self.groups)
        added = 0
        for i, (order, name, address) in enumerate(links):
            key = _key(group, order, name, block, i)
            if key in self.header:
                continue
            if len(self.keys) >= MAX_KEPT or added >= room:
                break
            added += 1
            bisect.insort(self.keys, key)
            self.header[key] = address
            if address // PAGE in self.pages:  # read before its link was seen
                self.read.add(key)
            if address not in self.key_of:
                self.key_of[address] = key
                bisect.insort(self.addresses, address)
        return added

    def _stepped(self, off: int, end: int) -> bool:
        """Whether the read of ``[off, end)`` goes on with a walk that makes ``WALK_STEPS``:
        it holds a member not read before among the ``SLACK`` from the walk's frontier (the
        first member after the walk's start not read yet: headers written out of order, or
        read before with another's pages, are passed over). A read holding only members read
        before (a header read again) is no step; one holding others starts a walk there."""
        i = bisect.bisect_left(self.addresses, off)
        j = bisect.bisect_left(self.addresses, end, lo=i)
        new = {k for k in map(self.key_of.__getitem__, self.addresses[i:j])
               if k not in self.read}
        if not new:
            return False
        self.read |= new
        if self.frontier is not None:
            p = bisect.bisect_left(self.keys, self.frontier)
            if any(k in new for k in self.keys[p:p + SLACK]):
                self.steps += 1
                self.since_step = 0
                self._advance(p)
                return self.steps >= WALK_STEPS
        self.steps = 0
        self.frontier = min(new)
        self._advance(bisect.bisect_left(self.keys, self.frontier))
        return False

    def _advance(self, p: int) -> None:
        """The frontier moves from ``keys[p]`` past the members read."""
        while p < len(self.keys) and self.keys[p] in self.read:
            p += 1
        self.frontier = self.keys[p] if p < len(self.keys) else (*self.keys[-1], 0)

    def ahead(self) -> list[int]:
        """The headers of the members of the ``AHEAD_TARGETS`` from the walk's frontier on
        (in its group) not read yet."""
        if self.frontier is None:
            return []
        group = self.frontier[0]
        p = bisect.bisect_left(self.keys, self.frontier)
        return [self.header[k] for k in self.keys[p:p + AHEAD_TARGETS]
                if k[0] == group and k not in self.read]
