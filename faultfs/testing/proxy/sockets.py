"""One socket of the proxy: a receive buffer the kernel reads into, and flow-controlled writes.

Invariants:
- Bytes are handed on as they arrived: a read takes what the buffer holds, never more than
  asked; a head or chunk-size line longer than ``HEAD_LIMIT`` is refused.
- A slow reader holds less than ``PAUSE_AT`` (< 1 MiB) in its buffer: reading the socket
  pauses above it and resumes below ``RESUME_AT``; a write waits (``drain``) while the
  transport holds more than ``WRITE_HIGH``, so pacing is measured at the socket.
- Every open socket is in its proxy's set of sockets from ``connection_made`` to
  ``connection_lost``, so that the proxy can abort it, stalled or idle.
- All of it runs on the proxy's loop thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import mmap
import socket
import struct
import termios
import time
from collections.abc import Callable

HEAD_LIMIT = 64 << 10  # longest head or chunk-size line accepted; S3 heads are a few KB
RECV_BUFFER = 1 << 20  # each socket's receive buffer, mapped once: the kernel reads into it
PAUSE_AT = 768 << 10  # stop reading a socket once this much waits in its buffer...
RESUME_AT = 256 << 10  # ...and read it again below this, so a slow reader holds < 1 MiB
RECV_ROOM = 256 << 10  # below this much free tail, held bytes move to the buffer's front first
WRITE_HIGH = 1 << 20  # client transport buffer above which a send waits: about one piece, so
# pacing is measured at the socket and not in a queue in front of it
FLUSH_TIMEOUT_S = 1.0  # before a reset, longest wait for the kernel to deliver what was sent (a
# client that stopped reading must not hold a reset back)
FLUSH_POLL_S = 0.001  # how often that wait looks at the socket's send queue


def unsent(sock: socket.socket) -> int:
    """Bytes the kernel still holds for the peer (sent but not acknowledged, or not sent)."""
    try:
        raw = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    except OSError:
        return 0
    return struct.unpack("i", raw)[0]


def wake(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


class Stream(asyncio.BufferedProtocol):
    """One socket: a receive buffer the kernel reads into, and flow-controlled writes.

    The buffer is one anonymous mapping, made once: its pages become resident as they are
    first used, so a connection that only carries small requests costs little. asyncio's
    ``StreamReader`` instead grows and shrinks a bytearray that, once read from the front, is
    copied into a fresh allocation on every receive; at 1 MiB and more that is a new mapping
    whose pages fault in afresh each time, which took a third of the proxy's time at 500 MB/s.

    One task reads a stream at a time, and one writes it; they may differ (a request body goes
    up while the response head is awaited).
    """

    def __init__(self, sockets: set[Stream],
                 accept: Callable[[Stream], None] | None = None) -> None:
        """``sockets``: the proxy's open sockets, this one among them while it is open;
        ``accept``: called once the socket is open (for a client socket the proxy accepted)."""
        self.sockets = sockets
        self.accept = accept
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
        self.sockets.add(self)
        if self.accept is not None:
            self.accept(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = self.eof = True
        self.sockets.discard(self)
        wake(self.read_waiter)
        wake(self.drain_waiter)

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
        wake(self.read_waiter)

    def eof_received(self) -> bool:
        self.eof = True
        wake(self.read_waiter)
        return True  # a half-closed client may still read its answer; we close the socket

    def pause_writing(self) -> None:
        self.writing_paused = True

    def resume_writing(self) -> None:
        self.writing_paused = False
        wake(self.drain_waiter)

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
            pending = transport.get_write_buffer_size() or (sock is not None and unsent(sock))
            if not pending or self.lost:
                break
            await asyncio.sleep(FLUSH_POLL_S)
        if sock is not None and not self.lost:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        transport.abort()
