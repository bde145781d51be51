"""Presigned S3 URLs without a botocore client, for the settings whose URL is plain to derive.

Why: making a botocore client costs a new process 60-80 ms of CPU (its service model, the
endpoint rules and partitions: 1-2 MB of JSON each time), before its first request. A
``faultfs::`` reader, a DataLoader or Dask worker, a mount: each is a new process whose first
read waited for it. Reads and a shared store's objects only need presigned URLs (``s3http``),
and botocore's own signer (``botocore.auth.S3SigV4QueryAuth``) signs one from a URL and
credentials without a client.

Invariants:
- Used only where the URL is exactly what the client would build: an explicit endpoint
  (path-style ``{endpoint}/{bucket}/{key}``, as botocore builds it for a custom endpoint,
  with or without ``addressing_style: path``), or
  AWS itself in a known commercial region for a bucket name that is a plain DNS label
  (``https://{bucket}.s3.amazonaws.com``, signed for the region, as botocore presigns it). Any other setting that could change the
  URL or the request — an endpoint in the shared config, FIPS, dual-stack, accelerate, an
  addressing style, S3 Express or access-point names, another partition, client arguments
  beyond region and endpoint — leaves it to the client (``light_presigner`` answers None).
- Credentials come as the client's would: the file system's own key, else botocore's
  provider chain (environment, profile, SSO, instance metadata), refreshed as botocore
  refreshes them (``get_frozen_credentials`` at each signature). No credentials: None (the
  client then says why). ``anon``: unsigned URLs.
- The key is quoted as botocore quotes an S3 key (``/`` and ``~`` kept); a version goes in
  the query before signing, so it is signed.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from typing import Any

# client settings that do not change a URL or a signature
_CONFIG_KEYS = frozenset({"max_pool_connections", "connect_timeout", "read_timeout", "retries",
                          "signature_version"})
_CLIENT_KEYS = frozenset({"region_name", "endpoint_url", "verify"})
# shared-config settings (and environment variables) that change where S3 requests go
_SCOPED_KEYS = frozenset({"endpoint_url", "s3", "services", "use_fips_endpoint",
                          "use_dualstack_endpoint", "s3_use_arn_region"})
_ENV_KEYS = ("AWS_USE_FIPS_ENDPOINT", "AWS_USE_DUALSTACK_ENDPOINT",
             "AWS_S3_US_EAST_1_REGIONAL_ENDPOINT", "AWS_S3_USE_ARN_REGION")
_COMMERCIAL_REGION = re.compile(r"(us|eu|ap|ca|sa|me|af|il|mx)-[a-z]+-\d")
_DNS_BUCKET = re.compile(r"[a-z0-9][a-z0-9-]{1,61}[a-z0-9]")
_OPERATIONS = {"get_object": "GET", "put_object": "PUT", "head_object": "HEAD"}


class LightPresigner:
    """``generate_presigned_url`` for GETs, PUTs and HEADs of objects, as a client's."""

    def __init__(self, endpoint: str, virtual: bool, region: str, credentials: Any,
                 anon: bool) -> None:
        self.endpoint = endpoint.rstrip("/")  # scheme://host[:port]
        self.virtual = virtual  # AWS: the bucket in the host name
        self.region = region
        self._credentials = credentials
        self._anon = anon

    def url(self, bucket: str, key: str, version_id: str = "") -> str:
        """The object's URL, unsigned."""
        path = urllib.parse.quote(key, safe="/~")
        if self.virtual:
            scheme, _, host = self.endpoint.partition("://")
            url = f"{scheme}://{bucket}.{host}/{path}"
        else:
            url = f"{self.endpoint}/{bucket}/{path}"
        if version_id:
            url += "?versionId=" + urllib.parse.quote(version_id, safe="")
        return url

    def generate_presigned_url(self, operation: str, Params: dict,  # botocore's names
                               ExpiresIn: int) -> str:
        from botocore.auth import S3SigV4QueryAuth
        from botocore.awsrequest import AWSRequest

        url = self.url(Params["Bucket"], Params["Key"], Params.get("VersionId", ""))
        if self._anon:
            return url
        request = AWSRequest(method=_OPERATIONS[operation], url=url)
        frozen = self._credentials.get_frozen_credentials()
        S3SigV4QueryAuth(frozen, "s3", self.region, expires=ExpiresIn).add_auth(request)
        return request.url


def light_presigner(fs: Any, session: Any = None) -> LightPresigner | None:
    """A presigner for ``fs``'s objects, or None where its client must build the URLs (see
    the module invariants). ``session``: a botocore session for the profile (tests)."""
    if fs.requester_pays or fs.s3_additional_kwargs:
        return None
    config = dict(fs.config_kwargs or {})
    path_style = config.pop("s3", None) == {"addressing_style": "path"}  # MinIO's usual
    if "s3" in (fs.config_kwargs or {}) and not path_style:
        return None
    if set(config) - _CONFIG_KEYS or set(fs.client_kwargs) - _CLIENT_KEYS:
        return None
    if config.get("signature_version") not in (None, "s3v4") and not fs.anon:
        return None
    if any(os.environ.get(name) for name in _ENV_KEYS):
        return None
    if session is None:
        import botocore.session

        session = botocore.session.Session(profile=fs.kwargs.get("profile"))
    if set(session.get_scoped_config()) & _SCOPED_KEYS:
        return None
    endpoint = fs.client_kwargs.get("endpoint_url") or fs.endpoint_url or ""
    region = fs.client_kwargs.get("region_name") or session.get_config_variable("region") or ""
    virtual = False
    if endpoint:
        parts = urllib.parse.urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path.strip("/") \
                or parts.query:
            return None
        endpoint = f"{parts.scheme}://{parts.netloc}"
        region = region or "us-east-1"
    else:
        if path_style or not _COMMERCIAL_REGION.fullmatch(region):
            return None  # unknown (botocore finds it), or another partition
        endpoint, virtual = "https://s3.amazonaws.com", True  # as botocore presigns
    credentials = None
    if not fs.anon:
        if fs.key and fs.secret:
            from botocore.credentials import Credentials

            credentials = Credentials(fs.key, fs.secret, fs.token)
        else:
            credentials = session.get_credentials()
        if credentials is None:
            return None
    return LightPresigner(endpoint, virtual, region, credentials, bool(fs.anon))


def virtual_hostable(bucket: str) -> bool:
    """Whether AWS serves ``bucket`` from its own host name, as this presigner addresses it
    (a plain DNS label; not S3 Express, an access point, or dotted)."""
    return bool(_DNS_BUCKET.fullmatch(bucket)) and not bucket.endswith(("--x-s3", "--ol-s3")) \
        and not bucket.startswith(("xn--", "sthree-"))
