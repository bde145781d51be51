"""faultfs::s3:// against a real S3 server on loopback (moto): fsspec's behaviour checked against
s3fs on the same objects, chained URLs in pandas and xarray, a new object version is a new
tag, 8 processes reading one object through one store read it from S3 once, hostile URLs."""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import subprocess
import sys
import time

import fsspec
import pytest

from faultfs.fsspec import FaultFileSystem, OptionError, ReadOnlyError

pytestmark = pytest.mark.s3
MiB = 1 << 20


def payload(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


@pytest.fixture
def bucket(make_bucket):
    return make_bucket(versioned=True)


def faultfs(store, **more) -> FaultFileSystem:
    return fsspec.filesystem("faultfs", target_protocol="s3", store=str(store), reserve_mb=0,
                             chunk_size="256k", skip_instance_cache=True, **more)


def test_behaves_like_s3fs_on_the_same_objects(s3_client, bucket, tmp_path):
    sizes = {"a/zero.bin": 0, "a/one.bin": 1, "a/mid.bin": 300_001, "b/big.bin": 2 * MiB + 7}
    for key, size in sizes.items():
        s3_client.put_object(Bucket=bucket, Key=key, Body=payload(size, size))
    ours = faultfs(tmp_path / "store")
    ref = fsspec.filesystem("s3", skip_instance_cache=True, use_listings_cache=False)
    assert ours.ls(bucket, detail=False) == ref.ls(bucket, detail=False)
    assert ours.find(bucket) == ref.find(bucket)
    assert ours.glob(f"{bucket}/*/*.bin") == ref.glob(f"{bucket}/*/*.bin")
    rng = random.Random(3)
    for key, size in sizes.items():
        path = f"{bucket}/{key}"
        assert ours.info(path)["size"] == ref.info(path)["size"] == size
        with ours.open(path) as f, ref.open(path) as g:
            for _ in range(60):
                off = rng.randrange(0, size + 10)
                n = rng.choice([-1, 0, 1, 4096, 65536, 700_000])
                whence = rng.choice([0, 1, 2])
                pos = off if whence == 0 else (off - size if whence == 2 else 0)
                try:
                    expect = g.seek(pos, whence)
                except ValueError:
                    with pytest.raises(ValueError):
                        f.seek(pos, whence)
                    continue
                assert f.seek(pos, whence) == expect
                assert f.read(n) == g.read(n)
                assert f.tell() == g.tell()
    big = f"{bucket}/b/big.bin"
    assert ours.cat_ranges([big, big], [0, MiB], [100, None]) == ref.cat_ranges(
        [big, big], [0, MiB], [100, None])
    with pytest.raises(ReadOnlyError):
        ours.open(big, "wb")
    with pytest.raises(FileNotFoundError):
        ours.open(f"{bucket}/absent")
    stats = ours.stats()
    assert stats["faults"] > 0 and stats["hits"] > 0


def test_chained_urls_in_pandas_xarray_and_h5py(s3_client, bucket, tmp_path, s3_env):
    pd = pytest.importorskip("pandas")
    h5py = pytest.importorskip("h5py")
    numpy = pytest.importorskip("numpy")
    frame = pd.DataFrame({"x": numpy.arange(50_000), "y": numpy.arange(50_000) * 0.5})
    buf = io.BytesIO()
    frame.to_parquet(buf)
    s3_client.put_object(Bucket=bucket, Key="t.parquet", Body=buf.getvalue())
    h5 = tmp_path / "field.h5"
    with h5py.File(h5, "w") as f:
        f.create_dataset("temperature", data=numpy.arange(200_000, dtype="f4").reshape(400, 500))
    s3_client.put_object(Bucket=bucket, Key="field.h5", Body=h5.read_bytes())
    options = {"faultfs": {"store": str(tmp_path / "store"), "reserve_mb": 0},
               "s3": {"endpoint_url": s3_env}}
    back = pd.read_parquet(f"faultfs::s3://{bucket}/t.parquet", storage_options=options)
    assert back.equals(frame)
    with fsspec.open(f"faultfs::s3://{bucket}/field.h5", **options) as f, h5py.File(f) as h:
        assert h["temperature"][3, :5].tolist() == [1500.0, 1501.0, 1502.0, 1503.0, 1504.0]
    xr = pytest.importorskip("xarray")
    pytest.importorskip("h5netcdf")
    nc = tmp_path / "field.nc"
    xr.Dataset({"t": (("a", "b"), numpy.ones((30, 40), "f8"))}).to_netcdf(nc, engine="h5netcdf")
    s3_client.put_object(Bucket=bucket, Key="field.nc", Body=nc.read_bytes())
    with fsspec.open(f"faultfs::s3://{bucket}/field.nc", **options) as f, xr.open_dataset(
            f, engine="h5netcdf") as ds:
        assert float(ds["t"].sum()) == 1200.0


def test_a_new_object_version_is_a_new_tag(s3_client, bucket, tmp_path):
    old, new = payload(600_000, 1), payload(600_000, 2)
    s3_client.put_object(Bucket=bucket, Key="v.bin", Body=old)
    fs = faultfs(tmp_path / "store", pin_ttl=0)  # every open asks S3 (the ttl: test_fsspec.py)
    first = fs.open(f"{bucket}/v.bin")
    assert first.read(1000) == old[:1000]
    s3_client.put_object(Bucket=bucket, Key="v.bin", Body=new)
    with fs.open(f"{bucket}/v.bin") as second:
        assert second.read() == new
    first.seek(0)
    assert first.read() == old  # its pinned version, the staged chunk and the rest alike
    first.close()
    tags = [t for t in os.listdir(tmp_path / "store" / "tags") if t.startswith("t-.fsspec-")]
    assert len(tags) == 2


CHILD = r"""
import hashlib, json, sys, time
import fsspec
store, url, start_at = sys.argv[1], sys.argv[2], float(sys.argv[3])
fs = fsspec.filesystem("faultfs", target_protocol="s3", store=store, reserve_mb=0,
                       chunk_size="1M", skip_instance_cache=True)
while time.time() < start_at:
    time.sleep(0.001)
with fs.open(url) as f:
    data = f.read()
fs.drain()
print(json.dumps({"sha": hashlib.sha256(data).hexdigest(), "stats": fs.stats()}))
"""


def test_an_object_a_live_mount_staged_is_read_from_its_blobs(mounter, s3_client, bucket,
                                                               tmp_path):
    """An S3 object mounted and read through the mount, then opened through faultfs:: on the
    same store with the same chunk size: every chunk is the mount's blob, nothing from S3."""
    data = payload(3 * MiB + 5, 11)
    s3_client.put_object(Bucket=bucket, Key="run9/field.bin", Body=data)
    store = tmp_path / "store"
    m = mounter(f"s3://{bucket}/run9/field.bin", store=str(store), args=["--chunk-size", "1M"])
    with open(os.path.join(m.tag("field"), "field.bin"), "rb") as f:
        assert f.read() == data
    m.wait_staged("field", 4)  # the mount stores its blobs behind its readers
    fs = fsspec.filesystem("faultfs", target_protocol="s3", store=str(store), reserve_mb=0,
                           chunk_size="1M", skip_instance_cache=True)
    with fs.open(f"{bucket}/run9/field.bin") as f:
        assert f.read() == data
    stats = fs.stats()
    assert stats.get("mount_hits") == 4 and stats.get("source_bytes", 0) == 0, stats


def test_eight_processes_read_one_object_from_s3_once(s3_client, bucket, tmp_path):
    data = payload(8 * MiB, 8)
    s3_client.put_object(Bucket=bucket, Key="shared.bin", Body=data)
    start = time.time() + 2.0
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path / "store"),
                               f"{bucket}/shared.bin", str(start)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(8)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        results.append(json.loads(out))
    assert {r["sha"] for r in results} == {hashlib.sha256(data).hexdigest()}
    from_source = sum(r["stats"].get("source_bytes", 0) for r in results)
    assert from_source <= 1.05 * len(data)


@pytest.mark.parametrize(("url", "error", "words"), [
    ("faultfs://bucket/key", OptionError, "needs a target"),
    ("faultfs::nosuchproto://bucket/key", ValueError, "nosuchproto"),
    ("faultfs::s3://bucket/a\x00b", OptionError, "NUL"),
    ("faultfs::", OSError, "does not exist"),
])
def test_hostile_urls_refused_in_one_line(tmp_path, s3_env, url, error, words):
    with pytest.raises(error) as err:
        fsspec.open(url, faultfs={"store": str(tmp_path / "store")}).open()
    assert words in str(err.value) and "\n" not in str(err.value)


def test_credentials_in_urls_never_reach_the_store(s3_client, bucket, tmp_path, fake_aws):
    s3_client.put_object(Bucket=bucket, Key="k.bin", Body=payload(1000, 5))
    fs = faultfs(tmp_path / "store")
    with fs.open(f"{bucket}/k.bin") as f:
        assert f.read() == payload(1000, 5)
    for base, _, names in os.walk(tmp_path / "store"):
        for name in names:
            with open(os.path.join(base, name), "rb") as f:
                assert fake_aws.secret.encode() not in f.read()


def test_the_example_runs(tmp_path):
    """examples/fsspec_s3.py: xarray and pandas through faultfs::s3:// against its own moto."""
    pytest.importorskip("xarray")
    pytest.importorskip("h5netcdf")
    example = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "fsspec_s3.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_CONFIG_FILE=str(tmp_path / "none"), AWS_SHARED_CREDENTIALS_FILE=str(
        tmp_path / "none"), AWS_EC2_METADATA_DISABLED="true", TMPDIR=str(tmp_path))
    out = subprocess.run([sys.executable, example], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "mean temperature at hour 12" in out.stdout and "refused:" in out.stdout
    assert "table: 100000 rows" in out.stdout
