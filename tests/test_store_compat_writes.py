"""A store whose writes an earlier faultfs made (83e4241, before resets and user blob changes
became journal records) mounts and reads byte-exact, and is carried on without a manual step.

The fixture (``tests/data/store-writes-83e4241.tar.gz``) was made through a mount of that
commit, by ``tests/data/make_store_writes.py``: tag ``field`` over a 70,000-byte local file in
4 KiB chunks, some chunks staged; writes folded by an unmount (a partial chunk write, a write
across three chunks, a whole chunk, the view grown past the source, three user blobs); then
a clone ``snap``, a rename and an unlink of user blobs, more writes, a reset of one chunk,
writes after it, the view cut, a user blob appended to, the clone written — and the daemon
killed with kill -9, so those are journal records no checkpoint folded. ``expected.json``
holds the sha256 of every name of both tags as the old mount read them just before the kill.
The source is put back where it was (a new version of it: clean chunks fault again).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import tarfile

import pytest

pytestmark = pytest.mark.mount

FIXTURE = pathlib.Path(__file__).parent / "data" / "store-writes-83e4241.tar.gz"
SOURCE_DIR = "/tmp/faultfs-fixture-writes"  # where the fixture's source was
SOURCE = bytes((i * 7 + i // 251) & 0xFF for i in range(70000))


@pytest.fixture
def old_store(tmp_path):
    with tarfile.open(FIXTURE) as tar:
        tar.extractall(tmp_path, filter="data")
    os.makedirs(SOURCE_DIR, exist_ok=True)
    with open(os.path.join(SOURCE_DIR, "field.bin"), "wb") as f:
        f.write(SOURCE)
    yield tmp_path
    shutil.rmtree(SOURCE_DIR, ignore_errors=True)


def names(mnt: str, also: dict[str, str] | None = None) -> dict[str, str]:
    """sha256 of every name listed, and of the names in ``also`` (a chunk past the source
    that holds no writes is a hole: found by name, not listed since the listing change)."""
    listed = {f"{tag}/{name}" for tag in ("field", "snap")
              for name in os.listdir(os.path.join(mnt, tag))}
    unlisted = set(also or ()) - listed
    assert all(n.split("/")[1].startswith("chunk_") for n in unlisted), unlisted
    out = {}
    for name in sorted(listed | unlisted):
        with open(os.path.join(mnt, name), "rb") as f:
            out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def test_a_store_an_earlier_faultfs_wrote_and_was_killed_over_reads_byte_exact(mounter,
                                                                             old_store):
    expected = json.loads((old_store / "expected.json").read_text())
    store = str(old_store / "store")
    m = mounter(store=store)
    assert names(m.path, expected) == expected, "the old store's bytes, as the old mount read them"
    with open(os.path.join(m.tag("field"), "notes.txt"), "a") as f:
        f.write("and one more line\n")  # the store takes writes on
    m.umount()  # folds the old journal's records with the new ones
    m2 = mounter(store=store)
    got = names(m2.path, expected)
    appended = hashlib.sha256(b"first user blob\nappended, in the journal only\n"
                              b"and one more line\n").hexdigest()
    assert got == {**expected, "field/notes.txt": appended}
