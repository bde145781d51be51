"""HDF5 lookahead: a reader of an HDF5 file through the whole-object view gets the chunks it will
read next prefetched, found in the file's own chunk index (DESIGN §15, issue 46).

A tag's view whose first bytes served are an HDF5 superblock is watched: every read of it is
scanned for the nodes of a chunk index (``core/hdf5.py``), which h5py reads before the chunks
they index. The exact byte ranges of the chunks seen so far are kept in address order. Each
read of a chunk's bytes is placed in that order; when a reader moves from chunk to chunk in a
steady pattern (a whole dataset: one chunk on each time; a strided hyperslab such as
``ds[::256]``: one chunk in every few, with the kernel's readahead touching the next one's
first pages), the chunks the pattern reads next are prefetched, as far as ``LOOKAHEAD_BYTES``,
``LOOKAHEAD_CHUNKS`` and the prefetch budget allow. A node above the leaves names the leaves
h5py reads next: their blobs are prefetched too, and when a strided reader's pattern runs past
the chunks known so far, the next leaf is read from memory (``Peek``: only bytes held there)
before h5py gets to it — a leaf not there is asked for, urgently (fetched, or read back from
the store where memory dropped it) and looked for again at the next reads —, so that the
chunks after a leaf's last one are on their way while the reader is still in the leaf before
(it would otherwise wait for the first of them at every leaf: a round trip and more, as a
whole leaf's chunks start at once).

A reader whose pattern skips chunks is strided: the blob window of ``prefetch.py`` (which would
fetch the gaps between its chunks) holds still for it; the reader's own chunks come from here.
A dense pattern (every chunk in turn) is left to that window, which already keeps the reader's
next blobs in flight in runs.

Invariants:
- The index is used for prefetch alone: a wrong or stale guess costs a fetch, never a byte.
- Only reads of the view are scanned, and only for tags found to be HDF5 at their first byte;
  other tags pay one dictionary lookup per read.
- At most ``MAX_TAGS`` files are remembered, each with ``MAX_CHUNKS`` chunks (2 MiB), ``MAX_NODES``
  index nodes and ``SMALL_READS`` small reads (128 KiB): outside ``--memory-mb``, and bounded.
- A read's scan parses ``core.hdf5.MAX_KEYS`` keys at most (~10 ms of the serving thread);
  a file whose reads spend that budget ``SCANS_SPENT`` times is scanned no more, and the
  chunks prefetched after a read add up to ``LOOKAHEAD_BYTES`` at most (a chunk's size is
  the file's word). Bytes crafted to look like huge overlapping nodes cost a bounded time.
"""

from __future__ import annotations

import bisect
import itertools
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from faultfs.core.chunks import ChunkLayout
from faultfs.core.hdf5 import (
    NODE_HEADER,
    Budget,
    ChunkNode,
    GroupNode,
    addresses_fit,
    chunk_nodes,
    group_extent,
    group_node_at,
    node_at,
    node_extent,
)
from faultfs.hdf5.grouplist import SNOD_BYTES, GroupListing
from faultfs.hdf5.linkwalk import LinkWalk

LOOKAHEAD_BYTES = 32 << 20  # chunk bytes prefetched ahead of a reader at most
LOOKAHEAD_CHUNKS = 16  # ... and chunks
MAX_TAGS = 16  # files remembered, each with up to SMALL_READS * SMALL_READ bytes of reads ...
MAX_CHUNKS = 1 << 17  # ... and this many chunks (16 bytes each: 2 MiB)
MAX_NODES = 1 << 12  # index nodes remembered per file
MAX_LAG = 4  # chunks read per repeat of a pattern, at most
DENSE_RUN = 8  # chunks read one after another before the blob window takes a reader over ...
TOUCHED = 256  # chunk positions read that are remembered
NEXT_CHUNKS = 8  # ... until then, the chunks right after its reads are prefetched
SMALL_READ = 16 << 10  # reads up to this are kept (the last ``SMALL_READS``): a node crossing
PAGE = 4096  # a read starts at most this before the chunk it was made for
SMALL_READS = 8  # a page boundary is served in two reads, in either order
SCANS_SPENT = 4  # reads of a file whose bytes spent a scan's whole budget: no more scans of it
LARGE_READ = 1 << 20  # a read longer than this is scanned at its edges alone ...
EDGE = 64 << 10  # ... this long each

LEAF_PEEK = 64 << 10  # bytes of a leaf read from memory at most (one of 64 entries: ~3 KiB)
LEAF_TRIES = 4  # leaves looked for in memory after one read, at most
SHORT_LOOKS = 8  # reads after which a leaf still short of its bytes is left to h5py

class Tag(Protocol):
    """A file read through a view: the daemon's tags, a ``faultfs::`` object."""

    @property
    def id(self) -> int: ...

    @property
    def layout(self) -> ChunkLayout: ...


class Stats(Protocol):
    """Where the counters go (``faultfs.stats.Stats``, the protocol's counters)."""

    def add(self, name: str, n: int = 1) -> None: ...


# (blob index, the first byte of it wanted) to prefetch, ascending; urgent: an index node the
# reader's pattern waits for, started even where the blobs already on their way fill the
# prefetch's reach (within the memory budget still) -> how many started (a caller that can
# start a fault at a byte starts it there: an object header's bytes first)
Starter = Callable[[Tag, list[tuple[int, int]], bool], int]
Peek = Callable[[Tag, int, int], bytes]  # view bytes [off, off+size) that memory holds (a prefix)


@dataclass
class ChunkMap:
    """The chunks of one HDF5 file seen so far, in address order, and the chunks read last."""

    addresses: array[int] = field(default_factory=lambda: array("q"))  # in order ...
    sizes: array[int] = field(default_factory=lambda: array("q"))  # ... and each one's size
    read: list[int] = field(default_factory=list)  # addresses of the last chunks read
    lag: int = 0  # a steady pattern: every ``lag`` chunks read, the reader moves ``period``
    period: int = 0  # chunks on (0: no steady pattern)
    in_chunk: bool = False  # the last read (not of the index) was of chunks
    end: int = -1  # the position of the furthest chunk read
    touched: set[int] = field(default_factory=set)  # positions read, the last TOUCHED of them
    grew: bool = False  # the last chunk read went on from the furthest (or was the first)
    small: OrderedDict[int, bytes] = field(default_factory=OrderedDict)  # offset -> bytes
    nodes: set[int] = field(default_factory=set)  # addresses of the index nodes read ...
    node_order: list[int] = field(default_factory=list)  # ... in order
    leaves: list[int] = field(default_factory=list)  # nodes named by the nodes above them and
    # not read yet, in the order h5py reads them ...
    queued: set[int] = field(default_factory=set)  # ... as a set
    short: dict[int, list[int]] = field(default_factory=dict)  # a queued leaf -> [the bytes
    # of it memory held when it was found short of the whole node, looks since, whether a
    # start for its missing bytes was made]
    spent: int = 0  # reads whose scan ran out of its budget (``SCANS_SPENT``)
    groups: GroupListing = field(default_factory=GroupListing)  # its groups' indexes ...
    links: LinkWalk = field(default_factory=LinkWalk)  # ... and their links

    def node_read(self, address: int) -> None:
        if address not in self.nodes and len(self.nodes) < MAX_NODES:
            self.nodes.add(address)
            bisect.insort(self.node_order, address)

    def named(self, children: Iterable[int]) -> None:
        """A node above the leaves named ``children``: they are read next, in this order,
        before the leaves named earlier and not read yet (a deeper tree's lower node).
        ``MAX_NODES`` queued at most: a node's own children count once."""
        room = MAX_NODES - len(self.leaves)
        new: list[int] = []
        for child in children:
            if len(new) >= room:
                break
            if child not in self.nodes and child not in self.queued:
                self.queued.add(child)
                new.append(child)
        self.leaves[:0] = new

    def unqueue(self, i: int) -> int:
        """The queued leaf at ``i``, out of the queue."""
        address = self.leaves.pop(i)
        self.queued.discard(address)
        self.short.pop(address, None)
        return address

    def node_in(self, off: int, end: int) -> bool:
        """Whether an index node starts in ``[off, end)``."""
        i = bisect.bisect_left(self.node_order, off)
        return i < len(self.node_order) and self.node_order[i] < end

    def joined(self, off: int, data: bytes | memoryview) -> tuple[int, bytes | memoryview]:
        """A small read with the small reads just before and after it (kept), as one: the
        pages of a node served apart."""
        if len(data) > SMALL_READ:
            return off, data
        raw = bytes(data)
        start, out = off, raw
        before = next((b for o, b in self.small.items() if o + len(b) == off), None)
        after = next((b for o, b in self.small.items() if o == off + len(raw)), None)
        if before is not None:  # one on each side: two kept reads may end at one offset
            start, out = off - len(before), before + out
        if after is not None:
            out = out + after
        self.small[off] = raw
        while len(self.small) > SMALL_READS:
            self.small.popitem(last=False)
        return start, out

    def add(self, chunks: list[tuple[int, int]]) -> bool:
        """Chunks of a leaf seen; whether any was new."""
        new = False
        for address, size in chunks:
            i = bisect.bisect_left(self.addresses, address)
            if len(self.sizes) < MAX_CHUNKS and (i == len(self.addresses)
                                                 or self.addresses[i] != address):
                self.addresses.insert(i, address)
                self.sizes.insert(i, size)
                new = True
        return new

    def inside_chunks(self, off: int, end: int) -> bool:
        """Whether ``[off, end)`` lies within known chunks, end to end (``MAX_LAG`` of them
        at most)."""
        a, b = self.chunks_in(off, end)
        if a > b or b - a > MAX_LAG or self.addresses[a] > off:
            return False
        reach = self.addresses[a] + self.sizes[a]
        for i in range(a + 1, b + 1):
            if self.addresses[i] > reach:
                return False
            reach = max(reach, self.addresses[i] + self.sizes[i])
        return reach >= end

    def chunks_in(self, off: int, end: int) -> tuple[int, int]:
        """Positions ``[a, b]`` of the chunks with bytes in ``[off, end)`` (``a > b``: none)."""
        a = bisect.bisect_right(self.addresses, off) - 1
        if a < 0 or off >= self.addresses[a] + self.sizes[a]:
            a += 1
        return a, bisect.bisect_left(self.addresses, end) - 1

    def covered(self, a: int, b: int) -> None:
        """A read touched chunks ``a..b``. Reads arrive out of order (the kernel's readahead
        requests are answered as they come), so what counts is which chunks were read, not
        the order: ``dense`` looks at the chunks just before the furthest read."""
        self.grew = self.end < 0 or (a <= self.end + 1 and b > self.end)
        self.touched.update(range(a, b + 1))
        self.end = max(self.end, b)
        if len(self.touched) > TOUCHED:
            self.touched = {p for p in self.touched if p > self.end - TOUCHED // 2}

    @property
    def dense(self) -> bool:
        """Whether the reader read every chunk (one may be missing: a request still on its
        way) of the ``DENSE_RUN`` up to its furthest: a whole dataset, not a hyperslab."""
        span = range(self.end - DENSE_RUN + 1, self.end + 1)
        return self.end >= DENSE_RUN - 1 and sum(p in self.touched for p in span) >= DENSE_RUN - 1

    def moved(self, i: int) -> bool:
        """The reader read chunk ``i`` (a position): True when it went on to another chunk
        and its reads follow a steady pattern (``lag``, ``period``). A pattern of several
        chunks is allowed for: the kernel's readahead reads the next chunk's first pages
        after each of h5py's reads, two datasets read in turns step in pairs."""
        address = self.addresses[i]
        if address in self.read[-1:]:
            return False
        self.read = [*self.read[-(3 * MAX_LAG - 1):], address]
        at = [bisect.bisect_left(self.addresses, a) for a in self.read]
        self.lag = self.period = 0
        for lag in range(1, MAX_LAG + 1):
            if len(at) < 3 * lag:
                break
            steps = {at[j] - at[j - lag] for j in range(len(at) - 2 * lag, len(at))}
            if len(steps) == 1 and (step := steps.pop()) > 0:
                self.lag, self.period = lag, step
                return True
        return False

    @property
    def strided(self) -> bool:
        """A steady pattern that skips chunks: the blob window would fetch them."""
        return self.period > self.lag > 0

    @property
    def holds_window(self) -> bool:
        """Whether the blob window holds still: the reader reads chunks, and not yet densely
        (a hyperslab that skips chunks must not get a window over the chunks it skips; a whole
        dataset gets it after a few chunks); or it walks a group's members (their headers
        come from the walk, and a window would fetch the data between them)."""
        return (self.in_chunk and not self.dense) or self.links.walking

    @property
    def runs_out(self) -> bool:
        """Whether a strided pattern's next ``LOOKAHEAD_CHUNKS`` steps pass the last chunk
        known: the next leaf is needed to go on."""
        if not self.strided or not self.read:
            return False
        last = bisect.bisect_left(self.addresses, self.read[-1])
        return last + LOOKAHEAD_CHUNKS * self.period >= len(self.addresses)

    def ahead(self) -> list[tuple[int, int]]:
        """(address, size) of the chunks the pattern reads next, nearest first."""
        last = [bisect.bisect_left(self.addresses, a) for a in self.read[-self.lag:]]

        def nearest_first() -> Iterator[tuple[int, int]]:
            for k in range(1, LOOKAHEAD_CHUNKS + 1):
                for j in sorted(p + k * self.period for p in last):
                    if j >= len(self.addresses):
                        return
                    yield self.addresses[j], self.sizes[j]

        return within(itertools.islice(nearest_first(), LOOKAHEAD_CHUNKS))


def edges(start: int, data: bytes | memoryview) -> list[tuple[int, bytes | memoryview]]:
    """What of a read is scanned for index nodes: all of it, or of a read over
    ``LARGE_READ`` (a reader's own read of data: h5py reads a node on its own, the kernel's
    pages around it stay under that) its first and last ``EDGE`` bytes."""
    if len(data) <= LARGE_READ:
        return [(start, data)]
    view = memoryview(data)
    return [(start, view[:EDGE]), (start + len(data) - EDGE, view[-EDGE:])]


def within(chunks: Iterable[tuple[int, int]], limit: int = LOOKAHEAD_BYTES
           ) -> list[tuple[int, int]]:
    """The first of ``chunks`` (address, size) whose sizes add up to ``limit`` at most, the
    first one whatever its size (a chunk's size is the file's word: up to 4 GiB each)."""
    out: list[tuple[int, int]] = []
    total = 0
    for address, size in chunks:
        total += size
        if total > limit and out:
            break
        out.append((address, size))
    return out


class Hdf5Lookahead:
    def __init__(self, start: Starter, stats: Stats, peek: Peek | None = None) -> None:
        self.start = start  # the prefetcher's: fault these blobs of a tag in the background
        self.peek = peek  # ... and what memory holds of a tag's view bytes
        self.stats = stats
        self.maps: OrderedDict[int, ChunkMap] = OrderedDict()

    def holds_window(self, tag: Tag) -> bool:
        """Whether the blob window holds still for ``tag``'s reader (``ChunkMap``)."""
        m = self.maps.get(tag.id)
        return m is not None and m.holds_window

    def served(self, tag: Tag, off: int, data: bytes | memoryview) -> None:
        """View bytes ``[off, off+len(data))`` of ``tag`` were served to a reader."""
        m = self.maps.get(tag.id)
        if m is None:
            if off != 0 or not addresses_fit(bytes(data[:16])):
                return
            m = self.maps[tag.id] = ChunkMap()
            while len(self.maps) > MAX_TAGS:
                self.maps.popitem(last=False)
            self.stats.add("hdf5_files")
        else:
            self.maps.move_to_end(tag.id)
        start, scanned = m.joined(off, data)
        budget, nodes, groups = Budget(), list[ChunkNode](), list[GroupNode]()
        # bytes made to cost a scan its budget are scanned no more, nor a read inside the
        # chunks known (compressed data: no node nor link there; most of a dataset's reads)
        inside = m.inside_chunks(start, start + len(scanned))
        if m.spent < SCANS_SPENT and not inside:
            for at, piece in edges(start, scanned):
                nodes += chunk_nodes(piece, at, tag.layout.size, skip=m.nodes, budget=budget,
                                     groups=groups, groups_known=m.groups.nodes)
            m.spent += budget.spent
        for group in groups:
            m.groups.add(group)
        if m.groups.read(off, off + len(data)):  # listing a group: its next members' nodes
            self._list_ahead(tag, m)
        if m.spent < SCANS_SPENT and not inside and (ranges := m.links.served(
                scanned, start, off, off + len(data), tag.layout.size)):
            self.stats.add("hdf5_links_ahead", self._fetch(tag, ranges))  # opening them
        grown = False
        for node in nodes:
            self.stats.add("hdf5_index_nodes")
            m.node_read(node.address)
            if node.level == 0:
                grown = m.add(node.chunks) or grown
            else:  # the leaves below: h5py reads them as it goes on
                m.named(node.children)
                self._fetch(tag, [(child, 1) for child in node.children])
        if grown and m.strided:  # the pattern goes on into the chunks of a leaf just read
            self.stats.add("hdf5_lookaheads", self._fetch(tag, m.ahead()))
        if len(data) <= SMALL_READ and m.node_in(off, off + len(data)):
            return  # a read of the index (met before or now), not of a chunk; a large read
            # over a node between chunks (the kernel's readahead) is of the chunks around it
        # a chunk read starts at the page before the chunk's first byte: placed by its middle
        margin = min(len(data) // 4, PAGE)  # and ends at the page after its last byte
        a, b = m.chunks_in(off + margin, off + len(data) - margin)
        m.in_chunk = a <= b
        if not m.in_chunk:
            return
        m.covered(a, b)
        if m.moved(a) and m.strided:
            self._leaves_ahead(tag, m)
            ahead = m.ahead()
        elif m.holds_window and m.grew:  # it may read every chunk: the next ones
            ahead = within(zip(m.addresses[b + 1:b + 1 + NEXT_CHUNKS],
                               m.sizes[b + 1:b + 1 + NEXT_CHUNKS], strict=True))
        else:
            return
        self.stats.add("hdf5_lookaheads", self._fetch(tag, ahead))

    def _leaves_ahead(self, tag: Tag, m: ChunkMap) -> None:
        """Read the next leaves from memory while the reader's pattern runs past the chunks
        known, ``LEAF_TRIES`` queued leaves at most. A leaf whose bytes are not all in memory
        is passed over for now (the next one may be) and its missing bytes are asked for,
        urgently, and again at the next looks while no start could be made; one found as short
        ``SHORT_LOOKS`` times (its bytes neither landed nor read back) is left to h5py's own
        read, as is one h5py read meanwhile. Short bytes are parsed once."""
        if self.peek is None:
            return
        size, i, tries = tag.layout.size, 0, 0
        while i < len(m.leaves) and tries < LEAF_TRIES and m.runs_out:
            address = m.leaves[i]
            if address in m.nodes:  # h5py read it meanwhile
                m.unqueue(i)
                continue
            tries += 1
            head = self.peek(tag, address, NODE_HEADER)
            whole = len(head) == min(NODE_HEADER, size - address)
            extent = node_extent(head)
            if whole and extent is None:
                m.unqueue(i)  # no node there after all
                continue
            want = min(LEAF_PEEK, size - address, extent or NODE_HEADER)
            data = self.peek(tag, address, want) if extent is not None else head
            seen = m.short.get(address)
            if seen is not None and seen[0] == len(data):
                seen[1] += 1  # as short as when it was looked at last
                if seen[1] > SHORT_LOOKS:
                    m.unqueue(i)
                else:
                    if not seen[2]:  # asked again while no start was made (no room): a
                        # fault that was made and failed is h5py's own read's to retry
                        seen[2] = int(self._fetch(tag, [(address, want)], urgent=True) > 0)
                    i += 1
                continue
            node = node_at(data, address, size) if extent is not None else None
            if node is None and len(data) < want:  # the rest is not here: fetch it
                started = self._fetch(tag, [(address, want)], urgent=True)
                m.short[address] = [len(data), 0, int(started > 0)]
                i += 1
                continue
            m.unqueue(i)
            if node is None:
                continue  # no node there after all
            m.node_read(address)
            self.stats.add("hdf5_leaves_ahead")
            if node.level == 0:
                m.add(node.chunks)
            else:  # h5py's read of it will be skipped: its children are fetched here
                m.named(node.children)
                self._fetch(tag, [(child, 1) for child in node.children])

    def _list_ahead(self, tag: Tag, m: ChunkMap) -> None:
        """Fetch the symbol table nodes ahead of a reader listing a group, and the leaves
        on the way that are not in memory (``grouplist.py``)."""
        snods, leaves = m.groups.ahead(lambda address: self._group_in_memory(tag, address))
        ranges = [(a, SNOD_BYTES) for a in snods] + [(a, NODE_HEADER) for a in leaves]
        self.stats.add("hdf5_listing_blobs", self._fetch(tag, ranges))

    def _group_in_memory(self, tag: Tag, address: int) -> GroupNode | None:
        """The group-index node at ``address`` if memory holds it whole (else its bytes
        are fetched)."""
        if self.peek is None:
            return None
        extent = group_extent(self.peek(tag, address, NODE_HEADER))
        if extent is None:
            return None
        want = min(extent, LEAF_PEEK, tag.layout.size - address)
        data = self.peek(tag, address, want)
        if len(data) < want:
            self._fetch(tag, [(address, want)], urgent=True)
            return None
        return group_node_at(data, address, tag.layout.size)

    def _fetch(self, tag: Tag, ranges: list[tuple[int, int]], urgent: bool = False) -> int:
        """Prefetch the blobs holding the byte ranges (address, size); how many started."""
        wanted: dict[int, int] = {}
        for address, size in ranges:
            for index, inner, _ in tag.layout.view_pieces(address, size):
                wanted[index] = min(inner, wanted.get(index, inner))
        return self.start(tag, sorted(wanted.items()), urgent) if wanted else 0
