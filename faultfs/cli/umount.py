"""``faultfs umount MNT``: unmount and wait for the daemon, so its store is free; a daemon
that does not answer is ended (``fuse.mountpoint.recover``), and the user told so."""

from __future__ import annotations

import argparse
import sys

from faultfs.fuse.mountpoint import unmount


def register(sub) -> None:
    u = sub.add_parser("umount", help="unmount MNT and wait for its daemon")
    u.add_argument("mountpoint")
    u.add_argument("--debug", action="store_true")
    u.set_defaults(func=cmd_umount)


def cmd_umount(args: argparse.Namespace) -> int:
    note = unmount(args.mountpoint)
    if note:
        print(f"faultfs: {note}", file=sys.stderr)
    return 0
