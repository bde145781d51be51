"""The proxy's books: the counters of the current window and the log of finished requests.

Invariants:
- The books change on the loop thread and are read from any thread, all under one lock.
- A window runs from the proxy's start or the last ``reset``; requests in flight at a reset
  are booked (served, logged) in the new window when they end, and the new window's peak
  starts at what is in flight.
- Every request is booked as begun once, when its head arrives, and as ended once
  (``finish``): just before its last bytes go, or as it fails. The in-flight count is
  integrated over time, for ``avg_in_flight``.
- The log keeps the last ``LOG_LENGTH`` finished requests.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from dataclasses import dataclass, field, fields

from faultfs.testing.proxy.faults import FAULT_KINDS

LOG_LENGTH = 10_000  # per-request records kept: a benchmark run's worth, a few MB at most


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


class ProxyStats:
    """The books of one proxy."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards the books, read from other threads
        now = time.monotonic()
        self._window = _Window(start=now, since=now)
        self._in_flight = 0
        self._connections = 0
        self._log: collections.deque[RequestRecord] = collections.deque(maxlen=LOG_LENGTH)
        self._request_numbers = itertools.count(1)

    def snapshot(self, *, log: bool = True) -> dict:
        """Counters of the current window and, with ``log``, the records of its last
        ``LOG_LENGTH`` finished requests, oldest first, as dicts."""
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

    def reset(self) -> None:
        """Start a new window: counters at zero, the log emptied, the peak at what is in flight.
        Requests in flight now are booked (served, logged) in the new window when they end."""
        with self._lock:
            now = time.monotonic()
            self._window = _Window(start=now, since=now, peak_in_flight=self._in_flight)
            self._log.clear()

    def admit(self, max_connections: int) -> bool:
        """Book a connection the proxy accepted: True if it is under ``max_connections`` and
        counted open, False if it is to be closed at once (counted refused)."""
        with self._lock:
            refuse = self._connections >= max_connections
            if refuse:
                self._window.refused_connections += 1
            else:
                self._connections += 1
                self._window.connections += 1
        return not refuse

    def closed(self) -> None:
        """Book the end of a connection ``admit`` counted open."""
        with self._lock:
            self._connections -= 1

    def begin(self, connection: int, request_bytes: int) -> RequestRecord:
        """Book a request whose head (``request_bytes`` long) arrived: its record, in flight."""
        rec = RequestRecord(n=next(self._request_numbers), connection=connection,
                            start=time.monotonic(), request_bytes=request_bytes)
        with self._lock:
            self._window.requests += 1
            self._window.request_bytes += request_bytes
            self._in_flight_by(+1)
        return rec

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self._window, name, getattr(self._window, name) + n)

    def fault_struck(self, rec: RequestRecord, kind: str) -> None:
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

    def finish(self, rec: RequestRecord) -> None:
        """Book a request as ended (once): just before its last bytes go, or as it fails."""
        if rec.end is not None:
            return
        rec.end = time.monotonic()
        with self._lock:
            self._in_flight_by(-1)
            self._window.served += rec.complete
            self._log.append(rec)
