"""``faultfs forget MNT/TAG``: unregister a tag of a live mount — its directory goes, its
registry entry and blobs are removed (kept with ``--keep-blobs``)."""

from __future__ import annotations

import argparse

from faultfs.control_client import request, split_tag_dir
from faultfs.core.units import format_size


def register(sub) -> None:
    f = sub.add_parser("forget", help="unregister MNT/TAG and remove its blobs")
    f.add_argument("tag_dir", metavar="MNT/TAG")
    f.add_argument("--keep-blobs", action="store_true",
                   help="keep the staged blobs (a later registration of the same source uses them)")
    f.add_argument("--discard-writes", action="store_true",
                   help="forget a tag that has writes, dropping them")
    f.add_argument("--debug", action="store_true")
    f.set_defaults(func=cmd_forget)


def cmd_forget(args: argparse.Namespace) -> int:
    root, tag = split_tag_dir(args.tag_dir)
    answer = request(root, {"op": "forget", "tag": tag, "keep_blobs": args.keep_blobs,
                            "discard_writes": args.discard_writes})
    kept = "blobs kept" if args.keep_blobs else f"{format_size(answer['freed_bytes'])} freed"
    print(f"forgot tag {tag} ({kept})")
    return 0
