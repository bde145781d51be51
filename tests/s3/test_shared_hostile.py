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
    assert c["shared_damaged"] == 1 and c["shared_hits"] == 0 and c["source_reads"] == 1
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
