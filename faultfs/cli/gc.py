"""``faultfs gc STORE [--dry-run]``: free what no mount of a store can use — blobs of tags no
longer registered, blobs of old source versions, temp files (``faultfs.store.gc``) — and say
how much. Dirty data is never touched.

Exit status: 0 done, 2 could not run (not a store, a live mount owns it, an I/O error).
"""

from __future__ import annotations

import argparse
import traceback

from faultfs.cli.fsck import WalkProgress, failed
from faultfs.core.units import format_size
from faultfs.errors import FaultfsError
from faultfs.store.fsck import Finding, check_store_root
from faultfs.store.gc import KINDS, gc, kind_of


def register(sub) -> None:
    g = sub.add_parser(
        "gc", help="free space in a store that is not mounted (unregistered tags, old "
                   "versions, temp files)",
        description="Remove the blobs of tags no longer registered, blobs staged from old "
                    "source versions and temp files of interrupted writes from STORE, which no "
                    "live mount may own. Dirty data is never touched.")
    g.add_argument("store", metavar="STORE")
    g.add_argument("--dry-run", action="store_true", help="say what would be freed, remove nothing")
    g.add_argument("-v", "--verbose", action="store_true", help="one line per file freed")
    g.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    g.add_argument("--debug", action="store_true")
    g.set_defaults(func=cmd_gc)


def cmd_gc(args: argparse.Namespace) -> int:
    progress: WalkProgress | None = None
    try:
        root = check_store_root(args.store)
        progress = WalkProgress(root, "gc", enabled=not args.no_progress)

        def seen(finding: Finding) -> None:
            assert progress is not None
            progress.advance(finding.size)
            if args.verbose and kind_of(finding) is not None:
                progress.clear()
                print(finding.describe(root), flush=True)

        report = gc(root, dry_run=args.dry_run, on_finding=seen)
    except (FaultfsError, OSError) as exc:
        if progress is not None:
            progress.clear()
        if args.debug:
            traceback.print_exc()
        return failed("gc", exc, as_json=False, store=args.store)
    progress.finish()
    verb = "would free" if args.dry_run else "freed"
    print(f"gc {root}: {verb} {report.files} files, {format_size(report.bytes)}")
    for kind in KINDS:
        count, size = report.freed[kind]
        print(f"{count:>10}  {format_size(size):>10}  {kind}")
    if report.damaged:
        print(f"{report.damaged} damaged files left alone: `faultfs fsck --repair {root}` "
              "judges them")
    return 0
