"""``faultfs restart MNT``: replace the daemon of a mount with the installed code (an upgrade),
keeping the mount: readers and writers wait for the new daemon, none sees an error.

The mount's holder (fuse/holder.py) does it: it starts the new daemon, lets it load, asks the
old one to finish what it read and exit, then lets the new one take the connection over.
"""

from __future__ import annotations

import argparse
import errno

from faultfs.errors import FaultfsError, InvalidInput
from faultfs.fuse.connection import FSTYPE, find_mount, mount_path
from faultfs.fuse.daemons import run_dir
from faultfs.fuse.holder import ask

RESTART_TIMEOUT_S = 600.0  # the old daemon folds its writes, the new one recovers the store


def register(sub) -> None:
    r = sub.add_parser("restart", help="replace MNT's daemon with the installed code, keeping "
                                       "the mount")
    r.add_argument("mountpoint")
    r.add_argument("--debug", action="store_true")
    r.set_defaults(func=cmd_restart)


def cmd_restart(args: argparse.Namespace) -> int:
    path = mount_path(args.mountpoint)
    entry = find_mount(path)
    if entry is None:
        raise InvalidInput(f"{path} is not mounted", errno.EINVAL)
    if entry.fstype != FSTYPE:
        raise InvalidInput(f"{path} is a {entry.fstype} mount, not a faultfs one", errno.EINVAL)
    directory = run_dir()
    if directory is None:
        raise FaultfsError("no runtime directory ($XDG_RUNTIME_DIR) to find the mount's holder",
                           errno.ENOENT)
    try:
        answer = ask(directory, entry.minor, "restart", RESTART_TIMEOUT_S)
    except OSError as exc:
        raise FaultfsError(f"{path} has no holder (mounted with --no-holder, --foreground, or "
                           f"by an older faultfs): it cannot be restarted in place ({exc.strerror})",
                           errno.ENOTSUP) from None
    if not answer.get("ok"):
        raise FaultfsError(f"restarting the daemon of {path} failed: {answer.get('error')}",
                           errno.EIO)
    print(f"restarted the daemon of {path}: pid {answer['old_pid']} -> {answer['pid']} "
          f"(the mount waited {answer['waited_s']:.2f} s)")
    return 0
