"""bench_fsync: writers that fsync after every write, each into a file of its own.

What it measures: W writer processes at once, each with its own file (faultfs: chunk_0 …
chunk_{W-1} of one tag, staged first; local: W files of 1 MiB on the store's file system),
each doing N 4 KiB `pwrite`s at random aligned offsets of its file, every one followed by
`fsync` — the pattern of processes that each keep a log or a checkpoint durable. The kernel
serialises writes and fsyncs to one FUSE inode, so only writers on different files reach the
daemon at once; there faultfs's fsyncs that queue behind a journal sync are answered by the
next one (group commit). ops/s from the first writer's start to the last one's end, medians
of --reps, the systems taking turns; every faultfs file is read back and checked against a
model on the first rep. rclone is not here: its `fsync` does nothing (docs/benchmarks.md).

    scripts/bench_fsync [--writers 8] [--ops 200] [--reps 5] [--base-tree DIR]

`--base-tree DIR` adds "faultfs-base", the same benchmark on another checkout of faultfs
(imported from DIR by PYTHONPATH; its compiled pieces copied in, or it serves reads through
pyfuse3), for before/after comparisons in one run.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import drop_caches, log

ROOT = Path(__file__).resolve().parent.parent
CHUNK = 1 << 20
BS = 4096


def _writer(path: str, offsets: list[int], seed: int, start, out) -> None:
    data = random.Random(seed).randbytes(BS)
    fd = os.open(path, os.O_WRONLY)
    start.wait()
    t0 = time.monotonic()
    for off in offsets:
        if os.pwrite(fd, data, off) != BS:
            raise SystemExit(f"short write to {path}")
        os.fsync(fd)
    t1 = time.monotonic()
    os.close(fd)
    out.put((t0, t1))


def run_writers(paths: list[str], plans: list[list[int]]) -> float:
    """ops/s of one writer per path at once (a fork each)."""
    ctx = multiprocessing.get_context("fork")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(p, plan, w, start, out))
             for w, (p, plan) in enumerate(zip(paths, plans, strict=True))]
    for p in procs:
        p.start()
    time.sleep(0.2)
    start.set()
    times = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
        if p.exitcode:
            raise SystemExit(f"a writer failed (exit {p.exitcode})")
    return sum(map(len, plans)) / (max(t for _, t in times) - min(t for t, _ in times))


def expected(source: bytes, plan: list[list[int]]) -> list[bytes]:
    files = []
    for w, offsets in enumerate(plan):
        buf = bytearray(source[w * CHUNK:(w + 1) * CHUNK])
        data = random.Random(w).randbytes(BS)
        for off in offsets:
            buf[off:off + BS] = data
        files.append(bytes(buf))
    return files


class Faultfs:
    def __init__(self, name: str, tree: Path, work: Path, source: Path) -> None:
        self.name, self.tree, self.work, self.source = name, tree, work, source
        self.mnt = work / f"{name}-mnt"
        self.store = work / f"{name}-store"
        self.mnt.mkdir()
        self.env = dict(os.environ, PYTHONPATH=str(tree))

    def _faultfs(self, *args: str) -> None:
        subprocess.run([str(ROOT / ".venv/bin/python"), "-m", "faultfs.cli", *args],
                       env=self.env, cwd="/", check=True, stdout=subprocess.DEVNULL)

    def paths(self, writers: int) -> list[str]:
        tag = self.source.stem
        return [str(self.mnt / tag / f"chunk_{w}") for w in range(writers)]

    def start(self, writers: int) -> list[str]:
        shutil.rmtree(self.store, ignore_errors=True)
        self._faultfs("mount", str(self.source), str(self.mnt), "--store", str(self.store))
        for p in self.paths(writers):  # staged: each write lands on a staged base
            Path(p).read_bytes()
        return self.paths(writers)

    def check(self, writers: int, want: list[bytes]) -> None:
        drop_caches()
        for p, data in zip(self.paths(writers), want, strict=True):
            if Path(p).read_bytes() != data:
                raise SystemExit(f"{self.name}: WRONG BYTES in {p}")

    def stop(self) -> None:
        self._faultfs("umount", str(self.mnt))


class Local:
    name = "local"

    def __init__(self, work: Path, source: Path) -> None:
        self.dir, self.source = work / "local", source

    def start(self, writers: int) -> list[str]:
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir()
        data = self.source.read_bytes()
        paths = []
        for w in range(writers):
            path = self.dir / f"f{w}"
            with open(path, "wb") as f:
                f.write(data[w * CHUNK:(w + 1) * CHUNK])
                os.fsync(f.fileno())
            paths.append(str(path))
        return paths

    def check(self, writers: int, want: list[bytes]) -> None:
        pass

    def stop(self) -> None:
        pass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--writers", type=int, default=8)
    p.add_argument("--ops", type=int, default=200, help="writes (each fsynced) per writer")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--seed", type=int, default=6)
    p.add_argument("--base-tree", type=Path, help="another checkout, run as faultfs-base")
    a = p.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench_fsync: needs root (FUSE mounts, dropping the page cache)")
    work = Path(tempfile.mkdtemp(prefix="faultfs-bench-fsync-"))
    source = work / "src.bin"
    size = max(a.writers, 1) * CHUNK
    data = random.Random(a.seed).randbytes(size)
    source.write_bytes(data)
    systems: list = [Faultfs("faultfs", ROOT, work, source)]
    if a.base_tree:
        systems.append(Faultfs("faultfs-base", a.base_tree.resolve(), work, source))
    systems.append(Local(work, source))
    rng = random.Random(a.seed)
    plan = [[rng.randrange(CHUNK // BS) * BS for _ in range(a.ops)] for _ in range(a.writers)]
    want = expected(data, plan)
    results: dict[str, list[float]] = {s.name: [] for s in systems}
    try:
        for rep in range(a.reps):
            order = systems[rep % len(systems):] + systems[:rep % len(systems)]
            for s in order:
                paths = s.start(a.writers)
                try:
                    drop_caches()
                    rate = run_writers(paths, plan)
                    if rep == 0:
                        s.check(a.writers, want)
                finally:
                    s.stop()
                results[s.name].append(rate)
                log(f"rep {rep + 1}: {s.name:13} {rate:10,.0f} ops/s", "bench_fsync")
    finally:
        for s in systems:
            if isinstance(s, Faultfs):
                subprocess.run(["umount", "-l", str(s.mnt)], stderr=subprocess.DEVNULL)
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"\n{a.writers} writers, each its own file, {a.ops} writes of 4 KiB each, "
          f"fsync after every write; median of {a.reps} (ops/s, all writers)\n")
    print("| system | ops/s | runs | faultfs ÷ it |")
    print("| --- | ---: | --- | ---: |")
    for name, v in med.items():
        runs = " / ".join(f"{x:,.0f}" for x in results[name])
        ratio = "" if name == "faultfs" else f"{med['faultfs'] / v:.2f}×"
        print(f"| {name} | {v:,.0f} | {runs} | {ratio} |")
    print(f"\nCommand: scripts/bench_fsync {' '.join(sys.argv[1:])}".rstrip())


if __name__ == "__main__":
    main()
