"""``faultfs export`` to S3: a multipart upload that resumes after an interrupt with the parts
S3 already holds, never shows a partial object, starts over when the tag changed, and keeps
its state outside the mount."""

from __future__ import annotations

import errno
import os

import pytest

from faultfs import export as exp
from faultfs.errors import InvalidInput

pytestmark = [pytest.mark.mount, pytest.mark.s3]

MiB = 1 << 20
UPLOAD_PART = exp._upload_part  # the real one, under every interrupting stand-in


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@pytest.fixture
def small_parts(monkeypatch, tmp_path):
    monkeypatch.setattr(exp, "PART_BYTES", 5 * MiB)  # S3's smallest part but the last
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))


class Interrupted(BaseException):
    """The export stops here, as at a Ctrl-C or a kill (nothing of it cleans up)."""


def interrupt_after(monkeypatch, parts: int) -> list[int]:
    calls: list[int] = []

    def dies(client, bucket, key, upload, number, data):
        calls.append(number)
        if len(calls) > parts:
            raise Interrupted
        return UPLOAD_PART(client, bucket, key, upload, number, data)

    monkeypatch.setattr(exp, "_upload_part", dies)
    return calls


def test_an_interrupted_export_to_s3_resumes_with_the_parts_s3_holds(
        s3_env, s3_client, make_bucket, mounter, sample, monkeypatch, small_parts):
    m = mounter(sample(17 * MiB + 123))
    tag = m.tag("field")
    with open(os.path.join(tag, "field.bin"), "r+b") as f:
        f.seek(12 * MiB)
        f.write(b"written")
    current = read(os.path.join(tag, "field.bin"))
    bucket = make_bucket()
    dest = f"s3://{bucket}/exports/field.bin"
    interrupt_after(monkeypatch, 2)
    with pytest.raises(Interrupted):
        exp.export(tag, dest, progress=False)
    assert "Contents" not in s3_client.list_objects_v2(Bucket=bucket), "no partial object"
    assert os.path.exists(exp.remote_state_path(dest))
    calls = interrupt_after(monkeypatch, 100)
    report = exp.export(tag, dest, progress=False)
    assert report.resumed_from == 10 * MiB and calls == [3, 4]
    assert report.written == len(current) - 10 * MiB
    assert s3_client.get_object(Bucket=bucket, Key="exports/field.bin")["Body"].read() == current
    assert not os.path.exists(exp.remote_state_path(dest))
    assert not s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads")
    with pytest.raises(InvalidInput) as info:  # done: an existing DEST is never replaced ...
        exp.export(tag, dest, progress=False)
    assert info.value.errno == errno.EEXIST
    assert exp.export(tag, dest, progress=False, force=True).resumed_from == 0  # ... unforced


def test_an_export_of_a_changed_tag_starts_over_and_drops_the_old_upload(
        s3_env, s3_client, make_bucket, mounter, sample, monkeypatch, small_parts):
    m = mounter(sample(11 * MiB))
    tag = m.tag("field")
    view = os.path.join(tag, "field.bin")
    bucket = make_bucket()
    dest = f"s3://{bucket}/field.bin"
    interrupt_after(monkeypatch, 1)
    with pytest.raises(Interrupted):
        exp.export(tag, dest, progress=False)
    with open(view, "r+b") as f:  # the tag changes between the two runs
        f.write(b"CHANGED")
    interrupt_after(monkeypatch, 100)
    report = exp.export(tag, dest, progress=False)
    assert report.resumed_from == 0 and report.written == 11 * MiB
    assert s3_client.get_object(Bucket=bucket, Key="field.bin")["Body"].read() == read(view)
    assert not s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads"), "old one aborted"


def test_an_upload_that_is_gone_starts_over(
        s3_env, s3_client, make_bucket, mounter, sample, monkeypatch, small_parts):
    m = mounter(sample(6 * MiB))
    tag = m.tag("field")
    bucket = make_bucket()
    dest = f"s3://{bucket}/field.bin"
    interrupt_after(monkeypatch, 1)
    with pytest.raises(Interrupted):
        exp.export(tag, dest, progress=False)
    for upload in s3_client.list_multipart_uploads(Bucket=bucket)["Uploads"]:  # a lifecycle rule
        s3_client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"],
                                         UploadId=upload["UploadId"])
    interrupt_after(monkeypatch, 100)
    assert exp.export(tag, dest, progress=False).resumed_from == 0
    assert s3_client.get_object(Bucket=bucket, Key="field.bin")["Body"].read() == read(
        os.path.join(tag, "field.bin"))
