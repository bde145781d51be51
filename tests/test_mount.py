"""Real mounts through the CLI: bytes, tools, numpy/h5py, remount, kill -9, bad input."""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import random
import subprocess
import threading
import time

import pytest
from conftest import run_faultfs

pytestmark = pytest.mark.mount

KiB, MiB = 1 << 10, 1 << 20


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@pytest.mark.parametrize(("size", "chunk"), [
    (5 * MiB, "1M"),              # a multiple of the chunk size
    (3 * MiB + 12345, "1MiB"),    # a short, zero-filled final chunk
    (700 * KiB + 1, "262144"),    # chunk size in bytes
    (10, "0"),                    # the assimilator default (1 MiB), one tiny chunk
])
def test_every_chunk_and_the_view_match_the_source(mounter, sample, size, chunk):
    src = sample(size)
    data = read(src)
    m = mounter(src, args=["--chunk-size", chunk])
    cs = int(chunk.rstrip("MiB")) * (MiB if chunk[-1] in "MB" else 1) if chunk != "0" else MiB
    tag = m.tag("field")
    names = sorted(os.listdir(tag))
    n = -(-size // cs)
    assert names == sorted(["field.bin", *[f"chunk_{i}" for i in range(n)]])
    for i in range(n):
        blob = read(os.path.join(tag, f"chunk_{i}"))
        assert len(blob) == cs
        piece = data[i * cs:(i + 1) * cs]
        assert blob == piece + bytes(cs - len(piece)), f"chunk_{i}"
    assert os.path.getsize(os.path.join(tag, "field.bin")) == size
    assert subprocess.run(["cmp", src, os.path.join(tag, "field.bin")]).returncode == 0
    c = m.counters()
    assert c["faults"] == n, "each chunk faults exactly once"
    assert c["source_bytes"] == size, "each source byte is read once"
    assert 1 <= c["source_reads"] <= n, "adjacent chunks read ahead share a source read"
    assert c["fault_errors"] == 0


def test_range_and_empty_prefix(mounter, sample):
    src = sample(4 * MiB + 777)
    data = read(src)
    m = mounter(src, args=["--range", "1000:2M", "--chunk-size", "512K", "--blob-prefix", "",
                           "--tag", "part"])
    tag = m.tag("part")
    assert sorted(os.listdir(tag), key=lambda s: (len(s), s)) == ["0", "1", "2", "3", "field.bin"]
    assert read(os.path.join(tag, "field.bin")) == data[1000:1000 + 2 * MiB]
    assert read(os.path.join(tag, "3")) == data[1000 + 3 * 512 * KiB:1000 + 2 * MiB]


def test_tools_dd_sha256_and_du(mounter, sample):
    src = sample(8 * MiB + 5)
    m = mounter(src)
    tag = m.tag("field")
    out = subprocess.run(["dd", f"if={tag}/chunk_7", "bs=1M", "status=none"], capture_output=True)
    assert out.stdout == read(src)[7 * MiB:8 * MiB]
    assert m.counters()["source_reads"] == 1, "dd of chunk_7 faults exactly that chunk"
    du = subprocess.run(["du", "-k", f"{tag}/field.bin"], capture_output=True, text=True)
    assert int(du.stdout.split()[0]) == 1024, "du shows what is staged"
    assert os.path.getsize(f"{tag}/field.bin") == 8 * MiB + 5, "ls -l shows the logical size"
    digest = subprocess.run(["sha256sum", f"{tag}/field.bin"], capture_output=True, text=True)
    assert digest.stdout.split()[0] == hashlib.sha256(read(src)).hexdigest()
    time.sleep(1.2)  # attributes are cached for a second
    du = subprocess.run(["du", "-k", f"{tag}/field.bin"], capture_output=True, text=True)
    assert int(du.stdout.split()[0]) >= 8 * 1024


def test_numpy_memmap_and_mmap(mounter, tmp_path):
    np = pytest.importorskip("numpy")
    arr = np.arange(3_000_000, dtype=np.float32) * 0.5
    src = str(tmp_path / "grid.f32")
    arr.tofile(src)
    m = mounter(src)
    view = np.memmap(os.path.join(m.tag("grid"), "grid.f32"), dtype=np.float32, mode="r")
    assert view.shape == arr.shape
    assert view[123456] == arr[123456]
    assert np.array_equal(view[-1000:], arr[-1000:])
    assert np.array_equal(view, arr)
    del view
    with open(os.path.join(m.tag("grid"), "grid.f32"), "rb") as f, \
            mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
        assert mm[4 * 999_999:4 * 1_000_000] == arr[999_999].tobytes()


def test_h5py_reads_an_hdf5_source_through_the_mount(mounter, tmp_path):
    h5py = pytest.importorskip("h5py")
    np = pytest.importorskip("numpy")
    src = str(tmp_path / "run42.h5")
    rng = np.random.default_rng(3)
    temp = rng.standard_normal((400, 500)).astype(np.float64)
    with h5py.File(src, "w") as f:
        f.create_dataset("field/temperature", data=temp, chunks=(50, 100), compression="gzip")
        f.create_dataset("field/ids", data=np.arange(100_000, dtype=np.int64))
        f.attrs["run"] = "42"
    m = mounter(src, args=["--chunk-size", "256K"])
    with h5py.File(os.path.join(m.tag("run42"), "run42.h5"), "r") as f:
        assert f.attrs["run"] == "42"
        assert np.array_equal(f["field/temperature"][10:20, 30:300], temp[10:20, 30:300])
        assert f["field/ids"][99_999] == 99_999
        assert np.array_equal(f["field/temperature"][:], temp)


def test_remount_recovers_tags_with_zero_source_reads(mounter, sample, tmp_path):
    src = sample(3 * MiB + 1)
    data = read(src)
    m = mounter(src)
    assert read(os.path.join(m.tag("field"), "field.bin")) == data
    m.umount()
    again = mounter(store=m.store)  # no source: everything comes from the registry
    assert sorted(os.listdir(again.path)) == [".faultfs", "field"]
    assert read(os.path.join(again.tag("field"), "field.bin")) == data
    c = again.counters()
    assert c["source_reads"] == 0 and c["faults"] == 0 and c["hits"] > 0
    registry = os.path.join(again.path, ".faultfs", "registry")
    [key] = os.listdir(registry)
    ctx = json.loads(read(os.path.join(registry, key)))
    assert ctx["src"] == src and ctx["src_token"] == ""
    assert os.stat(os.path.join(registry, key)).st_mode & 0o777 == 0o400


def test_changed_source_is_refaulted_after_remount(mounter, sample):
    src = sample(2 * MiB)
    m = mounter(src)
    read(os.path.join(m.tag("field"), "field.bin"))
    m.umount()
    new = os.urandom(2 * MiB)
    with open(src, "wb") as f:
        f.write(new)
    again = mounter(store=m.store)
    assert read(os.path.join(again.tag("field"), "field.bin")) == new
    stats = again.stats()
    assert stats["counters"]["source_reads"] == 2
    assert stats["tags"]["field"]["stale_dropped_at_mount"] == 2
    out = run_faultfs("stat", again.path, check=True).stdout
    assert "source changed since the last mount" in out


def test_source_modified_under_the_mount_fails_with_eio(mounter, sample):
    src = sample(2 * MiB)
    m = mounter(src)
    time.sleep(0.01)
    with open(src, "r+b") as f:
        f.seek(10)
        f.write(b"changed")
    with pytest.raises(OSError) as info:
        read(os.path.join(m.tag("field"), "chunk_1"))
    assert info.value.errno == 5
    assert m.counters()["fault_errors"] >= 1


def test_concurrent_readers_get_exact_bytes(mounter, sample):
    src = sample(16 * MiB + 333)
    data = read(src)
    m = mounter(src, args=["--chunk-size", "1M"])
    path = os.path.join(m.tag("field"), "field.bin")
    errors = []

    def reader(seed):
        rng = random.Random(seed)
        fd = os.open(path, os.O_RDONLY)
        try:
            for _ in range(150):
                off = rng.randrange(len(data))
                n = rng.choice([1, 4096, 65536, 300_000, 2 * MiB])
                got = os.pread(fd, n, off)
                if got != data[off:off + n]:
                    errors.append((seed, off, n))
        finally:
            os.close(fd)

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    c = m.counters()
    assert c["faults"] <= 17 and c["source_bytes"] <= len(data), "each chunk read at most once"


def test_kill_9_during_reads_then_remount_serves_correct_bytes(mounter, sample):
    src = sample(24 * MiB)
    data = read(src)
    m = mounter(src, args=["--chunk-size", "256K"])
    path = os.path.join(m.tag("field"), "field.bin")
    stop = threading.Event()

    def reader(seed):
        rng = random.Random(seed)
        while not stop.is_set():
            try:
                with open(path, "rb") as f:
                    f.seek(rng.randrange(len(data)))
                    f.read(1 << 20)
            except OSError:
                return

    threads = [threading.Thread(target=reader, args=(s,), daemon=True) for s in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.6)
    m.crash()
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{m.pid}") and time.monotonic() < deadline:
        time.sleep(0.02)
    m.pid = None
    stop.set()
    for t in threads:
        t.join(10)
    with pytest.raises(OSError) as info:
        os.listdir(m.path)
    assert info.value.errno == 107  # ENOTCONN: the dead mount
    again = mounter(store=m.store, mountpoint=m.path)
    assert read(os.path.join(again.tag("field"), "field.bin")) == data
    assert again.counters()["fault_errors"] == 0


def test_env_aliases_and_flags_override_env(mounter, sample):
    src = sample(2 * MiB)
    m = mounter(src, env={"CLIO_CAE_FAULT_STORE": "0", "CLIO_CAE_REF_IO_THREADS": "3"})
    read(os.path.join(m.tag("field"), "field.bin"))
    read(os.path.join(m.tag("field"), "chunk_0"))
    stats = m.stats()
    assert stats["store_enabled"] is False and stats["io_threads"] == 3
    assert stats["counters"]["skipped_no_store"] >= 2 and stats["counters"]["stored"] == 0
    assert _fuse_limits(m) == {"max_background": 64, "congestion_threshold": 48}, \
        "the kernel's 12 background requests raised at mount"
    m.umount()
    m2 = mounter(src, store=m.store, env={"FAULTFS_IO_THREADS": "5", "CLIO_CAE_REF_IO_THREADS": "9",
                                          "FAULTFS_MAX_BACKGROUND": "99"},
                 args=["--reserve-mb", "7", "--max-background", "20"])
    s2 = m2.stats()
    assert s2["io_threads"] == 5, "FAULTFS_* wins over its upstream alias"
    assert s2["reserve_bytes"] == 7 * MiB, "a flag wins over the environment"
    assert _fuse_limits(m2) == {"max_background": 20, "congestion_threshold": 15}


def _fuse_limits(m) -> dict:
    from faultfs.fuse import connection
    from faultfs.fuse.tuning import connection_limits

    entry = connection.find_mount(m.path)
    assert entry is not None
    return connection_limits(entry.minor)


def test_stat_table_and_json(mounter, sample):
    src = sample(MiB)
    m = mounter(src)
    read(os.path.join(m.tag("field"), "chunk_0"))
    table = run_faultfs("stat", m.path, check=True).stdout
    for word in ("faults", "hits", "bytes from source", "reserve", "fault latency", "field",
                 "blobs held", "read buffers", "memory hits"):
        assert word in table
    doc = json.loads(run_faultfs("stat", m.path, "--json", check=True).stdout)
    assert doc["counters"]["faults"] == 1
    assert doc["memory_bytes"] == MiB, "the faulted blob is held in memory"
    assert set(doc["read_buffers"]) == {"mapped", "reused", "lent", "free_bytes"}


def test_stats_logging(mounter, sample):
    src = sample(MiB)
    m = mounter(src, env={"FAULTFS_STATS": "1"})
    read(os.path.join(m.tag("field"), "chunk_0"))
    time.sleep(5.5)
    with open(os.path.join(m.store, "log", "faultfs.log")) as f:
        assert '"faults": 1' in f.read()


# -- bad input: one line, non-zero exit, nothing changed -----------------------------------

def _mount_fails(tmp_path, *args, store=None):
    mnt = tmp_path / "badmnt"
    mnt.mkdir(exist_ok=True)
    store = store or str(tmp_path / "badstore")
    result = run_faultfs("mount", *args, str(mnt), "--store", store)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert not os.path.ismount(mnt)
    return lines[0]


def _registry_is_empty(store):
    path = os.path.join(store, "tags", "t-__cae_on_fault")
    return not os.path.exists(path) or os.listdir(path) == []


@pytest.mark.parametrize(("make_args", "message"), [
    (lambda t, s: [str(t / "missing.bin")], "does not exist"),
    (lambda t, s: [str(t)], "is a directory"),
    (lambda t, s: [s, "--range", "3M:1"], "past the end"),
    (lambda t, s: [s, "--range", "1000:2M"], "past the end"),
    (lambda t, s: [s, "--chunk-size", "-1"], "negative"),
    (lambda t, s: [s, "--chunk-size", "2G"], "1 GiB"),
    (lambda t, s: [s, "--tag", "a/b"], "'/'"),
    (lambda t, s: [s, "--tag", ".hidden"], "starts with '.'"),
    (lambda t, s: [s, "--tag", "x..y"], ".."),
    (lambda t, s: [s, "--tag", "n" * 256], "over 255"),
    (lambda t, s: [s, s + "2", "--tag", "one"], "one tag"),
    (lambda t, s: [s, "--page-size", "2G"], "page size"),
    (lambda t, s: [s, "--max-background", "65536"], "--max-background must be at most"),
    (lambda t, s: [s, "--max-background", "-1"], "must not be negative"),
])
def test_bad_input_is_one_line_and_changes_nothing(tmp_path, sample, make_args, message):
    src = sample(2 * MiB)
    with open(src + "2", "wb") as f:
        f.write(b"x")
    store = str(tmp_path / "badstore")
    line = _mount_fails(tmp_path, *make_args(tmp_path, src), store=store)
    assert message in line
    assert _registry_is_empty(store)


def test_nul_in_tag_name_is_refused(tmp_path, sample):
    from faultfs.core.names import check_tag_name
    from faultfs.errors import InvalidInput

    with pytest.raises(InvalidInput, match="NUL"):
        check_tag_name("a\x00b")


def test_mountpoint_must_be_an_empty_directory(tmp_path, sample):
    src = sample(MiB)
    mnt = tmp_path / "full"
    mnt.mkdir()
    (mnt / "x").write_text("x")
    r = run_faultfs("mount", src, str(mnt), "--store", str(tmp_path / "s"))
    assert r.returncode != 0 and "not empty" in r.stderr
    r = run_faultfs("mount", src, str(tmp_path / "nope"), "--store", str(tmp_path / "s"))
    assert r.returncode != 0 and "does not exist" in r.stderr
    r = run_faultfs("mount", src, str(mnt / "x"), "--store", str(tmp_path / "s"))
    assert r.returncode != 0 and "not a directory" in r.stderr


def test_second_mount_of_a_store_in_use_is_refused(mounter, sample, tmp_path):
    src = sample(MiB)
    m = mounter(src)
    other = tmp_path / "other"
    other.mkdir()
    r = run_faultfs("mount", src, str(other), "--store", m.store)
    assert r.returncode != 0
    assert "in use by pid" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_store_that_is_not_writable_is_refused(tmp_path, sample):
    src = sample(MiB)
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the store should be")
    line = _mount_fails(tmp_path, src, store=str(blocker / "store"))
    assert "cannot be created" in line or "not writable" in line


def test_remount_of_an_empty_store_says_so(tmp_path):
    line = _mount_fails(tmp_path, store=str(tmp_path / "empty"))
    assert "no registered tags" in line


def test_umount_and_stat_of_something_not_mounted(tmp_path):
    r = run_faultfs("umount", str(tmp_path))
    assert r.returncode != 0 and "not mounted" in r.stderr
    r = run_faultfs("stat", str(tmp_path))
    assert r.returncode != 0 and "not a faultfs mount" in r.stderr


@pytest.mark.parametrize("flag", ["--read-only", "--no-store"])
def test_writes_are_refused_on_read_only_and_read_through_mounts(mounter, sample, flag):
    src = sample(MiB)
    m = mounter(src, args=[flag])
    for name in ("chunk_0", "field.bin"):
        with pytest.raises(OSError) as info:
            open(os.path.join(m.tag("field"), name), "r+b")
        assert info.value.errno == 30  # EROFS
    with pytest.raises(OSError) as info:
        open(os.path.join(m.tag("field"), "new.txt"), "wb")
    assert info.value.errno == 30
    assert read(src) == read(os.path.join(m.tag("field"), "field.bin"))


def test_glob_of_local_shards_gives_one_tag_each(mounter, tmp_path):
    for i in range(3):
        (tmp_path / f"part-{i}.bin").write_bytes(bytes([i]) * (MiB + i))
    m = mounter(str(tmp_path / "part-*.bin"))
    assert sorted(os.listdir(m.path)) == [".faultfs", "part-0", "part-1", "part-2"]
    for i in range(3):
        assert read(os.path.join(m.tag(f"part-{i}"), f"part-{i}.bin")) == bytes([i]) * (MiB + i)
    assert [m.stats()["tags"][f"part-{i}"]["shard"] for i in range(3)] == [0, 1, 2]


def test_a_tag_with_hundreds_of_thousands_of_chunks_lists_in_bounded_memory(mounter, tmp_path):
    src = tmp_path / "sparse.bin"
    with open(src, "wb") as f:
        f.truncate(1 << 30)  # 1 GiB, sparse: 262144 chunks of 4 KiB
    m = mounter(str(src), args=["--chunk-size", "4K"])
    tag = m.tag("sparse")
    count = 0
    last = None
    with os.scandir(tag) as entries:
        for entry in entries:
            count += 1
            last = entry.name
    assert count == 262144 + 1
    assert last == "chunk_262143"
    assert os.path.getsize(os.path.join(tag, "chunk_262143")) == 4096
    with open(f"/proc/{m.pid}/status") as f:
        rss_kb = int(next(line for line in f if line.startswith("VmHWM")).split()[1])
    assert rss_kb < 200 * 1024, f"listing must not allocate per entry (peak RSS {rss_kb} kB)"


def test_the_daemon_command_line_names_no_source(mounter, tmp_path):
    src = tmp_path / "secret-token-1234.bin"
    src.write_bytes(b"x" * 5000)
    m = mounter(str(src), args=["--tag", "plain"])
    with open(f"/proc/{m.pid}/cmdline", "rb") as f:
        cmdline = f.read()
    assert b"secret-token-1234" not in cmdline, "URLs may carry credentials: keep them off argv"
    assert read(os.path.join(m.tag("plain"), "secret-token-1234.bin")) == b"x" * 5000


def test_stats_read_in_small_pieces_is_one_consistent_document(mounter, sample):
    src = sample(4 * MiB)
    m = mounter(src)
    fd = os.open(os.path.join(m.path, ".faultfs", "stats"), os.O_RDONLY)
    try:
        pieces = []
        while True:
            piece = os.read(fd, 7)
            if not piece:
                break
            pieces.append(piece)
            if len(pieces) == 3:  # the counters change while the reader is half way
                read(os.path.join(m.tag("field"), "field.bin"))
    finally:
        os.close(fd)
    doc = json.loads(b"".join(pieces))
    assert doc["counters"]["faults"] == 0, "the document is the snapshot taken at open"
    assert m.counters()["faults"] == 4
