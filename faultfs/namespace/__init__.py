"""The namespace: tags as a tree of entries with attributes, and what opening each does —
plain code over the engine, testable without a mount (the FUSE adapter only converts).

Public: ``Tree`` (lookups, listings, attributes), ``Files`` (opens), ``OpenFile`` (and
``PlainFile``, its read-only defaults),
``Attributes``, ``Node``, and the rename flags ``Files.rename`` takes.
"""

from faultfs.namespace.files import RENAME_EXCHANGE, RENAME_NOREPLACE, Files, OpenFile
from faultfs.namespace.handle import PlainFile
from faultfs.namespace.tree import (
    ATTR_TIMEOUT,
    BLOCK_SIZE,
    Attributes,
    Node,
    Tree,
)

__all__ = ["ATTR_TIMEOUT", "BLOCK_SIZE", "RENAME_EXCHANGE", "RENAME_NOREPLACE", "Attributes",
           "Files", "Node", "OpenFile", "PlainFile", "Tree"]
