"""Clones of a tag taken while it is written, through a real mount (DESIGN §12): each is the
tag at one instant, checked against the logs of the writers (``faultfs.testing.stamps``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from faultfs.control_client import request
from faultfs.testing.stamps import Log, check, seen_chunks, seen_user, stamp_seq

pytestmark = pytest.mark.mount

KiB = 1 << 10
CHUNKS = 32  # chunk_0 … chunk_31 of 64 KiB: a clone folds each one the first writer stamps
WRITING_S = 4.0


def _stamped(tag_dir: str, name: str) -> bool:
    try:
        with open(os.path.join(tag_dir, name), "rb") as f:
            return stamp_seq(f.read(16)) > 0
    except FileNotFoundError:
        return False


def test_clones_taken_while_two_writers_write_are_the_tag_at_one_instant(mounter, sample,
                                                                         tmp_path):
    """One writer stamps chunk_0 … chunk_31 in turn, another appends stamps to a user blob,
    each logging when every write was answered; a clone is taken every ~0.3 s meanwhile. In
    every clone: each writer's writes are a prefix of what it made, every write answered
    before the clone began is in it, and none is in it while a write answered before that
    one started is not."""
    src = sample(CHUNKS * 64 * KiB)
    m = mounter(src, args=["--chunk-size", "64K"])
    tag_dir = m.tag("field")
    logs = {"chunks": str(tmp_path / "chunks.log"), "user": str(tmp_path / "user.log")}
    writer = [sys.executable, "-m", "faultfs.testing.stamps"]
    procs = [
        subprocess.Popen([*writer, "chunks", tag_dir, str(CHUNKS), str(WRITING_S),
                          logs["chunks"]]),
        subprocess.Popen([*writer, "user", os.path.join(tag_dir, "stamps.bin"),
                          str(WRITING_S), logs["user"]]),
    ]
    clones: list[tuple[str, int]] = []  # name, when it began
    try:
        deadline = time.monotonic() + 30
        while not (_stamped(tag_dir, "chunk_0") and _stamped(tag_dir, "stamps.bin")):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.01)
        while all(p.poll() is None for p in procs):
            name = f"snap{len(clones)}"
            began = time.monotonic_ns()
            request(m.path, {"op": "clone", "tag": "field", "new": name})
            clones.append((name, began))
            time.sleep(0.3)
    finally:
        for p in procs:
            assert p.wait(timeout=60) == 0, "a writer failed"
    made = {w: Log.read(path) for w, path in logs.items()}
    assert len(clones) >= 4
    problems = {}
    for name, began in clones:
        snap = m.tag(name)
        stamps = []
        for i in range(CHUNKS):
            with open(os.path.join(snap, f"chunk_{i}"), "rb") as f:
                stamps.append(stamp_seq(f.read(16)))
        with open(os.path.join(snap, "stamps.bin"), "rb") as f:
            seen = {"chunks": seen_chunks(stamps), "user": seen_user(f.read())}
        assert all(s.prefix for s in seen.values()), "each writer had written before"
        found = check(seen, made, began)
        if found:
            problems[name] = found
    assert not problems, f"{len(problems)} of {len(clones)} clones are no instant of the " \
                         f"tag: {problems}"
