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
    registry = os.path.join(m.path, ".faultfs", "registry")
    keys = sorted(os.listdir(registry))
    assert len(keys) == 2
    entries = {k: read(os.path.join(registry, k)) for k in keys}
    r = run_faultfs("forget", m.tag("a"), check=True)
    assert "forgot tag a" in r.stdout and "3.0 MiB" in r.stdout
    assert sorted(os.listdir(m.path)) == [".faultfs", "b"]
    # the registry shows what is registered now; the entry left keeps its name and bytes
    [left] = os.listdir(registry)
    assert read(os.path.join(registry, left)) == entries[left] and b"b.bin" in entries[left]
    gone = next(k for k in keys if k != left)
    assert not os.path.exists(os.path.join(registry, gone))
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


def test_forgetting_a_clone_leaves_its_parent_reading_its_source(mounter, sample):
    """A clone reads the parent's source: forgetting the clone must not close it under the
    parent (its chunks not staged yet read EIO until a remount, before)."""
    src = sample(3 * MiB)
    m = mounter(src, args=["--chunk-size", "1M"])
    run_faultfs("clone", m.tag("field"), "snap", check=True)
    run_faultfs("clone", m.tag("snap"), "snap2", check=True)
    assert read(os.path.join(m.tag("snap2"), "chunk_0")) == read(src)[:MiB]
    run_faultfs("forget", m.tag("snap2"), check=True)
    run_faultfs("forget", m.tag("snap"), check=True)
    assert read(os.path.join(m.tag("field"), "field.bin")) == read(src)
    assert m.counters()["fault_errors"] == 0


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


# -- mount -t fuse.faultfs, fstab, systemd ----------------------------------------------------

@pytest.fixture
def faultfs_on_path():
    """``mount(8)`` runs helpers with the standard PATH: put ``faultfs`` there for the test
    (a link to this checkout's entry point), unless one is installed already."""
    import shutil
    import sys

    link = "/usr/local/bin/faultfs"
    ours = os.path.join(os.path.dirname(sys.executable), "faultfs")
    if not os.path.exists(ours):
        pytest.skip(f"no faultfs entry point at {ours}: install the package (pip install -e .)")
    if shutil.which("mount.fuse3") is None and shutil.which("mount.fuse") is None:
        pytest.skip("needs mount.fuse (the fuse3 package)")
    made = False
    if not os.path.lexists(link):
        os.symlink(ours, link)
        made = True
    elif os.path.realpath(link) != os.path.realpath(ours):
        pytest.skip(f"{link} is another faultfs: not replaced")
    try:
        yield link
    finally:
        if made:
            os.unlink(link)


def _mounts_of(path: str) -> list[str]:
    with open("/proc/mounts") as f:
        return [line for line in f if line.split()[1] == path]


def test_mount_t_fuse_faultfs_and_an_fstab_line(faultfs_on_path, sample, tmp_path):
    import subprocess

    src = sample(3 * MiB)
    mnt, store = tmp_path / "mnt", tmp_path / "store"
    mnt.mkdir()
    opts = f"store={store},chunk_size=1M,reserve_mb=0,ro,nofail,x-systemd.automount"
    r = subprocess.run(["mount", "-t", "fuse.faultfs", src, str(mnt), "-o", opts],
                       capture_output=True, text=True, timeout=120)
    try:
        assert r.returncode == 0, r.stderr
        assert _mounts_of(str(mnt)) and _mounts_of(str(mnt))[0].split()[2] == "fuse.faultfs"
        assert read(os.path.join(mnt, "field", "field.bin")) == read(src)
        with pytest.raises(OSError):  # ro became --read-only
            open(os.path.join(mnt, "field", "chunk_0"), "r+b").close()
    finally:
        run_faultfs("umount", str(mnt))
    fstab = tmp_path / "fstab"
    fstab.write_text(f"# a test fstab\n{src} {mnt} fuse.faultfs store={store},chunk_size=1M,"
                     "reserve_mb=0,_netdev 0 0\n"
                     f"none {tmp_path / 'never'} fuse.faultfs store={store},noauto 0 0\n")
    r = subprocess.run(["mount", "-a", "--fstab", str(fstab)], capture_output=True, text=True,
                       timeout=120)
    try:
        assert r.returncode == 0, r.stderr
        assert read(os.path.join(mnt, "field", "chunk_1")) == read(src)[MiB:2 * MiB]
    finally:
        run_faultfs("umount", str(mnt))
    # a remount-only line (no source): what the store has registered
    fstab.write_text(f"none {mnt} fuse.faultfs store={store} 0 0\n")
    r = subprocess.run(["mount", "--fstab", str(fstab), str(mnt)], capture_output=True,
                       text=True, timeout=120)
    try:
        assert r.returncode == 0, r.stderr
        assert sorted(os.listdir(mnt)) == [".faultfs", "field"]
    finally:
        run_faultfs("umount", str(mnt))
    r = subprocess.run(["mount", "-t", "fuse.faultfs", src, str(mnt), "-o", "bogus=1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "unknown faultfs mount option 'bogus=1'" in r.stderr


def test_the_systemd_unit_verifies(tmp_path):
    import shutil
    import subprocess
    import sys

    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    from conftest import ROOT

    with open(os.path.join(ROOT, "contrib", "systemd", "faultfs-run42.service")) as f:
        unit = f.read()
    ours = os.path.join(os.path.dirname(sys.executable), "faultfs")
    path = tmp_path / "faultfs-run42.service"
    path.write_text(unit.replace("/usr/local/bin/faultfs", ours))
    r = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    path.write_text(unit.replace("/usr/local/bin/faultfs", "/nonexistent/faultfs"))
    r = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode != 0  # the check is real


# -- the Python API ---------------------------------------------------------------------------

def test_the_python_api_mounts_unmounts_and_cleans_up_on_an_exception(sample, tmp_path):
    import subprocess
    import sys

    src = sample(2 * MiB)
    script = f"""
import os, sys, faultfs
store = {str(tmp_path / 'store')!r}
with faultfs.mounted({src!r}, store=store, chunk_size="1M", reserve_mb=0) as root:
    data = open(os.path.join(root, "field", "field.bin"), "rb").read()
    assert data == open({src!r}, "rb").read()
    counters = faultfs.stat(root)
    assert counters["faults"] >= 2, counters
    pid = int(__import__("json").load(open(os.path.join(root, ".faultfs", "stats")))["pid"])
    print("ROOT", root, "PID", pid, flush=True)
    try:
        with faultfs.mounted({src!r}, store=store, mountpoint=root):
            pass
    except faultfs.Error as exc:
        print("ERROR", type(exc).__name__, exc, flush=True)
    raise RuntimeError("inside the with")
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=180)
    assert "RuntimeError: inside the with" in r.stderr and r.returncode != 0
    out = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    root, _, pid = out["ROOT"].partition(" PID ")
    assert out["ERROR"].startswith("MountError") and "\n" not in out["ERROR"]
    assert not os.path.ismount(root) and not os.path.exists(root)  # its temporary dir too
    try:
        with open(f"/proc/{pid}/status") as f:
            assert "zombie" in f.read(), "the daemon outlived the with block"
    except FileNotFoundError:
        pass  # gone


def test_every_mount_helper_option_is_a_flag_of_faultfs_mount():
    """``-o name[=value]`` turns into ``--name [value]``: each option the helper knows must be
    one ``faultfs mount`` takes, and a new mount flag cannot be missing from fstab lines
    unnoticed (and every mount flag but the daemon's own has its option)."""
    import argparse

    from faultfs.cli import build_parser
    from faultfs.cli.fstab import FLAGS, VALUED, mount_argv

    [commands] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    mount = commands.choices["mount"]
    takes = {s for a in mount._actions for s in a.option_strings if s.startswith("--")}
    options = [*(f"{n}=1" for n in VALUED), *FLAGS]
    argv = mount_argv(["/src", "/mnt", "-o", ",".join(options)])
    assert {a for a in argv if a.startswith("--")} <= takes
    helper = {f"--{n.replace('_', '-')}" for n in (*VALUED, *FLAGS)}
    # the daemon's, not a mount's choices (the last four: set by the holder on its daemons)
    internal = {"--help", "--foreground", "--ready-fd", "--holder-fd", "--state-fd",
                "--takeover-fd", "--standby"}
    assert takes - helper <= internal, sorted(takes - helper)
