"""Reclaiming space in a store no mount owns: blobs (and states) of tags no longer registered
(unless a registered clone names the tag as its parent: they are its clean chunks), clean
blobs staged from an old source version, temp files of interrupted writes.

It is fsck's walk (``store/fsck/``) reading headers only: what it finds *stale* or
*orphaned* and does not keep goes. Dirty data, write states and the journal are never
touched (a kept finding is never dropped), nor is damage (that is ``fsck --repair``'s to
judge, after reading every block): gc counts it and says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from faultfs.store.fsck import (
    DAMAGED,
    OK,
    STALE,
    TEMP,
    Finding,
    StoreLock,
    StoreWalk,
    check_store_root,
    check_writable,
)

# What gc frees, in the order it reports it.
UNREGISTERED = "blobs and states of tags no longer registered"
OLD_VERSIONS = "blobs of old source versions"
TEMP_FILES = "temp files of interrupted writes"
KINDS = (UNREGISTERED, OLD_VERSIONS, TEMP_FILES)


@dataclass
class GcReport:
    root: str
    dry_run: bool
    freed: dict[str, list[int]] = field(default_factory=lambda: {k: [0, 0] for k in KINDS})
    damaged: int = 0  # left for fsck --repair
    kept: int = 0  # orphaned or stale entries gc never removes (dirty data and the like)

    @property
    def files(self) -> int:
        return sum(count for count, _ in self.freed.values())

    @property
    def bytes(self) -> int:
        return sum(size for _, size in self.freed.values())


def kind_of(finding: Finding) -> str | None:
    """What gc frees ``finding`` as, or None when it stays."""
    if finding.keep or finding.status in (OK, DAMAGED):
        return None
    if finding.area == TEMP:
        return TEMP_FILES
    return OLD_VERSIONS if finding.status == STALE else UNREGISTERED


def gc(root: str, *, dry_run: bool = False,
       on_finding: Callable[[Finding], None] | None = None) -> GcReport:
    """Free what no mount of the store at ``root`` can use (StoreBusy when a live mount owns
    it). ``dry_run``: find and count it, remove nothing."""
    root = check_store_root(root)
    report = GcReport(root, dry_run)
    with StoreLock(root):
        if not dry_run:
            check_writable(root)
        walk = StoreWalk(root, verify=False)
        for finding in walk:
            kind = kind_of(finding)
            if kind is not None:
                freed = report.freed[kind]
                freed[0] += 1
                freed[1] += walk.drop(finding, dry_run=dry_run)
            elif finding.status == DAMAGED:
                report.damaged += 1
            elif finding.problem:
                report.kept += 1
            if on_finding is not None:
                on_finding(finding)
    return report
