"""A loopback HTTP/1.1 proxy that delays, paces and breaks responses, to emulate a remote source.

This kernel has no ``tc netem``, so benchmarks and tests put ``LatencyProxy`` between a client
and a local server (moto in server mode, or any HTTP/1.1 server) to give that server the round
trip and bandwidth of a remote one, and to make it fail on purpose (``FaultPlan``). The proxy
runs its own asyncio event loop in a background thread, so synchronous code can use it; it
needs only the standard library. ``python -m faultfs.testing.proxy`` runs one from a shell.

Invariants:
- Bytes are forwarded verbatim both ways. Heads are parsed only to find where each message ends
  (Content-Length, chunked, or until close; no body after HEAD, 1xx, 204 and 304) and are never
  rewritten, Host included, so request signatures stay valid. No upgrades, no CONNECT.
- The first byte of every response leaves no sooner than ``delay_ms`` after its request was
  fully forwarded (its head, for an interim 1xx answer; fully read from the client, for an
  answer the proxy makes itself). The upstream's own time runs inside the delay, not after it.
- Response bytes of a client connection, heads included, leave at no more than ``conn_mbps`` on
  average, and those of all connections together at no more than ``total_mbps``; each bucket
  lets one pacing piece (about ``PACE_QUANTUM_S`` at its rate) go as a burst. Request bytes
  are not paced.
- Each client connection has at most one upstream connection, opened at its first request and
  reopened after the upstream ended it; a response not relayed whole closes both.
- Faults are decided when a request head arrives, from generators seeded by the plan, so one
  plan over one sequence of requests breaks the same requests every run.
- All sockets belong to the loop thread. ``close()`` aborts whatever is open, stalled
  connections included, and returns within ``CLOSE_TIMEOUT_S``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import fcntl
import http
import itertools
import logging
import mmap
import random
import signal
import socket
import struct
import sys
import termios
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field, fields
from xml.sax.saxutils import escape

MB = 1_000_000  # rates are in MB/s of 10^6 bytes, as network links are rated

HEAD_LIMIT = 64 << 10  # longest head or chunk-size line accepted; S3 heads are a few KB
RECV_BUFFER = 1 << 20  # each socket's receive buffer, mapped once: the kernel reads into it
PAUSE_AT = 768 << 10  # stop reading a socket once this much waits in its buffer...
RESUME_AT = 256 << 10  # ...and read it again below this, so a slow reader holds < 1 MiB
RECV_ROOM = 256 << 10  # below this much free tail, held bytes move to the buffer's front first
MAX_PIECE = 1 << 20  # most bytes relayed per read: ~500 reads/s at 500 MB/s, so the Python cost
# of a read stays small beside the copying
MIN_PIECE = 16 << 10  # fewest bytes per paced send, so a slow cap does not wake the loop per packet
PACE_QUANTUM_S = 0.002  # a paced piece lasts this long at its cap: short against any delay worth
# emulating, yet 16 connections at 100 MB/s wake the loop only ~8000 times a second
MIN_SLEEP_S = 0.0005  # a send due sooner than this goes at once (its bucket keeps the debt):
# saves wake-ups, and sends never run further ahead of their schedule than this
WRITE_HIGH = 1 << 20  # client transport buffer above which a send waits: about one piece, so
# pacing is measured at the socket and not in a queue in front of it
IDLE_SCAN_S = 1.0  # how often idle connections are looked for; idle_timeout_s is seconds or more
FLUSH_TIMEOUT_S = 1.0  # before a reset, longest wait for the kernel to deliver what was sent (a
# client that stopped reading must not hold a reset back)
FLUSH_POLL_S = 0.001  # how often that wait looks at the socket's send queue
CONNECT_TIMEOUT_S = 10.0  # a loopback upstream accepts at once; this only bounds a dead one
START_TIMEOUT_S = 10.0  # binding a loopback port is instant; this only bounds a wedged start
CLOSE_TIMEOUT_S = 5.0  # close() aborts every transport at once, so this bounds a wedged loop only
LOG_LENGTH = 10_000  # per-request records kept: a benchmark run's worth, a few MB at most

FAULT_KINDS = ("reset", "stall", "status", "truncate")
S3_ERROR_CODES = {
    400: "BadRequest",
    403: "AccessDenied",
    404: "NoSuchKey",
    500: "InternalError",
    502: "BadGateway",
    503: "ServiceUnavailable",
}
S3_ERROR_MESSAGES = {
    500: "We encountered an internal error. Please try again.",
    503: "Please reduce your request rate.",
}

_NONE = ("none", 0)
_CHUNKED = ("chunked", 0)
_UNTIL_CLOSE = ("close", 0)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FaultRule:
    """One fault and the requests it hits.

    ``kind``: ``"reset"`` closes the client connection abruptly (RST) once ``after_bytes`` of the
    response body went out; ``"stall"`` stops sending there for ``stall_s`` seconds (``None``:
    until the client or the proxy closes), the connection kept open; ``"status"`` answers
    ``status`` with a small S3-style XML error (``code``, ``message``; defaults follow the
    status) without asking the upstream; ``"truncate"`` sends the real head, then closes after
    half the body (a chunked body: everything but its last chunk).

    ``after_bytes`` counts body bytes as sent (a chunked body's framing too); ``None`` means
    before the response head (a reset then answers nothing, though the upstream saw the
    request). A body shorter than ``after_bytes`` gets the fault at its end.

    Which requests: those numbered in ``requests`` (1 is the first request the rule matches),
    and each other one with probability ``fraction``. ``match(method, path)``, if given, picks
    the requests the rule sees at all; ``path`` is the request target as sent, query included.
    """

    kind: str
    requests: Iterable[int] = ()
    fraction: float = 0.0
    match: Callable[[str, str], bool] | None = None
    after_bytes: int | None = 0
    stall_s: float | None = None
    status: int = 503
    code: str | None = None
    message: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"fault kind {self.kind!r} is not one of {FAULT_KINDS}")
        numbers = frozenset(self.requests)
        if any(n < 1 for n in numbers):
            raise ValueError("request numbers count from 1")
        object.__setattr__(self, "requests", numbers)
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError("fraction must be within [0, 1]")
        if self.after_bytes is not None and self.after_bytes < 0:
            raise ValueError("after_bytes must be >= 0 or None")
        if self.stall_s is not None and self.stall_s < 0:
            raise ValueError("stall_s must be >= 0 or None")
        if not 400 <= self.status <= 599:
            raise ValueError("an injected status is an error: 400 to 599")


class FaultPlan:
    """Rules tried in order; the first that hits a request breaks it.

    Every rule counts and draws for each request it matches, whether or not an earlier rule
    took that request, so adding a rule does not shift another's hits. ``seed`` seeds one
    generator per rule. The plan itself holds no state: each ``set_faults`` (or proxy) starts
    its counts and generators afresh.
    """

    def __init__(self, *rules: FaultRule, seed: int = 0) -> None:
        for rule in rules:
            if not isinstance(rule, FaultRule):
                raise TypeError(f"FaultPlan takes FaultRule objects, not {rule!r}")
        self.rules = rules
        self.seed = seed

    def __repr__(self) -> str:
        return f"FaultPlan({', '.join(map(repr, self.rules))}, seed={self.seed})"


class _FaultPicker:
    """A plan in use: how many requests each rule has matched, and each rule's generator."""

    def __init__(self, plan: FaultPlan) -> None:
        self.rules = plan.rules
        self.matched = [0] * len(plan.rules)
        # a str seed is hashed with SHA-512, so it is the same in every process
        self.draws = [random.Random(f"{plan.seed}:{i}") for i in range(len(plan.rules))]

    def pick(self, method: str, path: str) -> FaultRule | None:
        chosen = None
        for i, rule in enumerate(self.rules):
            if rule.match is not None and not rule.match(method, path):
                continue
            self.matched[i] += 1
            hit = self.matched[i] in rule.requests
            if rule.fraction and self.draws[i].random() < rule.fraction:
                hit = True
            if hit and chosen is None:
                chosen = rule
        return chosen


class _Bucket:
    """A token bucket kept as the time its debt is paid (``due``): simple, exact on average.

    ``reserve(n, now)`` books n bytes and says when they may go: once the bytes booked before
    them are paid, less the burst the bucket holds when full.
    """

    __slots__ = ("_burst_s", "_due", "_per_byte")

    def __init__(self, mbps: float, burst: int) -> None:
        self._per_byte = 1.0 / (mbps * MB)
        self._burst_s = burst * self._per_byte
        self._due = 0.0

    def reserve(self, n: int, now: float) -> float:
        self._due = max(self._due, now) + n * self._per_byte
        return self._due - self._burst_s


def _piece_for(mbps: float | None) -> int:
    if not mbps:
        return MAX_PIECE
    return int(min(MAX_PIECE, max(MIN_PIECE, mbps * MB * PACE_QUANTUM_S)))


@dataclass(slots=True)
class RequestRecord:
    """One request through the proxy. Times are ``time.monotonic()`` seconds: ``first_byte`` and
    ``end`` are when the first and the last response bytes were handed to the client's socket
    (``first_byte`` ``None``: none were). ``complete``: the whole response was handed over.
    ``fault``: the kind of fault that struck it, if any."""

    n: int
    connection: int
    start: float
    method: str = ""
    path: str = ""
    status: int | None = None
    request_bytes: int = 0
    response_bytes: int = 0
    first_byte: float | None = None
    end: float | None = None
    fault: str | None = None
    complete: bool = False


_RECORD_FIELDS = tuple(f.name for f in fields(RequestRecord))


@dataclass
class _Window:
    """Counters since the proxy started or ``reset_stats`` was last called."""

    start: float
    since: float  # when ``area`` was last brought up to date
    area: float = 0.0  # in-flight requests integrated over time, from ``start`` to ``since``
    peak_in_flight: int = 0
    requests: int = 0
    served: int = 0
    request_bytes: int = 0
    response_bytes: int = 0
    connections: int = 0
    refused_connections: int = 0
    upstream_errors: int = 0
    faults: collections.Counter[str] = field(default_factory=collections.Counter)


class _Close(Exception):
    """End the client connection now, gracefully (FIN)."""


class _Reset(Exception):
    """End the client connection now, abruptly (RST)."""


def _consume(task: asyncio.Task) -> None:
    """Retrieve a helper task's outcome so that asyncio does not log it; its owner reacts."""
    if not task.cancelled():
        task.exception()


async def _sleep_until(deadline: float) -> None:
    wait = deadline - time.monotonic()
    if wait > 0:
        await asyncio.sleep(wait)


def _parse_head(raw: bytes) -> tuple[str, dict[str, list[str]]]:
    lines = raw.decode("latin-1").split("\r\n")
    headers: dict[str, list[str]] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise ValueError(f"malformed header line {line!r}")
        headers.setdefault(name.lower(), []).append(value.strip())
    return lines[0], headers


def _tokens(headers: dict[str, list[str]], name: str) -> list[str]:
    return [t.strip().lower() for v in headers.get(name, ()) for t in v.split(",") if t.strip()]


def _content_length(headers: dict[str, list[str]]) -> int | None:
    values = [v.strip() for v in ",".join(headers.get("content-length", ())).split(",")]
    values = [v for v in values if v]
    if not values:
        return None
    if not all(v.isdigit() for v in values) or len({int(v) for v in values}) > 1:
        raise ValueError(f"bad Content-Length {values}")
    return int(values[0])


def _keep_alive(version: str, headers: dict[str, list[str]]) -> bool:
    tokens = _tokens(headers, "connection")
    if "close" in tokens:
        return False
    return version == "HTTP/1.1" or "keep-alive" in tokens


def _request_framing(headers: dict[str, list[str]]) -> tuple[str, int]:
    codings = _tokens(headers, "transfer-encoding")
    if codings:
        if codings[-1] != "chunked":
            raise ValueError("a request body must end with the chunked coding")
        return _CHUNKED
    length = _content_length(headers)
    return ("length", length) if length else _NONE


def _response_framing(method: str, status: int, headers: dict[str, list[str]]) -> tuple[str, int]:
    if status == 101:
        return _UNTIL_CLOSE
    if method == "HEAD" or status < 200 or status in (204, 304):
        return _NONE
    codings = _tokens(headers, "transfer-encoding")
    if codings:
        return _CHUNKED if codings[-1] == "chunked" else _UNTIL_CLOSE
    length = _content_length(headers)
    return _UNTIL_CLOSE if length is None else ("length", length)


def _chunk_size(line: bytes) -> int:
    size = int(line.split(b";", 1)[0].strip(), 16)
    if size < 0:
        raise ValueError(f"bad chunk size line {line!r}")
    return size


def _error_answer(status: int, code: str | None, message: str | None, request_id: str,
                  close: bool) -> tuple[bytes, bytes]:
    """The head and body of an S3-style XML error answer."""
    try:
        phrase = http.HTTPStatus(status).phrase
    except ValueError:
        phrase = "Error"
    code = code or S3_ERROR_CODES.get(status) or phrase.replace(" ", "")
    message = message or S3_ERROR_MESSAGES.get(status) or phrase
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{escape(code)}</Code><Message>{escape(message)}</Message>"
        f"<RequestId>{escape(request_id)}</RequestId></Error>"
    ).encode()
    head = (
        f"HTTP/1.1 {status} {phrase}\r\n"
        "Content-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\n"
        f"x-amz-request-id: {request_id}\r\n"
        + ("Connection: close\r\n" if close else "")
        + "\r\n"
    ).encode()
    return head, body


def _unsent(sock: socket.socket) -> int:
    """Bytes the kernel still holds for the peer (sent but not acknowledged, or not sent)."""
    try:
        raw = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    except OSError:
        return 0
    return struct.unpack("i", raw)[0]


class _Stream(asyncio.BufferedProtocol):
    """One socket: a receive buffer the kernel reads into, and flow-controlled writes.

    The buffer is one anonymous mapping, made once: its pages become resident as they are
    first used, so a connection that only carries small requests costs little. asyncio's
    ``StreamReader`` instead grows and shrinks a bytearray that, once read from the front, is
    copied into a fresh allocation on every receive; at 1 MiB and more that is a new mapping
    whose pages fault in afresh each time, which took a third of the proxy's time at 500 MB/s.

    One task reads a stream at a time, and one writes it; they may differ (a request body goes
    up while the response head is awaited).
    """

    def __init__(self, proxy: LatencyProxy, *, accepted: bool) -> None:
        self.proxy = proxy
        self.accepted = accepted
        self.transport: asyncio.Transport | None = None
        self.buf = mmap.mmap(-1, RECV_BUFFER)
        self.view = memoryview(self.buf)
        self.start = 0  # held bytes are buf[start:end]
        self.end = 0
        self.eof = False
        self.lost = False
        self.reading_paused = False
        self.writing_paused = False
        self.read_waiter: asyncio.Future[None] | None = None
        self.drain_waiter: asyncio.Future[None] | None = None
        self.read_since: float | None = None  # since when a read waits (for the idle watchdog)
        self.drain_since: float | None = None
        self.idle_exempt = False  # a stall that waits for the client does not idle out

    # -- protocol callbacks --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.set_write_buffer_limits(high=WRITE_HIGH)
        self.proxy._streams.add(self)
        if self.accepted:
            self.proxy._accept(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = self.eof = True
        self.proxy._streams.discard(self)
        _wake(self.read_waiter)
        _wake(self.drain_waiter)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.start == self.end:
            self.start = self.end = 0
        elif len(self.buf) - self.end < RECV_ROOM:
            held = self.view[self.start:self.end].tobytes()  # no overlapping copy in place
            self.buf[:len(held)] = held
            self.start, self.end = 0, len(held)
        return self.view[self.end:]

    def buffer_updated(self, nbytes: int) -> None:
        self.end += nbytes
        if self.end - self.start >= PAUSE_AT and not self.reading_paused:
            self.reading_paused = True
            assert self.transport is not None
            self.transport.pause_reading()
        _wake(self.read_waiter)

    def eof_received(self) -> bool:
        self.eof = True
        _wake(self.read_waiter)
        return True  # a half-closed client may still read its answer; we close the socket

    def pause_writing(self) -> None:
        self.writing_paused = True

    def resume_writing(self) -> None:
        self.writing_paused = False
        _wake(self.drain_waiter)

    # -- for the proxy's tasks --

    def idle_for(self, now: float) -> float:
        """How long this socket has waited, to read or to write; 0 if it is not waiting."""
        read_since = None if self.idle_exempt else self.read_since
        waits = [t for t in (read_since, self.drain_since) if t is not None]
        return now - min(waits) if waits else 0.0

    async def _more(self) -> None:
        """Wait until more bytes arrived, or the end of the stream."""
        self.read_waiter = asyncio.get_running_loop().create_future()
        self.read_since = time.monotonic()
        try:
            await self.read_waiter
        finally:
            self.read_waiter = self.read_since = None

    def _taken(self, stop: int) -> bytes:
        data = self.view[self.start:stop].tobytes()
        self.start = stop
        if self.reading_paused and self.end - self.start < RESUME_AT and not self.lost:
            self.reading_paused = False
            assert self.transport is not None
            self.transport.resume_reading()
        return data

    async def read(self, n: int) -> bytes:
        """Up to ``n`` bytes, as soon as there are any; ``b""`` at the end of the stream."""
        while self.start == self.end:
            if self.eof:
                return b""
            await self._more()
        return self._taken(min(self.end, self.start + n))

    async def readuntil(self, sep: bytes) -> bytes:
        """Bytes up to and including ``sep``; IncompleteReadError if the stream ends first."""
        scanned = 0  # bytes past ``start`` known not to begin ``sep``
        while True:
            found = self.buf.find(sep, self.start + scanned, self.end)
            if found >= 0:
                return self._taken(found + len(sep))
            if self.end - self.start > HEAD_LIMIT:
                raise ValueError("a head or chunk line longer than HEAD_LIMIT")
            if self.eof:
                raise asyncio.IncompleteReadError(self.view[self.start:self.end].tobytes(), None)
            scanned = max(0, self.end - self.start - len(sep) + 1)
            await self._more()

    def write(self, data: bytes) -> None:
        if self.lost or self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("the connection is closed")
        self.transport.write(data)

    async def drain(self) -> None:
        """Wait until the transport's buffer is below ``WRITE_HIGH`` again."""
        while self.writing_paused and not self.lost:
            self.drain_waiter = asyncio.get_running_loop().create_future()
            self.drain_since = time.monotonic()
            try:
                await self.drain_waiter
            finally:
                self.drain_waiter = self.drain_since = None
        if self.lost:
            raise ConnectionResetError("the connection is closed")

    def close(self) -> None:
        """Close once what was written is sent (FIN)."""
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    async def reset(self) -> None:
        """Let the kernel deliver what was sent (a bounded wait), then close with an RST."""
        transport = self.transport
        if transport is None:
            return
        sock = transport.get_extra_info("socket")
        # no event says "the send queue is empty", so look at it, a bounded number of times
        for _ in range(round(FLUSH_TIMEOUT_S / FLUSH_POLL_S)):
            pending = transport.get_write_buffer_size() or (sock is not None and _unsent(sock))
            if not pending or self.lost:
                break
            await asyncio.sleep(FLUSH_POLL_S)
        if sock is not None and not self.lost:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        transport.abort()


def _wake(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


class _Conn:
    """One client connection, its upstream connection and its pacing."""

    def __init__(self, proxy: LatencyProxy, n: int, client: _Stream) -> None:
        self.proxy = proxy
        self.n = n
        self.client = client
        self.upstream: _Stream | None = None
        own = _Bucket(proxy.conn_mbps, _piece_for(proxy.conn_mbps)) if proxy.conn_mbps else None
        self.buckets = [b for b in (own, proxy._total_bucket) if b is not None]
        self.piece = min(_piece_for(proxy.conn_mbps), _piece_for(proxy.total_mbps))

    async def send(self, data: bytes, handing: Callable[[], None]) -> None:
        """Write response bytes to the client, no sooner than the buckets allow.

        The books (``handing``, the byte count) are kept before the write: once the send
        starts the client may see the bytes, and the stats must already hold them.
        """
        if self.buckets:
            now = time.monotonic()
            at = max([b.reserve(len(data), now) for b in self.buckets])
            if at - now > MIN_SLEEP_S:
                await asyncio.sleep(at - now)
        handing()
        self.proxy._count("response_bytes", len(data))
        self.client.write(data)
        await self.client.drain()

    async def to_upstream(self, rec: RequestRecord, data: bytes, final: bool) -> None:
        assert self.upstream is not None
        rec.request_bytes += len(data)
        self.proxy._count("request_bytes", len(data))
        self.upstream.write(data)
        await self.upstream.drain()

    async def discard(self, rec: RequestRecord, data: bytes, final: bool) -> None:
        rec.request_bytes += len(data)
        self.proxy._count("request_bytes", len(data))

    async def connect_upstream(self) -> bool:
        up = self.upstream
        if up is not None and not up.eof and not up.lost:
            return True
        self.drop_upstream()
        host, port = self.proxy.upstream
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                _, self.upstream = await loop.create_connection(
                    lambda: _Stream(self.proxy, accepted=False), host, port)
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


class _Response:
    """One response on its way to the client, and the fault (if any) that is to break it."""

    __slots__ = ("armed", "conn", "halve_first", "rec", "rule", "sent", "trigger")

    def __init__(self, conn: _Conn, rec: RequestRecord, rule: FaultRule | None) -> None:
        self.conn = conn
        self.rec = rec
        self.rule = rule
        self.armed = rule is not None and rule.kind != "status"
        self.trigger: int | None = None  # body offset at which the fault strikes
        self.halve_first = False  # a truncated body of unknown length: cut its first piece
        self.sent = 0  # body bytes sent

    def frame(self, framing: tuple[str, int]) -> None:
        if not self.armed:
            return
        assert self.rule is not None
        kind, length = framing
        if self.rule.kind != "truncate":
            self.trigger = self.rule.after_bytes
        elif kind in ("length", "none"):
            self.trigger = length // 2
        elif kind == "close":
            self.halve_first = True
        # a truncated chunked body strikes at its last chunk: see ``last``

    async def head(self, data: bytes, *, interim: bool = False, final: bool = False) -> None:
        """Send a head; ``final``: the response has no body."""
        if (self.armed and not interim and self.rule is not None
                and self.rule.kind != "truncate" and self.rule.after_bytes is None):
            await self._strike()
        await self._send(data, final=final)

    async def body(self, data: bytes, final: bool = False) -> None:
        """Send body bytes; ``final``: the last of them."""
        if self.armed:
            if self.halve_first:
                self.halve_first = False
                self.trigger = self.sent + len(data) // 2
            if self.trigger is not None and self.sent + len(data) >= self.trigger:
                cut = self.trigger - self.sent
                if cut:
                    await self._send(data[:cut], body=True)
                data = data[cut:]
                await self._strike()
        if data:
            await self._send(data, body=True, final=final)

    async def last(self) -> None:
        """Called before a chunked body's last chunk."""
        if self.armed and self.rule is not None and self.rule.kind == "truncate":
            await self._strike()

    async def end(self) -> None:
        """Called once the body went out whole: a fault not struck yet strikes now."""
        if self.armed:
            await self._strike()

    async def _strike(self) -> None:
        assert self.rule is not None
        self.armed = False
        kind = self.rule.kind
        self.conn.proxy._fault_struck(self.rec, kind)
        if kind == "reset":
            raise _Reset
        if kind == "truncate":
            raise _Close
        if self.rule.stall_s is None:
            await self.conn.wait_client_gone()
            raise _Close
        await asyncio.sleep(self.rule.stall_s)

    async def _send(self, data: bytes, *, body: bool = False, final: bool = False) -> None:
        rec = self.rec
        done = final and not self.armed  # a fault due at the end keeps the request open

        def handing() -> None:
            if rec.first_byte is None:
                rec.first_byte = time.monotonic()
            rec.response_bytes += len(data)
            if body:
                self.sent += len(data)
            if done:
                rec.complete = True
                self.conn.proxy._finish(rec)

        await self.conn.send(data, handing)


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
        self._total_bucket = (_Bucket(self.total_mbps, _piece_for(self.total_mbps))
                              if self.total_mbps else None)
        self._picker = _FaultPicker(faults) if faults is not None else None
        self._lock = threading.Lock()  # guards the stats below, read from other threads
        now = time.monotonic()
        self._window = _Window(start=now, since=now)
        self._in_flight = 0
        self._connections = 0
        self._log: collections.deque[RequestRecord] = collections.deque(maxlen=LOG_LENGTH)
        self._request_numbers = itertools.count(1)
        self._connection_numbers = itertools.count(1)
        self._tasks: set[asyncio.Task] = set()
        self._streams: set[_Stream] = set()  # every open socket, client and upstream
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
        self._picker = _FaultPicker(faults) if faults is not None else None

    # -- stats (any thread) --

    def stats(self, *, log: bool = True) -> dict:
        """Counters of the current window (since start or ``reset_stats``) and, with ``log``,
        the records of its last ``LOG_LENGTH`` finished requests, oldest first, as dicts."""
        with self._lock:
            now = time.monotonic()
            w = self._window
            elapsed = now - w.start
            area = w.area + self._in_flight * (now - w.since)
            out = {
                "window_start": w.start,
                "window_s": elapsed,
                "requests": w.requests,
                "served": w.served,
                "request_bytes": w.request_bytes,
                "response_bytes": w.response_bytes,
                "in_flight": self._in_flight,
                "peak_in_flight": w.peak_in_flight,
                "avg_in_flight": area / elapsed if elapsed > 0 else 0.0,
                "connections": self._connections,
                "connections_total": w.connections,
                "refused_connections": w.refused_connections,
                "upstream_errors": w.upstream_errors,
                "faults": {kind: w.faults[kind] for kind in FAULT_KINDS},
            }
            if log:
                out["log"] = [{name: getattr(r, name) for name in _RECORD_FIELDS}
                              for r in self._log]
        return out

    def reset_stats(self) -> None:
        """Start a new window: counters at zero, the log emptied, the peak at what is in flight.
        Requests in flight now are booked (served, logged) in the new window when they end."""
        with self._lock:
            now = time.monotonic()
            self._window = _Window(start=now, since=now, peak_in_flight=self._in_flight)
            self._log.clear()

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self._window, name, getattr(self._window, name) + n)

    def _fault_struck(self, rec: RequestRecord, kind: str) -> None:
        rec.fault = kind
        with self._lock:
            self._window.faults[kind] += 1

    def _in_flight_by(self, delta: int) -> None:
        """Change the in-flight count, integrating the old one up to now. Holds the lock."""
        now = time.monotonic()
        w = self._window
        w.area += self._in_flight * (now - w.since)
        w.since = now
        self._in_flight += delta
        w.peak_in_flight = max(w.peak_in_flight, self._in_flight)

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
            lambda: _Stream(self, accepted=True), self.listen_host, self.listen_port,
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

    def _accept(self, client: _Stream) -> None:
        with self._lock:
            refuse = self._connections >= self.max_connections
            if refuse:
                self._window.refused_connections += 1
            else:
                self._connections += 1
                self._window.connections += 1
        if refuse:
            client.abort()
            return
        task = asyncio.get_running_loop().create_task(self._on_client(client))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _on_client(self, client: _Stream) -> None:
        conn = _Conn(self, next(self._connection_numbers), client)
        try:
            await self._serve(conn)
        except asyncio.CancelledError:
            pass  # the proxy is closing; ending normally keeps asyncio from logging the task
        finally:
            conn.close()
            with self._lock:
                self._connections -= 1

    async def _serve(self, conn: _Conn) -> None:
        try:
            while True:
                raw = await self._request_head(conn.client)
                if raw is None or not await self._exchange(conn, raw):
                    return
        except _Reset:
            await conn.client.reset()
        except (_Close, ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass  # the connection ends here; close() follows
        except Exception:
            log.exception("latency proxy connection %d failed", conn.n)

    async def _request_head(self, client: _Stream) -> bytes | None:
        """The next request head, or None once the client closed or idled out between requests."""
        try:
            return await client.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            return None

    async def _exchange(self, conn: _Conn, raw: bytes) -> bool:
        """Relay one request and its response; True if the connection may carry another."""
        rec = RequestRecord(n=next(self._request_numbers), connection=conn.n,
                            start=time.monotonic(), request_bytes=len(raw))
        with self._lock:
            self._window.requests += 1
            self._window.request_bytes += len(raw)
            self._in_flight_by(+1)
        try:
            try:
                line, headers = _parse_head(raw)
                method, rec.path, version = line.split(" ")
                if not version.startswith("HTTP/1."):
                    raise ValueError(f"not HTTP/1.x: {line!r}")
                framing = _request_framing(headers)
            except ValueError:
                await self._answer(conn, rec, 400, None, "The proxy could not parse the request.",
                                   time.monotonic(), close=True)
                return False
            rec.method = method
            return await self._relay(conn, rec, raw, method, _keep_alive(version, headers),
                                     framing)
        finally:
            self._finish(rec)

    def _finish(self, rec: RequestRecord) -> None:
        """Book a request as ended (once): just before its last bytes go, or as it fails."""
        if rec.end is not None:
            return
        rec.end = time.monotonic()
        with self._lock:
            self._in_flight_by(-1)
            self._window.served += rec.complete
            self._log.append(rec)

    async def _relay(self, conn: _Conn, rec: RequestRecord, raw: bytes, method: str,
                     keep: bool, framing: tuple[str, int]) -> bool:
        picker = self._picker
        rule = picker.pick(method, rec.path) if picker is not None else None
        if rule is not None and rule.kind == "status":
            await self._relay_body(conn.client, framing, MAX_PIECE,
                                   lambda d, final: conn.discard(rec, d, final))
            self._fault_struck(rec, "status")
            await self._answer(conn, rec, rule.status, rule.code, rule.message,
                               time.monotonic(), head_only=method == "HEAD")
            return keep
        if not await conn.connect_upstream():
            await self._relay_body(conn.client, framing, MAX_PIECE,
                                   lambda d, final: conn.discard(rec, d, final))
            self._count("upstream_errors")
            await self._answer(conn, rec, 502, None, "The proxy could not reach the upstream.",
                               time.monotonic(), close=True)
            return False
        upstream = conn.upstream
        assert upstream is not None
        resp = _Response(conn, rec, rule)
        upstream.write(raw)
        sending = None
        if framing is not _NONE:
            sending = asyncio.create_task(self._send_request_body(conn, rec, framing))
            sending.add_done_callback(_consume)
        try:
            await upstream.drain()
            forwarded = time.monotonic()  # the head's, for an interim answer
            while True:
                rhead = await self._response_head(upstream)
                status_line, rheaders = _parse_head(rhead)
                version, _, rest = status_line.partition(" ")
                status = int(rest[:3])
                if 100 <= status < 200 and status != 101:
                    await _sleep_until(forwarded + self.delay_ms / 1000)
                    await resp.head(rhead, interim=True)
                    continue
                break
            if sending is not None:
                forwarded = await sending
        finally:
            if sending is not None and not sending.done():
                sending.cancel()
        await _sleep_until(forwarded + self.delay_ms / 1000)
        rframing = _response_framing(method, status, rheaders)
        upstream_keep = _keep_alive(version, rheaders) and rframing is not _UNTIL_CLOSE
        rec.status = status
        resp.frame(rframing)
        await resp.head(rhead, final=rframing in (_NONE, ("length", 0)))
        await self._relay_body(upstream, rframing, conn.piece, resp.body, resp.last)
        await resp.end()
        rec.complete = True
        if not upstream_keep:
            conn.drop_upstream()
        return keep and upstream_keep

    async def _send_request_body(self, conn: _Conn, rec: RequestRecord,
                                 framing: tuple[str, int]) -> float:
        """Forward the request body; returns when it was fully forwarded. Runs beside the wait
        for the response head, so that a ``100 Continue`` gets through."""
        try:
            await self._relay_body(conn.client, framing, MAX_PIECE,
                                   lambda d, final: conn.to_upstream(rec, d, final))
            return time.monotonic()
        except BaseException:
            conn.abort()  # the exchange cannot go on; the response side sees the abort
            raise

    async def _response_head(self, upstream: _Stream) -> bytes:
        try:
            return await upstream.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ValueError, ConnectionError):
            self._count("upstream_errors")
            raise _Close from None

    async def _answer(self, conn: _Conn, rec: RequestRecord, status: int, code: str | None,
                      message: str | None, since: float, *, head_only: bool = False,
                      close: bool = False) -> None:
        """Answer an error of the proxy's own, ``delay_ms`` after ``since``."""
        head, body = _error_answer(status, code, message, f"faultfs-proxy-{rec.n}", close)
        await _sleep_until(since + self.delay_ms / 1000)
        rec.status = status
        resp = _Response(conn, rec, None)
        await resp.head(head, final=head_only)
        if not head_only:
            await resp.body(body, final=True)
        rec.complete = True

    @staticmethod
    async def _relay_body(src: _Stream, framing: tuple[str, int], piece: int,
                          emit: Callable[[bytes, bool], Awaitable[None]],
                          last: Callable[[], Awaitable[None]] | None = None) -> None:
        """Pass one message body from ``src`` to ``emit(data, final)``, framing included, as it
        comes; ``final`` marks the last bytes, where the body's framing shows them."""
        kind, length = framing
        if kind == "length":
            await _relay_exact(src, length, piece, emit, final=True)
        elif kind == "chunked":
            while True:
                line = await src.readuntil(b"\r\n")
                size = _chunk_size(line)
                if size == 0:
                    if last is not None:
                        await last()
                    parts = [line]
                    while parts[-1] != b"\r\n":  # trailer fields, then the empty line
                        parts.append(await src.readuntil(b"\r\n"))
                    await emit(b"".join(parts), True)
                    return
                await emit(line, False)
                await _relay_exact(src, size + 2, piece, emit, final=False)  # data, CRLF
        elif kind == "close":
            while data := await src.read(piece):  # the end shows only after the last bytes
                await emit(data, False)


async def _relay_exact(src: _Stream, n: int, piece: int,
                       emit: Callable[[bytes, bool], Awaitable[None]], *, final: bool) -> None:
    while n > 0:
        data = await src.read(min(n, piece))
        if not data:
            raise asyncio.IncompleteReadError(b"", n)
        n -= len(data)
        await emit(data, final and n == 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m faultfs.testing.proxy",
        description="A loopback HTTP/1.1 proxy that adds a round-trip delay and a bandwidth "
                    "cap in front of a server (moto, or any HTTP/1.1 server).")
    parser.add_argument("--upstream", required=True, metavar="HOST:PORT")
    parser.add_argument("--delay-ms", type=float, default=20.0,
                        help="wait before each response's first byte (default 20)")
    parser.add_argument("--conn-mbps", type=float, default=100.0,
                        help="response MB/s per client connection, 0 = uncapped (default 100)")
    parser.add_argument("--total-mbps", type=float, default=None,
                        help="response MB/s of all connections together (default uncapped)")
    parser.add_argument("--listen-host", default="127.0.0.1")
    parser.add_argument("--listen-port", type=int, default=0, help="0 = a free port (default)")
    parser.add_argument("--max-connections", type=int, default=256)
    parser.add_argument("--idle-timeout-s", type=float, default=60.0)
    parser.add_argument("--lifetime-s", type=float, default=None,
                        help="stop after this many seconds (default: run until killed)")
    args = parser.parse_args(argv)
    host, sep, port = args.upstream.removeprefix("http://").rstrip("/").rpartition(":")
    if not sep or not port.isdigit():
        parser.error("--upstream must be HOST:PORT")

    def terminate(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # SIGTERM ends the run as Ctrl-C does: closed, summary printed

    signal.signal(signal.SIGTERM, terminate)
    proxy = LatencyProxy(host or "127.0.0.1", int(port), delay_ms=args.delay_ms,
                         conn_mbps=args.conn_mbps, total_mbps=args.total_mbps,
                         listen_host=args.listen_host, listen_port=args.listen_port,
                         max_connections=args.max_connections,
                         idle_timeout_s=args.idle_timeout_s, lifetime_s=args.lifetime_s)
    with proxy:
        print(proxy.url, flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            proxy.wait()
        s = proxy.stats(log=False)
    print(f"served {s['served']} of {s['requests']} requests, {s['response_bytes']} bytes down, "
          f"{s['request_bytes']} up, peak {s['peak_in_flight']} in flight", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
