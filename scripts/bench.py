"""bench: faultfs's read path side by side with rclone's VFS cache, a local read and the FUSE ceiling.

Run through ``scripts/bench`` (which installs rclone and the venv first). One run measures, on a
generated random-bytes source (``--size-mb``, default 1024) and a chunked gzip HDF5 file
(``--h5-mb`` of float32 before compression), for four systems:

- ``faultfs``  ``faultfs mount big.bin grid.h5 MNT --store DIR`` (default 1 MiB chunks; the views);
- ``rclone``   ``rclone mount SRCDIR MNT --vfs-cache-mode full --cache-dir DIR --daemon --read-only``;
- ``local``    the source files themselves;
- ``ceiling``  ``scripts/fuse_ceiling.py``: pyfuse3 + trio serving slices of a constant buffer;

these cases, each ``--reps`` times, reporting the median:

- ``seq cold``: nothing staged (empty store / cache, fresh mount), page cache dropped; one pass of
  1 MiB ``readv`` calls over the whole file;
- ``seq warm, dropped``: everything staged, page cache dropped (staged bytes come off the disk);
- ``seq warm, cached``: everything staged and in the kernel page cache (a second pass);
- ``rand {4K,64K} x{1,8} cold/warm``: ``pread`` of the block size at random aligned offsets
  (fixed seed, a fixed count split over the readers; readers are forked *processes*, so the
  client side has no GIL); cold as above, warm = staged with the page cache dropped;
- ``h5py cold/warm``: read the whole chunked, gzip-compressed dataset in slabs with h5py;
- ``peak RSS``: VmHWM of the faultfs daemon (and of rclone), the maximum over every mount of the
  run.

Every mount lives under a private temporary directory and is unmounted at the end, also on
Ctrl-C or SIGTERM; daemons that survive their unmount are killed by pid.
"""



from __future__ import annotations

import argparse
import contextlib
import datetime
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
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchlib import (
    BenchError,
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
    vm_hwm_mib,
)

ROOT = Path(__file__).resolve().parent.parent
VENV_PY = ROOT / ".venv" / "bin" / "python"
FAULTFS = ROOT / ".venv" / "bin" / "faultfs"
CEILING = ROOT / "scripts" / "fuse_ceiling.py"
DOC = ROOT / "docs" / "benchmarks.md"

MiB = 1 << 20
SEQ_BLOCK = 1 * MiB  # the reader's request size; the kernel splits it into FUSE requests
H5_COLS = 1024  # float32 columns: one row is 4 KiB
H5_CHUNK_ROWS = 64  # 64 x 1024 x 4 B = 256 KiB per chunk before compression
SYSTEMS = ("faultfs", "rclone", "local", "ceiling")
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


def rand_read(path: str, size: int, bs: int, total_ops: int, readers: int, seed: int,
              cap_s: float) -> dict:
    barrier = _ctx.Barrier(readers + 1)
    queue = _ctx.Queue()
    per = max(1, total_ops // readers)
    procs = [_ctx.Process(target=_rand_worker, daemon=True,
                          args=(path, size, bs, per, seed * 1000 + i, cap_s, barrier, queue))
             for i in range(readers)]
    for p in procs:
        p.start()
    results = []
    try:
        barrier.wait(timeout=120)
        for _ in procs:
            results.append(queue.get(timeout=cap_s + 120))
    except Exception as exc:
        raise BenchError(f"random readers failed: {type(exc).__name__}: {exc}") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    start = min(r[0] for r in results)
    end = max(r[1] for r in results)
    done = sum(r[2] for r in results)
    errors = sum(r[3] for r in results)
    if errors:
        raise BenchError(f"{errors} of {done} random reads failed or were short")
    return {"ops": done, "seconds": end - start, "capped": done < per * readers}


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

    def __init__(self, work: Path, big: Path, h5: Path) -> None:
        self.work = work
        self.big_src = big
        self.h5_src = h5
        self.mnt = work / f"mnt-{self.name}"
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
        if is_mounted(self.mnt):
            try:
                run_cmd(unmount_cmd, timeout=60, check=False)
            except BenchError as exc:
                log(str(exc))
            if is_mounted(self.mnt):
                force_unmount(self.mnt, self.dev)
        if self.pid is not None:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and pid_alive(self.pid):
                time.sleep(0.05)
            kill_pid(self.pid)
        self.pid = None


class Local(System):
    name = "local"
    mounts = False


class Faultfs(System):
    name = "faultfs"

    def __init__(self, work: Path, big: Path, h5: Path, chunk_size: str, extra_args: list[str]) -> None:
        super().__init__(work, big, h5)
        self.store = work / "store-faultfs"
        self.chunk_size = chunk_size
        self.extra_args = extra_args
        self.last_stats: dict = {}

    def big_path(self) -> str:
        return str(self.mnt / "big" / "big.bin")

    def h5_path(self) -> str:
        return str(self.mnt / "grid" / "grid.h5")

    def start(self) -> None:
        shutil.rmtree(self.store, ignore_errors=True)
        self.mnt.mkdir(exist_ok=True)
        run_cmd([str(FAULTFS), "mount", str(self.big_src), str(self.h5_src), str(self.mnt),
                 "--store", str(self.store), "--chunk-size", self.chunk_size, *self.extra_args],
                timeout=MOUNT_TIMEOUT_S + 30)
        self._wait_mounted("faultfs")
        self.pid = int(self.stats()["pid"])
        self.readahead_kb = get_readahead_kb(self.mnt)

    def stats(self) -> dict:
        with open(self.mnt / ".faultfs" / "stats") as f:
            return json.loads(f.read())

    def counters(self) -> tuple[int, int] | None:
        try:
            c = self.stats()["counters"]
            return int(c["reads"]), int(c["bytes_served"])
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

    def __init__(self, work: Path, big: Path, h5: Path, extra_args: list[str]) -> None:
        super().__init__(work, big, h5)
        self.cache = work / "cache-rclone"
        self.conf = work / "rclone.conf"
        self.extra_args = extra_args

    def big_path(self) -> str:
        return str(self.mnt / self.big_src.name)

    def h5_path(self) -> str:
        return str(self.mnt / self.h5_src.name)

    def start(self) -> None:
        shutil.rmtree(self.cache, ignore_errors=True)
        self.mnt.mkdir(exist_ok=True)
        self.conf.touch()
        run_cmd(["rclone", "mount", str(self.big_src.parent), str(self.mnt),
                 *rclone_vfs_args(self.cache), "--config", str(self.conf), "--log-file", str(self.work / "rclone.log"),
                 "--daemon", *self.extra_args], timeout=MOUNT_TIMEOUT_S + 30,
                log_to=self.work / "rclone.out")
        self._wait_mounted("rclone")
        self.readahead_kb = get_readahead_kb(self.mnt)
        pids = [p for p in pids_mentioning(str(self.mnt)) if pid_alive(p)]
        self.pid = pids[0] if pids else None

    def stop(self) -> None:
        self.note_rss()
        self._unmount_and_reap(["fusermount3", "-u", str(self.mnt)])
        shutil.rmtree(self.cache, ignore_errors=True)


class Ceiling(System):
    name = "ceiling"
    has_h5 = False

    def __init__(self, work: Path, big: Path, h5: Path, size: int,
                 readahead_kb: int | None) -> None:
        super().__init__(work, big, h5)
        self.size = size
        self.want_readahead_kb = readahead_kb  # None: the kernel default
        self.proc: subprocess.Popen | None = None
        self.stats_file = work / "ceiling.stats"

    def big_path(self) -> str:
        return str(self.mnt / "big.bin")

    def start(self) -> None:
        self.mnt.mkdir(exist_ok=True)
        ready = self.work / "ceiling.ready"
        ready.unlink(missing_ok=True)
        self.stats_file.unlink(missing_ok=True)
        self.proc = subprocess.Popen(
            [str(VENV_PY), str(CEILING), str(self.mnt), "--size", str(self.size),
             "--ready-file", str(ready), "--stats-file", str(self.stats_file)],
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

    def counters(self) -> tuple[int, int] | None:
        if self.proc is None or self.proc.poll() is not None:
            return None
        before = self.stats_file.stat().st_mtime_ns if self.stats_file.exists() else 0
        self.proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError, KeyError):
                if self.stats_file.stat().st_mtime_ns != before:
                    got = json.loads(self.stats_file.read_text())
                    return int(got["reads"]), int(got["bytes"])
            time.sleep(0.01)
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


class Runner:
    def __init__(self, args: argparse.Namespace, size: int) -> None:
        self.args = args
        self.size = size
        self.results: dict[str, dict[str, list[float]]] = {s: {} for s in SYSTEMS}
        self.notes: dict[str, list[str]] = {s: [] for s in SYSTEMS}
        self.big_src: Path = Path()
        # (system, case) -> (read requests, bytes) the daemon saw during the first measurement
        self.requests: dict[tuple[str, str], tuple[int, int]] = {}

    @contextlib.contextmanager
    def counting(self, sysm: System, key: str):
        if (sysm.name, key) in self.requests:
            yield
            return
        before = sysm.counters()
        yield
        after = sysm.counters() if before is not None else None
        if before is not None and after is not None:
            self.requests[(sysm.name, key)] = (after[0] - before[0], after[1] - before[1])

    def record(self, system: str, key: str, value: float) -> None:
        self.results[system].setdefault(key, []).append(value)

    def seq(self, sysm: System, key: str) -> None:
        try:
            with self.counting(sysm, key):
                out = in_child(_seq_read, sysm.big_path(), timeout=self.args.seq_timeout)
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
        if msg not in self.notes[sysm.name]:
            self.notes[sysm.name].append(msg)

    def run_system(self, sysm: System) -> None:
        a = self.args
        log(f"== {sysm.name}")
        for rep in range(a.reps):
            log(f"{sysm.name} rep {rep + 1}/{a.reps}: sequential, h5py and warm random")
            sysm.start()
            try:
                drop_caches()
                self.seq(sysm, "seq_cold")
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


# -- the table ---------------------------------------------------------------------------------

# (case key, other system, minimum ratio faultfs/other) from issue 6
TARGETS: dict[str, list[tuple[str, float]]] = {
    "seq_cold": [("rclone", 2.0), ("ceiling", 0.5)],
    "seq_warm_dropped": [("rclone", 1.5)],
    "seq_warm_cached": [("local", 0.8)],
    "rand4k_x1_cold": [("rclone", 2.0)], "rand4k_x8_cold": [("rclone", 2.0)],
    "rand4k_x1_warm": [("rclone", 2.0)], "rand4k_x8_warm": [("rclone", 2.0)],
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


def build_table(runner: Runner, peak_rss: dict[str, float | None]) -> tuple[str, list[str]]:
    head = ("| case | unit | faultfs | rclone | local | ceiling | f/rclone | f/local | f/ceiling "
            "| target (issue 6) |")
    lines = [head, "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    verdicts = []
    for key, label, unit in all_cases():
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
    if f_rss is None:
        rss_cells.append(f"≤ {RSS_TARGET_MIB} MiB: not measured")
    else:
        ok = f_rss <= RSS_TARGET_MIB
        rss_cells.append(f"≤ {RSS_TARGET_MIB} MiB: **{'met' if ok else 'not met'}**")
        verdicts.append(f"daemon peak RSS: {f_rss:.0f} MiB (target ≤ {RSS_TARGET_MIB} MiB, "
                        f"{runner.size / MiB / 1024:g} GiB source) — {'met' if ok else 'not met'}")
    lines.append("| " + " | ".join(rss_cells) + " |")
    return "\n".join(lines), verdicts


def spread_table(runner: Runner) -> str:
    lines = ["| case | " + " | ".join(SYSTEMS) + " |", "| --- |" + " ---: |" * len(SYSTEMS)]
    for key, label, unit in all_cases():
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
                   help="256 MiB source, 64 MiB HDF5, 2 reps, fewer random reads (about 1 minute)")
    p.add_argument("--size-mb", type=int, help="source size in MiB (default 1024; --quick 256)")
    p.add_argument("--h5-mb", type=int, help="HDF5 dataset size before compression (default 384; --quick 64)")
    p.add_argument("--reps", type=int,
                   help="repetitions of each case, median reported (default 5; --quick 2)")
    p.add_argument("--rand-ops", type=int,
                   help="random reads per warm case, split over the readers (default 8000; --quick 2000)")
    p.add_argument("--rand-ops-cold", type=int,
                   help="random reads per cold case, split over the readers (default 400; --quick 200)")
    p.add_argument("--case-cap", type=float, default=CASE_CAP_S_DEFAULT,
                   help="stop a random case after this many seconds (default %(default)s)")
    p.add_argument("--seq-timeout", type=float, default=600,
                   help="give up on one sequential or h5py read after this many seconds")
    p.add_argument("--seed", type=int, default=6)
    p.add_argument("--chunk-size", default="0", help="faultfs --chunk-size (default 0: faultfs's own default, 1 MiB)")
    p.add_argument("--faultfs-args", default="", help="extra flags for faultfs mount, one string")
    p.add_argument("--rclone-args", default="", help="extra flags for rclone mount, one string")
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
                   help="replace the 'latest run' section of docs/benchmarks.md with this run")
    a = p.parse_args(argv)
    q = a.quick
    a.size_mb = a.size_mb or (256 if q else 1024)
    a.h5_mb = a.h5_mb or (64 if q else 384)
    a.reps = a.reps or (2 if q else 5)
    a.rand_ops = a.rand_ops or (2000 if q else 8000)
    a.rand_ops_cold = a.rand_ops_cold or (200 if q else 400)
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
    work = Path(tempfile.mkdtemp(prefix="faultfs-bench-", dir=args.work_dir))
    log(f"working in {work}")
    data_dir = Path(args.data_dir) if args.data_dir else work / "data"
    started = datetime.datetime.now().astimezone()
    machine = machine_description()
    load_start = loadavg()
    busy = busiest_processes()
    systems: list[System] = []
    runner: Runner | None = None
    interrupted = False
    t_start = time.monotonic()
    try:
        big, h5 = make_data(data_dir, args.size_mb, args.h5_mb, args.seed)
        size = big.stat().st_size
        runner = Runner(args, size)
        runner.big_src = big
        makers = {
            "faultfs": lambda: Faultfs(work, big, h5, args.chunk_size, shlex.split(args.faultfs_args)),
            "rclone": lambda: Rclone(work, big, h5, shlex.split(args.rclone_args)),
            "local": lambda: Local(work, big, h5),
            "ceiling": lambda: Ceiling(work, big, h5, size, ceiling_readahead()),
        }
        def ceiling_readahead() -> int | None:
            """The ceiling gets the readahead faultfs set for itself (same kernel path)."""
            if args.ceiling_readahead_kb is not None:
                return args.ceiling_readahead_kb or None
            return next((s.readahead_kb for s in systems if isinstance(s, Faultfs)), None)

        with LoadSampler() as sampler:
            for name in SYSTEMS:
                if name not in args.systems:
                    continue
                sysm = makers[name]()
                systems.append(sysm)
                try:
                    runner.run_system(sysm)
                except BenchError as exc:
                    runner.fail(sysm, "run", exc)
                    sysm.stop()
        loads = sampler.samples
    except KeyboardInterrupt:
        interrupted = True
        log("interrupted: cleaning up")
        loads = []
    finally:
        cleanup(work, systems, keep=args.keep)
    if interrupted or runner is None:
        return 130
    elapsed = time.monotonic() - t_start
    peak = {s.name: s.peak_rss_mib for s in systems}
    table, verdicts = build_table(runner, peak)
    faultfs = next(s for s in systems if isinstance(s, Faultfs))
    observations = request_table(runner)
    load_line = (f"1-min load average {load_start:.2f} at the start, "
                 f"mean {statistics.mean(loads):.2f} / max {max(loads):.2f} during the run "
                 f"(the bench itself adds about 1–2); busiest processes at the start: {busy}"
                 if loads else f"1-min load average {load_start:.2f} at the start")
    readahead = ", ".join(f"{s.name} {s.readahead_kb} KiB" for s in systems
                          if s.readahead_kb is not None)
    report = render_report(args, command, started, machine, load_line, elapsed, table, verdicts,
                           runner, observations, readahead)
    print()
    print(report)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({
            "command": command, "started": started.isoformat(), "machine": machine,
            "loads": loads, "results": runner.results, "notes": runner.notes, "peak_rss_mib": peak,
            "requests": {f"{s} {k}": v for (s, k), v in runner.requests.items()},
            "faultfs_stats": faultfs.last_stats}, indent=1))
    if args.write_doc:
        write_doc(report, quick=args.quick)
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


def render_report(args, command, started, machine, load_line, elapsed, table, verdicts, runner,
                  observations, readahead) -> str:
    m = machine
    lines = [
        f"### {'Quick run' if args.quick else 'Run'} of {started.strftime('%Y-%m-%d %H:%M %Z')}",
        "",
        f"Command: `{command}` ({int(elapsed) // 60} min {int(elapsed) % 60} s)",
        "",
        f"Machine: {m['cores']} cores ({m['cpu']}), {m['mem_gib']} GiB, Linux {m['kernel']}, "
        f"Python {m['python']}, pyfuse3 {m['pyfuse3']}, {m['rclone']}. faultfs at {m['commit']}"
        + (f" with uncommitted changes in {', '.join(m['faultfs_uncommitted'])}"
           if m["faultfs_uncommitted"] else "") + ".",
        "",
        f"Load: {load_line}.",
        "",
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


def write_doc(report: str, quick: bool) -> None:
    doc = DOC.read_text() if DOC.exists() else "# Benchmarks\n"
    marker = "latest-quick-run" if quick else "latest-run"
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
