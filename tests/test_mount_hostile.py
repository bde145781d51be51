"""Defects found by trying the mount as a hostile (or merely unlucky) user would: each test
failed before its fix. Real mounts through the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

pytestmark = pytest.mark.mount

KiB, MiB = 1 << 10, 1 << 20


def read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def run(*cmd: str, cwd=None) -> None:
    result = subprocess.run(list(cmd), capture_output=True, text=True, cwd=cwd, timeout=120)
    assert result.returncode == 0, f"{' '.join(cmd)}: {result.stderr}"


def test_unread_data_is_never_taken_for_a_hole(mounter, sample, tmp_path):
    """A file with data and zero blocks is one whole hole to GNU tar -S, bsdtar and
    cp --sparse: they archived zeros without reading a byte and exited 0."""
    src = sample(5 * MiB + 1000)
    data = read(src)
    m = mounter(src, args=["--chunk-size", "1M", "--xattrs"])
    tag = m.tag("field")
    for i in range(5):
        st = os.stat(os.path.join(tag, f"chunk_{i}"))
        assert st.st_size == MiB and st.st_blocks >= 1, "an unstaged chunk still has a block"
        assert os.getxattr(os.path.join(tag, f"chunk_{i}"), "user.faultfs.staged") == b"0"
    out = tmp_path / "out"
    out.mkdir()
    run("tar", "-S", "-cf", str(tmp_path / "gnu.tar"), "-C", tag, "chunk_0")
    run("tar", "-xf", str(tmp_path / "gnu.tar"), "-C", str(out))
    assert read(out / "chunk_0") == data[:MiB], "GNU tar -S archived zeros"
    run("bsdtar", "-cf", str(tmp_path / "bsd.tar"), "-C", tag, "chunk_1")
    run("bsdtar", "-xf", str(tmp_path / "bsd.tar"), "-C", str(out))
    assert read(out / "chunk_1") == data[MiB:2 * MiB], "bsdtar archived zeros"
    run("cp", "--sparse=always", os.path.join(tag, "chunk_2"), str(out / "cp2"))
    assert read(out / "cp2") == data[2 * MiB:3 * MiB], "cp --sparse=always copied zeros"
    run("rsync", "-S", os.path.join(tag, "chunk_3"), str(out / "rs3"))
    assert read(out / "rs3") == data[3 * MiB:4 * MiB], "rsync -S copied zeros"
    assert os.getxattr(os.path.join(tag, "chunk_0"), "user.faultfs.staged") == b"1"
    run("tar", "-S", "-cf", str(tmp_path / "view.tar"), "-C", tag, "field.bin")
    run("tar", "-xf", str(tmp_path / "view.tar"), "-C", str(out))
    assert read(out / "field.bin") == data, "the partly staged view archived with holes"
    du = os.stat(os.path.join(tag, "field.bin")).st_blocks * 512
    assert du >= 5 * MiB, "du still shows what was staged"


def test_a_source_rewritten_with_its_mtime_restored_never_mixes_versions(mounter, sample, tmp_path):
    from conftest import run_faultfs

    src = sample(4 * MiB)
    old = read(src)
    m = mounter(src, args=["--chunk-size", "1M", "--prefetch-mb", "0"])
    view = os.path.join(m.tag("field"), "field.bin")
    with open(view, "rb") as f:
        assert f.read(MiB) == old[:MiB]
    st = os.stat(src)
    new = bytes(b ^ 0xA5 for b in old)
    with open(src, "r+b") as f:
        f.write(new)
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    fd = os.open(view, os.O_RDONLY)
    try:  # never served: it would be new bytes beside old staged ones
        with pytest.raises(OSError) as info:
            os.pread(fd, MiB, 2 * MiB)
    finally:
        os.close(fd)
    assert info.value.errno == 5
    out = run_faultfs("stat", m.path).stdout
    assert "source changed under the mount" in out
    m.umount()
    m2 = mounter(store=m.store)
    assert read(os.path.join(m2.tag("field"), "field.bin")) == new
    assert m2.stats()["tags"]["field"]["source_changed_at_mount"]


def test_a_fifo_in_the_store_neither_freezes_the_mount_nor_fails_reads(mounter, sample, tmp_path):
    from conftest import run_faultfs

    src = sample(3 * MiB)
    data = read(src)
    m = mounter(src, args=["--chunk-size", "1M"])
    assert read(os.path.join(m.tag("field"), "field.bin")) == data
    m.umount()
    blob = os.path.join(m.store, "tags", "t-field", "b-chunk_1")
    os.unlink(blob)
    os.mkfifo(blob)
    m2 = mounter(store=m.store)
    got = subprocess.run(["cat", os.path.join(m2.tag("field"), "field.bin")],
                         capture_output=True, timeout=30).stdout
    assert got == data
    deadline = time.monotonic() + 15  # re-faulted, then stored behind the reader
    while not os.path.isfile(blob):
        assert time.monotonic() < deadline, "the FIFO was not replaced by the re-faulted blob"
        time.sleep(0.05)
    fifo = tmp_path / "cp.meta"
    os.mkfifo(fifo)
    shown = run_faultfs("checkpoint", "show", str(fifo), timeout=30)
    assert shown.returncode == 1 and "not a regular file, not a checkpoint file" in shown.stderr
    shown = run_faultfs("checkpoint", "show", str(tmp_path), timeout=30)
    assert shown.returncode == 1 and "is a directory, not a checkpoint file" in shown.stderr


def test_a_fifo_as_the_source_is_refused_at_once(tmp_path):
    from conftest import run_faultfs

    fifo = tmp_path / "data.bin"
    os.mkfifo(fifo)
    (tmp_path / "mnt").mkdir()
    result = run_faultfs("mount", str(fifo), str(tmp_path / "mnt"), "--store",
                         str(tmp_path / "store"), timeout=60)
    assert result.returncode == 1
    assert "is not a regular file (a FIFO)" in result.stderr
    assert not os.path.ismount(tmp_path / "mnt")


def _tree(path) -> list[str]:
    return sorted(os.path.relpath(os.path.join(base, name), path)
                  for base, dirs, files in os.walk(path) for name in dirs + files)


@pytest.mark.parametrize("bad", ["missing source", "bad tag", "store inside the mountpoint"])
def test_a_refused_mount_changes_nothing(tmp_path, sample, bad):
    from conftest import run_faultfs

    src = sample(1000)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    store = tmp_path / "fresh-store"
    args = [src, str(mnt), "--store", str(store)]
    if bad == "missing source":
        args[0] = str(tmp_path / "nope.bin")
    elif bad == "bad tag":
        args += ["--tag", "a/b"]
    else:
        store = mnt / "store"
        args[2:4] = ["--store", str(store)]
    result = run_faultfs("mount", *args)
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not store.exists(), "a refused mount created the store"
    assert os.listdir(mnt) == [] and not os.path.ismount(mnt)
    if bad == "store inside the mountpoint":
        assert "is inside the mountpoint" in result.stderr
    good = run_faultfs("mount", src, str(mnt), "--store", str(tmp_path / "store2"))
    assert good.returncode == 0, good.stderr  # the mountpoint is still usable
    run_faultfs("umount", str(mnt), check=True)


def test_a_refused_mount_of_an_existing_store_keeps_it_as_it_was(mounter, sample, tmp_path):
    from conftest import run_faultfs

    m = mounter(sample(3000))
    m.umount()
    before = {p: os.stat(os.path.join(m.store, p)).st_mtime_ns for p in _tree(m.store)}
    (tmp_path / "mnt9").mkdir()
    result = run_faultfs("mount", str(tmp_path / "nope.bin"), str(tmp_path / "mnt9"),
                         "--store", m.store)
    assert result.returncode == 1
    after = {p: os.stat(os.path.join(m.store, p)).st_mtime_ns for p in _tree(m.store)}
    changed = {p for p in set(before) | set(after) if before.get(p) != after.get(p)}
    assert changed <= {"lock"}, changed  # only the lock file's pid is written


def test_the_store_is_private_and_its_log_never_follows_a_link(mounter, sample, tmp_path):
    import stat

    from conftest import run_faultfs

    m = mounter(sample(3000))
    for sub in ("", "tags", "log"):
        mode = stat.S_IMODE(os.stat(os.path.join(m.store, sub)).st_mode)
        assert mode == 0o700, (sub, oct(mode))
    log_file = os.path.join(m.store, "log", "faultfs.log")
    assert stat.S_IMODE(os.stat(log_file).st_mode) == 0o600
    assert os.path.getsize(log_file) > 0, "the daemon logs there"
    m.umount()
    os.chmod(m.store, 0o755)  # as an older faultfs left it
    m2 = mounter(store=m.store)
    assert stat.S_IMODE(os.stat(m.store).st_mode) == 0o700
    m2.umount()
    target = tmp_path / "victim"
    target.write_text("keep me\n")
    os.unlink(log_file)
    os.symlink(target, log_file)
    (tmp_path / "mnt9").mkdir()
    result = run_faultfs("mount", str(tmp_path / "mnt9"), "--store", m.store)
    assert result.returncode == 1 and "is a symbolic link" in result.stderr
    assert target.read_text() == "keep me\n"


def _fill(directory) -> None:
    """Fill a file system: bytes until ENOSPC, then inodes until ENOSPC."""
    n = 0
    with open(os.path.join(directory, "filler"), "wb") as f:
        try:
            while True:
                f.write(b"\xff" * (64 * KiB))
                f.flush()
        except OSError:
            pass
    while True:
        n += 1
        try:
            open(os.path.join(directory, f"inode-{n}"), "wb").close()
        except OSError:
            return


@pytest.mark.parametrize("how", ["full of bytes and inodes", "read-only"])
def test_a_store_that_cannot_be_written_mounts_degraded(mounter, sample, small_fs, tmp_path, how):
    from conftest import run_faultfs

    src = sample(4 * MiB)
    data = read(src)
    fs = small_fs(16 * 1024, inodes=200)
    store = fs / "store"
    m = mounter(src, store=str(store), args=["--chunk-size", "1M", "--prefetch-mb", "0"])
    for i in (0, 1):  # chunks 0 and 1 staged (the chunk files: no readahead past them)
        assert read(os.path.join(m.tag("field"), f"chunk_{i}")) == data[i * MiB:(i + 1) * MiB]
    m.umount()
    if how == "read-only":
        subprocess.run(["mount", "-o", "remount,ro", str(fs)], check=True)
    else:
        _fill(fs)
    mnt = tmp_path / "mnt-degraded"
    mnt.mkdir()
    result = run_faultfs("mount", str(mnt), "--store", str(store), "--prefetch-mb", "0")
    assert result.returncode == 0, result.stderr
    assert "warning: store" in result.stderr and "cannot be written" in result.stderr
    try:
        assert read(mnt / "field" / "field.bin") == data
        stats = json.loads(read(mnt / ".faultfs" / "stats"))
        c = stats["counters"]
        assert stats["store_degraded"]
        assert c["hits"] >= 2 and c["source_reads"] >= 2 and c["stored"] == 0
        assert "DEGRADED" in run_faultfs("stat", str(mnt)).stdout
    finally:
        run_faultfs("umount", str(mnt))


def test_changes_to_the_tree_are_refused_with_what_a_user_expects(mounter, sample):
    import errno

    m = mounter(sample(3 * MiB), args=["--chunk-size", "1M", "--page-size", "1M"])
    tag = m.tag("field")
    for name in ("chunk_0", "field.bin", "page:0", ".pagemap"):
        path = os.path.join(tag, name)
        for call in (os.unlink, lambda p: os.rename(p, os.path.join(tag, "x"))):
            with pytest.raises(OSError) as info:
                call(path)
            assert info.value.errno == errno.EPERM, (name, info.value)
    expected = {  # as a local file system answers, and "not here" where it would take it
        lambda: os.rmdir(tag): errno.ENOTEMPTY,  # a tag always holds its view
        lambda: os.rmdir(os.path.join(tag, "chunk_0")): errno.ENOTDIR,
        lambda: os.rmdir(os.path.join(tag, "nothing")): errno.ENOENT,
        lambda: os.mkdir(os.path.join(tag, "chunk_0")): errno.EEXIST,
        lambda: os.mkdir(os.path.join(tag, "d")): errno.EPERM,  # not EROFS: the mount is
        lambda: os.symlink("x", os.path.join(tag, "l")): errno.EPERM,  # writable
        lambda: os.link(os.path.join(tag, "chunk_0"), os.path.join(tag, "h")): errno.EPERM,
        lambda: os.mkfifo(os.path.join(tag, "f")): errno.EPERM,
        lambda: os.mkdir(os.path.join(m.path, "newtag")): errno.EPERM,
        lambda: os.stat(os.path.join(tag, "n" * 256)): errno.ENAMETOOLONG,
        lambda: open(os.path.join(tag, "n" * 256), "wb"): errno.ENAMETOOLONG,
        lambda: os.mkdir(os.path.join(tag, "n" * 256)): errno.ENAMETOOLONG,
    }
    for call, want in expected.items():
        with pytest.raises(OSError) as info:
            call()
        assert info.value.errno == want, (want, info.value)
    with open(os.path.join(tag, "n" * 255), "wb") as f:  # NAME_MAX itself is a name
        f.write(b"ok")
    ro = mounter(sample(MiB, name="ro.bin"), store=m.store + "-ro", args=["--read-only"])
    for call in (lambda: os.mkdir(os.path.join(ro.tag("ro"), "d")),
                 lambda: os.mkfifo(os.path.join(ro.tag("ro"), "f"))):
        with pytest.raises(OSError) as info:
            call()
        assert info.value.errno == errno.EROFS  # where nothing is taken, it says so
    result = subprocess.run(["rm", "-f", os.path.join(tag, "chunk_1")], capture_output=True,
                            text=True)
    assert "Operation not permitted" in result.stderr and "not implemented" not in result.stderr


def test_the_stats_file_has_the_size_of_its_document(mounter, sample):
    m = mounter(sample(1000))
    path = os.path.join(m.path, ".faultfs", "stats")
    size = os.stat(path).st_size
    assert size > 100
    data = read(path)
    assert abs(len(data) - size) < 64 and json.loads(data)["counters"]


@pytest.mark.parametrize(("args", "message"), [
    (["--blob-prefix", "page:"], "blob prefix 'page:' would name chunks like pages"),
    (["--blob-prefix", ".x"], "blob prefix '.x' would name chunks like pages or hidden"),
    (["--tag", "a\nb"], "tag name 'a\\nb' contains a control character"),
    (["--tag", "page:1"], "tag name 'page:1' starts with 'page:'"),
    (["--reserve-mb", "9" * 30], "--reserve-mb must be at most"),
    (["--io-threads", "100000"], "--io-threads must be at most"),
])
def test_more_bad_input_is_one_clear_line(tmp_path, sample, args, message):
    from conftest import run_faultfs

    (tmp_path / "mnt").mkdir()
    result = run_faultfs("mount", sample(1000), str(tmp_path / "mnt"), "--store",
                         str(tmp_path / "store"), *args)
    if os.path.ismount(tmp_path / "mnt"):  # accepted after all: leave nothing mounted
        run_faultfs("umount", str(tmp_path / "mnt"))
    assert result.returncode in (1, 2)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "unexpected" not in lines[0], lines
    assert not (tmp_path / "store").exists()


def test_names_that_are_not_utf8_and_unparsable_urls_are_one_clear_line(tmp_path):
    from conftest import run_faultfs

    (tmp_path / "mnt").mkdir()
    bad = os.path.join(os.fsencode(tmp_path), b"data\xff.bin")
    with open(bad, "wb") as f:
        f.write(b"x" * 1000)
    for source, message in ((os.fsdecode(bad), "is not valid UTF-8"),
                            ("http://[::1/x", "source URL (http://…) is not usable")):
        result = run_faultfs("mount", source, str(tmp_path / "mnt"), "--store",
                             str(tmp_path / "store"))
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 1 and len(lines) == 1, lines
        assert message in lines[0] and "unexpected" not in lines[0], lines
    result = run_faultfs("warm", os.fsdecode(bad))
    assert result.returncode == 1 and "Traceback" not in result.stderr


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_a_tag_grown_to_16_tib_lists_and_du_costs_what_is_written(mounter, sample):
    """One byte written at 2^44-1 made the tag list 16.7 M chunk_N names: ls, find and du
    never finished, and the daemon grew by hundreds of MiB. A tag lists the source's chunks
    and those written past it; a hole is still found by name and holds no blocks."""
    src = sample(3 * MiB)
    m = mounter(src, args=["--chunk-size", "1M"])
    tag = m.tag("field")
    view = os.path.join(tag, "field.bin")
    fd = os.open(view, os.O_WRONLY)
    try:
        os.pwrite(fd, b"x", (1 << 44) - 1)
        os.pwrite(fd, b"y" * 10, 7 * MiB)
    finally:
        os.close(fd)
    before = _rss_kib(m.pid)
    last = (1 << 44) // MiB - 1
    listed = sorted(os.listdir(tag))
    assert listed == sorted(["field.bin", "chunk_0", "chunk_1", "chunk_2", "chunk_7",
                             f"chunk_{last}"])
    found = subprocess.run(["find", tag], capture_output=True, text=True, timeout=60)
    assert len(found.stdout.splitlines()) == 7
    du = subprocess.run(["du", "-s", "--block-size=1", tag], capture_output=True, text=True,
                        timeout=60)
    assert int(du.stdout.split()[0]) < 64 * MiB, du.stdout  # not 16 TiB: what is held
    subprocess.run(["ls", "-l", tag], capture_output=True, timeout=60, check=True)
    assert _rss_kib(m.pid) - before < 32 * 1024, "the daemon grew while listing"
    hole = os.path.join(tag, "chunk_1000")
    st = os.stat(hole)
    assert st.st_size == MiB and st.st_blocks <= 8  # one block: never taken for a hole
    assert read(hole) == bytes(MiB)
    assert os.stat(os.path.join(tag, "chunk_7")).st_blocks * 512 >= MiB
    with open(os.path.join(tag, f"chunk_{last}"), "rb") as f:
        f.seek(MiB - 1)
        assert f.read() == b"x"


def test_growing_a_view_whose_chunk_was_opened_costs_what_is_written(mounter, sample):
    """``ftruncate`` of the view to 16 TiB after a chunk of the tag was opened dropped the
    kernel's cache of every chunk the growth spans, one range per chunk: the whole mount froze
    for 38-43 s and the daemon took 4.4 GiB, a read of another tag waiting 34 s. It costs
    what the opened names hold now; growing, shrinking and growing again."""
    src, other = sample(4 * MiB), sample(MiB, name="other.bin")
    m = mounter(src, other, args=["--chunk-size", "1M"])
    tag = m.tag("field")
    read(os.path.join(tag, "chunk_0"))
    before = _rss_kib(m.pid)
    fd = os.open(os.path.join(tag, "field.bin"), os.O_RDWR)
    try:
        for size in (1 << 44, 4 * MiB, 1 << 44):
            os.ftruncate(fd, size)
            assert read(os.path.join(m.tag("other"), "chunk_0")) == read(other)[:MiB]
        assert os.pread(fd, 4, 1 << 43) == bytes(4)
    finally:
        os.close(fd)
    assert _rss_kib(m.pid) - before < 64 * 1024, "the daemon grew with the view's size"
    assert len(os.listdir(tag)) == 5  # the view and the source's 4 chunks


def test_du_of_a_sparse_user_blob_is_what_it_holds(mounter, sample):
    """``truncate -s 1G`` of a user blob made ``du`` show 1 GiB while the store held under
    1 MiB for it; a user blob's blocks are its parts, not its holes."""
    m = mounter(sample(MiB), args=["--chunk-size", "1M"])
    big = os.path.join(m.tag("field"), "big")
    run("truncate", "-s", "1G", big)
    st = os.stat(big)
    assert st.st_size == 1 << 30 and 1 <= st.st_blocks * 512 <= 2 * MiB, st
    with open(big, "r+b") as f:
        f.seek(512 * MiB)
        f.write(b"z" * (3 * MiB))
    held = os.stat(big).st_blocks * 512
    assert 3 * MiB <= held <= 6 * MiB, held
    dense = os.path.join(m.tag("field"), "dense")
    with open(dense, "wb") as f:
        f.write(b"d" * (5 * MiB + 7))
    assert os.stat(dense).st_blocks * 512 >= 5 * MiB + 7
    du = subprocess.run(["du", "-s", "--block-size=1", m.tag("field")], capture_output=True,
                        text=True, timeout=60, check=True)
    assert int(du.stdout.split()[0]) < 64 * MiB, du.stdout


def test_a_mount_started_on_a_full_store_takes_writes_once_space_returns(
        mounter, sample, small_fs, tmp_path):
    """A mount started on a full store refused every write with EROFS for its whole life,
    also after space was freed; a mount that fills up while it runs answers ENOSPC and
    takes writes again when space returns, and so does this one now (faults are stored
    again too)."""
    import errno

    from conftest import run_faultfs

    src = sample(8 * MiB)
    data = read(src)
    cs = 256 * KiB
    fs = small_fs(16 * 1024, inodes=200)
    store = fs / "store"
    m = mounter(src, store=str(store), args=["--chunk-size", "256K", "--prefetch-mb", "0"])
    assert read(os.path.join(m.tag("field"), "chunk_0")) == data[:cs]
    m.umount()
    _fill(fs)
    mnt = tmp_path / "mnt-full"
    mnt.mkdir()
    result = run_faultfs("mount", str(mnt), "--store", str(store), "--prefetch-mb", "0",
                         "--reserve-mb", "0")
    assert result.returncode == 0, result.stderr
    view = mnt / "field" / "field.bin"
    try:
        fd = os.open(view, os.O_WRONLY)
        try:
            with pytest.raises(OSError) as info:
                os.pwrite(fd, b"x" * 100_000, 100)
        finally:
            os.close(fd)
        assert info.value.errno == errno.ENOSPC, info.value  # full, not read-only
        assert "ENOSPC until space returns" in result.stderr, result.stderr
        for name in os.listdir(fs):  # space returns
            if name != "store":
                os.unlink(fs / name)
        with open(view, "r+b") as f:
            f.seek(100)
            f.write(b"written after")
        index = 1  # a fault not stored probes the store again (every 5 s at most)
        while json.loads(read(mnt / ".faultfs" / "stats"))["store_degraded"]:
            assert index < 31, "the store stayed degraded"
            assert read(mnt / "field" / f"chunk_{index}") == data[index * cs:(index + 1) * cs]
            index += 1
            time.sleep(0.4)
        stored = json.loads(read(mnt / ".faultfs" / "stats"))["counters"]["stored"]
        assert read(mnt / "field" / "chunk_31") == data[31 * cs:]
        deadline = time.monotonic() + 10
        while json.loads(read(mnt / ".faultfs" / "stats"))["counters"]["stored"] == stored:
            assert time.monotonic() < deadline, "a fault after space returned was not stored"
            time.sleep(0.05)
    finally:
        run_faultfs("umount", str(mnt), check=True)
    m2 = mounter(store=str(store), mountpoint=str(mnt))
    got = read(os.path.join(m2.tag("field"), "field.bin"))
    assert got[100:113] == b"written after" and got[113:] == data[113:]
