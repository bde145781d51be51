"""Shuffled record streams (DESIGN §19): each epoch a seeded permutation of the records, a pure
function of the seed, the epoch and the shards with their sizes, resumed exactly from a
checkpoint.

One duty a module: ``plan`` (the arithmetic: the shard order, the blocks, their deal to the
readers, the windows and the permutations), ``window`` (a window read, its records numbered,
mixed and handed out as blocks), ``record`` (the shuffle record beside a reader's state and
its byte format), ``epochs`` (which epoch a reader is in, where it resumes, what its commits
record: the face's opener of a shuffled stream) and ``carry`` (a repartition inside an epoch:
the rest of it carried to the new readers, and that rest's format). The formats are in
docs/FORMAT-cursors.md.
"""

from faultfs.stream.shuffle.carry import decode_carried, replace_shuffled
from faultfs.stream.shuffle.epochs import Epochs, refuse_unshuffled_state
from faultfs.stream.shuffle.plan import (
    DEFAULT_WINDOW,
    WINDOW_BLOCKS,
    EpochGrid,
    Geometry,
    WindowSpec,
    permutation,
    reader_windows,
)
from faultfs.stream.shuffle.record import (
    ShuffleHeader,
    ShuffleRecord,
    ShuffleSlot,
    committed_pair,
    decode,
    decode_slot,
    image,
    meta_bytes,
    read_record,
    settle,
)
from faultfs.stream.shuffle.window import EpochReader, MixedBlock

__all__ = [
    "DEFAULT_WINDOW", "WINDOW_BLOCKS", "EpochGrid", "EpochReader", "Epochs", "Geometry",
    "MixedBlock", "ShuffleHeader", "ShuffleRecord", "ShuffleSlot", "WindowSpec",
    "committed_pair", "decode", "decode_carried", "decode_slot", "image",
    "meta_bytes", "permutation", "read_record", "reader_windows", "refuse_unshuffled_state",
    "replace_shuffled", "settle",
]
