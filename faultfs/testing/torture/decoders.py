"""Fuzz targets: every decoder of bytes faultfs reads back from disk or from a user, each as a
function of one ``bytes`` input, with valid encodings to start mutating from.

A target may raise only the library's own errors (``faultfs.errors.FaultfsError`` and its
kinds); anything else escaping — ``ValueError``, ``KeyError``, ``TypeError``, ``OverflowError``,
``MemoryError``, a ``struct.error`` — is a finding. Targets also check what a decoder promises
when it accepts an input (a round trip, a prefix of records in order, only verified bytes).

The same targets run under Hypothesis (``case_fuzz``, with tracemalloc bounding what one call
may allocate) and under atheris when it is installed (``fuzz_atheris``).

Targets that decode files write the input into a scratch directory of their own first (the
decoders read files through their own code paths: ``O_NOFOLLOW``, size checks, ``FileOps``).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import types
import zlib

import xxhash

from faultfs.core.context import REGISTRY_TAG, FaultContext
from faultfs.core.coord import StreamCoordinate
from faultfs.core.pagemap import parse, parse_strict
from faultfs.core.slots import SLOT_SIZE, DiskSlot, decode_slot
from faultfs.errors import FaultfsError
from faultfs.store.blobfile import FLAG_DIRTY, FLAG_NO_FAULT, decode_header, encode_header
from faultfs.store.blobstore import BlobStore, encode_component
from faultfs.store.journal import (
    KIND_SIZE,
    KIND_WRITE,
    KIND_ZERO,
    Journal,
    Record,
    data_len,
    encode,
)
from faultfs.store.metadata import DualMetadataManager, read_meta
from faultfs.store.registry import Registry, RegistryProblem
from faultfs.store.tagstate import TagState, read_tag_state

MAX_INPUT = 1 << 16  # inputs are cut to this: big enough for every header, small enough to be fast
READ_BOUND = 1 << 20  # the store reads a fuzzed blob with a caller's limit, as its callers do


BLOB_FIELDS = [8, 10, 12, 16, 24, 32, 40, 42, 44, 46, 48, 52, 56, 2048, 4088]  # blobfile.py
SLOT_FIELDS = [0, 4, 8, 16, 24, 28, 36, 40, 44, 48, 56, 60]  # core/slots.py, core/coord.py


class Finding(AssertionError):
    """A decoder accepted an input and then broke one of its own promises."""


def _bounded(data: bytes) -> bytes:
    return data[:MAX_INPUT]


class Target:
    """One decoder under fuzzing: ``__call__(data)`` decodes; ``seeds()`` are valid inputs."""

    name = ""

    def __init__(self, scratch: str) -> None:
        self.scratch = scratch

    def __call__(self, data: bytes) -> None:
        raise NotImplementedError

    def seeds(self) -> list[bytes]:
        return []

    def fix(self, data: bytes) -> bytes:
        """Make a mutated input pass the format's checksums again (reaches deeper checks)."""
        return data

    def offsets(self) -> list[int]:
        """Where the fields of the seeds' formats are: mutations aim there half the time."""
        return []

    def _store(self) -> BlobStore:
        """The target's store, made once (its files are overwritten by each input)."""
        store = getattr(self, "_made_store", None)
        if store is None:
            store = self._made_store = BlobStore(os.path.join(self.scratch, "store"))
        return store

    def _write(self, rel: str, data: bytes) -> str:
        path = os.path.join(self.scratch, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        return path

    def _reset(self) -> None:
        for entry in os.listdir(self.scratch):
            path = os.path.join(self.scratch, entry)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)


# -- core decoders ----------------------------------------------------------------------------

class PagemapText(Target):
    name = "pagemap text"

    def __call__(self, data: bytes) -> None:
        text = _bounded(data).decode("utf-8", "replace")
        lenient = parse(text)  # never raises: malformed text is the empty map
        try:
            strict = parse_strict(text)
        except FaultfsError:
            return
        if parse(strict.serialize()) != strict:
            raise Finding("parse(m.serialize()) != m")
        if lenient != strict:
            raise Finding("parse and parse_strict accepted the same text as different maps")

    def seeds(self) -> list[bytes]:
        return [b"pagemap\npage_size=4096\nchunk_0 0 0 1000\nchunk_1 100 2000 3000\n",
                b"pagemap\npage_size=1048576\ntotal=3145728\nchunk_0 0 0 1048576\n"
                b"chunk_1 0 1048576 1048576\nchunk_2 0 2097152 1048576\n",
                b"page_size=1\na 0 0 9223372036854775807\n"]


class ContextBytes(Target):
    name = "fault context"

    def __call__(self, data: bytes) -> None:
        try:
            ctx = FaultContext.decode(_bounded(data))
        except FaultfsError:
            return
        if ctx.encode() != _bounded(data) or FaultContext.decode(ctx.encode()) != ctx:
            raise Finding("a decoded context does not round-trip")
        _ = ctx.key

    def seeds(self) -> list[bytes]:
        return [FaultContext("/data/run42/field.bin", "field", chunk_size=1 << 20).encode(),
                FaultContext("s3://b/k.h5", "k", s3_region="eu", range_off=7, range_size=99,
                             blob_prefix="", on_fault=False).encode()]


class SlotBytes(Target):
    name = "cursor slot and coordinate"

    def __call__(self, data: bytes) -> None:
        data = _bounded(data)
        reading = decode_slot(data[:SLOT_SIZE])  # never raises
        if reading.slot is not None:
            if reading.slot.encode() != data[:SLOT_SIZE]:
                raise Finding("a valid slot does not re-encode to its bytes")
        try:
            StreamCoordinate.decode(data[:32])
        except FaultfsError:
            if len(data[:32]) == 32:
                raise Finding("32 bytes refused as a coordinate") from None

    def seeds(self) -> list[bytes]:
        c = StreamCoordinate(3, 1 << 40, 5, 0, 77, 123456)
        return [DiskSlot(7, 9, c, 1000).encode(), DiskSlot(2, 0, StreamCoordinate(), 0).encode()]

    def fix(self, data: bytes) -> bytes:
        if len(data) < SLOT_SIZE:
            return data
        body = data[:60]
        return body + struct.pack("<I", zlib.crc32(body)) + data[SLOT_SIZE:]

    def offsets(self) -> list[int]:
        return SLOT_FIELDS


# -- store decoders ---------------------------------------------------------------------------

def _fix_blob_header(data: bytes) -> bytes:
    if len(data) < 4096:
        return data
    head = data[:4088]
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head)) + data[4096:]


class BlobFile(Target):
    name = "blob header and file"

    def __call__(self, data: bytes) -> None:
        try:
            header = decode_header(data, file_size=len(data))
        except FaultfsError:
            header = None
        store = self._store()
        path = store.blob_path("t", "b")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        try:
            payload = store.read("t", "b", max_len=READ_BOUND)
        except FaultfsError:
            if header is None or not header.dirty:
                raise Finding("a damaged clean blob raised instead of reading as absent") from None
            return
        if payload is None:
            return
        if header is None or header.tag != "t" or header.name != "b":
            raise Finding("the store served a blob whose header does not verify as (t, b)")
        if len(payload) != header.payload_len:
            raise Finding("the store served a payload of the wrong length")
        if not header.all_zero:
            bs = header.block_size
            for i, want in enumerate(header.block_sums):
                if xxhash.xxh3_64_intdigest(payload[i * bs:(i + 1) * bs]) != want:
                    raise Finding(f"the store served block {i}, which fails its checksum")

    def seeds(self) -> list[bytes]:
        out = []
        for payload, flags in ((b"hello" * 1000, FLAG_NO_FAULT), (bytes(70000), FLAG_NO_FAULT),
                               (os.urandom(40000), FLAG_DIRTY), (b"", FLAG_NO_FAULT)):
            head, stored = encode_header("t", "b", payload, flags=flags, source_version="v1")
            out.append(head + (payload if stored else b""))
        return out

    def fix(self, data: bytes) -> bytes:
        return _fix_blob_header(data)

    def offsets(self) -> list[int]:
        return BLOB_FIELDS


class TagStateFile(Target):
    name = "tag state"

    def __call__(self, data: bytes) -> None:
        store = self._store()
        directory = store.tag_dir("t")
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "tag.json"), "wb") as f:
            f.write(_bounded(data))
        state = read_tag_state(store, "t")  # never raises: a damaged state reads as absent
        if state is not None and TagState.from_doc(state.to_doc()) != state:
            raise Finding("a tag state does not round-trip")
        try:
            doc = json.loads(_bounded(data))
        except ValueError:
            return
        if isinstance(doc, dict):
            TagState.from_doc(doc)

    def seeds(self) -> list[bytes]:
        return [json.dumps(TagState("fault:0123456789abcdef", "123 mtime:5", 0, "f.bin", 5.5,
                                    {"endpoint": "http://x"}).to_doc()).encode(),
                b'{"key": 7, "shard": "x", "mtime": true, "remote": []}']


class RegistryEntry(Target):
    name = "registry entry"

    def __call__(self, data: bytes) -> None:
        store = self._store()
        path = store.blob_path(REGISTRY_TAG, "fault:0123456789abcdef")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        for item in Registry(store).entries():  # never raises: problems are reported
            if isinstance(item, RegistryProblem):
                continue
            key, ctx, raw = item
            if ctx.key != key or ctx.encode() != raw:
                raise Finding("a registry entry was served that is not its own key's context")

    def seeds(self) -> list[bytes]:
        out = []
        for ctx in (FaultContext("/d/f.bin", "f", chunk_size=1 << 20),
                    FaultContext("s3://b/k", "k", blob_prefix="p")):
            payload = ctx.encode()
            head, _ = encode_header(REGISTRY_TAG, "fault:0123456789abcdef", payload,
                                    flags=FLAG_NO_FAULT)
            out.append(head + payload)
        # an entry of zeros: its payload is not stored, only its length
        head, _ = encode_header(REGISTRY_TAG, "fault:0123456789abcdef", bytes(100),
                                flags=FLAG_NO_FAULT)
        out.append(head)
        return out

    def fix(self, data: bytes) -> bytes:
        return _fix_blob_header(data)

    def offsets(self) -> list[int]:
        return BLOB_FIELDS


class CheckpointFiles(Target):
    """``X.meta`` (the ping-pong slots) and ``X.meta.dedup`` (the hash WAL): the first two
    bytes say how much of the input is the .meta file, the rest is the WAL."""

    name = "cursor .meta and WAL"

    def __call__(self, data: bytes) -> None:
        data = _bounded(data)
        split = int.from_bytes(data[:2], "little") % 260 if len(data) >= 2 else 0
        meta, wal = data[2:2 + split], data[2 + split:]
        self._reset()
        path = self._write("x.meta", meta)
        self._write("x.meta.dedup", wal)
        try:
            read_meta(path)
        except FaultfsError:
            pass
        try:
            mgr = DualMetadataManager.open(path)
        except FaultfsError:
            return
        with mgr:
            hashes = mgr.committed_hashes()
            if len(hashes) != mgr.dedup_count:
                raise Finding("committed_hashes() is not dedup_count long")
            try:
                mgr.commit(mgr.committed_batch_id + 1 if mgr.committed_batch_id < 2**64 - 1
                           else 0, mgr.coord, [1, 2, 3])
            except FaultfsError:
                return
        again = DualMetadataManager.open(path)
        with again:
            if again.dedup_count != len(hashes) + 3:
                raise Finding("a commit after recovery was not what the next open found")

    def seeds(self) -> list[bytes]:
        coord = StreamCoordinate(1, 4096, 0, 0, 0, 50)
        b = DiskSlot(2, 4, coord, 2).encode()
        a = DiskSlot(1, 3, StreamCoordinate(), 1).encode()
        wal = struct.pack("<3Q", 11, 22, 33)
        return [struct.pack("<H", 128) + a + b + wal,
                struct.pack("<H", 128) + bytes(64) + DiskSlot(0, 0, StreamCoordinate(), 0).encode()]

    def offsets(self) -> list[int]:
        return [0, *(2 + f for f in SLOT_FIELDS), *(66 + f for f in SLOT_FIELDS), 130]

    def fix(self, data: bytes) -> bytes:
        out = bytearray(data)
        for at in (2, 66):
            if len(out) >= at + 64:
                out[at + 60:at + 64] = struct.pack("<I", zlib.crc32(bytes(out[at:at + 60])))
        return bytes(out)


class StreamResume(Target):
    """A record stream resumed from a fuzzed ``.meta`` over a small .jsonl shard."""

    name = "record stream resume"

    def __call__(self, data: bytes) -> None:
        from faultfs.stream import RecordStream

        data = _bounded(data)
        self._reset()
        shard = self._write("part-0.jsonl", b"".join(b'{"i": %d}\n' % i for i in range(50)))
        self._write("run.meta", data[:128].ljust(128, b"\0"))
        self._write("run.meta.dedup", data[128:])
        try:
            with RecordStream(shard, os.path.join(self.scratch, "run.meta")) as stream:
                for batch_id, records in stream.batches(16):
                    if len(records) > 16:
                        raise Finding("a batch is larger than asked")
                    stream.commit(batch_id)
        except FaultfsError:
            return

    def seeds(self) -> list[bytes]:
        slot = DiskSlot(1, 2, StreamCoordinate(0, 20, 0, 0, 0, 2), 2).encode()
        wal = struct.pack("<2Q", xxhash.xxh3_64_intdigest(b'{"i": 0}'),
                          xxhash.xxh3_64_intdigest(b'{"i": 1}'))
        return [slot + DiskSlot(0, 0, StreamCoordinate(), 0).encode() + wal]

    def offsets(self) -> list[int]:
        return [*SLOT_FIELDS, *(64 + f for f in SLOT_FIELDS), 128]

    def fix(self, data: bytes) -> bytes:
        out = bytearray(data)
        for at in (0, 64):
            if len(out) >= at + 64:
                out[at + 60:at + 64] = struct.pack("<I", zlib.crc32(bytes(out[at:at + 60])))
        return bytes(out)


def _records(data: bytes) -> list[tuple[int, int]]:
    """``(offset, length)`` of each whole journal record in ``data`` (by its own lengths)."""
    out, pos = [], 0
    while pos + 56 <= len(data):
        kind = data[pos + 16]
        tag_len, name_len = struct.unpack_from("<HH", data, pos + 18)
        length = struct.unpack_from("<Q", data, pos + 32)[0]
        total = 56 + tag_len + name_len + data_len(kind, length)
        if pos + total > len(data):
            break
        out.append((pos, total))
        pos += total
    return out


class JournalSegments(Target):
    """Write-journal segments: the input is cut into up to three segment files at the
    offsets its first bytes name."""

    name = "write journal"

    def __call__(self, data: bytes) -> None:
        data = _bounded(data)
        self._reset()
        directory = os.path.join(self.scratch, "journal")
        os.makedirs(directory)
        head, body = data[:4], data[4:]
        cuts = sorted({int.from_bytes(head[i:i + 2], "little") % (len(body) + 1)
                       for i in (0, 2) if len(head) >= i + 2})
        pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
        first = 1
        for k, piece in enumerate(pieces):
            name = f"w-{first + k * 7:016x}.log"
            with open(os.path.join(directory, name), "wb") as f:
                f.write(piece)
        try:
            seqs = [rec.seq for rec in Journal(directory).replay(writable=False)]
        except FaultfsError:
            return
        if seqs != sorted(set(seqs)):
            raise Finding(f"replay yielded seqs out of order: {seqs[:10]}")
        journal = Journal(directory)
        try:
            again = [rec.seq for rec in journal.replay(writable=True)]
            if again != seqs:
                raise Finding("a writable replay found other records than a read-only one")
            seq = journal.append(KIND_WRITE, "t", "b", 0, 3, b"abc")
            journal.sync()
        except FaultfsError:
            return
        finally:
            journal.close()
        after = [rec.seq for rec in Journal(directory).replay(writable=False)]
        if after != [*seqs, seq]:
            raise Finding("the record appended after recovery is not the last one replayed")

    def seeds(self) -> list[bytes]:
        recs = [Record(1, KIND_WRITE, "t", "chunk_0", 10, 5, b"hello"),
                Record(2, KIND_ZERO, "t", "chunk_1", 0, 4096),
                Record(3, KIND_SIZE, "t", "", 0, 1 << 20),
                Record(4, KIND_WRITE, "t", "u:1", 0, 3, b"xyz")]
        raw = b"".join(encode(r) for r in recs)
        return [b"\0\0\0\0" + raw, struct.pack("<HH", 61, 140) + raw]

    def offsets(self) -> list[int]:
        starts = {4 + pos for seed in self.seeds() for pos, _ in _records(seed[4:])}
        return sorted({0, 2} | {at + f for at in starts
                                for f in (8, 16, 17, 18, 20, 22, 24, 32, 40, 48)})

    def fix(self, data: bytes) -> bytes:
        """Recompute every record's head and data checksums (so a mutated length or kind is
        what replay judges)."""
        body = bytearray(data[4:])
        for pos, total in _records(bytes(body)):
            tag_len, name_len = struct.unpack_from("<HH", body, pos + 18)
            kind = body[pos + 16]
            names = bytes(body[pos + 56:pos + 56 + tag_len + name_len])
            payload = bytes(body[pos + 56 + tag_len + name_len:pos + total])
            if kind == KIND_WRITE:
                body[pos + 40:pos + 48] = struct.pack(
                    "<Q", xxhash.xxh3_64_intdigest(payload) if payload else 0)
            check = xxhash.xxh3_64_intdigest(bytes(body[pos:pos + 48]) + names)
            body[pos + 48:pos + 56] = struct.pack("<Q", check)
        return data[:4] + bytes(body)


class _StandInTag:
    """What ``Writes.open_tag`` reads of a tag."""

    def __init__(self) -> None:
        from faultfs.core.chunks import ChunkLayout

        self.id = 1
        self.name = "t"
        self.layout = ChunkLayout(0, 3 << 20, 1 << 20)


class DirtyState(Target):
    """A tag's write state (``writes/t-<tag>/state.json``) and one dirty blob file, as the
    mount reads them back: ``DirtyFiles.read_state`` and ``Writes.open_tag``. The first two
    bytes of the input say how much of it is the state; the rest is the dirty file."""

    name = "dirty state and files"

    def __init__(self, scratch: str) -> None:
        super().__init__(scratch)
        import faultfs.engine.writes  # noqa: F401 - imported once here, not in the first call

    def __call__(self, data: bytes) -> None:
        from faultfs.engine.writes import Writes
        from faultfs.stats import Stats
        from faultfs.store.dirty import DirtyFiles

        data = _bounded(data)
        split = int.from_bytes(data[:2], "little") if len(data) >= 2 else 0
        state, blob = data[2:2 + split], data[2 + split:]
        self._reset()
        files = DirtyFiles(self.scratch)
        self._write(os.path.join("writes", encode_component("t-", "t"), "state.json"), state)
        if blob:
            self._write(os.path.join("writes", encode_component("t-", "t"),
                                     encode_component("b-", "chunk_1")), blob)
        try:
            files.read_state("t")
        except FaultfsError:
            pass
        writes = Writes(self.scratch, types.SimpleNamespace(unpin=None), types.SimpleNamespace(),
                        Stats(), writable=False)
        try:
            writes.open_tag(_StandInTag())  # type: ignore[arg-type]
        except FaultfsError:
            return

    def seeds(self) -> list[bytes]:
        state = json.dumps({"view_size": 3 << 20, "view_seq": 4, "users": {"a.txt": 1},
                            "next_user": 2, "ancestors": [], "voided": 0,
                            "voided_blobs": {}, "mtime_ns": 5}).encode()
        head, _ = encode_header("t", "chunk_1", b"x" * 5000, flags=FLAG_DIRTY,
                                source_version="wal:3")
        return [struct.pack("<H", len(state)) + state + head + b"x" * 5000,
                struct.pack("<H", len(state)) + state]

    def offsets(self) -> list[int]:
        split = int.from_bytes(self.seeds()[0][:2], "little")
        return [0, *(2 + split + f for f in BLOB_FIELDS)]

    def fix(self, data: bytes) -> bytes:
        split = int.from_bytes(data[:2], "little") if len(data) >= 2 else 0
        at = 2 + split
        return data[:at] + _fix_blob_header(data[at:])


TARGETS: tuple[type[Target], ...] = (PagemapText, ContextBytes, SlotBytes, BlobFile,
                                     TagStateFile, RegistryEntry, CheckpointFiles,
                                     StreamResume, JournalSegments, DirtyState)


def by_key(key: str) -> type[Target]:
    for cls in TARGETS:
        if cls.__name__ == key:
            return cls
    raise KeyError(key)


