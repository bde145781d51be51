"""Human sizes: '4M', '1MiB', '512k', '1048576' -> bytes; bytes -> '1.0 MiB'."""

from __future__ import annotations

from faultfs.errors import InvalidInput

_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10,
    "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
    "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30,
    "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40,
}


def parse_size(text: str, what: str = "size") -> int:
    """Bytes named by ``text``: an integer with an optional binary unit (k, M, G, T, KiB...).

    Units are powers of 1024 whatever their spelling: a chunk of '4M' is 4 MiB, as users of
    dd and rclone expect."""
    raw = str(text).strip()
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    unit = raw[len(number):].lower()
    if unit not in _UNITS or not number:
        raise InvalidInput(f"{what} {text!r} is not a size (try 1048576, 4M or 1MiB)")
    try:
        value = int(number)
    except ValueError:
        raise InvalidInput(f"{what} {text!r} is not a size (try 1048576, 4M or 1MiB)") from None
    if value < 0:
        raise InvalidInput(f"{what} {text!r} is negative")
    return value * _UNITS[unit]


def format_size(n: float) -> str:
    """``n`` bytes as a short binary-unit string."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
