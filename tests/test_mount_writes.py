"""Writes through real mounts: numpy.memmap's default mode, h5py "r+", dd, coherence across
names, an fsx-style random script against a local file, kill -9 durability, a full store,
pages with gaps, user blobs, clones, reset and export, and the bad input of each."""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import random
import subprocess
import sys
import time

import pytest
from conftest import run_faultfs

pytestmark = pytest.mark.mount

KiB, MiB = 1 << 10, 1 << 20


def read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def sha(path) -> str:
    return hashlib.sha256(read(path)).hexdigest()


def test_numpy_memmap_default_mode_writes_persist_and_the_source_is_untouched(mounter, tmp_path):
    import numpy as np

    src = tmp_path / "field.bin"
    np.arange(1 << 20, dtype=np.float32).tofile(src)
    before = sha(src)
    m = mounter(str(src), args=["--chunk-size", "1M"])
    view = os.path.join(m.tag("field"), "field.bin")
    a = np.memmap(view, np.float32)  # mode r+: O_RDWR and a shared writable map
    a[10] = 42.5
    a[(1 << 20) - 1] = -3.0
    a[300_000:300_010] = 7
    a.flush()
    del a
    m.umount()
    m2 = mounter(store=m.store)
    b = np.memmap(os.path.join(m2.tag("field"), "field.bin"), np.float32, "r")
    assert b[10] == 42.5 and b[(1 << 20) - 1] == -3.0 and list(b[300_000:300_010]) == [7] * 10
    assert b[11] == 11 and b[299_999] == 299_999
    assert sha(src) == before, "the source is never written"
    c = m2.counters()
    assert c["writes"] == 0


def test_h5py_r_plus_updates_a_dataset_and_creates_another(mounter, tmp_path):
    import h5py
    import numpy as np

    src = tmp_path / "grid.h5"
    with h5py.File(src, "w") as f:
        f.create_dataset("a", data=np.arange(200_000, dtype="f8"), chunks=(4096,),
                         compression="gzip")
    before = sha(src)
    m = mounter(str(src))
    path = os.path.join(m.tag("grid"), "grid.h5")
    size = os.path.getsize(path)
    with h5py.File(path, "r+") as f:  # takes flock(LOCK_EX|LOCK_NB), pwrite, ftruncate
        f["a"][100:200] = -1
        f.create_dataset("b", data=np.linspace(0, 1, 300_000))
    assert os.path.getsize(path) > size, "the file grew past the source"
    m.umount()
    m2 = mounter(store=m.store)
    with h5py.File(os.path.join(m2.tag("grid"), "grid.h5"), "r") as f:
        a = f["a"][:]
        assert (a[100:200] == -1).all() and a[99] == 99 and a[200] == 200
        assert f["b"].shape == (300_000,) and f["b"][-1] == 1.0
    assert sha(src) == before


def test_dd_through_a_chunk_and_the_view_is_seen_through_every_name(mounter, sample):
    src = sample(3 * MiB + 5000)
    data = bytearray(read(src))
    m = mounter(src, args=["--chunk-size", "1M", "--page-size", "512K"])
    tag = m.tag("field")
    patch = os.urandom(8 * KiB)
    with open(os.path.join(tag, "chunk_1"), "rb") as f:  # the kernel caches chunk_1
        f.read()
    subprocess.run(["dd", f"of={tag}/chunk_1", "bs=4K", "seek=3", "conv=notrunc",
                    "status=none"], input=patch, check=True)
    data[MiB + 12 * KiB:MiB + 20 * KiB] = patch
    patch2 = os.urandom(100_000)
    with open(os.path.join(tag, "field.bin"), "rb") as f:  # the kernel caches the view too
        f.read()
    subprocess.run(["dd", f"of={tag}/field.bin", "bs=100000", "seek=20", "conv=notrunc",
                    "status=none"], input=patch2, check=True)
    data[2_000_000:2_100_000] = patch2
    view = os.path.join(tag, "field.bin")
    assert subprocess.run(["cmp", view, "-"], input=bytes(data)).returncode == 0
    for i in range(4):
        piece = bytes(data[i * MiB:(i + 1) * MiB]).ljust(MiB, b"\0")
        assert read(os.path.join(tag, f"chunk_{i}")) == piece, f"chunk_{i}"
    for p in range(7):
        piece = bytes(data[p * 512 * KiB:(p + 1) * 512 * KiB]).ljust(512 * KiB, b"\0")
        assert read(os.path.join(tag, f"page:{p}")) == piece, f"page:{p}"
    code = ("import sys\nd=open(sys.argv[1],'rb').read()\n"
            "sys.exit(0 if d[2_000_000:2_100_000]==sys.stdin.buffer.read() else 1)")
    assert subprocess.run([sys.executable, "-c", code, view], input=patch2).returncode == 0


def test_a_write_is_seen_by_an_existing_mmap_of_another_name(mounter, sample):
    src = sample(2 * MiB)
    m = mounter(src, args=["--chunk-size", "1M"])
    tag = m.tag("field")
    with open(os.path.join(tag, "field.bin"), "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        assert mm[MiB:MiB + 4] == read(src)[MiB:MiB + 4]
        with open(os.path.join(tag, "chunk_1"), "r+b") as c:
            wm = mmap.mmap(c.fileno(), 0)
            wm[0:4] = b"MMAP"
            wm.flush()  # msync: the kernel writes it back through FUSE
            wm.close()
        assert mm[MiB:MiB + 4] == b"MMAP", "the view's mapping sees the chunk's write"
        mm.close()


@pytest.mark.parametrize("memory", [[], ["--dirty-mb", "1"], ["--dirty-mb", "1", "--journal-mb", "3"]],
                         ids=["held", "spilled", "spilled-and-folded"])
def test_fsx_style_random_script_matches_a_local_file(mounter, sample, tmp_path, memory):
    """Random pwrites, preads, ftruncates and mmap writes through the view, the same script
    on a local copy of the source; compared as it goes, at the end, and after a remount.
    With the writes held in memory; spilled past 1 MiB (read back from the journal); and
    spilled with a checkpoint folding them behind the script every 3 MiB of journal (reads
    meet blobs folded and segments trimmed under them)."""
    src = sample(3 * MiB + 777)
    model_path = tmp_path / "model.bin"
    model_path.write_bytes(read(src))
    m = mounter(src, args=["--chunk-size", "256K", *memory])
    view = os.path.join(m.tag("field"), "field.bin")
    rng = random.Random(2024)
    fd, md = os.open(view, os.O_RDWR), os.open(model_path, os.O_RDWR)
    try:
        for step in range(1500):
            size = os.fstat(md).st_size
            op = rng.random()
            if op < 0.45:
                off = rng.randrange(0, size + 64 * KiB)
                data = rng.randbytes(rng.randrange(1, 70 * KiB))
                assert os.pwrite(fd, data, off) == os.pwrite(md, data, off)
            elif op < 0.85:
                off, n = rng.randrange(0, size + 100), rng.randrange(1, 200 * KiB)
                assert os.pread(fd, n, off) == os.pread(md, n, off), f"step {step}"
            elif op < 0.93:
                new = rng.randrange(0, 4 * MiB)
                os.ftruncate(fd, new)
                os.ftruncate(md, new)
            elif size > 0:
                off = rng.randrange(0, size)
                data = rng.randbytes(min(size - off, rng.randrange(1, 9000)))
                for target in (fd, md):
                    with mmap.mmap(target, size) as mm:
                        mm[off:off + len(data)] = data
                        mm.flush()
            assert os.fstat(fd).st_size == os.fstat(md).st_size, f"step {step}"
    finally:
        os.close(fd)
        os.close(md)
    assert read(view) == read(model_path)
    counters = m.counters()
    if memory:
        assert counters["spills"] > 0, counters
    if "--journal-mb" in memory:
        assert counters["checkpoints"] > 3, counters
    m.umount()
    m2 = mounter(store=m.store)
    assert read(os.path.join(m2.tag("field"), "field.bin")) == read(model_path)


WRITER = r"""
import os, sys, random
view, log, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
rng = random.Random(seed)
fd = os.open(view, os.O_RDWR)
logf = open(log, "a")
n = 0
while True:
    off = rng.randrange(0, 4 << 20)
    data = bytes([n % 251 + 1]) * rng.randrange(1, 20000)
    os.pwrite(fd, data, off)
    os.fsync(fd)
    logf.write(f"{off} {len(data)} {data[0]}\n")
    logf.flush()
    n += 1
"""


def _writer_script(seed: int, count: int):
    """The writes WRITER makes, in order (it draws them from ``random.Random(seed)``)."""
    rng = random.Random(seed)
    for n in range(count):
        off = rng.randrange(0, 4 << 20)
        yield off, bytes([n % 251 + 1]) * rng.randrange(1, 20000)


def test_kill_9_during_fsyncing_writes_keeps_every_synced_write(mounter, sample, tmp_path):
    src = sample(4 * MiB)
    m = mounter(src, args=["--chunk-size", "1M"])
    view = os.path.join(m.tag("field"), "field.bin")
    log = tmp_path / "synced.log"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, view, str(log), "7"],
                              stderr=subprocess.DEVNULL)
    time.sleep(2.0)
    m.crash()  # the daemon, mid-stream
    writer.wait(timeout=30)
    m.pid = None
    synced = len(log.read_text().splitlines())
    assert synced > 20, "the writer got going before the kill"
    m2 = mounter(store=m.store, mountpoint=m.path)
    got = read(os.path.join(m2.tag("field"), "field.bin"))
    # every synced write is there; the one in flight at the kill (written, not yet synced)
    # may be there too, whole or cut where the kernel cut it into FUSE writes (at 4 KiB
    # boundaries of the file: each piece is a write of its own, answered or not); no write
    # is torn in any other way
    state = bytearray(read(src))
    script = list(_writer_script(7, synced + 1))
    for off, data in script[:synced]:
        end = off + len(data)
        if end > len(state):
            state.extend(bytes(end - len(state)))
        state[off:end] = data
    legal = [bytes(state)]
    off, data = script[synced]
    cuts = [c - off for c in range((off // 4096 + 1) * 4096, off + len(data), 4096)]
    for cut in [*cuts, len(data)]:
        after = bytearray(state)
        end = off + cut
        if end > len(after):
            after.extend(bytes(end - len(after)))
        after[off:end] = data[:cut]
        legal.append(bytes(after))
    assert got in legal, "a synced write is missing or a write is torn"


def test_writes_past_the_memory_bound_are_read_back_from_the_journal_not_folded(mounter,
                                                                                sample):
    """Random 4 KiB writes over a view of many chunks, far past ``--dirty-mb`` but within
    ``--journal-mb``: their bytes are let go of (spilled) instead of every dirty chunk being
    rewritten; they read back through the view and the chunks, survive a kill -9 (the replay
    keeps them in the journal too) and a clean remount (which folds them)."""
    src = sample(8 * MiB)
    source_sha = sha(src)
    m = mounter(src, args=["--chunk-size", "256K", "--dirty-mb", "1"])
    tag = m.tag("field")
    view = os.path.join(tag, "field.bin")
    want = bytearray(read(src))
    rng = random.Random(11)
    fd = os.open(view, os.O_RDWR)
    try:
        for n in range(1200):  # ~4.7 MiB of writes over all 32 chunks
            off = rng.randrange(len(want) // 4096) * 4096 + rng.choice([0, 100])
            data = rng.randbytes(4096)
            os.pwrite(fd, data, off)
            want[off:off + len(data)] = data
            if n % 300 == 299:  # reads in between see spilled and held writes together
                probe = rng.randrange(len(want) - 20000)
                assert os.pread(fd, 20000, probe) == bytes(want[probe:probe + 20000])
    finally:
        os.close(fd)
    counters = m.counters()
    assert counters["spills"] >= 2 and counters["spilled_bytes"] >= 3 * MiB, counters
    assert counters["checkpoints"] == 0 and counters["folds"] == 0, "nothing was rewritten"
    assert m.stats()["writes"]["held_bytes"] <= 2 * MiB, "memory stays bounded"
    assert read(view) == bytes(want)
    assert read(os.path.join(tag, "chunk_5")) == bytes(want[5 * 256 * KiB:6 * 256 * KiB])
    m.crash()  # acknowledged, never synced: in the journal only
    m.pid = None
    m2 = mounter(store=m.store, mountpoint=m.path)
    assert read(os.path.join(m2.tag("field"), "field.bin")) == bytes(want)
    m2.umount()  # folds everything
    m3 = mounter(store=m.store, mountpoint=m.path)
    assert read(os.path.join(m3.tag("field"), "field.bin")) == bytes(want)
    assert sha(src) == source_sha, "the source is never written"


def test_whole_chunk_writes_survive_kill_9_and_are_folded_by_the_next_mount(mounter, sample):
    """1 MiB writes over whole chunks go to direct files (no journal copy of the data, no
    fold copy): after a kill -9 they are there; fsck knows the files; the next mount folds
    them (renames) and later writes, partial ones over them included, read back."""
    src = sample(4 * MiB)
    m = mounter(src, args=["--chunk-size", "1M"])
    view = os.path.join(m.tag("field"), "field.bin")
    blocks = [bytes([n + 1]) * MiB for n in range(3)]
    fd = os.open(view, os.O_WRONLY)
    try:
        os.pwrite(fd, blocks[0], 0)
        os.fsync(fd)
        os.pwrite(fd, blocks[1], 2 * MiB)  # acknowledged, never synced
        os.pwrite(fd, blocks[2], 2 * MiB)  # replaces it
        os.pwrite(fd, b"partial", 2 * MiB + 100)  # over a direct file
    finally:
        os.close(fd)
    m.crash()
    m.pid = None
    wdir = os.path.join(m.store, "writes", "t-field")
    assert [n for n in os.listdir(wdir) if n.startswith("d-")], "whole writes are direct files"
    doc = json.loads(run_faultfs("fsck", m.store, "--json").stdout)
    assert doc["areas"]["dirty blobs"]["ok"] == 3, doc["areas"]  # the three direct files
    assert not doc["areas"]["dirty blobs"].get("damaged")
    assert not doc["areas"].get("other entries", {}).get("orphaned", 0), "fsck knows them"
    want = bytearray(read(src))
    want[0:MiB] = blocks[0]
    want[2 * MiB:3 * MiB] = blocks[2]
    want[2 * MiB + 100:2 * MiB + 107] = b"partial"
    m2 = mounter(store=m.store, mountpoint=m.path)
    assert read(os.path.join(m2.tag("field"), "field.bin")) == bytes(want)
    assert read(os.path.join(m2.tag("field"), "chunk_2")) == bytes(want[2 * MiB:3 * MiB])
    for _ in range(100):  # the mount folds what it replayed, then lets the files go
        if not [n for n in os.listdir(wdir) if n.startswith("d-")]:
            break
        time.sleep(0.05)
    assert not [n for n in os.listdir(wdir) if n.startswith("d-")]
    with open(os.path.join(m2.tag("field"), "chunk_1"), "r+b") as f:
        f.write(bytes([9]) * MiB)  # a whole chunk through chunk_N
    want[MiB:2 * MiB] = bytes([9]) * MiB
    m2.umount()
    m3 = mounter(store=m.store, mountpoint=m.path)
    assert read(os.path.join(m3.tag("field"), "field.bin")) == bytes(want)
    assert sha(src) == hashlib.sha256(read(src)).hexdigest()


def test_a_full_store_gives_the_writer_enospc_and_keeps_what_was_written(mounter, sample,
                                                                         small_fs):
    src = sample(8 * MiB)
    fs = small_fs(3 * 1024)
    m = mounter(src, store=str(fs / "store"), args=["--chunk-size", "64K", "--dirty-mb", "1"])
    view = os.path.join(m.tag("field"), "field.bin")
    written = bytearray(read(src))
    fd = os.open(view, os.O_RDWR)
    err = None
    try:
        for i in range(128):
            data = bytes([i % 250 + 1]) * (64 * KiB)
            try:
                os.pwrite(fd, data, i * 64 * KiB)
            except OSError as exc:
                err = exc
                break
            written[i * 64 * KiB:(i + 1) * 64 * KiB] = data
    finally:
        os.close(fd)
    assert err is not None and err.errno == errno.ENOSPC, "the writer is told"
    assert read(view) == bytes(written), "everything acknowledged before it is intact, the refused write changed nothing"


def test_page_writes_across_slices_and_gaps_read_back_and_survive_a_remount(mounter, sample):
    src = sample(256 * KiB)
    m = mounter(src, args=["--chunk-size", "64K"])
    tag = m.tag("field")
    text = "pagemap\npage_size=8192\nchunk_0 0 0 1000\nchunk_1 100 2000 3000\nchunk_3 0 6000 1000\n"
    with open(os.path.join(tag, ".pagemap"), "w") as f:
        f.write(text)
    payload = os.urandom(8192)
    with open(os.path.join(tag, "page:0"), "r+b") as f:
        f.write(payload)
    assert read(os.path.join(tag, "page:0")) == payload, "gaps read back what was written"
    c0, c1 = read(os.path.join(tag, "chunk_0")), read(os.path.join(tag, "chunk_1"))
    assert c0[:1000] == payload[:1000] and c1[100:3100] == payload[2000:5000]
    m.umount()
    m2 = mounter(store=m.store)
    assert read(os.path.join(m2.tag("field"), "page:0")) == payload


def test_user_blobs_are_created_renamed_and_unlinked(mounter, sample):
    m = mounter(sample(100 * KiB))
    tag = m.tag("field")
    with open(os.path.join(tag, "notes.txt"), "wb") as f:
        f.write(b"first\n")
    with open(os.path.join(tag, "notes.txt"), "ab") as f:
        f.write(b"second\n")
    assert read(os.path.join(tag, "notes.txt")) == b"first\nsecond\n"
    os.rename(os.path.join(tag, "notes.txt"), os.path.join(tag, "kept.txt"))
    with open(os.path.join(tag, "gone.bin"), "wb") as f:
        f.write(b"x" * 5000)
    os.truncate(os.path.join(tag, "gone.bin"), 10)
    assert read(os.path.join(tag, "gone.bin")) == b"x" * 10
    os.unlink(os.path.join(tag, "gone.bin"))
    names = os.listdir(tag)
    assert "kept.txt" in names and "notes.txt" not in names and "gone.bin" not in names
    for bad in ("chunk_0", "field.bin", ".faultfs-x", "page:3"):
        with pytest.raises(OSError) as info:
            open(os.path.join(tag, bad), "xb")
        assert info.value.errno in (errno.EPERM, errno.EEXIST, errno.EINVAL), bad
    m.umount()
    m2 = mounter(store=m.store)
    assert read(os.path.join(m2.tag("field"), "kept.txt")) == b"first\nsecond\n"
    assert "gone.bin" not in os.listdir(m2.tag("field"))


def test_a_user_blob_copied_in_is_kept_in_parts_folded_once_each(mounter, sample):
    """``cp`` of a 5 MiB file into a tag (128 KiB writes, checkpoints while it runs): it
    reads back, shrinks and grows across parts, survives a remount, and its store holds
    one dirty file per 1 MiB part (a fold rewrites the parts written since the last one:
    ``tests/test_user_blobs.py`` counts them)."""
    m = mounter(sample(100 * KiB), args=["--dirty-mb", "1", "--journal-mb", "1"])
    data = random.Random(5).randbytes(5 * MiB + 1234)
    path = os.path.join(m.tag("field"), "copy.bin")
    with open(path, "wb") as f:
        for off in range(0, len(data), 128 * KiB):
            f.write(data[off:off + 128 * KiB])
    assert read(path) == data and os.stat(path).st_size == len(data)
    assert m.counters()["checkpoints"] >= 1, "folds ran while it was copied in"
    os.truncate(path, 2 * MiB + 5)
    os.truncate(path, 3 * MiB)  # grown again: what was cut reads as zeros
    want = data[:2 * MiB + 5] + bytes(MiB - 5)
    assert read(path) == want
    m.umount()
    m2 = mounter(store=m.store)
    assert read(os.path.join(m2.tag("field"), "copy.bin")) == want
    m2.umount()
    parts = [n for n in os.listdir(os.path.join(m.store, "writes", "t-field"))
             if n.startswith("b-u")]
    assert len(parts) == 6, parts  # 0 … 5: the three past the end are empty now


def test_a_user_blob_grows_past_the_largest_blob_in_parts(mounter, sample):
    """No blob is longer than 1 GiB, but a user blob is kept in parts: it can grow past
    that (here sparsely, by a truncate and a write far out), and reads zeros in between."""
    m = mounter(sample(100 * KiB))
    path = os.path.join(m.tag("field"), "big.out")
    with open(path, "wb") as f:
        f.write(b"kept")
    far = (1 << 30) + 3 * MiB + 17
    os.truncate(path, far)
    fd = os.open(path, os.O_RDWR)
    try:
        assert os.pwrite(fd, b"tail", far) == 4
    finally:
        os.close(fd)
    for mount in (m, None):
        if mount is None:
            m.umount()
            mount = mounter(store=m.store)
        p = os.path.join(mount.tag("field"), "big.out")
        assert os.stat(p).st_size == far + 4
        with open(p, "rb") as f:
            assert f.read(4) == b"kept"
            f.seek(far - 5)
            assert f.read() == b"\0" * 5 + b"tail"
            f.seek(1 << 30)
            assert f.read(MiB) == bytes(MiB)


def test_chunks_have_a_fixed_size(mounter, sample):
    m = mounter(sample(2 * MiB), args=["--chunk-size", "1M"])
    fd = os.open(os.path.join(m.tag("field"), "chunk_0"), os.O_RDWR)
    try:  # like a file size limit: what fits is written (a short count), then EFBIG
        assert os.pwrite(fd, b"x" * 10, MiB - 5) == 5
        with pytest.raises(OSError) as info:
            os.pwrite(fd, b"x" * 10, MiB)
        assert info.value.errno == errno.EFBIG
        assert os.fstat(fd).st_size == MiB
    finally:
        os.close(fd)


def test_a_view_grown_far_out_shrinks_in_time_and_memory_and_stops_at_16_tib(mounter, sample):
    """Writes 1 and 16 TiB out make a sparse view; shrinking it back zeroes only the chunks that
    hold bytes (the source's and the written ones), not one per MiB of the range (which took
    the daemon past all memory); growth past 16 TiB is EFBIG for the view and a user blob,
    nothing changed; the daemon still serves and the bytes survive a remount."""
    from faultfs.engine.writes import MAX_GROWN

    src = sample(3 * MiB)
    m = mounter(src, args=["--chunk-size", "1M"])
    view = os.path.join(m.tag("field"), "field.bin")
    fd = os.open(view, os.O_RDWR)
    try:
        assert os.pwrite(fd, b"far", 1 << 40) == 3
        assert os.fstat(fd).st_size == (1 << 40) + 3
        assert os.pread(fd, 3, 1 << 40) == b"far"
        assert os.pread(fd, 8, 1 << 39) == bytes(8)  # the gap reads zeros
        for off in (MAX_GROWN, MAX_GROWN + 5, (1 << 63) - 10):
            with pytest.raises(OSError) as info:
                os.pwrite(fd, b"xyz", off)
            assert info.value.errno == errno.EFBIG
        with pytest.raises(OSError) as info:
            os.ftruncate(fd, MAX_GROWN + 1)
        assert info.value.errno == errno.EFBIG
        assert os.fstat(fd).st_size == (1 << 40) + 3
        # like a file size limit: what fits is written (a short count), then EFBIG
        assert os.pwrite(fd, b"xyz", MAX_GROWN - 2) == 2
        assert os.fstat(fd).st_size == MAX_GROWN
        assert os.pread(fd, 8, MAX_GROWN - 4) == b"\0\0xy"
        from faultfs.warm import staged_chunks  # every chunk past the source is the writes'

        started = time.monotonic()
        answer = staged_chunks(m.tag("field"))
        assert answer is not None and answer[1] == MAX_GROWN // MiB
        assert answer[2][-1] == 0xFF and answer[2][0] == 0xF8  # the source's 3: not staged
        assert time.monotonic() - started < 10
        started = time.monotonic()
        os.ftruncate(fd, 2 * MiB + 5)
        assert time.monotonic() - started < 10
        assert os.fstat(fd).st_size == 2 * MiB + 5
        os.ftruncate(fd, 4 * MiB)  # regrown: zeros past the cut, in the source's last chunk too
        assert os.pread(fd, 4 * MiB, 0) == read(src)[:2 * MiB + 5] + bytes(2 * MiB - 5)
    finally:
        os.close(fd)
    user = os.path.join(m.tag("field"), "notes.bin")
    with open(user, "wb") as f:
        f.write(b"n")
    with pytest.raises(OSError) as info:
        os.truncate(user, MAX_GROWN + 1)
    assert info.value.errno == errno.EFBIG
    assert os.stat(user).st_size == 1
    stats = json.loads(read(os.path.join(m.path, ".faultfs", "stats")))
    assert stats["pid"]
    m.umount()
    m2 = mounter(store=m.store)
    view = os.path.join(m2.tag("field"), "field.bin")
    assert read(view) == read(src)[:2 * MiB + 5] + bytes(2 * MiB - 5)
    assert len(os.listdir(m2.tag("field"))) < 16


def test_clones_are_point_in_time_snapshots_both_ways_across_remounts(mounter, sample, tmp_path):
    src = sample(2 * MiB)
    original = read(src)
    m = mounter(src, args=["--chunk-size", "512K"])
    view = os.path.join(m.tag("field"), "field.bin")
    with open(view, "r+b") as f:
        f.write(b"BEFORE")
    run_faultfs("clone", m.tag("field"), "snap", check=True)
    with open(view, "r+b") as f:
        f.write(b"AFTER!")
    snap = os.path.join(m.tag("snap"), "field.bin")
    assert read(snap)[:6] == b"BEFORE", "later writes to the parent are not seen by the clone"
    with open(snap, "r+b") as f:
        f.seek(MiB)
        f.write(b"CLONE")
    assert read(view)[MiB:MiB + 5] == original[MiB:MiB + 5], "the clone's writes stay its own"
    run_faultfs("clone", m.tag("snap"), "snap2", check=True)  # a clone of a clone
    m.umount()
    m2 = mounter(store=m.store)
    assert read(os.path.join(m2.tag("field"), "field.bin"))[:6] == b"AFTER!"
    got = read(os.path.join(m2.tag("snap"), "field.bin"))
    assert got[:6] == b"BEFORE" and got[MiB:MiB + 5] == b"CLONE"
    assert read(os.path.join(m2.tag("snap2"), "field.bin")) == got
    assert read(src) == original


def test_reset_drops_writes_and_export_writes_the_current_bytes(mounter, sample, tmp_path):
    src = sample(3 * MiB)
    original = read(src)
    m = mounter(src, args=["--chunk-size", "1M"])
    tag = m.tag("field")
    with open(os.path.join(tag, "field.bin"), "r+b") as f:
        f.seek(2 * MiB + 5)
        f.write(b"NEW")
        f.seek(0, 2)
        f.write(b"+tail")
    current = read(os.path.join(tag, "field.bin"))
    out = tmp_path / "export.bin"
    r = run_faultfs("export", tag, str(out), "--no-progress", check=True)
    assert "exported" in r.stdout and read(out) == current
    again = run_faultfs("export", tag, str(out), "--no-progress")
    assert again.returncode == 1 and "exists: give --force" in again.stderr
    stat = json.loads(run_faultfs("stat", m.path, "--json", check=True).stdout)
    assert stat["tags"]["field"]["dirty_blobs"] >= 2 and stat["counters"]["writes"] >= 2
    run_faultfs("reset", tag, "chunk_2", check=True)
    assert read(os.path.join(tag, "chunk_2")) == original[2 * MiB:]
    run_faultfs("reset", tag, check=True)
    assert read(os.path.join(tag, "field.bin")) == original


@pytest.mark.parametrize(("cmd", "message"), [
    (["reset", "{mnt}/nope"], "no tag named 'nope'"),
    (["clone", "{mnt}/nope", "x"], "no tag named 'nope'"),
    (["clone", "{mnt}/field", "field"], "tag 'field' exists"),
    (["clone", "{mnt}/field", "a/b"], "contains '/'"),
    (["export", "{mnt}/nope", "{tmp}/out"], "has no tag 'nope'"),
    (["export", "{mnt}/field", "{tmp}/no/such/dir/out"], "the directory"),
    (["export", "{mnt}/field", "{tmp}"], "is a directory"),
    (["reset", "{tmp}", ], "is not a tag directory of a faultfs mount"),
])
def test_bad_requests_are_one_line_and_change_nothing(mounter, sample, tmp_path, cmd, message):
    m = mounter(sample(10_000))
    before = sorted(os.listdir(m.path))
    args = [a.format(mnt=m.path, tmp=tmp_path) for a in cmd]
    result = run_faultfs(*args)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and message in lines[0], lines
    assert sorted(os.listdir(m.path)) == before
    assert not (tmp_path / "out").exists()
    assert not any(p.name.endswith(".faultfs-export.meta") for p in tmp_path.parent.iterdir())



def test_a_reset_refused_for_one_bad_name_drops_no_write_of_the_others(mounter, sample):
    """``faultfs reset TAG chunk_1 nope`` is refused as a whole: chunk_1's write is kept in
    this mount and after later state saves and remounts; a chunk the tag does not have is
    refused as a name it does not have."""
    src = sample(3 * MiB)
    original = read(src)
    m = mounter(src, args=["--chunk-size", "1M"])
    tag = m.tag("field")
    with open(os.path.join(tag, "chunk_1"), "r+b") as f:
        f.write(b"KEEP ME")
    m.umount()  # folded: its dirty file names a seq older than the journal's next
    m = mounter(store=m.store)
    tag = m.tag("field")
    for names in (["chunk_1", "nope"], ["chunk_1", "chunk_99"]):
        r = run_faultfs("reset", tag, *names)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and len(lines) == 1 and "has no blob" in lines[0], lines
    assert read(os.path.join(tag, "chunk_1"))[:7] == b"KEEP ME"
    with open(os.path.join(tag, "notes.txt"), "wb") as f:  # saves the tag's write state
        f.write(b"n")
    m.umount()
    m = mounter(store=m.store)
    got = read(os.path.join(m.tag("field"), "field.bin"))
    assert got[MiB:MiB + 7] == b"KEEP ME", "a refused reset dropped nothing"
    assert got[:MiB] == original[:MiB] and got[MiB + 7:] == original[MiB + 7:]

def test_an_interrupted_export_resumes_where_its_checkpoint_vouched(mounter, sample, tmp_path,
                                                                     monkeypatch):
    from faultfs import export as exp

    src = sample(6 * MiB + 123)
    m = mounter(src, args=["--chunk-size", "1M"])
    tag = m.tag("field")
    with open(os.path.join(tag, "field.bin"), "r+b") as f:
        f.seek(4 * MiB)
        f.write(b"written")
    current = read(os.path.join(tag, "field.bin"))
    out = tmp_path / "out.bin"
    _interrupted_export(monkeypatch, tag, out)  # Ctrl-C in the middle of the export
    report = exp.export(tag, str(out), progress=False)
    assert report.resumed_from == 4 * MiB  # the last checkpoint before the interrupt
    assert report.written == len(current) - 4 * MiB
    assert read(out) == current
    assert not os.path.exists(str(out) + exp.STATE_SUFFIX)


def _interrupted_export(monkeypatch, tag: str, out) -> None:
    """An export of ``tag`` to ``out`` stopped by Ctrl-C after its checkpoint at 4 MiB."""
    from faultfs import export as exp

    monkeypatch.setattr(exp, "BLOCK", 1 * MiB)
    monkeypatch.setattr(exp, "CHECKPOINT_BYTES", 2 * MiB)
    real, calls = exp.write_parts, []

    def dies_at_the_fifth(fd, parts, *args, at=0):
        calls.append(at)
        if len(calls) == 5:
            raise KeyboardInterrupt
        real(fd, parts, *args, at=at)

    monkeypatch.setattr(exp, "write_parts", dies_at_the_fifth)
    with pytest.raises(KeyboardInterrupt):
        exp.export(tag, str(out), progress=False)
    monkeypatch.setattr(exp, "write_parts", real)


def test_a_resumed_export_whose_destination_vanished_starts_over(mounter, sample, tmp_path,
                                                                  monkeypatch):
    """The checkpoint vouches for bytes of DEST: with DEST deleted (or cut shorter) since,
    nothing is vouched for, and the export starts over rather than leave zeros there."""
    from faultfs import export as exp

    src = sample(6 * MiB + 123)
    m = mounter(src, args=["--chunk-size", "1M"])
    tag = m.tag("field")
    current = read(os.path.join(tag, "field.bin"))
    for vanish in (os.unlink, lambda p: os.truncate(p, MiB)):
        out = tmp_path / "out.bin"
        _interrupted_export(monkeypatch, tag, out)
        assert os.path.exists(str(out) + exp.STATE_SUFFIX)
        vanish(out)
        report = exp.export(tag, str(out), progress=False)
        assert report.resumed_from == 0 and report.written == len(current)
        assert read(out) == current
        os.unlink(out)


def test_a_reset_between_an_export_and_its_resume_starts_it_over(mounter, sample, tmp_path,
                                                                   monkeypatch):
    """A reset changes the tag's bytes, so it is another state of the tag: the resumed
    export must not join the bytes from before it to the bytes after it."""
    from faultfs import export as exp

    src = sample(6 * MiB + 123)
    original = read(src)
    m = mounter(src, args=["--chunk-size", "1M"])
    tag = m.tag("field")
    view = os.path.join(tag, "field.bin")
    with open(view, "r+b") as f:
        for at in (MiB, 5 * MiB):
            f.seek(at)
            f.write(b"written")
    before = os.stat(view).st_mtime_ns
    out = tmp_path / "out.bin"
    _interrupted_export(monkeypatch, tag, out)
    run_faultfs("reset", tag, check=True)
    assert read(view) == original
    assert os.stat(view).st_mtime_ns > before, "a reset is a change of the view"
    report = exp.export(tag, str(out), progress=False)
    assert report.resumed_from == 0
    assert read(out) == original


def test_a_view_grown_far_out_exports_as_a_sparse_file(mounter, sample, tmp_path):
    """The zeros of a grown view are holes in the export (cp --sparse=auto does the same),
    its bytes equal to the view's, over an older file in the way."""
    from faultfs import export as exp

    src = sample(2 * MiB)
    m = mounter(src, args=["--chunk-size", "1M"])
    tag = m.tag("field")
    view = os.path.join(tag, "field.bin")
    with open(view, "r+b") as f:
        f.seek(60 * MiB)
        f.write(b"far out")
    out = tmp_path / "out.bin"
    out.write_bytes(b"\xff" * (64 * MiB))  # an older file in the way: replaced, holes and all
    report = exp.export(tag, str(out), progress=False, force=True)
    assert report.written == 60 * MiB + 7
    assert read(out) == read(src) + bytes(58 * MiB) + b"far out"
    assert os.stat(out).st_blocks * 512 < 16 * MiB, "the zeros are holes"


def test_flock_and_fcntl_locks_work_on_the_view(mounter, sample):
    import fcntl

    m = mounter(sample(100_000))
    view = os.path.join(m.tag("field"), "field.bin")
    with open(view, "r+b") as a, open(view, "r+b") as b:
        fcntl.flock(a, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what HDF5 takes in r+
        with pytest.raises(BlockingIOError):
            fcntl.flock(b, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(a, fcntl.LOCK_UN)
        fcntl.flock(b, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.lockf(a, fcntl.LOCK_EX | fcntl.LOCK_NB, 10, 0)  # a POSIX record lock
        fcntl.lockf(a, fcntl.LOCK_UN, 10, 0)


def test_a_closed_chunk_sees_every_later_write_through_the_view(mounter, sample):
    """Invalidations skip closed files already invalidated, never a file cached since."""
    src = sample(2 * MiB)
    m = mounter(src, args=["--chunk-size", "1M"])
    tag = m.tag("field")
    chunk, view = os.path.join(tag, "chunk_0"), os.path.join(tag, "field.bin")
    for round_ in range(4):
        cached = read(chunk)  # open, read (the kernel caches it), close
        word = f"w{round_}".encode()
        with open(view, "r+b") as f:
            f.seek(100)
            f.write(word)
        assert read(chunk)[100:102] == word, f"round {round_}: a stale page of chunk_0"
        assert cached[100:102] != word


def test_without_xattrs_a_write_is_one_request_and_with_them_attributes_answer(mounter, sample):
    """By default the mount refuses extended attributes with ENOSYS, once: the kernel then stops
    asking getxattr("security.capability") before every write (two requests per write
    before). With --xattrs the user.faultfs.* attributes answer, on every name."""
    src = sample(4 * MiB)
    data = read(src)
    m = mounter(src, args=["--chunk-size", "1M"])
    view = os.path.join(m.tag("field"), "field.bin")
    fd = os.open(view, os.O_RDWR)
    try:
        for i in range(200):
            os.pwrite(fd, b"%08d" % i, i * 4 * KiB)
        os.fsync(fd)
    finally:
        os.close(fd)
    for call in (lambda: os.getxattr(view, "user.faultfs.staged"), lambda: os.listxattr(view)):
        with pytest.raises(OSError) as err:
            call()
        assert err.value.errno == errno.EOPNOTSUPP
    stats = m.stats()
    assert stats["xattrs"] is False
    assert stats["counters"]["writes"] == 200
    assert stats["counters"].get("xattrs_refused", 0) <= 1, "the kernel kept asking"
    got = read(view)
    for i in range(200):
        assert got[i * 4 * KiB:i * 4 * KiB + 8] == b"%08d" % i
    assert got[8:4 * KiB] == data[8:4 * KiB]

    on = mounter(src, store=str(m.store) + "-x", args=["--chunk-size", "1M", "--xattrs"])
    tag = on.tag("field")
    assert os.getxattr(os.path.join(tag, "chunk_0"), "user.faultfs.staged") == b"0"
    assert os.getxattr(os.path.join(tag, "chunk_0"), "user.faultfs.source") == os.fsencode(src)
    read(os.path.join(tag, "chunk_1"))
    deadline = time.monotonic() + 10  # the store write follows the read
    while (os.getxattr(os.path.join(tag, "chunk_1"), "user.faultfs.staged") != b"1"
           and time.monotonic() < deadline):
        time.sleep(0.02)
    assert os.getxattr(os.path.join(tag, "chunk_1"), "user.faultfs.staged") == b"1"
    assert os.getxattr(os.path.join(tag, "field.bin"), "user.faultfs.staged") == b"1/4"
    with open(os.path.join(tag, "chunk_3"), "r+b") as f:
        f.write(b"dirty")  # a dirty chunk is here too, stored or not
    with open(os.path.join(tag, "field.bin"), "r+b") as f:
        f.seek(5 * MiB)
        f.write(b"grown")  # the view grew by two chunks, both the writes'
    assert os.getxattr(os.path.join(tag, "field.bin"), "user.faultfs.staged") == b"4/6"
    assert sorted(os.listxattr(os.path.join(tag, "chunk_0"))) == [
        "user.faultfs.source", "user.faultfs.staged", "user.faultfs.tag"]
    with pytest.raises(OSError) as err:
        os.getxattr(os.path.join(tag, "chunk_0"), "security.capability")
    assert err.value.errno == errno.ENODATA
    assert on.stats()["xattrs"] is True


@pytest.mark.mount
def test_an_open_with_o_trunc_empties_the_view_and_a_user_blob_not_a_chunk(mounter, sample):
    """The kernel hands O_TRUNC to the open (``atomic_o_trunc``): ``open(…, "wb")`` of the
    view or a user blob starts it empty, as on a local file; a chunk, whose size is fixed,
    refuses it (EPERM, as truncate) and keeps its bytes (tests/test_mount_names.py)."""
    src = sample(3 * MiB)
    before = sha(src)
    m = mounter(src)
    tag = m.tag("field")
    view = os.path.join(tag, "field.bin")
    with open(view, "wb") as f:
        f.write(b"new start")
    assert os.stat(view).st_size == 9 and read(view) == b"new start"
    user = os.path.join(tag, "notes.txt")
    with open(user, "wb") as f:
        f.write(b"x" * 5000)
    with open(user, "wb") as f:
        f.write(b"short")
    assert read(user) == b"short"
    chunk = os.path.join(tag, "chunk_1")
    kept = read(chunk)  # (zeros: the view was cut to 9 bytes)
    with pytest.raises(PermissionError):
        os.open(chunk, os.O_WRONLY | os.O_TRUNC)
    assert os.stat(chunk).st_size == MiB and read(chunk) == kept
    m.umount()
    m2 = mounter(store=m.store)
    assert read(os.path.join(m2.tag("field"), "field.bin")) == b"new start"
    assert read(os.path.join(m2.tag("field"), "notes.txt")) == b"short"
    assert sha(src) == before, "the source is never written"
