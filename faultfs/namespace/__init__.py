"""The namespace: tags as a tree of entries with attributes, and what opening each does —
plain code over the engine, testable without a mount (the FUSE adapter only converts).

Public: ``Tree`` (lookups, listings, attributes), ``Files`` (opens), ``OpenFile``,
``Attributes``, ``Node``.
"""

from faultfs.namespace.files import Files, OpenFile
from faultfs.namespace.tree import (
    ATTR_TIMEOUT,
    BLOCK_SIZE,
    Attributes,
    Node,
    Tree,
)

__all__ = ["ATTR_TIMEOUT", "BLOCK_SIZE", "Attributes", "Files", "Node", "OpenFile",
           "Tree"]
