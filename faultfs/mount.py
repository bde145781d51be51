"""Mounting: check the mountpoint, clean a dead mount, run pyfuse3 under trio, unmount.

``serve`` runs in the daemon (or in the foreground): ``pyfuse3.init``, then a trio outer
nursery holding ``pyfuse3.main`` beside the stats logger and the signal watcher. It reports
readiness (through ``ready``) only once the mount answers a request, and unmounts on SIGTERM,
SIGINT or ``fusermount3 -u``.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable

import pyfuse3
import trio

from faultfs.config import STATS_INTERVAL_S
from faultfs.engine import Engine
from faultfs.errors import FaultfsError, InvalidInput
from faultfs.fuse_ops import CTL_NAME, FaultOperations

log = logging.getLogger("faultfs.mount")

UNMOUNT_WAIT_S = 30.0  # how long `faultfs umount` waits for the daemon to finish
DRAIN_TIMEOUT_S = 20.0  # pending store writes get this long after an unmount (< UNMOUNT_WAIT_S)


def is_dead_mount(path: str) -> bool:
    """True when ``path`` is a FUSE mount whose daemon is gone (ENOTCONN)."""
    try:
        os.statvfs(path)  # never answered from the kernel's attribute cache
    except OSError as exc:
        return exc.errno in (errno.ENOTCONN, errno.ECONNABORTED)
    return False


def lazy_unmount(path: str) -> None:
    """Detach a (dead) FUSE mount at ``path``."""
    for cmd in (["fusermount3", "-u", "-z", path], ["umount", "-l", path]):
        if shutil.which(cmd[0]) is None:
            continue
        if subprocess.run(cmd, capture_output=True).returncode == 0:
            return
    raise FaultfsError(f"cannot detach the dead mount at {path}", errno.EBUSY)


def prepare_mountpoint(path: str) -> str:
    """Return the absolute mountpoint after cleaning a dead mount there; refuse anything
    but an existing empty directory that is not already mounted."""
    path = os.path.abspath(path)
    if is_dead_mount(path):
        log.warning("cleaning the dead mount at %s (its daemon is gone)", path)
        lazy_unmount(path)
    if not os.path.exists(path):
        raise InvalidInput(f"mountpoint {path} does not exist", errno.ENOENT)
    if not os.path.isdir(path):
        raise InvalidInput(f"mountpoint {path} is not a directory", errno.ENOTDIR)
    if os.path.ismount(path):
        raise InvalidInput(f"mountpoint {path} is already mounted", errno.EBUSY)
    if os.listdir(path):
        raise InvalidInput(f"mountpoint {path} is not empty", errno.ENOTEMPTY)
    return path


def serve(engine: Engine, mountpoint: str, *, ready: Callable[[], None] | None = None,
          allow_other: bool = False, debug_fuse: bool = False) -> None:
    """Mount ``engine`` at ``mountpoint`` and serve until unmounted (blocking)."""
    raise_fd_limit()
    bound_malloc()
    ops = FaultOperations(engine)
    options = set(pyfuse3.default_options)
    options.add("fsname=faultfs")
    options.add("subtype=faultfs")
    if allow_other:
        options.add("allow_other")
    if debug_fuse:
        options.add("debug")
    try:
        pyfuse3.init(ops, mountpoint, options)
    except RuntimeError as exc:
        raise FaultfsError(f"mounting {mountpoint} failed: {exc}", errno.EIO) from None
    try:
        trio.run(_serve_async, engine, mountpoint, ready)
    except BaseException:
        # never touch the mountpoint from this thread here: nothing answers it any more
        log.exception("the serving loop of %s stopped on an error; unmounting", mountpoint)
        raise
    finally:
        pyfuse3.close(unmount=True)
        engine.close()


async def _serve_async(engine: Engine, mountpoint: str, ready: Callable[[], None] | None) -> None:
    async with trio.open_nursery() as nursery:
        engine.attach(nursery)
        nursery.start_soon(_watch_signals)
        if engine.config.stats_log:
            nursery.start_soon(_log_stats, engine)
        nursery.start_soon(_announce_ready, mountpoint, ready, engine.config.readahead_kb)
        await pyfuse3.main()
        with trio.move_on_after(DRAIN_TIMEOUT_S):
            await engine.drain()  # blobs faulted just before the unmount reach the store
        if engine.pending_stores:
            log.warning("unmounting with %d blob(s) not yet stored", engine.pending_stores)
        nursery.cancel_scope.cancel()


async def _announce_ready(mountpoint: str, ready: Callable[[], None] | None,
                          engine_readahead_kb: int) -> None:
    """Report readiness once a request through the kernel has been answered."""
    await trio.to_thread.run_sync(os.stat, os.path.join(mountpoint, CTL_NAME, "stats"))
    readahead_kb = engine_readahead_kb
    if readahead_kb:
        await trio.to_thread.run_sync(set_readahead, mountpoint, readahead_kb)
    log.info("mounted at %s", mountpoint)
    if ready is not None:
        ready()


MMAP_THRESHOLD = 1 << 20  # blob-sized buffers (1 MiB + a header and up) are mappings of their own


def bound_malloc() -> None:
    """Keep blob-sized buffers out of glibc's heaps so freeing them returns the memory.

    Without this, glibc raises its mmap threshold after the first freed 1 MiB buffer and
    serves later ones from per-thread arenas (one per I/O thread), where freed blobs stay in
    the process: the daemon's RSS grows with the pool size instead of with what it holds.
    Not lower: asyncio reads sockets into 256 KiB buffers, and with the threshold at 256 KiB
    each of those became a mapping of its own, faulted in and unmapped per ``recv``."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return  # not glibc: nothing to tune
    m_mmap_threshold, m_arena_max = -3, -8
    libc.mallopt(m_mmap_threshold, MMAP_THRESHOLD)
    libc.mallopt(m_arena_max, 2)


def raise_fd_limit(want: int = 65536) -> None:
    """Let the daemon keep many store files open (the soft limit is often 1024)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def set_readahead(mountpoint: str, kb: int) -> bool:
    """Raise the kernel's readahead for this mount (root only): with the default 128 KiB
    the kernel sends 128 KiB requests one or two at a time; 1 MiB+ lets it send 1 MiB
    requests (FUSE's largest) several at once."""
    dev = os.stat(mountpoint).st_dev
    path = f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb"
    try:
        with open(path, "w") as f:
            f.write(str(kb))
    except OSError as exc:
        log.info("cannot set readahead of %s (%s): keeping the kernel default", mountpoint, exc.strerror)
        return False
    return True


async def _watch_signals() -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            log.info("signal %d: unmounting", signum)
            pyfuse3.terminate()
            return


async def _log_stats(engine: Engine) -> None:
    while True:
        await trio.sleep(STATS_INTERVAL_S)
        snap = await engine.snapshot()
        log.info("stats %s latency %s", json.dumps(snap["counters"], sort_keys=True),
                 json.dumps(snap["fault_latency"], sort_keys=True))


def read_stats(mountpoint: str) -> dict:
    """The JSON counters of a running mount."""
    path = os.path.join(os.path.abspath(mountpoint), CTL_NAME, "stats")
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except FileNotFoundError:
        raise InvalidInput(f"{mountpoint} is not a faultfs mount", errno.EINVAL) from None
    except OSError as exc:
        if exc.errno in (errno.ENOTCONN, errno.ECONNABORTED):
            raise FaultfsError(f"the faultfs daemon of {mountpoint} is gone (dead mount); "
                               f"`faultfs umount {mountpoint}` cleans it", exc.errno) from None
        raise FaultfsError(f"cannot read stats of {mountpoint}: {exc.strerror}", exc.errno or errno.EIO) from None


def unmount(mountpoint: str, *, wait: float = UNMOUNT_WAIT_S) -> None:
    """Unmount ``mountpoint`` and wait for its daemon to exit (so the store is free)."""
    path = os.path.abspath(mountpoint)
    if is_dead_mount(path):
        lazy_unmount(path)
        return
    if not os.path.ismount(path):
        raise InvalidInput(f"{path} is not mounted", errno.EINVAL)
    pid = None
    try:
        pid = int(read_stats(path).get("pid"))
    except (FaultfsError, TypeError, ValueError):
        pid = None
    result = subprocess.run(["fusermount3", "-u", path], capture_output=True, text=True)
    if result.returncode != 0:
        reason = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "unknown error"
        if "busy" in reason.lower():
            raise FaultfsError(f"{path} is busy: close the files open under it first", errno.EBUSY)
        raise FaultfsError(f"unmounting {path} failed: {reason}", errno.EIO)
    if pid is None or pid == os.getpid():
        return
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        if _is_zombie(pid):
            return
        time.sleep(0.05)
    raise FaultfsError(f"the daemon (pid {pid}) of {path} did not exit within {wait:.0f} s",
                       errno.ETIMEDOUT)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().split(b")")[-1].split()[0] == b"Z"
    except OSError:
        return True
