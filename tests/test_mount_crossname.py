"""Writes through several names of one tag's bytes at once (issue 41): the view, chunk_N and
page:N, by pwrite and through shared writable mmaps — no deadlock, every name reads what was
written, and no dirty mapped page lands over a later write.

Each case runs its writers as child processes under a deadline: a wedged mount fails the test
(the FUSE connection is then aborted, so nothing stays stuck in the kernel), never hangs it.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from faultfs.fuse import connection

pytestmark = pytest.mark.mount

MiB = 1 << 20
DEADLINE_S = 60.0


def run_children(mount, scripts: list[str], deadline: float = DEADLINE_S) -> list[str]:
    """Run each script (python source; ``T`` is the tag directory) as a child at once, and
    return their outputs; a child still running at the deadline fails the test after the
    mount's connection was aborted. What the children say on stderr is printed."""
    with contextlib.ExitStack() as stack:
        # files, not pipes: a pipe could fill and block a child
        outs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in scripts]
        errs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in scripts]
        procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(s)], text=True,
                                  stdout=out, stderr=err, env={**os.environ, "T": mount.tag("src")})
                 for s, out, err in zip(scripts, outs, errs, strict=True)]
        end = time.monotonic() + deadline
        while time.monotonic() < end and any(p.poll() is None for p in procs):
            time.sleep(0.05)
        stuck = [p.pid for p in procs if p.poll() is None]
        if stuck:
            stacks = {pid: _stack(pid) for pid in stuck}
            entry = connection.find_mount(mount.path)  # (a wedged mount's stat would hang)
            if entry is not None:
                connection.abort(entry.minor)
            for p in procs:
                p.kill()
                p.wait(10)
        said = []
        for out, err in zip(outs, errs, strict=True):
            out.seek(0)
            err.seek(0)
            said.append((out.read(), err.read()))
    for _, err in said:
        if err:
            print(err)  # (shown with a failure)
    assert not stuck, f"writers {stuck} made no progress in {deadline:.0f} s: {stacks}"
    for p, (_, err) in zip(procs, said, strict=True):
        assert p.returncode == 0, err
    return [out for out, _ in said]


def _stack(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stack") as f:
            return f.read()
    except OSError as exc:
        return str(exc)


def test_a_dirty_mapped_page_of_the_view_and_a_write_through_a_chunk_do_not_deadlock(
        mounter, sample):
    """The README's own combination in one process: a shared writable map of the view holds
    a dirty page while chunk_0 is written at another place of the same chunk."""
    src = sample(4 * MiB, name="src.bin")
    m = mounter(src)
    out, = run_children(m, ["""
        import mmap, os
        T = os.environ["T"]
        v = os.open(f"{T}/src.bin", os.O_RDWR)
        m = mmap.mmap(v, 1 << 20)
        m[:4096] = b"x" * 4096
        c = os.open(f"{T}/chunk_0", os.O_RDWR)
        os.pwrite(c, b"y" * 4096, 8192)
        assert m[8192:12288] == b"y" * 4096, "the map sees the chunk's write"
        m.flush()
        assert os.pread(c, 4096, 0) == b"x" * 4096, "the chunk sees the map's write"
        print("ok")
    """], deadline=30)
    assert out.strip() == "ok"
    with open(src, "rb") as f:
        want = bytearray(f.read())
    want[:4096] = b"x" * 4096
    want[8192:12288] = b"y" * 4096
    with open(os.path.join(m.tag("src"), "src.bin"), "rb") as f:
        assert f.read() == want


def test_a_dirty_mapped_page_never_lands_over_a_later_write_through_another_name(
        mounter, sample):
    """Stores into a shared map of the view (not yet written back), then a write through
    chunk_0 into the same 4 KiB page, then the map's msync: both stay (a local file system's
    single page cache gives the same)."""
    src = sample(2 * MiB, name="src.bin")
    m = mounter(src)
    out, = run_children(m, ["""
        import mmap, os
        T = os.environ["T"]
        v = os.open(f"{T}/src.bin", os.O_RDWR)
        m = mmap.mmap(v, 1 << 20)
        m[0:100] = b"a" * 100                       # dirty, not written back
        c = os.open(f"{T}/chunk_0", os.O_RDWR)
        os.pwrite(c, b"b" * 100, 200)               # the same page, through another name
        m.flush()                                    # the map's page is written back now
        got = os.pread(c, 300, 0)
        print(got[:100] == b"a" * 100, got[200:300] == b"b" * 100)
    """], deadline=30)
    assert out.split() == ["True", "True"], out
    with open(os.path.join(m.tag("src"), "chunk_0"), "rb") as f:
        got = f.read(300)
    assert got[:100] == b"a" * 100 and got[200:300] == b"b" * 100


WRITER = """
    import mmap, os, random, sys, time
    T, mode, seed, secs = os.environ["T"], {mode!r}, {seed}, {secs}
    view = os.open(f"{{T}}/src.bin", os.O_RDWR)
    vm = mmap.mmap(view, 4 << 20)
    chunks = [os.open(f"{{T}}/chunk_{{i}}", os.O_RDWR) for i in range(4)]
    pages = [os.open(f"{{T}}/page:{{i}}", os.O_RDWR) for i in range(4)]
    rng = random.Random(seed)
    lo = {lo}  # this writer's bytes in every 4 KiB page: [lo, lo + 400)
    last = {{}}
    n = stale = 0
    end = time.monotonic() + secs
    while time.monotonic() < end:
        g = rng.randrange(1024) * 4096 + lo + rng.randrange(300)
        size = rng.randrange(1, 100)
        data = rng.randbytes(size)
        i, off = divmod(g, 1 << 20)
        if mode == "chunk":
            os.pwrite(chunks[i], data, off)
            got = [vm[g:g + size], os.pread(pages[i], size, off)]
        elif mode == "page":
            os.pwrite(pages[i], data, off)
            got = [vm[g:g + size], os.pread(chunks[i], size, off)]
        else:
            vm[g:g + size] = data
            vm.flush(g - g % 4096, 4096)
            got = [os.pread(chunks[i], size, off), os.pread(pages[i], size, off)]
        for b in range(size):
            last[g + b] = data[b]
        n += 1
        if any(x != data for x in got):
            stale += 1
            time.sleep(0.2)
            again = os.pread(chunks[i], size, off) == data
            print("stale", mode, g, size, [x == data for x in got], "later", again,
                  file=sys.stderr)
    print(n, stale, ";".join(f"{{k}}:{{v}}" for k, v in sorted(last.items())))
"""


def test_writers_through_the_view_chunks_and_pages_at_once_read_their_writes_everywhere(
        mounter, sample, tmp_path):
    """Three writers at once, each through another name (chunk_N by pwrite, page:N by pwrite,
    the view through a shared map with msync), each owning bytes of every 4 KiB page: no
    hang, every write reads back at once through the other two names, and the tag ends as
    the writers left it (also after a remount)."""
    src = sample(4 * MiB, name="src.bin")
    store = str(tmp_path / "store")
    m = mounter(src, store=store, args=["--page-size", "1M"])  # page:N is chunk_N
    outs = run_children(m, [WRITER.format(mode=mode, seed=seed, secs=6, lo=lo)
                            for seed, (mode, lo) in enumerate(
                                [("chunk", 0), ("page", 1024), ("map", 2048)])])
    with open(src, "rb") as f:
        want = bytearray(f.read())
    total = 0
    for out in outs:
        n, stale, last = out.split(" ", 2)
        total += int(n)
        assert int(stale) == 0, f"{stale} of {n} writes read stale through another name"
        for item in last.strip().split(";"):
            k, v = item.split(":")
            want[int(k)] = int(v)
    assert total > 100
    view = os.path.join(m.tag("src"), "src.bin")
    with open(view, "rb") as f:
        assert f.read() == want
    m.umount()
    m2 = mounter(store=store)
    with open(os.path.join(m2.tag("src"), "src.bin"), "rb") as f:
        assert f.read() == want
