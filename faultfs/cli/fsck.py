"""``faultfs fsck STORE [--repair] [--json]``: verify every file of a store no mount owns
(``faultfs.store.fsck``), print one line per problem and a summary table.

Exit status: 0 clean, 1 problems found (also when ``--repair`` fixed them), 2 could not run
(not a store, a live mount owns it, an I/O error): one line on stderr. What a crash leaves
and the next mount clears (a torn journal tail, an unanswered write's file, temp files) is
listed as ``leftover`` and is no problem.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback

from faultfs.core.units import format_size
from faultfs.errors import FaultfsError
from faultfs.progress import ProgressBar
from faultfs.store.fsck import (
    AREAS,
    LEFTOVER,
    Finding,
    FsckReport,
    check_store_root,
    fsck,
    measure,
)

EXIT_CLEAN, EXIT_PROBLEMS, EXIT_CANNOT = 0, 1, 2
MAX_JSON_PROBLEMS = 10_000  # --json lists this many problems (memory stays flat), counts the rest
PROGRESS_MIN_FILES = 1000  # a bar on smaller stores would only flash
PROGRESS_MIN_BYTES = 256 << 20


def register(sub) -> None:
    f = sub.add_parser(
        "fsck", help="verify a store that is not mounted (--repair: drop damaged clean data)",
        description="Verify every blob file (header and every block), tag state, registry "
                    "entry, pagemap, dirty file, write state, journal record and temp file of "
                    "STORE, which no live mount may own.")
    f.add_argument("store", metavar="STORE")
    f.add_argument("--repair", action="store_true",
                   help="drop damaged and stale clean data, orphaned clean blobs and temp files "
                        "(dirty data, write states and the journal are reported and kept)")
    f.add_argument("--json", action="store_true", help="print the report as one JSON document")
    f.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    f.add_argument("--debug", action="store_true")
    f.set_defaults(func=cmd_fsck)


class WalkProgress:
    """A progress bar on stderr over the bytes of a store, only on a terminal and a large
    store (sized by a first pass that stats every file and opens none)."""

    def __init__(self, root: str, label: str, *, enabled: bool) -> None:
        self.bar: ProgressBar | None = None
        self.done = 0
        self.entries = 0
        if enabled and sys.stderr.isatty():
            files, total = measure(root)
            if files >= PROGRESS_MIN_FILES or total >= PROGRESS_MIN_BYTES:
                self.bar = ProgressBar(sys.stderr, label, total)

    def advance(self, size: int) -> None:
        self.done += size
        self.entries += 1
        if self.bar is not None:
            self.bar.update(self.done, f"{self.entries} files")

    def clear(self) -> None:
        """Make room for a line of output under the bar."""
        if self.bar is not None:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()

    def finish(self) -> None:
        if self.bar is not None:
            self.bar.finish(self.done, f"{self.entries} files")


def failed(command: str, exc: BaseException, *, as_json: bool, store: str) -> int:
    """The one line of a command that could not run; exit status 2."""
    if isinstance(exc, FaultfsError):
        message = exc.message
    elif isinstance(exc, OSError):
        message = f"{exc.strerror or exc}: {exc.filename or ''}".rstrip(": ")
    else:
        message = str(exc)
    print(f"faultfs: {command}: {message}", file=sys.stderr)
    if as_json:
        print(json.dumps({"store": store, "error": message, "exit": EXIT_CANNOT}))
    return EXIT_CANNOT


def cmd_fsck(args: argparse.Namespace) -> int:
    problems: list[dict] = []
    leftovers: list[dict] = []
    omitted = 0
    progress: WalkProgress | None = None
    try:
        root = check_store_root(args.store)
        progress = WalkProgress(root, "fsck", enabled=not args.no_progress)

        def seen(finding: Finding) -> None:
            nonlocal omitted
            assert progress is not None
            progress.advance(finding.size)
            if not finding.problem and finding.status != LEFTOVER:
                return
            listed = problems if finding.problem else leftovers
            if not args.json:
                progress.clear()
                print(finding.describe(root), flush=True)
            elif len(listed) < MAX_JSON_PROBLEMS:
                listed.append(finding.to_doc(root))
            elif finding.problem:
                omitted += 1

        report = fsck(root, repair=args.repair, on_finding=seen)
    except (FaultfsError, OSError) as exc:
        if progress is not None:
            progress.clear()
        if args.debug:
            traceback.print_exc()
        return failed("fsck", exc, as_json=args.json, store=args.store)
    progress.finish()
    code = EXIT_CLEAN if report.clean else EXIT_PROBLEMS
    if args.json:
        doc = to_doc(report, problems, omitted, code)
        doc["leftovers"] = leftovers
        print(json.dumps(doc, indent=1, sort_keys=True))
    else:
        print(render(report))
    return code


def to_doc(report: FsckReport, problems: list[dict], omitted: int, code: int) -> dict:
    return {"store": report.root, "repair": report.repair, "exit": code,
            "areas": {area: row.to_doc() for area, row in report.rows.items()},
            "total": report.total.to_doc(), "problems": problems, "problems_omitted": omitted,
            "dropped": {"files": report.dropped, "bytes": report.dropped_bytes},
            "kept": report.kept}


def render(report: FsckReport) -> str:
    """The summary table and the verdict."""
    cols = ("checked", "ok", "damaged", "stale", "orphaned", "leftover")
    lines = ["", f"{'':<18}" + "".join(f"{c:>10}" for c in cols) + f"{'bytes':>12}"]
    for name, row in [*((a, report.rows[a]) for a in AREAS), ("total", report.total)]:
        doc = row.to_doc()
        lines.append(f"{name:<18}" + "".join(f"{doc[c]:>10}" for c in cols)
                     + f"{format_size(row.bytes):>12}")
    total = report.total
    if report.clean:
        left = (f"; {report.leftovers} left by a crash, which the next mount clears"
                if report.leftovers else "")
        lines.append(f"store {report.root} is clean: {total.checked} files, "
                     f"{format_size(total.bytes)} checked{left}")
        return "\n".join(lines)
    kept = ", ".join(f"{n} {why}" for why, n in sorted(report.kept_why.items()))
    if report.repair:
        verdict = (f"{report.problems} problems: {report.dropped} dropped "
                   f"({format_size(report.dropped_bytes)}), {report.kept} kept")
    else:
        droppable = report.problems - report.kept
        verdict = (f"{report.problems} problems: {droppable} that --repair drops, "
                   f"{report.kept} it keeps")
    lines.append(verdict + (f" ({kept})" if kept else ""))
    return "\n".join(lines)
