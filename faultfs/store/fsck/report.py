"""fsck's verdict: the walk's findings counted area by area (``Tally``, ``FsckReport``), and
with ``--repair`` the clean data that may go dropped as it is found.

Invariants:
- The store is locked for the whole check (``StoreLock``), and checked writable before a
  repair starts (a repair never fails midway for want of permission).
- Only findings without a ``keep`` reason are dropped: damaged and stale clean data,
  orphaned clean blobs, temp files — never dirty data, write states or the journal.
- A leftover of a crash (``LEFTOVER``) is no problem: the store is clean with it, as the
  next mount finds it; a repair drops the temp files among them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from faultfs.store.fsck.findings import AREAS, LEFTOVER, Finding
from faultfs.store.fsck.look import check_store_root, check_writable
from faultfs.store.fsck.walk import StoreWalk
from faultfs.store.lock import StoreLock


@dataclass
class Tally:
    """One row of the summary: entries checked and what they were."""

    checked: int = 0
    ok: int = 0
    damaged: int = 0
    stale: int = 0
    orphaned: int = 0
    leftover: int = 0
    bytes: int = 0

    def add(self, finding: Finding) -> None:
        self.checked += 1
        setattr(self, finding.status, getattr(self, finding.status) + 1)
        self.bytes += finding.size

    def to_doc(self) -> dict:
        return {"checked": self.checked, "ok": self.ok, "damaged": self.damaged,
                "stale": self.stale, "orphaned": self.orphaned, "leftover": self.leftover,
                "bytes": self.bytes}


@dataclass
class FsckReport:
    root: str
    repair: bool
    rows: dict[str, Tally] = field(default_factory=lambda: {a: Tally() for a in AREAS})
    problems: int = 0
    leftovers: int = 0  # what a crash left that the next mount clears (not problems)
    dropped: int = 0
    dropped_bytes: int = 0
    kept: int = 0
    kept_why: dict[str, int] = field(default_factory=dict)  # keep reason -> problems kept

    @property
    def total(self) -> Tally:
        out = Tally()
        for row in self.rows.values():
            for name in ("checked", "ok", "damaged", "stale", "orphaned", "leftover", "bytes"):
                setattr(out, name, getattr(out, name) + getattr(row, name))
        return out

    @property
    def clean(self) -> bool:
        return self.problems == 0


def fsck(root: str, *, repair: bool = False,
         on_finding: Callable[[Finding], None] | None = None) -> FsckReport:
    """Verify every file of the store at ``root`` (locked for the while; StoreBusy when a live
    mount owns it). ``repair``: drop damaged and stale clean data, orphaned clean blobs and
    temp files — never dirty data, write states or the journal (kept, reported).
    ``on_finding`` sees every finding as it is made, after the repair decided."""
    root = check_store_root(root)
    report = FsckReport(root, repair)
    with StoreLock(root):
        if repair:
            check_writable(root)
        walk = StoreWalk(root, verify=True)
        for finding in walk:
            report.rows[finding.area].add(finding)
            if finding.problem:
                report.problems += 1
                if finding.keep:
                    finding.action = "kept" if repair else ""
                    report.kept += 1
                    report.kept_why[finding.keep] = report.kept_why.get(finding.keep, 0) + 1
                elif repair:
                    report.dropped_bytes += walk.drop(finding)
                    report.dropped += 1
            elif finding.status == LEFTOVER:
                report.leftovers += 1
                if repair and not finding.keep:  # a temp file: harmless, and gone now
                    report.dropped_bytes += walk.drop(finding)
                    report.dropped += 1
            if on_finding is not None:
                on_finding(finding)
    return report
