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


# -- metrics ----------------------------------------------------------------------------------

def _families(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    return {f.name: f for f in text_string_to_metric_families(text)}


def test_metrics_file_and_http_endpoint_parse_as_prometheus(mounter, sample):
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    src = sample(3 * MiB)
    m = mounter(src, args=["--chunk-size", "1M", "--metrics-addr", f"127.0.0.1:{port}"])
    read(os.path.join(m.tag("field"), "field.bin"))
    assert "metrics" in os.listdir(os.path.join(m.path, ".faultfs"))
    text = read(os.path.join(m.path, ".faultfs", "metrics")).decode()
    fams = _families(text)
    assert fams["faultfs_faults"].type == "counter"
    [faults] = fams["faultfs_faults"].samples
    assert faults.value >= 3
    staged = {s.labels["tag"]: s.value for s in fams["faultfs_tag_staged_blobs"].samples}
    assert set(staged) == {"field"}
    hist = fams["faultfs_fault_latency_seconds"]
    assert hist.type == "histogram"
    count = next(s.value for s in hist.samples if s.name.endswith("_count"))
    inf = next(s.value for s in hist.samples if s.labels.get("le") == "+Inf")
    assert count == inf >= 1
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        served = _families(r.read().decode())
    assert served["faultfs_faults"].samples[0].value >= faults.value


def test_a_bad_or_taken_metrics_address_refuses_the_mount(mounter, sample, tmp_path):
    import socket

    src = sample(MiB)
    for addr in ("nonsense", "127.0.0.1:99999"):
        r = run_faultfs("mount", src, str(tmp_path), "--metrics-addr", addr)
        assert r.returncode != 0 and "--metrics-addr" in r.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        mnt = tmp_path / "m"
        mnt.mkdir()
        r = run_faultfs("mount", src, str(mnt), "--store", str(tmp_path / "st"),
                        "--metrics-addr", f"127.0.0.1:{s.getsockname()[1]}")
        assert r.returncode != 0 and "cannot listen" in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
        assert not os.path.ismount(mnt)


def test_stat_watch_prints_rates_for_each_refresh(mounter, sample):
    import subprocess
    import threading

    from conftest import FAULTFS, ROOT

    src = sample(8 * MiB)
    m = mounter(src, args=["--chunk-size", "1M", "--prefetch-mb", "0"])
    proc = subprocess.Popen([*FAULTFS, "stat", m.path, "--watch", "0.5", "--count", "2"],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout is not None
    header = proc.stdout.readline()  # the first snapshot is taken: now read
    reader = threading.Thread(target=lambda: read(os.path.join(m.tag("field"), "field.bin")))
    reader.start()
    out, _ = proc.communicate(timeout=30)
    reader.join()
    lines = [header, *out.strip().splitlines()]
    assert proc.returncode == 0
    assert lines[0].split()[:3] == ["time", "served", "MB/s"] and len(lines) == 3
    served = [float(line.split()[1]) for line in lines[1:]]
    assert all(v >= 0 for v in served)
    assert sum(float(line.split()[3]) for line in lines[1:]) > 0  # faults/s while it read
