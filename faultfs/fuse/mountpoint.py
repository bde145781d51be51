"""Mountpoints: check one before mounting, detach a dead mount, unmount and wait for the
daemon, read a live mount's counters. No pyfuse3 here: the CLI uses it without serving.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess
import time

from faultfs.core.names import CTL_NAME
from faultfs.errors import FaultfsError, InvalidInput

log = logging.getLogger("faultfs.mount")

UNMOUNT_WAIT_S = 120.0  # how long `faultfs umount` waits for the daemon (it folds writes)


def is_dead_mount(path: str) -> bool:
    """True when ``path`` is a FUSE mount whose daemon is gone (ENOTCONN)."""
    try:
        os.statvfs(path)  # never answered from the kernel's attribute cache
    except OSError as exc:
        return exc.errno in (errno.ENOTCONN, errno.ECONNABORTED)
    return False


def lazy_unmount(path: str) -> None:
    """Detach a (dead) FUSE mount at ``path``."""
    for cmd in (["fusermount3", "-u", "-z", path], ["umount", "-l", path]):
        if shutil.which(cmd[0]) is None:
            continue
        if subprocess.run(cmd, capture_output=True).returncode == 0:
            return
    raise FaultfsError(f"cannot detach the dead mount at {path}", errno.EBUSY)


def prepare_mountpoint(path: str) -> str:
    """Return the absolute mountpoint after cleaning a dead mount there; refuse anything
    but an existing empty directory that is not already mounted."""
    path = os.path.abspath(path)
    if is_dead_mount(path):
        log.warning("cleaning the dead mount at %s (its daemon is gone)", path)
        lazy_unmount(path)
    if not os.path.exists(path):
        raise InvalidInput(f"mountpoint {path} does not exist", errno.ENOENT)
    if not os.path.isdir(path):
        raise InvalidInput(f"mountpoint {path} is not a directory", errno.ENOTDIR)
    if os.path.ismount(path):
        raise InvalidInput(f"mountpoint {path} is already mounted", errno.EBUSY)
    if os.listdir(path):
        raise InvalidInput(f"mountpoint {path} is not empty", errno.ENOTEMPTY)
    return path


def read_stats(mountpoint: str) -> dict:
    """The JSON counters of a running mount."""
    path = os.path.join(os.path.abspath(mountpoint), CTL_NAME, "stats")
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except FileNotFoundError:
        raise InvalidInput(f"{mountpoint} is not a faultfs mount", errno.EINVAL) from None
    except OSError as exc:
        if exc.errno in (errno.ENOTCONN, errno.ECONNABORTED):
            raise FaultfsError(f"the faultfs daemon of {mountpoint} is gone (dead mount); "
                               f"`faultfs umount {mountpoint}` cleans it", exc.errno) from None
        raise FaultfsError(f"cannot read stats of {mountpoint}: {exc.strerror}", exc.errno or errno.EIO) from None


def unmount(mountpoint: str, *, wait: float = UNMOUNT_WAIT_S) -> None:
    """Unmount ``mountpoint`` and wait for its daemon to exit (so the store is free)."""
    path = os.path.abspath(mountpoint)
    if is_dead_mount(path):
        lazy_unmount(path)
        return
    if not os.path.ismount(path):
        raise InvalidInput(f"{path} is not mounted", errno.EINVAL)
    pid = None
    try:
        pid = int(read_stats(path).get("pid"))
    except (FaultfsError, TypeError, ValueError):
        pid = None
    result = subprocess.run(["fusermount3", "-u", path], capture_output=True, text=True)
    if result.returncode != 0:
        reason = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "unknown error"
        if "busy" in reason.lower():
            raise FaultfsError(f"{path} is busy: close the files open under it first", errno.EBUSY)
        raise FaultfsError(f"unmounting {path} failed: {reason}", errno.EIO)
    if pid is None or pid == os.getpid():
        return
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        if _is_zombie(pid):
            return
        time.sleep(0.05)
    raise FaultfsError(f"the daemon (pid {pid}) of {path} did not exit within {wait:.0f} s",
                       errno.ETIMEDOUT)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().split(b")")[-1].split()[0] == b"Z"
    except OSError:
        return True
