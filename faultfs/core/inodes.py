"""The inode codec: inode numbers are computed from what an entry is, not allocated.

``inode = (tag_id << 40) | (kind << 36) | index``. A tag with millions of chunks costs no
memory per entry, listings stream from any offset, and ``forget`` has nothing to release.
Inodes 1..6 are the fixed entries of the root (1 is FUSE's root inode).

Invariants:
- ``split(make(t, k, i)) == (t, k, i)`` for every ``0 <= i <= MAX_INDEX``, ``0 < k < 16``.
- No computed inode of a tag (``tag_id >= 1``) collides with a fixed one.
"""

from __future__ import annotations

ROOT = 1  # pyfuse3.ROOT_INODE
CTL_DIR, STATS_FILE, REGISTRY_DIR, CONTROL_FILE, METRICS_FILE = 2, 3, 4, 5, 6

KIND_DIR, KIND_CHUNK, KIND_VIEW, KIND_PAGE, KIND_PAGEMAP, KIND_REGISTRY = 1, 2, 3, 4, 5, 6
KIND_USER = 7  # a blob a user created in a tag directory (index: its id in the tag)
INDEX_BITS, KIND_BITS = 36, 4
MAX_INDEX = (1 << INDEX_BITS) - 1  # the most chunks (or pages) an inode can number


def make(tag_id: int, kind: int, index: int = 0) -> int:
    return (tag_id << (INDEX_BITS + KIND_BITS)) | (kind << INDEX_BITS) | index


def split(inode: int) -> tuple[int, int, int]:
    """``(tag_id, kind, index)`` of an inode."""
    return (inode >> (INDEX_BITS + KIND_BITS), (inode >> INDEX_BITS) & 0xF, inode & MAX_INDEX)
