"""The local tier: staged blobs in the embedded store (a directory of blob files, ``store/``),
as a package of rooms behind this face.

Rooms: ``tier.py`` (``LocalTier``: the tier's protocol — get, put, contains, evict — and the
path of each read), ``staged.py`` (which blobs of each tag are staged: one bit per blob, and
the scan that fills it), ``openfiles.py`` (recently read blob files kept open for hits),
``ringreads.py`` (staged reads through io_uring).

Public here: ``LocalTier``, the ``ScanResult`` of opening a tag, ``StagedSet``. Callers import
this face, never a room.
"""

from faultfs.tiers.local.staged import ScanResult, StagedSet
from faultfs.tiers.local.tier import LocalTier

__all__ = ["LocalTier", "ScanResult", "StagedSet"]
