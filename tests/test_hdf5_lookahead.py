"""HDF5 lookahead (hdf5/lookahead.py, core/hdf5.py): the chunk index read from the bytes h5py
is served, checked against h5py's own view of where each chunk lies; the reader's pattern
over chunks; and a real mount where a strided hyperslab fetches the chunks it reads, not the
gaps between them, while every value read stays exact."""

from __future__ import annotations

import io
import os
import random
import struct
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from faultfs.core.chunks import ChunkLayout
from faultfs.core.hdf5 import (
    MAX_CANDIDATES,
    MAX_KEYS,
    SIGNATURE,
    Budget,
    ChunkNode,
    addresses_fit,
    chunk_nodes,
    group_node_at,
)
from faultfs.hdf5.lookahead import SCANS_SPENT, ChunkMap, Hdf5Lookahead
from faultfs.stats import Stats

h5py = pytest.importorskip("h5py")
np = pytest.importorskip("numpy")


def chunk_info(path: str, names: list[str]) -> list[tuple[int, int]]:
    """(address, stored size) of every chunk of the datasets, as HDF5 itself tells."""
    out = []
    with h5py.File(path, "r") as f:
        for name in names:
            ds = f[name].id
            for i in range(ds.get_num_chunks()):
                info = ds.get_chunk_info(i)
                out.append((info.byte_offset, info.size))
    return sorted(out)


def index_of(raw: bytes) -> tuple[list[tuple[int, int]], list]:
    nodes = chunk_nodes(raw, 0, len(raw))
    return sorted(c for n in nodes for c in n.chunks), [n for n in nodes if n.level > 0]


def test_the_chunk_index_found_in_the_bytes_is_hdf5s_own(tmp_path):
    path = str(tmp_path / "f.h5")
    with h5py.File(path, "w") as f:
        f.create_dataset("grid", data=np.arange(200 * 30 * 10, dtype=np.int32).reshape(200, 30, 10),
                         chunks=(5, 7, 10), compression="gzip")  # several leaves and a root
        f.create_dataset("line", data=np.arange(100_000.0), chunks=(1000,))
        f.create_dataset("g/small", data=np.ones((64, 64), np.float32), chunks=(16, 16),
                         compression="gzip", shuffle=True)
        f.create_dataset("plain", data=np.arange(1000))  # contiguous: no index
    raw = Path(path).read_bytes()
    assert addresses_fit(raw[:64])
    chunks, inner = index_of(raw)
    assert chunks == chunk_info(path, ["grid", "line", "g/small"])
    assert inner, "a dataset of more chunks than a leaf holds has a node above its leaves"
    leaves = {n.address for n in chunk_nodes(raw, 0, len(raw)) if n.level == 0}
    assert {c for n in inner for c in n.children} <= leaves


def one_leaf(tmp_path) -> tuple[bytes, ChunkNode]:
    """The bytes of a file of one dataset of 32 chunks, and its one index node."""
    path = str(tmp_path / "f.h5")
    with h5py.File(path, "w") as f:
        f.create_dataset("d", data=np.arange(4096.0), chunks=(128,))
    raw = Path(path).read_bytes()
    [node] = chunk_nodes(raw, 0, len(raw))
    return raw, node


def test_a_node_is_found_only_whole_and_in_the_file_it_claims(tmp_path):
    raw, node = one_leaf(tmp_path)
    at = node.address
    assert chunk_nodes(raw[:at + 100], 0, len(raw)) == [], "a node cut short is no node"
    assert chunk_nodes(raw, 0, node.children[-1]) == [], "chunks past the file's end: no node"
    # the same node read from its page: found at the same address
    page = at - at % 4096
    assert [n.address for n in chunk_nodes(raw[page:page + 8192], page, len(raw))] == [at]
    damaged = bytearray(raw)
    damaged[at + 24 + 8 + 8 * 1] = 7  # the first key's datatype offset, which is always 0
    assert chunk_nodes(bytes(damaged), 0, len(raw)) == []


def test_random_bytes_and_other_formats_give_no_index(tmp_path):
    rng = random.Random(7)
    noise = bytearray(rng.randbytes(1 << 20))
    for i in range(0, len(noise) - 8, 4099):  # many a signature in noise
        noise[i:i + 5] = b"TREE\x01"
    assert chunk_nodes(bytes(noise), 0, len(noise)) == []
    assert not addresses_fit(bytes(noise[:64]))
    assert not addresses_fit(SIGNATURE)  # too short to say
    path = str(tmp_path / "latest.h5")
    with h5py.File(path, "w", libver="latest") as f:  # chunks indexed by arrays, not TREE
        f.create_dataset("d", data=np.arange(100_000.0), chunks=(1000,), maxshape=(None,))
    raw = Path(path).read_bytes()
    assert chunk_nodes(raw, 0, len(raw)) == []


def test_bytes_made_of_nodes_cost_a_bounded_scan_and_nodes_read_before_are_skipped(tmp_path):
    raw, node = one_leaf(tmp_path)
    at, end = node.address, node.address + 24 + 33 * 24 + 32 * 8  # rank 1: 24-byte keys
    many = raw[at:end] * 1000  # a thousand copies of one valid node, back to back
    size = len(raw) + len(many)
    started = time.perf_counter()
    found = chunk_nodes(many, len(raw), size)
    assert len(found) == MAX_CANDIDATES and time.perf_counter() - started < 1.0
    assert chunk_nodes(raw, 0, len(raw), skip={at}) == []


def overlapping_nodes(size: int = 1 << 20, level: int = 1) -> bytes:
    """Bytes that make every candidate parse almost all of them: 64 ``TREE`` headers of
    thousands of entries each, every header also a valid rank-1 key of the ones before, then
    one long run of valid rank-1 keys and children."""
    out = bytearray()
    entries = (size - 32 * 64 - 4096) // 32
    for i in range(64):
        out += struct.pack("<Q4sBBHQQ", 1, b"TREE", 1, level, (entries + i) & 0xFFFF, 0,
                           4096 + i)
    j = 0
    while len(out) < size:
        out += struct.pack("<IIQQQ", 100, 0, (1 << 63) + j, 0, 4096 + j)
        j += 1
    return bytes(out[:size])


@pytest.mark.parametrize("level", [1, 0])
def test_bytes_of_overlapping_huge_nodes_cost_a_bounded_scan(level):
    """A read of bytes crafted so that each of the 64 candidates parses thousands of keys
    took 1-1.5 s of the serving thread (2 million children at level 1): a call now parses
    ``MAX_KEYS`` keys at most over every candidate and rank, and says its budget ran out."""
    data = overlapping_nodes(level=level)
    budget = Budget()
    started = time.perf_counter()
    found = chunk_nodes(data, 0, 1 << 40, budget=budget)
    assert time.perf_counter() - started < 0.25
    assert budget.spent and sum(len(n.children) for n in found) <= MAX_KEYS


def test_a_file_whose_reads_keep_spending_the_scan_is_scanned_no_more():
    """Reads of such bytes spend the scan's budget; after ``SCANS_SPENT`` of them the file's
    bytes are not scanned any more (each would cost the serving thread its budget again),
    and the prefetch its children asked for stays within the prefetcher's own bounds."""
    started: list[list[int]] = []
    stats = Stats()
    look = Hdf5Lookahead(lambda tag, wanted, urgent=False: started.append([i for i, _ in wanted]) or 0,
                         stats)
    layout = ChunkLayout(0, 1 << 40, 1 << 20)
    tag = SimpleNamespace(id=1, layout=layout)
    head = SIGNATURE + bytes([0, 0, 0, 0, 0, 8, 8]) + bytes(4096 - 15)
    look.served(tag, 0, head)
    data = overlapping_nodes()
    for i in range(SCANS_SPENT + 3):
        t = time.perf_counter()
        look.served(tag, (i + 1) << 20, data)
        if i >= SCANS_SPENT:
            assert time.perf_counter() - t < 0.05, "not scanned again"
    assert look.maps[1].spent == SCANS_SPENT


def test_a_node_served_in_two_reads_is_joined_in_either_order(tmp_path):
    raw, node = one_leaf(tmp_path)
    cut = node.address + 40  # inside the node
    for order in ((0, 1), (1, 0)):
        m = ChunkMap()
        parts = [(0, raw[:cut]), (cut, raw[cut:cut + 4096])]
        found = []
        for i in order:
            start, scanned = m.joined(*parts[i])
            found += chunk_nodes(scanned, start, len(raw))
        assert [n.address for n in found] == [node.address]


def pattern(reads: list[int | tuple[int, int]], n: int = 64) -> ChunkMap:
    """A map of ``n`` chunks of 500 bytes every 1000, after reads of the chunks given (a
    pair: a read over chunks a..b), as ``Hdf5Lookahead.served`` places them."""
    m = ChunkMap()
    m.add([(1000 * i, 500) for i in range(n)])
    for r in reads:
        first, last = r if isinstance(r, tuple) else (r, r)
        a, b = m.chunks_in(1000 * first + 10, 1000 * last + 400)
        assert (a, b) == (first, last)
        m.in_chunk = True
        m.covered(a, b)
        m.moved(a)
    return m


def test_a_readers_pattern_over_chunks():
    m = pattern([0, 4, 8, 12])
    assert (m.lag, m.period) == (1, 4) and m.strided and m.holds_window
    assert [a // 1000 for a, _ in m.ahead()][:3] == [16, 20, 24]
    m = pattern([0, 1, 4, 5, 8, 9])  # two chunks read each time, three skipped
    assert (m.lag, m.period) == (2, 4) and m.holds_window
    assert [a // 1000 for a, _ in m.ahead()][:4] == [12, 13, 16, 17]
    m = pattern([(0, 3), (3, 6), 7])  # a whole dataset, with the kernel's readahead
    assert not m.strided and m.grew and m.dense and not m.holds_window
    m = pattern([(0, 1), (4, 5), (2, 3), 6, 7])  # readahead requests answered out of order
    assert m.dense and not m.holds_window
    m = pattern([0, 1, 3, 4, 5, 6, 7])  # one chunk not (yet) read of the last 8: dense
    assert m.dense
    m = pattern([(0, 4), 8])  # the readahead after the first chunk, then a hyperslab's
    assert not m.grew and not m.dense and m.holds_window
    m = pattern([0, 2, 4, 6, 8, 10, 12, 14])  # every other chunk: not dense
    assert not m.dense and m.strided and m.holds_window
    m = pattern([10, 3, 40, 7])  # random: no pattern
    assert m.period == 0 and not m.strided and m.holds_window
    assert ChunkMap().chunks_in(0, 100) == (0, -1)
    m = pattern([])
    assert m.chunks_in(510, 990) == (1, 0), "between two chunks: none"


def gzip_chunks(tmp_path, chunks: int) -> bytes:
    """The bytes of a file of one dataset ``d`` of ``chunks`` gzip chunks of 16 × 64 floats
    (~3.7 KiB each stored)."""
    path = str(tmp_path / f"chunks{chunks}.h5")
    rng = np.random.default_rng(3)
    with h5py.File(path, "w") as f:
        f.create_dataset("d", data=rng.normal(size=(chunks * 16, 64)).astype(np.float32),
                         chunks=(16, 64), compression="gzip", compression_opts=1)
    return Path(path).read_bytes()


def many_leaves(tmp_path) -> tuple[bytes, list[ChunkNode], list[tuple[int, int]]]:
    """A file of one dataset of 320 chunks indexed by several leaves under a root: its bytes,
    its leaves in the order the root names them, and (address, size) of every chunk in the
    dataset's order."""
    raw = gzip_chunks(tmp_path, 320)
    nodes = chunk_nodes(raw, 0, len(raw))
    [root] = [n for n in nodes if n.level > 0]
    by_address = {n.address: n for n in nodes}
    leaves = [by_address[c] for c in root.children]
    return raw, leaves, [c for leaf in leaves for c in leaf.chunks]


class Memory:
    """What memory holds of a file's bytes, for ``Hdf5Lookahead``'s peek: everything, or
    nothing from ``held_below`` on."""

    def __init__(self, raw: bytes, held_below: int | None = None) -> None:
        self.raw, self.held_below, self.asked = raw, held_below, []

    def __call__(self, tag, off: int, size: int) -> bytes:
        self.asked.append(off)
        end = off + size if self.held_below is None else min(off + size, self.held_below)
        return self.raw[off:max(off, end)]


def strided_reader(raw: bytes, leaves: list[ChunkNode], chunks: list[tuple[int, int]],
                   peek, stop: int, urgent: list | None = None, room: bool = True
                   ) -> tuple[Hdf5Lookahead, list[int]]:
    """h5py's reads of every 4th chunk up to chunk ``stop`` through ``served``, its root
    and first leaf read before them (1 KiB blobs); the blob indices the lookahead asked for
    (and in ``urgent`` those of each urgent ask; without ``room`` none of those starts)."""
    started: list[int] = []

    def start(tag, wanted: list[tuple[int, int]], is_urgent: bool) -> int:
        started.extend(i for i, _ in wanted)
        if is_urgent and urgent is not None:
            urgent.append([i for i, _ in wanted])
        return len(wanted) if room or not is_urgent else 0

    look = Hdf5Lookahead(start, Stats(), peek)
    tag = SimpleNamespace(id=1, layout=ChunkLayout(0, len(raw), 1024))
    look.served(tag, 0, raw[:2048])
    root_at = min(a for a in range(len(raw)) if raw.startswith(b"TREE\x01\x01", a))
    look.served(tag, root_at, raw[root_at:root_at + 1024])
    first = leaves[0].address
    look.served(tag, first, raw[first:first + 4096])
    for address, size in chunks[:stop + 1:4]:
        look.served(tag, address, raw[address:address + size])
    return look, started


def test_a_strided_reader_gets_the_next_leafs_chunks_before_h5py_reads_that_leaf(tmp_path):
    """A hyperslab's pattern runs past the chunks of the leaf it reads: the next leaf is read
    from memory and the pattern's chunks in it are prefetched while the reader is still in
    the leaf before, not only once h5py reads the next leaf (a wait at every leaf)."""
    raw, leaves, chunks = many_leaves(tmp_path)
    assert len(leaves) >= 3
    in_first = len(leaves[0].chunks)
    stop = (in_first - 1) // 4 * 4  # the last of the reader's chunks in the first leaf
    beyond = [i for i in range(stop + 4, len(chunks), 4) if i >= in_first][:2]
    blobs_of = {i: set(range(chunks[i][0] // 1024, (sum(chunks[i]) - 1) // 1024 + 1))
                for i in beyond}
    look, started = strided_reader(raw, leaves, chunks, Memory(raw), stop)
    for i in beyond:
        assert blobs_of[i] <= set(started), f"chunk {i} (the next leaf's) not prefetched"
    assert look.stats.counters["hdf5_leaves_ahead"] >= 1
    assert leaves[1].address in look.maps[1].nodes  # h5py's read of it is the index's now
    # without the leaf in memory (not landed yet), nothing is read ahead and it stays to read
    urgent: list[list[int]] = []
    look, started = strided_reader(raw, leaves, chunks, Memory(raw, leaves[1].address + 100),
                                   stop, urgent)
    assert not any(blobs_of[i] <= set(started) for i in beyond)
    assert look.stats.counters["hdf5_leaves_ahead"] == 0
    assert leaves[1].address not in look.maps[1].nodes  # left to h5py's own read ...
    missing = (leaves[1].address + 100) // 1024
    assert missing in started  # ... its missing bytes on their way, urgent (the prefetch's
    # reach full of chunks must not hold them back): asked for once when that started them
    assert sum(missing in blobs for blobs in urgent) == 1, urgent
    urgent = []  # and at the next looks again while no start could be made (no room)
    strided_reader(raw, leaves, chunks, Memory(raw, leaves[1].address + 100), stop, urgent,
                   room=False)
    assert sum(missing in blobs for blobs in urgent) >= 2, urgent
    # bytes there that are no node (a wrong address named) are passed over, at no cost
    bogus = bytearray(raw)
    bogus[leaves[1].address:leaves[1].address + 4] = b"XXXX"
    look, started = strided_reader(bytes(bogus), leaves, chunks, Memory(bytes(bogus)), stop)
    assert leaves[1].address not in look.maps[1].leaves
    assert look.stats.counters["hdf5_leaves_ahead"] >= 1  # the one after it was read


def measured(src: str, rows: int, columns: int, chunk_rows: int, seed: int) -> np.ndarray:
    """An HDF5 file at ``src`` of one dataset ``data`` of values with a few significant
    digits (as measured data), chunked by ``chunk_rows`` rows, gzip and shuffle; its values."""
    rng = np.random.default_rng(seed)
    data = np.round(rng.normal(size=(rows, columns)), 2).astype(np.float32)
    with h5py.File(src, "w") as f:
        f.create_dataset("data", data=data, chunks=(chunk_rows, columns), compression="gzip",
                         compression_opts=1, shuffle=True)
    return data


def test_a_strided_hyperslab_through_a_mount_fetches_its_chunks_not_the_gaps(mounter, tmp_path):
    src = str(tmp_path / "field.h5")
    data = measured(src, 64 * 48, 2048, 64, seed=42)
    size = os.path.getsize(src)
    m = mounter(src, args=["--chunk-size", "128K"])
    view = os.path.join(m.tag("field"), "field.h5")
    with h5py.File(view, "r") as f:
        assert np.array_equal(f["data"][::256], data[::256])  # one row of every 4th chunk
    c = m.counters()
    seen = {k: c.get(k) for k in ("hdf5_index_nodes", "hdf5_lookaheads", "hdf5_errors", "reads",
                                  "fast_reads", "prefetch_started", "source_bytes")}
    assert c["hdf5_index_nodes"] >= 1 and c["hdf5_lookaheads"] > 0, seen
    assert c["source_bytes"] < 0.6 * size, (
        f"{c['source_bytes']} of {size} bytes fetched for a quarter of the chunks")
    with h5py.File(view, "r") as f:  # the rest of the file, and the whole dataset, exact
        assert np.array_equal(f["data"][...], data)
    assert m.counters()["hdf5_errors"] == 0


def test_a_hyperslab_over_many_leaves_through_a_mount_reads_the_leaves_ahead(mounter, tmp_path):
    """A strided read over a dataset indexed by several leaves: the daemon reads each next
    leaf from its memory before h5py does (the counter says so), and every value is exact,
    on the mount's view and after a write to the file through it."""
    src = str(tmp_path / "many.h5")
    data = measured(src, 16 * 400, 256, 16, seed=5)
    m = mounter(src, args=["--chunk-size", "64K"])
    view = os.path.join(m.tag("many"), "many.h5")
    with h5py.File(view, "r") as f:
        assert np.array_equal(f["data"][::64], data[::64])  # one row of every 4th chunk
    c = m.counters()
    assert c["hdf5_leaves_ahead"] >= 1 and c["hdf5_errors"] == 0, {
        k: c.get(k) for k in ("hdf5_index_nodes", "hdf5_leaves_ahead", "hdf5_lookaheads")}
    with h5py.File(view, "r+") as f:  # the view written: its chunks move, the index too
        f["data"][::64] = -data[::64]
    with h5py.File(view, "r") as f:
        assert np.array_equal(f["data"][::64], -data[::64])
        assert np.array_equal(f["data"][1::64], data[1::64])
    assert m.counters()["hdf5_errors"] == 0


def test_leaves_memory_dropped_are_read_back_from_the_store_ahead_of_the_reader(mounter,
                                                                              tmp_path):
    """A dataset larger than the memory budget: the leaves the root named were fetched at
    its read and dropped from memory by the chunks read since; they are read back from the
    store ahead of the reader, so its pattern runs on into the next leaves (before, the
    lookahead found the leaves after the first few missing from memory and left each to
    h5py's own read: a round trip at every leaf of a large dataset, and none read back). A
    local source serves this reader about as fast as the store, so how many leaves it reads
    before the lookahead does is the machine's timing: most, not all, are asked of it."""
    src = str(tmp_path / "big.h5")
    data = measured(src, 16 * 1600, 256, 16, seed=9)
    with open(src, "rb") as f:
        raw = f.read()
    [root] = [n for n in chunk_nodes(raw, 0, len(raw)) if n.level > 0]
    leaves = len(root.children)
    assert leaves >= 12
    m = mounter(src, args=["--chunk-size", "64K", "--memory-mb", "2"])
    view = os.path.join(m.tag("big"), "big.h5")
    with h5py.File(view, "r") as f:
        assert np.array_equal(f["data"][::64], data[::64])  # one row of every 4th chunk
    c = m.counters()
    seen = {k: c.get(k) for k in ("hdf5_leaves_ahead", "store_readahead", "hdf5_errors",
                                  "hdf5_lookaheads")}
    assert c["hdf5_errors"] == 0 and c["store_readahead"] >= 1, seen
    assert c["hdf5_leaves_ahead"] >= leaves // 2, (leaves, seen)


class Traced(io.RawIOBase):
    """A file's bytes as h5py's file object, keeping the reads it makes, in order."""

    def __init__(self, raw: bytes) -> None:
        self.raw, self.pos, self.reads = raw, 0, []

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, off: int, whence: int = 0) -> int:
        self.pos = off if whence == 0 else self.pos + off if whence == 1 else len(self.raw) + off
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b) -> int:
        n = min(len(b), len(self.raw) - self.pos)
        b[:n] = self.raw[self.pos:self.pos + n]
        self.reads.append((self.pos, n))
        self.pos += n
        return n


class Held:
    """Memory in a replay: a blob is held once a read served it or the lookahead started it
    (it lands at once)."""

    def __init__(self, raw: bytes, blob: int) -> None:
        self.raw, self.blob, self.memory = raw, blob, set()

    def blobs(self, off: int, size: int) -> range:
        return range(off // self.blob, (off + max(size, 1) - 1) // self.blob + 1)

    def start(self, tag, wanted: list[tuple[int, int]], urgent: bool = False) -> int:
        new = [i for i, _ in wanted if i not in self.memory]
        self.memory.update(new)
        return len(new)

    def peek(self, tag, off: int, size: int) -> bytes:
        end, pos = min(off + size, len(self.raw)), off
        while pos < end and pos // self.blob in self.memory:
            pos = (pos // self.blob + 1) * self.blob
        return self.raw[off:min(pos, end)]


def replayed(raw: bytes, select, blob: int, peek: bool = True):
    """h5py's own reads of ``select`` replayed through the lookahead, with memory holding a
    blob once a read served it or the lookahead started it (it lands at once); for each
    index node h5py read, whether its blob was in memory before, and whether the lookahead
    had read that node from memory before h5py did."""
    traced = Traced(raw)
    with h5py.File(traced, "r") as f:
        select(f)
    held = Held(raw, blob)
    look = Hdf5Lookahead(held.start, Stats(), held.peek if peek else None)
    tag = SimpleNamespace(id=1, layout=ChunkLayout(0, len(raw), blob))
    nodes = {n.address for n in chunk_nodes(raw, 0, len(raw), limit=1 << 20,
                                            budget=Budget(1 << 30))}
    found = []
    for off, size in traced.reads:
        if off in nodes:
            m = look.maps.get(1)
            found.append((all(b in held.memory for b in held.blobs(off, size)),
                          m is not None and off in m.nodes))
        held.memory.update(held.blobs(off, size))
        look.served(tag, off, raw[off:off + size])
    return found


def test_leaves_under_an_inner_node_read_from_memory_are_still_prefetched(tmp_path):
    """A three-level index: an inner node the lookahead read from memory is skipped when
    h5py reads it, so its leaves must be fetched when it is read from memory (they were
    not: 31 of 106 leaf reads waited, against 2 without the leaves read ahead)."""
    path = str(tmp_path / "deep.h5")
    with h5py.File(path, "w") as f:
        f.create_dataset("d", data=np.arange(6000 * 1024, dtype=np.float32), chunks=(1024,))
    raw = Path(path).read_bytes()
    strided = lambda f: f["d"][::4 * 1024]  # noqa: E731 (every 4th chunk)
    before = sum(not ready for ready, _ in replayed(raw, strided, 64 << 10, peek=False))
    found = replayed(raw, strided, 64 << 10)
    assert any(ahead for _, ahead in found), "no node read from memory"
    assert sum(not ready for ready, _ in found) <= before


def test_a_leaf_across_two_blobs_is_read_ahead_and_an_unread_one_blocks_no_other(tmp_path):
    """Small blobs: some leaves straddle two. Their second blob is fetched so that they are
    read from memory too; and a hyperslab starting past the first leaves (which h5py never
    reads, and which straddle or are not whole) still gets the leaves after them read ahead
    (the queue stopped for good at the first one short of its bytes)."""
    raw = gzip_chunks(tmp_path, 2000)
    for start in (0, 16 * 700):
        leaves = [ahead for _, ahead in replayed(raw, lambda f, s=start: f["d"][s::64], 16384)]
        assert sum(leaves) >= 0.8 * len(leaves), (start, sum(leaves), len(leaves))


def test_a_node_naming_thousands_of_leaves_costs_a_read_little():
    """Crafted nodes above the leaves naming 4,000 leaves each, one per 128 KiB read: each
    read's queueing of them costs the serving thread little (a list scan per child cost
    ~100 ms a read), and the queue stays bounded."""
    read = 128 << 10
    undefined = (1 << 64) - 1

    def node(first_child: int, entries: int) -> bytes:
        out = [b"TREE", bytes([1, 1]), struct.pack("<HQQ", entries, undefined, undefined)]
        for i in range(entries + 1):
            out.append(struct.pack("<II2Q", 100, 0, i, 0))
            if i < entries:
                out.append(struct.pack("<Q", first_child + 8 * i))
        return b"".join(out)

    reads = 12
    head = SIGNATURE + bytes([0, 0, 0, 0, 0, 8, 8, 0])
    raw = bytearray(head + bytes(read - len(head)))
    for r in range(1, reads + 1):
        one = node(read * reads + 1 + 8 * 4000 * r, 4000)
        raw += one + bytes(read - len(one))
    raw += bytes(8 * 4000 * (reads + 2))
    look = Hdf5Lookahead(lambda tag, indices, urgent=False: 0, Stats())
    tag = SimpleNamespace(id=1, layout=ChunkLayout(0, len(raw), 1 << 20))
    look.served(tag, 0, bytes(raw[:read]))
    started = time.perf_counter()
    for r in range(1, reads + 1):
        look.served(tag, r * read, bytes(raw[r * read:(r + 1) * read]))
    assert (time.perf_counter() - started) / reads < 0.03
    m = look.maps[1]
    assert len(m.leaves) == len(m.queued) <= 4096


def test_a_leaf_short_in_memory_is_parsed_once_for_each_length(tmp_path, monkeypatch):
    """Memory holds bytes at the next leaf's address that look like a node's start and end
    short of the node: they are parsed once, not again at every strided read."""
    from faultfs.hdf5 import lookahead

    raw, leaves, chunks = many_leaves(tmp_path)
    target = leaves[1].address
    held = raw[target:target + 100]  # its first bytes, the rest not in memory

    def peek(tag, off: int, size: int) -> bytes:
        return held[:size] if off == target else raw[off:off + size]

    parsed = []
    real = lookahead.node_at
    monkeypatch.setattr(lookahead, "node_at",
                        lambda data, base, size: parsed.append(base) or real(data, base, size))
    look = Hdf5Lookahead(lambda tag, indices, urgent=False: len(indices), Stats(), peek)
    tag = SimpleNamespace(id=1, layout=ChunkLayout(0, len(raw), 1024))
    look.served(tag, 0, raw[:2048])
    root_at = min(a for a in range(len(raw)) if raw.startswith(b"TREE\x01\x01", a))
    look.served(tag, root_at, raw[root_at:root_at + 1024])
    look.served(tag, leaves[0].address, raw[leaves[0].address:leaves[0].address + 4096])
    for address, size in chunks[:len(leaves[0].chunks):4]:
        look.served(tag, address, raw[address:address + size])
    assert parsed.count(target) <= 1


def members_file(tmp_path, n: int = 400, kib: int = 256) -> tuple[bytes, list]:
    """A file of ``n`` datasets of ``kib`` KiB each in its root group (h5py's default
    groups: a B-tree of type 0 over symbol table nodes), and its group-index nodes."""
    path = str(tmp_path / "members.h5")
    rng = np.random.default_rng(1)
    with h5py.File(path, "w") as f:
        for i in range(n):
            f.create_dataset(f"d{i:05d}", data=rng.normal(size=(kib * 256,)).astype(np.float32))
    raw = Path(path).read_bytes()
    groups: list = []
    chunk_nodes(raw, 0, len(raw), limit=1 << 20, budget=Budget(1 << 30), groups=groups)
    return raw, groups


def listing_replayed(raw: bytes, select, blob: int = 1 << 20, snods: set[int] | None = None):
    """h5py's reads of ``select`` replayed through the lookahead (memory holds a blob once
    served or started); for each symbol table node h5py read (of ``snods``: all), whether
    its blob was in memory before; and the lookahead's counters."""
    if snods is None:
        snods = {c for g in members_nodes(raw) if g.level == 0 for c in g.children}
    traced = Traced(raw)
    with h5py.File(traced, "r") as f:
        select(f)
    held = Held(raw, blob)
    look = Hdf5Lookahead(held.start, Stats(), held.peek)
    tag = SimpleNamespace(id=1, layout=ChunkLayout(0, len(raw), blob))
    ready = []
    for off, size in traced.reads:
        # the kernel reads a page at least, and serves the page holding a small read
        first, last = off // 4096 * 4096, -(-(off + size) // 4096) * 4096
        if off in snods:
            ready.append(all(b in held.memory for b in held.blobs(first, last - first)))
        held.memory.update(held.blobs(first, last - first))
        look.served(tag, first, raw[first:last])
    return ready, look.stats.counters


def members_nodes(raw: bytes) -> list:
    groups: list = []
    chunk_nodes(raw, 0, len(raw), limit=1 << 20, budget=Budget(1 << 30), groups=groups)
    return groups


def test_the_group_index_found_in_the_bytes_is_the_groups_own(tmp_path):
    raw, groups = members_file(tmp_path, n=300, kib=4)
    leaves = [g for g in groups if g.level == 0]
    snods = [c for g in leaves for c in g.children]
    assert len(snods) >= 300 // 8 and all(raw[a:a + 5] == b"SNOD\x01" for a in snods)
    [root] = [g for g in groups if g.level > 0]
    assert set(root.children) == {g.address for g in leaves}
    # the leaves chain in the root's order
    chain = [root.children[0]]
    by = {g.address: g for g in leaves}
    while by[chain[-1]].right != (1 << 64) - 1:
        chain.append(by[chain[-1]].right)
    assert chain == list(root.children)
    # not a node: children outside the file, repeated, or the node itself
    at = leaves[0].address
    for bad in (len(raw) + 1, leaves[0].children[1], at):
        forged = bytearray(raw[at:at + 24 + 16 * len(leaves[0].children) + 8])
        struct.pack_into("<Q", forged, 24 + 8, bad)
        assert group_node_at(bytes(forged), at, len(raw)) is None


def test_a_reader_listing_a_group_gets_its_next_symbol_table_nodes_fetched(tmp_path):
    """h5py listing a group of 400 datasets of 256 KiB (its symbol table nodes a MiB apart
    or more): after the first two, the ones it reads next are on their way — the leaves
    after its own read from memory as they land — where before each was a round trip."""
    raw, _ = members_file(tmp_path)
    ready, counters = listing_replayed(raw, lambda f: sorted(f))
    assert len(ready) >= 40
    assert sum(ready[4:]) >= 0.9 * len(ready[4:]), ready
    assert counters["hdf5_listing_blobs"] >= 30


def test_a_lookup_by_name_and_a_reader_of_the_whole_file_fetch_no_listing(tmp_path):
    """Opening members by name reads one symbol table node per leaf it passes through, and
    a reader going through the file passes them all one after the other (some side by
    side): neither is listing, and nothing is fetched for a listing."""
    raw, _ = members_file(tmp_path)
    _, counters = listing_replayed(raw, lambda f: [f[n][...] for n in ("d00007", "d00123",
                                                                         "d00201", "d00399")])
    assert counters["hdf5_listing_blobs"] == 0
    for size in (1 << 20, 128 << 10, 4096):
        look = Hdf5Lookahead(lambda tag, indices, urgent=False: len(indices), Stats(),
                             lambda tag, off, n: raw[off:off + n])
        tag = SimpleNamespace(id=1, layout=ChunkLayout(0, len(raw), 1 << 20))
        for at in range(0, len(raw), size):
            look.served(tag, at, raw[at:at + size])
        assert look.stats.counters["hdf5_listing_blobs"] == 0, size


def test_a_listing_through_a_mount_fetches_ahead_and_lists_every_member(mounter, tmp_path):
    src = str(tmp_path / "members.h5")
    rng = np.random.default_rng(2)
    names = [f"m{i:04d}" for i in range(300)]
    with h5py.File(src, "w") as f:
        for name in names:
            f.create_dataset(name, data=rng.normal(size=(64 * 256,)).astype(np.float32))
    m = mounter(src, args=["--chunk-size", "64K"])
    view = os.path.join(m.tag("members"), "members.h5")
    with h5py.File(view, "r") as f:
        assert sorted(f) == names
        with h5py.File(src, "r") as g:
            assert np.array_equal(f["m0123"][...], g["m0123"][...])
    c = m.counters()
    assert c["hdf5_listing_blobs"] > 0 and c["hdf5_errors"] == 0, c


def served_in_order(raw: bytes, reads: list[tuple[int, int]]) -> dict:
    """Reads served as given (no h5py), memory holding everything: the counters."""
    look = Hdf5Lookahead(lambda tag, indices, urgent=False: len(indices), Stats(),
                         lambda tag, off, n: raw[off:off + n])
    tag = SimpleNamespace(id=1, layout=ChunkLayout(0, len(raw), 64 << 10))
    for off, size in [(0, 4096), *reads]:
        look.served(tag, off, raw[off:off + size])
    return look.stats.counters


def test_readers_that_are_not_listing_fetch_nothing_for_a_listing(tmp_path):
    """A read holding several of a leaf's symbol table nodes side by side is one move, not
    a listing; a random reader of 64 KiB blocks; a reader going through the file whose
    reads arrive out of order (the kernel's readahead answered in reverse pairs)."""
    path = str(tmp_path / "small.h5")
    rng = np.random.default_rng(1)
    with h5py.File(path, "w") as f:
        for i in range(3000):  # 4 KiB members: symbol table nodes close together
            f.create_dataset(f"d{i:05d}", data=rng.normal(size=(1024,)).astype(np.float32))
    raw = Path(path).read_bytes()
    leaves = [g for g in members_nodes(raw) if g.level == 0]
    leaf = next(g for g in leaves if len(g.children) > 8)
    at = leaf.children[3] // 4096 * 4096
    assert served_in_order(raw, [(leaf.address // 4096 * 4096, 8192),
                                 (at, 64 << 10)])["hdf5_listing_blobs"] == 0
    blocks = len(raw) // (64 << 10)
    for seed in range(3):
        picked = random.Random(seed).sample(range(1, blocks), blocks // 10)
        reads = [(i * (64 << 10), 64 << 10) for i in picked]
        assert served_in_order(raw, reads)["hdf5_listing_blobs"] == 0, seed
    for size in (4096, 32 << 10, 128 << 10):
        order = list(range(-(-len(raw) // size)))
        for i in range(0, len(order) - 1, 2):
            order[i], order[i + 1] = order[i + 1], order[i]
        reads = [(i * size, size) for i in order]
        assert served_in_order(raw, reads)["hdf5_listing_blobs"] == 0, size


def test_a_visit_over_member_groups_is_a_listing_of_the_root(tmp_path):
    """``visit`` reads each member group's own symbol table node between two of the root's:
    the root's listing goes on (several walks at once) and its next nodes are fetched."""
    path = str(tmp_path / "groups.h5")
    rng = np.random.default_rng(1)
    with h5py.File(path, "w") as f:
        for i in range(400):
            f.create_group(f"s{i:05d}").create_dataset(
                "x", data=rng.normal(size=(64 * 256,)).astype(np.float32))
    raw = Path(path).read_bytes()
    groups = members_nodes(raw)
    root = max(groups, key=lambda g: g.level)
    leaves = {g.address: g for g in groups if g.level == 0}
    snods = {c for leaf in root.children for c in leaves[leaf].children}
    for select in (lambda f: sorted(f), lambda f: f.visit(lambda name: None)):
        ready, _ = listing_replayed(raw, select, 64 << 10, snods)
        assert sum(ready) >= 0.8 * len(ready), (sum(ready), len(ready))


def test_many_groups_before_a_chunk_index_leave_it_found(tmp_path):
    """A read (the kernel's readahead) over a hundred small groups' index nodes and then a
    dataset's chunk index: each kind of node has its own bound on the places examined."""
    path = str(tmp_path / "both.h5")
    with h5py.File(path, "w") as f:
        for i in range(100):
            f.create_group(f"g{i:03d}")["a"] = 1
        f.create_dataset("ds", data=np.arange(1 << 20, dtype=np.float32), chunks=(1024,))
    raw = Path(path).read_bytes()
    first = min(n.address for n in chunk_nodes(raw, 0, len(raw), limit=1 << 20,
                                                budget=Budget(1 << 30)))
    off = (first + 8192) // 4096 * 4096 - (128 << 10)
    look = Hdf5Lookahead(lambda tag, indices, urgent=False: len(indices), Stats())
    tag = SimpleNamespace(id=1, layout=ChunkLayout(0, len(raw), 1 << 16))
    look.served(tag, 0, raw[:4096])
    look.served(tag, off, raw[off:off + (128 << 10)])
    assert first in look.maps[1].nodes


def test_crafted_group_nodes_keep_a_files_state_bounded():
    """Nodes above group leaves naming 4,000 children each, two a read: what a file keeps of
    them (nodes, their children, the order between them) stops at ``MAX_SNODS`` children."""
    from faultfs.core.hdf5 import UNDEFINED
    from faultfs.hdf5.grouplist import MAX_SNODS

    def node(first_child: int) -> bytes:
        head = struct.pack("<4sBBHQQ", b"TREE", 0, 1, 4000, UNDEFINED, UNDEFINED)
        return head + b"".join(struct.pack("<QQ", k, first_child + k)
                               for k in range(4000)) + struct.pack("<Q", 4000)

    look = Hdf5Lookahead(lambda tag, indices, urgent=False: len(indices), Stats())
    tag = SimpleNamespace(id=1, layout=ChunkLayout(0, 1 << 40, 1 << 20))
    look.served(tag, 0, SIGNATURE + bytes([0, 0, 0, 0, 0, 8, 8, 0]) + bytes(4096 - 16))
    for r in range(1, 64):
        a, b = node((2 * r) << 20), node((2 * r + 1) << 20)
        look.served(tag, r << 17, (a + b).ljust(128 << 10, b"\0"))
    g = look.maps[1].groups
    assert g.kept <= MAX_SNODS and len(g.after) <= MAX_SNODS


def test_reads_inside_known_chunks_are_not_scanned(tmp_path, monkeypatch):
    """A reader of a whole dataset reads its index first, then chunk after chunk: once the
    chunks are known, a read inside them (compressed data: no node there) costs no scan."""
    from faultfs.hdf5 import lookahead

    raw, leaves, chunks = many_leaves(tmp_path)
    scanned = []
    real = lookahead.chunk_nodes
    monkeypatch.setattr(lookahead, "chunk_nodes",
                        lambda data, base, *a, **k: scanned.append(base) or real(data, base, *a,
                                                                                 **k))
    look = Hdf5Lookahead(lambda tag, wanted, urgent=False: len(wanted), Stats())
    tag = SimpleNamespace(id=1, layout=ChunkLayout(0, len(raw), 1024))
    look.served(tag, 0, raw[:2048])
    root_at = min(a for a in range(len(raw)) if raw.startswith(b"TREE\x01\x01", a))
    look.served(tag, root_at, raw[root_at:root_at + 1024])
    for leaf in leaves:
        look.served(tag, leaf.address, raw[leaf.address:leaf.address + 8192])
    before = len(scanned)
    for address, size in chunks:
        look.served(tag, address, raw[address:address + size])
    assert len(scanned) == before  # every chunk read was inside the chunks known
    look.served(tag, root_at, raw[root_at:root_at + 1024])  # the index again: scanned
    assert len(scanned) == before + 1
