"""Checking a store no mount owns: one streaming walk over every file of it (``StoreWalk``),
shared by ``fsck`` (verify, report, repair) and ``gc`` (``store/gc.py``: reclaim space).

One room for each area of the store (its layout is in ``blobstore.py``, ``dirty.py`` and
``journal.py``): ``registry.py`` the registry entries, ``tags.py`` the tag states, staged
blobs and pagemaps, ``writes.py`` the write states and dirty files, ``segments.py`` the
journal; beside them ``blobs.py`` (one blob file read and verified), ``look.py`` (entries
looked at without trusting them), ``findings.py`` (what a finding says), ``walk.py`` (the
passes in order, and ``drop``) and ``report.py`` (fsck's tally and repair). The lock is the
store's own (``store/lock.py``).

Invariants:
- Memory is bounded by the number of *tags* (the registry, encoded directory names), never by
  the number of blobs: directories are streamed with ``scandir`` (the journal's segment names
  excepted: one per 64 MiB of it), payloads are read in pieces of at most ``READ_STEP``, and
  findings go to the caller as they are made.
- Nothing is changed unless the caller drops a finding (``StoreWalk.drop``); a finding with a
  ``keep`` reason — dirty data, write states, the journal, entries the walk does not know — is
  never dropped. A registry entry without a tag state is kept too: a mount recovers it.
- The store is locked (``StoreLock``) as a mount locks it (``BlobStore.acquire``), without ever
  waiting: a store a live mount owns is refused, and a mount started during the walk is
  refused by the lock instead of blocking on it.

Public here: the findings' vocabulary, ``StoreWalk``, ``fsck`` and its report, the lock and
the checks a caller makes before a walk. Callers import this face, never a room.
"""

from faultfs.store.fsck.findings import (
    AREAS,
    BLOBS,
    DAMAGED,
    DIRTY,
    JOURNAL,
    LEFTOVER,
    OK,
    ORPHANED,
    OTHER,
    PAGEMAPS,
    REGISTRY,
    STALE,
    STATUSES,
    TAG_STATES,
    TEMP,
    WRITE_STATES,
    Finding,
)
from faultfs.store.fsck.look import check_store_root, check_writable, measure
from faultfs.store.fsck.report import FsckReport, Tally, fsck
from faultfs.store.fsck.walk import StoreWalk
from faultfs.store.lock import StoreBusy, StoreLock

__all__ = [
    "AREAS", "BLOBS", "DAMAGED", "DIRTY", "JOURNAL", "LEFTOVER", "OK", "ORPHANED", "OTHER",
    "PAGEMAPS", "REGISTRY", "STALE", "STATUSES", "TAG_STATES", "TEMP", "WRITE_STATES", "Finding",
    "FsckReport", "StoreBusy", "StoreLock", "StoreWalk", "Tally", "check_store_root",
    "check_writable", "fsck", "measure",
]
