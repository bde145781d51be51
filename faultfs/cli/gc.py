"""``faultfs gc STORE [--dry-run]``: free what no mount of a store can use — blobs of tags no
longer registered, blobs of old source versions, temp files (``faultfs.store.gc``) — and say
how much. Dirty data is never touched.

Exit status: 0 done, 2 could not run (not a store, a live mount owns it, an I/O error).
"""

from __future__ import annotations

import argparse
import sys
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
    g.add_argument("store", metavar="STORE", nargs="?")
    g.add_argument("--shared-store", metavar="URL",
                   help="also (or only) remove stray claims from this shared store: claims "
                        "past their deadline by a minute, and objects among them that are "
                        "not claims (live claims are kept)")
    g.add_argument("--shared-store-endpoint-url", metavar="URL",
                   help="the shared store's S3 endpoint")
    g.add_argument("--dry-run", action="store_true", help="say what would be freed, remove nothing")
    g.add_argument("-v", "--verbose", action="store_true", help="one line per file freed")
    g.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    g.add_argument("--debug", action="store_true")
    g.set_defaults(func=cmd_gc)


def cmd_gc(args: argparse.Namespace) -> int:
    if args.store is None and not args.shared_store:
        print("faultfs gc: give a STORE, a --shared-store URL, or both", file=sys.stderr)
        return 2
    if args.shared_store:
        status = _gc_claims(args)
        if status or args.store is None:
            return status
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


def _gc_claims(args: argparse.Namespace) -> int:
    """Remove stray claims from the shared store (DESIGN §17)."""
    from faultfs.sources import SourceOptions
    from faultfs.tiers.claimboard import sweep
    from faultfs.tiers.claims import claim_store
    from faultfs.tiers.objects import open_objects

    try:
        objects = open_objects(args.shared_store, SourceOptions(),
                               endpoint_url=args.shared_store_endpoint_url or "")
        store = claim_store(objects)
        if store is None:
            print(f"gc {objects.url}: this kind of store has no claims")
            return 0
        removed = sweep(store, dry_run=args.dry_run)
    except (FaultfsError, OSError) as exc:
        if args.debug:
            traceback.print_exc()
        print(f"faultfs gc: shared store {args.shared_store}: {exc}", file=sys.stderr)
        return 2
    verb = "would remove" if args.dry_run else "removed"
    print(f"gc {objects.url}: {verb} {len(removed)} stray claims (a dead holder's claim over "
          "published blobs is kept as its window's marker, the index of what is published)")
    if args.verbose:
        for key in removed:
            print(f"  {key}")
    return 0
