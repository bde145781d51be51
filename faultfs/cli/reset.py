"""``faultfs reset MNT/TAG [BLOB...]``: drop a tag's writes (or some blobs'): back to the
source's bytes."""

from __future__ import annotations

import argparse

from faultfs.control_client import request, split_tag_dir


def register(sub) -> None:
    r = sub.add_parser("reset", help="drop the writes of MNT/TAG (or of some of its blobs)")
    r.add_argument("tag_dir", metavar="MNT/TAG")
    r.add_argument("blobs", nargs="*", metavar="BLOB", help="only these blobs (chunks, user blobs)")
    r.add_argument("--debug", action="store_true")
    r.set_defaults(func=cmd_reset)


def cmd_reset(args: argparse.Namespace) -> int:
    root, tag = split_tag_dir(args.tag_dir)
    req = {"op": "reset", "tag": tag}
    if args.blobs:
        req["blobs"] = args.blobs
    answer = request(root, req)
    print(f"reset tag {tag}: {answer['dropped']} dirty blob(s) dropped")
    return 0
