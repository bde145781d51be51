"""fsspec file systems for remote sources: one instance per (protocol, resolved options, process),
tuned so that ``faultfs.sources.retry`` is the only retry loop.

Invariants:
- S3 and HTTP file systems are shared by every source that resolves to the same options;
  a forked process builds its own (an async file system is bound to its parent's loop).
- Listing caches are off: a cached listing would hide a changed object.
- Endpoint, region and profile follow the AWS conventions (flag, then environment, then the
  shared configuration), resolved here so that the shared instance is keyed by them.
- S3 object reads use one synchronous botocore client per shared instance (``s3_client``),
  built from that instance's settings exactly as s3fs builds its aiobotocore one, so both
  reach the same endpoint with the same credentials — made only when needed: where the
  settings make a presigned URL plain to derive, reads, stats and a shared store's objects
  are signed without it (``s3_presigner``, ``sources.s3sign``), the URL the client's own.
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from typing import Any

import fsspec
from fsspec.utils import tokenize

from faultfs.errors import InvalidInput
from faultfs.sources.base import HTTP_PROTOCOLS, S3_PROTOCOLS, SourceOptions, url_protocol
from faultfs.sources.s3sign import LightPresigner, light_presigner, virtual_hostable
from faultfs.sources.secrets import display_url

# The engine runs up to 32 faults at once (FAULTFS_IO_THREADS); the HTTP pool must never queue
# them, and glob/stat calls from registration come on top.
MAX_POOL_CONNECTIONS = 64
# A loopback or in-region endpoint connects in milliseconds; 5 s means the endpoint is gone.
CONNECT_TIMEOUT_S = 5.0
# No bytes for 15 s on an open connection: give up on this try and let the retry loop decide
# (the same values s3fs uses by default). FAULTFS_SOURCE_READ_TIMEOUT_S changes it (tests of
# stalled endpoints; a link known to pause longer).
READ_TIMEOUT_S = float(os.environ.get("FAULTFS_SOURCE_READ_TIMEOUT_S") or 15.0)

# --- file systems: one per (protocol, resolved options), shared by all sources ---

_FS_LOCK = threading.Lock()
_FILESYSTEMS: dict[str, fsspec.AbstractFileSystem] = {}
_SYNC_LOCKS: weakref.WeakKeyDictionary[Any, threading.Lock] = weakref.WeakKeyDictionary()
_S3_CLIENTS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_S3_POOLS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_S3_LIGHT: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def s3_filesystem_kwargs(options: SourceOptions, environ: dict[str, str] | None = None) -> dict:
    """s3fs constructor arguments from the context fields, the AWS environment and storage_options.

    botocore (installed version) already honours AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL,
    ``endpoint_url`` in the shared config, AWS_PROFILE, AWS_DEFAULT_REGION and the shared
    config/credential files. Filled in here: ``s3_endpoint_url`` > AWS_ENDPOINT_URL_S3 >
    AWS_ENDPOINT_URL resolved explicitly (so the shared file-system instance is keyed by it),
    AWS_REGION (which botocore does not read) after ``s3_region``, and ``s3_profile``.
    """
    env = os.environ if environ is None else environ
    kwargs: dict[str, Any] = {
        "anon": options.anon,
        "use_listings_cache": False,  # a listing cache would hide a changed object
        "skip_instance_cache": True,  # this instance is tuned (retries off); do not share it
        "config_kwargs": {
            "max_pool_connections": MAX_POOL_CONNECTIONS,
            "connect_timeout": CONNECT_TIMEOUT_S,
            "read_timeout": READ_TIMEOUT_S,
            "retries": {"total_max_attempts": 1},  # RetryPolicy is the only retry loop
        },
    }
    endpoint = options.s3_endpoint_url
    if not endpoint and env.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").lower() != "true":
        endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or ""
    if endpoint:
        kwargs["endpoint_url"] = endpoint
    region = options.s3_region or env.get("AWS_REGION", "")
    if region:
        kwargs["client_kwargs"] = {"region_name": region}
    if options.s3_profile:
        kwargs["profile"] = options.s3_profile
    for name, value in options.storage_options.items():
        if name in ("config_kwargs", "client_kwargs") and isinstance(value, dict):
            kwargs[name] = {**kwargs.get(name, {}), **value}
        else:
            kwargs[name] = value
    return kwargs


def http_filesystem_kwargs(options: SourceOptions) -> dict:
    import aiohttp

    kwargs: dict[str, Any] = {
        "skip_instance_cache": True,
        "client_kwargs": {
            "timeout": aiohttp.ClientTimeout(
                total=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=READ_TIMEOUT_S
            ),
        },
    }
    for name, value in options.storage_options.items():
        if name == "client_kwargs" and isinstance(value, dict):
            kwargs[name] = {**kwargs[name], **value}
        else:
            kwargs[name] = value
    return kwargs


def shared_filesystem(protocol: str, kwargs: dict) -> fsspec.AbstractFileSystem:
    # the pid: an async file system is bound to its parent's event loop and refuses to work
    # after a fork, so a forked daemon builds its own
    key = tokenize(protocol, kwargs, os.getpid())
    with _FS_LOCK:
        fs = _FILESYSTEMS.get(key)
        if fs is None:
            fs = fsspec.filesystem(protocol, **kwargs)
            if protocol in S3_PROTOCOLS:
                fs.retries = 1  # s3fs's own retry loop off (glob/list): RetryPolicy bounds tries
            _FILESYSTEMS[key] = fs
        return fs


def filesystem_for(url: str, options: SourceOptions) -> tuple[fsspec.AbstractFileSystem, str]:
    protocol = url_protocol(url)
    try:
        if protocol in S3_PROTOCOLS:
            fs = shared_filesystem("s3", s3_filesystem_kwargs(options))
            return fs, fs._strip_protocol(url)
        if protocol in HTTP_PROTOCOLS:
            return shared_filesystem("http", http_filesystem_kwargs(options)), url
        kwargs = {"use_listings_cache": False, **options.storage_options}
        return fsspec.url_to_fs(url, **kwargs)
    except ImportError as exc:
        raise InvalidInput(
            f"source {display_url(url)} needs a package that is not installed: {exc}"
        ) from None
    except ValueError as exc:
        raise InvalidInput(f"source {display_url(url)} is not a usable URL: {exc}") from None


def sync_lock(fs: Any) -> threading.Lock:
    with _FS_LOCK:
        lock = _SYNC_LOCKS.get(fs)
        if lock is None:
            lock = _SYNC_LOCKS[fs] = threading.Lock()
        return lock


def s3_client(fs: Any) -> Any:
    """The synchronous botocore S3 client of the shared s3fs instance ``fs`` (thread-safe once
    made; made once per instance): same session arguments, credentials, endpoint, config and
    client arguments as s3fs's own ``set_session``."""
    with _FS_LOCK:
        client = _S3_CLIENTS.get(fs)
        if client is not None:
            return client
        import botocore.session
        from botocore.config import Config

        client_kwargs = dict(fs.client_kwargs)
        init_kwargs = {name: value for name, value in (
            ("aws_access_key_id", fs.key), ("aws_secret_access_key", fs.secret),
            ("aws_session_token", fs.token), ("endpoint_url", fs.endpoint_url))
            if value is not None and value != client_kwargs.get(name)}
        if "use_ssl" not in client_kwargs:
            init_kwargs["use_ssl"] = fs.use_ssl
        config_kwargs = fs._prepare_config_kwargs()
        if fs.anon:
            from botocore import UNSIGNED

            secret_names = ("aws_access_key_id", "aws_secret_access_key", "aws_session_token")
            for kwargs in (init_kwargs, client_kwargs):
                for name in secret_names:
                    kwargs.pop(name, None)
            config_kwargs["signature_version"] = UNSIGNED
        # what botocore signs requests with anyway; said explicitly so that presigned URLs
        # (sources.s3http) are SigV4 too, which every region accepts
        config_kwargs.setdefault("signature_version", "s3v4")
        session = botocore.session.Session(profile=fs.kwargs.get("profile"))
        data_path = session.get_config_variable("data_path")  # AWS_DATA_PATH, as botocore reads it
        session.register_component("data_loader", _s3_loader()(extra_search_paths=[
            os.path.expanduser(os.path.expandvars(p)) for p in data_path.split(os.pathsep)
        ] if data_path else []))
        client = session.create_client("s3", config=Config(**config_kwargs), **init_kwargs,
                                       **client_kwargs)
        _S3_CLIENTS[fs] = client
        return client


@functools.cache
def _s3_loader() -> type:
    """botocore's data loader for a session that makes S3 clients only. Before it loads a
    service's model, botocore's own asks which services exist by listing every model
    directory it ships (about 400, with a stat of each version's file): 0.1-0.2 s of every
    new process's first S3 request (DataLoader and Dask workers, ``faultfs::`` readers, a
    mount), for an answer that is always "S3 is one"."""
    from botocore.loaders import Loader

    class S3Loader(Loader):  # type: ignore[misc]
        def list_available_services(self, type_name: str) -> list[str]:
            return ["s3"]  # a type S3 has no file of is still a DataNotFoundError

    return S3Loader


def s3_presigner(fs: Any, bucket: str) -> Any:
    """What makes presigned URLs of ``fs``'s objects in ``bucket``: a client-less presigner
    where the URL is plain to derive (``sources.s3sign``: no service model loaded), else the
    client."""
    light = _light(fs)
    if light is not None and (not light.virtual or virtual_hostable(bucket)):
        return light
    return s3_client(fs)


def _light(fs: Any) -> LightPresigner | None:
    with _FS_LOCK:
        if fs in _S3_LIGHT:
            return _S3_LIGHT[fs]
    try:
        light = light_presigner(fs)
    except Exception:  # a profile botocore cannot read: its client will say what is wrong
        light = None
    with _FS_LOCK:
        return _S3_LIGHT.setdefault(fs, light)


def s3_connections(fs: Any) -> Any:
    """The pool of kept-alive connections that presigned GETs of ``fs``'s objects use
    (``sources.s3http``), or None when that path does not fit its settings."""
    light = _light(fs)
    client = None if light is not None else s3_client(fs)
    with _FS_LOCK:
        if fs in _S3_POOLS:
            return _S3_POOLS[fs]
        from faultfs.sources.s3http import ConnectionPool, ssl_context_for, usable

        pool = None
        if usable(fs, client, light.endpoint if light is not None else ""):
            config = fs._prepare_config_kwargs()
            pool = ConnectionPool(config.get("connect_timeout") or CONNECT_TIMEOUT_S,
                                  config.get("read_timeout") or READ_TIMEOUT_S,
                                  lambda: ssl_context_for(fs))
        _S3_POOLS[fs] = pool
        return pool


def clear_filesystems() -> None:
    """Forget the shared file-system instances (tests; a process that changes its AWS setup)."""
    with _FS_LOCK:
        _FILESYSTEMS.clear()
        for pool in _S3_POOLS.values():
            if pool is not None:
                pool.close()
        _S3_POOLS.clear()
        _S3_LIGHT.clear()
        for client in _S3_CLIENTS.values():
            client.close()
        _S3_CLIENTS.clear()


# --- what a backend reports, and how it reads ---

