"""The kernel's knobs of a mount's FUSE connection, set by the daemon once the mount answers.

Invariants:
- Only sysfs files are written (``/sys/class/bdi/0:MINOR``, ``/sys/fs/fuse/connections/MINOR``),
  found from the mount's minor in mountinfo: a stat of the mount would be a request to this
  daemon, made from its own process.
- A knob that cannot be set (not root, no fusectl) keeps the kernel's default and logs one
  line: a mount never fails for it.
- The settings belong to the connection, not to the daemon: a daemon that takes the mount
  over (fuse/holder.py) finds them in place and writes the same values again.
"""

from __future__ import annotations

import logging

log = logging.getLogger("faultfs.mount")

FUSECTL = "/sys/fs/fuse/connections"
# the kernel marks the connection congested (readahead backs off) at this share of
# max_background: its own defaults are 9 of 12
CONGESTION_SHARE = 0.75


def set_readahead(mountpoint: str, minor: int, kb: int) -> bool:
    """Raise the kernel's readahead for this mount (root only): with the default 128 KiB
    the kernel sends 128 KiB requests one or two at a time; 1 MiB+ lets it send 1 MiB
    requests (FUSE's largest) several at once."""
    return _write(mountpoint, f"/sys/class/bdi/0:{minor}/read_ahead_kb", kb, "readahead")


def set_max_background(mountpoint: str, minor: int, count: int) -> bool:
    """Let the kernel keep ``count`` background requests (readahead, async reads) in flight
    on this connection instead of 12, and call it congested at 3/4 of that (root only).
    With 12, two readers' 4 MiB readaheads of 1 MiB requests already queue in the kernel
    while the daemon's workers and GETs wait for work."""
    congestion = max(1, int(count * CONGESTION_SHARE))
    return (_write(mountpoint, f"{FUSECTL}/{minor}/max_background", count, "max_background")
            and _write(mountpoint, f"{FUSECTL}/{minor}/congestion_threshold", congestion,
                       "congestion_threshold"))


def connection_limits(minor: int) -> dict[str, int]:
    """The connection's max_background and congestion_threshold ({} when unreadable)."""
    out = {}
    for name in ("max_background", "congestion_threshold"):
        try:
            with open(f"{FUSECTL}/{minor}/{name}") as f:
                out[name] = int(f.read())
        except (OSError, ValueError):
            return {}
    return out


def _write(mountpoint: str, path: str, value: int, what: str) -> bool:
    try:
        with open(path, "w") as f:
            f.write(str(value))
    except OSError as exc:
        log.info("cannot set %s of %s (%s: %s): keeping the kernel default", what, mountpoint,
                 path, exc.strerror)
        return False
    return True
