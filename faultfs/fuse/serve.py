"""Serving a mount: ``pyfuse3.init``, then a trio outer nursery holding ``pyfuse3.main`` beside
the engine's background work, the stats logger and the signal watcher.

Readiness is reported (through ``ready``) only once the mount answers a request through the
kernel. SIGTERM, SIGINT, SIGHUP or ``fusermount3 -u`` end it; pending store writes then get
``DRAIN_TIMEOUT_S`` to reach the store.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
from collections.abc import Callable

import trio

from faultfs.config import STATS_INTERVAL_S
from faultfs.core.names import CTL_NAME
from faultfs.core.ownership import Ownership
from faultfs.engine import Engine
from faultfs.errors import FaultfsError
from faultfs.fuse import fastwait
from faultfs.fuse.daemons import DaemonRecord
from faultfs.fuse.exporter import open_listeners, serve_metrics
from faultfs.fuse.fastread import FastReads
from faultfs.fuse.lowlevel import pyfuse3
from faultfs.fuse.ops import FaultOperations
from faultfs.tiers.uring import fuse_device_fds

log = logging.getLogger("faultfs.mount")

DRAIN_TIMEOUT_S = 20.0  # pending store writes get this long after an unmount (< UNMOUNT_WAIT_S)


def serve(engine: Engine, mountpoint: str, *, ready: Callable[[], None] | None = None,
          allow_other: bool = False, debug_fuse: bool = False,
          ownership: Ownership | None = None) -> None:
    """Mount ``engine`` at ``mountpoint`` and serve until unmounted (blocking)."""
    raise_fd_limit()
    bound_malloc()
    ops = FaultOperations(engine, ownership)
    options = set(pyfuse3.default_options)
    options.add("fsname=faultfs")
    options.add("subtype=faultfs")
    if allow_other:  # other users: the kernel checks the modes shown (a 0600 blob is private)
        options.add("allow_other")
        options.add("default_permissions")
    if debug_fuse:
        options.add("debug")
    devices = fuse_device_fds()
    FastReads.prepare(engine.config)
    try:
        pyfuse3.init(ops, mountpoint, options)
    except RuntimeError as exc:
        raise FaultfsError(f"mounting {mountpoint} failed: {exc}", errno.EIO) from None
    record = DaemonRecord(mountpoint)  # who serves it (fuse/daemons.py)
    # what pyfuse3 waits on: the fast read path's queue, else the session's device
    fd = FastReads.queue_fd()
    if fd is None:
        fd = fastwait.session_fd(devices)
    # the session's device (libfuse's own descriptor: opened first), for range invalidations
    opened = sorted(set(fuse_device_fds()) - set(devices))
    ops.invalidator.device_fd = opened[0] if opened else None
    ended = False
    try:
        record.write()
        trio.run(_serve_async, engine, ops, mountpoint, ready, fd)
        ended = True  # every write folded (``_serve_with``)
    except BaseException:
        # never touch the mountpoint from this thread here: nothing answers it any more
        log.exception("the serving loop of %s stopped on an error; unmounting", mountpoint)
        raise
    finally:
        ops.invalidator.device_fd = None
        ops.files.coherence.close()
        pyfuse3.close(unmount=True)
        if ended:  # left behind otherwise: `faultfs umount` says the unmount did not finish
            record.remove()
        engine.close()


async def _serve_async(engine: Engine, ops: FaultOperations, mountpoint: str,
                       ready: Callable[[], None] | None, fd: int | None) -> None:
    listeners = (await open_listeners(engine.config.metrics_addr)
                 if engine.config.metrics_addr else [])
    fast = FastReads.start(engine)
    try:
        await _serve_with(engine, ops, mountpoint, ready, fd, listeners, fast)
    finally:
        if fast is not None:
            ops.file_opened = None
            fast.stop()  # before pyfuse3.close: its threads reply into the session


async def _serve_with(engine: Engine, ops: FaultOperations, mountpoint: str,
                      ready: Callable[[], None] | None, fd: int | None, listeners: list,
                      fast: FastReads | None) -> None:
    async with trio.open_nursery() as nursery:
        engine.attach(nursery)
        if fast is not None:
            ops.file_opened = fast.file_opened
            ops.writebacks_marked = True
            fast.attach(nursery)
        if listeners:
            nursery.start_soon(serve_metrics, engine, listeners)
        nursery.start_soon(_watch_signals)
        if engine.config.stats_log:
            nursery.start_soon(_log_stats, engine)
        nursery.start_soon(_announce_ready, mountpoint, ready, engine.config.readahead_kb)
        engine.fold_replayed()  # writes replayed from the journal: fold them
        with fastwait.installed(pyfuse3, fd, engine.stats,
                                engine.config.fuse_fastwait):
            workers = engine.config.fuse_workers
            # a fixed pool: pyfuse3 starts a worker whenever none waits in its own wait, which
            # a fast wait never enters, and ends idle ones again — a task made and ended per
            # request with several readers (config.FUSE_WORKERS)
            await (pyfuse3.main(workers, workers) if workers else pyfuse3.main())
        with trio.move_on_after(DRAIN_TIMEOUT_S):
            await engine.drain()  # blobs faulted just before the unmount reach the store
        if engine.pending_stores:
            log.warning("unmounting with %d blob(s) not yet stored", engine.pending_stores)
        shared = engine.tiers.shared
        if shared is not None and shared.pending:
            log.warning("unmounting with %d publish(es) to the shared store %s abandoned",
                        shared.pending, shared.url)
        await engine.close_writes()  # every write folded and durable (level 2 of §11)
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


