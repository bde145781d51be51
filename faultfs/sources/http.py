"""HTTP(S) resources read with 206 range requests on a shared aiohttp session, pinned to a version.

Invariants:
- Reads carry ``If-Match`` on a strong ETag (else ``If-Unmodified-Since`` on Last-Modified),
  and the response's ETag / Last-Modified and ``Content-Range`` total are checked.
- Bodies are asked for with ``Accept-Encoding: identity``: a compressed body's byte ranges are
  not the resource's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from email.utils import parsedate_to_datetime
from typing import Any

from fsspec.asyn import sync

from faultfs.sources.objects import ObjectStat, content_range, etag_core, status_phrase, strong_etag
from faultfs.sources.retry import (
    HTTP_TRANSIENT_STATUSES,
    Changed,
    Denied,
    Failure,
    Missing,
    Permanent,
    Transient,
    transport_failure,
)


class HttpReader:
    """An HTTP(S) resource read with 206 range requests on a shared aiohttp session."""

    def __init__(self, fs: Any, url: str, scrub: Callable[[str], str]) -> None:
        self._fs = fs
        self._url = url
        self._scrub = scrub

    def _status_failure(self, status: int) -> Failure:
        what = f"HTTP {status} {status_phrase(status)}"
        if status in (404, 410):
            return Missing(what)
        if status in (401, 403):
            return Denied(what)
        if status >= 500 or status in HTTP_TRANSIENT_STATUSES:
            return Transient(what)
        return Permanent(what)

    def _classify(self, exc: BaseException) -> Failure:
        if isinstance(exc, Failure):
            return exc
        return transport_failure(exc, self._scrub) or Permanent(
            self._scrub(f"{type(exc).__name__}: {exc}")
        )

    async def _request(self, method: str, headers: dict[str, str]) -> Any:
        session = await self._fs.set_session()
        kw = dict(self._fs.kwargs)
        # identity: a compressed body's byte ranges are not the resource's byte ranges
        merged = {**kw.pop("headers", {}), "Accept-Encoding": "identity", **headers}
        return session.request(method, self._fs.encode_url(self._url), headers=merged, **kw)

    def stat(self) -> ObjectStat:
        return sync(self._fs.loop, self._stat)

    async def _stat(self) -> ObjectStat:
        try:
            async with await self._request("HEAD", {}) as r:
                size = r.headers.get("Content-Length")
                if r.status == 200 and size is not None:
                    return self._stat_from(int(size), r.headers)
                # 401/403 too: a presigned URL is signed for GET only, so S3 refuses its HEAD
                if r.status not in (200, 401, 403, 405, 501):
                    raise self._status_failure(r.status)
            # HEAD refused or without a length: ask for the first byte and read the total
            async with await self._request("GET", {"Range": "bytes=0-0"}) as r:
                if r.status in (206, 416):
                    _, total = content_range(r.headers.get("Content-Range", ""))
                elif r.status == 200:
                    total = r.content_length
                else:
                    raise self._status_failure(r.status)
                if total is None:
                    raise Permanent("the server reports no size for it")
                return self._stat_from(total, r.headers)
        except Exception as exc:
            raise self._classify(exc) from None

    @staticmethod
    def _stat_from(size: int, headers: Any) -> ObjectStat:
        etag = headers.get("ETag", "")
        last_modified = headers.get("Last-Modified", "")
        mtime = time.time()
        if last_modified:
            try:
                mtime = parsedate_to_datetime(last_modified).timestamp()
            except (TypeError, ValueError):
                last_modified = ""
        if etag:
            token = f"etag:{etag}"
        elif last_modified:
            token = f"lastmod:{last_modified}"
        else:
            token = "unpinned"
        return ObjectStat(size, token, mtime, etag=etag, last_modified=last_modified)

    def read(self, pin: ObjectStat, start: int, end: int) -> bytes | memoryview:
        return sync(self._fs.loop, self._read, pin, start, end)

    async def _read(self, pin: ObjectStat, start: int, end: int) -> bytes | memoryview:
        headers = {"Range": f"bytes={start}-{end - 1}"}
        if strong_etag(pin.etag):
            headers["If-Match"] = pin.etag
        elif pin.last_modified and not pin.etag:
            headers["If-Unmodified-Since"] = pin.last_modified
        try:
            async with await self._request("GET", headers) as r:
                if r.status == 412:
                    raise Changed("its validator no longer matches the pinned one (HTTP 412)")
                if r.status == 416:
                    raise Changed("the range is past its current end (HTTP 416)")
                if r.status not in (200, 206):
                    raise self._status_failure(r.status)
                etag = r.headers.get("ETag", "")
                if pin.etag and etag and etag_core(etag) != etag_core(pin.etag):
                    raise Changed(f"its ETag is now {etag}")
                last_modified = r.headers.get("Last-Modified", "")
                if not pin.etag and pin.last_modified and last_modified and (
                    last_modified != pin.last_modified
                ):
                    raise Changed(f"it was modified at {last_modified}")
                if r.status == 206:
                    first, total = content_range(r.headers.get("Content-Range", ""))
                    if total is not None and total != pin.size:
                        raise Changed(f"its size is now {total}")
                    if first != start:
                        raise Permanent(f"the server answered a different range ({first})")
                    data = await r.read()
                else:  # 200: the server ignored Range and sends the whole resource
                    if r.content_length is not None and r.content_length != pin.size:
                        raise Changed(f"its size is now {r.content_length}")
                    if start != 0:
                        raise Permanent("the server does not honour Range requests")
                    data = await r.content.readexactly(end)
        except Exception as exc:
            raise self._classify(exc) from None
        if len(data) != end - start:
            raise Transient(f"short body: {len(data)} of {end - start} bytes")
        return data
