"""``.faultfs/control``: one request to the daemon per open — write a JSON request, read the
JSON answer — for what changes a mount's tags (``faultfs reset``, ``faultfs clone``).

Requests: ``{"op": "reset", "tag": T}`` (every write of T dropped),
``{"op": "reset", "tag": T, "blobs": [...]}`` (those blobs only),
``{"op": "clone", "tag": T, "new": N}`` (N becomes a point-in-time copy of T),
``{"op": "forget", "tag": T, "keep_blobs": bool, "discard_writes": bool}`` (T is
unregistered: its directory goes, its registry entry and blobs are removed unless kept),
``{"op": "staged", "tag": T}`` (which chunks a read serves without the source: ``chunks``,
their name ``prefix`` and ``bitmap``, base64 of one bit per chunk, chunk i at bit ``i % 8``
of byte ``i // 8``; ``faultfs warm`` asks it once per tag).
The answer is ``{"ok": true, ...}`` or ``{"ok": false, "error": "<one line>", "errno": n}``.

Invariants: the request runs once, when the answer is first read; a request that cannot be
parsed changes nothing; the file is 0600 and only its owner can open it.
"""

from __future__ import annotations

import base64
import errno
import json
from collections import Counter
from typing import Any, Protocol

from faultfs.engine import Engine, Tag
from faultfs.errors import FaultfsError
from faultfs.namespace.handle import PlainFile

MAX_REQUEST = 1 << 16


class Controlled(Protocol):
    """What requests need of the namespace's open files (``namespace.files.Files``)."""

    engine: Engine
    live: Counter[int]  # tag id -> files open now

    async def invalidate_tag(self, tag: Tag) -> None: ...

    async def forgotten(self, tag: Tag) -> None: ...


class ControlFile(PlainFile):
    keep_cache = False
    direct_io = True

    def __init__(self, files: Controlled) -> None:
        self.files = files
        self.engine = files.engine
        self.invalidate_tag = files.invalidate_tag
        self.request = bytearray()
        self.answer: bytes | None = None

    async def read(self, off: int, size: int) -> bytes:
        if self.answer is None:
            self.answer = (json.dumps(await self._run(), sort_keys=True) + "\n").encode()
        return self.answer[off:off + size]

    async def write(self, off: int, data: bytes, *, cached: bool = False) -> int:
        if self.answer is not None or off + len(data) > MAX_REQUEST:
            raise FaultfsError("one request per open, of at most 64 KiB", errno.EINVAL)
        if off > len(self.request):
            self.request.extend(bytes(off - len(self.request)))
        self.request[off:off + len(data)] = data
        return len(data)

    async def truncate(self, size: int) -> None:
        del self.request[size:]

    async def _run(self) -> dict[str, Any]:
        try:
            try:
                req = json.loads(bytes(self.request).decode("utf-8"))
            except (UnicodeDecodeError, ValueError):
                raise FaultfsError("the request is not JSON", errno.EINVAL) from None
            if not isinstance(req, dict):
                raise FaultfsError("the request is not a JSON object", errno.EINVAL)
            return {"ok": True, **await self._dispatch(req)}
        except FaultfsError as exc:
            return {"ok": False, "error": exc.message, "errno": exc.errno}

    async def _dispatch(self, req: dict) -> dict[str, Any]:
        op = req.get("op")
        tag = self.engine.tags.get(str(req.get("tag", "")))
        if op not in ("reset", "clone", "forget", "staged"):
            raise FaultfsError(f"unknown request {op!r}", errno.EINVAL)
        if tag is None:
            raise FaultfsError(f"no tag named {req.get('tag')!r} in this mount", errno.ENOENT)
        if op == "staged":
            return {"chunks": self.engine.num_chunks(tag),
                    "prefix": tag.layout.blob_prefix,
                    "bitmap": base64.b64encode(self.engine.here_bitmap(tag)).decode()}
        if op == "forget":
            if self.files.live.get(tag.id, 0) > 0:
                raise FaultfsError(f"tag {tag.name} has {self.files.live[tag.id]} file(s) open: "
                                   "close them first", errno.EBUSY)
            freed = await self.engine.forget_tag(tag, keep_blobs=req.get("keep_blobs") is True,
                                                 discard_writes=req.get("discard_writes") is True)
            await self.files.forgotten(tag)
            return {"freed_bytes": freed}
        if op == "reset":
            blobs = req.get("blobs")
            if blobs is not None and not (isinstance(blobs, list)
                                          and all(isinstance(b, str) for b in blobs)):
                raise FaultfsError("blobs must be a list of names", errno.EINVAL)
            dropped = await self.engine.reset(tag, blobs)
            await self.invalidate_tag(tag)
            return {"dropped": dropped}
        new = req.get("new")
        if not isinstance(new, str):
            raise FaultfsError("a clone needs a new tag name", errno.EINVAL)
        child = await self.engine.clone_tag(tag, new)
        return {"tag": child.name}
