"""What the tests and the torture suite read of a live mount through its tree: the stats
document, the counters, a tag's directory."""

from __future__ import annotations

import json
import os


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
