"""The write journal's format and replay (``faultfs.store.journal``): golden bytes, torn and
foreign tails, segments, a replay after ``advance``, and hostile segment contents."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from faultfs.errors import CorruptionError
from faultfs.store.journal import (
    HEAD_LEN,
    KIND_BLOB,
    KIND_CREATE,
    KIND_RENAME,
    KIND_RESET,
    KIND_SIZE,
    KIND_UNLINK,
    KIND_WRITE,
    KIND_ZERO,
    MAGIC,
    MAGIC_V2,
    MAGIC_V3,
    RENAME_EXCHANGE,
    RENAME_REPLACE,
    Journal,
    Record,
    SegmentGone,
    decode_head,
    encode,
    segment_name,
)


@pytest.fixture
def tmp_path(tmp_path):
    """The journal's directory, as in a store: ``writes/damaged/`` lands beside it."""
    journal = tmp_path / "writes" / "journal"
    journal.mkdir(parents=True)
    return journal


def damaged_dir(journal) -> str:
    return os.path.join(os.path.dirname(journal), "damaged")


GOLDEN = bytes.fromhex(
    "46465357414c0001070000000000000001000100070000000010000000000000030000000000000050392f89"
    "945faf7895f45ac0fca74d6a746368756e6b5f30616263")


GOLDEN_BLOB = bytes.fromhex(
    "46465357414c00020900000000000000040001000700000000000000000000000000100000000000887766"
    "554433221190113d8158157b3d746368756e6b5f32")


def test_a_record_is_pinned_byte_for_byte():
    assert encode(Record(7, KIND_WRITE, "t", "chunk_0", 4096, 3, b"abc")) == GOLDEN
    assert len(GOLDEN) == HEAD_LEN + 1 + 7 + 3


def test_a_whole_blob_record_is_pinned_and_the_only_one_of_version_2():
    """Version 2 added KIND_BLOB: its records carry the version-2 magic; records of the
    other kinds keep version 1's bytes, so a version-1 journal replays as it always did."""
    rec = Record(9, KIND_BLOB, "t", "chunk_2", 0, 1 << 20, b"", 0x1122334455667788)
    assert encode(rec) == GOLDEN_BLOB
    assert GOLDEN_BLOB.startswith(MAGIC_V2) and GOLDEN.startswith(MAGIC)
    for kind in (KIND_WRITE, KIND_ZERO, KIND_SIZE):
        assert encode(Record(1, kind, "t", "n", 0, 1, b"x" if kind == KIND_WRITE else b"")
                      ).startswith(MAGIC)


GOLDEN_TABLE = [bytes.fromhex(h) for h in (
    "46465357414c00030b000000000000000500010005000000030000000000000000000000000000000000"
    "00000000000045cbfcc7fb46bfee74612e747874",
    "46465357414c00030c000000000000000700010003000000020000000000000000000000000000000000"
    "000000000000c7c626fceeb38c2774610062",
    "46465357414c00030d00000000000000080001000000000000002a36fe9c971709000000000000009"
    "0f73d548f9c8025ac5a05a96efe2e53746368756e6b5f310066")]


def test_table_records_are_pinned_and_the_only_ones_of_version_3(tmp_path):
    """Version 3 added a tag's table changes (a user blob made, renamed or exchanged; a
    reset of some blobs, its names as data): their records carry the version-3 magic, the
    others keep their bytes, and each replays as it was appended."""
    recs = [Record(11, KIND_CREATE, "t", "a.txt", 3, 0, b""),
            Record(12, KIND_RENAME, "t", "a\0b", RENAME_EXCHANGE, 0, b""),
            Record(13, KIND_RESET, "t", "", 1_700_000_000_000_000_000, 9, b"chunk_1\0f")]
    assert [encode(r) for r in recs] == GOLDEN_TABLE
    assert all(g.startswith(MAGIC_V3) for g in GOLDEN_TABLE)
    j = Journal(str(tmp_path))
    for r in [Record(1, KIND_CREATE, "t", "a", 1, 0, b""), Record(2, KIND_UNLINK, "t", "a", 1, 0, b""),
              Record(3, KIND_RENAME, "t", "a\0b", RENAME_REPLACE, 0, b""),
              Record(4, KIND_RESET, "t", "", 5, 0, b""), recs[2]]:
        j.append(r.kind, r.tag, r.name, r.off, r.length, r.data)
    j.close()
    got = [(r.seq, r.kind, r.name, r.off, r.data) for r in Journal(str(tmp_path)).replay()]
    assert got == [(1, KIND_CREATE, "a", 1, b""), (2, KIND_UNLINK, "a", 1, b""),
                   (3, KIND_RENAME, "a\0b", RENAME_REPLACE, b""), (4, KIND_RESET, "", 5, b""),
                   (5, KIND_RESET, "", 1_700_000_000_000_000_000, b"chunk_1\0f")]
    for bad in GOLDEN_TABLE:  # under an older magic, a table record is not a record
        for magic in (MAGIC, MAGIC_V2):
            with pytest.raises(CorruptionError):
                decode_head(magic + bad[8:HEAD_LEN])


def test_a_kind_under_the_wrong_version_does_not_verify(tmp_path):
    """A KIND_BLOB record under the version-1 magic (or a write under version 2) is not a
    record: the replay stops there."""
    blob = bytearray(GOLDEN_BLOB)
    blob[:8] = MAGIC
    write = bytearray(encode(Record(2, KIND_WRITE, "t", "chunk_0", 0, 3, b"abc")))
    write[:8] = MAGIC_V2
    for bad in (blob, write):
        path = tmp_path / bad[:8].hex()
        _fill(str(path), RECS[:1]).close()
        with open(os.path.join(path, segment_name(1)), "ab") as f:
            f.write(bytes(bad))
        assert [r.seq for r in Journal(str(path)).replay()] == [1]


def test_whole_blob_records_replay_with_their_checksum(tmp_path):
    j = _fill(str(tmp_path), RECS[:1])
    assert j.append(KIND_BLOB, "t", "chunk_3", 0, 4096, digest=12345) == 2
    j.append(*RECS[1])
    j.sync()
    j.close()
    got = list(Journal(str(tmp_path)).replay())
    assert [(r.seq, r.kind, r.name, r.length, r.digest, r.data) for r in got] == [
        (1, KIND_WRITE, "chunk_0", 3, 0, b"abc"), (2, KIND_BLOB, "chunk_3", 4096, 12345, b""),
        (3, KIND_ZERO, "chunk_1", 100, 0, b"")]


def test_a_record_the_caller_refuses_ends_the_replay_and_what_follows_is_set_aside(tmp_path):
    """``accept`` returning False (a whole-blob record whose file was lost) is a record that
    does not verify: the replay stops there and the journal is cut before it; the records
    after it are kept in ``writes/damaged/`` (never deleted) and their seqs never handed out
    again."""
    j = _fill(str(tmp_path), RECS[:1])
    j.append(KIND_BLOB, "t", "chunk_3", 0, 4096, digest=1)
    j.append(*RECS[1])
    j.roll()
    j.append(*RECS[2])
    j.sync()
    j.close()
    seen = []

    def accept(rec: Record) -> bool:
        seen.append(rec.seq)
        return rec.kind != KIND_BLOB

    j = Journal(str(tmp_path))
    assert [r.seq for r in j.replay(accept=accept)] == [1]
    assert seen == [1, 2]
    assert sorted(os.listdir(tmp_path)) == [segment_name(1), segment_name(5)]  # 5: next seq
    aside = j.set_aside
    assert aside is not None and aside.segment == segment_name(1) and aside.records == 3
    assert aside.blobs == [("t", 2)] and "file" in aside.reason
    assert sorted(os.listdir(damaged_dir(tmp_path))) == sorted(aside.files) == [
        f"{segment_name(1)}.from-{aside.pos}", segment_name(4)]
    assert j.append(KIND_ZERO, "t", "chunk_0", 0, 1) == 5
    j.sync()
    j.close()
    assert [(r.seq, r.kind) for r in Journal(str(tmp_path)).replay()] == [
        (1, KIND_WRITE), (5, KIND_ZERO)]


def test_a_large_write_is_appended_uncopied_and_replays_whole(tmp_path):
    data = os.urandom(3 << 20)
    j = _fill(str(tmp_path), RECS[:1])
    j.append(KIND_WRITE, "t", "chunk_9", 7, len(data), memoryview(data))
    j.sync()
    j.close()
    got = list(Journal(str(tmp_path)).replay())
    assert got[-1].data == data and got[-1].off == 7


def test_rolling_twice_with_nothing_between_keeps_one_empty_segment(tmp_path):
    """Two checkpoints in a row (or a checkpoint, then an unmount with no write between)
    roll the journal twice: the second has nothing to roll. It created the same segment
    again (EEXIST), and that checkpoint failed."""
    j = _fill(str(tmp_path), RECS[:2])
    j.roll()
    j.roll()
    j.append(*RECS[2])
    j.sync()
    j.roll()
    j.close()
    assert [r.seq for r in Journal(str(tmp_path)).replay()] == [1, 2, 3]


def _fill(path: str, records: list[tuple]) -> Journal:
    j = Journal(path)
    list(j.replay())
    for rec in records:
        j.append(*rec)
    j.sync()
    return j


RECS = [(KIND_WRITE, "t", "chunk_0", 0, 3, b"abc"), (KIND_ZERO, "t", "chunk_1", 5, 100),
        (KIND_SIZE, "t", "", 0, 12345), (KIND_WRITE, "u", "u:1", 9, 2, b"zz")]


def test_replay_gives_back_every_record_in_order(tmp_path):
    _fill(str(tmp_path), RECS).close()
    got = list(Journal(str(tmp_path)).replay())
    assert [r.seq for r in got] == [1, 2, 3, 4]
    assert [(r.kind, r.tag, r.name, r.off, r.length, r.data) for r in got] == [
        (k, t, n, o, ln, d[0] if d else b"") for k, t, n, o, ln, *d in RECS]


def test_replay_after_advance_keeps_every_record(tmp_path):
    """A folded blob file names a seq past records of other blobs still in the journal
    (a crash inside a checkpoint, or a clone's folds): advancing first must not hide them."""
    _fill(str(tmp_path), RECS).close()
    j = Journal(str(tmp_path))
    j.advance(3)
    assert len(list(j.replay())) == 4
    assert j.append(KIND_ZERO, "t", "chunk_0", 0, 1) == 5
    j.close()
    assert [r.seq for r in Journal(str(tmp_path)).replay()] == [1, 2, 3, 4, 5]
    j = Journal(str(tmp_path))
    j.advance(40)
    list(j.replay())
    assert j.append(KIND_ZERO, "t", "chunk_0", 0, 1) == 41  # never a seq a blob file named


def test_a_torn_tail_is_cut_and_appends_go_on_after_the_last_good_record(tmp_path):
    _fill(str(tmp_path), RECS).close()
    seg = os.path.join(tmp_path, segment_name(1))
    size = os.path.getsize(seg)
    with open(seg, "r+b") as f:
        f.truncate(size - 1)
    j = Journal(str(tmp_path))
    assert [r.seq for r in j.replay()] == [1, 2, 3]
    assert j.append(KIND_ZERO, "t", "chunk_0", 0, 1) == 4
    j.sync()
    j.close()
    assert [r.seq for r in Journal(str(tmp_path)).replay()] == [1, 2, 3, 4]


def test_a_damaged_record_ends_the_replay_and_what_follows_is_kept_aside(tmp_path):
    j = _fill(str(tmp_path), RECS[:2])
    j.roll()
    j.append(*RECS[2])
    j.sync()
    j.close()
    seg = os.path.join(tmp_path, segment_name(1))
    first_len = len(encode(Record(1, *RECS[0])))
    with open(seg, "rb") as f:
        second = f.read()[first_len:]
    with open(seg, "r+b") as f:  # a bit of the second record's head
        f.seek(first_len + 40)
        f.write(b"\xff")
    j = Journal(str(tmp_path))
    assert [r.seq for r in j.replay()] == [1]
    assert os.path.getsize(seg) == first_len
    kept = damaged_dir(tmp_path)
    assert sorted(os.listdir(kept)) == [f"{segment_name(1)}.from-{first_len}", segment_name(3)]
    with open(os.path.join(kept, f"{segment_name(1)}.from-{first_len}"), "rb") as f:
        assert f.read() == second[:40] + b"\xff" + second[41:]  # the bytes as they were
    assert j.set_aside.records == 1 and "checksum" in j.set_aside.reason  # seq 3 verifies
    assert j.append(*RECS[3]) == 4
    assert sorted(os.listdir(tmp_path)) == [segment_name(1), segment_name(4)]


def test_a_write_whose_data_does_not_verify_ends_the_replay_and_the_rest_is_kept(tmp_path):
    """Its blob is not known damaged: a stop like any record that does not verify, with the
    records after it kept aside. Told that the blob is damaged, the replay gives it out
    without its data and goes on."""
    _fill(str(tmp_path), RECS).close()
    seg = os.path.join(tmp_path, segment_name(1))
    with open(seg, "rb") as f:
        raw = f.read()
    at = len(encode(Record(1, *RECS[0]))) - 1  # the first write's data: b"abc" -> b"abX"
    with open(seg, "r+b") as f:
        f.seek(at)
        f.write(b"X")
    j = Journal(str(tmp_path / "copy"))  # (the same bytes, told of the damaged blob)
    os.makedirs(tmp_path / "copy", exist_ok=True)
    with open(os.path.join(tmp_path / "copy", segment_name(1)), "wb") as f:
        f.write(raw[:at] + b"X" + raw[at + 1:])
    got = list(j.replay(damaged=lambda rec: rec.name == "chunk_0"))
    assert [r.seq for r in got] == [1, 2, 3, 4] and got[0].bad_data and got[0].data == b""
    j = Journal(str(tmp_path))
    assert list(j.replay()) == []
    assert j.set_aside is not None and j.set_aside.records == 4  # the damaged one too
    assert j.append(*RECS[0]) == 5


def test_a_torn_tail_followed_by_zeros_or_a_partial_record_is_cut_not_kept(tmp_path):
    """What a power loss leaves (found by review): the last records' pages lost, zeros or a
    cut-short record after them: no whole run verifies there, so nothing is kept."""
    for tail in (bytes(300), encode(Record(9, *RECS[0]))[:30]):
        path = tmp_path / f"t{len(tail)}"
        path.mkdir()
        _fill(str(path), RECS).close()
        seg = os.path.join(path, segment_name(1))
        size = os.path.getsize(seg)
        with open(seg, "r+b") as f:  # the last record's data lost, then the junk
            f.seek(size - 1)
            f.write(b"\x00" + tail)
        j = Journal(str(path))
        assert [r.seq for r in j.replay()] == [1, 2, 3]
        assert j.set_aside is None and not os.path.exists(damaged_dir(path))


def test_a_record_hidden_in_a_writes_data_does_not_move_the_seqs(tmp_path):
    """A set-aside keeps every whole record found after the stop (keeping too much costs
    only disk), but a seq near the limit — a record inside a write's data, never one this
    journal handed out — changes nothing of what is handed out next."""
    hidden = encode(Record((1 << 62) - 1, KIND_ZERO, "t", "chunk_9", 0, 1))
    j = _fill(str(tmp_path), [RECS[0], (KIND_WRITE, "t", "chunk_5", 0, len(hidden) + 4,
                                        hidden + b"tail"), RECS[2]])
    j.close()
    seg = os.path.join(tmp_path, segment_name(1))
    with open(seg, "r+b") as f:  # the second record's head
        f.seek(len(encode(Record(1, *RECS[0]))) + 20)
        f.write(b"\xff")
    j = Journal(str(tmp_path))
    assert [r.seq for r in j.replay()] == [1]
    assert j.set_aside is not None and j.set_aside.records == 2  # seq 3 and the hidden one
    assert j.append(*RECS[1]) == 4


def test_a_last_write_whose_data_does_not_verify_is_a_torn_tail(tmp_path):
    _fill(str(tmp_path), RECS).close()
    seg = os.path.join(tmp_path, segment_name(1))
    size = os.path.getsize(seg)
    with open(seg, "r+b") as f:  # the last record's data (b"zz") lost to a crash
        f.seek(size - 1)
        f.write(b"\x00")
    j = Journal(str(tmp_path))
    assert [r.seq for r in j.replay()] == [1, 2, 3]
    assert os.path.getsize(seg) == size - len(encode(Record(4, *RECS[3])))
    assert j.set_aside is None and not os.path.exists(damaged_dir(tmp_path))


@settings(max_examples=300, deadline=None)
@given(junk=st.binary(max_size=4 * HEAD_LEN), cut=st.integers(0, 200),
       flip=st.integers(0, 1 << 12))
def test_hostile_segments_replay_a_prefix_and_never_raise(tmp_path_factory, junk, cut, flip):
    path = str(tmp_path_factory.mktemp("j") / "journal")
    _fill(path, RECS).close()
    seg = os.path.join(path, segment_name(1))
    with open(seg, "rb") as f:
        raw = bytearray(f.read())
    raw[flip % len(raw)] ^= 0x41
    with open(seg, "wb") as f:
        f.write(bytes(raw[:max(0, len(raw) - cut)]) + junk)
    j = Journal(path)
    got = list(j.replay())
    j.close()
    good = [encode(Record(i + 1, *r)) for i, r in enumerate(RECS)]
    for i, rec in enumerate(got):  # every record replayed is one that was written, in order
        assert encode(rec) == good[i]


def test_concurrent_syncs_while_appending_and_rolling_never_fail(tmp_path):
    """A checkpoint's sync and a client's fsync overlap: neither may fail, and each covers
    every record appended before it was called."""
    import threading

    j = Journal(str(tmp_path))
    list(j.replay())
    errors: list[BaseException] = []
    stop = threading.Event()

    def syncer() -> None:
        while not stop.is_set():
            try:
                j.sync()
            except BaseException as exc:  # the test collects every failure
                errors.append(exc)
                return

    threads = [threading.Thread(target=syncer) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        for i in range(3000):
            j.append(KIND_ZERO, "t", "chunk_0", i, 1)
            if i % 50 == 0:
                j.roll()
    finally:
        stop.set()
        for t in threads:
            t.join()
    j.sync()
    j.close()
    assert not errors, errors[0]
    assert len(list(Journal(str(tmp_path)).replay())) == 3000


def test_a_record_claiming_a_huge_seq_ends_the_replay_and_writes_go_on(tmp_path):
    """A record with valid checksums and seq 2**64-1 is not replayed: it would leave no seq
    the next append could encode (found by the torture suite's fuzzing)."""
    _fill(str(tmp_path), RECS[:1]).close()
    seg = os.path.join(tmp_path, segment_name(1))
    with open(seg, "ab") as f:
        f.write(encode(Record((1 << 64) - 1, KIND_ZERO, "t", "chunk_0", 0, 1)))
    j = Journal(str(tmp_path))
    assert [r.seq for r in j.replay()] == [1]
    assert j.append(KIND_ZERO, "t", "chunk_0", 0, 1) == 2
    j.close()


def test_a_write_records_data_reads_back_verified_until_its_segment_is_trimmed(tmp_path):
    """What a spilled extent of a dirty blob reads: the data where ``append`` (or a replay)
    says it lies, checked against the record's checksum; gone with its trimmed segment."""
    j = Journal(str(tmp_path))
    j.append(KIND_WRITE, "t", "chunk_0", 0, 5, b"hello")
    first = j.last_data
    j.append(KIND_ZERO, "t", "chunk_0", 0, 9)
    j.append(KIND_WRITE, "tag-ü", "u:3", 7, 70000, b"w" * 70000)  # past the inline limit
    second = j.last_data
    assert j.read_data(*first[:2], 5, first[2]) == b"hello"
    assert j.read_data(*second[:2], 70000, second[2]) == b"w" * 70000
    with pytest.raises(CorruptionError):
        j.read_data(first[0], first[1], 5, first[2] ^ 1)  # another checksum: not these bytes
    j.sync()
    j.close()
    j2 = Journal(str(tmp_path))  # a replay says the same places
    got = [(r.segment, r.data_pos, r.data_digest) for r in j2.replay() if r.kind == KIND_WRITE]
    assert got == [first, second]
    j2.roll()
    j2.append(KIND_WRITE, "t", "chunk_1", 0, 3, b"new")
    third = j2.last_data
    j2.sync()
    assert len(j2.trim(j2.last_seq - 1)) == 1
    with pytest.raises(SegmentGone):
        j2.read_data(*first[:2], 5, first[2])
    assert j2.read_data(*third[:2], 3, third[2]) == b"new"
    path = os.path.join(str(tmp_path), segment_name(third[0]))
    with open(path, "r+b") as f:  # the store's contents changed under the journal
        f.seek(third[1])
        f.write(b"N")
    with pytest.raises(CorruptionError):
        j2.read_data(*third[:2], 3, third[2])


def test_a_segment_that_is_a_link_is_refused_and_its_target_left_alone(tmp_path):
    """The journal (and the dirty files) open nothing through a symbolic link: a segment
    replaced by one had its target cut to nothing at the replay and journal records
    appended to it."""
    from faultfs.errors import InvalidInput
    from faultfs.store.dirty import DirtyFiles

    victim = tmp_path.parent.parent / "victim"
    victim.write_bytes(b"not the store's")
    os.symlink(victim, tmp_path / segment_name(1))
    with pytest.raises(InvalidInput, match="symbolic link"):
        list(Journal(str(tmp_path)).replay())
    assert victim.read_bytes() == b"not the store's"
    files = DirtyFiles(str(tmp_path.parent.parent))
    files.write("t", "b", b"x" * 100, 1)
    os.symlink(victim, files.direct_path("t", 7))
    with pytest.raises(InvalidInput, match="symbolic link"):
        files.ops.open(files.direct_path("t", 7), os.O_RDONLY)
