"""The writes model: a Hypothesis state machine that writes through a real engine (real store
for the clean blobs, the write journal and dirty files on a ``SimDisk``) against plain
``bytearray`` chunks, with three ways to stop: a clean remount, a ``kill -9`` (what was
appended survives, nothing else happens) and a power loss (``SimDisk.crash``: what was not
fsynced is kept, dropped or torn at random).

Rules: writes through the view (growing it) and through ``chunk_N``, whole-chunk writes (the
direct files of ``store/dirty.py``: aligned, through either name), truncates of the view,
writes and truncates of a user blob (in parts of ``UPART`` here, so a few KiB cross parts),
fsyncs, checkpoints (folds), reads of every name, the three stops.

What must hold (DESIGN §11): reads return exactly the model; after a remount or a kill -9
every acknowledged write is there; after a power loss each chunk, and the view's size, equal
the model at some prefix of their own writes that includes every write before the last
fsync — never a torn or foreign state; so does each part of the user blob. The prefix found
becomes the model.

``crash_sweep`` runs a fixed script and crashes it at every write and fsync point of the
journal and dirty files in turn (``SimOps(crash_at=n)``), checking the same rule.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import tempfile
from collections.abc import Iterator

import trio
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from faultfs.engine import Engine
from faultfs.errors import FaultfsError
from faultfs.store.blobstore import BlobStore
from faultfs.testing.crashfs import SimDisk, SimOps, SimulatedCrash
from faultfs.testing.fakes import CS, ctx_for, engine_for, make_source, payload

TAG = "w"
URL = "mem://writes-model"
USER = "u.bin"  # the user blob of the model
UPART = 2 * CS  # its parts (the engine's are 1 MiB)


class History:
    """The states one blob (or the view's size) went through; ``synced``: the first state a
    crash may go back to."""

    def __init__(self, first) -> None:
        self.states = [first]
        self.synced = 0

    @property
    def now(self):
        return self.states[-1]

    def push(self, state) -> None:
        self.states.append(state)

    def sync(self) -> None:
        self.synced = len(self.states) - 1

    def settle(self, found, what: str, *, exact: bool) -> None:
        """After a stop: ``found`` must be the last state (``exact``: a clean remount or a
        kill -9), or one at or after the synced one (a power loss); the model goes back to
        it."""
        if exact:
            assert found == self.now, f"{what}: an acknowledged write was lost"
            return
        for k in range(len(self.states) - 1, self.synced - 1, -1):
            if self.states[k] == found:
                del self.states[k + 1:]
                self.synced = k
                return
        raise AssertionError(f"{what}: after the crash it is no state between the last fsync "
                             f"and the last write (of {len(self.states) - self.synced})")


class WritesWorld:
    """One engine over a store and a SimDisk, and the chunk model of its tag."""

    def __init__(self, size: int, cs: int, *, behind: bool = False) -> None:
        # behind: each step runs in a nursery of its own, so a partial write's size-0 request
        # runs behind it, and the step's end stops it wherever it is (a kill before it lands)
        self.behind = behind
        self.tmp = tempfile.TemporaryDirectory()
        self.store = BlobStore(os.path.join(self.tmp.name, "store"))
        self.cs = cs
        source = payload(size)
        make_source(source, url=URL)
        self.disk = SimDisk()
        self.ops = SimOps(self.disk)
        self.engine = self._engine()
        self.tag = self.engine.register(ctx_for(URL, TAG, chunk_size=cs))
        self.engine.open_writes()
        chunks = [source[i:i + cs].ljust(cs, b"\0") for i in range(0, size, cs)]
        self.chunks = [History(c) for c in chunks]
        self.size = History(size)
        self.parts: list[History] = []  # the user blob's parts (bytes, as long as the part)
        self.has_user = False

    def _engine(self) -> Engine:
        engine = engine_for(self.store, writes_ops=self.ops)
        engine.writes.user_part = UPART
        return engine

    def close(self) -> None:
        self.engine.close()
        self.tmp.cleanup()

    # -- the model ---------------------------------------------------------------------------

    def view_model(self) -> bytes:
        return b"".join(h.now for h in self.chunks).ljust(self.size.now, b"\0")[:self.size.now]

    def _chunk(self, index: int) -> History:
        while len(self.chunks) <= index:
            self.chunks.append(History(bytes(self.cs)))
        return self.chunks[index]

    def model_write(self, off: int, data: bytes) -> None:
        pos = 0
        while pos < len(data):
            index, inner = divmod(off + pos, self.cs)
            take = min(len(data) - pos, self.cs - inner)
            h = self._chunk(index)
            h.push(h.now[:inner] + data[pos:pos + take] + h.now[inner + take:])
            pos += take

    def model_truncate(self, size: int) -> None:
        old = self.size.now
        for index in range(size // self.cs, -(-old // self.cs)):
            lo, hi = max(size, index * self.cs), min(old, (index + 1) * self.cs)
            if lo < hi:
                h = self._chunk(index)
                a, b = lo - index * self.cs, hi - index * self.cs
                h.push(h.now[:a] + bytes(b - a) + h.now[b:])
        self.size.push(size)

    def sync_model(self) -> None:
        for h in (*self.chunks, self.size, *self.parts):
            h.sync()

    def _part(self, k: int) -> History:
        while len(self.parts) <= k:
            self.parts.append(History(b""))
        return self.parts[k]

    def user_model(self) -> bytes:
        size = self.user_model_size()
        out = bytearray(size)
        for k, h in enumerate(self.parts):
            out[k * UPART:k * UPART + len(h.now)] = h.now
        return bytes(out[:size])

    def user_model_size(self) -> int:
        return max((k * UPART + len(h.now) for k, h in enumerate(self.parts) if h.now), default=0)

    # -- running -----------------------------------------------------------------------------

    def run(self, fn, *args):
        async def step():
            if not self.behind:
                return await fn(*args)
            failed: Exception | None = None
            async with trio.open_nursery() as nursery:
                self.engine.attach(nursery)  # the base's store write behind it too
                try:
                    got = await fn(*args)
                except Exception as exc:  # raised past the nursery, not in a group
                    failed = exc
                nursery.cancel_scope.cancel()
            if failed is not None:
                raise failed
            return got
        return trio.run(step)

    # The model moves first: a crash inside an operation may leave any part of it on disk.

    def write_view(self, off: int, data: bytes) -> None:
        self.model_write(off, data)
        if off + len(data) > self.size.now:
            self.size.push(off + len(data))
        self.run(self.engine.write_view, self.tag, off, data)

    def write_chunk(self, index: int, off: int, data: bytes) -> None:
        self.model_write(index * self.cs + off, data)
        self.run(self.engine.write_chunk, self.tag, index, off, data)

    def truncate(self, size: int) -> None:
        self.model_truncate(size)
        self.run(self.engine.truncate_view, self.tag, size)

    def create_user(self) -> None:
        self.run(self.engine.create_user, self.tag, USER)  # durable when it returns
        self.has_user = True

    def write_user(self, off: int, data: bytes) -> None:
        pos = 0
        while pos < len(data):
            k, inner = divmod(off + pos, UPART)
            take = min(len(data) - pos, UPART - inner)
            h = self._part(k)
            now = h.now.ljust(inner, b"\0")
            h.push(now[:inner] + data[pos:pos + take] + now[inner + take:])
            pos += take
        self.run(self.engine.write_user, self.tag, USER, off, data)

    def truncate_user(self, size: int) -> None:
        last, inner = divmod(size, UPART)
        if inner == 0 and last:
            last, inner = last - 1, UPART
        for k, h in enumerate(self.parts):
            if (k > last or not size) and h.now:
                h.push(b"")
        if size:
            h = self._part(last)
            if len(h.now) != inner:
                h.push(h.now[:inner].ljust(inner, b"\0"))
        self.run(self.engine.truncate_user, self.tag, USER, size)

    def fsync(self) -> None:
        self.run(self.engine.fsync)
        self.sync_model()

    def spill(self) -> None:
        """Let go of every written byte held in memory (reads take them from the journal)."""
        self.engine.writes.spill()

    def checkpoint(self) -> None:
        self.run(self.engine.writes.checkpoint)
        # a checkpoint syncs the journal before it folds: everything before it is durable
        if not self.ops.crashed:
            self.sync_model()

    # -- stops -------------------------------------------------------------------------------

    def remount(self, how: str, rng: random.Random | None = None, *, check: bool = True) -> None:
        """``clean`` (unmount folds everything), ``kill`` (the disk as it is), ``power``
        (the disk a reboot finds); ``check``: match what came back against the model."""
        if how == "clean":
            self.run(self.engine.close_writes)
            self.sync_model()
        self.engine.close()
        if how == "power":
            assert rng is not None
            self.disk = self.disk.crash(rng)
        # a kill -9 leaves the disk as it is: what was appended is in the page cache, and as
        # durable as it was (a later power loss may still take what was never fsynced)
        self.ops = SimOps(self.disk)
        self.engine = self._engine()
        [self.tag] = self.engine.recover()
        if check:
            self.settle(exact=how != "power")

    def settle(self, *, exact: bool) -> None:
        """Match what came back against the histories."""
        engine, writes = self.engine, self.engine.writes
        self.size.settle(engine.view_size(self.tag), "the view's size", exact=exact)
        if self.has_user:
            uid = engine.user_id(self.tag, USER)
            assert uid is not None, "the user blob is gone after the stop"
            found = writes.table.parts(self.tag, uid)  # (each part, as long as it is)
            for k in range(max(len(self.parts), max(found, default=-1) + 1)):
                blob = found.get(k)
                try:
                    got = b"" if blob is None or not blob.size else bytes(
                        self.run(writes.reads.read, blob, 0, blob.size))
                except FaultfsError as exc:
                    raise AssertionError(f"part {k} cannot be read after the stop: {exc}") from None
                self._part(k).settle(got, f"user blob part {k}", exact=exact)
        count = max(len(self.chunks), engine.num_chunks(self.tag))
        for index in range(count):
            try:
                got = bytes(self.run(self.engine.read_blob, self.tag, index, 0, self.cs))
            except FaultfsError as exc:  # no stop may leave a blob unreadable
                raise AssertionError(f"chunk {index} cannot be read after the stop: {exc}") from None
            self._chunk(index).settle(got, f"chunk {index}", exact=exact)

    # -- checks ------------------------------------------------------------------------------

    def check_view(self, off: int, size: int) -> None:
        got = bytes(self.run(self.engine.read_view, self.tag, off, size))
        assert got == self.view_model()[off:off + size], f"view [{off}, +{size})"

    def check_user(self, off: int, size: int) -> None:
        engine = self.engine
        assert engine.user_size(self.tag, USER) == self.user_model_size(), "the user blob's size"
        got = bytes(self.run(engine.read_user, self.tag, USER, off, size))
        assert got == self.user_model()[off:off + size], f"user blob [{off}, +{size})"

    def check_chunk(self, index: int, off: int, size: int) -> None:
        got = bytes(self.run(self.engine.read_blob, self.tag, index, off, size))
        assert got == self._chunk(index).now[off:off + size], f"chunk {index} [{off}, +{size})"


class WritesModel(RuleBasedStateMachine):
    USER_BLOBS = True  # False: the rules of the view and chunks only (the mutant hunts)

    def __init__(self) -> None:
        super().__init__()
        self.world: WritesWorld | None = None

    @initialize(size=st.integers(1, 5 * CS + 300), cs=st.sampled_from([CS, 2 * CS]))
    def start(self, size: int, cs: int) -> None:
        self.world = WritesWorld(size, cs)

    def teardown(self) -> None:
        if self.world is not None:
            self.world.close()

    @property
    def w(self) -> WritesWorld:
        assert self.world is not None
        return self.world

    @rule(off=st.integers(0, 7 * CS), data=st.binary(min_size=1, max_size=3 * CS))
    def write_view(self, off: int, data: bytes) -> None:
        self.w.write_view(off, data)

    @rule(pick=st.integers(0, 1 << 16), off=st.integers(0, 2 * CS - 1),
          data=st.binary(min_size=1, max_size=2 * CS))
    def write_chunk(self, pick: int, off: int, data: bytes) -> None:
        w = self.w
        index = pick % w.engine.num_chunks(w.tag)
        off %= w.cs
        if off + len(data) > w.cs:
            got = None
            try:
                w.run(w.engine.write_chunk, w.tag, index, off, data)
            except FaultfsError as exc:
                got = exc.errno
            assert got == errno.EFBIG, f"a write past a chunk's end: {got}"
            return
        w.write_chunk(index, off, data)

    @rule(pick=st.integers(0, 7), seed=st.integers(0, 1 << 16), view=st.booleans())
    def write_whole_chunk(self, pick: int, seed: int, view: bool) -> None:
        """A write covering one chunk exactly: a direct file, not a journal record of data."""
        w = self.w
        data = random.Random(seed).randbytes(w.cs)
        if view:
            w.write_view(pick * w.cs, data)
            return
        w.write_chunk(pick % w.engine.num_chunks(w.tag), 0, data)

    @rule(size=st.integers(0, 7 * CS))
    def truncate(self, size: int) -> None:
        self.w.truncate(size)

    @rule(off=st.integers(0, 4 * UPART), data=st.binary(min_size=1, max_size=3 * UPART))
    @precondition(lambda self: self.USER_BLOBS)
    def write_user(self, off: int, data: bytes) -> None:
        if not self.w.has_user:
            self.w.create_user()
        self.w.write_user(off, data)

    @rule(size=st.integers(0, 5 * UPART))
    @precondition(lambda self: self.USER_BLOBS)
    def truncate_user(self, size: int) -> None:
        if not self.w.has_user:
            self.w.create_user()
        self.w.truncate_user(size)

    @rule(off=st.integers(0, 5 * UPART), size=st.integers(0, 3 * UPART))
    @precondition(lambda self: self.USER_BLOBS)
    def read_user(self, off: int, size: int) -> None:
        if self.w.has_user:
            self.w.check_user(off, size)

    @rule()
    def fsync(self) -> None:
        self.w.fsync()

    @rule()
    def checkpoint(self) -> None:
        self.w.checkpoint()

    @rule(off=st.integers(0, 7 * CS), size=st.integers(0, 3 * CS))
    def read_view(self, off: int, size: int) -> None:
        self.w.check_view(off, size)

    @rule(pick=st.integers(0, 1 << 16), off=st.integers(0, 2 * CS), size=st.integers(1, 2 * CS))
    def read_chunk(self, pick: int, off: int, size: int) -> None:
        w = self.w
        w.check_chunk(pick % w.engine.num_chunks(w.tag), off, size)

    @rule(how=st.sampled_from(["clean", "kill", "power"]), seed=st.integers(0, 1 << 16))
    def remount(self, how: str, seed: int) -> None:
        self.w.remount(how, random.Random(seed))

    @invariant()
    def the_view_size_is_the_models(self) -> None:
        if self.world is not None:
            w = self.world
            assert w.engine.view_size(w.tag) == w.size.now


# -- crash at every point ---------------------------------------------------------------------

def _script(world: WritesWorld) -> None:
    """A fixed sequence that reaches every durable step: appends, syncs, a segment roll,
    folds (a checkpoint), state files, the unmount fold; and each state of a whole-chunk
    write's direct file: written, synced, replaced unsynced, written over, renamed by a fold,
    replaced after the fold, synced by the unmount."""
    cs = world.cs
    world.write_view(10, b"a" * 100)
    world.write_chunk(1, 0, b"b" * cs)  # a whole chunk: a direct file, no fault
    world.fsync()
    world.write_chunk(1, 0, b"B" * cs)  # replaces a synced direct file, unsynced
    world.write_view(2 * cs, b"g" * cs)  # a whole chunk through the view
    world.write_view(2 * cs + 9, b"h" * 5)  # written over a direct file
    world.write_chunk(3, 0, bytes(cs))  # an all-zero direct file (a header, no payload)
    world.write_view(3 * cs - 50, b"c" * 200)  # across two chunks
    world.truncate(2 * cs + 7)
    world.create_user()
    world.write_user(UPART - 10, b"u" * 30)  # across two parts of the user blob
    world.truncate_user(3 * UPART + 1)  # grown by a size alone
    world.spill()  # the writes so far are read back from the journal from here on
    world.write_view(12, b"k" * 20)  # over a spilled write: held and spilled parts
    world.checkpoint()  # chunk 1 renamed, chunk 2 folded (its direct file obsolete)
    world.truncate_user(UPART - 5)
    world.write_view(cs, b"i" * cs)  # a direct file over a folded one
    world.write_view(4 * cs, b"d" * 300)  # grows the view past the source
    world.write_chunk(0, 5, b"e" * 9)
    world.spill()
    world.fsync()
    world.write_view(0, b"f" * 17)
    world.write_chunk(0, 0, b"j" * cs)  # the last write: a direct file the unmount folds
    world.run(world.engine.close_writes)
    world.sync_model()


def crash_sweep(seeds: int = 3, *, behind: bool = False) -> int:
    """Crash the script at each mutation point in turn (``seeds`` random reboots each); the
    points covered. ``behind``: the size-0 requests run behind the writes (see WritesWorld)."""
    probe = WritesWorld(3 * CS + 500, CS, behind=behind)
    try:
        _script(probe)
        total = probe.ops.points
    finally:
        probe.close()
    for crash_at in range(total + 1):
        for seed in range(seeds):
            world = WritesWorld(3 * CS + 500, CS, behind=behind)
            try:
                world.ops.crash_at = crash_at
                try:
                    _script(world)
                except SimulatedCrash:
                    pass
                world.remount("power", random.Random(crash_at * 1000 + seed))
                world.check_view(0, 6 * CS)
                world.write_view(1, b"after")  # the store takes writes after the crash
                world.remount("clean")
                world.check_view(0, 6 * CS)
            finally:
                world.close()
    return total


@contextlib.contextmanager
def writes_mutant(kind: str) -> Iterator[None]:
    """Deliberately broken writes for the duration (the model must catch each kind):
    ``nosync`` — fsync returns without syncing; ``noreplay`` — a remount reads the journal
    but applies none of its records; ``nofold`` — a checkpoint folds nothing yet trims the
    journal; ``nodirectsync`` — fsync syncs the journal but not the direct files of
    whole-chunk writes; ``nodirectcheck`` — a replay trusts a direct file without verifying it;
    ``nosizefold`` — a checkpoint folds only blobs with bytes held (a size change alone is
    trimmed away with the journal); ``spillzeros`` — a spilled write reads back as zeros."""
    from faultfs.engine.writes.checkpoint import Checkpoints
    from faultfs.engine.writes.reads import DirtyReads
    from faultfs.engine.writes.recovery import Recovery
    from faultfs.engine.writes.sync import GroupCommit
    from faultfs.engine.writes.table import FOLDED
    from faultfs.store.dirty import DirtyFiles

    saved: list[tuple[type, str, object]] = []

    def patch(room: type, name: str, value) -> None:
        saved.append((room, name, room.__dict__[name]))
        setattr(room, name, value)

    if kind == "nosync":
        async def fsync(self) -> None:
            return None
        patch(GroupCommit, "fsync", fsync)
    elif kind == "noreplay":
        def replay(self, tags) -> int:
            for _ in self.journal.replay(writable=self.states.writable):
                pass  # read (the journal goes on after them) but never applied
            return 0
        patch(Recovery, "replay", replay)
    elif kind == "nofold":
        async def fold(self, blob, **kwargs) -> None:
            return None
        patch(Checkpoints, "fold", fold)
    elif kind == "nodirectsync":
        async def sync_files(self, taken) -> None:
            return None
        patch(GroupCommit, "sync_files", sync_files)
    elif kind == "nosizefold":
        async def checkpoint_folding_held_only(self) -> None:
            sized = [b for b in self.table if not b.pending and b.base is FOLDED]
            for blob in sized:
                blob.folded_size = blob.size  # as if its file had the size: never folded
            await real_checkpoint(self)
        real_checkpoint = Checkpoints.__dict__["checkpoint"]
        patch(Checkpoints, "checkpoint", checkpoint_folding_held_only)
    elif kind == "spillzeros":
        def read_back(self, ref) -> bytes:
            return bytes(len(ref))
        patch(DirtyReads, "read_back", read_back)
    elif kind == "nodirectcheck":
        patch(DirtyFiles, "check_direct", lambda self, *args: True)
    else:
        raise ValueError(f"no mutant {kind!r}")
    try:
        yield
    finally:
        for room, name, value in reversed(saved):
            setattr(room, name, value)


class ChunkWritesModel(WritesModel):
    """The model without the user blob: what the mutant hunts search (the view and chunks
    are what their mutants break, and fewer rules find them in fewer examples)."""

    USER_BLOBS = False


def _spill(self: WritesModel) -> None:
    self.w.spill()


class SpillingWritesModel(WritesModel):
    """The whole model, and spills: every written byte let go of at random steps (reads then
    take them from the journal). A class of its own, so that the mutant hunts of the models
    above draw the same steps as they did before spills were a rule."""

    spill = rule()(_spill)


class SpillWritesModel(ChunkWritesModel):
    """The view and chunks with spills: the hunt of the mutant that breaks reading back."""

    spill = rule()(_spill)
