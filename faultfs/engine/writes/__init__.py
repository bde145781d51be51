"""Writes: copy-on-write over the read-only source (DESIGN §11, §12), a package of rooms over
one table of dirty blobs.

A written blob is *dirty*: its bytes are a base — the clean chunk (staged, pinned), a dirty
file of its own (``store/dirty.py``), a direct file (a write that covered the whole chunk,
written as a file of its own and journaled as one small record), or nothing (a new blob) —
with the writes since its last fold laid over it (an ``ExtentMap`` in memory, each write
also a journal record). A fold writes base + writes as a new dirty file (a direct file with
nothing over it is renamed, not copied) and lets the journal go.

The rooms, one duty each (their rules at the top of each module):
``face`` (``Writes``: what the engine calls), ``table`` (the dirty blobs, their bases and
counts), ``state`` (per-tag write state and its saves), ``recovery`` (open, replay, bases
after a remount), ``reads`` (dirty bytes), ``base`` (the clean base under a partial write;
``CleanPath``, the engine's clean path as the writes use it), ``blobwrite`` (one blob's
write or cut, and the retry after a reset), ``writing`` (chunks, the view, user blobs, page
gaps), ``users`` (user blob create, unlink, rename), ``sync`` (fsync, group commit),
``checkpoint`` (folds, checkpoints, memory and journal bounds), ``damage`` (damaged blobs),
``reset`` (reset, and its undo when its save fails), ``lifetime`` (clone, forget).

Public here: ``Writes`` and ``CleanPath`` for the engine, ``CleanReads`` (what the writes need
of a clean path), and the limits and names the tests and tools use. The namespace and the
FUSE layer reach writes through the engine's face only.
"""

from faultfs.engine.writes.base import BASE_FAULTS, CleanPath, CleanReads
from faultfs.engine.writes.checkpoint import FOLD_BYTES, JOURNAL_BYTES
from faultfs.engine.writes.face import Writes
from faultfs.engine.writes.table import (
    USER_PART,
    USER_PREFIX,
    Base,
    DirtyBlob,
    part_name,
    user_key,
    void_key,
)
from faultfs.engine.writes.writing import MAX_GROWN, USER_BLOB_MAX

__all__ = [
    "BASE_FAULTS", "FOLD_BYTES", "JOURNAL_BYTES", "MAX_GROWN", "USER_BLOB_MAX", "USER_PART",
    "USER_PREFIX", "Base", "CleanPath", "CleanReads", "DirtyBlob", "Writes", "part_name",
    "user_key", "void_key",
]
