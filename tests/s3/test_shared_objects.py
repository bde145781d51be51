"""A shared store's objects on S3 (``tiers/objects.py``): whole-object gets and puts through
presigned URLs (``sources/s3http.PresignedObjects``), against moto behind a proxy that logs
and fails requests: one request an operation, the conditions kept, an endpoint without
conditional puts and a redirect handled, failures raised as ``OSError``."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest

from faultfs.sources import SourceOptions
from faultfs.testing.proxy import FaultPlan, FaultRule, LatencyProxy
from faultfs.tiers.claims import claim_store, probe_claims
from faultfs.tiers.objects import open_objects

pytestmark = [pytest.mark.s3]


@pytest.fixture
def store(s3_env, make_bucket):
    """``store(faults=None) -> (objects, proxy)``: a fresh bucket's shared store reached
    through a proxy."""
    proxies = []

    def make(faults: FaultPlan | None = None):
        bucket = make_bucket()
        endpoint = urlsplit(s3_env)
        proxy = LatencyProxy(endpoint.hostname, endpoint.port, delay_ms=0,
                             conn_mbps=None).start()
        proxies.append(proxy)
        if faults is not None:
            proxy.set_faults(faults)
        objects = open_objects(f"s3://{bucket}/cluster",
                               SourceOptions(s3_endpoint_url=proxy.url))
        return objects, proxy

    yield make
    for p in proxies:
        p.close()


def requests(proxy: LatencyProxy) -> list[tuple[str, str]]:
    return [(r["method"], r["path"]) for r in sorted(proxy.stats()["log"],
                                                     key=lambda r: r["start"])]


def test_gets_and_puts_are_one_presigned_request_each_and_keep_their_conditions(store):
    objects, proxy = store()
    assert objects.direct is not None
    blob = bytes(range(256)) * 4096  # 1 MiB
    proxy.reset_stats()
    assert objects.put("blobs/a", blob, create=True) is True
    assert objects.put("blobs/a", b"other bytes", create=True) is False  # 412: kept
    assert objects.get("blobs/a", limit=len(blob)) == blob
    assert objects.get("blobs/a", limit=9) == blob[:10]  # at most limit + 1 bytes
    assert objects.get("blobs/absent", limit=100) is None
    objects.put("blobs/empty", b"")
    assert objects.get("blobs/empty", limit=100) == b""
    objects.put("blobs/a", b"replaced")  # unconditional: replaces
    assert objects.get("blobs/a", limit=100) == b"replaced"
    log = requests(proxy)
    assert [m for m, _ in log] == ["PUT", "PUT", "GET", "GET", "GET", "PUT", "GET", "PUT", "GET"]
    assert all("X-Amz-Signature=" in path and "/cluster/blobs/" in path for _, path in log)


def test_claims_keep_both_conditions_through_presigned_puts(store):
    objects, proxy = store()
    claims = claim_store(objects)
    assert claims is not None
    proxy.reset_stats()
    assert probe_claims(claims) is True
    tag = claims.create("claims/k/v/0", b'{"a":1}')
    assert tag and claims.create("claims/k/v/0", b'{"a":2}') is None
    assert claims.replace("claims/k/v/0", b'{"a":3}', '"0123"') is None  # a wrong tag loses
    assert claims.replace("claims/k/v/0", b'{"a":4}', tag) is not None
    assert claims.read("claims/k/v/0")[0] == b'{"a":4}'
    assert claims.replace("claims/k/v/gone", b"{}", tag) is None  # If-Match on nothing
    puts = [path for method, path in requests(proxy) if method == "PUT"]
    assert puts and all("X-Amz-Signature=" in path for path in puts)


def test_an_endpoint_refusing_a_conditional_put_gets_a_check_then_a_put(store):
    refusing = FaultPlan(FaultRule("status", requests=(1,), status=501, code="NotImplemented",
                                   match=lambda method, path: method == "PUT"))
    objects, _ = store(refusing)
    assert objects.put("blobs/b", b"bytes of b", create=True) is True
    assert objects.conditional is False
    assert objects.put("blobs/b", b"other", create=True) is False  # found by a GET
    assert objects.get("blobs/b", limit=100) == b"bytes of b"


def test_a_wrong_region_sends_the_store_through_botocore_and_the_put_lands(store):
    # S3's answer to a request signed for another region (botocore follows it; this path not)
    moved = FaultPlan(FaultRule("status", requests=(1,), status=400,
                                code="AuthorizationHeaderMalformed",
                                match=lambda method, path: method == "PUT"))
    objects, proxy = store(moved)
    assert objects.put("blobs/c", b"bytes of c", create=True) is True
    assert objects.direct is None
    assert objects.get("blobs/c", limit=100) == b"bytes of c"
    assert "X-Amz-Signature=" not in requests(proxy)[-1][1]  # botocore signs in headers


def test_a_failing_or_resetting_store_raises_oserror(store):
    failing = FaultPlan(FaultRule("status", fraction=1.0, status=503, code="SlowDown"))
    objects, _ = store(failing)
    with pytest.raises(OSError):
        objects.put("blobs/d", b"x", create=True)
    with pytest.raises(OSError):
        objects.get("blobs/d", limit=10)
    resetting = FaultPlan(FaultRule("reset", fraction=1.0, after_bytes=None))
    objects, _ = store(resetting)
    with pytest.raises(OSError):
        objects.get("blobs/d", limit=10)
