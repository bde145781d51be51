"""Reads of dirty blobs (``engine/writes/reads.py``): a spilled write read back from a journal
segment that was trimmed under the read (its blob folded meanwhile) is read again from the
blob's new state; a read that keeps finding it so is EIO, never zeros. The trimmed segment is
a rule of the file operations (``FaultyOps``: its open finds no file)."""

from __future__ import annotations

import errno

import pytest
import trio

from faultfs.errors import FaultfsError
from faultfs.store.blobstore import BlobStore
from faultfs.testing.fakes import CS
from faultfs.testing.writing import JOURNAL, writing_engine


def _trimmed(path: str) -> None:
    raise FileNotFoundError(errno.ENOENT, "trimmed under the read", path)


@pytest.mark.parametrize("times", [1, None], ids=["once", "always"])
def test_a_read_whose_spilled_write_lost_its_segment_reads_again(tmp_path, times):
    data, _src, eng, tag, ops = writing_engine(BlobStore(str(tmp_path / "store")), 3)
    want = bytearray(data[:2 * CS])
    want[10:110] = b"x" * 100

    async def main():
        await eng.write_view(tag, 10, b"x" * 100)
        eng.writes.spill()  # its bytes are read back from the journal from now on
        gone = ops.when("open", JOURNAL, _trimmed, times=times)
        if times == 1:
            assert bytes(await eng.read_view(tag, 0, 2 * CS)) == want
            assert (gone.acted, gone.matched) == (1, 2), "read once more after it was gone"
        else:
            with pytest.raises(FaultfsError) as err:
                await eng.read_view(tag, 0, 200)
            assert err.value.errno == errno.EIO

    trio.run(main)
    eng.close()
