"""A reader opening a group's members one after another gets the next members' object headers
fetched (``core/hdf5links.py``, ``hdf5/linkwalk.py``): the links found in the bytes are the
group's own, in its order; xarray opening a NetCDF-4 file finds its headers in memory; a lookup
by name fetches no member; crafted bytes cost a bounded scan and state."""

from __future__ import annotations

import os
import random
import re
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest

from faultfs.core import hdf5links
from faultfs.core.chunks import ChunkLayout
from faultfs.core.hdf5index import MAX_ENTRIES, Node, Tree, tree_at
from faultfs.core.hdf5links import HEAP_BYTES, MAX_PLACES, Heap, link_places
from faultfs.hdf5.linkwalk import MAX_KEPT, WALKING_READS, LinkWalk
from faultfs.hdf5.lookahead import ChunkMap, Hdf5Lookahead
from faultfs.stats import Stats
from tests.test_hdf5_lookahead import Held, Traced

h5py = pytest.importorskip("h5py")
np = pytest.importorskip("numpy")
xr = pytest.importorskip("xarray")
pytest.importorskip("h5netcdf")

BLOB = 64 << 10


def netcdf(path: Path, n: int = 120, floats: int = 16 << 10) -> Path:
    """A NetCDF-4 file (h5netcdf: creation order tracked, links in a fractal heap) of ``n``
    variables of ``floats`` values each: their headers a variable's data apart."""
    rng = np.random.default_rng(3)
    ds = xr.Dataset({f"v{i:04d}": (("x",), rng.normal(size=floats).astype(np.float32))
                     for i in range(n)})
    ds.to_netcdf(path, engine="h5netcdf")
    return path


def headers(path: Path, group: str = "/") -> list[int]:
    """h5py's own addresses of the members' object headers, in its iteration order."""
    with h5py.File(path, "r") as f:
        g = f[group]
        return [h5py.h5o.get_info(g[name].id).addr for name in g]


def at(raw: bytes, signature: bytes) -> list[int]:
    return [m.start() for m in re.finditer(re.escape(signature), raw)]


def all_links(raw: bytes) -> tuple[dict[int, Heap], list[tuple[int | None, bytes, int]]]:
    """Every heap and link in a file's bytes, scanned in pieces as reads would be."""
    heaps: dict[int, Heap] = {}
    links: list[tuple[int | None, bytes, int]] = []
    step = 4096
    for at in range(0, len(raw), step):
        found = link_places(raw[at:at + 4 * step], at, len(raw), heaps)
        heaps.update((h.address, h) for h in found.heaps)
        for block, _, targets, whole in found.targets:
            if whole and block < at + step:
                links.extend(targets)
    return heaps, links


def test_the_links_found_in_the_bytes_are_the_groups_own(tmp_path):
    path = netcdf(tmp_path / "vars.nc")
    raw = path.read_bytes()
    heaps, links = all_links(raw)
    assert len(heaps) == 1
    ordered = [address for _, _, address in sorted(set(links), key=lambda t: t[0] or 0)]
    assert ordered == headers(path)  # creation order: "x" first, then every variable
    [heap] = heaps.values()
    assert heap.rows > 0  # its root is an indirect block, naming direct blocks

    def named(address: int) -> list[tuple[int, int]]:
        found = link_places(raw[address:address + 8192], address, len(raw), heaps, nodes)
        return [r for a, rs, _ in found.fetch if a == address for r in rs]

    trees: dict[int, Tree] = {}
    nodes: dict[int, Node] = {}
    for address in at(raw, b"BTHD"):
        tree = tree_at(raw, address, 0, len(raw))
        assert tree is not None
        trees[tree.root] = tree
        nodes[tree.root] = Node(tree, tree.depth, tree.root_records)
    # the chain an open reads, each link named by the one before: the group's header names
    # the heap and both B-trees, a B-tree its root, a root its leaves, the heap its root
    # block, that one the direct blocks
    assert {a for a, _ in named(96)} == {heap.address, *(t.address for t in trees.values())}
    assert sorted(a for t in trees.values() for a, _ in named(t.address)) == sorted(trees)
    assert sorted(a for root in trees for a, _ in named(root)) == sorted(at(raw, b"BTLF"))
    assert named(heap.address) == [(heap.root, heap.start)]
    assert sorted(a for a, _ in named(heap.root)) == sorted(at(raw, b"FHDB"))

    old = tmp_path / "old.h5"  # h5py's default groups: symbol table nodes
    with h5py.File(old, "w") as f:
        for i in range(40):
            f.create_dataset(f"d{i:03d}", data=np.arange(4096, dtype=np.float32))
    raw = old.read_bytes()
    found = link_places(raw, 0, len(raw), {})
    assert sorted(a for _, _, t, _ in found.targets for _, _, a in t) == sorted(headers(old))


def replay(raw: bytes, read, blob: int = BLOB, started: set[int] | None = None):
    """h5py's reads of ``read(file object)`` replayed through the lookahead (pages, as the
    kernel asks; memory holds a blob once served or started, at once): for each read of
    pages holding a member's header, whether its blob was in memory before; the counters."""
    traced = Traced(raw)
    read(traced)
    firsts = set()
    with h5py.File(Traced(raw), "r") as f:
        firsts = {h5py.h5o.get_info(f[name].id).addr for name in f}
    held = Held(raw, blob)

    def start(tag, wanted: list[tuple[int, int]], urgent: bool = False) -> int:
        if started is not None:
            started.update(i for i, _ in wanted if i not in held.memory)
        return held.start(tag, wanted)

    look = Hdf5Lookahead(start, Stats(), held.peek)
    tag = SimpleNamespace(id=1, layout=ChunkLayout(0, len(raw), blob))
    ready, pages = [], set()
    for off, size in traced.reads:
        first, last = off // 4096 * 4096, -(-(off + size) // 4096) * 4096
        want = [p for p in range(first, last, 4096) if p not in pages]
        if not want:
            continue  # the kernel's page cache
        first, last = want[0], want[-1] + 4096
        pages.update(want)
        if any(first <= a < last for a in firsts):
            ready.append(all(b in held.memory for b in held.blobs(first, last - first)))
        held.memory.update(held.blobs(first, last - first))
        look.served(tag, first, raw[first:last])
    return ready, look.stats.counters, held


def opened_by_xarray(f) -> None:
    with xr.open_dataset(f, engine="h5netcdf") as ds:
        for name in ds.data_vars:
            ds[name].attrs  # noqa: B018 (what an open reads: every variable's header)


def test_xarray_opening_a_netcdf_file_finds_the_next_headers_in_memory(tmp_path, monkeypatch):
    raw = netcdf(tmp_path / "vars.nc").read_bytes()
    ready, counters, _ = replay(raw, opened_by_xarray)
    assert len(ready) > 30
    # the first dozen headers' pages start the walk; after them nearly all wait for nothing
    assert sum(ready[12:]) >= 0.9 * len(ready[12:]), ready
    assert counters["hdf5_links_ahead"] > 0
    monkeypatch.setattr(LinkWalk, "served", lambda *args: [])  # as before: no link walk
    alone, _, _ = replay(raw, opened_by_xarray)
    assert sum(alone[12:]) <= 0.2 * len(alone[12:]), alone


def test_a_lookup_by_name_and_a_random_reader_fetch_no_members(tmp_path):
    raw = netcdf(tmp_path / "vars.nc").read_bytes()
    started: set[int] = set()
    _, counters, _ = replay(raw, lambda f: h5py.File(f, "r")["v0042"][...], started=started)
    # what a lookup fetches ahead is the group's index (heap, B-trees, header chunks), no
    # member's header
    index = {a // BLOB for sig in (b"FRHP", b"FHIB", b"FHDB", b"BTHD", b"BTIN", b"BTLF",
                                   b"OCHK") for a in at(raw, sig)}
    assert started and started <= index, started - index

    names = [f"v{i:04d}" for i in range(120)]
    random.Random(4).shuffle(names)

    def random_reader(f) -> None:
        with h5py.File(f, "r") as h:
            for name in names[:30]:
                h[name].attrs.keys()

    _, counters, _ = replay(raw, random_reader)
    ahead = counters.get("hdf5_links_ahead", 0)
    assert ahead <= 40, ahead  # 30 headers opened at random: a chance walk at most


def test_crafted_bytes_cost_a_bounded_scan_and_state():
    rng = random.Random(5)
    noise = rng.randbytes(1 << 20)
    assert link_places(noise, 0, 1 << 40, {}).targets == []
    # a heap header whose fields disagree is no heap
    good = struct.pack("<4sBHHBI12QHQQHHQH", b"FRHP", 0, 7, 0, 2, 4096, *([0] * 12), 4, 512,
                       65536, 32, 1, 1 << 20, 2) + b"\0" * 4
    assert len(good) == HEAP_BYTES
    [heap] = link_places(good, 0, 1 << 30, {}).heaps
    assert heap.offset_bytes == 4 and heap.checksummed and heap.rows == 2
    for bad in (good[:7] + b"\x01" + good[8:],  # filters
                good[:132] + struct.pack("<Q", 1 << 50) + good[140:],  # root past the end
                good[:112] + struct.pack("<Q", 500) + good[120:]):  # not a power of two
        assert link_places(bad, 0, 1 << 30, {}).heaps == [], bad[:16]
    # a direct block of that heap: link messages until the first one that is not whole
    link = bytes([1, 0x0C, 0]) + struct.pack("<Q", 7) + bytes([2]) + b"ab" + struct.pack(
        "<Q", 4096)
    block = b"FHDB\0" + struct.pack("<Q", heap.address) + b"\0\0\0\0" + b"\0" * 4
    body = link * 5 + bytes([1, 0, 200]) + b"x" * 10
    found = link_places(block + body, 1 << 20, 1 << 30, {heap.address: heap})
    [(_, owner, targets, whole)] = found.targets
    assert owner == heap.address and targets == [(7, b"ab", 4096)] * 5 and not whole
    # ... of a heap not seen: passed over
    assert link_places(block + body, 1 << 20, 1 << 30, {}).targets == []
    # bytes made of thousands of blocks: MAX_PLACES examined
    spam = (block + link * 20) * 5000
    found = link_places(spam, 1 << 20, 1 << 40, {heap.address: heap})
    assert len(found.targets) <= MAX_PLACES
    # a file's state stays bounded whatever its blocks name
    walk = LinkWalk()
    walk.heaps[heap.address] = heap
    for i in range(200):
        many = b"".join(bytes([1, 0x0C, 0]) + struct.pack("<Q", i * 1000 + j) + bytes([1])
                        + b"n" + struct.pack("<Q", 8192 + 64 * (i * 1000 + j))
                        for j in range(1000))
        base = (1 << 30) + i * (1 << 20)
        walk.served(block + many, base, base, base + 4096, 1 << 40)
    assert len(walk.keys) <= MAX_KEPT and len(walk.header) <= MAX_KEPT


def test_xarray_through_a_mount_reads_every_variable_exactly(mounter, tmp_path):
    """The walk's prefetch through a real mount (a local source: the fetch itself is
    measured in the S3 proxy tests) leaves every value the file's own."""
    src = netcdf(tmp_path / "vars.nc", n=160, floats=64 << 10)
    m = mounter(str(src), args=["--chunk-size", "64K"])
    view = os.path.join(m.tag("vars"), "vars.nc")
    with xr.open_dataset(view, engine="h5netcdf") as got, xr.open_dataset(
            src, engine="h5netcdf") as want:
        assert sorted(got.data_vars) == sorted(want.data_vars)
        for name in ("v0000", "v0077", "v0159"):
            assert np.array_equal(got[name].values, want[name].values)
    c = m.counters()
    assert c["hdf5_errors"] == 0 and c["fault_errors"] == 0, c


def test_soft_links_and_utf8_names_cut_at_a_page_are_read_not_refused(tmp_path):
    """A symbol table node holding a soft link (no header) keeps its hard links; a link
    message cut right after its creation order (the read ends there) ends the block, never
    raises."""
    old = tmp_path / "soft.h5"
    with h5py.File(old, "w") as f:
        for i in range(64):
            f.create_dataset(f"d{i:03d}", data=np.arange(16))
        f["soft"] = h5py.SoftLink("/d000")
    raw = old.read_bytes()
    found = link_places(raw, 0, len(raw), {})
    got = {a for _, _, t, _ in found.targets for _, _, a in t}
    with h5py.File(old, "r") as f:
        want = {h5py.h5o.get_info(f[f"d{i:03d}"].id).addr for i in range(64)}
    assert got == want

    heap = struct.pack("<4sBHHBI12QHQQHHQH", b"FRHP", 0, 7, 0, 2, 4096, *([0] * 12), 4, 512,
                       65536, 32, 1, 1 << 20, 0) + b"\0" * 4
    [h] = link_places(heap, 0, 1 << 30, {}).heaps
    block = b"FHDB\0" + struct.pack("<Q", 0) + b"\0" * 8
    cut = bytes([1, 0x14]) + struct.pack("<Q", 7)  # creation order, then the read ends
    assert link_places(block + cut, 4096, 1 << 30, {0: h}).targets == []


def test_a_crafted_read_costs_little_and_names_little_to_fetch():
    """Soft links whose values hold block headers (each block parses the rest of the read):
    one budget of messages for the whole read. A heap whose blocks claim huge sizes is no
    heap; what is fetched for a structure is its first bytes."""
    start = 1 << 20
    heap = struct.pack("<4sBHHBI12QHQQHHQH", b"FRHP", 0, 7, 0, 0, 4096, *([0] * 12), 4,
                       start, start, 64, 1, 0x1000, 0) + b"\0" * 4

    def soft(value: bytes) -> bytes:
        return bytes([1, 0x08, 1, 1]) + b"a" + struct.pack("<H", len(value)) + value

    data = heap + soft(b"FHDB\x00" + struct.pack("<Q", 1 << 20) + bytes(8)) * 63
    data += soft(b"") * (((128 << 10) - len(data)) // 7)
    parsed = []  # (its first message, how many) of each run of link messages parsed
    real = hdf5links._links

    def counting(view, at, end, file_size, budget):
        left = budget.entries
        out = real(view, at, end, file_size, budget)
        parsed.append(left - budget.entries)
        return out

    hdf5links._links = counting
    try:
        link_places(data, 1 << 20, 1 << 30, {})
    finally:
        hdf5links._links = real
    # ~1.2 million messages before (every block parsed the rest of the read: 0.49 s)
    assert 0 < sum(parsed) <= MAX_ENTRIES

    huge = struct.pack("<4sBHHBI12QHQQHHQH", b"FRHP", 0, 7, 0, 0, 4096, *([0] * 12), 2,
                       1 << 36, 1 << 36, 64, 2, 0x1000, 2) + b"\0" * 4
    assert link_places(huge, 0, 1 << 40, {}).heaps == []
    found = link_places(heap, 0, 1 << 30, {})
    assert [(a, n) for _, rs, _ in found.fetch for a, n in rs] == [(0x1000, 64 << 10)]


def test_a_group_without_creation_order_is_walked_by_name(tmp_path):
    """``libver="latest"`` without ``track_order``: links in a heap without creation
    orders, created in shuffled order; h5py iterates by name, and so does the walk."""
    path = tmp_path / "latest.h5"
    names = list(range(200))
    random.Random(1).shuffle(names)
    rng = np.random.default_rng(6)
    with h5py.File(path, "w", libver="latest") as f:
        for i in names:
            f.create_dataset(f"v{i:04d}", data=rng.normal(size=16 << 10).astype(np.float32))
    raw = path.read_bytes()

    def iterate(f) -> None:
        with h5py.File(f, "r") as h:
            for name in h:
                h[name].attrs.keys()

    ready, counters, _ = replay(raw, iterate)
    assert counters["hdf5_links_ahead"] > 0
    assert sum(ready[12:]) >= 0.8 * len(ready[12:]), ready


def fixpoint(raw: bytes) -> tuple[set[int], LinkWalk]:
    """Every address the walk names to fetch when the whole file is served page by page,
    over and over until nothing new is named (h5py reads each structure after the one
    naming it; pages in file order would meet some before)."""
    walk, named = LinkWalk(), set()
    while True:
        before = len(named)
        for at in range(0, len(raw), 4096):  # each page with the next (``joined``)
            named.update(a for a, _ in walk.served(raw[at:at + 8192], at, at, at + 4096,
                                                   len(raw)))
        if len(named) == before:
            return named, walk


def test_deep_b_trees_and_continuation_chains_name_every_node_and_chunk(tmp_path):
    """2,000 links: version-2 B-trees of depth 2 (their root's children are internal
    nodes, whose pointers also count their subtrees); a NetCDF dimension used by 300
    variables: its header's continuation chunks chain."""
    path = tmp_path / "deep.h5"
    with h5py.File(path, "w", track_order=True) as f:
        for i in range(2000):
            f.create_dataset(f"member_with_a_longer_name_{i:05d}", data=[i])
    raw = path.read_bytes()
    named, _ = fixpoint(raw)
    assert 2 in {tree_at(raw, a, 0, len(raw)).depth for a in at(raw, b"BTHD")}
    assert set(at(raw, b"BTLF")) <= named and set(at(raw, b"BTIN")) <= named

    nc = tmp_path / "dims.nc"
    xr.Dataset({f"v{i:03d}": (("x",), np.zeros(4, np.float32)) for i in range(300)}
               ).to_netcdf(nc, engine="h5netcdf")
    raw = nc.read_bytes()
    named, _ = fixpoint(raw)
    assert at(raw, b"OCHK") and set(at(raw, b"OCHK")) <= named


def test_a_read_ending_inside_a_structures_first_bytes_never_raises(tmp_path):
    path = tmp_path / "latest.h5"
    with h5py.File(path, "w", libver="latest") as f:
        for i in range(200):
            f.create_dataset(f"a_dataset_with_a_thirty_byte_{i:03d}", data=[i])
    raw = path.read_bytes()
    heaps = {h.address: h for a in at(raw, b"FRHP")
             for h in link_places(raw[a:a + 512], a, len(raw), {}).heaps}
    for sig in (b"OHDR", b"BTIN", b"BTHD", b"FRHP", b"FHIB", b"FHDB", b"OCHK"):
        for a in at(raw, sig):
            for cut in range(4, 16):
                link_places(raw[max(0, a - 64):a + cut], max(0, a - 64), len(raw), heaps)
    # ... and through the lookahead, a page at a time ending anywhere
    look = Hdf5Lookahead(lambda tag, indices, urgent=False: len(indices), Stats())
    tag = SimpleNamespace(id=1, layout=ChunkLayout(0, len(raw), BLOB))
    for end in range(4096, len(raw), 997):
        look.served(tag, end - 4096, raw[end - 4096:end])


def test_links_whose_names_share_a_long_prefix_keep_their_own_places(tmp_path):
    path = tmp_path / "prefix.h5"
    prefix = "p" * 80
    with h5py.File(path, "w", libver="latest") as f:  # no creation order: keyed by name
        for i in range(40):
            f.create_dataset(f"{prefix}{i:03d}", data=[i])
    raw = path.read_bytes()
    _, walk = fixpoint(raw)
    assert len(walk.keys) == 40


def test_two_kept_reads_ending_at_one_offset_join_as_the_files_bytes():
    raw = bytes(range(256)) * 256
    m = ChunkMap()
    for off, size in ((4096, 4096), (6144, 2048), (8192, 4096)):
        m.joined(off, raw[off:off + size])
    start, out = m.joined(12288, raw[12288:16384])
    assert raw[start:start + len(out)] == out
    assert len(out) <= 3 * 4096


def test_a_walking_reader_holds_the_blob_window_until_it_reads_data(tmp_path):
    """While a reader walks a group's members, the blob window holds still (the walk
    fetches their headers; a window would fetch the data between them: 38 of 126 MB for
    an open through a mount in the demo, 6 without); once it reads data it has stopped."""
    raw = netcdf(tmp_path / "vars.nc").read_bytes()
    look = Hdf5Lookahead(lambda tag, wanted, urgent=False: len(wanted), Stats())
    tag = SimpleNamespace(id=1, layout=ChunkLayout(0, len(raw), BLOB))
    traced = Traced(raw)
    opened_by_xarray(traced)
    held = []
    for off, size in traced.reads:  # the open's reads, a page at least each
        first, last = off // 4096 * 4096, -(-(off + size) // 4096) * 4096
        look.served(tag, first, raw[first:last])
        held.append(look.holds_window(tag))
    assert sum(held) >= len(held) // 2, held  # most of the open
    data = 1 << 20
    for i in range(WALKING_READS + 1):  # then the members' data, in large reads
        look.served(tag, data + i * (64 << 10), raw[data + i * (64 << 10):][:64 << 10])
    assert not look.holds_window(tag)
