"""RecordStream over s3:// (moto on loopback): glob expansion, and O(1) resume that opens only
the resume shard and starts its first range read at the checkpoint offset."""

from __future__ import annotations

import json

import pytest

from faultfs.stream import RecordStream
from faultfs.stream.shards import Shard

pytestmark = pytest.mark.s3


def test_s3_glob_stream_and_resume(s3_env, s3_client, make_bucket, tmp_path, monkeypatch):
    bucket = make_bucket()
    for k in range(3):
        body = "".join(json.dumps({"shard": k, "i": i}) + "\n" for i in range(200))
        s3_client.put_object(Bucket=bucket, Key=f"data/{k}.jsonl", Body=body.encode())
    src = f"s3://{bucket}/data/*.jsonl"
    options = {"client_kwargs": {"endpoint_url": s3_env}, "skip_instance_cache": True}
    state = tmp_path / "s.meta"
    with RecordStream(src, state, fs_options=options) as s:
        it = s.batches(50)
        for _ in range(5):  # 250 records: shard 1, record 50
            batch_id, _ = next(it)
        s.commit(batch_id)
        coord = s.committed_coord
    assert (coord.shard_id, coord.global_row_idx) == (1, 250)

    opened, reads = [], []
    real_open = Shard.open

    def recording_open(self, **kw):
        opened.append(self.path)
        f = real_open(self, **kw)
        real_read = f.read

        def read(n=-1):
            reads.append((self.path, f.tell()))
            return real_read(n)

        f.read = read
        return f

    monkeypatch.setattr(Shard, "open", recording_open)
    with RecordStream(src, state, fs_options=options) as s:
        rest = [json.loads(r) for _, batch in s.batches(64) for r in batch]
    assert rest[0] == {"shard": 1, "i": 50}
    assert len(rest) == 350
    assert opened == [f"{bucket}/data/1.jsonl", f"{bucket}/data/2.jsonl"]
    # the first read starts at the byte before the offset (a line end: the shard unchanged),
    # every later one at or after it: nothing before the offset is read as records
    assert reads[0] == (f"{bucket}/data/1.jsonl", coord.byte_offset - 1)
    assert all(pos >= coord.byte_offset for path, pos in reads[1:] if path.endswith("/1.jsonl"))
