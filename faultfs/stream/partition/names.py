"""The file names of a partitioned stream.

Each reader's state, the sidecar, its locks, the carried hashes and a repartition's fresh
states.

Invariants:
- ``world_size == num_workers == 1`` without a template names one state file, ``state``
  itself: the unpartitioned stream of before. Any other partition gives every reader a name of
  its own: ``<state>.rank-R.worker-W.meta``, or the user's template, which holds ``{rank}`` and
  ``{worker}`` and nothing else to format (``check_template``).
- The sidecar, its two locks and the carried hashes of generation G are
  ``<state>.partition``, ``.partition.lock``, ``.partition.readers`` and
  ``.partition.gG.dedup``; a repartition to generation G writes each new reader's fresh state
  as ``<its state>.gG.fresh`` before renaming it into place.
- A shuffled reader keeps a shuffle record beside its state, ``<its state>.shuffle``, part of
  the state (made fresh, renamed and removed with it); the rest of a shuffled epoch carried
  over a repartition to generation G is ``<state>.partition.gG.shuffle``.
"""

from __future__ import annotations

import os

from faultfs.errors import InvalidInput
from faultfs.store.metadata import WAL_SUFFIX

PARTITION_SUFFIX = ".partition"
LOCK_SUFFIX = ".partition.lock"
READERS_SUFFIX = ".partition.readers"  # every open partitioned reader holds a shared flock
SHUFFLE_SUFFIX = ".shuffle"  # a shuffled reader's record beside its state (faultfs.stream.shuffle)


def check_template(reader_state: str | os.PathLike[str] | None) -> str:
    """The reader state template (``""``: default names), checked to name every reader apart."""
    if reader_state is None:
        return ""
    template = os.fspath(reader_state)
    if "{rank}" not in template or "{worker}" not in template:
        raise InvalidInput(
            f"reader_state {template!r} must contain {{rank}} and {{worker}}, so that every "
            "reader has its own state file"
        )
    try:
        template.format(rank=0, worker=0)
    except (KeyError, IndexError, ValueError) as err:
        raise InvalidInput(
            f"reader_state {template!r} may only use {{rank}} and {{worker}}: {err}"
        ) from None
    return template


def reader_state_path(
    state: str, template: str, rank: int, worker: int, world_size: int, num_workers: int
) -> str:
    """The state file of one reader: ``state`` itself for one unpartitioned reader, else
    ``<state>.rank-R.worker-W.meta`` or the user's template."""
    if template:
        return template.format(rank=rank, worker=worker)
    if world_size == 1 and num_workers == 1:
        return state
    return f"{state}.rank-{rank}.worker-{worker}.meta"


def reader_paths(state: str, template: str, world_size: int, num_workers: int) -> list[str]:
    return [
        reader_state_path(state, template, r, w, world_size, num_workers)
        for r in range(world_size)
        for w in range(num_workers)
    ]


def base_path(state: str, generation: int) -> str:
    return f"{state}{PARTITION_SUFFIX}.g{generation}{WAL_SUFFIX}"


def carried_path(state: str, generation: int) -> str:
    return f"{state}{PARTITION_SUFFIX}.g{generation}{SHUFFLE_SUFFIX}"


def state_files(path: str) -> tuple[str, str, str]:
    """A reader state's files: its ``.meta``, its WAL and its shuffle record."""
    return path, path + WAL_SUFFIX, path + SHUFFLE_SUFFIX


def fresh_name(path: str, generation: int) -> str:
    return f"{path}.g{generation}.fresh"
