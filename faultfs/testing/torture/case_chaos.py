"""Case 5: a chaos source — an HTTP source behind ``faultfs.testing.proxy.LatencyProxy`` with a
``FaultPlan`` that answers 503, resets connections before and during the body, stalls a body
without end and truncates bodies.

Two mounts of the source (64 KiB chunks, no memory tier, no prefetch): one stages what it
reads, one never stores (``--no-store``: every read asks the source). Phases:
1. "1 in 10": about one request in five breaks (503 one in ten, the rest spread over resets
   before the head and in the body, stalls and truncations) while 8 threads read random
   ranges of the view and the chunk files, half through each mount (the staging mount's
   readers stay in the first half; a stalled body never resumes, in ``--quick`` it
   resumes after 2 s; 40 s, 3 s in ``--quick``);
2. "storm": every request answers 503, and reads that need the source (unstaged chunks of
   the last quarter, anything through the read-through mount) must fail with EIO, promptly;
3. "calm": no faults; every byte of the view and of every chunk file is read and compared
   (nothing wrong was staged while the source misbehaved).

What must hold: every read returned the source's bytes or failed with EIO, never wrong bytes
and never another error; no read took longer than the bound the retry policy implies
(``READ_BOUND_S``); the storm's reads all failed with EIO; the calm pass read every byte right.
"""

from __future__ import annotations

import errno
import os
import random
import threading
import time

from faultfs.testing.httpd import RangeHttpServer
from faultfs.testing.proxy import FaultPlan, FaultRule, LatencyProxy
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
from faultfs.warm import chunk_staged, staged_chunks

NAME = "chaos HTTP source"
CS = 64 * KiB
SOURCE_SIZE = 32 * MiB + 999  # half of it in --quick
READERS = 8
STORM_READS = 12
# faultfs tries a request 5 times; each try may wait out a 15 s read timeout (a stalled body)
# or a 5 s connect timeout, with at most 0.2+0.4+0.8+1.6 s of back-off between: 80 s at worst
# for one fault. A read touches at most a few chunks, faulted at once.
READ_BOUND_S = 90.0


def chaos_plan(seed: int, stall_s: float | None) -> FaultPlan:
    gets = lambda method, path: method == "GET"  # noqa: E731 - the mount's HEAD is spared
    return FaultPlan(
        FaultRule("status", fraction=0.10, status=503, match=gets),
        FaultRule("reset", fraction=0.03, after_bytes=None, match=gets),
        FaultRule("reset", fraction=0.03, after_bytes=16 * KiB, match=gets),
        FaultRule("truncate", fraction=0.03, match=gets),
        FaultRule("stall", fraction=0.02, after_bytes=8 * KiB, stall_s=stall_s, match=gets),
        seed=seed)


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ok = self.eio = self.wrong = self.wrong_bytes = self.slow = 0
        self.other: dict[str, int] = {}
        self.longest = 0.0

    def add(self, outcome: str, seconds: float, bad: int = 0) -> None:
        with self.lock:
            self.longest = max(self.longest, seconds)
            if seconds > READ_BOUND_S:
                self.slow += 1
            if outcome == "ok":
                self.ok += 1
            elif outcome == "EIO":
                self.eio += 1
            elif outcome == "wrong":
                self.wrong += 1
                self.wrong_bytes += bad
            else:
                self.other[outcome] = self.other.get(outcome, 0) + 1


def _timed_read(path: str, off: int, n: int, *,
                uncached: bool = False) -> tuple[str, bytes, float]:
    """``uncached``: drop the kernel's cached pages of the file first (chunk files keep
    them across opens), so that the read reaches the daemon."""
    t0 = time.monotonic()
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            if uncached:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            got = os.pread(fd, n, off)
        finally:
            os.close(fd)
    except OSError as exc:
        return errno.errorcode.get(exc.errno or 0, str(exc.errno)), b"", time.monotonic() - t0
    return "ok", got, time.monotonic() - t0


def _expected(data: bytes, name: str, off: int, n: int) -> bytes:
    if name.startswith("chunk_"):
        base = int(name[6:]) * CS
        want = data[base + off:base + min(CS, off + n)]
        return want.ljust(max(0, min(CS, off + n) - off), b"\0")
    return data[off:off + n]


def _reader(tag_dir: str, data: bytes, seed: int, until: float, tally: Tally,
            limit: int) -> None:
    """Random reads of the view and the chunk files within the first ``limit`` bytes."""
    rng = random.Random(f"chaos:{seed}")
    chunks = -(-limit // CS)
    while time.monotonic() < until:
        if rng.random() < 0.5:
            name, size = "chaos.bin", limit
        else:
            name, size = f"chunk_{rng.randrange(chunks)}", CS
        off = rng.randrange(size)
        n = min(rng.choice((4 * KiB, 64 * KiB, 200 * KiB)), size - off)
        outcome, got, took = _timed_read(os.path.join(tag_dir, name), off, n)
        if outcome == "ok":
            want = _expected(data, name, off, n)
            if got != want:
                tally.add("wrong", took, diff_bytes(got, want))
                continue
        tally.add(outcome, took)


def _run_threads(targets: list, bound: float) -> int:
    """Start one thread per ``(fn, args)``; how many were still running ``bound`` s later."""
    threads = [threading.Thread(target=fn, args=args, daemon=True) for fn, args in targets]
    for t in threads:
        t.start()
    deadline = time.monotonic() + bound
    for t in threads:
        t.join(max(0.1, deadline - time.monotonic()))
    return sum(t.is_alive() for t in threads)


def run_case(run: Run, budget: Budget, res: CaseResult) -> None:
    size = SOURCE_SIZE - (16 * MiB if run.quick else 0)
    _, data = run.make_source("chaos-origin.bin", size, seed=run.seed + 5)
    server = RangeHttpServer()
    server.put("/chaos.bin", data)
    run.on_close(server.close)
    proxy = LatencyProxy("127.0.0.1", server.port, delay_ms=1, conn_mbps=None,
                         idle_timeout_s=300).start()
    run.on_close(proxy.close)
    url = f"{proxy.url}/chaos.bin"
    args = ["--chunk-size", str(CS), "--prefetch-mb", "0", "--memory-mb", "0"]
    # one mount that stages what it reads, one that never does (every read asks the source)
    staging = run.mount(url, store=run.fresh_dir("chaos-store"), args=args)
    through = run.mount(url, store=run.fresh_dir("chaos-store"), args=[*args, "--no-store"])
    tag, tag_through = staging.tag("chaos"), through.tag("chaos")
    chunks = -(-len(data) // CS)
    # the staging mount's readers stay in the first half; the kernel's readahead (4 MiB) may
    # stage a little past it, never the last quarter, which the storm reads
    kept = chunks // 2
    phase_s = 3.0 if run.quick else 40.0
    storm_reads = STORM_READS // 2 if run.quick else STORM_READS
    # a stall without end is outlived by the source's 15 s read timeout; --quick stalls
    # bodies for 2 s instead (they must be waited out, not cut short into wrong bytes)
    proxy.set_faults(chaos_plan(run.seed, stall_s=2.0 if run.quick else None))
    tally = Tally()
    until = time.monotonic() + phase_s
    jobs = [(_reader, (tag if i % 2 else tag_through, data, run.seed * 100 + i, until, tally,
                       kept * CS if i % 2 else len(data))) for i in range(READERS)]
    hung = _run_threads(jobs, phase_s + READ_BOUND_S + 10)
    faults = dict(proxy.stats(log=False).get("faults", {}))
    if hung:
        staging.close()  # aborts the connections: the hung readers return
        through.close()
        raise TortureError(f"{hung} readers still inside a read {READ_BOUND_S:.0f} s after "
                           "the phase ended")
    # the storm: every request fails, so every read that needs the source must answer EIO
    proxy.set_faults(FaultPlan(FaultRule("status", fraction=1.0, status=503), seed=run.seed))
    storm = Tally()
    here = staged_chunks(tag)
    if here is None:
        raise TortureError(f"the staging mount gave no staged bitmap of {tag}")
    unstaged = [i for i in range(chunks * 3 // 4, chunks)
                if chunk_staged(here, i, os.path.join(tag, f"chunk_{i}")) is False]
    picked = [(tag, i) for i in random.Random(run.seed).sample(
        unstaged, min(storm_reads, len(unstaged)))]
    picked += [(tag_through, i) for i in random.Random(run.seed + 1).sample(
        range(chunks), storm_reads)]

    def storm_read(where: str, i: int) -> None:
        # (a chunk the chaos phase read whole may sit in the page cache: served from there,
        # a read in a storm would never reach the daemon, and rightly answer its bytes)
        outcome, _, took = _timed_read(os.path.join(where, f"chunk_{i}"), 0, CS, uncached=True)
        storm.add(outcome if outcome != "ok" else "served in a storm", took)

    if _run_threads([(storm_read, p) for p in picked], READ_BOUND_S + 10):
        staging.close()
        through.close()
        raise TortureError("a read hung in the storm")
    # the calm: every byte right, what was staged under the chaos included
    proxy.set_faults(None)
    bad = diff_bytes(read_all(os.path.join(tag, "chaos.bin")), data)
    for i in range(chunks):
        bad += diff_bytes(read_all(os.path.join(tag, f"chunk_{i}")),
                          data[i * CS:(i + 1) * CS].ljust(CS, b"\0"))
    bad += diff_bytes(read_all(os.path.join(tag_through, "chaos.bin")), data)
    c, ct = staging.counters(), through.counters()
    staging.umount()
    through.umount()
    res.trials = 3
    res.operations = tally.ok + tally.eio + tally.wrong + sum(tally.other.values()) + \
        len(picked) + chunks + 2
    broke = sum(faults.values())
    res.notes.append(f"faults struck by the proxy in the first phase: {faults}; fault errors "
                     f"{c['fault_errors']} (staging) and {ct['fault_errors']} (read-through)")
    res.check(tally.wrong == 0 and not tally.other,
              f"{tally.ok:,} reads right and {tally.eio} EIO under {broke} injected faults, "
              "0 wrong bytes",
              f"{tally.wrong} reads with wrong bytes ({tally.wrong_bytes} bytes), other "
              f"errors {tally.other}")
    res.check(tally.slow == 0 and storm.slow == 0,
              f"longest read {max(tally.longest, storm.longest):.1f} s (bound "
              f"{READ_BOUND_S:.0f} s), none hung",
              f"{tally.slow + storm.slow} reads over {READ_BOUND_S:.0f} s")
    res.check(storm.eio == len(picked) and len(picked) > storm_reads and not storm.other,
              f"storm: {storm.eio} of {len(picked)} reads EIO, in at most "
              f"{storm.longest:.1f} s",
              f"storm: {storm.eio} EIO and {storm.other} of {len(picked)} reads")
    res.check(bad == 0, "calm: every byte right, what was staged under the chaos included",
              f"calm: {bad} bytes wrong after the chaos")
    if broke == 0:
        res.failed.append("the proxy broke no request: the case proved nothing")
