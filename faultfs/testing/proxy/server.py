"""LatencyProxy, the face: a loopback HTTP/1.1 proxy that delays, paces and breaks responses.

This kernel has no ``tc netem``, so benchmarks and tests put ``LatencyProxy`` between a client
and a local server (moto in server mode, or any HTTP/1.1 server) to give that server the round
trip and bandwidth of a remote one, and to make it fail on purpose (``FaultPlan``). The proxy
runs its own asyncio event loop in a background thread, so synchronous code can use it; it
needs only the standard library. ``python -m faultfs.testing.proxy`` runs one from a shell.

Invariants:
- Bytes are forwarded verbatim both ways (``http1``); each response's first byte waits
  ``delay_ms`` (``connection``); response bytes are paced (``pacing``); faults are picked by
  a seeded plan (``faults``). Each room states its own.
- All sockets belong to the loop thread. ``close()`` aborts whatever is open, stalled
  connections included, and returns within ``CLOSE_TIMEOUT_S``.
- Connections beyond ``max_connections`` are closed at once and counted; a socket waiting
  longer than ``idle_timeout_s`` (for a request, or for the upstream) is aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time

from faultfs.testing.proxy.connection import Conn
from faultfs.testing.proxy.faults import FaultPlan, Faults
from faultfs.testing.proxy.pacing import Bucket, Pacing, piece_for
from faultfs.testing.proxy.sockets import Stream
from faultfs.testing.proxy.stats import ProxyStats

IDLE_SCAN_S = 1.0  # how often idle connections are looked for; idle_timeout_s is seconds or more
START_TIMEOUT_S = 10.0  # binding a loopback port is instant; this only bounds a wedged start
CLOSE_TIMEOUT_S = 5.0  # close() aborts every transport at once, so this bounds a wedged loop only

log = logging.getLogger(__name__)


class LatencyProxy:
    """A proxy on ``listen_host:listen_port`` (0: a free port) to ``upstream_host:upstream_port``.

    ``delay_ms``: wait before each response's first byte (0: none). ``conn_mbps``: response
    bandwidth of each client connection, MB/s (``None`` or 0: uncapped); ``total_mbps``: of
    all together. Connections beyond ``max_connections`` are closed at once (and counted);
    one idle for ``idle_timeout_s`` (waiting for a request, or for the upstream) is closed.
    After ``lifetime_s`` the proxy stops by itself. ``faults``: a ``FaultPlan``, or
    ``set_faults`` later. Use as a context manager, or ``start()`` and ``close()``.
    """

    def __init__(self, upstream_host: str, upstream_port: int, *, delay_ms: float = 20.0,
                 conn_mbps: float | None = 100.0, total_mbps: float | None = None,
                 listen_host: str = "127.0.0.1", listen_port: int = 0,
                 max_connections: int = 256, idle_timeout_s: float | None = 60,
                 lifetime_s: float | None = None, faults: FaultPlan | None = None) -> None:
        if delay_ms < 0:
            raise ValueError("delay_ms must be >= 0")
        if (conn_mbps or 0) < 0 or (total_mbps or 0) < 0:
            raise ValueError("bandwidths must be >= 0 (0 or None: uncapped)")
        if max_connections < 1:
            raise ValueError("max_connections must be >= 1")
        self.upstream = (upstream_host, int(upstream_port))
        self.delay_ms = float(delay_ms)
        self.conn_mbps = conn_mbps or None
        self.total_mbps = total_mbps or None
        self.listen_host = listen_host
        self.listen_port = listen_port
        self.max_connections = max_connections
        self.idle_timeout_s = idle_timeout_s or None
        self.lifetime_s = lifetime_s
        self._total_bucket = (Bucket(self.total_mbps, piece_for(self.total_mbps))
                              if self.total_mbps else None)
        self._faults = Faults(faults)
        self._stats = ProxyStats()  # read from other threads
        self._connection_numbers = itertools.count(1)
        self._tasks: set[asyncio.Task] = set()
        self._streams: set[Stream] = set()  # every open socket, client and upstream
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._stopped = threading.Event()
        self._error: BaseException | None = None
        self._port: int | None = None

    # -- life cycle (any thread) --

    def start(self) -> LatencyProxy:
        if self._thread is not None:
            raise RuntimeError("the proxy was already started")
        self._thread = threading.Thread(
            target=self._run, name=f"LatencyProxy-{self.upstream[0]}:{self.upstream[1]}",
            daemon=True)
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S):
            self.close()
            raise RuntimeError("the proxy did not start")
        if self._error is not None:
            raise self._error
        return self

    def close(self) -> None:
        """Stop serving and close every connection; returns within ``CLOSE_TIMEOUT_S``."""
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not self._stopped.is_set():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(stop.set)
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(CLOSE_TIMEOUT_S)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the proxy has stopped (``close`` or ``lifetime_s``); False on timeout."""
        if self._thread is None:
            raise RuntimeError("the proxy was not started")
        return self._stopped.wait(timeout)

    def __enter__(self) -> LatencyProxy:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the proxy is not listening yet: start() it")
        return self._port

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.listen_host in ("", "0.0.0.0") else self.listen_host
        return f"http://{host}:{self.port}"

    def set_faults(self, faults: FaultPlan | None) -> None:
        """Install a plan (counting requests from 1 again), or ``None`` for no faults."""
        self._faults.use(faults)

    # -- stats (any thread) --

    def stats(self, *, log: bool = True) -> dict:
        """Counters of the current window (since start or ``reset_stats``) and, with ``log``,
        the records of its last ``LOG_LENGTH`` finished requests, oldest first, as dicts."""
        return self._stats.snapshot(log=log)

    def reset_stats(self) -> None:
        """Start a new window: counters at zero, the log emptied, the peak at what is in flight.
        Requests in flight now are booked (served, logged) in the new window when they end."""
        self._stats.reset()

    # -- the loop thread --

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported by start(), or logged if it came later
            if self._ready.is_set():
                log.exception("the latency proxy stopped on an error")
            self._error = exc
        finally:
            self._stopped.set()
            self._ready.set()

    async def _main(self) -> None:
        self._loop = loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        server = await loop.create_server(
            lambda: Stream(self._streams, self._accept), self.listen_host, self.listen_port,
            backlog=self.max_connections)
        watchdog = None
        try:
            self._port = server.sockets[0].getsockname()[1]
            if self.idle_timeout_s is not None:
                watchdog = asyncio.create_task(self._watch_idle(self.idle_timeout_s))
            self.reset_stats()
            self._ready.set()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.lifetime_s):
                    await self._stop.wait()
        finally:
            server.close()
            if watchdog is not None:
                watchdog.cancel()
            for task in list(self._tasks):
                task.cancel()
            for stream in list(self._streams):
                stream.abort()
            if self._tasks:
                await asyncio.wait(list(self._tasks), timeout=CLOSE_TIMEOUT_S / 2)
            for stream in list(self._streams):  # any an ending task had just opened
                stream.abort()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(CLOSE_TIMEOUT_S / 4):
                    await server.wait_closed()
            # aborted transports close their sockets on the next turns of the loop
            for _ in range(3):
                await asyncio.sleep(0)

    async def _watch_idle(self, idle_s: float) -> None:
        while True:
            await asyncio.sleep(min(IDLE_SCAN_S, idle_s / 4))
            now = time.monotonic()
            for stream in list(self._streams):
                if stream.idle_for(now) > idle_s:
                    stream.abort()  # its waiting read sees the end, its drain an error

    def _accept(self, client: Stream) -> None:
        if not self._stats.admit(self.max_connections):
            client.abort()
            return
        task = asyncio.get_running_loop().create_task(self._on_client(client))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _on_client(self, client: Stream) -> None:
        conn = Conn(next(self._connection_numbers), client, route=self,
                    pacing=Pacing(self.conn_mbps, self.total_mbps, self._total_bucket),
                    faults=self._faults, stats=self._stats, sockets=self._streams)
        try:
            await conn.serve()
        except asyncio.CancelledError:
            pass  # the proxy is closing; ending normally keeps asyncio from logging the task
        finally:
            conn.close()
            self._stats.closed()
