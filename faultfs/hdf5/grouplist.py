"""HDF5 group listing lookahead: a reader listing a group gets the group's next symbol table
nodes prefetched together, found in the group's own index (DESIGN §15, issue 46).

A group's leaves (``core.hdf5.GroupNode`` at level 0) name its symbol table nodes in name
order, 8 members each by default; h5py lists a group (``list(f)``, ``f.keys()``, ``visit``)
by reading every one of them in that order, leaf after leaf.
Each lies where it was written, between the members' data, so in a large file each is a
round trip of its own (and a blob window over them fetches the data between). A reader that
makes two steps in a row — a step: a read of the symbol table node next in the group's
order (in its leaf, or the first of the leaf after), on its own (``NODE_READ``, one step a
read), after a jump over bytes it did not read (``read``) — is listing: the ones after it
are fetched together, up to ``AHEAD_SNODS`` ahead, through the leaves after its own (their
right siblings, or the next children of the node above); a leaf not read yet is read from
memory when it is there and fetched otherwise. ``WALKS`` walks are followed at once
(``visit`` lists each member group between two of its parent's nodes). A lookup by name
reads one symbol table node in each leaf it goes through, a reader going through the file
reads them all beside what lies between: nothing is fetched for either.

Invariants:
- Used for prefetch alone: a wrong guess costs a fetch, never a byte served.
- Bounded per file: ``MAX_GROUP_NODES`` nodes and ``MAX_SNODS`` children of them all kept
  (and as many links between them); per read, ``AHEAD_SNODS`` fetched ahead and ``PEEKS``
  leaves read from memory at most.
"""

from __future__ import annotations

import bisect
import itertools
from collections import OrderedDict, deque
from collections.abc import Callable

from faultfs.core.hdf5 import UNDEFINED, GroupNode

AHEAD_SNODS = 64  # symbol table nodes fetched ahead of a listing reader at most ...
AHEAD_LEAVES = 8  # ... over this many leaves after its own
WALKS = 4  # groups listed at once (``visit`` lists a member group between two of its parent's)
RECENT_READS = 8  # reads remembered: one abutting none of them is a jump
PEEKS = 4  # leaves read from memory after one read, at most
MAX_GROUP_NODES = 4096  # group-index nodes kept per file ...
MAX_SNODS = 1 << 16  # ... and children of them all together
SNOD_BYTES = 328  # a symbol table node of h5py's groups (8 entries of 40 bytes, a header)
LISTING_GAP = 512 << 10  # bytes read since the last symbol table node, at most, to be listing
LISTING_STEPS = 2  # steps to the next symbol table node in a row that make a listing (a
# lookup by name and the next one may meet two in order by chance)
NODE_READ = 128 << 10  # a read of a symbol table node is this long at most (the kernel's pages
# around it); a longer one is of the data around it

Parse = Callable[[int], GroupNode | None]  # a leaf read from memory, if it is there whole


class GroupListing:
    """The group-index nodes of one file seen so far, and where its reader lists."""

    def __init__(self) -> None:
        self.nodes: dict[int, GroupNode] = {}
        self.kept = 0  # their children, all nodes together (``MAX_SNODS``)
        self.where: dict[int, tuple[int, int]] = {}  # symbol table node -> (leaf, position)
        self.order: list[int] = []  # symbol table nodes' addresses, ascending
        self.after: dict[int, int] = {}  # a node -> the node after it at its level
        # the walks under way: the symbol table node each read last -> (steps to the next in
        # a row, its address); the one moved last is the reader's (``at``)
        self.walks: OrderedDict[tuple[int, int], tuple[int, int]] = OrderedDict()
        self.at: tuple[int, int] | None = None
        self.since = 0  # bytes read since the last symbol table node ...
        self.recent: deque[tuple[int, int]] = deque(maxlen=RECENT_READS)  # ... and the reads
        self.listing = False  # the reader's walk made LISTING_STEPS in a row

    def add(self, node: GroupNode) -> None:
        """A node of a group's index was seen (read, or read from memory)."""
        if (node.address in self.nodes or len(self.nodes) >= MAX_GROUP_NODES
                or self.kept + len(node.children) > MAX_SNODS):
            return
        self.nodes[node.address] = node
        self.kept += len(node.children)
        if node.right != UNDEFINED:
            self.after.setdefault(node.address, node.right)
        if node.level != 0:  # the nodes below, in order
            for a, b in itertools.pairwise(node.children):
                self.after.setdefault(a, b)
            return
        for i, child in enumerate(node.children):
            if child not in self.where:
                self.where[child] = (node.address, i)
                bisect.insort(self.order, child)

    def read(self, off: int, end: int) -> bool:
        """A read of ``[off, end)`` was served: whether its reader is listing a group now.
        A step of a walk is a read of the symbol table node next in its group's order, read
        on its own (``NODE_READ`` at most, one step a read), after a jump (abutting none of
        the last reads: a sequential reader's reads arrive out of order, each beside one
        before it) over bytes it did not read (less than half the way since, and
        ``LISTING_GAP`` at most). A larger read over one is of data."""
        i = bisect.bisect_left(self.order, off)
        j = bisect.bisect_left(self.order, end, lo=i)
        jumped = not any(o == end or e == off for o, e in self.recent)
        self.recent.append((off, end))
        if end - off > NODE_READ or j == i:
            self.since += end - off
            if self.since > LISTING_GAP:
                self.walks.clear()
                self.listing = False
            return self.listing
        address, at, walk = self._follow(self.order[i:j])
        steps = 0
        if walk is not None:
            steps, before = self.walks.pop(walk)
            skipped = self.since <= min(LISTING_GAP, abs(address - before) // 2)
            if at == walk:
                pass
            elif skipped and jumped and self._next(walk, at):
                steps += 1
            elif not (steps >= LISTING_STEPS and self.since <= LISTING_GAP):
                steps = 0
        self.walks[at] = (steps, address)
        while len(self.walks) > WALKS:
            self.walks.popitem(last=False)
        self.at, self.since = at, 0
        self.listing = steps >= LISTING_STEPS
        return self.listing

    def _follow(self, addresses: list[int]
                ) -> tuple[int, tuple[int, int], tuple[int, int] | None]:
        """Of the symbol table nodes a read covers, the one that goes on with a walk (the
        next in its order, else one in its leaf or the next), latest walk first; else the
        first. (address, its place, the walk it goes on with or None)"""
        places = [(a, self.where[a]) for a in addresses]
        for fits in (self._next, self._near):
            for walk in reversed(self.walks):
                for address, at in places:
                    if fits(walk, at) or at == walk:
                        return address, at, walk
        address, at = places[0]
        return address, at, None

    def _next(self, last: tuple[int, int], at: tuple[int, int]) -> bool:
        """Whether ``at`` comes right after ``last`` in the group's order."""
        (leaf, pos), (other, j) = last, at
        if other == leaf:
            return j == pos + 1
        return j == 0 and self.after.get(leaf) == other and pos == len(
            self.nodes[leaf].children) - 1

    def _near(self, last: tuple[int, int], at: tuple[int, int]) -> bool:
        """Whether ``at`` is in the leaf of ``last`` or the one after."""
        return at[0] in (last[0], self.after.get(last[0]))

    def ahead(self, parse: Parse) -> tuple[list[int], list[int]]:
        """While listing: the symbol table nodes after the one read last, and the leaves on
        the way that are neither seen nor in memory (to fetch, to be read from memory at a
        later read)."""
        if not self.listing or self.at is None:
            return [], []
        leaf, pos = self.at
        snods = list(self.nodes[leaf].children[pos + 1:pos + 1 + AHEAD_SNODS])
        missing: list[int] = []
        peeks = 0
        for _ in range(AHEAD_LEAVES):
            nxt = self.after.get(leaf)
            if nxt is None or len(snods) >= AHEAD_SNODS:
                break
            node = self.nodes.get(nxt)
            if node is None and peeks < PEEKS:
                peeks += 1
                node = parse(nxt)
                if node is not None and node.level == 0:
                    self.add(node)
                else:
                    node = None
            if node is None:
                missing.append(nxt)
            else:
                snods.extend(node.children[:AHEAD_SNODS - len(snods)])
            leaf = nxt
        return snods, missing
