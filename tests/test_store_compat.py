"""A store written by an earlier faultfs (d53de6a, before the package layout of DESIGN §1)
mounts and serves its staged bytes unchanged: the on-disk formats did not move.

The fixture (``tests/data/store-d53de6a.tar.gz``) holds tag ``field`` over a 12388-byte local
file in 4 KiB chunks, with chunks 0 and 3 staged; the source itself is gone, so every byte
served comes from the store.
"""

from __future__ import annotations

import errno
import hashlib
import os
import pathlib
import tarfile

import pytest
import trio

from faultfs.errors import FaultfsError
from faultfs.store.blobstore import BlobStore
from faultfs.testing.fakes import engine_for, payload

FIXTURE = pathlib.Path(__file__).parent / "data" / "store-d53de6a.tar.gz"
SOURCE = payload(3 * 4096 + 100)  # what the fixture's source held


@pytest.fixture
def old_store(tmp_path):
    with tarfile.open(FIXTURE) as tar:
        tar.extractall(tmp_path, filter="data")
    return BlobStore(str(tmp_path / "store"))


def digests(root: str) -> dict[str, str]:
    out = {}
    for base, _, files in os.walk(root):
        for name in files:
            path = os.path.join(base, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def test_an_older_store_recovers_and_serves_its_staged_blobs(old_store):
    before = digests(os.path.join(old_store.root, "tags"))
    engine = engine_for(old_store)
    [tag] = engine.recover()
    assert tag.name == "field" and tag.view_name == "field.bin"
    assert tag.layout.chunk_size == 4096 and tag.layout.size == len(SOURCE)
    assert [engine.is_staged(tag, i) for i in range(4)] == [True, False, False, True]

    async def reads():
        assert bytes(await engine.read_blob(tag, 0, 0, 4096)) == SOURCE[:4096]
        tail = SOURCE[3 * 4096:]
        assert bytes(await engine.read_blob(tag, 3, 0, 4096)) == tail + bytes(4096 - len(tail))
        with pytest.raises(FaultfsError) as info:  # never staged, source gone: EIO, not zeros
            await engine.read_blob(tag, 1, 0, 10)
        assert info.value.errno == errno.EIO

    trio.run(reads)
    engine.close()
    c = engine.stats.counters
    assert c["source_reads"] == 0 and c["hits"] == 2
    assert digests(os.path.join(old_store.root, "tags")) == before, "recovery rewrote the store"
