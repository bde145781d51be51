"""S3 sources through s3fs against a real moto server on loopback: ranges, pinning, retries, globs.

The AWS-configuration tests at the top are pure (no server) and carry no marker.
"""

from __future__ import annotations

import errno
import os
import random
import time

import pytest
from conftest import check_concurrent_preads

from faultfs.errors import InvalidInput, SourceError
from faultfs.sources import SourceOptions, SourceVersion, expand_sources, open_source, remote
from faultfs.sources.filesystems import s3_filesystem_kwargs
from faultfs.sources.remote import open_fsspec_source
from faultfs.sources.retry import RetryPolicy

# Retries that take milliseconds, so failing tests stay fast.
QUICK = RetryPolicy(attempts=3, base_delay_s=0.001, max_delay_s=0.005)


def payload(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


# --- AWS configuration resolution (pure) ---


def test_endpoint_precedence_option_then_service_env_then_global_env() -> None:
    env = {"AWS_ENDPOINT_URL": "http://global", "AWS_ENDPOINT_URL_S3": "http://s3only"}
    assert s3_filesystem_kwargs(SourceOptions(), env)["endpoint_url"] == "http://s3only"
    assert s3_filesystem_kwargs(SourceOptions(), {"AWS_ENDPOINT_URL": "http://g"})[
        "endpoint_url"] == "http://g"
    opts = SourceOptions(s3_endpoint_url="http://flag")
    assert s3_filesystem_kwargs(opts, env)["endpoint_url"] == "http://flag"
    ignored = {**env, "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS": "true"}
    assert "endpoint_url" not in s3_filesystem_kwargs(SourceOptions(), ignored)


def test_region_profile_anon_and_storage_options() -> None:
    kw = s3_filesystem_kwargs(SourceOptions(), {"AWS_REGION": "eu-west-3"})
    assert kw["client_kwargs"] == {"region_name": "eu-west-3"}
    kw = s3_filesystem_kwargs(SourceOptions(s3_region="ap-south-1"), {"AWS_REGION": "eu-west-3"})
    assert kw["client_kwargs"] == {"region_name": "ap-south-1"}
    kw = s3_filesystem_kwargs(
        SourceOptions(s3_profile="lab", anon=True,
                      storage_options={"config_kwargs": {"read_timeout": 60}}), {})
    assert kw["profile"] == "lab"
    assert kw["anon"] is True
    assert kw["use_listings_cache"] is False
    assert kw["config_kwargs"]["read_timeout"] == 60
    assert kw["config_kwargs"]["retries"] == {"total_max_attempts": 1}
    assert kw["config_kwargs"]["max_pool_connections"] >= 32


# --- reads against moto ---


@pytest.mark.s3
def test_open_version_and_ranges(s3_client, make_bucket) -> None:
    bucket = make_bucket()
    data = payload(3 * 2**20 + 123, 1)
    s3_client.put_object(Bucket=bucket, Key="run42/field.bin", Body=data)
    src = open_source(f"s3://{bucket}/run42/field.bin")
    assert src.url == f"s3://{bucket}/run42/field.bin"
    v = src.version()
    assert v.size == len(data)
    assert v.token.startswith("etag:")
    assert src.mtime() > time.time() - 3600
    for off, size in [(0, 1), (0, 2**20), (2**20 - 7, 2**20 + 13), (len(data) - 2**20, 2**20)]:
        assert src.pread(off, size) == data[off:off + size]
    src.close()


@pytest.mark.s3
def test_short_read_at_end_of_object(s3_client, make_bucket) -> None:
    bucket = make_bucket()
    data = payload(5000, 2)
    s3_client.put_object(Bucket=bucket, Key="k", Body=data)
    src = open_source(f"s3://{bucket}/k")
    assert src.pread(4990, 100) == data[4990:]
    assert src.pread(5000, 10) == b""
    assert src.pread(9000, 10) == b""
    assert src.pread(0, 0) == b""


@pytest.mark.s3
def test_empty_object(s3_client, make_bucket) -> None:
    bucket = make_bucket()
    s3_client.put_object(Bucket=bucket, Key="empty", Body=b"")
    src = open_source(f"s3://{bucket}/empty")
    assert src.version().size == 0
    assert src.pread(0, 4096) == b""


@pytest.mark.s3
def test_concurrent_pread_from_16_threads(s3_client, make_bucket) -> None:
    bucket = make_bucket()
    data = payload(8 * 2**20, 3)
    s3_client.put_object(Bucket=bucket, Key="big", Body=data)
    check_concurrent_preads(open_source(f"s3://{bucket}/big"), data, 160, seed=4)


# --- version pinning ---


@pytest.mark.s3
def test_overwrite_unversioned_bucket_fails_reads(s3_client, make_bucket) -> None:
    bucket = make_bucket()
    old, new = payload(4096, 5), payload(4096, 6)
    s3_client.put_object(Bucket=bucket, Key="k", Body=old)
    src = open_source(f"s3://{bucket}/k")
    pinned = src.version()
    assert src.pread(0, 100) == old[:100]
    s3_client.put_object(Bucket=bucket, Key="k", Body=new)  # same size, other bytes
    with pytest.raises(SourceError, match="changed since it was opened") as info:
        src.pread(0, 100)
    assert info.value.errno == errno.EIO
    assert f"s3://{bucket}/k" in str(info.value)
    now = src.version()
    assert now.size == pinned.size
    assert now.token != pinned.token


@pytest.mark.s3
def test_versioned_bucket_serves_the_pinned_version(s3_client, make_bucket) -> None:
    bucket = make_bucket(versioned=True)
    old, new = payload(10_000, 7), payload(12_000, 8)
    first = s3_client.put_object(Bucket=bucket, Key="k", Body=old)["VersionId"]
    src = open_source(f"s3://{bucket}/k")
    pinned = src.version()
    assert pinned == SourceVersion(len(old), f"vid:{first}")
    s3_client.put_object(Bucket=bucket, Key="k", Body=new)
    assert src.pread(0, 20_000) == old  # the pinned version, whole and consistent
    assert src.pread(9_990, 100) == old[9_990:]
    now = src.version()
    assert now.size == len(new)
    assert now.token.startswith("vid:")
    assert now.token != pinned.token
    # an explicit ?versionId= pins that version too
    exact = open_source(f"s3://{bucket}/k?versionId={first}")
    assert exact.pread(0, 50) == old[:50]
    # once the pinned version is deleted, reads fail: they never fall back to another version
    s3_client.delete_object(Bucket=bucket, Key="k", VersionId=first)
    with pytest.raises(SourceError, match=r"changed since it was opened.*pinned version was deleted"):
        src.pread(0, 10)


# --- missing, directories, permanent errors ---


@pytest.mark.s3
def test_missing_object_bucket_and_directories(s3_client, make_bucket) -> None:
    bucket = make_bucket()
    s3_client.put_object(Bucket=bucket, Key="dir/a.bin", Body=b"x")
    with pytest.raises(InvalidInput, match=f"source s3://{bucket}/nope does not exist") as info:
        open_source(f"s3://{bucket}/nope")
    assert info.value.errno == errno.ENOENT
    with pytest.raises(InvalidInput, match="does not exist"):
        open_source("s3://faultfs-no-such-bucket/k")
    for url in (f"s3://{bucket}/dir", f"s3://{bucket}/dir/", f"s3://{bucket}"):
        with pytest.raises(InvalidInput, match="is a directory") as info:
            open_source(url)
        assert info.value.errno == errno.EISDIR


@pytest.mark.s3
def test_deleted_object_fails_at_once(s3_client, make_bucket, faulty_proxy) -> None:
    bucket = make_bucket()
    s3_client.put_object(Bucket=bucket, Key="k", Body=b"y" * 1000)
    opts = SourceOptions(s3_endpoint_url=faulty_proxy.endpoint)
    src = open_fsspec_source(f"s3://{bucket}/k", opts, retry=RetryPolicy(attempts=5))
    s3_client.delete_object(Bucket=bucket, Key="k")
    start = time.monotonic()
    with pytest.raises(SourceError, match="changed since it was opened"):
        src.pread(0, 10)
    assert faulty_proxy.range_gets == 1  # a 404 is not retried
    assert time.monotonic() - start < 2


# --- transient failures ---


@pytest.mark.s3
@pytest.mark.parametrize("mode", ["503", "reset"])
def test_transient_failures_are_retried(s3_client, make_bucket, faulty_proxy, mode) -> None:
    bucket = make_bucket()
    data = payload(300_000, 9)
    s3_client.put_object(Bucket=bucket, Key="k", Body=data)
    src = open_fsspec_source(
        f"s3://{bucket}/k", SourceOptions(s3_endpoint_url=faulty_proxy.endpoint),
        retry=RetryPolicy(attempts=4, base_delay_s=0.001, max_delay_s=0.005),
    )
    faulty_proxy.mode = mode
    faulty_proxy.fail_reads = 2
    assert src.pread(1000, 200_000) == data[1000:201_000]
    assert faulty_proxy.range_gets == 3


@pytest.mark.s3
def test_always_failing_gives_up_after_bounded_tries(s3_client, make_bucket, faulty_proxy) -> None:
    bucket = make_bucket()
    s3_client.put_object(Bucket=bucket, Key="k", Body=b"z" * 4096)
    src = open_fsspec_source(f"s3://{bucket}/k",
                             SourceOptions(s3_endpoint_url=faulty_proxy.endpoint), retry=QUICK)
    faulty_proxy.fail_reads = 1000
    start = time.monotonic()
    with pytest.raises(SourceError, match=r"\[0, 4096\) failed after 3 tries: SlowDown") as info:
        src.pread(0, 8192)
    assert info.value.errno == errno.EIO
    assert faulty_proxy.range_gets == QUICK.attempts
    assert time.monotonic() - start < 2


# --- globs ---


@pytest.mark.s3
def test_glob_expands_three_shards_in_sorted_order(s3_client, make_bucket) -> None:
    bucket = make_bucket()
    for key in ["run42/part-2.bin", "run42/part-0.bin", "run42/part-1.bin", "run42/part-1.txt",
                "run42/sub/part-9.bin", "run43/part-0.bin"]:
        s3_client.put_object(Bucket=bucket, Key=key, Body=key.encode())
    want = [f"s3://{bucket}/run42/part-{i}.bin" for i in range(3)]
    assert remote.expand_fsspec_glob(f"s3://{bucket}/run42/part-*.bin", SourceOptions()) == want
    assert expand_sources([f"s3://{bucket}/run42/part-?.bin"]) == want
    for i, url in enumerate(want):
        assert open_source(url).pread(0, 100) == f"run42/part-{i}.bin".encode()
    with pytest.raises(InvalidInput, match="matches no file"):
        expand_sources([f"s3://{bucket}/run99/*.bin"])
    # a version id is not a wildcard
    assert expand_sources([f"s3://{bucket}/k?versionId=abc"]) == [f"s3://{bucket}/k?versionId=abc"]


# --- AWS configuration, end to end ---


@pytest.mark.s3
def test_service_endpoint_env_beats_global_endpoint_env(s3_client, make_bucket,
                                                        monkeypatch) -> None:
    bucket = make_bucket()
    s3_client.put_object(Bucket=bucket, Key="k", Body=b"hello")
    moto = os.environ["AWS_ENDPOINT_URL"]
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # discard port: nothing there
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto)
    assert open_source(f"s3://{bucket}/k").pread(0, 5) == b"hello"


@pytest.mark.s3
def test_profile_from_shared_config_and_credentials_files(s3_client, make_bucket, tmp_path,
                                                          monkeypatch, fake_aws) -> None:
    bucket = make_bucket()
    s3_client.put_object(Bucket=bucket, Key="k", Body=b"profiled")
    moto = os.environ["AWS_ENDPOINT_URL"]
    (tmp_path / "config").write_text(
        f"[profile faultfs-lab]\nregion = {fake_aws.region}\nendpoint_url = {moto}\n")
    (tmp_path / "credentials").write_text(
        f"[faultfs-lab]\naws_access_key_id = {fake_aws.key_id}\n"
        f"aws_secret_access_key = {fake_aws.secret}\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL",
                 "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name)
    src = open_source(f"s3://{bucket}/k", SourceOptions(s3_profile="faultfs-lab"))
    assert src.pread(0, 100) == b"profiled"
    monkeypatch.setenv("AWS_PROFILE", "faultfs-lab")
    assert open_source(f"s3://{bucket}/k").pread(0, 100) == b"profiled"


@pytest.mark.s3
def test_secrets_never_appear_in_url_errors_or_versions(s3_client, make_bucket,
                                                        faulty_proxy, fake_aws) -> None:
    bucket = make_bucket()
    s3_client.put_object(Bucket=bucket, Key="k", Body=b"q" * 100)
    secret = "s3cr3t-from-storage-options-0123456789"
    opts = SourceOptions(s3_endpoint_url=faulty_proxy.endpoint,
                         storage_options={"key": fake_aws.key_id, "secret": secret})
    src = open_fsspec_source(f"s3://{bucket}/k", opts, retry=QUICK)
    faulty_proxy.fail_reads = 1000
    with pytest.raises(SourceError) as read_err:
        src.pread(0, 10)
    with pytest.raises(InvalidInput) as open_err:
        open_fsspec_source(f"s3://{bucket}/missing", opts, retry=QUICK)
    shown = [src.url, repr(src.version()), str(read_err.value), str(open_err.value)]
    for text in shown:
        assert secret not in text
        assert fake_aws.secret not in text


@pytest.mark.s3
def test_anon_reads_without_any_credentials(s3_client, make_bucket, monkeypatch) -> None:
    bucket = make_bucket()
    s3_client.put_object(Bucket=bucket, Key="public.bin", Body=b"open data", ACL="public-read")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    src = open_source(f"s3://{bucket}/public.bin", SourceOptions(anon=True))
    assert src.pread(0, 100) == b"open data"
