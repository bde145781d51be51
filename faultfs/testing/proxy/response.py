"""One response on its way to the client, and the fault, if any, that is to break it there.

Invariants:
- A fault strikes once, where its rule says: before the head (``after_bytes`` None), once
  ``after_bytes`` of the body went out (a shorter body: at its end), or for ``truncate`` after
  half the body (a chunked body: before its last chunk). A reset ends the connection with an
  RST, a truncate with a FIN, a stall waits ``stall_s`` (None: until the client goes).
- The books are kept before each write (``send``'s ``handing``): once a send starts the client
  may see the bytes, and the stats must already hold them. A response is booked as ended just
  before its last bytes go, unless a fault is still due at its end.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

from faultfs.testing.proxy.faults import FaultRule
from faultfs.testing.proxy.stats import ProxyStats, RequestRecord


class Close(Exception):
    """End the client connection now, gracefully (FIN)."""


class Reset(Exception):
    """End the client connection now, abruptly (RST)."""


class Client(Protocol):
    """What a response needs of its client connection (``connection.Conn``)."""

    stats: ProxyStats

    async def send(self, data: bytes, handing: Callable[[], None]) -> None: ...

    async def wait_client_gone(self) -> None: ...


class Response:
    """One response on its way to the client, and the fault (if any) that is to break it."""

    __slots__ = ("armed", "conn", "halve_first", "rec", "rule", "sent", "trigger")

    def __init__(self, conn: Client, rec: RequestRecord, rule: FaultRule | None) -> None:
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
        self.conn.stats.fault_struck(self.rec, kind)
        if kind == "reset":
            raise Reset
        if kind == "truncate":
            raise Close
        if self.rule.stall_s is None:
            await self.conn.wait_client_gone()
            raise Close
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
                self.conn.stats.finish(rec)

        await self.conn.send(data, handing)
