"""bench: faultfs's read and write paths side by side with rclone's VFS cache, a local file and the FUSE ceiling.

Run through ``scripts/bench`` (which installs rclone and the venv first). One run measures, on a
generated random-bytes source (``--size-mb``, default 1024) and a chunked gzip HDF5 file
(``--h5-mb`` of float32 before compression), for four systems:

- ``faultfs``  ``faultfs mount big.bin grid.h5 MNT --store DIR`` (default 1 MiB chunks; the views);
- ``rclone``   ``rclone mount SRCDIR MNT --vfs-cache-mode full --cache-dir DIR --daemon --read-only``;
- ``local``    the source files themselves;
- ``ceiling``  ``scripts/fuse_ceiling.py``: pyfuse3 + trio serving slices of a constant buffer;

these cases, each ``--reps`` times, reporting the median:

- ``seq cold``: nothing staged (empty store / cache, fresh mount), page cache dropped; one pass of
  1 MiB ``readv`` calls over the whole file; beside the local file's, the disk's part of a staged
  cold read (the file read and every MiB written to a new file on the store's file system, no
  FUSE): what a read that stages every byte on this disk can reach;
- ``seq warm, dropped``: everything staged, page cache dropped (staged bytes come off the disk);
- ``seq warm, cached``: everything staged and in the kernel page cache (a second pass);
- ``rand {4K,64K} x{1,8} cold/warm``: ``pread`` of the block size at random aligned offsets
  (fixed seed, a fixed count split over the readers; readers are forked *processes*, so the
  client side has no GIL); cold as above, warm = staged with the page cache dropped;
- ``h5py cold/warm``: read the whole chunked, gzip-compressed dataset in slabs with h5py;
- ``peak RSS``: VmHWM of the faultfs daemon (and of rclone), the maximum over every mount of the
  run.

The write cases (``--cases writes``; the default ``--cases all`` runs both) write through a fresh
mount per case and rep, the systems taking turns case by case (the load of a shared machine then
falls on all of them alike): faultfs over the same read-only sources (copy-on-write into its store),
rclone writable (no ``--read-only``) over a directory holding a fresh copy of the sources, the
local file a fresh copy, the ceiling a writable trivial file system that drops the bytes:

- ``seq overwrite``: the whole view in 1 MiB ``pwrite`` calls of new bytes, then one ``fsync``
  (MiB/s, the fsync included); nothing staged (a whole-chunk write needs no fault);
- ``rand 4 KiB x{1,8} cold/warm``: ``pwrite`` of 4 KiB at distinct random aligned offsets
  (fixed seed, ``--write-ops`` / ``--write-ops-cold`` split over forked writers), each writer
  ending with ``fsync`` (ops/s); cold = nothing staged, warm = staged (faultfs and rclone: the
  file read whole through the mount first); page cache dropped before each; ``sustained``: warm,
  one writer, ``--write-ops-sustained`` writes (more than faultfs holds in memory);
- ``h5py update cold/warm``: ``h5py.File(view, "r+")``, rewrite ``--h5-write-fraction`` of the
  dataset's chunks (whole chunks, fixed seed), close (seconds);
- the time ``close`` took after the fsync (a system may defer work to it), the CPU seconds each
  daemon used during the timed part (load moves it far less than the times), and the write
  requests that reached faultfs's daemon (and the faults, folds and store writes they caused).

Each system's written bytes are checked once (first rep of every case): read back through the
mount with the page cache dropped and compared with a model (source + writes); faultfs's also
after a remount of its store.

Every mount lives under a private temporary directory and is unmounted at the end, also on
Ctrl-C or SIGTERM; daemons that survive their unmount are killed by pid.
"""



from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import multiprocessing as mp
import os
import platform
import random
import re
import shlex
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchlib import (
    BenchError,
    cpu_seconds,
    drop_caches,
    force_unmount,
    get_readahead_kb,
    is_mounted,
    kill_pid,
    log,
    pid_alive,
    pids_mentioning,
    rclone_vfs_args,
    run_cmd,
    set_readahead_kb,
    unmount_and_reap,
    vm_hwm_mib,
)

ROOT = Path(__file__).resolve().parent.parent
VENV_PY = ROOT / ".venv" / "bin" / "python"
FAULTFS = ROOT / ".venv" / "bin" / "faultfs"
CEILING = ROOT / "scripts" / "fuse_ceiling.py"
DOC = ROOT / "docs" / "benchmarks.md"

MiB = 1 << 20
SEQ_BLOCK = 1 * MiB  # the reader's request size; the kernel splits it into FUSE requests
STAGE_BEHIND = 32  # MiB read and not yet staged, in the disk's part of a staged cold read
STAGE_THREADS = 4  # its readers, and as many writers
H5_COLS = 1024  # float32 columns: one row is 4 KiB
H5_CHUNK_ROWS = 64  # 64 x 1024 x 4 B = 256 KiB per chunk before compression
SYSTEMS = ("faultfs", "rclone", "local", "ceiling")
CASE_GROUPS = ("reads", "writes")  # --cases
# faultfs counters shown per write case: what the writes made the daemon do
FAULTFS_WRITE_COUNTERS = ("faults", "stored_bytes", "folds", "checkpoints", "fsyncs")
MOUNT_TIMEOUT_S = 60
CASE_CAP_S_DEFAULT = 30.0  # a random case stops after this long (a safety net, not the measure)

_ctx = mp.get_context("fork")


def loadavg() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


class LoadSampler:
    """Samples the 1-minute load average (and CPU pressure) every few seconds during the run."""

    def __init__(self, every_s: float = 5.0) -> None:
        self.samples: list[float] = []
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(OSError):
                self.samples.append(loadavg())
            self._stop.wait(self.every_s)

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def busiest_processes(n: int = 4) -> str:
    try:
        out = subprocess.run(["ps", "-eo", "pcpu,comm", "--sort=-pcpu", "--no-headers"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "?"
    rows = [" ".join(line.split()) for line in out.splitlines()[:n]]
    return ", ".join(f"{r.split(' ', 1)[1]} {r.split(' ', 1)[0]}%" for r in rows if " " in r)


def machine_description() -> dict:
    cpu = "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_gib = 0.0
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem_gib = int(line.split()[1]) / (1 << 20)
    def git_raw(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True,
                                  timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            return "?"

    def git(*a: str) -> str:
        return git_raw(*a).strip()
    dirty = [line[3:] for line in git_raw("status", "--porcelain", "--", "faultfs").splitlines()]
    try:
        rclone_v = subprocess.run(["rclone", "version"], capture_output=True, text=True,
                                  timeout=30).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        rclone_v = "?"
    try:
        import pyfuse3
        pyfuse3_v = pyfuse3.__version__
    except Exception:
        pyfuse3_v = "?"
    return {
        "cpu": cpu, "cores": os.cpu_count(), "mem_gib": round(mem_gib, 1),
        "kernel": platform.release(), "python": platform.python_version(),
        "pyfuse3": pyfuse3_v, "rclone": rclone_v,
        "commit": git("rev-parse", "--short", "HEAD"),
        "faultfs_uncommitted": dirty,
    }


def compiled_into(snap: Path) -> None:
    """The compiled pieces (the fast read path, the record cut) into an export, which ``git
    archive`` leaves without them (every staged read would then go through pyfuse3): the
    working tree's builds, which ``_bootstrap.sh`` keeps in step with its C sources, when
    those sources are HEAD's."""
    for built in sorted((ROOT / "faultfs").rglob("_*.so")):
        rel = built.relative_to(ROOT)
        source = rel.parent / (built.name.split(".")[0] + ".c")
        head = subprocess.run(["git", "show", f"HEAD:{source}"], cwd=ROOT, capture_output=True,
                              timeout=60).stdout
        if not head or head != (ROOT / source).read_bytes():
            raise SystemExit(f"bench: --faultfs-head: {source} differs from HEAD's: commit it "
                             "(or run without --faultfs-head)")
        shutil.copy2(built, snap / rel)


def use_head_export(snap: Path, machine: dict) -> None:
    """Export HEAD's packages into ``snap``, put it first on PYTHONPATH and make its parent the
    working directory: every faultfs command the run starts (``.venv/bin/faultfs``, a script,
    so its own directory comes first, then PYTHONPATH, then the editable install) and the
    daemon it starts (``python -m faultfs.cli``, which puts the working directory first: from
    the checkout, the working tree) import the committed tree."""
    snap.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", "HEAD", "faultfs", "assimilators"], cwd=ROOT,
                             capture_output=True, check=True, timeout=60).stdout
    subprocess.run(["tar", "-x", "-C", str(snap)], input=archive, check=True, timeout=60)
    compiled_into(snap)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(snap) + (os.pathsep + old if old else "")
    os.chdir(snap.parent)  # every path of the run is absolute
    # ``-c``, like the daemon's ``-m``, puts the working directory first on sys.path
    got = subprocess.run([str(FAULTFS.parent / "python"), "-c",
                          "import faultfs; print(faultfs.__file__)"],
                         capture_output=True, text=True, timeout=60).stdout.strip()
    if not got.startswith(str(snap)):
        raise SystemExit(f"bench: --faultfs-head: faultfs still imports from {got}")
    log(f"faultfs from a clean export of HEAD ({machine['commit']}): {snap}")
    machine["faultfs_uncommitted"] = []
    machine["head_export"] = True


# -- data -------------------------------------------------------------------------------------

def make_data(data_dir: Path, size_mb: int, h5_mb: int, seed: int) -> tuple[Path, Path]:
    """big.bin (random bytes) and grid.h5 (chunked, shuffle+gzip float32); reused when they match."""
    import h5py
    import numpy as np

    data_dir.mkdir(parents=True, exist_ok=True)
    big = data_dir / "big.bin"
    h5 = data_dir / "grid.h5"
    manifest = data_dir / "manifest.json"
    want = {"size_mb": size_mb, "h5_mb": h5_mb, "seed": seed, "version": 1}
    if manifest.exists() and big.exists() and h5.exists():
        with contextlib.suppress(ValueError):
            if json.loads(manifest.read_text()) == want and big.stat().st_size == size_mb * MiB:
                log(f"reusing the data in {data_dir}")
                return big, h5
    manifest.unlink(missing_ok=True)
    rng = np.random.default_rng(seed)
    log(f"generating {size_mb} MiB of random bytes: {big}")
    block = 64 * MiB
    with open(big, "wb") as f:
        left = size_mb * MiB
        while left:
            n = min(block, left)
            f.write(rng.bytes(n))
            left -= n
        f.flush()
        os.fsync(f.fileno())
    rows = max(H5_CHUNK_ROWS, h5_mb * MiB // (4 * H5_COLS))
    log(f"generating a {h5_mb} MiB float32 HDF5 dataset (chunks 64x1024, shuffle+gzip 1): {h5}")
    with h5py.File(h5, "w") as f:
        ds = f.create_dataset("field", shape=(rows, H5_COLS), dtype="float32",
                              chunks=(H5_CHUNK_ROWS, H5_COLS), compression="gzip",
                              compression_opts=1, shuffle=True)
        slab = H5_CHUNK_ROWS * 64
        for r in range(0, rows, slab):
            n = min(slab, rows - r)
            # small integers as floats: compressible like real gridded data, not trivially so
            ds[r:r + n] = rng.integers(0, 4096, size=(n, H5_COLS), dtype=np.int32).astype(np.float32)
    with open(h5, "rb+") as f:
        os.fsync(f.fileno())
    manifest.write_text(json.dumps(want))
    return big, h5


# -- clients (run in forked children so a hung mount cannot hang the bench) ------------------

def _seq_read(path: str) -> dict:
    buf = bytearray(SEQ_BLOCK)
    fd = os.open(path, os.O_RDONLY)
    try:
        total = 0
        t0 = time.monotonic()
        while True:
            n = os.readv(fd, [buf])
            if n <= 0:
                break
            total += n
        dt = time.monotonic() - t0
    finally:
        os.close(fd)
    return {"bytes": total, "seconds": dt}


def _seq_read_staged(path: str, stage_dir: str) -> dict:
    """What the disk allows a staged cold read on this machine: the file read in 1 MiB blocks
    by ``STAGE_THREADS`` threads, every block also written to a new file of its own in
    ``stage_dir`` (the store's file system) by as many more; both around the page cache
    where the file systems allow, as faultfs reads an uncached local source and stages a
    blob; at most ``STAGE_BEHIND`` MiB read and not yet written (faultfs bounds that too).
    No FUSE, no checksums, no reader in order: the disk's part of the work alone."""
    import mmap
    import queue

    os.makedirs(stage_dir, exist_ok=True)
    size = os.stat(path).st_size
    blocks = -(-size // SEQ_BLOCK)
    todo: queue.Queue = queue.Queue()
    free: queue.Queue = queue.Queue()
    for _ in range(STAGE_BEHIND):
        free.put(mmap.mmap(-1, SEQ_BLOCK))  # page-aligned, as O_DIRECT wants
    lock = threading.Lock()
    state = {"next": 0, "bytes": 0}
    failed: list[BaseException] = []
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        fd = os.open(path, os.O_RDONLY)

    def reader() -> None:
        while not failed:
            with lock:
                i = state["next"]
                state["next"] += 1
            if i >= blocks:
                return
            buf = free.get()
            try:
                n = os.preadv(fd, [buf], i * SEQ_BLOCK)
            except OSError as exc:
                failed.append(exc)
                return
            with lock:
                state["bytes"] += n
            todo.put((i, buf))

    def writer() -> None:
        while (item := todo.get()) is not None:
            i, buf = item
            name = os.path.join(stage_dir, f"b{i}")
            try:
                try:
                    out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
                except OSError:
                    out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    os.pwritev(out, [buf], 0)  # whole pages
                finally:
                    os.close(out)
            except OSError as exc:
                failed.append(exc)
            free.put(buf)

    readers = [threading.Thread(target=reader) for _ in range(STAGE_THREADS)]
    writers = [threading.Thread(target=writer) for _ in range(STAGE_THREADS)]
    try:
        t0 = time.monotonic()
        for t in readers + writers:
            t.start()
        for t in readers:
            t.join()
        for _ in writers:
            todo.put(None)
        for t in writers:
            t.join()
        dt = time.monotonic() - t0
    finally:
        os.close(fd)
        shutil.rmtree(stage_dir, ignore_errors=True)
    if failed:
        raise BenchError(f"the staged read of {path} into {stage_dir} failed: {failed[0]}")
    return {"bytes": state["bytes"], "seconds": dt}


def _h5_read(path: str) -> dict:
    import h5py

    t0 = time.monotonic()
    total = 0
    with h5py.File(path, "r") as f:
        ds = f["field"]
        slab = H5_CHUNK_ROWS * 16
        for r in range(0, ds.shape[0], slab):
            total += ds[r:r + slab].nbytes
    return {"bytes": total, "seconds": time.monotonic() - t0}


def _child_main(conn, fn, args) -> None:
    try:
        conn.send(("ok", fn(*args)))
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


def in_child(fn, *args, timeout: float) -> dict:
    parent, child = _ctx.Pipe(duplex=False)
    proc = _ctx.Process(target=_child_main, args=(child, fn, args), daemon=True)
    proc.start()
    child.close()
    try:
        if not parent.poll(timeout):
            raise BenchError(f"{fn.__name__} did not finish in {timeout:.0f} s")
        status, value = parent.recv()
    except EOFError:
        raise BenchError(f"{fn.__name__}: the reader died (exit code {proc.exitcode})") from None
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(timeout=5)
        parent.close()
    if status != "ok":
        raise BenchError(value)
    return value


def _rand_worker(path: str, size: int, bs: int, count: int, seed: int, cap_s: float,
                 barrier, queue) -> None:
    rng = random.Random(seed)
    slots = (size - bs) // bs + 1
    offsets = [rng.randrange(slots) * bs for _ in range(count)]
    fd = os.open(path, os.O_RDONLY)
    done = errors = 0
    try:
        barrier.wait(timeout=120)
        t0 = time.monotonic()
        deadline = t0 + cap_s
        for off in offsets:
            try:
                if len(os.pread(fd, bs, off)) != bs:
                    errors += 1
            except OSError:
                errors += 1
            done += 1
            if time.monotonic() > deadline:
                break
        t1 = time.monotonic()
    finally:
        os.close(fd)
    queue.put((t0, t1, done, errors))


def fan_out(worker, worker_args: list[tuple], wait_s: float, what: str) -> list[tuple]:
    """Run ``worker(*args, barrier, queue)`` in one forked process per ``worker_args`` entry,
    released together by the barrier; each puts one result tuple on the queue (or
    ``("error", message)``). The results, in the order they came."""
    barrier = _ctx.Barrier(len(worker_args) + 1)
    queue = _ctx.Queue()
    procs = [_ctx.Process(target=worker, daemon=True, args=(*a, barrier, queue))
             for a in worker_args]
    for p in procs:
        p.start()
    results: list[tuple] = []
    try:
        barrier.wait(timeout=120)
        deadline = time.monotonic() + wait_s + 120
        while len(results) < len(procs):
            try:
                got = queue.get(timeout=1)
            except Exception:  # queue.Empty: are they still there?
                if time.monotonic() > deadline:
                    raise BenchError(f"{what} did not finish in {wait_s + 120:.0f} s") from None
                if not any(p.is_alive() for p in procs) and queue.empty():
                    raise BenchError(f"{what}: a process died without a result") from None
                continue
            if got and got[0] == "error":
                raise BenchError(f"{what}: {got[1]}")
            results.append(got)
    except BenchError:
        raise
    except Exception as exc:
        raise BenchError(f"{what} failed: {type(exc).__name__}: {exc}") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return results


def rand_read(path: str, size: int, bs: int, total_ops: int, readers: int, seed: int,
              cap_s: float) -> dict:
    per = max(1, total_ops // readers)
    results = fan_out(_rand_worker,
                      [(path, size, bs, per, seed * 1000 + i, cap_s) for i in range(readers)],
                      cap_s, "random readers")
    start = min(r[0] for r in results)
    end = max(r[1] for r in results)
    done = sum(r[2] for r in results)
    errors = sum(r[3] for r in results)
    if errors:
        raise BenchError(f"{errors} of {done} random reads failed or were short")
    return {"ops": done, "seconds": end - start, "capped": done < per * readers}


# -- write clients and their models ------------------------------------------------------------

WRITE_BS = 4096  # the random writes' size and alignment
_STAMP = struct.Struct("<QQ")  # every written block starts with (offset, writer << 32 | n)


def seq_write_base(seed: int) -> bytes:
    """The bytes of every 1 MiB block of the sequential overwrite (after its stamp)."""
    return random.Random(seed * 7 + 1).randbytes(SEQ_BLOCK)


def seq_block(base: bytes, off: int, n: int) -> bytes:
    """What the sequential overwrite writes at ``off`` (a multiple of SEQ_BLOCK)."""
    return (_STAMP.pack(off, 0xFFFF_FFFF) + base[_STAMP.size:])[:n]


def _seq_write(path: str, size: int, seed: int) -> dict:
    """Overwrite ``path`` whole in 1 MiB writes, then fsync; the time includes the fsync."""
    buf = bytearray(seq_block(seq_write_base(seed), 0, SEQ_BLOCK))
    fd = os.open(path, os.O_WRONLY)
    try:
        t0 = time.monotonic()
        for off in range(0, size, SEQ_BLOCK):
            buf[:_STAMP.size] = _STAMP.pack(off, 0xFFFF_FFFF)
            n = min(SEQ_BLOCK, size - off)
            view = memoryview(buf)[:n]
            done = 0
            while done < n:
                done += os.pwrite(fd, view[done:], off + done)
        os.fsync(fd)
        t1 = time.monotonic()
    finally:
        os.close(fd)
    return {"bytes": size, "seconds": t1 - t0, "close_s": time.monotonic() - t1}


def rand_write_plan(size: int, total: int, writers: int, seed: int) -> list[list[int]]:
    """Distinct random aligned offsets (no two writers touch the same block, so the result
    does not depend on their interleaving), ``total`` split evenly over the writers."""
    slots = size // WRITE_BS
    per = max(1, min(total, slots) // writers)
    picked = random.Random(seed * 1000 + writers).sample(range(slots), per * writers)
    return [[s * WRITE_BS for s in picked[i * per:(i + 1) * per]] for i in range(writers)]


def rand_write_base(seed: int) -> bytes:
    return random.Random(seed * 7 + 2).randbytes(256 * 1024)


def rand_payload(base: bytes, writer: int, n: int, off: int) -> bytes:
    """The 4 KiB that writer ``writer`` writes as its ``n``-th write, at ``off``."""
    k = (writer * 7919 + n * 4099) % (len(base) - WRITE_BS)
    return _STAMP.pack(off, writer << 32 | n) + base[k + _STAMP.size:k + WRITE_BS]


def _rand_write_worker(path: str, offsets: list[int], base: bytes, writer: int, cap_s: float,
                       barrier, queue) -> None:
    try:
        payloads = [rand_payload(base, writer, n, off) for n, off in enumerate(offsets)]
        fd = os.open(path, os.O_WRONLY)
        done = errors = 0
        try:
            barrier.wait(timeout=120)
            t0 = time.monotonic()
            deadline = t0 + cap_s
            for off, data in zip(offsets, payloads, strict=True):
                try:
                    if os.pwrite(fd, data, off) != WRITE_BS:
                        errors += 1
                except OSError:
                    errors += 1
                done += 1
                if time.monotonic() > deadline:
                    break
            try:
                os.fsync(fd)
            except OSError:
                errors += 1
            t1 = time.monotonic()
        finally:
            os.close(fd)
        queue.put((t0, t1, time.monotonic(), done, errors, writer))
    except BaseException as exc:
        queue.put(("error", f"writer {writer}: {type(exc).__name__}: {exc}"))


def rand_write(path: str, plan: list[list[int]], base: bytes, cap_s: float) -> dict:
    """The writers of ``plan`` at once; ops/s over first start to last fsync's return."""
    results = fan_out(_rand_write_worker,
                      [(path, offsets, base, w, cap_s) for w, offsets in enumerate(plan)],
                      cap_s, "random writers")
    errors = sum(r[4] for r in results)
    done = sum(r[3] for r in results)
    if errors:
        raise BenchError(f"{errors} of {done} random writes (or fsyncs) failed or were short")
    return {"ops": done, "seconds": max(r[1] for r in results) - min(r[0] for r in results),
            "close_s": max(r[2] - r[1] for r in results), "capped": done < sum(map(len, plan)),
            "done": {r[5]: r[3] for r in results}}  # each writer did a prefix of its list


class SeqModel:
    """The expected bytes after the sequential overwrite (the source does not show)."""

    def __init__(self, seed: int) -> None:
        self.base = seq_write_base(seed)

    def __call__(self, fd: int, off: int, n: int) -> bytes:
        return seq_block(self.base, off, n)


class OverlayModel:
    """The expected bytes of a file: its source with 4 KiB blocks written over it."""

    def __init__(self, written: dict[int, bytes]) -> None:
        self.by_block: dict[int, list[tuple[int, bytes]]] = {}
        for off, data in written.items():
            self.by_block.setdefault(off // SEQ_BLOCK, []).append((off, data))

    def __call__(self, fd: int, off: int, n: int) -> bytes:
        data = bytearray(os.pread(fd, n, off))
        for w_off, w in self.by_block.get(off // SEQ_BLOCK, []):
            data[w_off - off:w_off - off + len(w)] = w
        return bytes(data)


def _verify_file(path: str, size: int, source: str, expected) -> dict:
    """Compare ``path`` with ``expected(source_fd, off, n)`` in 1 MiB pieces: ``bad`` is ''
    when equal, else where it first differs."""
    return {"bad": _first_difference(path, size, source, expected)}


def _first_difference(path: str, size: int, source: str, expected) -> str:
    if os.stat(path).st_size != size:
        return f"size {os.stat(path).st_size}, expected {size}"
    fd, src = os.open(path, os.O_RDONLY), os.open(source, os.O_RDONLY)
    try:
        for off in range(0, size, SEQ_BLOCK):
            n = min(SEQ_BLOCK, size - off)
            got, want = os.pread(fd, n, off), expected(src, off, n)
            if got != want:
                first = next((i for i in range(min(len(got), len(want))) if got[i] != want[i]),
                             min(len(got), len(want)))
                return f"bytes differ from the model at offset {off + first}"
    finally:
        os.close(fd)
        os.close(src)
    return ""




def h5_update_plan(h5: Path, fraction: float, seed: int) -> tuple[int, list[int]]:
    """(rows of the dataset, the chunk indices the update rewrites, in the order it does)."""
    import h5py

    with h5py.File(h5, "r") as f:
        rows = f["field"].shape[0]
    chunks = -(-rows // H5_CHUNK_ROWS)
    count = max(1, min(chunks, round(chunks * fraction)))
    return rows, random.Random(seed * 1000 + 5).sample(range(chunks), count)


def h5_chunk_rows(seed: int, chunk: int, rows: int):
    """The float32 rows the update writes into ``chunk`` (as compressible as the source's)."""
    import numpy as np

    first = chunk * H5_CHUNK_ROWS
    n = min(H5_CHUNK_ROWS, rows - first)
    rng = np.random.default_rng(seed * 100_003 + chunk)
    return rng.integers(0, 4096, size=(n, H5_COLS), dtype=np.int32).astype(np.float32) - 7.5


def _h5_update(path: str, rows: int, chunks: list[int], seed: int) -> dict:
    """Open "r+", rewrite the chunks whole, close: the seconds from open to closed."""
    import h5py

    datas = [(c * H5_CHUNK_ROWS, h5_chunk_rows(seed, c, rows)) for c in chunks]
    t0 = time.monotonic()
    with h5py.File(path, "r+") as f:
        ds = f["field"]
        for first, data in datas:
            ds[first:first + len(data)] = data
    return {"seconds": time.monotonic() - t0, "close_s": None}  # the close is in the time


def _h5_verify(path: str, source: str, rows: int, chunks: list[int], seed: int) -> dict:
    import h5py
    import numpy as np

    slab = H5_CHUNK_ROWS * 16
    with h5py.File(path, "r") as f, h5py.File(source, "r") as g:
        ds, src = f["field"], g["field"]
        if ds.shape != src.shape:
            return {"bad": f"dataset shape {ds.shape}, expected {src.shape}"}
        by_slab: dict[int, list[int]] = {}
        for c in chunks:
            by_slab.setdefault(c * H5_CHUNK_ROWS // slab, []).append(c)
        for r in range(0, rows, slab):
            want = src[r:r + slab]
            for c in by_slab.get(r // slab, []):
                data = h5_chunk_rows(seed, c, rows)
                want[c * H5_CHUNK_ROWS - r:c * H5_CHUNK_ROWS - r + len(data)] = data
            if not np.array_equal(ds[r:r + slab], want):
                return {"bad": f"dataset rows {r}..{r + slab} differ from the model"}
    return {"bad": ""}


def spot_check(path: str, source: Path, size: int, seed: int) -> str:
    """Compare a few random blocks (and the tail) of ``path`` with the source: '' when equal."""
    rng = random.Random(seed)
    offsets = [rng.randrange(0, size - 4096) for _ in range(8)] + [size - 4096, 0]
    with open(path, "rb", buffering=0) as a, open(source, "rb", buffering=0) as b:
        for off in offsets:
            if os.pread(a.fileno(), 4096, off) != os.pread(b.fileno(), 4096, off):
                return f"bytes differ from the source at offset {off}"
    return ""


# -- systems ----------------------------------------------------------------------------------

class System:
    """A way of reading the two files; ``start`` makes it cold (nothing staged), ``stop`` ends it."""

    name = "?"
    has_h5 = True
    mounts = True
    keeps_writes = True  # written bytes read back (the ceiling drops them)

    def __init__(self, work: Path, big: Path, h5: Path, prefix: str = "mnt") -> None:
        self.work = work
        self.big_src = big
        self.h5_src = h5
        self.prefix = prefix  # "wmnt" for the write cases' instances: their own mountpoint
        self.mnt = work / f"{prefix}-{self.name}"
        self.pid: int | None = None
        self.dev: int | None = None
        self.peak_rss_mib: float | None = None
        self.readahead_kb: int | None = None  # bdi read_ahead_kb as mounted

    # paths of the two files as this system shows them
    def big_path(self) -> str:
        return str(self.big_src)

    def h5_path(self) -> str:
        return str(self.h5_src)

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def counters(self) -> tuple[int, int] | None:
        """(read requests, bytes) served so far by this mount, where the system counts them."""
        return None

    def write_counters(self) -> dict[str, int] | None:
        """Write requests (``writes``, ``bytes``, and what they caused) so far, where counted."""
        return None

    def stage(self, path: str, size: int) -> str:
        """Bring every byte of the file at ``path`` (this system's name of a source of ``size``
        bytes) into the system's cache, for the warm write cases: '' when done, else what went
        wrong. Here: nothing to do (a local file, the ceiling)."""
        return ""

    @staticmethod
    def read_whole(path: str, size: int) -> str:
        """Stage by reading the file whole through the mount (the same client action for
        faultfs and rclone)."""
        out = in_child(_seq_read, path, timeout=600)
        return "" if out["bytes"] == size else f"read {out['bytes']} of {size} bytes"

    def note_rss(self) -> None:
        if self.pid is not None:
            hwm = vm_hwm_mib(self.pid)
            if hwm is not None:
                self.peak_rss_mib = max(self.peak_rss_mib or 0.0, hwm)

    def _wait_mounted(self, what: str) -> None:
        deadline = time.monotonic() + MOUNT_TIMEOUT_S
        while time.monotonic() < deadline:
            if is_mounted(self.mnt):
                self.dev = os.stat(self.mnt).st_dev
                return
            time.sleep(0.05)
        raise BenchError(f"{what} did not mount {self.mnt} within {MOUNT_TIMEOUT_S} s")

    def _unmount_and_reap(self, unmount_cmd: list[str]) -> None:
        unmount_and_reap(self.mnt, self.dev, self.pid, unmount_cmd)
        self.pid = None


class Local(System):
    name = "local"
    mounts = False


class Faultfs(System):
    name = "faultfs"

    def __init__(self, work: Path, big: Path, h5: Path, chunk_size: str, extra_args: list[str],
                 prefix: str = "mnt") -> None:
        super().__init__(work, big, h5, prefix)
        self.store = work / f"store-{prefix}-faultfs"
        self.chunk_size = chunk_size
        self.extra_args = extra_args
        self.last_stats: dict = {}

    def big_path(self) -> str:
        return str(self.mnt / "big" / "big.bin")

    def h5_path(self) -> str:
        return str(self.mnt / "grid" / "grid.h5")

    def start(self, fresh: bool = True) -> None:
        """A fresh mount over an empty store; ``fresh=False``: remount the store as it is
        (its tags and their writes)."""
        self.mnt.mkdir(exist_ok=True)
        if fresh:
            shutil.rmtree(self.store, ignore_errors=True)
            cmd = [str(FAULTFS), "mount", str(self.big_src), str(self.h5_src), str(self.mnt),
                   "--store", str(self.store), "--chunk-size", self.chunk_size, *self.extra_args]
        else:
            cmd = [str(FAULTFS), "mount", str(self.mnt), "--store", str(self.store),
                   *self.extra_args]
        run_cmd(cmd, timeout=MOUNT_TIMEOUT_S + 30)
        self._wait_mounted("faultfs")
        self.pid = int(self.stats()["pid"])
        self.readahead_kb = get_readahead_kb(self.mnt)

    def stage(self, path: str, size: int) -> str:
        """Read the view whole (not ``faultfs warm``: it opens every chunk_N, and the view's
        writes then invalidate those inodes one write at a time — see docs/benchmarks.md),
        then check that every blob is staged."""
        bad = self.read_whole(path, size)
        tag = Path(path).parent.name
        for _ in range(100):  # faulted blobs are stored just behind the reader
            got = self.stats()["tags"][tag]
            if got["staged_blobs"] == got["blobs"]:
                return bad
            time.sleep(0.05)
        return bad or f"{got['staged_blobs']} of {got['blobs']} blobs of {tag} staged"

    def stats(self) -> dict:
        with open(self.mnt / ".faultfs" / "stats") as f:
            return json.loads(f.read())

    def counters(self) -> tuple[int, int] | None:
        try:
            c = self.stats()["counters"]
            return int(c["reads"]), int(c["bytes_served"])
        except (OSError, ValueError, KeyError):
            return None

    def write_counters(self) -> dict[str, int] | None:
        try:
            c = self.stats()["counters"]
            return {"writes": int(c["writes"]), "bytes": int(c["bytes_written"]),
                    **{k: int(c[k]) for k in FAULTFS_WRITE_COUNTERS}}
        except (OSError, ValueError, KeyError):
            return None

    def stop(self) -> None:
        if self.pid is not None:
            with contextlib.suppress(OSError, ValueError):
                self.last_stats = self.stats()
        self.note_rss()
        self._unmount_and_reap([str(FAULTFS), "umount", str(self.mnt)])


class Rclone(System):
    name = "rclone"

    def __init__(self, work: Path, big: Path, h5: Path, extra_args: list[str],
                 prefix: str = "mnt", writable: bool = False) -> None:
        super().__init__(work, big, h5, prefix)
        self.cache = work / f"cache-{prefix}-rclone"
        self.conf = work / "rclone.conf"
        self.log_stem = f"rclone-{prefix}"
        self.extra_args = extra_args
        self.writable = writable

    def big_path(self) -> str:
        return str(self.mnt / self.big_src.name)

    def h5_path(self) -> str:
        return str(self.mnt / self.h5_src.name)

    def start(self) -> None:
        shutil.rmtree(self.cache, ignore_errors=True)
        self.mnt.mkdir(exist_ok=True)
        self.conf.touch()
        run_cmd(["rclone", "mount", str(self.big_src.parent), str(self.mnt),
                 *rclone_vfs_args(self.cache, self.writable), "--config", str(self.conf),
                 "--log-file", str(self.work / f"{self.log_stem}.log"),
                 "--daemon", *self.extra_args], timeout=MOUNT_TIMEOUT_S + 30,
                log_to=self.work / f"{self.log_stem}.out")
        self._wait_mounted("rclone")
        self.readahead_kb = get_readahead_kb(self.mnt)
        pids = [p for p in pids_mentioning(str(self.mnt)) if pid_alive(p)]
        self.pid = pids[0] if pids else None

    def stage(self, path: str, size: int) -> str:
        """Read the file whole through the mount: rclone's cache then holds all of it."""
        return self.read_whole(path, size)

    def stop(self) -> None:
        self.note_rss()
        self._unmount_and_reap(["fusermount3", "-u", str(self.mnt)])
        shutil.rmtree(self.cache, ignore_errors=True)


class Ceiling(System):
    name = "ceiling"
    has_h5 = False

    def __init__(self, work: Path, big: Path, h5: Path, size: int,
                 readahead_kb: int | None, prefix: str = "mnt", writable: bool = False) -> None:
        super().__init__(work, big, h5, prefix)
        self.size = size
        self.want_readahead_kb = readahead_kb  # None: the kernel default
        self.proc: subprocess.Popen | None = None
        self.stats_file = work / f"ceiling-{prefix}.stats"
        self.writable = writable
        self.keeps_writes = False  # acknowledged and dropped

    def big_path(self) -> str:
        return str(self.mnt / "big.bin")

    def start(self) -> None:
        self.mnt.mkdir(exist_ok=True)
        ready = self.work / "ceiling.ready"
        ready.unlink(missing_ok=True)
        self.stats_file.unlink(missing_ok=True)
        self.proc = subprocess.Popen(
            [str(VENV_PY), str(CEILING), str(self.mnt), "--size", str(self.size),
             "--ready-file", str(ready), "--stats-file", str(self.stats_file),
             *(["--writable"] if self.writable else [])],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=open(self.work / "ceiling.log", "ab"))
        self.pid = self.proc.pid
        deadline = time.monotonic() + MOUNT_TIMEOUT_S
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise BenchError(f"fuse_ceiling did not start; see {self.work / 'ceiling.log'}")
            time.sleep(0.05)
        self._wait_mounted("fuse_ceiling")
        if self.want_readahead_kb:
            set_readahead_kb(self.mnt, self.want_readahead_kb)
        self.readahead_kb = get_readahead_kb(self.mnt)

    def _stats(self) -> dict | None:
        """Its counters, written on SIGUSR1."""
        if self.proc is None or self.proc.poll() is not None:
            return None
        before = self.stats_file.stat().st_mtime_ns if self.stats_file.exists() else 0
        self.proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                if self.stats_file.stat().st_mtime_ns != before:
                    return json.loads(self.stats_file.read_text())
            time.sleep(0.01)
        return None

    def counters(self) -> tuple[int, int] | None:
        got = self._stats()
        with contextlib.suppress(TypeError, KeyError, ValueError):
            return int(got["reads"]), int(got["bytes"])  # type: ignore[index]
        return None

    def write_counters(self) -> dict[str, int] | None:
        got = self._stats()
        with contextlib.suppress(TypeError, KeyError, ValueError):
            return {"writes": int(got["writes"]), "bytes": int(got["wbytes"])}  # type: ignore[index]
        return None

    def stop(self) -> None:
        self.note_rss()
        self._unmount_and_reap(["fusermount3", "-u", str(self.mnt)])
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
            self.proc = None


# -- the cases ---------------------------------------------------------------------------------

SEQ_CASES = [("seq_cold", "seq cold"), ("seq_warm_dropped", "seq warm, page cache dropped"),
             ("seq_warm_cached", "seq warm, in page cache")]
RAND_SHAPES = [(4096, 1), (4096, 8), (65536, 1), (65536, 8)]
H5_CASES = [("h5_cold", "h5py cold"), ("h5_warm_dropped", "h5py warm, page cache dropped"),
            ("h5_warm_cached", "h5py warm, in page cache")]


def rand_key(bs: int, readers: int, state: str) -> str:
    return f"rand{bs // 1024}k_x{readers}_{state}"


def rand_label(bs: int, readers: int, state: str) -> str:
    what = "cold" if state == "cold" else "warm, page cache dropped"
    return f"rand {bs // 1024} KiB x{readers} {what}"


def all_cases() -> list[tuple[str, str, str]]:
    """(key, label, unit) in table order."""
    rows = [(k, label, "MiB/s") for k, label in SEQ_CASES]
    for state in ("cold", "warm"):
        rows += [(rand_key(bs, r, state), rand_label(bs, r, state), "ops/s") for bs, r in RAND_SHAPES]
    rows += [(k, label, "s") for k, label in H5_CASES]
    return rows


WRITERS = (1, 8)
WRITE_STATES = ("cold", "warm")
SUSTAINED = "sustained"  # warm, one writer, --write-ops-sustained: past faultfs's --dirty-mb


def wrand_key(writers: int, state: str) -> str:
    return f"wrand4k_x{writers}_{state}"


def write_cases() -> list[tuple[str, str, str]]:
    """(key, label, unit) of the write cases, in table order."""
    rows = [("wseq", "seq overwrite 1 MiB + fsync", "MiB/s")]
    for state in WRITE_STATES:
        what = "cold (nothing staged)" if state == "cold" else "warm (staged)"
        rows += [(wrand_key(w, state), f"rand 4 KiB write x{w} + fsync, {what}", "ops/s")
                 for w in WRITERS]
    rows.append((wrand_key(1, SUSTAINED), "rand 4 KiB write x1 + fsync, warm, sustained", "ops/s"))
    rows += [(f"wh5_{state}", f"h5py r+ update, {state}", "s") for state in WRITE_STATES]
    return rows


@contextlib.contextmanager
def _counted_once(into: dict, key, read, diff):
    """Around the first measurement of ``key``: ``into[key] = diff(read() after, before)``
    when ``read`` gives numbers both times (a system without counters gives None)."""
    if key in into:
        yield
        return
    before = read()
    yield
    after = read() if before is not None else None
    if before is not None and after is not None:
        into[key] = diff(after, before)


class Runner:
    def __init__(self, args: argparse.Namespace, size: int) -> None:
        self.args = args
        self.size = size
        self.results: dict[str, dict[str, list[float]]] = {s: {} for s in SYSTEMS}
        self.notes: dict[str, list[str]] = {s: [] for s in SYSTEMS}  # the read cases'
        self.wnotes: dict[str, list[str]] = {s: [] for s in SYSTEMS}  # the write cases'
        self.phase = "reads"  # which of CASE_GROUPS is running: where notes go
        self.big_src: Path = Path()
        # (system, case) -> (read requests, bytes) the daemon saw during the first measurement
        self.requests: dict[tuple[str, str], tuple[int, int]] = {}
        # (system, write case) -> write counters (writes, bytes, faults ...), first measurement
        self.wrequests: dict[tuple[str, str], dict[str, int]] = {}
        self.h5_src: Path = Path()
        self.checked: dict[str, list[str]] = {s: [] for s in SYSTEMS}  # write cases verified

    def counting(self, sysm: System, key: str):
        """The read requests (count, bytes) of the first measurement of ``key``."""
        return _counted_once(self.requests, (sysm.name, key), sysm.counters,
                                 lambda a, b: (a[0] - b[0], a[1] - b[1]))

    def counting_writes(self, sysm: System, key: str):
        """What the write requests of the first measurement of ``key`` made the daemon do."""
        return _counted_once(self.wrequests, (sysm.name, key), sysm.write_counters,
                                 lambda a, b: {k: a[k] - b[k] for k in a})

    def record(self, system: str, key: str, value: float) -> None:
        self.results[system].setdefault(key, []).append(value)

    def seq(self, sysm: System, key: str) -> None:
        if key == "seq_cold_staged":  # the disk's part of a staged read (local only)
            fn, args = _seq_read_staged, (sysm.big_path(), str(sysm.work / "staged-floor"))
        else:
            fn, args = _seq_read, (sysm.big_path(),)
        try:
            with self.counting(sysm, key):
                out = in_child(fn, *args, timeout=self.args.seq_timeout)
        except BenchError as exc:
            self.fail(sysm, key, exc)
            return
        if out["bytes"] != self.size:
            self.fail(sysm, key, BenchError(f"read {out['bytes']} bytes, expected {self.size}"))
            return
        mibs = out["bytes"] / MiB / out["seconds"]
        self.record(sysm.name, key, mibs)
        log(f"{sysm.name:8} {key:22} {mibs:9.1f} MiB/s")

    def rand(self, sysm: System, bs: int, readers: int, state: str, count: int) -> None:
        key = rand_key(bs, readers, state)
        try:
            with self.counting(sysm, key):
                out = rand_read(sysm.big_path(), self.size, bs, count, readers, self.args.seed,
                                self.args.case_cap)
        except BenchError as exc:
            self.fail(sysm, key, exc)
            return
        ops = out["ops"] / out["seconds"]
        self.record(sysm.name, key, ops)
        if out["capped"]:
            self.note(sysm, f"{key}: stopped at the {self.args.case_cap:.0f} s cap "
                            f"after {out['ops']} reads")
        log(f"{sysm.name:8} {key:22} {ops:9.0f} ops/s ({out['ops']} reads)")

    def h5(self, sysm: System, key: str) -> None:
        try:
            with self.counting(sysm, key):
                out = in_child(_h5_read, sysm.h5_path(), timeout=self.args.seq_timeout)
        except BenchError as exc:
            self.fail(sysm, key, exc)
            return
        self.record(sysm.name, key, out["seconds"])
        log(f"{sysm.name:8} {key:22} {out['seconds']:9.2f} s")

    def fail(self, sysm: System, key: str, exc: Exception) -> None:
        log(f"{sysm.name} {key} FAILED: {exc}")
        self.note(sysm, f"{key} failed: {exc}")

    def note(self, sysm: System, msg: str) -> None:
        notes = (self.wnotes if self.phase == "writes" else self.notes)[sysm.name]
        if msg not in notes:
            notes.append(msg)

    def run_system(self, sysm: System) -> None:
        a = self.args
        log(f"== {sysm.name}")
        for rep in range(a.reps):
            log(f"{sysm.name} rep {rep + 1}/{a.reps}: sequential, h5py and warm random")
            sysm.start()
            try:
                drop_caches()
                self.seq(sysm, "seq_cold")
                if sysm.name == "local":  # what staging every byte costs the disk
                    drop_caches()
                    self.seq(sysm, "seq_cold_staged")
                if sysm.name not in ("ceiling",) and rep == 0:
                    bad = spot_check(sysm.big_path(), self.big_src, self.size, a.seed)
                    if bad:
                        self.note(sysm, f"WRONG BYTES: {bad}")
                        log(f"{sysm.name}: {bad}")
                if sysm.has_h5:
                    drop_caches()
                    self.h5(sysm, "h5_cold")
                drop_caches()
                self.seq(sysm, "seq_warm_dropped")
                self.seq(sysm, "seq_warm_cached")
                for bs, readers in RAND_SHAPES:
                    drop_caches()
                    self.rand(sysm, bs, readers, "warm", a.rand_ops)
                if sysm.has_h5:
                    drop_caches()
                    self.h5(sysm, "h5_warm_dropped")
                    self.h5(sysm, "h5_warm_cached")
                sysm.note_rss()
            finally:
                sysm.stop()
        for rep in range(a.reps):
            log(f"{sysm.name} rep {rep + 1}/{a.reps}: cold random")
            for bs, readers in RAND_SHAPES:
                sysm.start()
                try:
                    drop_caches()
                    self.rand(sysm, bs, readers, "cold", a.rand_ops_cold)
                finally:
                    sysm.stop()


    # -- writes ------------------------------------------------------------------------------

    def run_writes(self, systems: list[System]) -> None:
        """The write cases, each rep of each case on a fresh mount (and fresh copies); the
        systems take turns case by case, so a change in the machine's load falls on all of
        them alike (it is shared: ratios, not absolute numbers)."""
        a = self.args
        log("== writes: " + ", ".join(s.name for s in systems))
        h5_plan = h5_update_plan(self.h5_src, a.h5_write_fraction, a.seed)
        for rep in range(a.reps):
            log(f"writes rep {rep + 1}/{a.reps}")
            for sysm in systems:
                self.write_case(sysm, "wseq", self.big_src, False, self._wseq, rep)
            for state in WRITE_STATES:
                count = a.write_ops_cold if state == "cold" else a.write_ops
                for writers in WRITERS:
                    plan = rand_write_plan(self.size, count, writers, a.seed)
                    for sysm in systems:
                        self.write_case(sysm, wrand_key(writers, state), self.big_src,
                                        state == "warm", lambda path, s=sysm, plan=plan:
                                        self._wrand(s, path, plan), rep)
            plan = rand_write_plan(self.size, a.write_ops_sustained, 1, a.seed + 1)
            for sysm in systems:
                self.write_case(sysm, wrand_key(1, SUSTAINED), self.big_src, True,
                                lambda path, s=sysm, plan=plan: self._wrand(s, path, plan), rep)
            for state in WRITE_STATES:
                for sysm in (s for s in systems if s.has_h5):
                    self.write_case(sysm, f"wh5_{state}", self.h5_src, state == "warm",
                                    lambda path: self._wh5(path, h5_plan), rep)

    def write_case(self, sysm: System, key: str, src: Path, warm: bool, measure,
                   rep: int) -> None:
        """One rep of one write case: fresh copies (rclone, local) and a fresh mount, ``src``
        staged when ``warm``, page cache dropped, measured; on the first rep the bytes read
        back (page cache dropped) and compared with the model, for faultfs after a remount
        too."""
        check = rep == 0 and sysm.keeps_writes
        copy = sysm.h5_src if src == self.h5_src else sysm.big_src
        path = sysm.h5_path() if src == self.h5_src else sysm.big_path()
        try:
            if copy != src:  # rclone and local write a copy of the source
                shutil.copyfile(src, copy)
            sysm.start()
            try:
                if warm:
                    bad = sysm.stage(path, src.stat().st_size)
                    if bad:
                        self.note(sysm, f"{key}: not all staged: {bad}")
                drop_caches()
                cpu0 = cpu_seconds(sysm.pid) if sysm.pid is not None else None
                with self.counting_writes(sysm, key):
                    value, close_s, verify = measure(path)
                cpu1 = cpu_seconds(sysm.pid) if sysm.pid is not None else None
                if cpu0 is not None and cpu1 is not None:
                    self.record(sysm.name, f"{key}_cpu", cpu1 - cpu0)
                self.record(sysm.name, key, value)
                unit = next(u for k, _, u in write_cases() if k == key)
                after = ""
                if close_s is not None:
                    self.record(sysm.name, f"{key}_close", close_s)
                    after = f" (close {close_s * 1000:.0f} ms)"
                log(f"{sysm.name:8} {key:22} {fmt_value(value, unit):>9} {unit}{after}")
                sysm.note_rss()
                if check:
                    self.check_written(sysm, key, path, verify)
            finally:
                sysm.stop()
        except BenchError as exc:
            self.fail(sysm, key, exc)

    def check_written(self, sysm: System, key: str, path: str, verify) -> None:
        drop_caches()
        bad = verify(path)
        where = "read back"
        if not bad and isinstance(sysm, Faultfs):
            sysm.stop()
            sysm.start(fresh=False)
            drop_caches()
            bad, where = verify(path), "read back after a remount"
        if bad:
            self.note(sysm, f"WRONG BYTES in {key} ({where}): {bad}")
            log(f"{sysm.name}: {key}: {bad}")
        else:
            self.checked[sysm.name].append(key)

    def _wseq(self, path: str) -> tuple[float, float, object]:
        out = in_child(_seq_write, path, self.size, self.args.seed, timeout=self.args.seq_timeout)
        model = SeqModel(self.args.seed)

        def verify(p: str) -> str:
            return in_child(_verify_file, p, self.size, str(self.big_src), model,
                            timeout=self.args.seq_timeout)["bad"]
        return out["bytes"] / MiB / out["seconds"], out["close_s"], verify

    def _wrand(self, sysm: System, path: str, plan: list[list[int]]) -> tuple[float, float, object]:
        base = rand_write_base(self.args.seed)
        out = rand_write(path, plan, base, self.args.case_cap)
        if out["capped"]:
            self.note(sysm, f"random writes stopped at the {self.args.case_cap:.0f} s cap "
                            f"after {out['ops']} writes")

        def verify(p: str) -> str:
            written = {off: rand_payload(base, w, n, off) for w, offsets in enumerate(plan)
                       for n, off in enumerate(offsets[:out["done"][w]])}
            return in_child(_verify_file, p, self.size, str(self.big_src),
                            OverlayModel(written),
                            timeout=self.args.seq_timeout)["bad"]
        return out["ops"] / out["seconds"], out["close_s"], verify

    def _wh5(self, path: str, plan: tuple[int, list[int]]) -> tuple[float, float, object]:
        rows, chunks = plan
        out = in_child(_h5_update, path, rows, chunks, self.args.seed,
                       timeout=self.args.seq_timeout)

        def verify(p: str) -> str:
            return in_child(_h5_verify, p, str(self.h5_src), rows, chunks, self.args.seed,
                            timeout=self.args.seq_timeout)["bad"]
        return out["seconds"], out["close_s"], verify


# -- the table ---------------------------------------------------------------------------------

# (case key, other system, minimum ratio faultfs/other) from issue 6
TARGETS: dict[str, list[tuple[str, float]]] = {
    "seq_cold": [("rclone", 2.0), ("ceiling", 0.5)],
    "seq_warm_dropped": [("rclone", 1.5)],
    "seq_warm_cached": [("local", 0.8)],
    "rand4k_x1_cold": [("rclone", 2.0)], "rand4k_x8_cold": [("rclone", 2.0)],
    "rand4k_x1_warm": [("rclone", 2.0)], "rand4k_x8_warm": [("rclone", 2.0)],
    # the writes issue, item 6
    "wseq": [("rclone", 1.0)],
    **{wrand_key(w, state): [("rclone", 2.0)] for w in WRITERS for state in WRITE_STATES},
    wrand_key(1, SUSTAINED): [("rclone", 2.0)],
}
RSS_TARGET_MIB = 300


def median(values: list[float] | None) -> float | None:
    return statistics.median(values) if values else None


def fmt_value(v: float | None, unit: str) -> str:
    if v is None:
        return "—"
    if unit == "s":
        return f"{v:.2f}"
    if unit == "MiB/s":
        return f"{v:.0f}" if v >= 100 else f"{v:.1f}"
    return f"{v:,.0f}"


def speed_ratio(f: float | None, other: float | None, unit: str) -> float | None:
    """faultfs speed / other speed (> 1: faultfs faster); for times that is other / faultfs."""
    if not f or not other:
        return None
    return other / f if unit == "s" else f / other


def build_table(runner: Runner, peak_rss: dict[str, float | None],
                cases: list[tuple[str, str, str]] | None = None,
                rss_target: float | None = RSS_TARGET_MIB,
                target_issue: str = "issue 6") -> tuple[str, list[str]]:
    """The medians of ``cases`` (default: the read cases) per system, faultfs's ratios, the
    targets; the daemons' peak RSS last (checked against ``rss_target`` when given)."""
    head = ("| case | unit | faultfs | rclone | local | ceiling | f/rclone | f/local | f/ceiling "
            f"| target ({target_issue}) |")
    lines = [head, "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    verdicts = []
    for key, label, unit in cases or all_cases():
        meds = {s: median(runner.results[s].get(key)) for s in SYSTEMS}
        if all(v is None for v in meds.values()):
            continue
        ratios = {s: speed_ratio(meds["faultfs"], meds[s], unit) for s in ("rclone", "local", "ceiling")}
        cells = [label, unit] + [fmt_value(meds[s], unit) for s in SYSTEMS]
        cells += [f"{ratios[s]:.2f}×" if ratios[s] is not None else "—"
                  for s in ("rclone", "local", "ceiling")]
        goals = []
        for other, want in TARGETS.get(key, []):
            got = ratios[other]
            if got is None:
                goals.append(f"f/{other} ≥ {want:g}: not measured")
                verdicts.append(f"{label}: f/{other} not measured")
                continue
            ok = got >= want
            near = abs(got - want) < 0.01  # show enough digits to see which side of the line
            goals.append(f"f/{other} ≥ {want:g}: **{'met' if ok else 'not met'}**"
                         + (f" ({got:.3f}×)" if near else ""))
            pct = f"{got / want * 100:.1f}" if near else f"{got / want * 100:.0f}"
            verdicts.append(f"{label}: faultfs/{other} = {got:.3f}×" if near else
                            f"{label}: faultfs/{other} = {got:.2f}×")
            verdicts[-1] += (f" (target ≥ {want:g}×) — "
                             + ("met" if ok else f"not met, {pct} % of the target"))
        cells.append("; ".join(goals))
        lines.append("| " + " | ".join(cells) + " |")
    f_rss = peak_rss.get("faultfs")
    rss_cells = ["daemon peak RSS (VmHWM)", "MiB"]
    rss_cells += [f"{peak_rss[s]:.0f}" if peak_rss.get(s) is not None else "—" for s in SYSTEMS]
    rss_cells += ["", "", ""]
    if rss_target is None:
        rss_cells.append("")
    elif f_rss is None:
        rss_cells.append(f"≤ {rss_target} MiB: not measured")
    else:
        ok = f_rss <= rss_target
        rss_cells.append(f"≤ {rss_target} MiB: **{'met' if ok else 'not met'}**")
        verdicts.append(f"daemon peak RSS: {f_rss:.0f} MiB (target ≤ {rss_target} MiB, "
                        f"{runner.size / MiB / 1024:g} GiB source) — {'met' if ok else 'not met'}")
    lines.append("| " + " | ".join(rss_cells) + " |")
    return "\n".join(lines), verdicts


def spread_table(runner: Runner, cases: list[tuple[str, str, str]] | None = None) -> str:
    lines = ["| case | " + " | ".join(SYSTEMS) + " |", "| --- |" + " ---: |" * len(SYSTEMS)]
    for key, label, unit in cases or all_cases():
        cells = []
        for s in SYSTEMS:
            vals = runner.results[s].get(key)
            if not vals:
                cells.append("—")
            else:
                cells.append(" / ".join(fmt_value(v, unit) for v in vals))
        if any(c != "—" for c in cells):
            lines.append(f"| {label} ({unit}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# -- the document ------------------------------------------------------------------------------

def replace_section(doc: str, marker: str, body: str) -> str:
    start, end = f"<!-- {marker}:start -->", f"<!-- {marker}:end -->"
    block = f"{start}\n{body.rstrip()}\n{end}"
    if start in doc and end in doc:
        return re.sub(re.escape(start) + r".*?" + re.escape(end), lambda _: block, doc, flags=re.S)
    return doc.rstrip() + "\n\n" + block + "\n"


# -- main --------------------------------------------------------------------------------------

def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/bench", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.split("\n")[2:]))
    p.add_argument("--quick", action="store_true",
                   help="256 MiB source, 64 MiB HDF5, 2 reps, fewer random reads and writes "
                        "(about 1 minute for the reads, 2 for the writes)")
    p.add_argument("--size-mb", type=int, help="source size in MiB (default 1024; --quick 256)")
    p.add_argument("--h5-mb", type=int, help="HDF5 dataset size before compression (default 384; --quick 64)")
    p.add_argument("--reps", type=int,
                   help="repetitions of each case, median reported (default 5; --quick 2)")
    p.add_argument("--rand-ops", type=int,
                   help="random reads per warm case, split over the readers (default 8000; --quick 2000)")
    p.add_argument("--rand-ops-cold", type=int,
                   help="random reads per cold case, split over the readers (default 400; --quick 200)")
    p.add_argument("--cases", default="all",
                   help="which cases: reads, writes, or all (default; both, reads first)")
    p.add_argument("--write-ops", type=int,
                   help="random 4 KiB writes per warm case, split over the writers (default 8000; "
                        "--quick 2000)")
    p.add_argument("--write-ops-sustained", type=int,
                   help="random 4 KiB writes of the sustained case, one writer (default 48000, "
                        "187.5 MiB: three times faultfs's default --dirty-mb; --quick 20000)")
    p.add_argument("--write-ops-cold", type=int,
                   help="random 4 KiB writes per cold case, split over the writers (default 1000; "
                        "--quick 400)")
    p.add_argument("--h5-write-fraction", type=float, default=0.125,
                   help="fraction of the HDF5 dataset's chunks the h5py update rewrites "
                        "(default %(default)s)")
    p.add_argument("--case-cap", type=float, default=CASE_CAP_S_DEFAULT,
                   help="stop a random case after this many seconds (default %(default)s)")
    p.add_argument("--seq-timeout", type=float, default=600,
                   help="give up on one sequential or h5py read, write or check after this "
                        "many seconds")
    p.add_argument("--seed", type=int, default=6)
    p.add_argument("--chunk-size", default="0", help="faultfs --chunk-size (default 0: faultfs's own default, 1 MiB)")
    p.add_argument("--faultfs-args", default="", help="extra flags for faultfs mount, one string")
    p.add_argument("--rclone-args", default="", help="extra flags for rclone mount, one string")
    p.add_argument("--faultfs-head", action="store_true",
                   help="run faultfs from a clean export of HEAD (git archive into the run's "
                        "directory, first on PYTHONPATH) instead of the working tree: one "
                        "committed state for the whole run while others edit the tree")
    p.add_argument("--ceiling-readahead-kb", type=int,
                   help="read_ahead_kb for the ceiling mount (default: what faultfs's mount had; "
                        "0: the kernel default)")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated subset of {','.join(SYSTEMS)} (default all)")
    p.add_argument("--data-dir", help="keep the generated sources here and reuse them next time")
    p.add_argument("--work-dir", help="parent of the private temporary directory (default /tmp)")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, stores)")
    p.add_argument("--json", dest="json_out", help="also write the raw results as JSON here")
    p.add_argument("--write-doc", action="store_true",
                   help="replace the 'latest run' sections of docs/benchmarks.md (reads, writes) "
                        "with this run's")
    a = p.parse_args(argv)
    q = a.quick
    a.size_mb = a.size_mb or (256 if q else 1024)
    a.h5_mb = a.h5_mb or (64 if q else 384)
    a.reps = a.reps or (2 if q else 5)
    a.rand_ops = a.rand_ops or (2000 if q else 8000)
    a.rand_ops_cold = a.rand_ops_cold or (200 if q else 400)
    a.write_ops = a.write_ops or (2000 if q else 8000)
    a.write_ops_cold = a.write_ops_cold or (400 if q else 1000)
    a.write_ops_sustained = a.write_ops_sustained or (20000 if q else 48000)
    cases = {c.strip() for c in a.cases.split(",") if c.strip()}
    if cases - {*CASE_GROUPS, "all"} or not cases:
        p.error(f"--cases: one or more of {', '.join(CASE_GROUPS)}, all")
    a.cases = list(CASE_GROUPS) if "all" in cases else [g for g in CASE_GROUPS if g in cases]
    if not 0 < a.h5_write_fraction <= 1:
        p.error("--h5-write-fraction must be in (0, 1]")
    a.systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    bad = [s for s in a.systems if s not in SYSTEMS]
    if bad or "faultfs" not in a.systems:
        p.error(f"--systems: unknown {bad}" if bad else "--systems must include faultfs")
    if a.size_mb < 16:
        p.error("--size-mb must be at least 16")
    return a


def _on_sigterm(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str]) -> int:
    if os.geteuid() != 0:
        print("bench: run as root (it drops the kernel page cache between cases)", file=sys.stderr)
        return 2
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGHUP, _on_sigterm)
    command = "scripts/bench " + shlex.join(argv) if argv else "scripts/bench"
    work = Path(tempfile.mkdtemp(prefix="faultfs-bench-", dir=args.work_dir)).resolve()
    log(f"working in {work}")
    data_dir = Path(args.data_dir).resolve() if args.data_dir else work / "data"
    if args.json_out:  # --faultfs-head changes the working directory
        args.json_out = str(Path(args.json_out).resolve())
    started = datetime.datetime.now().astimezone()
    machine = machine_description()
    load_start = loadavg()
    busy = busiest_processes()
    systems: list[System] = []  # every instance, for the cleanup
    by_group: dict[str, list[System]] = {g: [] for g in CASE_GROUPS}
    seconds: dict[str, float] = {}
    runner: Runner | None = None
    interrupted = False
    try:
        if args.faultfs_head:
            use_head_export(work / "faultfs-head", machine)
        big, h5 = make_data(data_dir, args.size_mb, args.h5_mb, args.seed)
        size = big.stat().st_size
        runner = Runner(args, size)
        runner.big_src, runner.h5_src = big, h5

        def copies(name: str) -> tuple[Path, Path]:
            """Where a system that writes in place keeps its fresh copies of the sources."""
            d = work / f"wsrc-{name}"
            d.mkdir(exist_ok=True)
            return d / big.name, d / h5.name

        makers = {
            "reads": {
                "faultfs": lambda: Faultfs(work, big, h5, args.chunk_size,
                                           shlex.split(args.faultfs_args)),
                "rclone": lambda: Rclone(work, big, h5, shlex.split(args.rclone_args)),
                "local": lambda: Local(work, big, h5),
                "ceiling": lambda: Ceiling(work, big, h5, size, ceiling_readahead()),
            },
            "writes": {
                "faultfs": lambda: Faultfs(work, big, h5, args.chunk_size,
                                           shlex.split(args.faultfs_args), prefix="wmnt"),
                "rclone": lambda: Rclone(work, *copies("rclone"), shlex.split(args.rclone_args),
                                         prefix="wmnt", writable=True),
                "local": lambda: Local(work, *copies("local"), prefix="wmnt"),
                "ceiling": lambda: Ceiling(work, big, h5, size, None, prefix="wmnt",
                                           writable=True),
            },
        }

        def ceiling_readahead() -> int | None:
            """The ceiling gets the readahead faultfs set for itself (same kernel path)."""
            if args.ceiling_readahead_kb is not None:
                return args.ceiling_readahead_kb or None
            return next((s.readahead_kb for s in by_group["reads"] if isinstance(s, Faultfs)),
                        None)

        with LoadSampler() as sampler:
            for group in CASE_GROUPS:
                if group not in args.cases:
                    continue
                runner.phase = group
                t_group = time.monotonic()
                for name in SYSTEMS:
                    if name not in args.systems:
                        continue
                    sysm = makers[group][name]()
                    systems.append(sysm)
                    by_group[group].append(sysm)
                    if group == "writes":
                        continue  # run together below, case by case
                    try:
                        runner.run_system(sysm)
                    except BenchError as exc:
                        runner.fail(sysm, "run", exc)
                        sysm.stop()
                if group == "writes":
                    runner.run_writes(by_group[group])
                seconds[group] = time.monotonic() - t_group
        loads = sampler.samples
    except KeyboardInterrupt:
        interrupted = True
        log("interrupted: cleaning up")
        loads = []
    finally:
        cleanup(work, systems, keep=args.keep)
    if interrupted or runner is None:
        return 130
    load_line = (f"1-min load average {load_start:.2f} at the start, "
                 f"mean {statistics.mean(loads):.2f} / max {max(loads):.2f} during the run "
                 f"(the bench itself adds about 1–2); busiest processes at the start: {busy}"
                 if loads else f"1-min load average {load_start:.2f} at the start")
    head = functools.partial(report_head, args, command, started, machine, load_line, seconds)
    reports = {}
    peaks = {g: {s.name: s.peak_rss_mib for s in by_group[g]} for g in CASE_GROUPS}
    if by_group["reads"]:
        table, verdicts = build_table(runner, peaks["reads"])
        readahead = ", ".join(f"{s.name} {s.readahead_kb} KiB" for s in by_group["reads"]
                              if s.readahead_kb is not None)
        reports["reads"] = render_report(args, head, table, verdicts, runner,
                                         request_table(runner), readahead)
    if by_group["writes"]:
        reports["writes"] = render_write_report(args, head, runner, peaks["writes"])
    print()
    print("\n\n".join(reports.values()))
    if args.json_out:
        last_stats = {g: next((s.last_stats for s in by_group[g] if isinstance(s, Faultfs)), {})
                      for g in CASE_GROUPS}
        Path(args.json_out).write_text(json.dumps({
            "command": command, "started": started.isoformat(), "machine": machine,
            "loads": loads, "seconds": seconds, "results": runner.results,
            "notes": runner.notes, "write_notes": runner.wnotes,
            "peak_rss_mib": peaks["reads"], "write_peak_rss_mib": peaks["writes"],
            "requests": {f"{s} {k}": v for (s, k), v in runner.requests.items()},
            "write_requests": {f"{s} {k}": v for (s, k), v in runner.wrequests.items()},
            "faultfs_stats": last_stats["reads"], "faultfs_write_stats": last_stats["writes"]},
            indent=1))
    if args.write_doc:
        for group, report in reports.items():
            write_doc(report, DOC_MARKERS[group][args.quick])
        log(f"wrote {DOC}")
    return 0


def request_table(runner: Runner) -> str:
    """Read requests the kernel sent per case (first rep), for the systems that count them."""
    shown = [s for s in ("faultfs", "ceiling") if any(k[0] == s for k in runner.requests)]
    if not shown:
        return ""
    lines = ["| case | " + " | ".join(f"{s} requests | {s} KiB/request" for s in shown) + " |",
             "| --- |" + " ---: | ---: |" * len(shown)]
    for key, label, _unit in all_cases():
        cells = []
        for s in shown:
            got = runner.requests.get((s, key))
            if got is None or got[0] <= 0:
                cells += ["—", "—"]
            else:
                cells += [f"{got[0]:,}", f"{got[1] / got[0] / 1024:.0f}"]
        if any(c != "—" for c in cells):
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_request_table(runner: Runner) -> str:
    """Write requests that reached faultfs's daemon (and the ceiling's) per write case, first
    rep, and what they made faultfs do."""
    f_cols = ("faults", "MiB stored", "folds", "checkpoints", "fsyncs")
    lines = ["| case | faultfs requests | KiB/request | " + " | ".join(f_cols)
             + " | ceiling requests | KiB/request |",
             "| --- |" + " ---: |" * (len(f_cols) + 4)]
    for key, label, _unit in write_cases():
        f = runner.wrequests.get(("faultfs", key))
        c = runner.wrequests.get(("ceiling", key))
        if f is None and c is None:
            continue
        cells = []
        for got in (f, c):
            if got is None or got["writes"] <= 0:
                cells.append(["—", "—"])
            else:
                cells.append([f"{got['writes']:,}", f"{got['bytes'] / got['writes'] / 1024:.0f}"])
        extra = (["—"] * len(f_cols) if f is None else
                 [f"{f['faults']:,}", f"{f['stored_bytes'] / MiB:,.0f}", f"{f['folds']:,}",
                  f"{f['checkpoints']:,}", f"{f['fsyncs']:,}"])
        lines.append("| " + " | ".join([label, *cells[0], *extra, *cells[1]]) + " |")
    return "\n".join(lines)


def close_table(runner: Runner) -> str:
    """How long ``close`` took after the timed fsync (work a system defers past it)."""
    lines = ["| case | " + " | ".join(SYSTEMS) + " |", "| --- |" + " ---: |" * len(SYSTEMS)]
    for key, label, _unit in write_cases():
        meds = [median(runner.results[s].get(f"{key}_close")) for s in SYSTEMS]
        if any(m is not None for m in meds):
            lines.append(f"| {label} | " + " | ".join(
                "—" if m is None else f"{m * 1000:,.1f}" for m in meds) + " |")
    return "\n".join(lines)


def cpu_table(runner: Runner) -> str:
    """CPU seconds the daemons used during each case's timed part (median over the reps): a
    measure the machine's load changes far less than the times."""
    shown = [s for s in ("faultfs", "rclone", "ceiling")
             if any(k.endswith("_cpu") for k in runner.results[s])]
    if not shown:
        return ""
    lines = ["| case | " + " | ".join(f"{s} CPU s" for s in shown)
             + (" | faultfs ÷ rclone |" if "rclone" in shown else " |"),
             "| --- |" + " ---: |" * (len(shown) + ("rclone" in shown))]
    for key, label, _unit in write_cases():
        meds = {s: median(runner.results[s].get(f"{key}_cpu")) for s in shown}
        if all(m is None for m in meds.values()):
            continue
        cells = ["—" if meds[s] is None else f"{meds[s]:.2f}" for s in shown]
        if "rclone" in shown:
            f, r = meds.get("faultfs"), meds["rclone"]
            cells.append(f"{f / r:.1f}×" if f and r else "—")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report_head(args, command, started, machine, load_line, seconds: dict[str, float],
                title: str, group: str) -> list[str]:
    """The lines every report starts with: what ran (how long ``group``'s cases took), where,
    on what load."""
    m = machine
    took = int(seconds.get(group, 0))
    what = f"its {group[:-1]} cases: " if len(seconds) > 1 else ""
    return [
        f"### {'Quick ' if args.quick else ''}{title} of {started.strftime('%Y-%m-%d %H:%M %Z')}",
        "",
        f"Command: `{command}` ({what}{took // 60} min {took % 60} s)",
        "",
        f"Machine: {m['cores']} cores ({m['cpu']}), {m['mem_gib']} GiB, Linux {m['kernel']}, "
        f"Python {m['python']}, pyfuse3 {m['pyfuse3']}, {m['rclone']}. faultfs at {m['commit']}"
        + (" (a clean export of that commit, `--faultfs-head`)" if m.get("head_export") else "")
        + (f" with uncommitted changes in {', '.join(m['faultfs_uncommitted'])}"
           if m["faultfs_uncommitted"] else "") + ".",
        "",
        f"Load: {load_line}.",
        "",
    ]


def staged_floor_lines(runner) -> list[str]:
    """The disk's part of a staged cold read (measured beside the local file) and faultfs's
    cold read against it."""
    staged = median(runner.results["local"].get("seq_cold_staged"))
    plain = median(runner.results["local"].get("seq_cold"))
    cold = median(runner.results["faultfs"].get("seq_cold"))
    if not staged or not plain:
        return []
    line = (f"The disk's part of a staged cold read, measured in the same reps (the local file "
            f"read in 1 MiB blocks by {STAGE_THREADS} threads, every block also written to a new "
            f"file of its own on the store's file system by {STAGE_THREADS} more, both "
            f"`O_DIRECT` as faultfs's are; no FUSE, no checksums): {staged:,.0f} MiB/s, "
            f"{staged / plain:.2f}× the plain cold read")
    if cold:
        line += f"; faultfs's seq cold is {cold / staged:.2f}× it"
    return [line + ".", ""]


def render_report(args, head, table, verdicts, runner, observations, readahead) -> str:
    lines = [
        *head("run" if args.quick else "Run", "reads"),
        f"Source: {args.size_mb} MiB of random bytes; HDF5: {args.h5_mb} MiB float32 "
        f"(chunks 64×1024, shuffle+gzip 1). faultfs `--chunk-size {args.chunk_size}`"
        + (f" `{args.faultfs_args}`" if args.faultfs_args else "")
        + f"; rclone `--vfs-cache-mode full`{' ' + args.rclone_args if args.rclone_args else ''}. "
        f"Medians of {args.reps} reps; random: {args.rand_ops} reads per warm case, "
        f"{args.rand_ops_cold} per cold case, split over the readers (forked processes). "
        f"Kernel readahead of the mounts (bdi read_ahead_kb): {readahead or 'not read'}.",
        "",
        "Ratios are faultfs speed ÷ other speed (> 1: faultfs faster; for the h5py times, other "
        "time ÷ faultfs time).",
        "",
        table,
        "",
        *staged_floor_lines(runner),
        "Targets:",
        "",
        *[f"- {v}" for v in verdicts],
    ]
    notes = [f"- {s}: {n}" for s in SYSTEMS for n in runner.notes[s]]
    if notes:
        lines += ["", "Notes:", "", *notes]
    if observations:
        lines += ["", "Read requests that reached the daemon (first rep of each case; the "
                  "kernel splits and merges the client's reads):", "", observations]
    lines += ["", "<details><summary>Every rep</summary>", "", spread_table(runner), "", "</details>"]
    return "\n".join(lines)


def render_write_report(args, head, runner: Runner, peak: dict[str, float | None]) -> str:
    table, verdicts = build_table(runner, peak, write_cases(), rss_target=None,
                                  target_issue="writes, item 6")
    checked = []
    for s in SYSTEMS:
        done = runner.checked[s]
        if not done:
            continue
        missing = [label for k, label, _ in write_cases()
                   if k not in done and runner.results[s].get(k)]
        checked.append(f"{s} ({'every case' if not missing else 'not: ' + ', '.join(missing)})")
    lines = [
        *head("write run" if args.quick else "Write run", "writes"),
        f"Source: {args.size_mb} MiB of random bytes (view `big/big.bin`); HDF5: {args.h5_mb} MiB "
        f"float32 (chunks 64×1024, shuffle+gzip 1). faultfs `--chunk-size {args.chunk_size}`"
        + (f" `{args.faultfs_args}`" if args.faultfs_args else "")
        + " over the read-only sources; rclone `--vfs-cache-mode full` writable"
        + (f" `{args.rclone_args}`" if args.rclone_args else "")
        + " over a directory with fresh copies; local: a fresh copy; ceiling: "
        "`fuse_ceiling.py --writable` (drops the bytes). A fresh mount (empty store or cache) per "
        f"case and rep, page cache dropped before each. Medians of {args.reps} reps; random: "
        f"{args.write_ops} writes per warm case, {args.write_ops_cold} per cold case, "
        f"{args.write_ops_sustained} in the sustained one, distinct "
        "4 KiB-aligned offsets split over the writers (forked processes), each ending with "
        f"fsync; h5py: {args.h5_write_fraction:g} of the dataset's chunks rewritten whole, then "
        "close (no fsync: h5py never calls it).",
        "",
        "Ratios are faultfs speed ÷ other speed (> 1: faultfs faster; for the h5py times, other "
        "time ÷ faultfs time). The peak RSS row is the write-case daemons'.",
        "",
        table,
        "",
        "Targets:",
        "",
        *[f"- {v}" for v in verdicts],
        "",
        "Written bytes read back and equal to the model (first rep, page cache dropped; faultfs "
        "also after a remount): " + ("; ".join(checked) if checked else "none") + ".",
    ]
    notes = [f"- {s}: {n}" for s in SYSTEMS for n in runner.wnotes[s]]
    if notes:
        lines += ["", "Notes:", "", *notes]
    lines += ["", "`close` after the timed fsync (ms, median): work a system leaves for later.",
              "", close_table(runner),
              "", "CPU the daemons used during the timed part of each case (median; all their "
              "threads; work left for later, such as faultfs's folds after the fsync, is not "
              "in it):", "", cpu_table(runner),
              "", "Write requests that reached the daemon (first rep of each case) and what they "
              "made faultfs do:", "", write_request_table(runner),
              "", "<details><summary>Every rep</summary>", "", spread_table(runner, write_cases()),
              "", "</details>"]
    return "\n".join(lines)


# report marker per case group: (full run, --quick run)
DOC_MARKERS = {"reads": {False: "latest-run", True: "latest-quick-run"},
               "writes": {False: "latest-writes-run", True: "latest-writes-quick-run"}}


def write_doc(report: str, marker: str) -> None:
    doc = DOC.read_text() if DOC.exists() else "# Benchmarks\n"
    DOC.write_text(replace_section(doc, marker, report))


def cleanup(work: Path, systems: list[System], keep: bool) -> None:
    """Unmount everything under ``work`` and kill the daemons we started, whatever happened."""
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not skip this
    try:
        for s in systems:
            try:
                s.stop()
            except Exception as exc:
                log(f"stopping {s.name}: {exc}")
        with open("/proc/self/mounts") as f:
            ours = [line.split()[1] for line in f if line.split()[1].startswith(str(work))]
        for mnt in ours:
            log(f"unmounting leftover {mnt}")
            dev = None
            with contextlib.suppress(OSError):
                dev = os.stat(mnt).st_dev
            force_unmount(Path(mnt), dev)
        for pid in pids_mentioning(str(work)):
            log(f"killing leftover daemon pid {pid}")
            kill_pid(pid)
        if keep:
            log(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    finally:
        signal.signal(signal.SIGINT, old)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
