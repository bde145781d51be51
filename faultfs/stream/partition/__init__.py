"""Partitions: which records each distributed reader (rank x worker) of a RecordStream owns.

One duty a module: ``plan`` (one reader's plan: find, make or replace its partition),
``sidecar`` (the record of a partition and its byte format), ``keys`` (keys, intervals and
their split by measure), ``committed`` (what the readers committed, read without changing a
file), ``repartition`` (a new partition of what no reader committed), ``locks`` (the flocks
that keep openers, readers and a repartition apart) and ``names`` (the files of a partition).
The formats are in docs/FORMAT-cursors.md.
"""

from faultfs.stream.partition.committed import (
    HASH_DTYPE,
    CommittedState,
    load_base,
    meta_image,
    read_committed,
    read_hashes,
)
from faultfs.stream.partition.keys import shard_pieces
from faultfs.stream.partition.locks import claim_states
from faultfs.stream.partition.names import (
    PARTITION_SUFFIX,
    SHUFFLE_SUFFIX,
    base_path,
    carried_path,
    check_template,
    fresh_name,
    reader_paths,
    reader_state_path,
)
from faultfs.stream.partition.plan import (
    ReaderPlan,
    Replace,
    first_partition,
    plan_reader,
    shard_sizes,
)
from faultfs.stream.partition.repartition import roll_forward, write_replacement
from faultfs.stream.partition.sidecar import (
    MAX_SIDECAR_BYTES,
    Partition,
    decode,
    encode,
    fingerprint,
    load,
    store,
)

__all__ = [
    "HASH_DTYPE", "MAX_SIDECAR_BYTES", "PARTITION_SUFFIX", "SHUFFLE_SUFFIX", "CommittedState",
    "Partition",
    "ReaderPlan", "Replace", "base_path", "carried_path", "check_template", "claim_states",
    "decode", "encode", "fingerprint", "first_partition", "fresh_name", "load", "load_base",
    "meta_image", "plan_reader", "read_committed", "read_hashes", "reader_paths",
    "reader_state_path", "roll_forward", "shard_pieces", "shard_sizes", "store",
    "write_replacement",
]
