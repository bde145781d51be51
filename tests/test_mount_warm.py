"""`faultfs warm` and `faultfs checkpoint show` against real mounts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import FAULTFS, ROOT, run_faultfs

pytestmark = pytest.mark.mount

MiB = 1 << 20


def test_warm_stages_every_blob_once_and_then_skips(mounter, sample, tmp_path):
    src = sample(6 * MiB + 100)
    m = mounter(src, args=["--chunk-size", "1M", "--prefetch-mb", "0"])
    state = str(tmp_path / "warm.meta")
    r = run_faultfs("warm", m.path, "--state", state, "--no-progress", check=True)
    assert r.returncode == 0
    stats = m.stats()
    assert stats["tags"]["field"]["staged_blobs"] == 7
    assert stats["counters"]["source_reads"] == 7
    time.sleep(1.1)  # attributes (st_blocks) are cached for a second
    run_faultfs("warm", m.path, "--state", state, "--no-progress", check=True)
    assert m.counters()["source_reads"] == 7, "a second warm skips staged blobs"
    with open(os.path.join(m.tag("field"), "field.bin"), "rb") as f, open(src, "rb") as g:
        assert f.read() == g.read()
    assert m.counters()["source_reads"] == 7
    shown = json.loads(run_faultfs("checkpoint", "show", state, "--json", check=True).stdout)
    assert shown["active"] in ("A", "B", "a", "b") or shown.get("active") is not None


def test_interrupted_warm_resumes_where_it_stopped(mounter, sample, tmp_path):
    src = sample(48 * MiB)
    m = mounter(src, args=["--chunk-size", "256K", "--prefetch-mb", "0"])
    state = str(tmp_path / "warm.meta")
    proc = subprocess.Popen([*FAULTFS, "warm", m.path, "--state", state, "--no-progress",
                             "--checkpoint-every", "8"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while m.counters()["source_reads"] < 40 and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    done_before = m.counters()["source_reads"]
    assert 0 < done_before < 192, "the warm was interrupted part way"
    r = run_faultfs("warm", m.path, "--state", state, "--no-progress", check=True)
    assert r.returncode == 0
    stats = m.stats()
    assert stats["tags"]["field"]["staged_blobs"] == 192
    assert stats["counters"]["source_reads"] == 192, "no blob is read from the source twice"


def test_warm_of_something_that_is_not_a_mount_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "faultfs.cli", "warm", str(tmp_path / "nope"),
                        "--no-progress", "--state", str(tmp_path / "s.meta")],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode != 0
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_default_checkpoint_lives_in_the_store(mounter, sample):
    src = sample(2 * MiB)
    m = mounter(src, args=["--prefetch-mb", "0"])
    run_faultfs("warm", m.path, "--no-progress", check=True)
    names = os.listdir(os.path.join(m.store, "warm"))
    assert len([n for n in names if n.endswith(".meta")]) == 1, names


def test_the_staged_request_names_staged_and_written_chunks(mounter, sample):
    """``faultfs warm`` learns what is staged from one control request per tag (no extended
    attributes needed): staged chunks, dirty ones and those the view grew are all set."""
    from faultfs.control_client import request
    from faultfs.errors import FaultfsError
    from faultfs.warm import chunk_staged, staged_chunks

    m = mounter(sample(3 * MiB + 100), args=["--chunk-size", "1M", "--prefetch-mb", "0"])
    tag = m.tag("field")
    with open(os.path.join(tag, "chunk_1"), "rb") as f:
        f.read()
    with open(os.path.join(tag, "chunk_2"), "r+b") as f:
        f.write(b"dirty")
    with open(os.path.join(tag, "field.bin"), "r+b") as f:
        f.seek(5 * MiB)
        f.write(b"grown")
    m.wait_staged("field", 2, timeout=10)  # chunk 1's store write follows its read (chunk
    # 2's fault too)
    answer = staged_chunks(tag)
    assert answer is not None and answer[:2] == ("chunk_", 6)
    here = [chunk_staged(answer, i, os.path.join(tag, f"chunk_{i}")) for i in range(6)]
    assert here[:3] == [False, True, True] and here[4:] == [True, True]
    assert chunk_staged(answer, 6, os.path.join(tag, "chunk_6")) is None, "past its chunks"
    assert chunk_staged(answer, 1, os.path.join(tag, "page:1")) is None, "not a chunk"
    with pytest.raises(FaultfsError, match="no tag named"):
        request(m.path, {"op": "staged", "tag": "nope"})
    assert staged_chunks(os.path.join(m.path, "nope")) is None
