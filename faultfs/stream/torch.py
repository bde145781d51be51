"""A PyTorch ``IterableDataset`` over RecordStream: one reader per (rank, DataLoader worker),
batches tagged with ids unique within the rank, and commits made by the main process.

    >>> ds = RecordDataset("data/*.jsonl", "ckpt/run.meta", batch_size=1024)  # doctest: +SKIP
    >>> for batch_id, records in ds.loader(num_workers=2):                      # doctest: +SKIP
    ...     loss = step(records); optimizer.step()
    ...     ds.commit(batch_id)                  # durable: a restart resumes after it

Needs torch (``pip install 'faultfs[torch]'``); nothing else in faultfs imports this module.
Use the loader with ``batch_size=None`` (``loader()`` does): the dataset makes the batches, and
a collated batch would lose its id's receipt.

Who does what:
- The rank and world size come from the arguments, else from ``torch.distributed`` when it is
  initialised, else from the ``RANK``/``WORLD_SIZE`` environment, else (0, 1); they are fixed
  when the dataset is made, in the main process. Inside a DataLoader worker,
  ``get_worker_info()`` gives the worker and ``num_workers``; without workers the main process
  is worker 0 of 1. Each (rank, worker) is one RecordStream reader of the partition
  (``faultfs.stream.partition``) with its own state file.
- A worker never writes its state. For each batch it takes the coordinate just after the
  batch and its records' hashes from its stream (``RecordStream.hand_off``) and sends them with
  the batch, inside the batch id: a ``BatchId`` is an int that, when the main process unpickles
  it from the DataLoader's queue, files that *receipt* under this dataset and worker, then
  becomes a plain int. The id is ``local_batch_id * num_workers + worker``.
- ``commit(batch_id)`` in the main process takes the receipts of that worker up to that batch
  and commits them to the worker's state with ``DualMetadataManager`` (opened for the commit,
  closed after it), so every batch the training loop received has its hashes committed even
  when it commits only every n-th batch. The worker's stream read its state when it started
  and does not read it again, so there is one writer; a worker's stream starts (each
  ``iter(loader)``) only after the loop's earlier commits returned.
- A worker killed with SIGKILL loses nothing committed: commits are the main process's, and a
  batch the main process never received was never committed. Restarting the rank resumes each
  worker after its last commit; batches received but not committed are delivered again.
- ``state_dict()`` in a worker (where torchdata's ``StatefulDataLoader`` calls it) gives that
  reader's position just after the last batch it produced, and ``load_state_dict()`` there
  puts its state file at that position before it reads: back to it if later batches were
  committed since (the WAL is append-only, so the hashes up to it are the WAL's prefix),
  forward to it if they were not (their hashes were never committed, so a later duplicate of
  one of them can be delivered: only positions are restored exactly then). In the main
  process without an iteration running, ``state_dict()`` gives the committed position of every
  worker of the rank, and ``load_state_dict()`` applies every entry.
- Receipts are kept in the main process until a commit covers them: about 8 bytes per
  record (its hash) of the batches received and not yet committed.
- Shuffled (``shuffle=True``): each worker is a reader of the epoch's permutation, dealt its
  blocks (``faultfs.stream.shuffle``); a receipt also carries the shuffle slot after its
  batch, which ``commit`` writes into the worker's shuffle record before the ``.meta`` slot.
  ``set_epoch(n)`` (in the process that iterates, before ``iter``) picks the epoch every
  later iteration reads, as a ``DistributedSampler``'s does: an iteration continues that
  epoch where the workers' checkpoints are in it, and reads it from its start where they
  finished it. Never set (``epoch=None``), each iteration continues the checkpoint's epoch,
  or starts the next one where a worker finished its part.

Invariants:
- A batch id names one (worker, local batch) of this rank; local batch ids are the reader's
  own RecordStream batch ids (they continue from its last commit across restarts).
- Receipts of one worker are kept in production order; a receipt for local batch ``b``
  replaces any kept receipt ``>= b`` (a new iteration produces those batches again).
"""

from __future__ import annotations

import os
import secrets
import threading
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np

from faultfs.core.coord import StreamCoordinate
from faultfs.core.slots import DiskSlot
from faultfs.errors import InvalidInput
from faultfs.store.durable import write_atomic
from faultfs.store.metadata import DualMetadataManager
from faultfs.stream import RecordStream
from faultfs.stream.partition import (
    PARTITION_SUFFIX,
    SHUFFLE_SUFFIX,
    CommittedState,
    check_template,
    load,
    meta_image,
    read_committed,
    reader_state_path,
)
from faultfs.stream.shuffle import (
    ShuffleRecord,
    ShuffleSlot,
    committed_pair,
    decode_slot,
    image,
    meta_bytes,
    read_record,
    settle,
)
from faultfs.stream.shuffle import decode as decode_record

try:
    import torch
    import torch.utils.data as torch_data
except ImportError:  # pragma: no cover - depends on the installed extras
    raise InvalidInput("faultfs.stream.torch needs PyTorch: pip install 'faultfs[torch]'") from None

STATE_VERSION = 1  # of the dicts state_dict() returns
_HASH_DTYPE = np.dtype("<u8")


class Batch(NamedTuple):
    """What the dataset yields: ``(batch_id, records)``; records as ``RecordStream.batches``
    gives them in the chosen ``format``."""

    batch_id: int
    records: Any


class _Receipt(NamedTuple):
    local: int
    coord: bytes  # 32-byte StreamCoordinate just after the batch
    hashes: bytes  # little-endian xxh3_64 of its records
    shuffle: bytes = b""  # a shuffled reader's 64-byte shuffle slot after the batch


class _Receipts:
    """Receipts that reached this process, per dataset token and worker (any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: dict[str, dict[int, deque[_Receipt]]] = {}
        self._workers: dict[str, int] = {}  # num_workers of the receipts of each token

    def file(self, token: str, worker: int, num_workers: int, receipt: _Receipt) -> None:
        with self._lock:
            if self._workers.get(token) != num_workers:
                self._kept[token] = {}  # a new partition of the workers: older receipts are void
                self._workers[token] = num_workers
            kept = self._kept[token].setdefault(worker, deque())
            while kept and kept[-1].local >= receipt.local:
                kept.pop()
            kept.append(receipt)

    def num_workers(self, token: str) -> int | None:
        with self._lock:
            return self._workers.get(token)

    def take(self, token: str, worker: int, local: int) -> list[_Receipt]:
        """The receipts of ``worker`` up to ``local``, removed (empty if ``local`` is not kept)."""
        with self._lock:
            kept = self._kept.get(token, {}).get(worker)
            if not kept or not any(r.local == local for r in kept):
                return []
            out = []
            while kept and kept[0].local <= local:
                out.append(kept.popleft())
            return out

    def put_back(self, token: str, worker: int, receipts: list[_Receipt]) -> None:
        with self._lock:
            self._kept.setdefault(token, {}).setdefault(worker, deque()).extendleft(
                reversed(receipts)
            )

    def forget(self, token: str) -> None:
        with self._lock:
            self._kept.pop(token, None)
            self._workers.pop(token, None)


_RECEIPTS = _Receipts()


def _arrive(token: str, value: int, worker: int, num_workers: int, receipt: _Receipt) -> int:
    """Unpickling a ``BatchId`` in the main process: file its receipt, give a plain int."""
    _RECEIPTS.file(token, worker, num_workers, _Receipt(*receipt))
    return value


class BatchId(int):
    """A batch id travelling from a worker: unpickled, it files its receipt (module doc)."""

    _token: str
    _worker: int
    _num_workers: int
    _receipt: _Receipt

    def __new__(
        cls, value: int, token: str, worker: int, num_workers: int, receipt: _Receipt
    ) -> BatchId:
        obj = super().__new__(cls, value)
        obj._token, obj._worker, obj._num_workers, obj._receipt = (
            token,
            worker,
            num_workers,
            receipt,
        )
        return obj

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _arrive,
            (self._token, int(self), self._worker, self._num_workers, tuple(self._receipt)),
        )


def resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world_size): the arguments, else torch.distributed, else RANK/WORLD_SIZE."""
    if (rank is None) != (world_size is None):
        raise InvalidInput("give both rank and world_size, or neither")
    if rank is not None and world_size is not None:
        return rank, world_size
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    env_rank, env_world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if env_rank is not None and env_world is not None:
        try:
            return int(env_rank), int(env_world)
        except ValueError:
            raise InvalidInput(
                f"RANK={env_rank!r} and WORLD_SIZE={env_world!r} must be integers"
            ) from None
    return 0, 1


class _Position(NamedTuple):
    """A reader's position after the last batch it produced."""

    worker: int
    num_workers: int
    generation: int
    batch_id: int
    coord: StreamCoordinate
    dedup_count: int  # WAL hashes a commit of ``batch_id`` leaves
    shuffle: ShuffleSlot | None = None  # a shuffled reader's place (its meta_epoch unset)


class RecordDataset(torch_data.IterableDataset):
    """Batches of a RecordStream for ``torch.utils.data.DataLoader`` (use ``batch_size=None``:
    the dataset makes the batches; ``loader()`` does that for you)."""

    def __init__(
        self,
        sources: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
        state: str | os.PathLike[str],
        *,
        batch_size: int,
        format: str = "raw",
        schema: Any = None,
        dedup: bool = True,
        fs_options: Mapping[str, Any] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        reader_state: str | os.PathLike[str] | None = None,
        repartition: bool = False,
        shuffle: bool = False,
        seed: int | None = None,
        epoch: int | None = None,
        shuffle_window: int | None = None,
    ) -> None:
        """Arguments as ``RecordStream``'s; ``shuffle``, ``seed``, ``epoch`` and
        ``shuffle_window`` shuffle each epoch (``set_epoch`` picks the next one to read)."""
        super().__init__()
        if not isinstance(batch_size, int) or batch_size < 1:
            raise InvalidInput(f"batch_size must be a positive int, got {batch_size!r}")
        self.sources = sources if isinstance(sources, (str, os.PathLike)) else list(sources)
        self.state = os.fspath(state)
        self.batch_size = batch_size
        self.format = format
        self.schema = schema
        self.dedup = dedup
        self.fs_options = dict(fs_options or {})
        self.rank, self.world_size = resolve_rank(rank, world_size)
        self.reader_state = check_template(reader_state)
        self.repartition = repartition
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = epoch
        self.shuffle_window = shuffle_window
        self._token = secrets.token_hex(8)
        self._position: _Position | None = None  # set while (or after) this copy iterates

    # -- the loader side -------------------------------------------------------------------

    def loader(self, **kwargs: Any) -> torch_data.DataLoader[Any]:
        """A ``DataLoader`` over this dataset (``batch_size=None``; other arguments as given)."""
        if kwargs.get("batch_size", None) is not None:
            raise InvalidInput("the dataset makes the batches: leave the loader's batch_size None")
        kwargs["batch_size"] = None
        return torch_data.DataLoader(self, **kwargs)

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration of a shuffled dataset reads (call it in the process
        that iterates the loader, before ``iter``): at the start of an epoch, or after it."""
        if not self.shuffle:
            raise InvalidInput("set_epoch applies to a shuffled dataset (shuffle=True)")
        self.epoch = epoch

    def __iter__(self) -> Iterator[Batch]:
        info = torch_data.get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        shuffled = {}
        if self.shuffle:
            shuffled = {"shuffle": True, "seed": self.seed, "epoch": self.epoch,
                        "shuffle_window": self.shuffle_window}
        stream = RecordStream(
            self.sources,
            self.state,
            dedup=self.dedup,
            fs_options=self.fs_options,
            rank=self.rank,
            world_size=self.world_size,
            worker=worker,
            num_workers=num_workers,
            reader_state=self.reader_state or None,
            repartition=self.repartition,
            **shuffled,
        )
        generation = stream.plan.partition.generation if stream.plan.partition else 0
        position = _Position(
            worker,
            num_workers,
            generation,
            stream.committed_batch_id,
            stream.committed_coord,
            stream.committed_dedup_count,
            _read_state(stream.state_path, True)[1] if self.shuffle else None,
        )
        self._position = position
        try:
            for local, records in stream.batches(
                self.batch_size, format=self.format, schema=self.schema
            ):
                coord, hashes, slot = stream.hand_off(local)
                position = position._replace(
                    batch_id=local, coord=coord, dedup_count=position.dedup_count + hashes.size,
                    shuffle=slot,
                )
                self._position = position
                receipt = _Receipt(local, coord.encode(), hashes.astype(_HASH_DTYPE).tobytes(),
                                   slot.encode() if slot is not None else b"")
                batch_id = local * num_workers + worker
                if info is None:  # the main process reads: no queue to travel through
                    _RECEIPTS.file(self._token, worker, num_workers, receipt)
                    yield Batch(batch_id, records)
                else:
                    yield Batch(
                        BatchId(batch_id, self._token, worker, num_workers, receipt), records
                    )
        finally:
            stream.close()

    # -- commits (main process) ------------------------------------------------------------

    def _path(self, worker: int, num_workers: int) -> str:
        return reader_state_path(
            self.state, self.reader_state, self.rank, worker, self.world_size, num_workers
        )

    def commit(self, batch_id: int) -> None:
        """Durably mark every batch of the worker that produced ``batch_id``, up to it,
        consumed: call it after the optimizer step, in the process iterating the loader."""
        batch_id = int(batch_id)
        num_workers = _RECEIPTS.num_workers(self._token)
        if num_workers is None:
            raise InvalidInput(
                f"batch {batch_id} was not received from this dataset's loader (is the loader's "
                "batch_size None, and is this the process iterating it?)"
            )
        worker, local = batch_id % num_workers, batch_id // num_workers
        receipts = _RECEIPTS.take(self._token, worker, local)
        path = self._path(worker, num_workers)
        if not receipts:
            committed, _ = _read_state(path, self.shuffle)
            if committed is not None and local <= committed.batch_id:
                return  # already durable
            raise InvalidInput(f"batch {batch_id} was not received from this dataset's loader")
        try:
            if self.shuffle:
                settle(path)  # a .meta a power loss left behind its record
            with DualMetadataManager.open(path) as meta:
                fresh = [r for r in receipts if r.local > meta.committed_batch_id]
                if fresh:
                    hashes = np.frombuffer(b"".join(r.hashes for r in fresh), dtype=_HASH_DTYPE)
                    coord = StreamCoordinate.decode(fresh[-1].coord)
                    if not fresh[-1].shuffle:
                        meta.commit(local, coord, hashes)
                    else:  # the shuffle record's slot is the commit, the .meta slot follows
                        record = ShuffleRecord.open(path + SHUFFLE_SUFFIX, meta.epoch, path)
                        try:
                            place = decode_slot(fresh[-1].shuffle)
                            meta.commit(local, coord, hashes, journal=record.journal(place))
                        finally:
                            record.close()
        except BaseException:
            _RECEIPTS.put_back(self._token, worker, receipts)
            raise

    # -- checkpoints -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """In a worker (or a main process that iterates): this reader's position after its
        last batch. Otherwise: the committed position of every worker of this rank."""
        base = {"version": STATE_VERSION, "rank": self.rank, "world_size": self.world_size}
        pos = self._position
        if pos is not None:
            return {
                **base,
                "num_workers": pos.num_workers,
                "generation": pos.generation,
                "readers": {str(pos.worker): _entry(pos.batch_id, pos.coord, pos.dedup_count,
                                                    pos.shuffle)},
            }
        num_workers, generation = self._recorded_partition()
        readers = {}
        for worker in range(num_workers):
            path = self._path(worker, num_workers)
            committed, shuffle = _read_state(path, self.shuffle)
            if committed is not None:
                readers[str(worker)] = _entry(
                    committed.batch_id, committed.coord, committed.dedup_count, shuffle
                )
        return {**base, "num_workers": num_workers, "generation": generation, "readers": readers}

    def _recorded_partition(self) -> tuple[int, int]:
        """(num_workers, generation) of the recorded partition ((1, 0) without one)."""
        part = load(self.state + PARTITION_SUFFIX)
        if part is None:
            return 1, 0
        if part.world_size != self.world_size:
            raise InvalidInput(
                f"{self.state}{PARTITION_SUFFIX} records world_size {part.world_size}; this "
                f"dataset has world_size {self.world_size}"
            )
        return part.num_workers, part.generation

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Put the state files of the readers in ``state_dict`` at its positions (in a worker:
        only that worker's), before they read (module doc)."""
        try:
            version = state_dict["version"]
            rank, world_size = state_dict["rank"], state_dict["world_size"]
            num_workers, generation = state_dict["num_workers"], state_dict["generation"]
            readers = {int(w): e for w, e in state_dict["readers"].items()}
            entries = {
                w: (int(e["batch_id"]), StreamCoordinate(*e["coord"]), int(e["dedup_count"]),
                    ShuffleSlot(0, *e["shuffle"]) if e.get("shuffle") is not None else None)
                for w, e in readers.items()
            }
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise InvalidInput(f"not a RecordDataset state_dict: {err!r}") from None
        if version != STATE_VERSION:
            raise InvalidInput(f"state_dict version {version}; this faultfs reads {STATE_VERSION}")
        if (rank, world_size) != (self.rank, self.world_size):
            raise InvalidInput(
                f"state_dict is of rank {rank} of {world_size}; this dataset is rank "
                f"{self.rank} of {self.world_size}"
            )
        recorded = self._recorded_partition()
        if (num_workers, generation) != recorded:
            raise InvalidInput(
                f"state_dict was taken with num_workers {num_workers} (partition generation "
                f"{generation}); the states now have num_workers {recorded[0]} (generation "
                f"{recorded[1]})"
            )
        info = torch_data.get_worker_info()
        for worker, (batch_id, coord, dedup_count, shuffle) in sorted(entries.items()):
            if not 0 <= worker < num_workers:
                raise InvalidInput(f"state_dict names worker {worker} of {num_workers}")
            if info is not None and worker != info.id:
                continue
            if (shuffle is not None) != self.shuffle:
                raise InvalidInput(
                    "state_dict was taken from a "
                    f"{'shuffled' if shuffle is not None else 'file-order'} dataset; this one "
                    f"{'shuffles' if self.shuffle else 'reads in file order'}"
                )
            self._restore(self._path(worker, num_workers), batch_id, coord, dedup_count,
                          shuffle)

    @staticmethod
    def _restore(path: str, batch_id: int, coord: StreamCoordinate, dedup_count: int,
                 shuffle: ShuffleSlot | None) -> None:
        committed, now = _read_state(path, shuffle is not None)
        if committed is None and (batch_id, coord) == (0, StreamCoordinate()) and (
            shuffle is None or now is None
        ):
            return  # nothing committed, nothing to restore
        have = committed.dedup_count if committed is not None else 0
        if committed is not None and (committed.batch_id, committed.coord, have, now) == (
            batch_id,
            coord,
            dedup_count,
            shuffle,
        ):
            return
        # hashes past the WAL's committed ones were never committed: keep what is there
        if shuffle is None:
            write_atomic(path, [meta_image(DiskSlot(1, batch_id, coord, min(dedup_count, have)))])
            return
        # shuffled: the record gets the restored slot as its newest (the checkpoint after the
        # one in place, which stays beside it), then the .meta follows as the record says; a
        # crash between leaves a .meta behind its record, which the next open puts right
        current = committed.epoch if committed is not None else 0
        data = read_record(path + SHUFFLE_SUFFIX)
        if data is None:
            raise InvalidInput(f"{path}{SHUFFLE_SUFFIX}: the shuffle record to restore into is "
                               "missing (the dataset never read with this state)")
        header, slots = decode_record(data, path + SHUFFLE_SUFFIX)
        keep = [s for s, _ in slots if s is not None and s.meta_epoch == current]
        restored = shuffle.with_meta(DiskSlot(current + 1, batch_id, coord,
                                              min(dedup_count, have)))
        write_atomic(path + SHUFFLE_SUFFIX, [image(header, [*keep, restored])])
        write_atomic(path, [meta_bytes([*keep, restored])])


def _entry(batch_id: int, coord: StreamCoordinate, dedup_count: int,
           shuffle: ShuffleSlot | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "batch_id": batch_id,
        "coord": list(coord.as_dict().values()),
        "dedup_count": dedup_count,
    }
    if shuffle is not None:
        out["shuffle"] = list(_fields(shuffle))
    return out


def _fields(slot: ShuffleSlot) -> tuple[int, int, int, int, int, bool]:
    """A shuffle slot's place, without the checkpoint it goes with (``meta_epoch``)."""
    return (slot.epoch, slot.window, slot.position, slot.dedup_base, slot.generation,
            slot.finished)


def _read_state(path: str, shuffled: bool) -> tuple[CommittedState | None, ShuffleSlot | None]:
    """A reader's committed checkpoint (None: no state) and, shuffled, its shuffle slot with
    no ``meta_epoch`` (None: no record): a shuffled state's is its record's, whose ``.meta``
    may be behind it after a power loss."""
    pair = committed_pair(path) if shuffled else None
    if pair is None:
        return read_committed(path), None
    meta, slot = pair
    return (CommittedState(path, meta.committed_batch_id, meta.coord, meta.dedup_count,
                           meta.epoch), ShuffleSlot(0, *_fields(slot)))
