"""The shared store against a hostile writer (anyone with the bucket's write credentials, as
every node has): objects of any size cost a bounded amount of memory and time, and — with
``--shared-store-key`` — a forged object is never served. moto in server mode on loopback,
several daemons, one bucket (DESIGN §13; docs/decisions.md, "Who can write the shared
store")."""

from __future__ import annotations

import os
import time

import pytest

from .test_mount_s3 import read
from .test_mount_shared import settled

pytestmark = [pytest.mark.mount, pytest.mark.s3]
MiB = 1 << 20
NODE = ["--chunk-size", "1M", "--prefetch-mb", "0"]
HUGE = 160 * MiB  # a forged object: many times what its kind can be


@pytest.fixture
def cluster(s3_env, make_bucket, mounter, tmp_path):
    """``node(name, *sources, args=...)``: a daemon with its own store; all share one bucket
    (``node.bucket``, objects under ``node.prefix``)."""
    bucket = make_bucket()

    def node(name: str, *sources: str, args=()):
        return mounter(*sources, store=str(tmp_path / f"store-{name}"),
                       args=[*NODE, "--shared-store", f"s3://{bucket}/cluster", *args])

    node.bucket = bucket
    node.prefix = "cluster/"
    return node


def keys(s3_client, bucket: str, prefix: str) -> list[str]:
    found = s3_client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return sorted(o["Key"] for o in found)


def peak_mib(pid: int) -> float:
    """The daemon's peak resident memory so far (VmHWM), in MiB."""
    with open(f"/proc/{pid}/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return kib / 1024


def test_a_huge_blob_object_costs_one_blob_not_its_size_and_is_replaced(
        cluster, s3_client, sample):
    """A blob object is read no further than a blob object of its tag can be (header and
    one blob): a 512 MiB object took the daemon to 1.1 GiB. It is refused by its length,
    the blob re-faulted from the source and published over it."""
    src = sample(4 * MiB)
    data = read(src)
    a = cluster("a", src)
    assert read(os.path.join(a.tag("field"), "chunk_0")) == data[:MiB]
    settled(a)
    [blob] = keys(s3_client, cluster.bucket, cluster.prefix + "blobs/")
    s3_client.put_object(Bucket=cluster.bucket, Key=blob, Body=bytes(HUGE))
    b = cluster("b")
    before = peak_mib(b.pid)
    assert read(os.path.join(b.tag("field"), "chunk_0")) == data[:MiB]
    grew = peak_mib(b.pid) - before
    assert grew < 48, f"the daemon grew {grew:.0f} MiB reading a {HUGE >> 20} MiB object"
    c = settled(b)
    assert c["shared_damaged"] >= 1 and c["shared_hits"] == 0 and c["source_reads"] == 1
    size = s3_client.head_object(Bucket=cluster.bucket, Key=blob)["ContentLength"]
    assert size < 2 * MiB, "the blob was not published over the huge object"


def test_a_huge_tag_state_neither_slows_the_mount_nor_takes_its_memory(
        cluster, s3_client, sample):
    """A tag state (and a claim) is read no further than its kind can be: a 300 MiB tag
    state made a mount take 33 s. It is ignored (the tag is served, its version taken from
    the source)."""
    src = sample(2 * MiB)
    data = read(src)
    a = cluster("a", src)
    assert read(os.path.join(a.tag("field"), "chunk_0")) == data[:MiB]
    settled(a)
    for what in ("state.json", "claim"):  # (a pagemap may be 64 MiB: MAX_PAGEMAP_TEXT)
        s3_client.put_object(Bucket=cluster.bucket, Key=f"{cluster.prefix}tags/field/{what}",
                             Body=b" " * HUGE)
    started = time.monotonic()
    b = cluster("b")
    took = time.monotonic() - started
    assert peak_mib(b.pid) < peak_mib(a.pid) + 48, "the mount read a huge object whole"
    assert took < 15, f"the mount took {took:.1f} s"
    assert read(os.path.join(b.tag("field"), "field.bin")) == data


# -- sealed objects: --shared-store-key ------------------------------------------------------


def key_file(tmp_path, name: str = "cluster.key") -> str:
    path = tmp_path / name
    path.write_text(os.urandom(32).hex() + "\n")
    path.chmod(0o600)
    return str(path)


def forge(raw: bytes, size: int) -> bytes:
    """A blob object for what ``raw`` (a published one) holds, with another payload: its
    header and every checksum valid, and a seal's trailer of random bytes (a writer that
    knows the format but not the key)."""
    from faultfs.store.blobfile import HEADER_LEN, decode_header, encode_header
    from faultfs.tiers.sealed import MAGIC

    h = decode_header(raw[:HEADER_LEN])
    forged = b"forged by a writer of the bucket " * (size // 33 + 1)
    header, _ = encode_header(h.tag, h.name, forged[:size], flags=0,
                              source_version=h.source_version)
    return header + forged[:size] + MAGIC + os.urandom(32)


def test_a_forged_blob_object_is_never_served_where_the_key_is_configured(
        cluster, s3_client, sample, tmp_path):
    """A writer of the bucket puts a blob object with a valid header and checksums and the
    wrong payload: every node without the key serves it (the checksums catch accidents,
    not a writer); a node with the cluster key refuses it, reads the source, and publishes
    the blob over it, sealed."""
    src = sample(3 * MiB)
    data = read(src)
    key = ["--shared-store-key", key_file(tmp_path)]
    a = cluster("a", src, args=key)
    assert read(os.path.join(a.tag("field"), "chunk_0")) == data[:MiB]
    settled(a)
    [blob] = keys(s3_client, cluster.bucket, cluster.prefix + "blobs/")
    raw = s3_client.get_object(Bucket=cluster.bucket, Key=blob)["Body"].read()
    s3_client.put_object(Bucket=cluster.bucket, Key=blob, Body=forge(raw, MiB))

    b = cluster("b", args=key)
    assert read(os.path.join(b.tag("field"), "chunk_0")) == data[:MiB]
    c = settled(b)
    assert c["shared_damaged"] >= 1 and c["shared_hits"] == 0 and c["source_reads"] == 1
    d = cluster("d", args=key)  # published over, sealed: served from the tier again
    assert read(os.path.join(d.tag("field"), "chunk_0")) == data[:MiB]
    assert settled(d)["shared_hits"] == 1 and d.counters()["source_reads"] == 0
    assert "sealed" in d.stats()["shared"] and d.stats()["shared"]["sealed"]

    s3_client.put_object(Bucket=cluster.bucket, Key=blob, Body=forge(raw, MiB))
    e = cluster("e", src)  # without the key: what the threat is
    assert read(os.path.join(e.tag("field"), "chunk_0")).startswith(b"forged by a writer")


def test_a_node_without_the_key_publishes_nothing_keyed_nodes_accept(
        cluster, s3_client, sample, tmp_path):
    """What a node without the cluster key publishes (blobs, the registration) is never
    used by a keyed node: it reads the source, and registers and publishes over it."""
    src = sample(2 * MiB)
    data = read(src)
    u = cluster("u", src)
    assert read(os.path.join(u.tag("field"), "field.bin")) == data
    assert settled(u)["shared_publishes"] == 2
    key = ["--shared-store-key", key_file(tmp_path)]
    k = cluster("k", src, args=key)
    assert read(os.path.join(k.tag("field"), "field.bin")) == data
    c = settled(k)
    assert c["shared_hits"] == 0 and c["shared_damaged"] >= 2 and c["source_reads"] == 2
    k2 = cluster("k2", args=key)  # no source given: the registration is k's, sealed
    assert read(os.path.join(k2.tag("field"), "field.bin")) == data
    assert settled(k2)["shared_hits"] == 2 and k2.counters()["source_reads"] == 0


@pytest.mark.parametrize("content", [b"short\n", b""])
def test_a_key_file_that_holds_no_key_refuses_the_mount(s3_env, make_bucket, sample, tmp_path,
                                                        content):
    from conftest import run_faultfs

    bad = tmp_path / "bad.key"
    bad.write_bytes(content)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = run_faultfs("mount", sample(MiB), str(mnt), "--store", str(tmp_path / "store"),
                    "--shared-store", f"s3://{make_bucket()}/c", "--shared-store-key", str(bad))
    assert r.returncode != 0 and "shared store key" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not os.path.ismount(mnt)
