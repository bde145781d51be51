"""Kill the daemon of a live mount again and again (or restart it with ``faultfs restart``)
under verifying readers and fsyncing writers, and report what they saw (DESIGN §16).

Readers (processes) read random ranges of chunk files and of the whole-object view, each
through a file they keep open and through fresh opens, and compare every byte with the source.
Writers (processes) write random blocks into a user blob of their own, fsync at random
points, and keep a model of every write that was answered; at the end each file must equal
its model (an answered write survives a kill -9 of the daemon). The mountpoint is checked
after every kill.

Printed: one table — kills, reader and writer operations, errors, wrong bytes, writer files
that differ from their model, and the stalls: per kill, the time until every reader has
finished an operation begun after it (median, p99, max), and the longest single operation.
Exit status 1 when anything failed. ``--quick`` is the short form a test runs.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAULTFS = [sys.executable, "-m", "faultfs.cli"]
MiB = 1 << 20


def faultfs(*args: str, timeout: float = 300, env: dict | None = None
            ) -> subprocess.CompletedProcess:
    return subprocess.run([*FAULTFS, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env={**os.environ, **(env or {})})


def reader(seed: int, src: str, tag: str, chunk: int, stop, out) -> None:
    rng = random.Random(seed)
    data = open(src, "rb").read()
    nchunks = len(data) // chunk
    view = os.path.join(tag, os.path.basename(src))
    kept = os.open(view, os.O_RDONLY)  # a file open across every kill
    ops: list[tuple[float, float]] = []
    errors: list[str] = []
    wrong = 0
    while not stop.is_set():
        size = rng.choice((4096, 65536, 262144))
        kind = rng.random()
        t0 = time.monotonic()
        try:
            if kind < 0.4:  # the kept view handle
                off = rng.randrange(len(data) - size)
                os.posix_fadvise(kept, off, size, os.POSIX_FADV_DONTNEED)
                got, want = os.pread(kept, size, off), data[off:off + size]
            elif kind < 0.7:  # a chunk file, opened fresh (lookup, open, read, release)
                i = rng.randrange(nchunks)
                off = rng.randrange(chunk - size)
                fd = os.open(os.path.join(tag, f"chunk_{i}"), os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, off, size, os.POSIX_FADV_DONTNEED)
                    got = os.pread(fd, size, off)
                finally:
                    os.close(fd)
                want = data[i * chunk + off:i * chunk + off + size]
            else:  # the view, opened fresh
                off = rng.randrange(len(data) - size)
                with open(view, "rb", buffering=0) as f:
                    os.posix_fadvise(f.fileno(), off, size, os.POSIX_FADV_DONTNEED)
                    got, want = os.pread(f.fileno(), size, off), data[off:off + size]
            wrong += got != want
        except OSError as exc:
            errors.append(f"reader {seed}: {exc}")
            time.sleep(0.05)
        ops.append((t0, time.monotonic()))
    os.close(kept)
    out.put({"ops": ops, "errors": errors, "wrong": wrong})


def writer(seed: int, tag: str, size: int, stop, out) -> None:
    rng = random.Random(1000 + seed)
    path = os.path.join(tag, f"writer{seed}.dat")
    model = bytearray(size)
    errors: list[str] = []
    ops: list[tuple[float, float]] = []
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.ftruncate(fd, size)
    fsyncs = 0
    while not stop.is_set():
        n = rng.choice((4096, 16384, 65536))
        off = rng.randrange(size - n) & ~4095
        block = rng.randbytes(n)
        t0 = time.monotonic()
        try:
            if os.pwrite(fd, block, off) != n:
                errors.append(f"writer {seed}: short write")
            model[off:off + n] = block  # answered: it must be there at the end
            if rng.random() < 0.2:
                os.fsync(fd)
                fsyncs += 1
        except OSError as exc:
            errors.append(f"writer {seed}: {exc}")
            time.sleep(0.05)
        ops.append((t0, time.monotonic()))
    try:
        os.fsync(fd)
        os.close(fd)
        with open(path, "rb") as f:
            differs = f.read() != model
    except OSError as exc:
        errors.append(f"writer {seed} at the end: {exc}")
        differs = True
    out.put({"ops": ops, "errors": errors, "differs": differs, "fsyncs": fsyncs})


def daemon_pid(mnt: str) -> int:
    with open(os.path.join(mnt, ".faultfs", "stats"), "rb") as f:
        return int(json.loads(f.read())["pid"])


def stalls(events: list[float], ops_by_reader: list[list[tuple[float, float]]]) -> list[float]:
    """Per event: the time until every reader finished an operation begun at or after it."""
    out = []
    for k in events:
        worst = 0.0
        for ops in ops_by_reader:
            done = [end for start, end in ops if start >= k or (start < k < end)]
            if done:
                worst = max(worst, min(done) - k)
        out.append(worst)
    return out


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="3 events, 1-2 s apart, 16 MiB")
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--gap", type=float, nargs=2, default=(2.0, 5.0), metavar=("MIN", "MAX"))
    p.add_argument("--restart", action="store_true",
                   help="`faultfs restart` instead of kill -9 (an upgrade)")
    p.add_argument("--readers", type=int, default=8)
    p.add_argument("--writers", type=int, default=2)
    p.add_argument("--size-mb", type=int, default=64)
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = p.parse_args()
    if args.quick:
        args.kills, args.gap, args.size_mb = 3, (1.0, 2.0), 16
    base = tempfile.mkdtemp(prefix="faultfs-restart-")
    src, mnt, store = (os.path.join(base, n) for n in ("field.bin", "mnt", "store"))
    os.mkdir(mnt)
    with open(src, "wb") as f:
        f.write(random.Random(7).randbytes(args.size_mb * MiB))
    # a torture kills far more often than the holder's default bound allows (5 in 60 s)
    env = {"FAULTFS_RESTARTS_MAX": str(args.kills + 5)}
    r = faultfs("mount", src, mnt, "--store", store, "--chunk-size", "1M", env=env)
    if r.returncode != 0:
        print(f"mount failed: {r.stderr.strip()}", file=sys.stderr)
        return 1
    tag = os.path.join(mnt, "field")
    stop = mp.Event()
    out: mp.Queue = mp.Queue()
    procs = [mp.Process(target=reader, args=(i, src, tag, MiB, stop, out))
             for i in range(args.readers)]
    procs += [mp.Process(target=writer, args=(i, tag, 4 * MiB, stop, out))
              for i in range(args.writers)]
    events: list[float] = []
    absent = 0
    failures: list[str] = []
    rng = random.Random(3)
    try:
        for proc in procs:
            proc.start()
        time.sleep(1.0)
        for _ in range(args.kills):
            time.sleep(rng.uniform(*args.gap))
            if args.restart:
                events.append(time.monotonic())
                done = faultfs("restart", mnt)
                if done.returncode != 0:
                    failures.append(f"restart: {done.stderr.strip()}")
            else:
                pid = daemon_pid(mnt)
                events.append(time.monotonic())
                os.kill(pid, signal.SIGKILL)
            absent += not os.path.ismount(mnt)
        time.sleep(2.0)
    finally:
        stop.set()
        results = [out.get(timeout=120) for _ in procs]
        for proc in procs:
            proc.join(30)
        stats = json.loads(open(os.path.join(mnt, ".faultfs", "stats"), "rb").read())
        um = faultfs("umount", mnt)
        if um.returncode != 0:
            failures.append(f"umount: {um.stderr.strip()}")
            subprocess.run(["fusermount3", "-u", "-z", mnt], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)
    readers = [x for x in results if "wrong" in x]
    writers = [x for x in results if "differs" in x]
    errors = [e for x in results for e in x["errors"]] + failures
    per_event = stalls(events, [x["ops"] for x in readers + writers])
    longest = max((end - start for x in results for start, end in x["ops"]), default=0.0)
    table = {
        "events": len(events), "kind": "faultfs restart" if args.restart else "kill -9",
        "takeovers": stats.get("daemon", {}).get("takeovers"),
        "reader_ops": sum(len(x["ops"]) for x in readers),
        "writer_ops": sum(len(x["ops"]) for x in writers),
        "fsyncs": sum(x["fsyncs"] for x in writers),
        "errors": len(errors), "wrong_reads": sum(x["wrong"] for x in readers),
        "writer_files_differing": sum(x["differs"] for x in writers),
        "mountpoint_absent": absent,
        "stall_median_s": round(statistics.median(per_event), 3) if per_event else 0.0,
        "stall_p99_s": round(pct(per_event, 0.99), 3),
        "stall_max_s": round(max(per_event, default=0.0), 3),
        "longest_op_s": round(longest, 3),
    }
    width = max(len(k) for k in table)
    print(f"restart torture: {args.readers} verifying readers, {args.writers} fsyncing writers")
    for key, value in table.items():
        print(f"  {key:<{width}}  {value}")
    for line in errors[:10]:
        print(f"  error: {line}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**table, "stalls_s": per_event, "error_lines": errors[:50]}, f)
    ok = not (errors or table["wrong_reads"] or table["writer_files_differing"] or absent)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
