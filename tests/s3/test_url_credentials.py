"""Source URLs that carry credentials: what a fault context may persist (pure, no server)."""

from __future__ import annotations

import errno

import pytest

from faultfs.errors import InvalidInput
from faultfs.sources import SourceOptions
from faultfs.sources.remote import open_fsspec_source
from faultfs.sources.secrets import has_redacted_credentials, persistable_src


@pytest.mark.parametrize(("url", "persisted"), [
    # presigned S3, SigV4 (with a session token)
    ("https://b.s3.amazonaws.com/k.bin?X-Amz-Algorithm=AWS4-HMAC-SHA256"
     "&X-Amz-Credential=AKIAEXAMPLE%2F20240101%2Fus-east-1%2Fs3%2Faws4_request"
     "&X-Amz-Date=20240101T000000Z&X-Amz-Expires=900&X-Amz-SignedHeaders=host"
     "&X-Amz-Security-Token=TOKEN123&X-Amz-Signature=abcdef0123",
     "https://b.s3.amazonaws.com/k.bin?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=***"
     "&X-Amz-Date=20240101T000000Z&X-Amz-Expires=900&X-Amz-SignedHeaders=host"
     "&X-Amz-Security-Token=***&X-Amz-Signature=***"),
    # presigned S3, SigV2
    ("http://127.0.0.1:9/b/k?AWSAccessKeyId=AKIAEXAMPLE&Signature=Zm9v%3D&Expires=1795963757",
     "http://127.0.0.1:9/b/k?AWSAccessKeyId=***&Signature=***&Expires=1795963757"),
    # GCS signed URL, Azure SAS, a bearer token
    ("https://storage.googleapis.com/b/o?X-Goog-Credential=sa%40p&X-Goog-Signature=00ff",
     "https://storage.googleapis.com/b/o?X-Goog-Credential=***&X-Goog-Signature=***"),
    ("https://acct.blob.core.windows.net/c/b.bin?sv=2022-11-02&se=2030-01-01&sp=r&sig=c2ln",
     "https://acct.blob.core.windows.net/c/b.bin?sv=2022-11-02&se=2030-01-01&sp=r&sig=***"),
    ("https://h/get?file=a.bin&access_token=q1w2e3", "https://h/get?file=a.bin&access_token=***"),
    # userinfo
    ("https://user:pa55@h:8443/f.bin", "https://***@h:8443/f.bin"),
    ("https://tokenonly@h/f.bin", "https://***@h/f.bin"),
    # nothing secret: unchanged, byte for byte
    ("s3://b/run42/f.bin?versionId=3HL4kqtJlcpXroDTDmJ%2Bx", "s3://b/run42/f.bin?versionId=3HL4kqtJlcpXroDTDmJ%2Bx"),
    ("https://h/get?file=a.bin&part=2", "https://h/get?file=a.bin&part=2"),
    ("memory://bucket/f.bin", "memory://bucket/f.bin"),
    ("/data/f.bin", "/data/f.bin"),
])
def test_persistable_src(url: str, persisted: str) -> None:
    assert persistable_src(url) == persisted
    assert persistable_src(persisted) == persisted
    assert has_redacted_credentials(persisted) == (persisted != url)
    assert not has_redacted_credentials(url)


def test_a_redacted_url_is_refused_without_a_request() -> None:
    # port 9 (discard) on loopback: a request would fail as a connection error, not EACCES
    url = "http://127.0.0.1:9/b/k.bin?X-Amz-Signature=***"
    with pytest.raises(InvalidInput, match="registered with credentials in its URL") as exc:
        open_fsspec_source(url, SourceOptions())
    assert exc.value.errno == errno.EACCES
    with pytest.raises(InvalidInput, match="give the full URL again"):
        open_fsspec_source("http://***@127.0.0.1:9/f.bin", SourceOptions())
