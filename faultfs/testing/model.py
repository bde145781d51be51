"""The engine model: a Hypothesis state machine that drives a real engine (real store, in-memory
source) against a plain ``bytes`` model, with no mount.

Rules: reads of blobs, of the whole-object view and of pages (through a random pagemap over the
tag's chunks, with gaps); several concurrent readers of the same blobs inside one ``trio.run``
while the source holds every read (single-flight raced); injected source failures; damaged
staged blobs (payload, header, truncation); store-full episodes; remounts (a new engine on the
same store); in a variant, a store cap small enough to evict.

The model decides when an operation must succeed (STYLE.md): a read with no failure pending
returns exactly the model's bytes. EIO is allowed only when an injected source failure was
raised during that step (``MemorySource.failures`` moved) — a damaged clean blob must be
re-faulted and served correctly, a full store must be read through. Zeros, other bytes or an
error without a cause fail the test.

``mutant`` runs the machine against a deliberately broken engine; the suite checks that each
mutant is caught, so a model that accepts anything cannot pass unnoticed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
import threading
from collections.abc import Iterator

import trio
import trio.testing
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from faultfs.core.pagemap import PageExtent, build
from faultfs.engine import Engine
from faultfs.errors import FaultfsError, StoreFull
from faultfs.store.blobstore import BlobStore
from faultfs.testing.fakes import CS, MemorySource, ctx_for, engine_for, make_source, payload

TAG = "t"
URL = "mem://model"


class FullableStore(BlobStore):
    """A store whose file system can be made full: every ``put`` then fails with ENOSPC."""

    full = False

    def put(self, tag, name, payload, **kw):
        if self.full:
            raise StoreFull(f"store {self.root} is full (simulated)")
        return super().put(tag, name, payload, **kw)


class EngineModel(RuleBasedStateMachine):
    background = False  # attach the engine to a nursery: prefetch and stores behind readers
    cap_blobs = 0  # a --cache-size of this many chunks (0: none)
    memory_mb = 0  # 0: every hit comes off the store, where damage can be planted

    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.TemporaryDirectory()
        self.store = FullableStore(os.path.join(self.tmp.name, "store"))
        self.engine: Engine | None = None

    # -- set-up ------------------------------------------------------------------------------

    @initialize(size=st.integers(1, 6 * CS + 300), cs=st.sampled_from([CS // 2, CS, 2 * CS]),
                off=st.integers(0, 200))
    def start(self, size: int, cs: int, off: int) -> None:
        self.data = payload(size + off)[off:]
        self.source: MemorySource = make_source(payload(size + off), url=URL)
        self.cs = cs
        self.extents: list[tuple[int, int, int, int]] = []  # (chunk, blob_off, page_off, size)
        self.page_size = 0
        self.engine = self._new_engine()
        self.tag = self.engine.register(ctx_for(URL, TAG, chunk_size=cs, range_off=off))

    def _new_engine(self) -> Engine:
        cap = self.cap_blobs * (self.cs + 4096)
        return engine_for(self.store, memory_mb=self.memory_mb, cache_size=cap)

    def teardown(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.tmp.cleanup()

    # -- the model ---------------------------------------------------------------------------

    def blob_model(self, index: int) -> bytes:
        piece = self.data[index * self.cs:(index + 1) * self.cs]
        return piece + bytes(self.cs - len(piece))

    def page_model(self, page: int) -> bytes:
        out = bytearray(self.page_size)
        lo = page * self.page_size
        for chunk, blob_off, page_off, size in self.extents:
            blob = self.blob_model(chunk)[blob_off:blob_off + size]
            for k, byte in enumerate(blob):
                if 0 <= page_off + k - lo < self.page_size:
                    out[page_off + k - lo] = byte
        return bytes(out)

    @property
    def num_blobs(self) -> int:
        return self.tag.layout.num_blobs

    # -- running a step ----------------------------------------------------------------------

    def run(self, fn, *args):
        """``fn(*args)`` in one trio run; a FaultfsError is returned, not raised."""
        engine = self.engine
        assert engine is not None

        async def step():
            if not self.background:
                return await fn(*args)
            async with trio.open_nursery() as nursery:  # prefetch and background stores
                engine.attach(nursery)
                try:
                    return await fn(*args)
                except FaultfsError as exc:
                    return exc  # not through the nursery: it would wrap it in a group
                finally:
                    with trio.fail_after(10):
                        while engine.busy:  # noqa: ASYNC110 - waits for threads
                            await trio.sleep(0.001)
                    nursery.cancel_scope.cancel()

        try:
            return trio.run(step)
        except FaultfsError as exc:
            return exc

    def check(self, got, want: bytes, what: str, failures_before: int) -> None:
        """``got`` is ``want``, or an EIO whose cause (an injected failure) happened now."""
        if isinstance(got, FaultfsError):
            assert got.errno == errno.EIO, f"{what}: {got!r}"
            assert self.source.failures > failures_before, (
                f"{what}: EIO with no injected failure: {got}")
            return
        assert bytes(got) == want, f"{what}: wrong bytes"

    # -- reads -------------------------------------------------------------------------------

    @rule(off=st.integers(0, 7 * CS), size=st.integers(0, 3 * CS))
    def read_view(self, off: int, size: int) -> None:
        before = self.source.failures
        got = self.run(self.engine.read_view, self.tag, off, size)
        self.check(got, self.data[off:off + size], f"view [{off}, +{size})", before)

    @rule(data=st.data(), off=st.integers(0, 2 * CS), size=st.integers(1, 2 * CS))
    def read_blob(self, data, off: int, size: int) -> None:
        index = data.draw(st.integers(0, self.num_blobs - 1))
        before = self.source.failures
        got = self.run(self.engine.read_blob, self.tag, index, off, size)
        self.check(got, self.blob_model(index)[off:off + size], f"blob {index}", before)

    @rule(data=st.data(), readers=st.integers(2, 6))
    def concurrent_readers(self, data, readers: int) -> None:
        """Readers of a few blobs at once, the source holding every read until all of them
        are waiting: one source read per blob, every reader the model's bytes."""
        engine = self.engine
        assert engine is not None
        picks = [(data.draw(st.integers(0, self.num_blobs - 1)),
                  data.draw(st.integers(0, self.cs - 1)), data.draw(st.integers(1, self.cs)))
                 for _ in range(readers)]
        fresh = {i for i, _, _ in picks
                 if not engine.is_staged(self.tag, i) and not engine.tiers.is_held((self.tag.id, i))}
        before_reads, before_failures = self.source.reads, self.source.failures
        gate = self.source.gate = threading.Event()
        results: list[object] = [None] * readers

        async def reader(slot: int, index: int, off: int, size: int) -> None:
            try:
                results[slot] = bytes(await engine.read_blob(self.tag, index, off, size))
            except FaultfsError as exc:
                results[slot] = exc

        async def race() -> None:
            async with trio.open_nursery() as nursery:
                for slot, pick in enumerate(picks):
                    nursery.start_soon(reader, slot, *pick)
                await trio.testing.wait_all_tasks_blocked()  # every reader waits on its flight
                gate.set()

        try:
            self.run(race)
        finally:
            self.source.gate = None
            gate.set()
        for (index, off, size), got in zip(picks, results, strict=True):
            self.check(got, self.blob_model(index)[off:off + size], f"racing blob {index}",
                       before_failures)
        # With a full or capped store a blob may be served without being kept, and a reader
        # that arrives just after its fault (past a damaged copy) reads it again: read-through,
        # not a second flight. Otherwise each blob costs at most one source read.
        undisturbed = not self.store.full and not self.cap_blobs
        if not self.background and undisturbed and self.source.failures == before_failures:
            touched = {index for index, _, _ in picks}
            assert self.source.reads - before_reads <= len(touched), (
                f"a blob was faulted twice: readers {picks}, staged before "
                f"{sorted(set(range(self.num_blobs)) - fresh)}, source reads "
                f"{self.source.ranges[before_reads:]}")
            assert self.source.reads - before_reads >= len(fresh), "a read served no bytes"

    @precondition(lambda self: self.page_size > 0)
    @rule(data=st.data(), off=st.integers(0, 4 * CS), size=st.integers(1, 4 * CS))
    def read_page(self, data, off: int, size: int) -> None:
        engine = self.engine
        assert engine is not None
        pages = engine.pages.num_pages(self.tag)
        page = data.draw(st.integers(0, max(0, pages - 1)))
        before = self.source.failures
        got = self.run(engine.pages.read_page, self.tag, page, off, size)
        self.check(got, self.page_model(page)[off:off + size], f"page {page}", before)

    # -- changes -----------------------------------------------------------------------------

    @rule(data=st.data(), page_size=st.integers(1, 3 * CS), count=st.integers(1, 6))
    def set_pagemap(self, data, page_size: int, count: int) -> None:
        """A random pagemap over the tag's chunks, with gaps, installed through a handle."""
        extents = []
        pos = 0
        for _ in range(count):
            chunk = data.draw(st.integers(0, self.num_blobs - 1))
            blob_off = data.draw(st.integers(0, self.cs - 1))
            size = data.draw(st.integers(1, self.cs - blob_off))
            pos += data.draw(st.integers(0, CS))  # a gap (or none)
            extents.append((chunk, blob_off, pos, size))
            pos += size
        layout = self.tag.layout
        text = build(page_size, [PageExtent(layout.blob_name(c), b, p, s)
                                 for c, b, p, s in extents]).serialize().encode()
        engine = self.engine
        assert engine is not None

        async def install() -> None:
            fh = await engine.pages.open_pagemap(self.tag, os.O_WRONLY | os.O_TRUNC)
            try:
                engine.pages.handle_write(fh, 0, text)
                await engine.pages.flush(fh)
            finally:
                await engine.pages.close(fh)

        got = self.run(install)
        if isinstance(got, FaultfsError):  # user data that cannot be kept: ENOSPC, old map stays
            assert got.errno == errno.ENOSPC and self.store.full, got
            return
        self.extents, self.page_size = extents, page_size

    @rule(calls=st.sets(st.integers(1, 4), max_size=2))
    def fail_next_source_reads(self, calls: set[int]) -> None:
        base = self.source.reads
        self.source.fail_calls = {base + c for c in calls}

    @rule(pick=st.integers(0, 1 << 16), where=st.sampled_from(["payload", "header", "truncate"]),
          at=st.integers(0, 1 << 16))
    def damage_a_staged_blob(self, pick: int, where: str, at: int) -> None:
        # what is on disk depends on background timing: draw a number, not from that list,
        # so every replay of a step draws the same kinds of values
        names = sorted(n for n in self.store.list_blobs(TAG) if n != "pagemap")
        if not names:
            return
        path = self.store.blob_path(TAG, names[pick % len(names)])
        size = os.path.getsize(path)
        if where == "truncate":
            os.truncate(path, max(0, size - 1 - at % 64))
            return
        pos = 60 if where == "header" else 4096 + at % max(1, size - 4096)
        if pos >= size:
            return
        with open(path, "r+b") as f:
            f.seek(pos)
            byte = f.read(1)
            f.seek(pos)
            f.write(bytes([byte[0] ^ 0x5A]))

    @rule()
    def toggle_store_full(self) -> None:
        self.store.full = not self.store.full

    @rule()
    def remount(self) -> None:
        assert self.engine is not None
        self.engine.close()
        self.engine = self._new_engine()
        [self.tag] = self.engine.recover()

    # -- invariants --------------------------------------------------------------------------

    @precondition(lambda self: self.engine is not None)
    @invariant()
    def staged_blobs_are_on_disk(self) -> None:
        on_disk = set(self.store.list_blobs(TAG))
        engine = self.engine
        assert engine is not None
        for index in range(self.num_blobs):
            if engine.is_staged(self.tag, index):
                assert self.tag.layout.blob_name(index) in on_disk

    @precondition(lambda self: self.engine is not None and self.cap_blobs > 0)
    @invariant()
    def the_store_stays_under_its_cap(self) -> None:
        engine = self.engine
        assert engine is not None
        policy = engine.tiers.local.policy
        assert policy.lru_bytes <= policy.cache_size


class EngineModelAttached(EngineModel):
    """The same, with prefetch running and stores happening behind the readers."""

    background = True


class EngineModelCapped(EngineModel):
    """The same under a store cap of two chunks: faults evict least-recently-used blobs."""

    cap_blobs = 2


@contextlib.contextmanager
def mutant(kind: str) -> Iterator[None]:
    """A deliberately broken engine for the duration (the model must catch each kind):
    ``eio`` — every read fails; ``zeros`` — faults serve zeros; ``unverified`` — staged blocks
    are served without their checksum check."""
    from assimilators.binary import BinaryFileAssimilator
    from faultfs.store.blobfile import BlobHeader

    saved: list[tuple[object, str, object]] = []

    def patch(owner: object, name: str, value: object) -> None:
        saved.append((owner, name, owner.__dict__[name]))  # type: ignore[attr-defined]
        setattr(owner, name, value)

    if kind == "eio":
        async def broken_read(self, tag, index, off, size):
            raise FaultfsError("broken engine", errno.EIO)

        patch(Engine, "read_blob", broken_read)
        patch(Engine, "read_view", lambda self, tag, off, size: broken_read(self, tag, 0, off, size))
    elif kind == "zeros":
        real = BinaryFileAssimilator.read_blobs

        def zeros(self, source, ctx, layout, first, count):
            return [bytes(len(b)) for b in real(self, source, ctx, layout, first, count)]

        patch(BinaryFileAssimilator, "read_blobs", zeros)
    elif kind == "unverified":
        patch(BlobHeader, "check_blocks", lambda self, first, data: None)
    else:
        raise ValueError(f"no mutant {kind!r}")
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)
