"""The blob file format and the store: golden bytes, corruption, locking, staleness, names."""

import os
import struct

import pytest
import xxhash

from faultfs.errors import CorruptionError, FaultfsError, InvalidInput
from faultfs.store.blobfile import (
    FLAG_DIRTY,
    FLAG_NO_FAULT,
    HEADER_LEN,
    decode_header,
    encode_header,
)
from faultfs.store.blobstore import BlobStore


def test_golden_header_bytes():
    header, with_payload = encode_header("run42", "chunk_7", b"hello", flags=FLAG_NO_FAULT,
                                         source_version="5 mtime_ns:1")
    assert with_payload
    assert len(header) == HEADER_LEN
    digest = xxhash.xxh3_64(b"hello").intdigest().to_bytes(8, "little").hex()
    assert header[:56].hex() == (
        "464653424c4f4200" "0100" "0400" "00100000" "0500000000000000" "0500000000000000"
        + digest + "0500" "0700" "0c00" "0100" "00400000" "00000000"
    ), "format changed: bump the version"
    assert header[56:56 + 24] == b"run42chunk_75 mtime_ns:1"
    assert header[56 + 24:2048] == bytes(2048 - 80)
    assert header[2048:2056].hex() == digest, "one 16 KiB block: its checksum is the payload's"
    assert header[2056:4088] == bytes(4088 - 2056)
    assert xxhash.xxh3_64_intdigest(header[:4088]).to_bytes(8, "little") == header[4088:]


def test_block_table_bounds_every_size():
    from faultfs.store.blobfile import MAX_BLOCKS, block_size_for

    for n in (0, 1, 4096, 16384, 16385, 1 << 20, (1 << 20) + 5, 255 << 14, (255 << 14) + 1, 1 << 30):
        bs = block_size_for(n)
        assert bs % 4096 == 0 and bs >= 16384
        assert -(-n // bs) <= MAX_BLOCKS


@pytest.mark.parametrize("whole", [False, True])
def test_a_read_verifies_only_the_blocks_it_touches(tmp_path, whole):
    """Also when the blob was opened ``whole`` (header and payload in one read)."""
    store = BlobStore(str(tmp_path / "s"))
    data = bytes(range(256)) * 4096  # 1 MiB: 64 blocks of 16 KiB
    store.put("t", "b", data, flags=FLAG_NO_FAULT)
    path = store.blob_path("t", "b")
    bs = 16384
    with open(path, "r+b") as f:  # damage block 60 only
        f.seek(HEADER_LEN + 60 * bs + 7)
        f.write(b"\x00\x01\x02")
    blob = store.open_blob("t", "b", whole=whole)
    assert (blob.loaded is not None) is whole
    assert blob.header.block_size == bs and len(blob.header.block_sums) == 64
    assert blob.pread(4096, bs * 3 + 100) == data[bs * 3 + 100:bs * 3 + 100 + 4096]
    with pytest.raises(CorruptionError, match="block 60"):
        blob.pread(10, 60 * bs)
    blob.close()


def test_all_zero_payload_is_not_stored():
    header, with_payload = encode_header("t", "b", bytes(4096), flags=FLAG_NO_FAULT)
    assert not with_payload
    parsed = decode_header(header, file_size=HEADER_LEN)
    assert parsed.all_zero and parsed.payload_len == 4096 and parsed.stored_len == 0


@pytest.fixture
def store(tmp_path):
    return BlobStore(str(tmp_path / "store"))


def test_put_and_read_round_trip(store):
    store.put("tag", "chunk_0", b"abc" * 1000, flags=FLAG_NO_FAULT, source_version="v1")
    assert store.read("tag", "chunk_0", source_version="v1") == b"abc" * 1000
    assert store.list_blobs("tag") == ["chunk_0"]
    mode = os.stat(store.blob_path("tag", "chunk_0")).st_mode & 0o777
    assert mode == 0o600


def test_stale_clean_blob_is_not_served_but_dirty_is(store):
    store.put("tag", "a", b"x" * 10, flags=FLAG_NO_FAULT, source_version="v1")
    store.put("tag", "b", b"y" * 10, flags=FLAG_DIRTY, source_version="v1")
    assert store.read("tag", "a", source_version="v2") is None
    assert store.read("tag", "b", source_version="v2") == b"y" * 10


def _path(store):
    store.put("tag", "chunk_0", b"payload-bytes" * 100, flags=FLAG_NO_FAULT)
    return store.blob_path("tag", "chunk_0")


def _corrupt_torn(path):
    os.truncate(path, os.path.getsize(path) - 7)


def _corrupt_flip_payload(path):
    with open(path, "r+b") as f:
        f.seek(HEADER_LEN + 5)
        byte = f.read(1)
        f.seek(HEADER_LEN + 5)
        f.write(bytes([byte[0] ^ 1]))


def _corrupt_foreign(path):
    with open(path, "wb") as f:
        f.write(b"#!/bin/sh\necho not a blob\n" * 300)


def _corrupt_truncated_header(path):
    os.truncate(path, 100)


def _corrupt_huge_length(path):
    with open(path, "r+b") as f:
        f.seek(16)
        f.write(struct.pack("<Q", 2**64 - 1))


def _corrupt_header_byte(path):
    with open(path, "r+b") as f:
        f.seek(50)
        f.write(b"Z")


@pytest.mark.parametrize("damage", [
    _corrupt_torn, _corrupt_flip_payload, _corrupt_foreign, _corrupt_truncated_header,
    _corrupt_huge_length, _corrupt_header_byte,
])
def test_damaged_clean_blob_is_treated_as_absent_and_removed(store, damage):
    path = _path(store)
    damage(path)
    assert store.read("tag", "chunk_0") is None
    assert not os.path.exists(path), "a damaged clean blob must be dropped so it re-faults"


def test_damaged_dirty_blob_is_an_error_not_silence(store):
    store.put("tag", "mine", b"user data" * 100, flags=FLAG_DIRTY)
    path = store.blob_path("tag", "mine")
    _corrupt_flip_payload(path)
    blob = store.open_blob("tag", "mine")
    with pytest.raises(CorruptionError, match="dirty blob"):
        blob.pread(100, 0)
    blob.close()
    with pytest.raises(CorruptionError, match="dirty blob"):
        store.read("tag", "mine")
    assert os.path.exists(path), "user data is never deleted on a checksum failure"


def test_a_small_read_verifies_its_own_block_only(store):
    """A read within one block (the hit path's one pread and one checksum) is served from a
    good block of a blob whose other block is damaged, and names the block it fails on."""
    payload = os.urandom(40 << 10)  # 16 KiB blocks: three of them
    store.put("tag", "b", payload, flags=FLAG_NO_FAULT)
    with open(store.blob_path("tag", "b"), "r+b") as f:
        f.seek(HEADER_LEN + (33 << 10))
        f.write(bytes([payload[33 << 10] ^ 1]))
    blob = store.open_blob("tag", "b")
    assert blob.header.block_size == 16 << 10
    assert blob.pread(4096, 100) == payload[100:4196]
    assert blob.pread(16 << 10, 16 << 10) == payload[16 << 10:32 << 10]  # a whole block
    for size, off in ((10, 33 << 10), (1 << 20, 39 << 10)):  # the second clipped at the end
        with pytest.raises(CorruptionError, match="block 2 failed its checksum"):
            blob.pread(size, off)
    blob.close()


@pytest.mark.parametrize("damaged", [0, 2, 4])  # the first, an inner and the last block read
def test_a_read_over_blocks_checks_each_without_joining_them(store, damaged):
    """A read over several blocks returns the bytes asked for read once (``pread``) or
    straight into the caller's buffer (``preadinto``), the rest of its end blocks read apart:
    every block it lies in is checked, the first and last too, whatever the offsets."""
    payload = os.urandom(100 << 10)  # 16 KiB blocks: seven of them
    store.put("tag", "b", payload, flags=FLAG_NO_FAULT)
    blob = store.open_blob("tag", "b")
    bs = blob.header.block_size
    assert bs == 16 << 10
    for off, size in ((5, 3 * bs), (bs, 2 * bs), (bs - 1, 2), (7, 100 << 10), (0, 5 << 20),
                      (3 * bs + 9, 1)):
        want = payload[off:off + size]
        assert blob.pread(size, off) == want
        buf = bytearray(size + 3)
        assert blob.preadinto(memoryview(buf)[:size], off) == len(want)
        assert bytes(buf[:len(want)]) == want
    blob.close()
    with open(store.blob_path("tag", "b"), "r+b") as f:  # one byte of one block
        at = damaged * bs + bs // 2
        f.seek(HEADER_LEN + at)
        f.write(bytes([payload[at] ^ 0x40]))
    blob = store.open_blob("tag", "b")
    # the damaged byte in the bytes asked for, or only in the rest of an end block
    for off, size in ((bs // 3, 4 * bs + 100), (damaged * bs + 1, bs), (1, 5 * bs - 2),
                      (damaged * bs + bs // 2 + 10, bs), (max(0, damaged - 1) * bs, bs + 9)):
        if not off // bs <= damaged <= (off + size - 1) // bs:
            continue
        with pytest.raises(CorruptionError, match=f"block {damaged} failed its checksum"):
            blob.pread(size, off)
        with pytest.raises(CorruptionError, match=f"block {damaged} failed its checksum"):
            blob.preadinto(memoryview(bytearray(size)), off)
    # the blocks around it still read
    good = 5 * bs + 3
    assert blob.pread(bs, good) == payload[good:good + bs]
    blob.close()


def test_huge_length_gives_exact_error():
    header, _ = encode_header("t", "b", b"data", flags=FLAG_NO_FAULT)
    raw = bytearray(header)
    raw[16:24] = struct.pack("<Q", 2**64 - 1)
    raw[4088:] = xxhash.xxh3_64_intdigest(bytes(raw[:4088])).to_bytes(8, "little")
    with pytest.raises(CorruptionError, match="payload length 18446744073709551615 is over the limit"):
        decode_header(bytes(raw), file_size=HEADER_LEN + 4)


def test_blob_file_of_another_name_is_not_served(store):
    store.put("tag", "chunk_0", b"zero", flags=FLAG_NO_FAULT)
    store.put("tag", "chunk_1", b"one!", flags=FLAG_NO_FAULT)
    os.replace(store.blob_path("tag", "chunk_1"), store.blob_path("tag", "chunk_0"))
    assert store.open_blob("tag", "chunk_0") is None
    assert store.read("tag", "chunk_0") is None


def test_names_cannot_escape_the_store(store, tmp_path):
    for name in ("../../etc/passwd", "a/b", "..", "x" * 255, "page:7", "fault:0123456789abcdef"):
        path = store.blob_path("tag/../..", name)
        assert os.path.realpath(path).startswith(os.path.realpath(store.root) + os.sep)
        store.put("tag/../..", name, b"data", flags=FLAG_NO_FAULT)
        assert store.read("tag/../..", name) == b"data"
    assert sorted(os.listdir(tmp_path)) == ["store"]


def test_one_owner_at_a_time(store):
    store.acquire()
    other = BlobStore(store.root)
    with pytest.raises(FaultfsError, match=f"in use by pid {os.getpid()}"):
        other.acquire()
    store.release()
    other.acquire()
    other.release()


def test_unwritable_store_is_refused(tmp_path):
    target = tmp_path / "ro"
    target.mkdir()
    (target / "tags").mkdir()
    (target / "log").mkdir()
    os.chmod(target, 0o555)
    try:
        if os.geteuid() == 0:
            # root ignores mode bits; a store on a file is refused instead
            (tmp_path / "file").write_text("x")
            with pytest.raises(InvalidInput):
                BlobStore(str(tmp_path / "file"))
        else:
            with pytest.raises(InvalidInput, match="not writable"):
                BlobStore(str(target))
    finally:
        os.chmod(target, 0o755)


def test_leftover_temporary_files_are_cleaned(store):
    store.put("tag", "chunk_0", b"x", flags=FLAG_NO_FAULT)
    tmp = os.path.join(store.tag_dir("tag"), "t-deadbeef.tmp")
    with open(tmp, "wb") as f:
        f.write(b"partial")
    assert store.list_blobs("tag") == ["chunk_0"]
    assert not os.path.exists(tmp)


def test_is_dirty_reads_the_header(store):
    store.put("t", "clean", b"c" * 100, flags=FLAG_NO_FAULT)
    store.put("t", "dirty", b"d" * 100, flags=FLAG_DIRTY)
    assert not store.is_dirty("t", "clean") and store.is_dirty("t", "dirty")
    assert not store.is_dirty("t", "absent")


def test_a_whole_read_of_a_file_cut_short_meanwhile_is_not_served(store, monkeypatch):
    """open_blob(whole=True) reads the file in one request: fewer bytes than fstat said
    (cut after the fstat) must not become a short, block-verified payload."""
    import faultfs.store.blobread as blobread_mod

    data = bytes(range(256)) * 4096
    store.put("t", "b", data, flags=FLAG_NO_FAULT)
    real = blobread_mod.pread_full
    monkeypatch.setattr(blobread_mod, "pread_full",
                        lambda fd, size, off: real(fd, size - 16384 * 32, off))
    assert store.open_blob("t", "b", whole=True) is None


def _zero_blob_claiming(tag: str, name: str, length: int) -> bytes:
    """An all-zero blob's header (no payload stored, only its length) claiming ``length``."""
    head, stored = encode_header(tag, name, bytes(100), flags=FLAG_NO_FAULT)
    assert not stored
    raw = bytearray(head)
    struct.pack_into("<Q", raw, 16, length)
    struct.pack_into("<Q", raw, 4088, xxhash.xxh3_64_intdigest(bytes(raw[:4088])))
    return bytes(raw)


@pytest.mark.parametrize("length", [2**64 - 1, 2**63, (1 << 30) + 1])
def test_an_all_zero_blob_claiming_an_absurd_length_is_damaged(tmp_path, length):
    raw = _zero_blob_claiming("tag", "chunk_0", length)
    with pytest.raises(CorruptionError, match="over the limit"):
        decode_header(raw, file_size=len(raw))
    store = BlobStore(str(tmp_path / "s"))
    path = store.blob_path("tag", "chunk_0")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(raw)
    assert store.read("tag", "chunk_0") is None  # absent, never an allocation of its length
    assert not os.path.exists(path), "a damaged clean blob is dropped"


def test_a_read_is_held_to_its_callers_limit(tmp_path):
    store = BlobStore(str(tmp_path / "s"))
    store.put("tag", "zeros", bytes(3 << 20), flags=FLAG_NO_FAULT)  # stored as a length only
    store.put("tag", "mine", bytes(3 << 20), flags=FLAG_DIRTY)
    assert store.read("tag", "zeros", max_len=4 << 20) == bytes(3 << 20)
    assert store.read("tag", "zeros", max_len=1 << 20) is None
    with pytest.raises(CorruptionError, match="dirty blob mine of tag tag is damaged"):
        store.read_with_mtime("tag", "mine", max_len=1 << 20)
    assert store.read("tag", "mine") == bytes(3 << 20), "a dirty blob is kept"


def test_a_registry_entry_claiming_two_to_the_64_bytes_is_a_problem_not_a_failed_mount(tmp_path):
    from faultfs.core.context import REGISTRY_TAG, FaultContext
    from faultfs.store.registry import Registry, RegistryProblem

    store = BlobStore(str(tmp_path / "s"))
    good = FaultContext("/d/f.bin", "f", chunk_size=1 << 20)
    Registry(store).put(good)
    bad_key = "fault:0123456789abcdef"
    for length in (2**64 - 1, 2 << 20):  # absurd, and under the blob limit but over an entry's
        path = store.blob_path(REGISTRY_TAG, bad_key)
        with open(path, "wb") as f:
            f.write(_zero_blob_claiming(REGISTRY_TAG, bad_key, length))
        items = list(Registry(store).entries())
        problems = [i for i in items if isinstance(i, RegistryProblem)]
        assert [p.key for p in problems] == [bad_key]
        assert [i[0] for i in items if not isinstance(i, RegistryProblem)] == [good.key]


def test_writers_making_a_new_tags_directory_at_once_keep_each_others_blobs(tmp_path):
    """The first blobs of a new tag, staged at once by several writers (threads here; the
    protocol's processes and a mount alike), each make the tag's directory: none may remove
    it under the others. A check-then-remove-then-make lost blobs another writer had just
    published (a faultfs:: read faulted them a second time)."""
    import threading

    stores = [BlobStore(str(tmp_path / "store")) for _ in range(2)]
    writers = 8
    failed: list[BaseException] = []
    for round_ in range(25):
        tag = f"new-{round_}"
        barrier = threading.Barrier(writers)

        def stage(i: int, tag: str = tag, barrier: threading.Barrier = barrier) -> None:
            try:
                barrier.wait()
                store = stores[i % 2]
                store.publish(tag, str(i), bytes([i + 1]) * 1000, store.temp_path(tag))
            except BaseException as exc:
                failed.append(exc)

        threads = [threading.Thread(target=stage, args=(i,)) for i in range(writers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not failed, failed
        assert sorted(stores[0].list_blobs(tag), key=int) == [str(i) for i in range(writers)]
