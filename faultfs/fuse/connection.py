"""A FUSE mount seen from outside, without waiting on its daemon: which connection a
mountpoint is (``/proc/self/mountinfo``), whether its daemon answers (a probe in a child
process, bounded in time), and aborting the connection (fusectl).

Invariants:
- Nothing here makes a request to the mount from this process: a request to a daemon that
  does not answer cannot be taken back (a fatal signal does not end it once the daemon has
  read it), so only a child process asks, and this process never waits on it unbounded.
- An abort ends every request of the connection at once (ECONNABORTED) and every later one;
  the daemon's reads of its device fail, so a daemon that runs exits by itself.
"""

from __future__ import annotations

import errno
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass

from faultfs.errors import FaultfsError

FSTYPE = "fuse.faultfs"  # a faultfs mount's type in mountinfo (subtype=faultfs)
CONNECTIONS = "/sys/fs/fuse/connections"  # fusectl: <minor of st_dev>/abort per connection
# A daemon that has not answered a lookup in this long does not answer: a healthy one answers
# it on its serving thread, without I/O, in well under a millisecond (a few under load)
PROBE_S = 5.0
COMMAND_S = 30.0  # a mount or unmount command that has not returned in this long is stuck
ANSWERS, GONE, SILENT = "answers", "gone", "silent"

# The probe: a lookup of a name nobody has (never in the kernel's caches, so the daemon is
# asked; it answers on its serving thread without I/O); or a read of the daemon's stats, for
# its pid (that one may wait behind the daemon's I/O).
_PROBE = r"""
import errno, json, os, sys
root, ask = sys.argv[1], sys.argv[2]
if ask == "lookup":
    try:
        os.lstat(os.path.join(root, ".faultfs", ".probe-%d" % os.getpid()))
    except OSError as exc:
        if exc.errno in (errno.ENOTCONN, errno.ECONNABORTED):
            print("gone")
            sys.exit()
    print("answers")
else:
    try:
        with open(os.path.join(root, ".faultfs", "stats"), "rb") as f:
            pid = json.loads(f.read()).get("pid")
    except (OSError, ValueError):
        pid = None
    print(pid if isinstance(pid, int) else "")
"""

_stuck: list[subprocess.Popen] = []  # probes and commands still waiting on a silent mount


@dataclass(frozen=True)
class MountEntry:
    """One line of mountinfo: where, which device (a FUSE mount's minor is its connection)
    and of which type."""

    mountpoint: str
    minor: int
    fstype: str


def mount_path(path: str) -> str:
    """``path`` absolute, its directory resolved, without a look at ``path`` itself (a look
    at a mount's root may wait on its daemon)."""
    path = os.path.abspath(path)
    head, tail = os.path.split(path)
    return os.path.join(os.path.realpath(head), tail) if tail else path


def mounts() -> list[MountEntry]:
    """The mounts of this process's namespace, in mount order."""
    out = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split()
            try:
                dash = fields.index("-", 6)
                minor = int(fields[2].split(":")[1])
            except (ValueError, IndexError):
                continue
            out.append(MountEntry(_unescape(fields[4]), minor, fields[dash + 1]))
    return out


def find_mount(path: str) -> MountEntry | None:
    """The topmost mount at ``path`` (made by ``mount_path``), or None."""
    found = None
    for entry in mounts():
        if entry.mountpoint == path:
            found = entry
    return found


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def probe(path: str, timeout: float = PROBE_S) -> str:
    """ANSWERS when the daemon of the mount at ``path`` answers within ``timeout`` seconds,
    GONE when it is gone (ENOTCONN: a dead mount), else SILENT."""
    out = _ask(path, "lookup", timeout)
    if out is None:
        return SILENT
    if out not in (ANSWERS, GONE):  # the probe itself failed (it cannot start a process?)
        raise FaultfsError(f"cannot tell whether the daemon of {path} answers", errno.EIO)
    return out


def stats_pid(path: str, timeout: float = PROBE_S) -> int | None:
    """The pid in the stats of the mount at ``path``; None when they do not say it in time."""
    out = _ask(path, "pid", timeout)
    return int(out) if out and out.isdigit() else None


def _ask(path: str, ask: str, timeout: float) -> str | None:
    proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _PROBE, path, ask],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stuck.append(proc)  # waited for after an abort, or left to end with the mount
        return None
    return out.strip()


def run_bounded(cmd: list[str], timeout: float = COMMAND_S
                ) -> subprocess.CompletedProcess[str] | None:
    """Run ``cmd``; None when it has not returned within ``timeout`` (it is left running:
    a command waiting on a silent mount may not end before the mount is aborted)."""
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stuck.append(proc)
        return None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def ensure_fusectl() -> None:
    """fusectl mounted at ``CONNECTIONS`` (where a connection is aborted and tuned), mounting
    it when it is not; FaultfsError when that fails."""
    if any(e.fstype == "fusectl" and e.mountpoint == CONNECTIONS for e in mounts()):
        return
    done = run_bounded(["mount", "-t", "fusectl", "fusectl", CONNECTIONS])
    if done is None or done.returncode != 0:
        why = "it did not return" if done is None else done.stderr.strip() or "failed"
        raise FaultfsError(f"{CONNECTIONS} is not mounted, and mounting it failed ({why})",
                           errno.EPERM)


def abort(minor: int) -> None:
    """Abort FUSE connection ``minor`` (mounting fusectl first when it is not mounted)."""
    try:
        ensure_fusectl()
    except FaultfsError as exc:
        raise FaultfsError(f"cannot abort FUSE connection {minor}: {exc}", exc.errno) from None
    path = os.path.join(CONNECTIONS, str(minor), "abort")
    try:
        with open(path, "w") as f:
            f.write("1")
    except FileNotFoundError:
        return  # the connection is gone already
    except OSError as exc:
        raise FaultfsError(f"cannot abort FUSE connection {minor} ({path}): {exc.strerror}",
                           exc.errno or errno.EIO) from None
    _reap_stuck()


def _reap_stuck(timeout: float = 5.0) -> None:
    """Wait (bounded) for the probes and commands an abort has let go."""
    deadline = time.monotonic() + timeout
    for proc in list(_stuck):
        try:
            proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            continue
        _stuck.remove(proc)
