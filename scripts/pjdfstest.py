"""pjdfstest inside a tag directory: the groups of the public POSIX test suite that apply to
files (open, chmod, chown, unlink, rename, truncate, ftruncate, utimensat), built from a
checkout of its source (https://github.com/pjd/pjdfstest) and run in a tag of a fresh mount.

A tag directory holds files only (no directories, links, fifos or devices: README "Only
files") and every entry belongs to the mount's user (``chown`` to another is ``EPERM``), so
many assertions fail by design: a test file whose first failure is one of those operations
is counted *by design*; the others are listed, assertion by assertion, to look at. One row
per group, the failures to look at after the table; docs/reliability.md has the last run.

    scripts/pjdfstest --source DIR [--groups open,chmod] [--keep-going]

No network is needed: the source is a checkout (``git clone`` it where a network is). It is
built with the C compiler and a ``config.h`` for Linux (its configure script needs autotools).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys

from faultfs.testing.torture.harness import MiB, Run, TortureError

GROUPS = ("open", "chmod", "chown", "unlink", "rename", "truncate", "ftruncate", "utimensat")
TEST_TIMEOUT_S = 300
CONFIG_H = """#define _GNU_SOURCE 1
#define HAVE_SYS_SYSMACROS_H 1
#define HAVE_FACCESSAT 1
#define HAVE_FCHMODAT 1
#define HAVE_FCHOWNAT 1
#define HAVE_FSTATAT 1
#define HAVE_LINKAT 1
#define HAVE_MKDIRAT 1
#define HAVE_MKFIFOAT 1
#define HAVE_MKNODAT 1
#define HAVE_OPENAT 1
#define HAVE_POSIX_FALLOCATE 1
#define HAVE_READLINKAT 1
#define HAVE_RENAMEAT 1
#define HAVE_SYMLINKAT 1
#define HAVE_UTIMENSAT 1
#define HAVE_STRUCT_STAT_ST_ATIM 1
#define HAVE_STRUCT_STAT_ST_CTIM 1
#define HAVE_STRUCT_STAT_ST_MTIM 1
"""
# a test file's first failure with one of these is the tree's design, not a defect
# (or one on a path through a subdirectory, which the test made with the shell's mkdir -p)
BY_DESIGN = re.compile(r"tried '(-u \d+ |-g [\d,]+ )*((mkdir|symlink|link|mkfifo|mknod|bind|"
                       r"connect|lchown|chflags) |chown \S+ (?!0 0)|\w+ [^ ']*/)")


def build(source: str, into: str) -> str:
    """The pjdfstest binary and its tests, copied and built under ``into``."""
    work = os.path.join(into, "pjdfstest")
    shutil.copytree(source, work, ignore=shutil.ignore_patterns(".git"))
    with open(os.path.join(work, "config.h"), "w") as f:
        f.write(CONFIG_H)
    subprocess.run(["cc", "-O1", "-w", "-o", "pjdfstest", "pjdfstest.c"], cwd=work, check=True,
                   capture_output=True, timeout=300)
    return work


def run_file(test: str, cwd: str) -> list[str]:
    """The TAP lines of one test file run in ``cwd``."""
    try:
        out = subprocess.run(["bash", test], cwd=cwd, capture_output=True, text=True,
                             timeout=TEST_TIMEOUT_S).stdout
    except subprocess.TimeoutExpired:
        return [f"not ok - {os.path.basename(test)} did not finish in {TEST_TIMEOUT_S} s"]
    return [line for line in out.splitlines() if line.startswith(("ok", "not ok"))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/pjdfstest", description=__doc__.split("\n\n")[0])
    p.add_argument("--source", required=True, help="a checkout of pjdfstest")
    p.add_argument("--groups", default=",".join(GROUPS))
    args = p.parse_args(argv)
    if os.getuid() != 0:
        print("pjdfstest: needs root (it switches users)", file=sys.stderr)
        return 2
    run = Run(quick=False)
    rows, to_look = [], []
    try:
        work = build(os.path.abspath(args.source), run.root)
        src, _ = run.make_source("s.bin", 2 * MiB, seed=1)
        m = run.mount(src, store=run.path("store"), args=["--chunk-size", "1M"])
        tag = m.tag("s")
        for group in args.groups.split(","):
            ok = design = other = 0
            tests = sorted(os.path.join(work, "tests", group, t)
                           for t in os.listdir(os.path.join(work, "tests", group))
                           if t.endswith(".t"))
            for test in tests:
                lines = run_file(test, tag)
                failed = [line for line in lines if line.startswith("not ok")]
                ok += len(lines) - len(failed)
                if failed and BY_DESIGN.search(failed[0]):
                    design += len(failed)
                elif failed:
                    other += len(failed)
                    to_look += [f"{group}/{os.path.basename(test)}: {line[:200]}"
                                for line in failed]
            rows.append((group, ok + design + other, ok, design, other))
        m.umount()
    except (TortureError, subprocess.SubprocessError, OSError) as exc:
        print(f"pjdfstest: {exc}", file=sys.stderr)
        return 1
    finally:
        run.cleanup()
    print(f"{'group':<10} {'assertions':>10} {'ok':>6} {'by design':>9} {'to look at':>10}")
    for group, total, ok, design, other in rows:
        print(f"{group:<10} {total:>10} {ok:>6} {design:>9} {other:>10}")
    t = [sum(r[i] for r in rows) for i in range(1, 5)]
    print(f"{'total':<10} {t[0]:>10} {t[1]:>6} {t[2]:>9} {t[3]:>10}")
    for line in to_look:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
