"""Presigned S3 URLs without a client (``sources/s3sign.py``): the same URL, byte for byte and
signature for signature, as the botocore client's own ``generate_presigned_url`` for the
settings it takes, and the client kept for every setting that could change a URL."""

from __future__ import annotations

import urllib.parse

import pytest

from faultfs.sources import SourceOptions
from faultfs.sources.filesystems import s3_client, s3_filesystem_kwargs
from faultfs.sources.s3sign import LightPresigner, light_presigner

s3fs = pytest.importorskip("s3fs")

KEYS = ["run42/field.h5", "a b/c+d~e=f&g.bin", "ünï/cödé/%41.dat", "x/../y//z", "é"]


@pytest.fixture(autouse=True)
def aws_env(monkeypatch, tmp_path):
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION",
                 "AWS_SESSION_TOKEN", "AWS_USE_FIPS_ENDPOINT", "AWS_USE_DUALSTACK_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAFAULTFSSIGNTEST1")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "faultfs-sign-test-secret-0123456789abcd")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def filesystem(**storage: object) -> object:
    options = SourceOptions(storage_options=storage)
    return s3fs.S3FileSystem(**s3_filesystem_kwargs(options))


def same_second(light: LightPresigner, client: object, operation: str,
                params: dict) -> tuple[str, str]:
    for _ in range(5):  # signed in the same second (X-Amz-Date), else again
        mine = light.generate_presigned_url(operation, Params=params, ExpiresIn=900)
        theirs = client.generate_presigned_url(operation, Params=params, ExpiresIn=900)
        date = [urllib.parse.parse_qs(urllib.parse.urlsplit(u).query)["X-Amz-Date"]
                for u in (mine, theirs)]
        if date[0] == date[1]:
            return mine, theirs
    raise AssertionError("five tries across a second boundary")


@pytest.mark.parametrize("where", [
    {"endpoint_url": "http://127.0.0.1:9000"},
    {"endpoint_url": "https://minio.example.org"},
    {"endpoint_url": "http://store.local:8333", "client_kwargs": {"region_name": "eu-west-1"}},
    {"client_kwargs": {"region_name": "eu-west-1"}},  # AWS itself, the bucket in the host
    {"client_kwargs": {"region_name": "ap-southeast-2"}},
    {"client_kwargs": {"region_name": "us-east-1"}},
    {"endpoint_url": "http://minio.local:9000",  # MinIO's usual setting
     "config_kwargs": {"s3": {"addressing_style": "path"}}},
])
def test_the_url_is_the_clients_own(where):
    fs = filesystem(**where)
    light = light_presigner(fs)
    assert light is not None
    client = s3_client(fs)
    for key in KEYS:
        for operation in ("get_object", "put_object", "head_object"):
            for extra in ({}, {"VersionId": "3/L4kqtJl+cWz.Yx"}):
                if extra and operation == "put_object":
                    continue  # a PUT makes a version, it names none
                params = {"Bucket": "faultfs-bucket", "Key": key, **extra}
                mine, theirs = same_second(light, client, operation, params)
                assert mine == theirs, (operation, key, extra)


def test_session_credentials_are_signed_with_their_token(monkeypatch):
    monkeypatch.setenv("AWS_SESSION_TOKEN", "a-session-token/with+chars=")
    fs = filesystem(endpoint_url="http://127.0.0.1:9000")
    light = light_presigner(fs)
    mine, theirs = same_second(light, s3_client(fs), "get_object",
                               {"Bucket": "b-1", "Key": "k"})
    assert mine == theirs and "X-Amz-Security-Token=" in mine


@pytest.mark.parametrize("setting", [
    {"config_kwargs": {"s3": {"addressing_style": "virtual"}}},
    {"config_kwargs": {"s3": {"addressing_style": "path"}}},  # AWS itself, path style
    {"endpoint_url": "http://127.0.0.1:9000",
     "config_kwargs": {"s3": {"addressing_style": "path", "use_accelerate_endpoint": True}}},
    {"config_kwargs": {"proxies": {"http": "http://proxy:3128"}}},
    {"requester_pays": True},
    {"s3_additional_kwargs": {"ServerSideEncryption": "AES256"}},
    {"client_kwargs": {"region_name": "cn-north-1"}},  # another partition
    {"client_kwargs": {"region_name": "us-gov-west-1"}},
    {"endpoint_url": "http://127.0.0.1:9000/prefix"},  # an endpoint with a path
])
def test_any_setting_that_could_change_the_url_keeps_the_client(setting):
    assert light_presigner(filesystem(**setting)) is None


def test_the_shared_config_and_the_environment_keep_the_client(monkeypatch, tmp_path):
    monkeypatch.setenv("AWS_USE_FIPS_ENDPOINT", "true")
    assert light_presigner(filesystem(client_kwargs={"region_name": "eu-west-1"})) is None
    monkeypatch.delenv("AWS_USE_FIPS_ENDPOINT")
    (tmp_path / "config").write_text("[default]\nendpoint_url = http://elsewhere:9000\n")
    assert light_presigner(filesystem(client_kwargs={"region_name": "eu-west-1"})) is None
    (tmp_path / "config").write_text("[default]\ns3 =\n  addressing_style = path\n")
    assert light_presigner(filesystem(client_kwargs={"region_name": "eu-west-1"})) is None


def test_aws_without_a_known_region_or_with_a_dotted_bucket_keeps_the_client(monkeypatch):
    from faultfs.sources.filesystems import s3_presigner

    monkeypatch.delenv("AWS_DEFAULT_REGION")
    assert light_presigner(filesystem()) is None  # botocore finds the bucket's region
    fs = filesystem(client_kwargs={"region_name": "eu-west-1"})
    assert isinstance(s3_presigner(fs, "plain-bucket"), LightPresigner)
    assert not isinstance(s3_presigner(fs, "dotted.bucket.name"), LightPresigner)
    assert not isinstance(s3_presigner(fs, "express--use1-az4--x-s3"), LightPresigner)


def test_anonymous_urls_are_unsigned():
    fs = filesystem(anon=True, endpoint_url="http://127.0.0.1:9000")
    light = light_presigner(fs)
    url = light.generate_presigned_url("get_object", Params={"Bucket": "pub", "Key": "a b"},
                                       ExpiresIn=900)
    assert url == "http://127.0.0.1:9000/pub/a%20b"
