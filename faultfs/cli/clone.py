"""``faultfs clone MNT/TAG NEW``: a lazy, point-in-time copy of a tag (DESIGN §12)."""

from __future__ import annotations

import argparse

from faultfs.control_client import request, split_tag_dir


def register(sub) -> None:
    c = sub.add_parser("clone", help="make tag NEW a point-in-time copy of MNT/TAG")
    c.add_argument("tag_dir", metavar="MNT/TAG")
    c.add_argument("new", metavar="NEW")
    c.add_argument("--debug", action="store_true")
    c.set_defaults(func=cmd_clone)


def cmd_clone(args: argparse.Namespace) -> int:
    root, tag = split_tag_dir(args.tag_dir)
    answer = request(root, {"op": "clone", "tag": tag, "new": args.new})
    print(f"cloned {tag} as {answer['tag']}")
    return 0
