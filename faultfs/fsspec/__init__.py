"""``faultfs::<url>``: the fsspec protocol over a faultfs store that many processes on a node
share (DESIGN §18). Registered through fsspec's entry points (``fsspec.specs``), so
``fsspec.open("faultfs::s3://bucket/key", faultfs={"store": DIR})`` works once faultfs is
installed.

Rooms: ``filesystem`` (the fsspec face: options, passthrough of listings, pinned opens,
writes refused), ``objects`` (one pinned object's chunks: hit, wait, fault, publish),
``landing`` (a fault in flight: readers answered as their bytes land, split source reads),
``claims`` (a per-blob lock file: one source read per blob per store), ``space`` (reserve,
cap and LRU read from the file system), ``shared`` (the shared tier: chunks other nodes
faulted, in an object store). Public here: ``FaultFileSystem``, ``FaultFile`` and
the errors it raises.
"""

from faultfs.fsspec.filesystem import FaultFile, FaultFileSystem, OptionError, ReadOnlyError

__all__ = ["FaultFile", "FaultFileSystem", "OptionError", "ReadOnlyError"]
