"""What the walk reports: one ``Finding`` per entry of the store, with its area, its status
and, for a finding that must never be dropped, why.

Invariants:
- A finding's status is one of ``STATUSES`` and its area one of ``AREAS`` (the rows of
  fsck's summary table, in their order).
- ``LEFTOVER`` is what a crash (a kill -9, a power loss) leaves as a matter of course and the
  next mount clears by itself — a torn journal tail, the file of a whole-chunk write whose
  record never reached the journal, a temporary file — never an answered write: reported,
  not a problem (fsck judges a store as the mount will).
- A finding with a ``keep`` reason is never dropped (``StoreWalk.drop`` refuses it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# Statuses of a finding.
OK, DAMAGED, STALE, ORPHANED, LEFTOVER = "ok", "damaged", "stale", "orphaned", "leftover"
STATUSES = (OK, DAMAGED, STALE, ORPHANED, LEFTOVER)

# Areas: the rows of fsck's summary table.
REGISTRY = "registry entries"
TAG_STATES = "tag states"
BLOBS = "blobs"
PAGEMAPS = "pagemaps"
DIRTY = "dirty blobs"
WRITE_STATES = "write states"
JOURNAL = "journal segments"
TEMP = "temp files"
OTHER = "other entries"
AREAS = (REGISTRY, TAG_STATES, BLOBS, PAGEMAPS, DIRTY, WRITE_STATES, JOURNAL, TEMP, OTHER)

# Why a finding is never dropped.
KEEP_DIRTY = "dirty data"
KEEP_JOURNAL = "the journal"
KEEP_UNKNOWN = "not a file faultfs writes"
KEEP_RECOVERABLE = "a mount with its source recovers it"
KEEP_CLONED = "a registered clone reads its staged blobs"


@dataclass(slots=True)
class Finding:
    """One entry of the store and what the walk found it to be."""

    area: str
    status: str
    path: str  # absolute
    size: int = 0  # bytes of the entry on disk
    reason: str = ""  # what is wrong, naming the blob or tag ("" when it is ok)
    keep: str = ""  # why it is never dropped ("" when it may be)
    action: str = ""  # "dropped", "would drop", "kept" once the caller decided

    @property
    def problem(self) -> bool:
        return self.status not in (OK, LEFTOVER)

    def describe(self, root: str) -> str:
        """One line: status, where, what is wrong, what was done."""
        where = os.path.relpath(self.path, root)
        if self.action in ("dropped", "would drop"):
            done = self.action
        elif self.status == LEFTOVER:
            done = "the next mount clears it"
        elif self.keep:
            done = (f"kept: {self.keep}" if self.action == "kept"
                    else f"--repair keeps it: {self.keep}")
        else:
            done = "--repair drops it"
        return f"{self.status:<8}  {where}: {self.reason} [{done}]"

    def to_doc(self, root: str) -> dict:
        return {"status": self.status, "area": self.area,
                "path": os.path.relpath(self.path, root), "reason": self.reason,
                "bytes": self.size, "keep": self.keep, "action": self.action}
