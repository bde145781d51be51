"""Remote sources through real mounts: S3 objects on moto (loopback) and HTTP(S) URLs, mounted
with the daemonized CLI.

The daemon inherits the test's environment, so the fake credentials and ``AWS_ENDPOINT_URL``
that ``s3_env`` sets reach it (one test passes ``--s3-endpoint-url`` instead, with the variable
unset). Every test checks bytes against what was uploaded, with ``cmp`` or byte comparisons;
changed and failing sources must give ``EIO`` and never other bytes.
"""

from __future__ import annotations

import errno
import json
import os
import random
import subprocess
import sys
import time

import pytest
from conftest import run_faultfs

from faultfs.sources.retry import DEFAULT_RETRY

from .conftest import FAKE_KEY_ID, FAKE_SECRET, REGION

pytestmark = [pytest.mark.mount, pytest.mark.s3]

KiB, MiB = 1 << 10, 1 << 20
FAKE_SESSION_TOKEN = "FQoGZXIvYXdzEFAKEsessionTOKENfaultfs0123456789"


def payload(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def read_errno(path: str, off: int = 0, size: int = 4096) -> int | None:
    """The errno a fresh read of ``[off, off+size)`` fails with, or None when it succeeds."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.pread(fd, size, off)
    except OSError as exc:
        return exc.errno
    finally:
        os.close(fd)
    return None


def same_as(expected: bytes, path: str, tmp_path) -> bool:
    """``cmp`` of ``path`` against ``expected`` (written to a local file first)."""
    ref = tmp_path / f"expected-{random.getrandbits(32):08x}"
    ref.write_bytes(expected)
    try:
        return subprocess.run(["cmp", str(ref), path], capture_output=True).returncode == 0
    finally:
        ref.unlink()


def log_text(store: str) -> str:
    return read(os.path.join(store, "log", "faultfs.log")).decode(errors="replace")


def stat_json(mountpoint: str) -> dict:
    return json.loads(run_faultfs("stat", mountpoint, "--json", check=True).stdout)


# --- one object, every chunk and the whole-object view ---


def test_s3_object_every_chunk_and_the_view(s3_env, s3_client, make_bucket, mounter, tmp_path,
                                            monkeypatch):
    bucket = make_bucket()
    data = payload(3 * MiB + 12345, 1)
    s3_client.put_object(Bucket=bucket, Key="run42/field.bin", Body=data)
    # the endpoint from the flag this time, not from the environment
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    m = mounter(f"s3://{bucket}/run42/field.bin", args=["--chunk-size", "1M",
                                                        "--s3-endpoint-url", s3_env])
    tag = m.tag("field")
    assert sorted(os.listdir(tag)) == ["chunk_0", "chunk_1", "chunk_2", "chunk_3", "field.bin"]
    for i in range(4):
        piece = data[i * MiB:(i + 1) * MiB]
        assert same_as(piece + bytes(MiB - len(piece)), os.path.join(tag, f"chunk_{i}"),
                       tmp_path), f"chunk_{i}"
    assert os.path.getsize(os.path.join(tag, "field.bin")) == len(data)
    assert same_as(data, os.path.join(tag, "field.bin"), tmp_path)
    c = m.counters()
    assert (c["source_reads"], c["fault_errors"]) == (4, 0), "each chunk read from S3 once"
    info = stat_json(m.path)["tags"]["field"]
    assert info["source"] == f"s3://{bucket}/run42/field.bin"
    assert info["source_version"].startswith(f"{len(data)} etag:")


def test_a_remount_reaches_the_endpoint_the_tag_was_registered_with(
        s3_env, s3_client, make_bucket, mounter, tmp_path, monkeypatch):
    """--s3-endpoint-url is kept in the tag's state: a remount with no source, no flag and
    no AWS_ENDPOINT_URL still faults the chunks not staged yet from the same endpoint."""
    bucket = make_bucket()
    data = payload(3 * MiB + 5, 7)
    s3_client.put_object(Bucket=bucket, Key="run7/field.bin", Body=data)
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    m = mounter(f"s3://{bucket}/run7/field.bin", args=["--chunk-size", "1M", "--prefetch-mb", "0",
                                                       "--s3-endpoint-url", s3_env])
    assert read(os.path.join(m.tag("field"), "chunk_0")) == data[:MiB]
    m.wait_staged("field", 1)
    m.umount()
    m2 = mounter(store=m.store, mountpoint=m.path)
    assert stat_json(m2.path)["tags"]["field"]["remote"] == {"s3_endpoint_url": s3_env}
    assert same_as(data, os.path.join(m2.tag("field"), "field.bin"), tmp_path)
    c = m2.counters()
    assert (c["faults"], c["fault_errors"]) == (3, 0), "chunks 1-3 from the recorded endpoint"


def test_h5py_reads_an_hdf5_object_through_the_mount(s3_env, s3_client, make_bucket, mounter,
                                                     tmp_path):
    import h5py
    import numpy as np

    local = tmp_path / "field.h5"
    big = np.arange(2 * MiB // 4, dtype=np.float32)  # 2 MiB, contiguous
    small = np.random.default_rng(7).integers(0, 1 << 40, size=(64, 100))
    with h5py.File(local, "w") as f:
        f.create_dataset("big", data=big)
        f.create_dataset("small", data=small, chunks=(16, 100), compression="gzip")
        f.attrs["run"] = 42
    bucket = make_bucket()
    s3_client.put_object(Bucket=bucket, Key="run42/field.h5", Body=local.read_bytes())
    m = mounter(f"s3://{bucket}/run42/field.h5", args=["--chunk-size", "64K"])
    view = os.path.join(m.tag("field"), "field.h5")
    # h5py holds the GIL while HDF5 reads, and moto serves from a thread of this process:
    # read in a child process (as a user's program would)
    check = tmp_path / "check.py"
    check.write_text(
        "import sys, h5py, numpy as np\n"
        "with h5py.File(sys.argv[1], 'r') as f:\n"
        "    assert f.attrs['run'] == 42\n"
        "    np.save(sys.argv[2], f['small'][...])\n"
        "    np.save(sys.argv[3], f['big'][1000:1010] if sys.argv[4] == 'part' else f['big'][...])\n")

    def h5read(part: str) -> tuple:
        outs = (tmp_path / "small.npy", tmp_path / "big.npy")
        subprocess.run([sys.executable, str(check), view, *map(str, outs), part], check=True,
                       timeout=60)
        return tuple(np.load(o) for o in outs)

    got_small, got_big = h5read("part")
    assert np.array_equal(got_small, small)
    assert np.array_equal(got_big, big[1000:1010])
    assert np.array_equal(h5read("all")[1], big)
    assert m.counters()["fault_errors"] == 0


# --- globs: one tag per shard ---


def test_glob_of_three_shards_gives_three_tags(s3_env, s3_client, make_bucket, mounter, tmp_path):
    bucket = make_bucket()
    shards = {f"run42/part-{k}.bin": payload(300 * KiB + k, 10 + k) for k in (2, 0, 1)}
    for key, body in shards.items():
        s3_client.put_object(Bucket=bucket, Key=key, Body=body)
    s3_client.put_object(Bucket=bucket, Key="run42/notes.txt", Body=b"not a shard")
    m = mounter(f"s3://{bucket}/run42/part-*.bin", args=["--chunk-size", "128K"],
                store=str(tmp_path / "store1"))
    tags = stat_json(m.path)["tags"]
    assert sorted(tags) == ["part-0", "part-1", "part-2"]
    for k in range(3):
        assert tags[f"part-{k}"]["shard"] == k, "the shard index follows the sorted expansion"
        assert tags[f"part-{k}"]["source"] == f"s3://{bucket}/run42/part-{k}.bin"
        assert same_as(shards[f"run42/part-{k}.bin"],
                       os.path.join(m.tag(f"part-{k}"), f"part-{k}.bin"), tmp_path)

    # basenames that collide: made unique, in sorted order of the full keys
    for prefix in ("c", "a", "b"):
        s3_client.put_object(Bucket=bucket, Key=f"{prefix}/data.bin", Body=prefix.encode() * 1000)
    m2 = mounter(f"s3://{bucket}/*/data.bin", store=str(tmp_path / "store2"))
    tags = stat_json(m2.path)["tags"]
    assert {name: (t["shard"], t["source"]) for name, t in tags.items()} == {
        "data": (0, f"s3://{bucket}/a/data.bin"),
        "data-2": (1, f"s3://{bucket}/b/data.bin"),
        "data-3": (2, f"s3://{bucket}/c/data.bin"),
    }
    assert read(os.path.join(m2.tag("data-2"), "data.bin")) == b"b" * 1000


# --- an object overwritten while mounted, and on remount ---


def test_unversioned_overwrite_fails_with_eio_then_remount_refaults(
        s3_env, s3_client, make_bucket, mounter, tmp_path):
    bucket = make_bucket()
    key = "run42/field.bin"
    old, new = payload(4 * MiB, 20), payload(4 * MiB, 21)
    s3_client.put_object(Bucket=bucket, Key=key, Body=old)
    m = mounter(f"s3://{bucket}/{key}", args=["--chunk-size", "1M"])
    tag = m.tag("field")
    assert read(os.path.join(tag, "chunk_0")) == old[:MiB]  # staged from the pinned ETag

    s3_client.put_object(Bucket=bucket, Key=key, Body=new)
    assert read_errno(os.path.join(tag, "chunk_1")) == errno.EIO
    with pytest.raises(OSError) as exc:  # the whole view: no mix of old and new bytes
        read(os.path.join(tag, "field.bin"))
    assert exc.value.errno == errno.EIO
    assert read(os.path.join(tag, "chunk_0")) == old[:MiB], "staged bytes are the pinned version"
    assert m.counters()["fault_errors"] >= 1
    assert f"s3://{bucket}/{key} changed since it was opened" in log_text(m.store)

    m.wait_staged("field", 1)
    m.umount()
    m2 = mounter(store=m.store, mountpoint=m.path)  # no source: recovered from the registry
    out = run_faultfs("stat", m2.path, check=True).stdout
    assert "source changed since the last mount: 1 stale blobs dropped" in out
    assert same_as(new, os.path.join(m2.tag("field"), "field.bin"), tmp_path)
    assert m2.counters()["faults"] == 4, "every chunk re-faulted from the new version"


def test_versioned_overwrite_keeps_serving_the_pinned_version_until_remount(
        s3_env, s3_client, make_bucket, mounter, tmp_path):
    bucket = make_bucket(versioned=True)
    key = "run42/field.bin"
    old, new = payload(3 * MiB, 30), payload(3 * MiB, 31)
    s3_client.put_object(Bucket=bucket, Key=key, Body=old)
    src = f"s3://{bucket}/{key}"
    m = mounter(src, args=["--chunk-size", "1M"])
    tag = m.tag("field")
    assert read(os.path.join(tag, "chunk_0")) == old[:MiB]
    s3_client.put_object(Bucket=bucket, Key=key, Body=new)
    assert same_as(old, os.path.join(tag, "field.bin"), tmp_path), "the pinned VersionId"
    assert m.counters()["fault_errors"] == 0

    m.wait_staged("field", 3)
    m.umount()
    m2 = mounter(src, args=["--chunk-size", "1M"], store=m.store, mountpoint=m.path)
    out = run_faultfs("stat", m2.path, check=True).stdout
    assert "source changed since the last mount: 3 stale blobs dropped" in out
    assert same_as(new, os.path.join(m2.tag("field"), "field.bin"), tmp_path)
    assert stat_json(m2.path)["tags"]["field"]["source_version"].startswith(f"{len(new)} vid:")


# --- a source that fails: bounded retries, EIO, and the other tags keep serving ---


def test_failing_source_retries_then_eio_and_other_tags_keep_serving(
        s3_env, s3_client, make_bucket, mounter, faulty_proxy, tmp_path):
    bucket = make_bucket()
    good, bad = payload(2 * MiB, 40), payload(2 * MiB, 41)
    s3_client.put_object(Bucket=bucket, Key="good.bin", Body=good)
    s3_client.put_object(Bucket=bucket, Key="bad.bin", Body=bad)
    m = mounter(f"s3://{bucket}/good.bin", f"s3://{bucket}/bad.bin",
                args=["--chunk-size", "1M", "--s3-endpoint-url", faulty_proxy.endpoint])
    bad_path = f"/{bucket}/bad.bin"
    faulty_proxy.fail_path = bad_path
    faulty_proxy.fail_reads = 10**6  # every read of bad.bin answers 503 SlowDown

    started = time.monotonic()
    assert read_errno(os.path.join(m.tag("bad"), "chunk_0")) == errno.EIO
    assert time.monotonic() - started < 20, "bounded retries, not a hang"
    c = m.counters()
    assert c["fault_errors"] >= 1
    assert faulty_proxy.gets_of[bad_path] == DEFAULT_RETRY.attempts * c["fault_errors"], \
        "each failed fault made exactly the bounded number of tries"
    assert (f"reading source s3://{bucket}/bad.bin [0, {MiB}) failed after "
            f"{DEFAULT_RETRY.attempts} tries: SlowDown (HTTP 503)") in log_text(m.store)

    # the same daemon keeps serving the other tag, and its own stats
    assert same_as(good, os.path.join(m.tag("good"), "good.bin"), tmp_path)
    assert m.stats()["pid"] == m.pid

    # a transient failure shorter than the bound is ridden out
    faulty_proxy.gets_of.clear()
    faulty_proxy.fail_reads = 2
    assert read(os.path.join(m.tag("bad"), "chunk_1")) == bad[MiB:]
    assert faulty_proxy.gets_of[bad_path] == 3
    # and the failed chunk was never staged: it faults again, with the right bytes
    assert same_as(bad, os.path.join(m.tag("bad"), "bad.bin"), tmp_path)


# --- HTTP(S) sources ---


def test_http_source_through_a_mount(http_server, mounter, tmp_path):
    old, new = payload(1 * MiB + 999, 50), payload(1 * MiB + 999, 51)
    url = http_server.put("/data/field.bin", old)
    m = mounter(url, args=["--chunk-size", "256K"])
    tag = m.tag("field")
    names = sorted(os.listdir(tag))
    assert names == ["chunk_0", "chunk_1", "chunk_2", "chunk_3", "chunk_4", "field.bin"]
    for i in range(5):
        piece = old[i * 256 * KiB:(i + 1) * 256 * KiB]
        assert read(os.path.join(tag, f"chunk_{i}")) == piece + bytes(256 * KiB - len(piece))
    assert same_as(old, os.path.join(tag, "field.bin"), tmp_path)
    assert 1 <= http_server.range_gets <= 5  # one GET per chunk at most; read-ahead runs share one
    assert stat_json(m.path)["tags"]["field"]["source_version"] == f"{len(old)} etag:\"v1\""

    m2 = mounter(url, args=["--chunk-size", "256K"], store=str(tmp_path / "store2"))
    http_server.put("/data/field.bin", new)  # changed under the second mount
    assert read_errno(os.path.join(m2.tag("field"), "field.bin")) == errno.EIO
    m2.umount()
    m3 = mounter(store=m2.store, mountpoint=m2.path)
    assert same_as(new, os.path.join(m3.tag("field"), "field.bin"), tmp_path)


# --- secrets: nothing persisted holds one ---


def _persisted_bytes(m) -> dict[str, bytes]:
    """Every registry file of the mount, and every file under its store."""
    out = {}
    registry = os.path.join(m.path, ".faultfs", "registry")
    for name in os.listdir(registry):
        out[os.path.join(registry, name)] = read(os.path.join(registry, name))
    for root, _, files in os.walk(m.store):
        for name in files:
            if name.endswith(".lock"):
                continue
            out[os.path.join(root, name)] = read(os.path.join(root, name))
    return out


def test_registry_and_store_hold_no_secret(s3_env, make_bucket, mounter, http_server, tmp_path,
                                           monkeypatch):
    import boto3
    from botocore.config import Config

    monkeypatch.setenv("AWS_SESSION_TOKEN", FAKE_SESSION_TOKEN)
    client = boto3.client("s3", endpoint_url=s3_env, region_name=REGION,
                          aws_access_key_id=FAKE_KEY_ID, aws_secret_access_key=FAKE_SECRET,
                          aws_session_token=FAKE_SESSION_TOKEN,
                          config=Config(signature_version="s3v4"))
    bucket = make_bucket()
    data = payload(2 * MiB + 5, 60)
    client.put_object(Bucket=bucket, Key="run42/env.bin", Body=data)
    for key in ("signed", "cold"):
        client.put_object(Bucket=bucket, Key=f"run42/{key}.bin", Body=data)
    presigned, cold = (client.generate_presigned_url(
        "get_object", Params={"Bucket": bucket, "Key": f"run42/{key}.bin"}, ExpiresIn=900)
        for key in ("signed", "cold"))
    assert "X-Amz-Signature=" in presigned and "X-Amz-Security-Token=" in presigned
    http_server.require_basic = ("reader", "pa55-w0rd-faultfs")
    userinfo = http_server.put("/data/auth.bin", data).replace(
        "http://", "http://reader:pa55-w0rd-faultfs@")

    m = mounter(f"s3://{bucket}/run42/env.bin", presigned, cold, userinfo,
                args=["--chunk-size", "1M"])
    for name, view in (("env", "env.bin"), ("signed", "signed.bin"), ("auth", "auth.bin")):
        assert same_as(data, os.path.join(m.tag(name), view), tmp_path), name
    secrets = [FAKE_KEY_ID, FAKE_SECRET, FAKE_SESSION_TOKEN, "pa55-w0rd-faultfs",
               *(url.rpartition("X-Amz-Signature=")[2] for url in (presigned, cold))]
    sources = {t: i["source"] for t, i in stat_json(m.path)["tags"].items()}
    assert sources["auth"] == userinfo.replace("reader:pa55-w0rd-faultfs@", "***@")
    assert "X-Amz-Signature=***" in sources["signed"]
    assert "X-Amz-Credential=***" in sources["signed"]
    assert "X-Amz-Security-Token=***" in sources["signed"]

    files = _persisted_bytes(m)
    assert any("/registry/" in p for p in files) and any("__cae_on_fault" in p for p in files)
    stat_text = run_faultfs("stat", m.path, "--json", check=True).stdout.encode()
    for path, content in [*files.items(), ("faultfs stat --json", stat_text)]:
        for secret in secrets:
            assert secret.encode() not in content, f"{path} holds a secret"

    # a remount without the sources cannot re-open the credential URLs and says so; staged
    # blobs still serve, a fault fails with EIO; the S3 tag (environment credentials) works
    for name in ("signed", "auth"):
        m.wait_staged(name, 3)
    m.umount()
    m2 = mounter(store=m.store, mountpoint=m.path)
    tags = stat_json(m2.path)["tags"]
    assert tags["env"]["source_error"] == ""
    for name in ("signed", "cold", "auth"):
        assert "registered with credentials in its URL" in tags[name]["source_error"]
    for name in ("signed", "auth"):
        assert same_as(data, os.path.join(m2.tag(name), f"{name}.bin"), tmp_path), name
    assert read_errno(os.path.join(m2.tag("cold"), "cold.bin")) == errno.EIO  # never staged
    assert "source unavailable" in run_faultfs("stat", m2.path, check=True).stdout
    m2.umount()
    # given again, the same URLs find their contexts (and staged blobs) and can fault again
    m3 = mounter(presigned, cold, store=m.store, mountpoint=m.path, args=["--chunk-size", "1M"])
    assert read(os.path.join(m3.tag("signed"), "signed.bin")) == data
    assert m3.counters()["source_reads"] == 0, "signed.bin was staged by the first mount"
    assert same_as(data, os.path.join(m3.tag("cold"), "cold.bin"), tmp_path)
    assert stat_json(m3.path)["tags"]["cold"]["source_error"] == ""
    for path, content in _persisted_bytes(m3).items():
        for secret in secrets:
            assert secret.encode() not in content, f"{path} holds a secret"


def test_presigned_url_refused_on_head_is_read_with_get(http_server, mounter, tmp_path):
    data = payload(300 * KiB, 70)
    http_server.require_query = {"X-Amz-Signature": "0123abcd"}
    url = http_server.put("/b/k.bin", data) + (
        "?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Expires=900&X-Amz-Signature=0123abcd")
    m = mounter(url, args=["--chunk-size", "128K"])
    assert same_as(data, os.path.join(m.tag("k"), "k.bin"), tmp_path)
    assert stat_json(m.path)["tags"]["k"]["source"].endswith("&X-Amz-Signature=***")
