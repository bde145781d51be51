"""A Hypothesis state machine drives the engine against a plain ``bytes`` model.

Random reads of blobs and of the whole-object view, injected source failures, damaged blob
files, store-full episodes and remounts (a new engine on the same store): whatever happens,
a read returns exactly the model's bytes or fails with EIO — never other bytes, never zeros
in place of data.
"""

from __future__ import annotations

import errno
import os

import trio
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from faultfs.errors import FaultfsError
from faultfs.store import blobstore
from faultfs.store.blobstore import BlobStore
from faultfs.testing.fakes import CS, ctx_for, engine_for, make_source, payload


class EngineModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        import tempfile

        self.tmp = tempfile.TemporaryDirectory()
        self.store = BlobStore(os.path.join(self.tmp.name, "store"))

    @initialize(size=st.integers(1, 6 * CS + 300), cs=st.sampled_from([CS // 2, CS, 2 * CS]),
                off=st.integers(0, 200))
    def start(self, size, cs, off):
        self.data = payload(size + off)[off:]
        self.source = make_source(payload(size + off), url="mem://model")
        self.cs = cs
        self.range_off = off
        self.engine = engine_for(self.store, memory_mb=0)
        self.tag = self.engine.register(ctx_for("mem://model", chunk_size=cs, range_off=off))
        self.full = False

    def teardown(self) -> None:
        if hasattr(self, "engine"):
            self.engine.close()
        self.tmp.cleanup()

    def _blob_model(self, index: int) -> bytes:
        piece = self.data[index * self.cs:(index + 1) * self.cs]
        return piece + bytes(self.cs - len(piece))

    background = False

    def _run(self, fn, *args):
        async def step():
            if not self.background:
                return await fn(*args)
            async with trio.open_nursery() as nursery:  # prefetch and background stores
                self.engine.attach(nursery)
                try:
                    return await fn(*args)
                except FaultfsError as exc:
                    return exc  # not through the nursery: it would wrap it in a group
                finally:
                    with trio.fail_after(10):
                        while self.engine.busy:  # noqa: ASYNC110
                            await trio.sleep(0.001)
                    nursery.cancel_scope.cancel()

        try:
            result = trio.run(step)
        except FaultfsError as exc:
            result = exc
        if isinstance(result, FaultfsError):
            assert result.errno == errno.EIO, result  # EIO is one allowed outcome of a step
            return None
        return result

    @rule(off=st.integers(0, 7 * CS), size=st.integers(0, 3 * CS))
    def read_view(self, off, size):
        got = self._run(self.engine.read_view, self.tag, off, size)
        if got is not None:
            assert got == self.data[off:off + size]

    @rule(data=st.data(), off=st.integers(0, 2 * CS), size=st.integers(1, 2 * CS))
    def read_blob(self, data, off, size):
        index = data.draw(st.integers(0, self.tag.layout.num_blobs - 1))
        got = self._run(self.engine.read_blob, self.tag, index, off, size)
        if got is not None:
            assert got == self._blob_model(index)[off:off + size]

    @rule(calls=st.sets(st.integers(1, 4), max_size=2))
    def fail_next_source_reads(self, calls):
        base = self.source.reads
        self.source.fail_calls = {base + c for c in calls}

    @rule(pick=st.integers(0, 1 << 16), where=st.sampled_from(["payload", "header", "truncate"]))
    def damage_a_staged_blob(self, pick, where):
        # what is on disk depends on background timing: draw a number, not from that list,
        # so every replay of a step draws the same kinds of values
        names = sorted(self.store.list_blobs("t"))
        if not names:
            return
        path = self.store.blob_path("t", names[pick % len(names)])
        size = os.path.getsize(path)
        if where == "truncate":
            os.truncate(path, max(0, size - 1))
            return
        pos = 60 if where == "header" else 4096 + (size - 4096) // 2
        if pos >= size:
            return
        with open(path, "r+b") as f:
            f.seek(pos)
            byte = f.read(1)
            f.seek(pos)
            f.write(bytes([byte[0] ^ 0x5A]))

    @rule()
    def toggle_store_full(self):
        self.full = not self.full

    @rule()
    def remount(self):
        self.engine.close()
        self.engine = engine_for(self.store, memory_mb=0)
        [self.tag] = self.engine.recover()

    @precondition(lambda self: hasattr(self, "engine"))
    @invariant()
    def staged_blobs_are_on_disk(self):
        on_disk = set(self.store.list_blobs("t"))
        for index in range(self.tag.layout.num_blobs):
            if self.engine.is_staged(self.tag, index):
                assert self.tag.layout.blob_name(index) in on_disk


_real_write_atomic = blobstore.write_atomic


def _maybe_full_write_atomic(path, parts, **kw):
    machine = _maybe_full_write_atomic.machine
    if machine is not None and getattr(machine, "full", False):
        raise OSError(errno.ENOSPC, "No space left on device")
    return _real_write_atomic(path, parts, **kw)


_maybe_full_write_atomic.machine = None


class EngineModelWithFullStore(EngineModel):
    def __init__(self) -> None:
        super().__init__()
        _maybe_full_write_atomic.machine = self
        blobstore.write_atomic = _maybe_full_write_atomic

    def teardown(self) -> None:
        blobstore.write_atomic = _real_write_atomic
        _maybe_full_write_atomic.machine = None
        super().teardown()


EngineModelWithFullStore.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None,
    derandomize=bool(os.environ.get("CI")),  # CI replays the same examples; local runs explore
    suppress_health_check=[HealthCheck.too_slow])
test_engine_matches_the_bytes_model = EngineModelWithFullStore.TestCase


class EngineModelInBackground(EngineModelWithFullStore):
    """The same, with the engine attached: prefetch runs and stores happen in the background."""

    background = True


EngineModelInBackground.TestCase.settings = EngineModelWithFullStore.TestCase.settings
test_attached_engine_matches_the_bytes_model = EngineModelInBackground.TestCase
