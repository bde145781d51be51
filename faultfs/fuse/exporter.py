"""``--metrics-addr HOST:PORT``: the mount's metrics over HTTP (GET /metrics, the Prometheus
text format), served from the mount's trio loop beside FUSE.

Invariants: the listener is bound before the mount reports ready (a taken port refuses the
mount with one line); a request is answered from one snapshot and the connection closed; a
client gets ``REQUEST_TIMEOUT_S`` to send its request head of at most ``MAX_HEAD`` bytes.
Loopback unless an address is given.
"""

from __future__ import annotations

import errno
import logging

import trio

from faultfs import metrics
from faultfs.engine import Engine
from faultfs.errors import FaultfsError, InvalidInput

log = logging.getLogger("faultfs.metrics")

MAX_HEAD = 8192
REQUEST_TIMEOUT_S = 10.0


def parse_addr(addr: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``PORT`` (loopback); InvalidInput when it is neither."""
    host, sep, port = addr.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", addr
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidInput(f"--metrics-addr {addr!r} is not HOST:PORT")
    return host, int(port)


async def open_listeners(addr: str) -> list[trio.SocketListener]:
    host, port = parse_addr(addr)
    try:
        return await trio.open_tcp_listeners(port, host=host)
    except OSError as exc:
        raise FaultfsError(f"--metrics-addr {addr}: cannot listen ({exc.strerror})",
                           exc.errno or errno.EADDRINUSE) from None


async def serve_metrics(engine: Engine, listeners: list[trio.SocketListener]) -> None:
    async def answer(stream: trio.SocketStream) -> None:
        try:
            with trio.move_on_after(REQUEST_TIMEOUT_S):
                head = b""
                while b"\r\n\r\n" not in head and len(head) < MAX_HEAD:
                    data = await stream.receive_some(MAX_HEAD)
                    if not data:
                        return
                    head += data
                request = head.split(b"\r\n", 1)[0].split()
                if len(request) < 2 or request[0] not in (b"GET", b"HEAD"):
                    await _reply(stream, 405, b"only GET\n", "text/plain")
                elif request[1].split(b"?")[0] not in (b"/metrics", b"/"):
                    await _reply(stream, 404, b"see /metrics\n", "text/plain")
                else:
                    body = metrics.render(await engine.snapshot()).encode()
                    await _reply(stream, 200, body if request[0] == b"GET" else b"",
                                 metrics.CONTENT_TYPE, length=len(body))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except Exception:  # a scrape must never take the mount down
            log.exception("answering a metrics request failed")
        finally:
            await stream.aclose()

    await trio.serve_listeners(answer, listeners)


async def _reply(stream: trio.SocketStream, status: int, body: bytes, content_type: str,
                 length: int | None = None) -> None:
    reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed"}[status]
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body) if length is None else length}\r\n"
            "Connection: close\r\n\r\n").encode()
    await stream.send_all(head + body)
