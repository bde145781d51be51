"""The write state's one format (``faultfs.store.writestate``): pinned byte for byte, read
back as written, a state of the format before versions still read, and every damaged
document refused with the same words by a mount and by ``faultfs fsck``."""

from __future__ import annotations

import dataclasses
import errno
import json
import os

import pytest
import trio

from faultfs.errors import CorruptionError, FaultfsError
from faultfs.store.blobstore import BlobStore, encode_component
from faultfs.store.dirty import STATE
from faultfs.store.fsck import WRITE_STATES, fsck
from faultfs.store.writestate import VERSION, WriteState, encode, problem
from faultfs.testing.fakes import CS, ctx_for, engine_for, make_source, payload

STATE_V1 = WriteState(
    view_size=3 * CS + 5, view_seq=41, users={"notes.txt": 3, "b": 1}, next_user=4,
    parted={3}, ancestors=("parent", "grandparent"), voided=7, voided_blobs={"u:1": 9},
    mtime_ns=1_700_000_000_123_456_789,
    damaged_blobs={"chunk_2": {"reason": "a write in the journal does not verify", "size": CS}})

GOLDEN_V1 = (
    b'{\n "ancestors": [\n  "parent",\n  "grandparent"\n ],\n "damaged_blobs": {\n'
    b'  "chunk_2": {\n   "reason": "a write in the journal does not verify",\n'
    b'   "size": 4096\n  }\n },\n "mtime_ns": 1700000000123456789,\n "next_user": 4,\n'
    b' "parted": [\n  3\n ],\n "users": {\n  "b": 1,\n  "notes.txt": 3\n },\n'
    b' "version": 1,\n "view_seq": 41,\n "view_size": 12293,\n "voided": 7,\n'
    b' "voided_blobs": {\n  "u:1": 9\n }\n}')


STATE_V2 = dataclasses.replace(
    STATE_V1, user_attrs={3: [0o600, 978_307_200_000_000_000, 978_307_200_000_000_001],
                          1: [0o755, 5, 6]}, dir_mode=0o700)

GOLDEN_V2 = (
    b'{\n "ancestors": [\n  "parent",\n  "grandparent"\n ],\n "damaged_blobs": {\n'
    b'  "chunk_2": {\n   "reason": "a write in the journal does not verify",\n'
    b'   "size": 4096\n  }\n },\n "dir_mode": 448,\n "mtime_ns": 1700000000123456789,\n'
    b' "next_user": 4,\n "parted": [\n  3\n ],\n "user_attrs": {\n  "1": [\n   493,\n'
    b'   5,\n   6\n  ],\n  "3": [\n   384,\n   978307200000000000,\n'
    b'   978307200000000001\n  ]\n },\n "users": {\n  "b": 1,\n  "notes.txt": 3\n },\n'
    b' "version": 2,\n "view_seq": 41,\n "view_size": 12293,\n "voided": 7,\n'
    b' "voided_blobs": {\n  "u:1": 9\n }\n}')


def test_the_serialised_form_is_pinned_byte_for_byte():
    assert CS == 4096  # (the golden bytes name it)
    assert encode(STATE_V2) == GOLDEN_V2, "format changed: bump the version"
    assert VERSION == 2, "a new version: pin its bytes here, and keep reading versions 1, 2"
    # version 2 without user blob modes and times is version 1 but for its number
    assert encode(STATE_V1) == GOLDEN_V1.replace(b'"version": 1', b'"version": 2')


def test_a_state_version_1_wrote_still_reads():
    """What faultfs wrote before user blobs had modes and times reads as it was: its user
    blobs take 0644 and the tag's time (``TagStates.user_attrs``)."""
    assert WriteState.parse(json.loads(GOLDEN_V1), 0) == STATE_V1
    assert WriteState.parse(json.loads(GOLDEN_V2), 0) == STATE_V2


def test_a_state_reads_back_as_written():
    assert WriteState.parse(json.loads(encode(STATE_V1)), 0) == STATE_V1
    empty = WriteState(view_size=0)
    assert "damaged_blobs" not in json.loads(encode(empty)), "an empty table is absent"
    assert WriteState.parse(json.loads(encode(empty)), 99) == empty


def test_a_state_of_the_format_before_versions_still_reads():
    """What faultfs wrote before the format had a version (no ``version``; ``parted`` and
    ``damaged_blobs`` absent in the oldest) reads with defaults for what it lacks."""
    old = {"view_size": 10, "view_seq": 4, "users": {"a.txt": 1}, "next_user": 2,
           "ancestors": [], "voided": 0, "voided_blobs": {}, "mtime_ns": 5}
    assert WriteState.parse(old, 99) == WriteState(
        view_size=10, view_seq=4, users={"a.txt": 1}, next_user=2, mtime_ns=5)
    assert WriteState.parse({}, 99) == WriteState(view_size=99), "no state: the source's size"


def _v1(**changes: object) -> dict:
    doc = json.loads(encode(STATE_V1))
    doc.update(changes)
    return doc


def _without(name: str) -> dict:
    doc = _v1()
    del doc[name]
    return doc


BIG = 2**64 - 1
CORRUPT = [
    ([], "not a JSON object"),
    ("state", "not a JSON object"),
    ({"view_size": -1}, "field view_size is -1, not an integer in [0, 2**63)"),
    ({"view_size": BIG}, f"field view_size is {BIG}, not an integer in [0, 2**63)"),
    ({"view_size": 2**63}, f"field view_size is {2**63}, not an integer in [0, 2**63)"),
    ({"view_size": "big"}, "field view_size is 'big', not an integer in [0, 2**63)"),
    ({"view_size": 1.5}, "field view_size is 1.5, not an integer in [0, 2**63)"),
    ({"view_size": True}, "field view_size is True, not an integer in [0, 2**63)"),
    ({"view_seq": None}, "field view_seq is None, not an integer in [0, 2**63)"),
    ({"next_user": -2}, "field next_user is -2, not an integer in [0, 2**63)"),
    ({"voided": BIG}, f"field voided is {BIG}, not an integer in [0, 2**63)"),
    ({"mtime_ns": -5}, "field mtime_ns is -5, not an integer in [0, 2**63)"),
    ({"users": []}, "field users is not a table of names"),
    ({"users": {"a.txt": -3}}, "field users.a.txt is -3, not an integer in [0, 2**63)"),
    ({"users": {"a.txt": "1"}}, "field users.a.txt is '1', not an integer in [0, 2**63)"),
    ({"voided_blobs": {"chunk_1": BIG}},
     f"field voided_blobs.chunk_1 is {BIG}, not an integer in [0, 2**63)"),
    ({"ancestors": "parent"}, "field ancestors is not a list of tag names"),
    ({"ancestors": ["parent", 7]}, "field ancestors is not a list of tag names"),
    ({"parted": {"1": 1}}, "field parted is not a list of user blob ids"),
    ({"parted": [1, -1]}, "field parted is -1, not an integer in [0, 2**63)"),
    ({"damaged_blobs": []}, "field damaged_blobs is not a table of blob names"),
    ({"damaged_blobs": {"chunk_1": {}}}, "field damaged_blobs gives chunk_1 no reason"),
    ({"damaged_blobs": {"chunk_1": {"reason": "r", "size": -1}}},
     "field damaged_blobs.chunk_1.size is -1, not an integer in [0, 2**63)"),
    (_v1(version=3), "version 3 is not one this faultfs reads (1, 2)"),
    (_v1(version=0), "version 0 is not one this faultfs reads (1, 2)"),
    (_v1(version="1"), "version '1' is not one this faultfs reads (1, 2)"),
    (_v1(version=None), "version None is not one this faultfs reads (1, 2)"),
    ({"user_attrs": []}, "field user_attrs is not a table of user blob ids"),
    ({"user_attrs": {"3": [0o644, 1]}}, "field user_attrs gives 3 no [mode, atime, mtime]"),
    ({"user_attrs": {"3": [0o644, -1, 1]}},
     "field user_attrs.3 is -1, not an integer in [0, 2**63)"),
    ({"user_attrs": {"3": [0o170644, 1, 1]}},
     "field user_attrs.3 has mode 0o170644, past 0o7777"),
    ({"user_attrs": {"x": [0o644, 1, 1]}}, "field user_attrs names 'x', not a user blob id"),
    ({"dir_mode": 0o40755}, "field dir_mode is 0o40755, past 0o7777"),
    (_without("view_size"), "field view_size is missing"),
    (_without("users"), "field users is missing"),
    (_without("voided_blobs"), "field voided_blobs is missing"),
    (_v1(view_size=-1), "field view_size is -1, not an integer in [0, 2**63)"),
]


@pytest.mark.parametrize(("doc", "why"), CORRUPT, ids=[w for _, w in CORRUPT])
def test_a_damaged_state_is_refused_with_the_exact_error(doc, why):
    with pytest.raises(CorruptionError) as err:
        WriteState.parse(doc, 0)
    assert err.value.message == why
    assert problem(doc) == why


def test_fsck_and_a_mount_say_the_same_of_every_damaged_state(tmp_path):
    """fsck's verdict on each damaged state is the mount's, word for word: the mount keeps
    the tag up and refuses its writes (EIO) naming it; fsck reports it damaged and keeps it.
    Neither calls a state fine that the other refuses (fsck once passed ``"view_size": -1``
    that the next mount called damaged)."""
    store = BlobStore(str(tmp_path / "store"))
    make_source(payload(2 * CS))
    eng = engine_for(store)
    eng.register(ctx_for(tag="t"))
    eng.close()
    path = os.path.join(store.root, "writes", encode_component("t-", "t"), STATE)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    for doc, why in [*CORRUPT, (_v1(), "")]:
        with open(path, "w") as f:
            json.dump(doc, f)
        found = _write_state_findings(store.root)
        make_source(payload(2 * CS))
        eng = engine_for(store)
        [tag] = eng.recover()

        async def write(eng=eng, tag=tag):
            await eng.writes.write_chunk(tag, 0, 0, b"x")

        if why:
            said = f"write state of t: {why}"
            assert [(f.status, f.reason) for f in found] == [("damaged", said)], doc
            with pytest.raises(FaultfsError) as err:
                trio.run(write)
            assert err.value.errno == errno.EIO
            assert f"its write state is damaged ({said})" in err.value.message
        else:
            assert [f.status for f in found] == ["ok"]
            trio.run(write)
        eng.close()


def _write_state_findings(root: str) -> list:
    found: list = []
    fsck(root, on_finding=lambda f: found.append(f) if f.area == WRITE_STATES else None)
    return found
