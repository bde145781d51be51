"""HTTP/1.1 framing: where each message ends, and relaying one body as it comes.

Invariants:
- Heads are parsed only to find where each message ends (Content-Length, chunked, or until
  close; no body after HEAD, 1xx, 204 and 304) and are never rewritten, Host included, so
  request signatures stay valid. No upgrades, no CONNECT.
- Bodies are relayed verbatim, their framing included (chunk-size lines, trailers), in pieces
  as they arrive; ``final`` marks the last bytes where the framing shows them.
- Anything malformed is a ValueError (a body cut short, IncompleteReadError): the connection
  ends there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from faultfs.testing.proxy.sockets import Stream

NONE = ("none", 0)
CHUNKED = ("chunked", 0)
UNTIL_CLOSE = ("close", 0)


def parse_head(raw: bytes) -> tuple[str, dict[str, list[str]]]:
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


def keep_alive(version: str, headers: dict[str, list[str]]) -> bool:
    tokens = _tokens(headers, "connection")
    if "close" in tokens:
        return False
    return version == "HTTP/1.1" or "keep-alive" in tokens


def request_framing(headers: dict[str, list[str]]) -> tuple[str, int]:
    codings = _tokens(headers, "transfer-encoding")
    if codings:
        if codings[-1] != "chunked":
            raise ValueError("a request body must end with the chunked coding")
        return CHUNKED
    length = _content_length(headers)
    return ("length", length) if length else NONE


def response_framing(method: str, status: int, headers: dict[str, list[str]]) -> tuple[str, int]:
    if status == 101:
        return UNTIL_CLOSE
    if method == "HEAD" or status < 200 or status in (204, 304):
        return NONE
    codings = _tokens(headers, "transfer-encoding")
    if codings:
        return CHUNKED if codings[-1] == "chunked" else UNTIL_CLOSE
    length = _content_length(headers)
    return UNTIL_CLOSE if length is None else ("length", length)


def _chunk_size(line: bytes) -> int:
    size = int(line.split(b";", 1)[0].strip(), 16)
    if size < 0:
        raise ValueError(f"bad chunk size line {line!r}")
    return size


async def relay_body(src: Stream, framing: tuple[str, int], piece: int,
                     emit: Callable[[bytes, bool], Awaitable[None]],
                     last: Callable[[], Awaitable[None]] | None = None) -> None:
    """Pass one message body from ``src`` to ``emit(data, final)``, framing included, as it
    comes; ``final`` marks the last bytes, where the body's framing shows them."""
    kind, length = framing
    if kind == "length":
        await relay_exact(src, length, piece, emit, final=True)
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
            await relay_exact(src, size + 2, piece, emit, final=False)  # data, CRLF
    elif kind == "close":
        while data := await src.read(piece):  # the end shows only after the last bytes
            await emit(data, False)


async def relay_exact(src: Stream, n: int, piece: int,
                      emit: Callable[[bytes, bool], Awaitable[None]], *, final: bool) -> None:
    while n > 0:
        data = await src.read(min(n, piece))
        if not data:
            raise asyncio.IncompleteReadError(b"", n)
        n -= len(data)
        await emit(data, final and n == 0)
