"""The torture suite's command line: run the cases within their time budgets, print one table,
exit 1 if anything failed (a case's own failures, a harness error, or leftovers at cleanup).

Budgets are per case (seconds, default run / ``--quick``); a case stops its trials when its
budget runs out and says so. The seeds are fixed (``--seed`` shifts them all).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback

from faultfs.testing.torture.crossname_model import PARTS, parse_parts
from faultfs.testing.torture.harness import Budget, CaseResult, Interrupted, Run, interruptible, log

# (key, module, default budget s, --quick budget s)
CASES = (
    ("kill9", "case_kill9", 110, 12),
    ("crash", "case_crash", 75, 14),
    ("fsrand", "case_fsrand", 45, 8),
    ("tinyfs", "case_tinyfs", 45, 12),
    ("chaos", "case_chaos", 80, 14),
    ("fuzz", "case_fuzz", 110, 10),
    ("scale", "case_scale", 70, 20),
    ("crossname", "case_crossname", 60, 35),
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="scripts/torture",
        description="The standing torture suite of faultfs (needs root and /dev/fuse).")
    p.add_argument("--quick", action="store_true",
                   help="a smaller run of every case (under 3 minutes)")
    p.add_argument("--only", action="append", choices=[c[0] for c in CASES], metavar="CASE",
                   help="run only this case (repeatable): " + ", ".join(c[0] for c in CASES))
    p.add_argument("--skip", action="append", default=[], choices=[c[0] for c in CASES],
                   metavar="CASE", help="leave this case out (repeatable)")
    p.add_argument("--budget", type=float, metavar="SECONDS",
                   help="each chosen case's time budget (default: its share of the run); "
                        "e.g. --only crossname --budget 600 for its full ten minutes")
    p.add_argument("--crossname-parts", metavar="LIST", default="all",
                   help="the crossname case's parts, comma-separated: " + ", ".join(PARTS)
                        + ", or single writers (mmap-chunk/chunk); 'all' (the default), and "
                          "'-ITEM' to leave one out (all,-view-chunk)")
    p.add_argument("--seed", type=int, default=0, help="shift every seed by this (default 0)")
    p.add_argument("--verbose", action="store_true", help="print each case's notes")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    p.add_argument("--head", action="store_true",
                   help="test faultfs from a clean export of HEAD, not the working tree (the "
                        "torture package itself comes from the working tree if HEAD has none)")
    args = p.parse_args(argv)
    try:
        parse_parts(args.crossname_parts)
    except ValueError as exc:
        p.error(str(exc))
    return args


def preflight() -> str | None:
    if os.geteuid() != 0:
        return "the torture suite needs root (tmpfs mounts, FUSE connections, /proc of daemons)"
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing"
    if shutil.which("fusermount3") is None:
        return "fusermount3 is missing (Debian package fuse3)"
    return None


def table(results: list[CaseResult], width: int = 56) -> str:
    """One pipe table: case, trials, operations, what held, what failed, seconds."""
    head = ("case", "trials", "operations", "what held", "what failed", "s")
    rows = []
    for r in results:
        rows.append((r.name, str(r.trials), f"{r.operations:,}", "; ".join(r.held) or "-",
                     "; ".join(r.failed) or "-", f"{r.seconds:.0f}"))
    lines = []
    wrapped = [[textwrap.wrap(cell, width) or [""] if i in (3, 4) else [cell]
                for i, cell in enumerate(row)] for row in rows]
    widths = [max([len(head[i])] + [len(line) for row in wrapped for line in row[i]])
              for i in range(len(head))]

    def fmt(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    lines.append(fmt(list(head)))
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in wrapped:
        height = max(len(cell) for cell in row)
        for k in range(height):
            lines.append(fmt([cell[k] if k < len(cell) else "" for cell in row]))
    return "\n".join(lines)


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))))
HEAD_ENV = "FAULTFS_TORTURE_HEAD"  # set in the re-run: which commit was exported


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                              timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def provenance() -> str:
    """Which faultfs this run tests: a commit, and whether the tree differs from it."""
    if os.environ.get(HEAD_ENV):
        return f"faultfs at {os.environ[HEAD_ENV]} (a clean export of HEAD)"
    commit = _git("rev-parse", "--short", "HEAD") or "an unknown commit"
    changed = [line for line in _git("status", "--porcelain").splitlines()
               if "faultfs/testing/torture" not in line and "torture" not in line]
    return f"faultfs at {commit}" + (f" with uncommitted changes to {len(changed)} paths"
                                     if changed else "")


def run_from_head(argv: list[str]) -> int:
    """Run this command again with faultfs imported from a clean export of HEAD."""
    snap = tempfile.mkdtemp(prefix="faultfs-torture-head-")
    try:
        archive = subprocess.run(["git", "archive", "HEAD", "faultfs", "assimilators"], cwd=REPO,
                                 capture_output=True, check=True, timeout=120).stdout
        subprocess.run(["tar", "-x", "-C", snap], input=archive, check=True, timeout=120)
        here = os.path.dirname(os.path.abspath(__file__))
        there = os.path.join(snap, "faultfs", "testing", "torture")
        if not os.path.isdir(there):
            shutil.copytree(here, there, ignore=shutil.ignore_patterns("__pycache__"))
        env = dict(os.environ, PYTHONPATH=snap, **{HEAD_ENV: _git("rev-parse", "--short",
                                                                   "HEAD")})
        proc = subprocess.Popen([sys.executable, "-m", "faultfs.testing.torture",
                                 *[a for a in argv if a != "--head"]], env=env, cwd=snap)
        signal.signal(signal.SIGTERM, lambda signum, frame: proc.send_signal(signum))
        while True:
            try:
                return proc.wait()
            except KeyboardInterrupt:  # the run got the same Ctrl-C: wait for its cleanup
                continue
    finally:
        shutil.rmtree(snap, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.head and not os.environ.get(HEAD_ENV):
        return run_from_head(sys.argv[1:] if argv is None else argv)
    problem = preflight()
    if problem:
        print(f"torture: {problem}", file=sys.stderr)
        return 2
    chosen = [c for c in CASES if (not args.only or c[0] in args.only)
              and c[0] not in args.skip]
    started = time.monotonic()
    results: list[CaseResult] = []
    leftovers: list[str] = []
    interrupted = None
    run = Run(quick=args.quick, verbose=args.verbose, seed=args.seed,
              options={"crossname_parts": args.crossname_parts})
    mode = "--quick" if args.quick else "default"
    log(f"{mode} run of {len(chosen)} cases in {run.root}")
    try:
        with interruptible():
            for key, module, full_s, quick_s in chosen:
                budget = Budget(args.budget or (quick_s if args.quick else full_s))
                log(f"case {key} (budget {budget.seconds:.0f} s)")
                mod = importlib.import_module(f"faultfs.testing.torture.{module}")
                res = CaseResult(mod.NAME)
                try:
                    mod.run_case(run, budget, res)
                except (KeyboardInterrupt, Interrupted):
                    res.failed.append("interrupted")
                    res.seconds = budget.elapsed()
                    results.append(res)
                    raise
                except Exception as exc:  # a harness error is this case's failure
                    res.failed.append(f"error: {type(exc).__name__}: {exc}")
                    res.notes.append(traceback.format_exc())
                res.seconds = budget.elapsed()
                results.append(res)
                log(f"case {key}: {'FAILED' if res.failed else 'ok'} in {res.seconds:.1f} s")
                if args.verbose or res.failed:
                    for note in res.notes:
                        print(textwrap.indent(note.rstrip(), "    "), file=sys.stderr)
    except (KeyboardInterrupt, Interrupted) as exc:
        interrupted = type(exc).__name__ if isinstance(exc, KeyboardInterrupt) else str(exc)
    finally:
        leftovers = run.cleanup()
    total = time.monotonic() - started
    print(table(results))
    print(f"\n{mode} run, {total:.0f} s, seed {args.seed}, {provenance()}"
          + (f"; interrupted ({interrupted})" if interrupted else ""))
    for item in leftovers:
        print(f"cleanup: {item}")
    failed = interrupted or leftovers or any(r.failed for r in results)
    print("FAILED" if failed else "all held")
    if args.json:
        doc = {"mode": mode, "seconds": round(total, 1), "seed": args.seed,
               "faultfs": provenance(),
               "interrupted": interrupted, "leftovers": leftovers, "failed": bool(failed),
               "cases": [{"name": r.name, "trials": r.trials, "operations": r.operations,
                          "held": r.held, "failed": r.failed, "seconds": round(r.seconds, 1)}
                         for r in results]}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
