"""The shared tier on a real S3 endpoint (moto in server mode, loopback): several daemons, each
with its own local store, one bucket as the shared store (DESIGN §13). Counters prove where
bytes came from; every read is checked against what was uploaded."""

from __future__ import annotations

import os
import signal
import time
from urllib.parse import urlsplit

import pytest
from conftest import run_faultfs

from faultfs.testing.proxy import FaultPlan, FaultRule, LatencyProxy
from faultfs.tiers.objects import open_objects

from .test_mount_s3 import payload, read, read_errno

pytestmark = [pytest.mark.mount, pytest.mark.s3]
MiB = 1 << 20
ANY = 64 << 20  # the objects these tests read back are smaller
NODE = ["--chunk-size", "1M", "--prefetch-mb", "0"]


def settled(m, timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout
    while m.stats()["shared"]["publishes_pending"] and time.monotonic() < deadline:
        time.sleep(0.05)
    return m.counters()


@pytest.fixture
def cluster(s3_env, make_bucket, mounter, tmp_path):
    """``node(name, *sources, args=...)``: a daemon with its own store; all share one bucket."""
    bucket = make_bucket()
    url = f"s3://{bucket}/cluster"

    def node(name: str, *sources: str, args=(), shared: str | None = None):
        return mounter(*sources, store=str(tmp_path / f"store-{name}"),
                       args=[*NODE, "--shared-store", shared or url, *args])

    node.url = url
    node.bucket = bucket
    return node


def test_half_from_the_tier_half_from_s3_then_a_third_node_reads_only_the_tier(
        cluster, s3_client, make_bucket):
    src_bucket = make_bucket()
    data = payload(6 * MiB, 11)
    s3_client.put_object(Bucket=src_bucket, Key="run/field.bin", Body=data)
    a = cluster("a", f"s3://{src_bucket}/run/field.bin")
    for i in (0, 2, 4):  # A stages half
        assert read(os.path.join(a.tag("field"), f"chunk_{i}")) == data[i * MiB:(i + 1) * MiB]
    assert settled(a)["shared_publishes"] == 3
    b = cluster("b")  # no source given: the tag comes from the shared store
    assert read(os.path.join(b.tag("field"), "field.bin")) == data
    c = settled(b)
    assert c["shared_hits"] == 3 and c["source_bytes"] == 3 * MiB
    assert c["shared_publishes"] == 3 and c["source_reads"] == 3
    third = cluster("c")
    assert read(os.path.join(third.tag("field"), "field.bin")) == data
    c = third.counters()
    assert c["source_reads"] == 0 and c["shared_hits"] == 6 and c["source_bytes"] == 0
    stat = run_faultfs("stat", third.path, check=True).stdout
    assert "shared hits" in stat and cluster.url in stat


def test_kill_9_during_publishes_never_leaves_a_torn_object(cluster, s3_client, make_bucket):
    src_bucket = make_bucket()
    data = payload(24 * MiB, 12)
    s3_client.put_object(Bucket=src_bucket, Key="big.bin", Body=data)
    a = cluster("a", f"s3://{src_bucket}/big.bin")
    assert read(os.path.join(a.tag("big"), "big.bin")) == data
    os.kill(a.pid, signal.SIGKILL)  # publishes are under way (or done): whole objects only
    a.pid = None
    b = cluster("b")
    assert read(os.path.join(b.tag("big"), "big.bin")) == data
    c = settled(b)
    assert c["shared_damaged"] == 0 and c["shared_hits"] + c["source_reads"] >= 1
    assert c["shared_hits"] + c["source_bytes"] // MiB == 24


def test_an_overwritten_source_serves_the_new_bytes_on_every_node_never_a_mix(
        cluster, s3_client, make_bucket):
    src_bucket = make_bucket()
    old, new = payload(3 * MiB, 13), payload(3 * MiB, 14)
    s3_client.put_object(Bucket=src_bucket, Key="f.bin", Body=old)
    a = cluster("a", f"s3://{src_bucket}/f.bin")
    assert read(os.path.join(a.tag("f"), "chunk_0")) == old[:MiB]
    settled(a)
    s3_client.put_object(Bucket=src_bucket, Key="f.bin", Body=new)
    b = cluster("b")
    assert read(os.path.join(b.tag("f"), "f.bin")) == new  # never old chunk_0 from the tier
    assert b.counters()["shared_hits"] == 0
    # A is pinned to the old version: what it staged is the old bytes, the rest fails
    assert read(os.path.join(a.tag("f"), "chunk_0")) == old[:MiB]
    assert read_errno(os.path.join(a.tag("f"), "chunk_1")) == 5
    c = cluster("c")  # a node after both: the new version's objects, B published them
    assert read(os.path.join(c.tag("f"), "f.bin")) == new
    assert settled(c)["source_reads"] == 0


def test_a_failing_shared_endpoint_degrades_to_the_source_then_publishing_resumes(
        cluster, s3_env, sample):
    src = sample(8 * MiB)
    data = read(src)
    endpoint = urlsplit(s3_env)
    with LatencyProxy(endpoint.hostname, endpoint.port, delay_ms=0, conn_mbps=None) as proxy:
        proxy_url = f"http://127.0.0.1:{proxy.port}"
        a = cluster("a", src, args=["--shared-store-endpoint-url", proxy_url])
        tag = a.tag("field")
        assert read(os.path.join(tag, "chunk_0")) == data[:MiB]
        proxy.set_faults(FaultPlan(FaultRule("status", fraction=1.0, status=503)))
        started = time.monotonic()
        for i in (1, 2, 3):  # the source still serves every read
            assert read(os.path.join(tag, f"chunk_{i}")) == data[i * MiB:(i + 1) * MiB]
        assert time.monotonic() - started < 20
        # its claims and (behind the reads) its publishes fail: counted, never a read
        deadline = time.monotonic() + 10
        while not (c := a.counters())["shared_errors"] + c["claim_errors"]:
            assert time.monotonic() < deadline, c
            time.sleep(0.1)
        proxy.set_faults(FaultPlan(FaultRule("reset", fraction=1.0, after_bytes=None)))
        assert read(os.path.join(tag, "chunk_4")) == data[4 * MiB:5 * MiB]
        proxy.set_faults(None)  # the endpoint is back
        time.sleep(2.5)  # past the back-off
        before = a.counters()["shared_publishes"]
        for i in (5, 6, 7):
            assert read(os.path.join(tag, f"chunk_{i}")) == data[i * MiB:(i + 1) * MiB]
        deadline = time.monotonic() + 20
        while a.counters()["shared_publishes"] < before + 3:
            assert time.monotonic() < deadline, a.counters()
            time.sleep(0.2)


def test_an_unreachable_shared_store_refuses_the_mount_and_changes_nothing(s3_env, sample,
                                                                           tmp_path):
    src = sample(MiB)
    store, mnt = tmp_path / "store", tmp_path / "mnt"
    mnt.mkdir()
    started = time.monotonic()
    r = run_faultfs("mount", src, str(mnt), "--store", str(store), "--shared-store",
                    "s3://nowhere/x", "--shared-store-endpoint-url", "http://127.0.0.1:9")
    assert r.returncode != 0 and time.monotonic() - started < 30
    assert len(r.stderr.strip().splitlines()) == 1 and "cannot be used" in r.stderr
    assert not store.exists() and os.listdir(mnt) == []
    r = run_faultfs("mount", src, str(mnt), "--store", str(store), "--shared-store",
                    "s3://no-such-bucket-here/x")
    assert r.returncode != 0 and "cannot be used" in r.stderr and not store.exists()


@pytest.mark.parametrize("conditional", [True, False])
def test_concurrent_publishes_are_idempotent_with_and_without_conditional_puts(
        s3_env, make_bucket, conditional):
    from faultfs.sources import SourceOptions

    bucket = make_bucket()
    objects = open_objects(f"s3://{bucket}/p", SourceOptions(), conditional=conditional)
    assert objects.put("blobs/k/v/chunk_0", b"first", create=True)
    assert not objects.put("blobs/k/v/chunk_0", b"second", create=True)
    assert objects.get("blobs/k/v/chunk_0", limit=ANY) == b"first"
    assert objects.conditional is conditional  # moto honours If-None-Match: the real path
    assert objects.put("blobs/k/v/chunk_0", b"replaced")  # a damaged object is replaced
    assert objects.get("blobs/k/v/chunk_0", limit=ANY) == b"replaced"
    assert objects.list("blobs/") == ["blobs/k/v/chunk_0"]
    assert objects.get("blobs/none", limit=ANY) is None


@pytest.fixture
def netns():
    """A network namespace ``ns`` joined to the host by a veth pair: the host is 10.231.7.1,
    the namespace 10.231.7.2; the namespace's loopback is its own (it cannot reach the
    host's 127.0.0.1). Removed at teardown."""
    import shutil
    import subprocess

    if not shutil.which("ip") or not shutil.which("nsenter"):
        pytest.skip("needs iproute2 (ip) and util-linux (nsenter)")
    name = f"ffs{os.getpid() % 100000}"
    host, peer = f"{name}h", f"{name}n"

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    ip("netns", "add", name)
    try:
        ip("link", "add", host, "type", "veth", "peer", "name", peer)
        ip("link", "set", peer, "netns", name)
        ip("addr", "add", "10.231.7.1/24", "dev", host)
        ip("link", "set", host, "up")
        ip("netns", "exec", name, "ip", "addr", "add", "10.231.7.2/24", "dev", peer)
        ip("netns", "exec", name, "ip", "link", "set", peer, "up")
        ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
        yield name
    finally:
        subprocess.run(["ip", "link", "del", host], capture_output=True)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_a_node_in_another_network_namespace_serves_from_the_tier_without_the_source(
        s3_env, s3_client, netns, http_server, mounter, tmp_path):
    """Node A reads an HTTP source on the host's loopback; node B runs in its own network
    namespace, where that address is not reachable but the shared store (an S3 endpoint on
    the veth address) is: B serves what A staged, fails the rest with EIO, reads no source."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="10.231.7.1", port=0, verbose=False)
    server.start()
    try:
        endpoint = "http://{}:{}".format(*server.get_host_and_port())
        import boto3

        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="tier")
        data = payload(4 * MiB, 21)
        url = http_server.put("/data/field.bin", data)
        shared = ["--shared-store", "s3://tier/c", "--shared-store-endpoint-url", endpoint]
        a = mounter(url, store=str(tmp_path / "store-a"), args=[*NODE, *shared])
        for i in (0, 3):
            assert read(os.path.join(a.tag("field"), f"chunk_{i}")) == data[i * MiB:(i + 1) * MiB]
        assert settled(a)["shared_publishes"] == 2
        mnt, store = tmp_path / "mnt-b", tmp_path / "store-b"
        mnt.mkdir()
        import subprocess

        from conftest import FAULTFS, ROOT

        r = subprocess.run(["nsenter", f"--net=/run/netns/{netns}", *FAULTFS, "mount",
                            str(mnt), "--store", str(store), "--reserve-mb", "0", *NODE,
                            *shared], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert r.returncode == 0, r.stderr
        try:
            from conftest import Mount

            b = Mount(str(mnt), str(store))
            tag = b.tag("field")
            assert read(os.path.join(tag, "chunk_3")) == data[3 * MiB:]
            with open(os.path.join(tag, "field.bin"), "rb") as f:
                assert f.read(100) == data[:100]  # the view, over chunk_0 from the tier
            assert read_errno(os.path.join(tag, "chunk_1")) == 5
            c = b.counters()
            assert c["source_reads"] == 0 and c["shared_hits"] == 2
            assert "source unavailable" in run_faultfs("stat", str(mnt), check=True).stdout
        finally:
            run_faultfs("umount", str(mnt))
    finally:
        server.stop()


@pytest.mark.parametrize("claims", [True, False])
def test_a_tier_load_is_one_get_and_a_miss_one_request_or_none(cluster, s3_env, sample,
                                                                claims):
    """A load of a blob object is one GET (no HEAD for its size first), and a miss one
    request without claims; with claims none: the window's claim object, which a node asks
    for anyway, names the blobs published (counted at a proxy in front of the shared store).
    Before, a node with claims asked for every blob it missed (a GET 404) before its claim."""
    src = sample(3 * MiB)
    data = read(src)
    endpoint = urlsplit(s3_env)
    with LatencyProxy(endpoint.hostname, endpoint.port, delay_ms=0, conn_mbps=None) as proxy:
        shared = ["--shared-store-endpoint-url", f"http://127.0.0.1:{proxy.port}",
                  *([] if claims else ["--no-shared-claims"])]
        a = cluster("a", src, args=shared)
        assert read(os.path.join(a.tag("field"), "chunk_0")) == data[:MiB]
        settled(a)
        b = cluster("b", args=shared)
        proxy.reset_stats()
        assert read(os.path.join(b.tag("field"), "chunk_0")) == data[:MiB]  # a hit
        assert read(os.path.join(b.tag("field"), "chunk_1")) == data[MiB:2 * MiB]  # a miss
        blobs = [r for r in proxy.stats()["log"] if "/blobs/" in r["path"]
                 or (r["method"] != "PUT" and "list-type" in r["path"])]
        reads = [r for r in blobs if r["method"] != "PUT"]
        assert [r["method"] for r in reads] == ["GET", "GET"][:2 if not claims else 1], reads
        # a ranged GET (206): never more than a blob object of the tag can be
        assert sorted(r["status"] for r in reads) == [206, 404][:2 if not claims else 1]
        assert b.counters()["shared_index_misses"] == (1 if claims else 0)
        settled(b)  # b's publish of the missed blob goes through the proxy: done before it stops
