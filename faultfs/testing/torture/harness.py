"""The torture suite's harness: one private temporary directory, real mounts made through the
CLI, and a cleanup that leaves nothing behind, whatever happened (Ctrl-C included).

Invariants:
- Everything a run makes lives under ``Run.root`` (a fresh ``mkdtemp``) or is registered with
  the run the moment it exists: a mount, a worker process, a tmpfs, a closer (servers).
- The run is the child subreaper of what it starts (``PR_SET_CHILD_SUBREAPER``): a daemon whose
  CLI parent exited is re-parented to us, so it is reaped (no zombie stays behind) and found
  at cleanup even when its mount was lost.
- ``cleanup`` is idempotent and never raises: workers killed, mounts unmounted (a FUSE
  connection that does not answer is aborted), daemons killed and reaped, every mount left
  under the root detached deepest first, tmpfs file systems unmounted, the root removed.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from faultfs.errors import FaultfsError
from faultfs.fuse import connection
from faultfs.fuse.daemons import holder_of
from faultfs.testing.mountview import MountView

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
FAULTFS = [sys.executable, "-m", "faultfs.cli"]
PR_SET_CHILD_SUBREAPER = 36
UMOUNT_TIMEOUT_S = 120.0  # `faultfs umount` folds writes before the daemon exits
MOUNT_TIMEOUT_S = 120.0
REAP_TIMEOUT_S = 30.0  # a killed daemon is gone in milliseconds; this only bounds a wedged one


class TortureError(Exception):
    """The harness could not do what a case asked (a mount that failed, a daemon that hung):
    the case reports it as a failure."""


class Interrupted(BaseException):
    """SIGTERM or SIGHUP: stop like Ctrl-C does, cleaning up on the way out."""


def log(msg: str) -> None:
    print(f"[torture {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- processes --------------------------------------------------------------------------------

def become_subreaper() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def proc_state(pid: int) -> str | None:
    """The state letter of ``pid`` (``R``, ``S``, ``D``, ``Z`` …); None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    state = proc_state(pid)
    return state is not None and state not in ("Z", "X")


def reap(pid: int, timeout: float = REAP_TIMEOUT_S) -> bool:
    """Wait until ``pid`` has exited, and collect it if it is our child; False on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done == pid:
                return True
        except ChildProcessError:  # not ours (a subreaper-less run): watch /proc
            if not alive(pid):
                return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


def kill_and_reap(pid: int) -> bool:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    return reap(pid)


def daemon_rss(pid: int) -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` of ``pid`` in bytes (empty when it is gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out[key] = int(value.split()[0]) * KiB
    except OSError:
        pass
    return out


def fd_count(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def our_children() -> list[int]:
    me = os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:
            found.append(int(entry))
    return found


# -- mounts -----------------------------------------------------------------------------------

def mounts_at(path: str) -> int:
    """How many mounts are stacked at ``path`` (read from mountinfo: nothing here touches a
    mount, which may hang)."""
    return sum(1 for e in connection.mounts() if e.mountpoint == path)


def mounts_under(path: str) -> list[str]:
    """The mountpoints at ``path`` or below it."""
    return [e.mountpoint for e in connection.mounts()
            if e.mountpoint == path or e.mountpoint.startswith(path.rstrip(os.sep) + os.sep)]


def ensure_fusectl() -> bool:
    """The fusectl file system mounted at its place (it is where a connection is aborted);
    whether it is."""
    try:
        connection.ensure_fusectl()
    except FaultfsError:
        return False
    return True


def abort_fuse(minor: int | None) -> None:
    """Abort a FUSE connection: every request waiting on it fails at once."""
    if minor is not None:
        with contextlib.suppress(FaultfsError):
            connection.abort(minor)


def lazy_detach(path: str) -> None:
    for cmd in (["fusermount3", "-u", "-z", path], ["umount", "-l", path]):
        if mounts_at(path) == 0:
            return
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(cmd, capture_output=True, timeout=30)


@dataclass
class Mount(MountView):
    """One faultfs mount made through the CLI (``Run.mount``)."""

    run: Run
    path: str
    store: str
    pid: int | None = None
    minor: int | None = None  # its FUSE connection

    def umount(self, timeout: float = UMOUNT_TIMEOUT_S) -> None:
        """``faultfs umount``; TortureError when it fails or the daemon outlives it."""
        result = self.run.faultfs("umount", self.path, timeout=timeout)
        pid, self.pid = self.pid, None
        if result.returncode != 0:
            if pid is not None:
                self.pid = pid
            raise TortureError(f"faultfs umount {self.path} failed: {result.stderr.strip()}")
        if pid is not None and not reap(pid):
            raise TortureError(f"the daemon {pid} of {self.path} did not exit after umount")
        self.run.forget_mount(self)

    def kill9(self) -> None:
        """kill -9 of the daemon (and first of its holder, which would let a new daemon take
        the mount over: fuse/holder.py); returns once it is gone (the mount is left dead)."""
        if self.pid is None:
            raise TortureError(f"{self.path} has no daemon to kill")
        pid, self.pid = self.pid, None
        holder = holder_of(pid)
        if holder is not None:
            kill_and_reap(holder)
        if not kill_and_reap(pid):
            raise TortureError(f"the daemon {pid} survived kill -9")

    def close(self) -> None:
        """Leave nothing mounted and no daemon running, whatever state this mount is in (a
        hung daemon too: nothing here waits on the mount without a timeout)."""
        if mounts_at(self.path) and self.pid is not None and alive(self.pid):
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                self.run.faultfs("umount", self.path, timeout=60)
        if mounts_at(self.path):
            abort_fuse(self.minor)
            lazy_detach(self.path)
        if self.pid is not None:
            kill_and_reap(self.pid)
            self.pid = None


class Run:
    """One run of the suite: its temporary root and everything it must take down."""

    def __init__(self, *, quick: bool, verbose: bool = False, seed: int = 0,
                 options: dict | None = None) -> None:
        self.quick = quick
        self.verbose = verbose
        self.seed = seed
        self.options = dict(options or {})  # a case's own flags (``--crossname-parts``)
        self.root = os.path.realpath(tempfile.mkdtemp(prefix="faultfs-torture-"))
        self.subreaper = become_subreaper()
        self.mounts: list[Mount] = []
        self.procs: list[subprocess.Popen] = []
        self.tmpfs_paths: list[str] = []
        self.closers: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._cleaned = False
        self._counter = 0

    # -- places ---------------------------------------------------------------------------

    def path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def fresh_dir(self, stem: str) -> str:
        with self._lock:
            self._counter += 1
            n = self._counter
        path = self.path(f"{stem}-{n}")
        os.makedirs(path)
        return path

    def make_source(self, name: str, size: int, seed: int, *, directory: str | None = None
                    ) -> tuple[str, bytes]:
        """A file of ``size`` seeded random bytes; its path and its bytes."""
        data = random.Random(seed).randbytes(size)
        path = os.path.join(directory or self.path(), name)
        with open(path, "wb") as f:
            f.write(data)
        return path, data

    def tmpfs(self, stem: str, size_kb: int, inodes: int | None = None) -> str:
        """A tmpfs of its own (bytes and, optionally, inodes limited)."""
        path = self.fresh_dir(stem)
        opts = f"size={size_kb}k,mode=0700" + (f",nr_inodes={inodes}" if inodes else "")
        subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", path], check=True,
                       capture_output=True, timeout=30)
        self.tmpfs_paths.append(path)
        return path

    def drop_tmpfs(self, path: str) -> None:
        subprocess.run(["umount", "-l", path], capture_output=True, timeout=30)
        if path in self.tmpfs_paths:
            self.tmpfs_paths.remove(path)

    def on_close(self, fn: Callable[[], None]) -> None:
        self.closers.append(fn)

    # -- processes --------------------------------------------------------------------------

    def faultfs(self, *args: str, timeout: float = MOUNT_TIMEOUT_S, env: dict | None = None
                ) -> subprocess.CompletedProcess:
        full_env = dict(os.environ)
        full_env.update(env or {})
        return subprocess.run([*FAULTFS, *args], capture_output=True, text=True, env=full_env,
                              timeout=timeout, stdin=subprocess.DEVNULL)

    def popen(self, cmd: list[str], **kw) -> subprocess.Popen:
        proc = subprocess.Popen(cmd, **kw)
        self.procs.append(proc)
        return proc

    def worker(self, *args: str, **kw) -> subprocess.Popen:
        """A worker process (``faultfs.testing.torture.workers``); its JSON report on stdout."""
        return self.popen([sys.executable, "-m", "faultfs.testing.torture.workers", *args],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)

    def mount(self, *sources: str, store: str, args: list[str] | tuple[str, ...] = (),
              mountpoint: str | None = None, env: dict | None = None,
              reserve_mb: int | None = 0) -> Mount:
        """``faultfs mount SOURCES MNT --store STORE ARGS``; returns once the mount answers.
        A new mountpoint under the root unless one is given (an existing one may hold a dead
        mount: the CLI detaches it)."""
        mnt = mountpoint or self.fresh_dir("mnt")
        extra = ["--reserve-mb", str(reserve_mb)] if reserve_mb is not None else []
        result = self.faultfs("mount", *sources, mnt, "--store", store, *extra, *args, env=env)
        if result.returncode != 0:
            # a mount that failed late may still have a daemon: find it through the table
            for e in connection.mounts():
                if e.mountpoint == mnt:
                    self.mounts.append(Mount(self, mnt, store, minor=e.minor))
            raise TortureError(f"mount failed ({result.returncode}): "
                               f"{result.stderr.strip()[-400:]}")
        m = Mount(self, mnt, store)
        with self._lock:
            self.mounts.append(m)
        m.minor = next((e.minor for e in reversed(connection.mounts()) if e.mountpoint == mnt),
                       None)
        m.pid = int(m.stats()["pid"])
        return m

    def forget_mount(self, m: Mount) -> None:
        with self._lock:
            if m in self.mounts and not mounts_at(m.path):
                self.mounts.remove(m)

    # -- the way out ------------------------------------------------------------------------

    def cleanup(self) -> list[str]:
        """Take everything down; what could not be (should be empty)."""
        if self._cleaned:
            return []
        self._cleaned = True
        problems: list[str] = []
        for proc in self.procs:  # killed first; waited for once their mounts are gone (one
            if proc.poll() is None:  # inside a read of a hung mount dies only then)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
        for fn in reversed(self.closers):
            with contextlib.suppress(Exception):
                fn()
        for m in list(self.mounts):
            with contextlib.suppress(Exception):
                m.close()
        # anything still mounted under the root (a mount lost track of), deepest first
        under = set(mounts_under(self.root))
        for e in reversed(connection.mounts()):
            if e.mountpoint in under:
                if e.fstype.startswith("fuse"):
                    abort_fuse(e.minor)
                    lazy_detach(e.mountpoint)
                else:
                    subprocess.run(["umount", "-l", e.mountpoint], capture_output=True,
                                   timeout=30)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
            if proc.poll() is None:
                problems.append(f"worker {proc.pid} did not exit")
        for pid in our_children():  # re-parented daemons the run lost track of
            if not any(p.pid == pid for p in self.procs):
                kill_and_reap(pid)
        for path in mounts_under(self.root):
            problems.append(f"{path} is still mounted")
        if not problems:
            shutil.rmtree(self.root, ignore_errors=True)
        if os.path.exists(self.root):
            problems.append(f"{self.root} was not removed")
        return problems


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """SIGTERM and SIGHUP raise ``Interrupted``, SIGINT (Ctrl-C) KeyboardInterrupt, so the
    ``finally`` that cleans up runs for each."""

    def stop(signum: int, frame: object) -> None:
        raise Interrupted(signal.Signals(signum).name)

    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    # Ctrl-C, also when started where SIGINT was ignored (a background job of a script)
    old[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


# -- results ----------------------------------------------------------------------------------

@dataclass
class CaseResult:
    """What one case did: trials, operations, what held and what failed (one line each)."""

    name: str
    trials: int = 0
    operations: int = 0
    held: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def out_of_time(self, done: int, planned: int, what: str) -> None:
        """The case's budget ran out: fewer trials than planned is said, not a failure (a
        loaded machine is slower); none at all is one."""
        line = f"{done} of {planned} {what} within the time budget"
        (self.held if done else self.failed).append(line)

    def check(self, ok: bool, held: str, failed: str) -> bool:
        """Record ``held`` when ``ok``, else ``failed``."""
        (self.held if ok else self.failed).append(held if ok else failed)
        return ok


class Budget:
    """A case's time: ``left()`` seconds until its deadline."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.start = time.monotonic()

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.start)

    def over(self) -> bool:
        return self.left() <= 0

    def elapsed(self) -> float:
        return time.monotonic() - self.start


def read_all(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def diff_bytes(a: bytes, b: bytes) -> int:
    """How many bytes differ (a length difference counts each missing byte)."""
    if a == b:
        return 0
    n = min(len(a), len(b))
    import numpy as np

    x = np.frombuffer(a, dtype=np.uint8, count=n)
    y = np.frombuffer(b, dtype=np.uint8, count=n)
    return int(np.count_nonzero(x != y)) + abs(len(a) - len(b))


def wait_json(proc: subprocess.Popen, timeout: float) -> dict | None:
    """A worker's JSON report, or None when it did not finish in time or said nothing."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    try:
        return json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": f"worker said nothing useful (exit {proc.returncode}): "
                         f"{(err or '').strip()[-300:]}"}
