"""The PyTorch adapter (faultfs.stream.torch) with real DataLoaders: 4 ranks x 2 worker
processes deliver every record once with batch ids unique in each rank; commits made by the
main process cover every batch it received; a worker killed with SIGKILL mid-epoch loses no
committed record and delivers none twice after the rank restarts; state_dict/load_state_dict
put the readers back where a checkpoint was taken, also through torchdata's
StatefulDataLoader; rank and world size come from arguments, torch.distributed or the
environment."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

torch = pytest.importorskip(
    "torch", reason="faultfs.stream.torch needs PyTorch: pip install 'faultfs[torch]'"
)

from faultfs.errors import InvalidInput  # noqa: E402
from faultfs.store.metadata import DualMetadataManager  # noqa: E402
from faultfs.stream.shuffle import committed_pair  # noqa: E402
from faultfs.stream.torch import RecordDataset, resolve_rank  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
WORLD = 4


def make_shards(root: Path, counts=(40, 900, 120, 2000, 15, 700, 300, 1500), seed=3):
    rng = random.Random(seed)
    records = []
    for k, n in enumerate(counts):
        lines = [
            json.dumps({"s": k, "i": i, "pad": "x" * rng.randrange(40)}).encode() for i in range(n)
        ]
        records += lines
        (root / f"part-{k}.jsonl").write_bytes(b"".join(line + b"\n" for line in lines))
    return records


def run_rank(src, state, rank, *, num_workers=2, commit_every=1, batch_size=40, **kw):
    """(records received, batch ids) of one rank's pass, committing every n-th batch and the
    last batch of each worker."""
    ds = RecordDataset(src, state, batch_size=batch_size, rank=rank, world_size=WORLD, **kw)
    got, ids, last = [], [], {}
    for n, (batch_id, records) in enumerate(ds.loader(num_workers=num_workers), 1):
        got += records
        ids.append(batch_id)
        last[batch_id % max(num_workers, 1)] = batch_id
        if n % commit_every == 0:
            ds.commit(batch_id)
    for batch_id in last.values():
        ds.commit(batch_id)
    return got, ids


def test_ranks_and_workers_deliver_every_record_once(tmp_path):
    records = make_shards(tmp_path)
    src, state = str(tmp_path / "part-*.jsonl"), tmp_path / "run.meta"
    delivered = []
    for rank in range(WORLD):
        got, ids = run_rank(src, state, rank, commit_every=3)
        assert len(ids) == len(set(ids)), "batch ids are unique within the rank"
        assert {i % 2 for i in ids} == {0, 1}, "both workers produced batches"
        delivered += got
        # the commits of every third batch still committed the hashes of every batch
        for worker in range(2):
            path = f"{state}.rank-{rank}.worker-{worker}.meta"
            with DualMetadataManager.open(path) as m:
                assert m.dedup_count == m.coord.global_row_idx > 0
    assert sorted(delivered) == sorted(records)
    # a second pass over committed states delivers nothing
    assert run_rank(src, state, 1) == ([], [])


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_workers_started_by_spawn_or_forkserver_deliver_and_commit(tmp_path, context):
    """Not only fork: spawn is the default on macOS and what CUDA users pick; the dataset
    travels pickled and the receipts still reach the main process's commits."""
    records = make_shards(tmp_path, counts=(30, 200, 90))
    src, state = str(tmp_path / "part-*.jsonl"), tmp_path / "run.meta"
    ds = RecordDataset(src, state, batch_size=25)
    got = []
    for batch_id, batch in ds.loader(num_workers=2, multiprocessing_context=context):
        got += batch
        ds.commit(batch_id)
    assert sorted(got) == sorted(records)
    again = RecordDataset(src, state, batch_size=25).loader(num_workers=2,
                                                            multiprocessing_context=context)
    assert [b for _, b in again] == [], "every batch was committed"


@pytest.mark.parametrize("fmt", ["arrow", "pydict"])
def test_parsed_batches_travel_through_the_loader(tmp_path, fmt):
    make_shards(tmp_path, counts=(200, 30, 500))
    src, state = str(tmp_path / "part-*.jsonl"), tmp_path / "run.meta"
    ids = []
    for rank in range(WORLD):
        ds = RecordDataset(src, state, batch_size=64, format=fmt, rank=rank, world_size=WORLD)
        for batch_id, table in ds.loader(num_workers=2):
            cols = table.to_pydict() if fmt == "arrow" else table
            ids += list(zip(cols["s"], cols["i"], strict=True))
            ds.commit(batch_id)
    assert sorted(ids) == sorted((s, i) for s, n in enumerate((200, 30, 500)) for i in range(n))


TRAIN = textwrap.dedent(
    """
    import os, sys, time
    from faultfs.stream.torch import RecordDataset
    src, state, log, rank, world = sys.argv[1:6]
    ds = RecordDataset(src, state, batch_size=25, rank=int(rank), world_size=int(world))
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for batch_id, records in ds.loader(num_workers=2):
        os.write(fd, b"".join(b"%d\\t%s\\n" % (batch_id, r) for r in records))
        time.sleep(0.02)  # the training step
        ds.commit(batch_id)
    os.write(fd, b"DONE\\n")
    """
)


def child_pids(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                out.append(int(entry))
    return out


def committed_ids(state, rank):
    """Each worker's committed batch. A shuffled state's commit point is its record, whose
    ``.meta`` slot follows it: the DataLoader raises a dead worker's error from a signal
    handler, anywhere in the main process — between the two writes too, leaving the ``.meta``
    one commit behind until the next open settles it."""
    out = {}
    for worker in range(2):
        path = f"{state}.rank-{rank}.worker-{worker}.meta"
        pair = committed_pair(path)
        if pair is not None:
            out[worker] = pair[0].committed_batch_id
            continue
        with DualMetadataManager.open(path) as m:
            out[worker] = m.committed_batch_id
    return out


def kill_a_worker_then_restart(tmp_path, script, src, state, rank, victim):
    """Train ``rank`` (``script``) in a child, kill -9 its worker ``victim`` mid-epoch, then
    train it again to the end: each worker's committed records, in the order received."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    committed: dict[int, list[bytes]] = {0: [], 1: []}
    previous = {0: 0, 1: 0}
    for run in range(2):
        log = tmp_path / f"run{run}.log"
        proc = subprocess.Popen(
            [sys.executable, "-c", script, src, str(state), str(log), str(rank), str(WORLD)],
            env=env,
            stderr=subprocess.PIPE,
        )
        if run == 0:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if log.exists() and log.read_bytes().count(b"\n") >= 200:
                    break
                time.sleep(0.01)
            workers = child_pids(proc.pid)
            assert len(workers) >= 2, workers
            os.kill(workers[victim], signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
        now = committed_ids(state, rank)
        lines = log.read_bytes().splitlines()
        for line in lines:
            if line == b"DONE":
                continue
            batch_id, _, record = line.partition(b"\t")
            worker, local = int(batch_id) % 2, int(batch_id) // 2
            if previous[worker] < local <= now[worker]:
                committed[worker].append(record)
        if run == 0:
            assert proc.returncode != 0 and lines[-1:] != [b"DONE"], "killed mid-epoch"
            assert b"DataLoader worker" in err, err[-2000:]
            assert 0 < sum(now.values()), "batches were committed before the kill"
        else:
            assert proc.returncode == 0, err[-2000:]
            assert lines[-1:] == [b"DONE"]
        previous = now
    return committed


@pytest.mark.slow
def test_kill_9_of_a_worker_mid_epoch_then_restart_the_rank(tmp_path):
    records = make_shards(tmp_path)
    src, state = str(tmp_path / "part-*.jsonl"), tmp_path / "run.meta"
    committed = kill_a_worker_then_restart(tmp_path, TRAIN, src, state, 1, 0)
    committed_records = committed[0] + committed[1]
    others = [r for rank in range(WORLD) if rank != 1 for r in run_rank(src, state, rank)[0]]
    assert len(committed_records) == len(set(committed_records)), "no record twice"
    assert sorted(committed_records + others) == sorted(records), "none lost"


def test_state_dict_in_the_main_process_and_rolling_back(tmp_path):
    make_shards(tmp_path, counts=(600, 50, 900))
    src, state = str(tmp_path / "part-*.jsonl"), tmp_path / "run.meta"
    ds = RecordDataset(src, state, batch_size=30, rank=2, world_size=WORLD)
    it = iter(ds.loader(num_workers=2))
    seen = []
    for _ in range(6):
        batch_id, records = next(it)
        seen += records
        ds.commit(batch_id)
    snapshot = ds.state_dict()  # the committed positions of both workers
    assert snapshot["num_workers"] == 2 and set(snapshot["readers"]) == {"0", "1"}
    for _ in range(4):  # progress past the snapshot, then a crash
        batch_id, _ = next(it)
        ds.commit(batch_id)
    del it
    again = RecordDataset(src, state, batch_size=30, rank=2, world_size=WORLD)
    again.load_state_dict(snapshot)
    rest, _ = run_rank(src, state, 2)
    reference, _ = run_rank(src, tmp_path / "ref.meta", 2)
    assert sorted(seen + rest) == sorted(reference), "back to the snapshot: nothing skipped"
    with pytest.raises(InvalidInput, match="state_dict is of rank 2 of 4; this dataset is rank 1"):
        RecordDataset(src, state, batch_size=30, rank=1, world_size=WORLD).load_state_dict(snapshot)
    with pytest.raises(InvalidInput, match="not a RecordDataset state_dict"):
        again.load_state_dict({"version": 1})


# torchdata 0.11 calls torch.set_vital, which torch 2.13 deprecates
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_dataloader_round_trip(tmp_path, num_workers):
    sdl = pytest.importorskip(
        "torchdata.stateful_dataloader",
        reason="torchdata is not installed (pip install torchdata; it needs torch>=2)",
    )
    records = make_shards(tmp_path, counts=(500, 80, 700))
    src, state = str(tmp_path / "part-*.jsonl"), tmp_path / "run.meta"
    ds = RecordDataset(src, state, batch_size=25, rank=0, world_size=1)
    loader = sdl.StatefulDataLoader(ds, batch_size=None, num_workers=num_workers)
    it = iter(loader)
    trained = []
    for _ in range(7):
        batch_id, batch = next(it)
        trained += batch
        ds.commit(batch_id)
    checkpoint = loader.state_dict()
    for _ in range(5):  # trained and committed after the checkpoint, then lost in a crash
        batch_id, _ = next(it)
        ds.commit(batch_id)
    del it, loader
    ds = RecordDataset(src, state, batch_size=25, rank=0, world_size=1)
    loader = sdl.StatefulDataLoader(ds, batch_size=None, num_workers=num_workers)
    loader.load_state_dict(checkpoint)
    for batch_id, batch in loader:
        trained += batch
        ds.commit(batch_id)
    assert sorted(trained) == sorted(records), "from the checkpoint: every record once"


def test_rank_and_world_size_come_from_arguments_distributed_or_the_environment(
    tmp_path, monkeypatch
):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert resolve_rank(None, None) == (0, 1)
    assert resolve_rank(2, 5) == (2, 5)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert resolve_rank(None, None) == (3, 4)
    assert resolve_rank(1, 2) == (1, 2)
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(InvalidInput, match="must be integers"):
        resolve_rank(None, None)
    with pytest.raises(InvalidInput, match="give both rank and world_size"):
        resolve_rank(1, None)
    dist = torch.distributed
    if not dist.is_available():
        pytest.skip("this torch build has no torch.distributed")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        monkeypatch.setenv("RANK", "3")
        assert resolve_rank(None, None) == (0, 1), "an initialised process group wins"
    finally:
        dist.destroy_process_group()


def test_commit_and_loader_misuse_are_clear(tmp_path):
    make_shards(tmp_path, counts=(50,))
    src, state = str(tmp_path / "part-*.jsonl"), tmp_path / "run.meta"
    ds = RecordDataset(src, state, batch_size=10, rank=0, world_size=1)
    with pytest.raises(InvalidInput, match="batch 3 was not received from this dataset's loader"):
        ds.commit(3)
    with pytest.raises(InvalidInput, match="leave the loader's batch_size None"):
        ds.loader(batch_size=4)
    batches = list(ds.loader(num_workers=0))
    ds.commit(batches[-1].batch_id)
    ds.commit(batches[0].batch_id)  # already durable: nothing to do
    with pytest.raises(InvalidInput, match="batch 99 was not received"):
        ds.commit(99)


# ---------------------------------------------------------------------------------------------
# shuffled

SHUFFLED = {"shuffle": True, "seed": 5, "shuffle_window": 4096}
TRAIN_SHUFFLED = TRAIN.replace(
    "world_size=int(world))",
    "world_size=int(world), shuffle=True, seed=5, shuffle_window=4096, dedup=False)",
)  # without dedup, which would drop the records of a resume that starts too early
assert TRAIN_SHUFFLED != TRAIN


def worker_sequences(src, state, rank, **kw):
    """Each worker's records of one shuffled pass of ``rank``, in the order received."""
    ds = RecordDataset(src, state, batch_size=25, rank=rank, world_size=WORLD, **SHUFFLED, **kw)
    out = {0: [], 1: []}
    for batch_id, records in ds.loader(num_workers=2):
        out[batch_id % 2] += records
        ds.commit(batch_id)
    return out


@pytest.mark.slow
def test_kill_9_of_a_worker_mid_shuffled_epoch_resumes_exactly(tmp_path):
    """Each worker's committed records before the kill, then those after the restart, are
    the uninterrupted run's sequence for that worker: the same records in the same order."""
    make_shards(tmp_path)
    src, state = str(tmp_path / "part-*.jsonl"), tmp_path / "run.meta"
    reference = worker_sequences(src, tmp_path / "ref.meta", 2, dedup=False)
    assert all(reference.values())
    got = kill_a_worker_then_restart(tmp_path, TRAIN_SHUFFLED, src, state, 2, 1)
    assert got == reference, "each worker resumed exactly where it was, in the same order"


# torchdata 0.11 calls torch.set_vital, which torch 2.13 deprecates
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
def test_shuffled_epochs_through_the_loader_and_a_stateful_round_trip(tmp_path):
    sdl = pytest.importorskip(
        "torchdata.stateful_dataloader",
        reason="torchdata is not installed (pip install torchdata; it needs torch>=2)",
    )
    records = make_shards(tmp_path, counts=(500, 0, 80, 700))
    src, state = str(tmp_path / "part-*.jsonl"), tmp_path / "run.meta"
    ds = RecordDataset(src, state, batch_size=25, rank=0, world_size=1, **SHUFFLED)
    orders = []
    for epoch in range(2):
        ds.set_epoch(epoch)
        got = []
        for batch_id, batch in ds.loader(num_workers=2):
            got += batch
            ds.commit(batch_id)
        assert sorted(got) == sorted(records), f"epoch {epoch}: every record once"
        orders.append(got)
    assert orders[0] != orders[1]
    # a checkpoint inside epoch 2, later commits lost in a crash, then back to it
    ds = RecordDataset(src, state, batch_size=25, rank=0, world_size=1, epoch=2, **SHUFFLED)
    loader = sdl.StatefulDataLoader(ds, batch_size=None, num_workers=2)
    it = iter(loader)
    trained = []
    for _ in range(9):
        batch_id, batch = next(it)
        trained += batch
        ds.commit(batch_id)
    checkpoint = loader.state_dict()
    for _ in range(6):
        batch_id, _ = next(it)
        ds.commit(batch_id)
    del it, loader
    ds = RecordDataset(src, state, batch_size=25, rank=0, world_size=1, **SHUFFLED)
    loader = sdl.StatefulDataLoader(ds, batch_size=None, num_workers=2)
    loader.load_state_dict(checkpoint)
    for batch_id, batch in loader:
        trained += batch
        ds.commit(batch_id)
    assert sorted(trained) == sorted(records), "from the checkpoint: every record once"
    with pytest.raises(InvalidInput, match="set_epoch applies to a shuffled dataset"):
        RecordDataset(src, state, batch_size=25).set_epoch(1)


def test_a_commit_of_several_shuffled_batches_resumes_after_the_last(tmp_path):
    """A commit every few batches writes the shuffle slot of the worker's last batch it
    covers: a restart continues each worker after that batch, in the reference order
    (without dedup, which would hide a resume that starts too early)."""
    make_shards(tmp_path)
    src, state = str(tmp_path / "part-*.jsonl"), tmp_path / "run.meta"
    reference = worker_sequences(src, tmp_path / "ref.meta", 1, dedup=False)
    ds = RecordDataset(src, state, batch_size=25, rank=1, world_size=WORLD, dedup=False,
                       **SHUFFLED)
    pending = {0: [], 1: []}
    committed = {0: [], 1: []}
    for n, (batch_id, records) in enumerate(ds.loader(num_workers=2), 1):
        worker = batch_id % 2
        pending[worker] += records
        if n % 6 in (5, 0):  # each worker's commit covers its last three batches
            ds.commit(batch_id)
            committed[worker] += pending[worker]
            pending[worker] = []
        if n == 18:
            break
    assert all(committed.values())
    ds = RecordDataset(src, state, batch_size=25, rank=1, world_size=WORLD, dedup=False,
                       **SHUFFLED)
    for batch_id, records in ds.loader(num_workers=2):
        committed[batch_id % 2] += records
        ds.commit(batch_id)
    assert committed == reference, "each worker resumed after its last committed batch"


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
def test_another_worker_count_inside_a_shuffled_epoch_carries_its_rest(tmp_path, before, after):
    """Workers commit part of a shuffled epoch; a restart with another count is refused
    without repartition=True, and with it delivers the rest: no committed record again."""
    records = make_shards(tmp_path, counts=(500, 0, 80, 700))
    src, state = str(tmp_path / "part-*.jsonl"), tmp_path / "run.meta"
    kw = {"batch_size": 25, "rank": 0, "world_size": 1, "dedup": False, **SHUFFLED}
    ds = RecordDataset(src, state, **kw)
    committed = []
    for n, (batch_id, batch) in enumerate(ds.loader(num_workers=before), 1):
        committed += batch
        ds.commit(batch_id)
        if n == 15:
            break
    with pytest.raises(Exception, match=f"num_workers {after}"):
        next(iter(RecordDataset(src, state, **kw).loader(num_workers=after)))
    ds = RecordDataset(src, state, repartition=True, **kw)
    rest = []
    for batch_id, batch in ds.loader(num_workers=after):
        rest += batch
        ds.commit(batch_id)
    assert not set(committed) & set(rest), "no committed record comes again in the epoch"
    assert sorted(committed + rest) == sorted(records), "and every record is delivered once"
    ds = RecordDataset(src, state, **kw)  # the next epoch: the new workers' own plan
    nxt = []
    for batch_id, batch in ds.loader(num_workers=after):
        nxt += batch
        ds.commit(batch_id)
    assert sorted(nxt) == sorted(records)
