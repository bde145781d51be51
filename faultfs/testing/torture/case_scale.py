"""Case 7: scale — many opens, many readers, a huge tag — with the daemon's file descriptors
and memory watched in ``/proc/<pid>``.

1. 10,000 open/pread/close cycles over the view, the chunk files and ``.faultfs/stats``, then
   512 files held open at once and closed (2,000 and 128 in ``--quick``): the daemon's descriptor count must come back to
   where it was, and its RSS must not grow past ``OPEN_RSS_SLACK``.
2. 64 reader threads for 30 s (3 s in ``--quick``) on a source larger than the memory tier,
   every byte compared: after a first pass (every blob staged, the memory tier full), RSS may
   not grow by more than ``READ_RSS_SLACK``, and the descriptor count stays within its idle value plus one
   per staged blob (the local tier keeps staged blob files open for hits, a bounded cache).
3. A tag of 1,048,576 chunks (a sparse 1 TiB source in 1 MiB chunks; an eighth of that in
   ``--quick``) listed whole with ``scandir``: every name arrives, and the daemon's peak RSS
   grows by at most ``LIST_RSS_SLACK`` (nothing is held per entry).
"""

from __future__ import annotations

import os
import random
import threading
import time

from faultfs.testing.torture.harness import (
    Budget,
    CaseResult,
    GiB,
    KiB,
    MiB,
    Run,
    daemon_rss,
    diff_bytes,
    fd_count,
    read_all,
)

NAME = "scale: fds, RSS, a huge tag"
OPEN_CYCLES = 10_000
HELD_OPEN = 512
READERS = 64
OPEN_RSS_SLACK = 16 * MiB
READ_RSS_SLACK = 32 * MiB
LIST_RSS_SLACK = 32 * MiB
FD_SLACK = 2  # a descriptor or two may be opened lazily (a log, a journal segment)
HUGE_CHUNKS = 1 << 20
BLOBS = 96  # the readers' source in 1 MiB chunks: more than the memory tier (64 MiB) holds


def opens(run: Run, res: CaseResult, cycles: int, held_open: int) -> None:
    src, data = run.make_source("scale.bin", 32 * MiB, seed=run.seed + 7)
    m = run.mount(src, store=run.fresh_dir("scale-store"), args=["--chunk-size", "1M"])
    tag = m.tag("scale")
    names = ["scale.bin", *(f"chunk_{i}" for i in range(32))]
    rng = random.Random(f"scale:{run.seed}")
    bad = 0

    def cycle() -> int:
        name = rng.choice(names)
        if rng.random() < 0.05:
            fd = os.open(os.path.join(m.path, ".faultfs", "stats"), os.O_RDONLY)
            os.pread(fd, 4096, 0)
            os.close(fd)
            return 0
        fd = os.open(os.path.join(tag, name), os.O_RDONLY)
        try:
            size = len(data) if name == "scale.bin" else MiB
            off = rng.randrange(size - 4096)
            got = os.pread(fd, 4096, off)
        finally:
            os.close(fd)
        base = 0 if name == "scale.bin" else int(name[6:]) * MiB
        return diff_bytes(got, data[base + off:base + off + 4096])

    for _ in range(500):  # warm: every chunk staged, every lazy descriptor opened
        bad += cycle()
    fd0, rss0 = fd_count(m.pid), daemon_rss(m.pid).get("VmRSS", 0)
    for _ in range(cycles):
        bad += cycle()
    fd1, rss1 = fd_count(m.pid), daemon_rss(m.pid).get("VmRSS", 0)
    held = [os.open(os.path.join(tag, names[i % len(names)]), os.O_RDONLY)
            for i in range(held_open)]
    for fd in held:
        os.pread(fd, 100, 0)
    fd_held = fd_count(m.pid)
    for fd in held:
        os.close(fd)
    time.sleep(0.2)  # releases are asynchronous in FUSE
    fd2, rss2 = fd_count(m.pid), daemon_rss(m.pid).get("VmRSS", 0)
    m.umount()
    res.trials += 1
    res.operations += cycles + 500 + held_open
    res.notes.append(f"opens: daemon fds {fd0} -> {fd1} after {cycles} cycles, {fd_held} "
                     f"with {held_open} files open, {fd2} after; RSS {rss0 / MiB:.0f} -> "
                     f"{rss1 / MiB:.0f} -> {rss2 / MiB:.0f} MiB")
    res.check(bad == 0 and fd1 <= fd0 + FD_SLACK and fd2 <= fd0 + FD_SLACK
              and max(rss1, rss2) <= rss0 + OPEN_RSS_SLACK,
              f"{cycles:,} open/close cycles and {held_open} held open: fds {fd0} -> "
              f"{fd2}, RSS +{(max(rss1, rss2) - rss0) / MiB:.1f} MiB",
              f"open/close: fds {fd0} -> {fd1} -> {fd2}, RSS {rss0 / MiB:.0f} -> "
              f"{max(rss1, rss2) / MiB:.0f} MiB, {bad} corrupt bytes")


def readers(run: Run, res: CaseResult, seconds: float) -> None:
    src, data = run.make_source("readers.bin", BLOBS * MiB, seed=run.seed + 8)
    m = run.mount(src, store=run.fresh_dir("scale-store"), args=["--chunk-size", "1M"])
    tag = m.tag("readers")
    fd_idle = fd_count(m.pid)
    # one pass first: every blob staged, the memory tier full; then RSS must stay flat
    warm_bad = diff_bytes(read_all(os.path.join(tag, "readers.bin")), data)
    rss_base = daemon_rss(m.pid).get("VmRSS", 0)
    lock = threading.Lock()
    counts = {"reads": 0, "bad": 0, "errors": 0}
    stop = time.monotonic() + seconds
    samples: list[tuple[float, int, int]] = []

    def reader(seed: int) -> None:
        rng = random.Random(f"scale-reader:{seed}")
        reads = bad = errors = 0
        fd = -1
        while time.monotonic() < stop:
            try:
                if fd < 0 or rng.random() < 0.1:
                    if fd >= 0:
                        os.close(fd)
                    fd = os.open(os.path.join(tag, "readers.bin"), os.O_RDONLY)
                off = rng.randrange(len(data))
                n = rng.choice((4 * KiB, 64 * KiB, 256 * KiB))
                got = os.pread(fd, n, off)
                bad += diff_bytes(got, data[off:off + n])
                reads += 1
            except OSError:
                errors += 1
                fd = -1
        if fd >= 0:
            os.close(fd)
        with lock:
            counts["reads"] += reads
            counts["bad"] += bad
            counts["errors"] += errors

    threads = [threading.Thread(target=reader, args=(run.seed * 100 + i,), daemon=True)
               for i in range(READERS)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        samples.append((time.monotonic() - t0, fd_count(m.pid),
                        daemon_rss(m.pid).get("VmRSS", 0)))
        time.sleep(0.25)
    for t in threads:
        t.join()
    time.sleep(0.3)
    fd_end = fd_count(m.pid)
    m.umount()
    res.trials += 1
    res.operations += counts["reads"]
    rss_warm, rss_max = rss_base, max(s[2] for s in samples)
    fd_max = max(s[1] for s in samples)
    counts["bad"] += warm_bad
    res.notes.append(f"readers: fds idle {fd_idle}, at most {fd_max} under load, {fd_end} "
                     f"after; RSS {rss_warm / MiB:.0f} MiB after a first pass, at most "
                     f"{rss_max / MiB:.0f} MiB; {counts['errors']} read errors")
    # the daemon keeps staged blob files open for hits (tiers/local/openfiles.py, at most one per blob)
    fd_bound = fd_idle + BLOBS + FD_SLACK
    fd_warm_max = fd_max
    res.check(counts["bad"] == 0 and counts["errors"] == 0 and fd_end <= fd_bound
              and fd_warm_max <= fd_bound and rss_max <= rss_warm + READ_RSS_SLACK,
              f"{READERS} readers for {seconds:.0f} s: {counts['reads']:,} reads correct, "
              f"fds {fd_idle} idle, at most {fd_max} ({BLOBS} staged blobs kept open), RSS "
              f"+{(rss_max - rss_warm) / MiB:.1f} MiB over a warm mount",
              f"{READERS} readers: {counts['bad']} corrupt bytes, {counts['errors']} errors, "
              f"fds {fd_idle} -> {fd_end}, RSS {rss_warm / MiB:.0f} -> {rss_max / MiB:.0f} MiB")


def huge_listing(run: Run, res: CaseResult, chunks: int) -> None:
    src = run.path("huge.bin")
    with open(src, "wb") as f:
        f.truncate(chunks * MiB)  # sparse: no byte of it is ever read
    m = run.mount(src, store=run.fresh_dir("scale-store"), args=["--chunk-size", "1M"])
    before = daemon_rss(m.pid)
    t0 = time.monotonic()
    seen = 0
    last = ""
    with os.scandir(m.tag("huge")) as it:
        for entry in it:
            seen += 1
            last = entry.name
    took = time.monotonic() - t0
    after = daemon_rss(m.pid)
    m.umount()
    res.trials += 1
    res.operations += seen
    grew = after.get("VmHWM", 0) - before.get("VmHWM", 0)
    res.notes.append(f"huge tag: {seen} entries in {took:.1f} s (last {last}); daemon VmHWM "
                     f"{before.get('VmHWM', 0) / MiB:.0f} -> {after.get('VmHWM', 0) / MiB:.0f} MiB")
    size = f"{chunks * MiB / GiB / 1024:.0f} TiB" if chunks * MiB >= 1024 * GiB else \
        f"{chunks * MiB / GiB:.0f} GiB"
    res.check(seen == chunks + 1 and grew <= LIST_RSS_SLACK,
              f"a {chunks:,}-chunk tag ({size}) listed in {took:.0f} s, daemon peak RSS "
              f"+{grew / MiB:.1f} MiB",
              f"huge tag: {seen} of {chunks + 1} entries, daemon peak RSS +{grew / MiB:.1f} MiB")


def run_case(run: Run, budget: Budget, res: CaseResult) -> None:
    if run.quick:
        opens(run, res, OPEN_CYCLES // 5, HELD_OPEN // 4)
    else:
        opens(run, res, OPEN_CYCLES, HELD_OPEN)
    readers(run, res, 3.0 if run.quick else 30.0)
    huge_listing(run, res, HUGE_CHUNKS // 8 if run.quick else HUGE_CHUNKS)
