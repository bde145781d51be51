"""One client connection: its requests relayed in turn to its upstream connection, and back.

Invariants:
- Each client connection has at most one upstream connection, opened at its first request and
  reopened after the upstream ended it; a response not relayed whole closes both.
- The first byte of every response leaves no sooner than ``delay_ms`` after its request was
  fully forwarded (its head, for an interim 1xx answer; fully read from the client, for an
  answer the proxy makes itself). The upstream's own time runs inside the delay, not after it.
- A request body goes up beside the wait for the response head, so that a ``100 Continue``
  gets through; request bytes are not paced, response bytes are (``pacing``).
- The fault of a request is picked when its head arrives (``Faults.pick``); a ``status``
  fault is answered by the proxy without asking the upstream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

from faultfs.testing.proxy.faults import Faults, error_answer
from faultfs.testing.proxy.http1 import (
    NONE,
    UNTIL_CLOSE,
    keep_alive,
    parse_head,
    relay_body,
    request_framing,
    response_framing,
)
from faultfs.testing.proxy.pacing import MAX_PIECE, Pacing
from faultfs.testing.proxy.response import Close, Reset, Response
from faultfs.testing.proxy.sockets import Stream
from faultfs.testing.proxy.stats import ProxyStats, RequestRecord

CONNECT_TIMEOUT_S = 10.0  # a loopback upstream accepts at once; this only bounds a dead one

log = logging.getLogger(__name__)


class Route(Protocol):
    """What a connection reads of its proxy at each request (``LatencyProxy``)."""

    upstream: tuple[str, int]
    delay_ms: float


def _consume(task: asyncio.Task) -> None:
    """Retrieve a helper task's outcome so that asyncio does not log it; its owner reacts."""
    if not task.cancelled():
        task.exception()


async def _sleep_until(deadline: float) -> None:
    wait = deadline - time.monotonic()
    if wait > 0:
        await asyncio.sleep(wait)


class Conn:
    """One client connection, its upstream connection and its pacing."""

    def __init__(self, n: int, client: Stream, *, route: Route, pacing: Pacing, faults: Faults,
                 stats: ProxyStats, sockets: set[Stream]) -> None:
        self.n = n
        self.client = client
        self.upstream: Stream | None = None
        self.route = route
        self.pacing = pacing
        self.faults = faults
        self.stats = stats
        self.sockets = sockets  # the proxy's open sockets; an upstream one joins them

    async def send(self, data: bytes, handing: Callable[[], None]) -> None:
        """Write response bytes to the client, no sooner than the buckets allow.

        The books (``handing``, the byte count) are kept before the write: once the send
        starts the client may see the bytes, and the stats must already hold them.
        """
        await self.pacing.wait(len(data))
        handing()
        self.stats.count("response_bytes", len(data))
        self.client.write(data)
        await self.client.drain()

    async def to_upstream(self, rec: RequestRecord, data: bytes, final: bool) -> None:
        assert self.upstream is not None
        rec.request_bytes += len(data)
        self.stats.count("request_bytes", len(data))
        self.upstream.write(data)
        await self.upstream.drain()

    async def discard(self, rec: RequestRecord, data: bytes, final: bool) -> None:
        rec.request_bytes += len(data)
        self.stats.count("request_bytes", len(data))

    async def connect_upstream(self) -> bool:
        up = self.upstream
        if up is not None and not up.eof and not up.lost:
            return True
        self.drop_upstream()
        host, port = self.route.upstream
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                _, self.upstream = await loop.create_connection(
                    lambda: Stream(self.sockets), host, port)
        except OSError:
            return False
        return True

    def drop_upstream(self) -> None:
        if self.upstream is not None:
            self.upstream.close()
        self.upstream = None

    async def wait_client_gone(self) -> None:
        """Until the client closes its side; anything it sends meanwhile is dropped."""
        self.client.idle_exempt = True
        while await self.client.read(MAX_PIECE):
            pass

    def close(self) -> None:
        self.client.close()
        self.drop_upstream()

    def abort(self) -> None:
        self.client.abort()
        if self.upstream is not None:
            self.upstream.abort()

    # -- the requests, in turn --

    async def serve(self) -> None:
        """Relay requests and their responses until the connection ends."""
        try:
            while True:
                raw = await self._request_head()
                if raw is None or not await self._exchange(raw):
                    return
        except Reset:
            await self.client.reset()
        except (Close, ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass  # the connection ends here; close() follows
        except Exception:
            log.exception("latency proxy connection %d failed", self.n)

    async def _request_head(self) -> bytes | None:
        """The next request head, or None once the client closed or idled out between requests."""
        try:
            return await self.client.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            return None

    async def _exchange(self, raw: bytes) -> bool:
        """Relay one request and its response; True if the connection may carry another."""
        rec = self.stats.begin(self.n, len(raw))
        try:
            try:
                line, headers = parse_head(raw)
                method, rec.path, version = line.split(" ")
                if not version.startswith("HTTP/1."):
                    raise ValueError(f"not HTTP/1.x: {line!r}")
                framing = request_framing(headers)
            except ValueError:
                await self._answer(rec, 400, None, "The proxy could not parse the request.",
                                   time.monotonic(), close=True)
                return False
            rec.method = method
            expects = "100-continue" in [v.lower() for v in headers.get("expect", ())]
            return await self._relay(rec, raw, method, keep_alive(version, headers), framing,
                                     expects)
        finally:
            self.stats.finish(rec)

    async def _relay(self, rec: RequestRecord, raw: bytes, method: str, keep: bool,
                     framing: tuple[str, int], expects: bool = False) -> bool:
        rule = self.faults.pick(method, rec.path)
        if rule is not None and rule.kind == "status":
            if expects:  # the client waits for "100 Continue" before its body: answer now
                self.stats.fault_struck(rec, "status")
                await self._answer(rec, rule.status, rule.code, rule.message,
                                   time.monotonic(), close=True)
                return False
            await relay_body(self.client, framing, MAX_PIECE,
                             lambda d, final: self.discard(rec, d, final))
            self.stats.fault_struck(rec, "status")
            await self._answer(rec, rule.status, rule.code, rule.message, time.monotonic(),
                               head_only=method == "HEAD")
            return keep
        if not await self.connect_upstream():
            await relay_body(self.client, framing, MAX_PIECE,
                             lambda d, final: self.discard(rec, d, final))
            self.stats.count("upstream_errors")
            await self._answer(rec, 502, None, "The proxy could not reach the upstream.",
                               time.monotonic(), close=True)
            return False
        upstream = self.upstream
        assert upstream is not None
        resp = Response(self, rec, rule)
        upstream.write(raw)
        sending = None
        if framing is not NONE:
            sending = asyncio.create_task(self._send_request_body(rec, framing))
            sending.add_done_callback(_consume)
        try:
            await upstream.drain()
            forwarded = time.monotonic()  # the head's, for an interim answer
            while True:
                rhead = await self._response_head(upstream)
                status_line, rheaders = parse_head(rhead)
                version, _, rest = status_line.partition(" ")
                status = int(rest[:3])
                if 100 <= status < 200 and status != 101:
                    await _sleep_until(forwarded + self.route.delay_ms / 1000)
                    await resp.head(rhead, interim=True)
                    continue
                break
            if sending is not None:
                forwarded = await sending
        finally:
            if sending is not None and not sending.done():
                sending.cancel()
        await _sleep_until(forwarded + self.route.delay_ms / 1000)
        rframing = response_framing(method, status, rheaders)
        upstream_keep = keep_alive(version, rheaders) and rframing is not UNTIL_CLOSE
        rec.status = status
        resp.frame(rframing)
        await resp.head(rhead, final=rframing in (NONE, ("length", 0)))
        await relay_body(upstream, rframing, self.pacing.piece, resp.body, resp.last)
        await resp.end()
        rec.complete = True
        if not upstream_keep:
            self.drop_upstream()
        return keep and upstream_keep

    async def _send_request_body(self, rec: RequestRecord, framing: tuple[str, int]) -> float:
        """Forward the request body; returns when it was fully forwarded. Runs beside the wait
        for the response head, so that a ``100 Continue`` gets through."""
        try:
            await relay_body(self.client, framing, MAX_PIECE,
                             lambda d, final: self.to_upstream(rec, d, final))
            return time.monotonic()
        except BaseException:
            self.abort()  # the exchange cannot go on; the response side sees the abort
            raise

    async def _response_head(self, upstream: Stream) -> bytes:
        try:
            return await upstream.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ValueError, ConnectionError):
            self.stats.count("upstream_errors")
            raise Close from None

    async def _answer(self, rec: RequestRecord, status: int, code: str | None,
                      message: str | None, since: float, *, head_only: bool = False,
                      close: bool = False) -> None:
        """Answer an error of the proxy's own, ``delay_ms`` after ``since``."""
        head, body = error_answer(status, code, message, f"faultfs-proxy-{rec.n}", close)
        await _sleep_until(since + self.route.delay_ms / 1000)
        rec.status = status
        resp = Response(self, rec, None)
        await resp.head(head, final=head_only)
        if not head_only:
            await resp.body(body, final=True)
        rec.complete = True
