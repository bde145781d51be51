"""Operating a mount: ``faultfs forget``, metrics, ``stat --watch``, ``mount -t fuse.faultfs``
and fstab, the systemd unit, and the Python API — through real mounts."""

from __future__ import annotations

import json
import os

import pytest
from conftest import run_faultfs

pytestmark = pytest.mark.mount
MiB = 1 << 20


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


# -- forget -----------------------------------------------------------------------------------

def test_forget_unregisters_a_tag_of_a_live_mount(mounter, sample, tmp_path):
    a, b = sample(3 * MiB, "a.bin"), sample(2 * MiB, "b.bin")
    m = mounter(a, b, args=["--chunk-size", "1M"])
    assert read(os.path.join(m.tag("a"), "a.bin")) == read(a)
    assert read(os.path.join(m.tag("b"), "b.bin")) == read(b)
    with open(os.path.join(m.tag("a"), "chunk_0"), "rb") as held:
        r = run_faultfs("forget", m.tag("a"))
        assert r.returncode != 0 and "open" in r.stderr  # a file of it is open
        assert held.read(10) == read(a)[:10]
    r = run_faultfs("forget", m.tag("a"), check=True)
    assert "forgot tag a" in r.stdout and "3.0 MiB" in r.stdout
    assert sorted(os.listdir(m.path)) == [".faultfs", "b"]
    assert not os.path.exists(m.tag("a"))
    assert not os.path.exists(os.path.join(m.store, "tags", "t-a"))
    assert os.path.exists(os.path.join(m.store, "tags", "t-b"))
    assert read(os.path.join(m.tag("b"), "chunk_1")) == read(b)[MiB:]
    m.umount()
    m2 = mounter(store=m.store)  # the remount recovers only what is still registered
    assert sorted(os.listdir(m2.path)) == [".faultfs", "b"]


def test_forget_keeps_blobs_and_refuses_tags_with_writes_or_clones(mounter, sample):
    src = sample(2 * MiB)
    m = mounter(src, args=["--chunk-size", "1M"])
    tag = m.tag("field")
    read(os.path.join(tag, "field.bin"))
    with open(os.path.join(tag, "chunk_1"), "r+b") as f:
        f.write(b"dirty")
    r = run_faultfs("forget", tag)
    assert r.returncode != 0 and "--discard-writes" in r.stderr
    run_faultfs("clone", tag, "snap", check=True)
    r = run_faultfs("forget", tag, "--discard-writes")
    assert r.returncode != 0 and "snap" in r.stderr
    run_faultfs("forget", m.tag("snap"), "--discard-writes", check=True)
    run_faultfs("forget", tag, "--discard-writes", "--keep-blobs", check=True)
    assert os.listdir(m.path) == [".faultfs"]
    staged = os.listdir(os.path.join(m.store, "tags", "t-field"))
    assert "chunk_0" in " ".join(staged)  # the blobs were kept
    m.umount()
    # registered again: the kept blobs are hits, and the dropped writes are gone for good
    m2 = mounter(src, args=["--chunk-size", "1M"])
    assert read(os.path.join(m2.tag("field"), "field.bin")) == read(src)
    assert m2.counters()["source_reads"] == 0
    assert json.loads(run_faultfs("stat", m2.path, "--json", check=True).stdout)[
        "tags"]["field"]["dirty_blobs"] == 0
