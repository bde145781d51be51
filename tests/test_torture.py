"""The torture suite's quick run (``scripts/torture --quick``, docs/reliability.md) as a test:
every case but crossname (tests/test_crossname.py), smaller, in under two minutes, and nothing
left behind — no mount, no daemon, no tmpfs, no temporary directory.

A failure the suite reports that is one of ``KNOWN_DEFECTS`` (found by the suite and not fixed
yet) makes this test xfail, naming the defect; any other failure fails it. Delete an entry
when its defect is fixed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from faultfs.testing.torture.harness import mounts_under

pytestmark = [pytest.mark.mount, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# pattern of a failure line of the table -> the defect it shows (docs/reliability.md)
KNOWN_DEFECTS: dict[str, str] = {}  # pattern of a failure line -> the defect it is


def _holding_files_under(path: str) -> list[int]:
    """Processes with a descriptor open under ``path`` (a daemon holds its store's lock)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(path):
                    pids.append(int(pid))
                    break
            except OSError:
                continue
    return pids


# one test per case, so that the suite's workers share them out (the crossname case runs on
# its own in tests/test_crossname.py)
CASES = ["kill9", "crash", "fsrand", "tinyfs", "chaos", "fuzz", "scale"]


@pytest.mark.parametrize("case", CASES)
def test_the_quick_torture_run_holds_and_leaves_nothing_behind(tmp_path, case):
    if os.geteuid() != 0:
        pytest.skip("the torture suite needs root (tmpfs mounts, FUSE connections)")
    report = tmp_path / "torture.json"
    work = tmp_path / "tmp"
    work.mkdir()
    env = dict(os.environ, TMPDIR=str(work))  # the run's root is made in here
    result = subprocess.run([os.path.join(ROOT, "scripts", "torture"), "--quick", "--only",
                             case, "--json", str(report)], capture_output=True,
                            text=True, env=env, cwd=ROOT, timeout=400)
    assert "| case" in result.stdout, result.stderr[-3000:]
    assert mounts_under(str(tmp_path)) == [], "a mount outlived the run"
    assert os.listdir(work) == [], "the run's temporary directory outlived it"
    assert _holding_files_under(str(work)) == [], "a process of the run outlived it"
    doc = json.loads(report.read_text())
    assert not doc["leftovers"] and not doc["interrupted"], doc
    assert len(doc["cases"]) == 1 and doc["cases"][0]["trials"] > 0, doc["cases"]
    known, unknown = set(), []
    for case in doc["cases"]:
        for line in case["failed"]:
            hits = [why for pattern, why in KNOWN_DEFECTS.items() if re.search(pattern, line)]
            if hits:
                known.update(hits)
            else:
                unknown.append(f"{case['name']}: {line}")
    assert not unknown, "\n".join(unknown) + "\n\n" + result.stdout
    assert result.returncode == (1 if known else 0), result.stdout + result.stderr[-2000:]
    if known:
        pytest.xfail("known defects found by the torture suite: " + "; ".join(sorted(known)))
