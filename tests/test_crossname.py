"""The cross-name torture case in its quick form (``scripts/torture --quick --only crossname``,
docs/reliability.md, issue 41): writers through every pair of a tag's names, read-your-writes
across names after every write, clones checked against the writers' logs, and a watchdog that
turns a hang into a failure with the stacks and frees the mount.

Two verdicts of one run: that it leaves nothing behind and wedges nothing (whatever the mount
does: the watchdog must free it), and that every check held (before issue 41's fixes, writing
one tag through two names deadlocked within a second, and clones were not point-in-time).
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from faultfs.testing.torture.harness import mounts_under

pytestmark = [pytest.mark.mount, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_TIMEOUT_S = 240  # the quick case takes under 60 s; a wedged run is killed here


@pytest.fixture(scope="module")
def crossname_run(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("the torture suite needs root (FUSE connections, /proc of the daemon)")
    base = tmp_path_factory.mktemp("crossname")
    report = base / "torture.json"
    work = base / "tmp"
    work.mkdir()
    env = dict(os.environ, TMPDIR=str(work))  # the run's root is made in here
    result = subprocess.run([os.path.join(ROOT, "scripts", "torture"), "--quick", "--only",
                             "crossname", "--json", str(report)], capture_output=True,
                            text=True, env=env, cwd=ROOT, timeout=RUN_TIMEOUT_S)
    doc = json.loads(report.read_text()) if report.exists() else None
    return base, work, result, doc


def test_the_quick_crossname_run_leaves_nothing_behind(crossname_run):
    base, work, result, doc = crossname_run
    assert "| case" in result.stdout, result.stderr[-3000:]
    assert mounts_under(str(base)) == [], "a mount outlived the run"
    assert os.listdir(work) == [], "the run's temporary directory outlived it"
    assert doc is not None and not doc["leftovers"] and not doc["interrupted"], doc
    (case,) = doc["cases"]
    assert not [line for line in case["failed"] if line.startswith("error:")], case["failed"]


def test_the_quick_crossname_run_holds(crossname_run):
    _, _, result, doc = crossname_run
    assert doc is not None
    (case,) = doc["cases"]
    assert not case["failed"] and result.returncode == 0, "\n".join(case["failed"])
    assert case["trials"] > 0 and case["operations"] > 0, case
