"""Partitions: which records each distributed reader (rank x worker) of a RecordStream owns.

One duty a module: ``plan`` (one reader's plan: find, make or replace its partition),
``sidecar`` (the record of a partition and its byte format), ``keys`` (keys, intervals and
their split by measure), ``committed`` (what the readers committed, read without changing a
file), ``repartition`` (a new partition of what no reader committed), ``locks`` (the flocks
that keep openers, readers and a repartition apart) and ``names`` (the files of a partition).
The formats are in docs/FORMAT-cursors.md.
"""

from faultfs.stream.partition.committed import load_base, meta_image, read_committed
from faultfs.stream.partition.keys import shard_pieces
from faultfs.stream.partition.names import (
    PARTITION_SUFFIX,
    check_template,
    reader_paths,
    reader_state_path,
)
from faultfs.stream.partition.plan import ReaderPlan, plan_reader
from faultfs.stream.partition.sidecar import MAX_SIDECAR_BYTES, Partition, decode, encode, load

__all__ = [
    "MAX_SIDECAR_BYTES", "PARTITION_SUFFIX", "Partition", "ReaderPlan", "check_template",
    "decode", "encode", "load", "load_base", "meta_image", "plan_reader", "read_committed",
    "reader_paths", "reader_state_path", "shard_pieces",
]
