"""Requests to a live mount through ``<mount>/.faultfs/control`` (``faultfs reset``,
``faultfs clone``): one request per open, the answer read back from the same file."""

from __future__ import annotations

import errno
import json
import os

from faultfs.core.names import CTL_NAME
from faultfs.errors import FaultfsError, InvalidInput


def split_tag_dir(path: str) -> tuple[str, str]:
    """``(mount root, tag)`` of ``MNT/TAG``; InvalidInput when it is not one."""
    tag_dir = os.path.abspath(path).rstrip("/")
    root, tag = os.path.split(tag_dir)
    if not os.path.isdir(os.path.join(root, CTL_NAME)):
        raise InvalidInput(f"{path} is not a tag directory of a faultfs mount (MNT/TAG)")
    return root, tag


def request(root: str, req: dict) -> dict:
    """Send ``req`` to the mount at ``root``; the answer, or FaultfsError with its message."""
    path = os.path.join(root, CTL_NAME, "control")
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        raise InvalidInput(f"{root} is not a faultfs mount that takes requests") from None
    try:
        os.write(fd, json.dumps(req).encode())
        raw = b""
        while chunk := os.pread(fd, 65536, len(raw)):
            raw += chunk
    finally:
        os.close(fd)
    try:
        answer = json.loads(raw)
    except ValueError:
        raise FaultfsError(f"the mount at {root} answered something that is not JSON") from None
    if not answer.get("ok"):
        raise FaultfsError(str(answer.get("error", "the request failed")),
                           int(answer.get("errno", errno.EIO)))
    return answer
