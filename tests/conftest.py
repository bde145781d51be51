"""Shared fixtures: real faultfs mounts (daemonized through the CLI) and sample sources (local
files, and objects on a loopback HTTP server that honours Range)."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from faultfs.fuse import daemons
from faultfs.testing.httpd import RangeHttpServer
from faultfs.testing.mountview import MountView
from faultfs.testing.torture.harness import mounts_under

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAULTFS = [sys.executable, "-m", "faultfs.cli"]


def fuse_missing_reason() -> str | None:
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing (no FUSE in this kernel or container)"
    if shutil.which("fusermount3") is None:
        return "fusermount3 is missing (Debian package fuse3)"
    if os.geteuid() != 0 and not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "/dev/fuse is not accessible to this user"
    return None


def pytest_collection_modifyitems(config, items):
    reason = fuse_missing_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "mount" in item.keywords:
            item.add_marker(skip)


# A passing test's tmp_path is removed once the test is torn down. pytest keeps every one to
# the end of the run by default: about 3 GB at the peak of this suite on four workers (under
# 1 GB when removed), more than a CI machine sometimes has free (a run failed so, with ENOSPC
# in /tmp). A failed test's directory stays, for its daemons' logs; so does one with a mount
# still under it, which a removal would walk into.
_TMP_PATH = pytest.StashKey[str]()
_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if call.when == "call" and "tmp_path" in getattr(item, "funcargs", {}):
        item.stash[_TMP_PATH] = str(item.funcargs["tmp_path"])
    if report.failed:
        item.stash[_FAILED] = True
    elif call.when == "teardown" and not item.stash.get(_FAILED, False):
        path = item.stash.get(_TMP_PATH, None)
        if path is not None and not mounts_under(path):
            shutil.rmtree(path, ignore_errors=True)
    return report


def check_concurrent_preads(src, data: bytes, count: int, seed: int) -> None:
    """``count`` random ranges of ``src`` read from 16 threads at once, each compared with
    the same range of ``data``."""
    rng = random.Random(seed)
    ranges = [(rng.randrange(len(data)), rng.randrange(1, 2**20)) for _ in range(count)]
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda r: src.pread(*r), ranges))
    for (off, size), piece in zip(ranges, got, strict=True):
        assert piece == data[off:off + size]


# Hypothesis's per-example deadline (200 ms) measures the host, not the code, on a suite of
# workers sharing two cores (one example of test_chunks took 259 ms so); the examples
# themselves still run, and a real hang still meets pytest-timeout's 600 s.
try:
    from hypothesis import settings as _hypothesis_settings

    _hypothesis_settings.register_profile("faultfs-suite", deadline=None)
    _hypothesis_settings.load_profile("faultfs-suite")
except ImportError:  # pragma: no cover - hypothesis is a test dependency
    pass

# A holder keeps every mount of the suite (the default), but preloads no standby daemon: a
# standby is one more Python start for each of the suite's hundreds of mounts (a sixth of a
# mount test's time). tests/test_mount_restart.py turns it back on for its own.
os.environ.setdefault("FAULTFS_STANDBY", "0")


def run_faultfs(*args: str, env: dict | None = None, timeout: float = 120,
                check: bool = False) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    full_env.update(env or {})
    result = subprocess.run([*FAULTFS, *args], capture_output=True, text=True, env=full_env,
                            timeout=timeout, cwd=ROOT)
    if check and result.returncode != 0:
        raise AssertionError(f"faultfs {' '.join(args)} failed ({result.returncode}):\n"
                             f"{result.stdout}\n{result.stderr}")
    return result


class Mount(MountView):
    """One faultfs mount made through the CLI; ``close()`` unmounts whatever happened."""

    def __init__(self, path: str, store: str) -> None:
        self.path = path
        self.store = store
        self.pid: int | None = None

    def umount(self) -> None:
        run_faultfs("umount", self.path, check=True)
        self.pid = None

    def wait_gone(self, timeout: float = 30) -> bool:
        """Wait for the daemon's process to end; True if it did (``pid`` is then None)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                self.pid = None
                return True
            time.sleep(0.05)
        return False

    def holder(self) -> int | None:
        """The pid of the holder that keeps this mount across daemon crashes, if any."""
        return None if self.pid is None else daemons.holder_of(self.pid)

    def crash(self) -> None:
        """The mount dies with its daemon, as a crash without a holder: kill -9 the holder
        (if any), then the daemon, and wait until the daemon is gone."""
        holder = self.holder()
        if holder is not None:
            os.kill(holder, signal.SIGKILL)
        os.kill(self.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{self.pid}") and time.monotonic() < deadline:
            time.sleep(0.02)

    def close(self) -> None:
        holder = self.holder()
        if os.path.ismount(self.path) or _dead(self.path):
            run_faultfs("umount", self.path)
        if os.path.ismount(self.path) or _dead(self.path):
            subprocess.run(["fusermount3", "-u", "-z", self.path], capture_output=True)
        for pid in (holder, self.pid):
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _dead(path: str) -> bool:
    try:
        os.stat(path)
    except OSError:
        return True
    return False


@pytest.fixture
def mounter(tmp_path):
    """``mount(*sources, store=..., args=[...], env={...}) -> Mount`` — real daemonized mounts,
    all unmounted at teardown."""
    made: list[Mount] = []
    counter = [0]

    def mount(*sources: str, store: str | None = None, args: list[str] | tuple = (),
              env: dict | None = None, mountpoint: str | None = None) -> Mount:
        counter[0] += 1
        mnt = mountpoint or str(tmp_path / f"mnt{counter[0]}")
        try:
            os.mkdir(mnt)
        except FileExistsError:
            pass  # an existing directory, or a dead mount the CLI must clean
        store = store or str(tmp_path / "store")
        result = run_faultfs("mount", *sources, mnt, "--store", store, "--reserve-mb", "0",
                             *args, env=env)
        if result.returncode != 0:
            raise AssertionError(f"mount failed ({result.returncode}): {result.stderr.strip()}")
        m = Mount(mnt, store)
        made.append(m)
        m.pid = m.stats()["pid"]
        return m

    yield mount
    for m in made:
        m.close()


@pytest.fixture
def sample(tmp_path):
    """``sample(size, name=...) -> path`` of a file of random bytes."""

    def make(size: int, name: str = "field.bin", seed: int = 0) -> str:
        import random

        rng = random.Random(seed ^ size)
        path = tmp_path / name
        path.write_bytes(rng.randbytes(size))
        return str(path)

    return make


@pytest.fixture
def http_server() -> Iterator[RangeHttpServer]:
    """A ``RangeHttpServer`` for the test; fsspec's shared HTTP file systems are dropped after."""

    server = RangeHttpServer()
    try:
        yield server
    finally:
        server.close()
        from faultfs.sources import filesystems

        filesystems.clear_filesystems()


@pytest.fixture
def small_fs(tmp_path):
    """``small_fs(size_kb, inodes) -> path`` of a tmpfs of its own (unmounted at teardown)."""
    made = []

    def make(size_kb: int, inodes: int | None = None):
        path = tmp_path / f"fs{len(made)}"
        path.mkdir()
        opts = f"size={size_kb}k" + (f",nr_inodes={inodes}" if inodes else "")
        subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], check=True)
        made.append(path)
        return path

    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    yield make
    for path in made:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
