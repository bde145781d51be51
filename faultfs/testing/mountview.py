"""What the tests and the torture suite read of a live mount through its tree: the stats
document, the counters, a tag's directory."""

from __future__ import annotations

import json
import os
import time


class MountView:
    """Reads of a mount at ``self.path`` (set by the subclass)."""

    path: str

    def stats(self) -> dict:
        with open(os.path.join(self.path, ".faultfs", "stats"), "rb") as f:
            return json.loads(f.read())

    def counters(self) -> dict:
        return self.stats()["counters"]

    def tag(self, name: str) -> str:
        return os.path.join(self.path, name)

    def wait_staged(self, tag: str, count: int, timeout: float = 15.0) -> None:
        """Wait until ``count`` blobs of ``tag`` are in the store (a fault stores its blobs in
        the background, behind its readers); AssertionError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while self.stats()["tags"][tag]["staged_blobs"] < count:
            assert time.monotonic() < deadline, f"{tag}: {count} blobs not staged in {timeout} s"
            time.sleep(0.02)
