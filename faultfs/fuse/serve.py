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
import subprocess
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from faultfs import buffers
from faultfs.config import STATS_INTERVAL_S, Config
from faultfs.core.names import CTL_NAME
from faultfs.core.ownership import Ownership
from faultfs.engine import Engine
from faultfs.errors import FaultfsError
from faultfs.fuse import fastwait
from faultfs.fuse.connection import find_mount
from faultfs.fuse.daemons import DaemonRecord
from faultfs.fuse.exporter import open_listeners, serve_metrics
from faultfs.fuse.fastread import FastReads
from faultfs.fuse.handover import HAND_OVER
from faultfs.fuse.lowlevel import native, pyfuse3
from faultfs.fuse.ops import FaultOperations
from faultfs.fuse.tuning import set_max_background, set_readahead
from faultfs.tiers.budget import FREE_BUFFERS_SHARE
from faultfs.tiers.uring import fuse_device_fds

if TYPE_CHECKING:
    from faultfs.fuse.handover import Handover

log = logging.getLogger("faultfs.mount")

DRAIN_TIMEOUT_S = 20.0  # pending store writes get this long after an unmount (< UNMOUNT_WAIT_S)


def serve(engine: Engine, mountpoint: str, *, ready: Callable[[], None] | None = None,
          allow_other: bool = False, debug_fuse: bool = False,
          ownership: Ownership | None = None, held: Handover | None = None) -> None:
    """Mount ``engine`` at ``mountpoint`` and serve until unmounted (blocking). ``held``: a
    holder keeps the mount (fuse/holder.py); with ``held.takeover`` the mount is there, and
    this daemon serves the connection the holder handed it."""
    raise_fd_limit()
    bound_malloc()
    # recycled read buffers are memory too: a share of the data budget (tiers/budget.py)
    buffers.POOL.keep_bytes = min(buffers.KEEP_BYTES, (engine.config.memory_mb << 20)
                                  // FREE_BUFFERS_SHARE)
    if held is not None and native is None:
        log.warning("this install has no compiled fast path (_fastread): a crash of the daemon "
                    "ends the mount, and it cannot be restarted in place")
        held = None
    ops = FaultOperations(engine, ownership, session=held.state if held is not None else None)
    options = set(pyfuse3.default_options)
    options.add("fsname=faultfs")
    options.add("subtype=faultfs")
    if allow_other:  # other users: the kernel checks the modes shown (a 0600 blob is private)
        options.add("allow_other")
        options.add("default_permissions")
    if debug_fuse:
        options.add("debug")
    devices = fuse_device_fds()
    fast = FastReads.prepare(engine.config)
    if held is not None and not fast:
        native.prepare(1)  # the library's reader records the INIT, or replays it
    where = mountpoint
    if held is not None and held.takeover:
        init = held.state.init
        if init is None:
            raise FaultfsError(f"the mount at {mountpoint} was never set up by a daemon: "
                               "nothing to take over", errno.EINVAL)
        native.takeover(init)
        where = f"/dev/fd/{held.device}"  # libfuse serves this descriptor: no new mount
    try:
        pyfuse3.init(ops, where, options)
    except RuntimeError as exc:
        raise FaultfsError(f"mounting {mountpoint} failed: {exc}", errno.EIO) from None
    if held is not None and held.takeover:
        # what the dead daemon read and did not answer comes again (asked by the library
        # before its readers read anything)
        try:
            native.resend()
        except OSError as exc:
            log.error("the kernel refused to resend what the dead daemon read (%s): those "
                      "requests wait until the mount is aborted", exc.strerror)
        held.state.taken_over()
        log.info("took over the mount at %s (takeover %d)", mountpoint, held.state.takeovers)
    record = DaemonRecord(mountpoint)  # who serves it (fuse/daemons.py)
    # what pyfuse3 waits on: the fast read path's queue, else the session's device
    fd = FastReads.queue_fd()
    if fd is None:
        fd = fastwait.session_fd(devices)
    # the session's device (libfuse's own descriptor: opened first), for range invalidations
    opened = sorted(set(fuse_device_fds()) - set(devices))
    device = (held.device if held is not None and held.takeover
              else opened[0] if opened else None)
    ops.invalidator.device_fd = device
    unmount = True
    ended = False
    served = Served(held, device)
    try:
        record.write()
        trio.run(_serve_async, engine, ops, mountpoint, ready, fd, fast, served)
        unmount = held is None or held.ending
        ended = True  # every write folded (``_serve_with``)
    except BaseException:
        # never touch the mountpoint from this thread here: nothing answers it any more
        if not served.armed:  # no holder keeps the connection: the mount goes with us
            log.exception("the serving loop of %s stopped on an error; unmounting", mountpoint)
        else:
            log.exception("the serving loop of %s stopped on an error; the holder starts a "
                          "new daemon", mountpoint)
            unmount = False
        raise
    finally:
        ops.invalidator.device_fd = None
        ops.files.coherence.close()
        pyfuse3.close(unmount=unmount)
        if unmount and held is not None and held.takeover:
            _detach(mountpoint)  # libfuse did not mount it: it does not unmount it
        if ended:  # left behind otherwise: `faultfs umount` says the unmount did not finish
            record.remove()
        engine.close()


def _detach(mountpoint: str) -> None:
    from faultfs.fuse.mountpoint import lazy_unmount

    try:
        lazy_unmount(mountpoint)
    except FaultfsError as exc:
        log.warning("%s", exc)


class Served:
    """What the serving loop needs of the holder: the link, and the connection to hand it."""

    def __init__(self, held: Handover | None, device: int | None) -> None:
        self.held = held
        self.device = device
        # the holder keeps the connection (it took this daemon's, or handed it over)
        self.armed = held is not None and held.takeover

    async def announce(self, mountpoint: str) -> None:
        """Tell the holder this daemon serves the mount (the first: with its connection)."""
        held = self.held
        if held is None:
            return
        if held.takeover:
            held.serving()
            return
        entry = find_mount(mountpoint)
        init = native.init_request()
        if self.device is None or entry is None or init is None:
            log.warning("the mount at %s cannot be taken over by a new daemon (no device, "
                        "mount entry or INIT seen): a crash ends it", mountpoint)
            return
        held.armed(self.device, entry.minor, mountpoint, init)
        self.armed = True
        if not held.state.resend:
            log.warning("this kernel cannot resend requests a dead daemon read "
                        "(FUSE_NOTIFY_RESEND, Linux >= 6.9): a crash of the daemon ends the "
                        "mount at %s, as before", mountpoint)

    async def watch(self) -> None:
        """Hand the mount over when the holder says so; note when the holder is gone."""
        held = self.held
        if held is None:
            return
        sock = trio.socket.from_stdlib_socket(held.link.sock)
        data = b""
        while True:
            got = await sock.recv(4096)
            if not got:
                log.warning("the holder of this mount is gone: a crash of this daemon now ends "
                            "the mount (ENOTCONN), as without a holder")
                return
            data += got
            while b"\n" in data:
                line, data = data.split(b"\n", 1)
                if json.loads(line).get("word") == HAND_OVER:
                    log.info("handing the mount over to a new daemon")
                    held.handing_over = True
                    native.pause()  # the next daemon reads what is queued from here on
                    pyfuse3.terminate()
                    return


async def _serve_async(engine: Engine, ops: FaultOperations, mountpoint: str,
                       ready: Callable[[], None] | None, fd: int | None, fast_ok: bool,
                       served: Served) -> None:
    listeners = (await open_listeners(engine.config.metrics_addr)
                 if engine.config.metrics_addr else [])
    fast = FastReads.start(engine) if fast_ok else None
    try:
        await _serve_with(engine, ops, mountpoint, ready, fd, listeners, fast, served)
    finally:
        if fast is not None:
            ops.file_opened = None
            fast.stop()  # before pyfuse3.close: its threads reply into the session


async def _serve_with(engine: Engine, ops: FaultOperations, mountpoint: str,
                      ready: Callable[[], None] | None, fd: int | None, listeners: list,
                      fast: FastReads | None, served: Served) -> None:
    async with trio.open_nursery() as nursery:
        engine.attach(nursery)
        if fast is not None:
            ops.file_opened = fast.file_opened
            ops.writebacks_marked = True
            fast.attach(nursery)
        if listeners:
            nursery.start_soon(serve_metrics, engine, listeners)
        nursery.start_soon(_watch_signals, served.held)
        if engine.config.stats_log:
            nursery.start_soon(_log_stats, engine)
        engine.fold_replayed()  # writes replayed from the journal: fold them
        restored = await ops.restore()  # handles the kernel held across a takeover
        if restored:
            log.info("%d open file handle(s) opened again", restored)
        nursery.start_soon(_announce_ready, mountpoint, ready, engine.config,
                           served, ops)
        nursery.start_soon(served.watch)
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
                          config: Config, served: Served,
                          ops: FaultOperations) -> None:
    """Report readiness once a request through the kernel has been answered.

    The request is made by a child process, never by this one: a request this daemon made to
    its own mount and then died with could not be abandoned (the kernel waits out a request a
    daemon has read), so its thread would keep the dead daemon from exiting, and the holder
    from seeing it go."""
    probe = [sys.executable, "-I", "-S", "-c", "import os, sys; os.stat(sys.argv[1])",
             os.path.join(mountpoint, CTL_NAME, "stats")]
    done = await trio.run_process(probe, check=False, stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if done.returncode != 0:
        raise FaultfsError(f"the mount at {mountpoint} does not answer", errno.EIO)
    entry = find_mount(mountpoint)
    if config.readahead_kb and entry is not None:
        await trio.to_thread.run_sync(set_readahead, mountpoint, entry.minor, config.readahead_kb)
    if config.max_background and entry is not None:
        await trio.to_thread.run_sync(set_max_background, mountpoint, entry.minor,
                                      config.max_background)
    await served.announce(mountpoint)
    ops.serving()
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


async def _watch_signals(held: Handover | None) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            log.info("signal %d: unmounting", signum)
            if held is not None:
                held.bye()  # the holder lets the connection go instead of restarting
            pyfuse3.terminate()
            return


async def _log_stats(engine: Engine) -> None:
    while True:
        await trio.sleep(STATS_INTERVAL_S)
        snap = await engine.snapshot()
        log.info("stats %s latency %s", json.dumps(snap["counters"], sort_keys=True),
                 json.dumps(snap["fault_latency"], sort_keys=True))


