"""Resumable, deduplicating record streams over multi-shard sources (DESIGN §9).

``RecordStream`` is the entry point; ``shards`` expands sources, ``readers`` turns one shard into
blocks of records, ``columns`` parses a block into a pyarrow.Table in bulk, ``delivered`` decides
duplicates a block at a time, ``partition`` splits the records among distributed readers
(rank x worker) and records that split, and the checkpoint lives in ``faultfs.store.metadata``.
``faultfs.stream.torch`` (PyTorch's ``IterableDataset``) is imported only by its users.
"""

from faultfs.stream.columns import RecordParseError
from faultfs.stream.record_stream import RecordStream

__all__ = ["RecordParseError", "RecordStream"]
