"""Case 4: a store on a tiny file system (a tmpfs of its own), out of bytes or out of inodes,
with and without the free-space reserve.

Reads: a source several times larger than the file system is read whole, three times over,
through the view and the chunk files (no memory tier, no prefetch, so every pass faults), and
every byte is compared with the source. A full file system must make the store back off —
``store_failures`` counted, then the next 256 faults served from the source without trying
(``readthrough_backoff``) — and the reserve must keep the store from ever filling the file
system (``skipped_reserve``, no store failure, the reserve still free at the end).

Writes: 64 KiB blocks are written through the view until the store has no room; the writer
must get ENOSPC (never EIO, never silence), everything acknowledged before it must read back,
the refused write must have changed nothing — and all of that again after an unmount and a
remount of the full store (which mounts degraded: the journal is replayed read-only).
"""

from __future__ import annotations

import errno
import os

from faultfs.testing.torture.harness import (
    Budget,
    CaseResult,
    KiB,
    MiB,
    Run,
    TortureError,
    diff_bytes,
    read_all,
)

NAME = "store on a tiny file system"
CS = 64 * KiB
BACKOFF_FAULTS = 256  # faultfs's back-off after a full store (README: "the next 256 faults")


def _read_passes(m, tag: str, data: bytes, passes: int) -> tuple[int, int]:
    """Read the view and every chunk file ``passes`` times; (reads, corrupt bytes)."""
    reads = bad = 0
    view = os.path.join(m.tag(tag), f"{tag}.bin")
    for _ in range(passes):
        with open(view, "rb") as f:
            for off in range(0, len(data), CS):
                got = f.read(CS)
                bad += diff_bytes(got, data[off:off + CS])
                reads += 1
        for i in range(-(-len(data) // CS)):
            got = read_all(os.path.join(m.tag(tag), f"chunk_{i}"))
            bad += diff_bytes(got, data[i * CS:(i + 1) * CS].ljust(CS, b"\0"))
            reads += 1
        _drop_page_cache(m.path)
    return reads, bad


def _drop_page_cache(path: str) -> None:
    """Forget the mount's cached pages, so the next pass reaches the daemon again."""
    for base, _, files in os.walk(path):
        if ".faultfs" in base:
            continue
        for name in files:
            fd = os.open(os.path.join(base, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def reads_case(run: Run, res: CaseResult, label: str, *, size_kb: int, inodes: int | None,
               reserve_mb: int, passes: int) -> None:
    fs = run.tmpfs("tiny", size_kb, inodes)
    tag = f"tiny{len(res.held) + len(res.failed)}"
    size = (12 if run.quick else 24) * MiB  # larger than the file system, than the reserve
    src, data = run.make_source(f"{tag}.bin", size, seed=run.seed + 40 + size_kb)
    m = run.mount(src, store=os.path.join(fs, "store"), reserve_mb=reserve_mb,
                  args=["--chunk-size", str(CS), "--prefetch-mb", "0", "--memory-mb", "0"])
    try:
        reads, bad = _read_passes(m, tag, data, passes)
        st = m.stats()
    finally:
        m.umount()
        run.drop_tmpfs(fs)
    c = st["counters"]
    res.operations += reads
    res.trials += 1
    what = (f"{label}: {reads} reads right, {c['stored']} stored, {c['store_failures']} "
            f"store failures, {c['readthrough_backoff']} faults backed off, "
            f"{c['skipped_reserve']} kept out by the free-space check")
    if bad:
        res.failed.append(f"{label}: {bad} corrupt bytes")
        return
    if reserve_mb:
        free = st["store_free_bytes"]
        res.check(c["store_failures"] == 0 and c["skipped_reserve"] > 0
                  and free >= reserve_mb * MiB - CS - 4 * KiB, f"{what}, the reserve free",
                  f"{what}; {free} bytes free at the end (reserve {reserve_mb} MiB)")
    else:
        # Out of bytes, the store checks the free space before each write, so it rarely meets
        # ENOSPC (a race with another write of the same file system can). Out of inodes, every
        # new blob file fails. Each failure (concurrent faults may fail together) sets a
        # back-off of 256 faults read through without trying; after it, storing is tried
        # again — out of inodes it fails again (a second failure), out of bytes the free-space
        # check may keep it out instead.
        fails, backoff = c["store_failures"], c["readthrough_backoff"]
        counted = (fails == 0 and backoff == 0) or \
            BACKOFF_FAULTS <= backoff <= BACKOFF_FAULTS * fails
        retried = fails >= 2 if inodes else (fails > 0 or c["skipped_reserve"] > 0)
        res.check(counted and retried, what + (" (never ENOSPC)" if fails == 0 else ""),
                  f"{what}: the back-off was not counted as it must be (none without a "
                  "failure, 256 to 256 per failure with one, and storing tried again after it)")


def writes_case(run: Run, res: CaseResult, label: str, *, size_kb: int, reserve_mb: int
                ) -> None:
    fs = run.tmpfs("tiny", size_kb)
    tag = f"tinyw{len(res.held) + len(res.failed)}"
    src, data = run.make_source(f"{tag}.bin", 8 * MiB, seed=run.seed + 50 + size_kb)
    store = os.path.join(fs, "store")
    m = run.mount(src, store=store, reserve_mb=reserve_mb,
                  args=["--chunk-size", str(CS), "--dirty-mb", "1", "--journal-mb", "1",
                        "--prefetch-mb", "0"])
    view = os.path.join(m.tag(tag), f"{tag}.bin")
    model = bytearray(data)
    err: OSError | None = None
    acknowledged = 0
    fd = os.open(view, os.O_RDWR)
    try:
        for i in range(len(data) // CS):
            block = bytes([i % 250 + 1]) * CS
            try:
                os.pwrite(fd, block, i * CS)
                os.fsync(fd)
            except OSError as exc:
                err = exc
                break
            model[i * CS:(i + 1) * CS] = block
            acknowledged += 1
    finally:
        os.close(fd)
    res.operations += acknowledged + 1
    res.trials += 1
    problems = []
    if err is None:
        problems.append("the writer filled the whole view without ENOSPC (the file system "
                        "was not small enough)")
    elif err.errno != errno.ENOSPC:
        problems.append(f"the writer got {errno.errorcode.get(err.errno or 0)} instead of "
                        "ENOSPC")
    bad = diff_bytes(read_all(view), bytes(model))
    if bad:
        problems.append(f"{bad} bytes differ from the acknowledged writes")
    umount_error = ""
    try:
        m.umount()
    except TortureError as exc:
        umount_error = str(exc)
        m.close()
    try:
        m2 = run.mount(store=store, reserve_mb=reserve_mb)
    except TortureError as exc:
        problems.append(f"the full store could not be remounted: {exc}")
    else:
        try:
            after = read_all(os.path.join(m2.tag(tag), f"{tag}.bin"))
            bad = diff_bytes(after, bytes(model))
            if bad:
                problems.append(f"after the remount {bad} bytes differ from the acknowledged "
                                f"writes ({len(after)} bytes read)")
        finally:
            m2.umount()
    run.drop_tmpfs(fs)
    what = (f"{label}: ENOSPC after {acknowledged} blocks of 64 KiB, all acknowledged "
            "intact, also remounted")
    if umount_error:
        res.notes.append(f"{label}: unmount of the full store: {umount_error}")
    res.check(not problems, what, f"{label}: " + "; ".join(problems))


def run_case(run: Run, budget: Budget, res: CaseResult) -> None:
    passes = 1 if run.quick else 3
    subcases = [
        (reads_case, "6 MiB, no reserve",
         {"size_kb": 6 * 1024, "inodes": None, "reserve_mb": 0, "passes": passes}),
        (reads_case, "48 inodes, no reserve",
         {"size_kb": 64 * 1024, "inodes": 48, "reserve_mb": 0, "passes": passes}),
        (reads_case, "16 MiB, reserve 8 MiB",
         {"size_kb": 16 * 1024, "inodes": None, "reserve_mb": 8, "passes": passes}),
        (writes_case, "writes to 3 MiB", {"size_kb": 3 * 1024, "reserve_mb": 0}),
        (writes_case, "writes to 4 MiB, reserve 1 MiB", {"size_kb": 4 * 1024, "reserve_mb": 1}),
    ]
    if run.quick:  # the back-off, the reserve and a full store's writes
        subcases = [subcases[1], subcases[2], subcases[3]]
    for done, (fn, label, kw) in enumerate(subcases):
        if budget.over():
            res.out_of_time(done, len(subcases), "parts")
            break
        try:
            fn(run, res, label, **kw)
        except TortureError as exc:
            res.failed.append(f"{label}: {exc}")
