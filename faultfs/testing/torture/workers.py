"""Worker processes run against a mount: a verifying reader and the crash-consistency writer.

``python -m faultfs.testing.torture.workers reader|writer ARGS``; each prints one JSON report
on stdout when it stops (SIGTERM, its duration, or — with ``--stop-on-error`` — the first
failed call). Workers are processes, not threads, so a kill -9 of the daemon leaves each one
to meet the dead mount on its own, and one stuck in the kernel can be told from one that
returned.

The reader compares every byte it reads with the source file (a chunk file past the source's
end reads zeros); the writer performs ``writeops.script`` and appends the number of each op to
its log only after the op's ``fsync`` returned.
"""

from __future__ import annotations

import argparse
import errno
import json
import mmap
import os
import random
import signal
import sys
import time

KiB, MiB = 1 << 10, 1 << 20
DEAD_ERRNOS = (errno.ENOTCONN, errno.ECONNABORTED)


class _Stop:
    requested = False


def _on_term(signum: int, frame: object) -> None:
    _Stop.requested = True


def reader(args: argparse.Namespace) -> dict:
    with open(args.source, "rb") as f:  # shared pages: eight readers cost one copy
        data = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    cs = args.chunk_size
    chunks = -(-len(data) // cs)
    rng = random.Random(f"reader:{args.seed}")
    fds: dict[str, int] = {}
    report = {"reads": 0, "bytes": 0, "corrupt_bytes": 0, "corrupt_reads": 0, "errors": {},
              "first_error_at": None, "first_corrupt": None, "max_read_s": 0.0,
              "short_reads": 0, "short_at": None, "corrupt_at": None,
              "stopped": "time"}
    deadline = time.monotonic() + args.duration
    sizes = (4 * KiB, 64 * KiB, 128 * KiB, MiB)
    while not _Stop.requested and time.monotonic() < deadline:
        if args.view and (rng.random() < 0.5 or not chunks):
            name, base, size = args.view, 0, len(data)
        else:
            i = rng.randrange(chunks)
            name, base, size = f"chunk_{i}", i * cs, cs
        off = rng.randrange(max(1, size))
        n = rng.choice(sizes) if rng.random() < 0.8 else rng.randrange(1, MiB)
        path = os.path.join(args.dir, name)
        t0 = time.monotonic()
        try:
            fd = fds.get(name)
            if fd is None or rng.random() < 0.2:
                if fd is not None:
                    os.close(fd)
                fd = fds[name] = os.open(path, os.O_RDONLY)
            got = os.pread(fd, n, off)
        except OSError as exc:
            key = errno.errorcode.get(exc.errno or 0, str(exc.errno))
            report["errors"][key] = report["errors"].get(key, 0) + 1
            if report["first_error_at"] is None:
                report["first_error_at"] = time.monotonic()
            fds.pop(name, None)
            if args.stop_on_error or exc.errno in DEAD_ERRNOS:
                report["stopped"] = f"error {key}"
                break
            continue
        report["max_read_s"] = max(report["max_read_s"], time.monotonic() - t0)
        want = data[base + off:base + min(size, off + n)]
        want += bytes(min(size, off + n) - off - len(want))  # a chunk past the end: zeros
        report["reads"] += 1
        report["bytes"] += len(got)
        if len(got) < len(want) and got == want[:len(got)]:
            # a short read (a read cut by the kill returns what arrived): legal, counted
            report["short_reads"] += 1
            report["short_at"] = report["short_at"] or time.monotonic()
        elif got != want:
            bad = sum(1 for a, b in zip(got, want, strict=False) if a != b)
            zeros = sum(1 for a, b in zip(got, want, strict=False) if a != b and a == 0)
            bad += abs(len(got) - len(want))
            report["corrupt_bytes"] += bad
            report["corrupt_reads"] += 1
            if report["first_corrupt"] is None:
                first = next((i for i, (a, b) in enumerate(zip(got, want, strict=False))
                              if a != b), min(len(got), len(want)))
                report["first_corrupt"] = (
                    f"{name} [{off}, +{n}): got {len(got)} bytes of {len(want)}, {bad} differ "
                    f"({zeros} of them zeros where data should be), the first at +{first}")
                report["corrupt_at"] = time.monotonic()
    if _Stop.requested:
        report["stopped"] = "signal"
    _close_all(fds)
    return report


def writer(args: argparse.Namespace) -> dict:
    from faultfs.testing.torture.writeops import script

    view = os.path.join(args.dir, args.view)
    report: dict = {"logged": 0, "error": None, "in_flight": None}
    fds: dict[str, int] = {}
    with open(args.log, "a") as log:
        try:
            fds["view"] = os.open(view, os.O_RDWR)
            for op in script(args.seed, args.source_size, args.chunk_size):
                if _Stop.requested or op.n >= args.max_ops:
                    break
                report["in_flight"] = op.n
                if op.kind == "view":
                    _pwrite(fds["view"], op.data, op.off)
                    os.fsync(fds["view"])
                elif op.kind == "chunk":
                    key = f"chunk_{op.index}"
                    if key not in fds:
                        fds[key] = os.open(os.path.join(args.dir, key), os.O_RDWR)
                    _pwrite(fds[key], op.data, op.off)
                    os.fsync(fds[key])
                else:
                    flags = os.O_WRONLY | (os.O_CREAT | os.O_EXCL if op.kind == "user_new" else 0)
                    fd = os.open(os.path.join(args.dir, op.name), flags, 0o644)
                    try:
                        _pwrite(fd, op.data, op.off)
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                log.write(f"{op.n}\n")
                log.flush()
                report["logged"] = op.n + 1
                report["in_flight"] = None
        except OSError as exc:
            report["error"] = f"{errno.errorcode.get(exc.errno or 0, exc.errno)}: {exc}"
            report["error_at"] = time.monotonic()
    _close_all(fds)
    return report


def _close_all(fds: dict) -> None:
    for fd in fds.values():
        try:
            os.close(fd)
        except OSError:
            pass


def _pwrite(fd: int, data: bytes, off: int) -> None:
    done = os.pwrite(fd, data, off)
    if done != len(data):
        raise OSError(errno.EIO, f"short write: {done} of {len(data)} bytes")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m faultfs.testing.torture.workers")
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("reader")
    r.add_argument("--dir", required=True, help="the tag directory in the mount")
    r.add_argument("--view", default="", help="the whole-object view's name ('' : chunks only)")
    r.add_argument("--source", required=True)
    r.add_argument("--chunk-size", type=int, required=True)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--duration", type=float, default=3600.0)
    r.add_argument("--stop-on-error", action="store_true")
    w = sub.add_parser("writer")
    w.add_argument("--dir", required=True)
    w.add_argument("--view", required=True)
    w.add_argument("--log", required=True)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--source-size", type=int, required=True)
    w.add_argument("--chunk-size", type=int, required=True)
    w.add_argument("--max-ops", type=int, default=1 << 30)
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, _on_term)
    report = reader(args) if args.what == "reader" else writer(args)
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
