"""A one-line progress bar on a text stream: bytes done of a total, percent, rate, ETA, and a
note of the caller's (``faultfs warm``, ``faultfs export``)."""

from __future__ import annotations

import time
from typing import TextIO

from faultfs.core.units import format_size

INTERVAL_S = 0.2  # seconds between redraws


def clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02}:{s % 60:02}"


class ProgressBar:
    WIDTH = 24

    def __init__(self, out: TextIO, label: str, total_bytes: int) -> None:
        self._out = out
        self._label = label
        self._total = total_bytes
        self._start = time.monotonic()
        self._last = 0.0
        isatty = getattr(out, "isatty", None)
        self._tty = bool(isatty and isatty())  # a log or a pipe gets the final line only

    def line(self, done: int, note: str = "") -> str:
        elapsed = max(time.monotonic() - self._start, 1e-9)
        rate = done / elapsed
        frac = done / self._total if self._total else 1.0
        eta = (self._total - done) / rate if rate > 0 else None
        filled = round(self.WIDTH * min(frac, 1.0))
        return (f"{self._label} [{'#' * filled}{'.' * (self.WIDTH - filled)}] {frac:4.0%} "
                f"{format_size(done)}/{format_size(self._total)} {format_size(rate)}/s "
                f"ETA {clock(eta) if eta is not None else '?:??:??'}"
                + (f" {note}" if note else ""))

    def update(self, done: int, note: str = "", *, force: bool = False) -> None:
        now = time.monotonic()
        if self._tty and (force or now - self._last >= INTERVAL_S):
            self._last = now
            self._out.write("\r" + self.line(done, note) + "\x1b[K")
            self._out.flush()

    def finish(self, done: int, note: str = "") -> None:
        if self._tty:
            self.update(done, note, force=True)
        else:
            self._out.write(self.line(done, note))
        self._out.write("\n")
        self._out.flush()
