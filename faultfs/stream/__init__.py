"""Resumable, deduplicating record streams over multi-shard sources (DESIGN §9).

``RecordStream`` (``record_stream``) is the entry point, assembling batches; ``shards`` expands
sources, ``opening`` picks a reader's shards in order and opens each where it resumes,
``readers`` turns one shard into blocks of records, ``columns`` parses a block into a
pyarrow.Table in bulk, ``hashing`` hashes its records, ``fresh`` decides which are delivered
(over ``delivered``, the hashes delivered so far), ``read_ahead`` makes the next blocks in
worker threads, ``commits`` commits the batches handed out, ``partition`` splits the records
among distributed readers (rank x worker) and records that split, ``shuffle`` reads each
epoch in a seeded order (and resumes inside it), and the checkpoint lives in
``faultfs.store.metadata``. ``faultfs.stream.torch`` (PyTorch's ``IterableDataset``) is
imported only by its users.
"""

from faultfs.stream.columns import RecordParseError
from faultfs.stream.record_stream import RecordStream

__all__ = ["RecordParseError", "RecordStream"]
