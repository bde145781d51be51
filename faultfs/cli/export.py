"""``faultfs export MNT/TAG DEST``: a tag's current bytes as one file (``faultfs.export``)."""

from __future__ import annotations

import argparse

from faultfs.export import export


def register(sub) -> None:
    e = sub.add_parser("export", help="write MNT/TAG's current bytes to a path or fsspec URL")
    e.add_argument("tag_dir", metavar="MNT/TAG")
    e.add_argument("dest", metavar="DEST", help="a local path or an s3:// URL (both resumable), or any fsspec URL")
    e.add_argument("--force", action="store_true", help="replace an existing DEST")
    e.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    e.add_argument("--debug", action="store_true")
    e.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    report = export(args.tag_dir, args.dest, force=args.force, progress=not args.no_progress)
    resumed = f", resumed at {report.resumed_from} bytes" if report.resumed_from else ""
    print(f"exported {report.size} bytes to {report.dest} in {report.seconds:.1f}s{resumed}")
    return 0
