"""faultfs warm and checkpoint show, against a plain directory tree shaped like a mount
(DESIGN §7): files whose ``user.faultfs.staged`` attribute is "0" stand for unstaged blobs, "1" for staged
ones."""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from faultfs.cli import checkpoint as checkpoint_cli
from faultfs.cli import warm as warm_cli
from faultfs.core.coord import StreamCoordinate
from faultfs.errors import CorruptionError, FaultfsError, InvalidInput, SourceError
from faultfs.store.metadata import DualMetadataManager
from faultfs.warm import default_state_path, tag_blobs, warm

REPO = Path(__file__).resolve().parent.parent
CHUNK = 4096


def make_mount(root: Path, tags: dict[str, dict]) -> Path:
    """tags: name -> {"prefix": str, "n": int, "staged": set of indices}."""
    (root / ".faultfs" / "registry").mkdir(parents=True)
    (root / ".faultfs" / "stats").write_text("{}")
    for name, spec in tags.items():
        d = root / name
        d.mkdir()
        for i in range(spec["n"]):
            p = d / f"{spec['prefix']}{i}"
            staged = i in spec.get("staged", ())
            if staged:
                p.write_bytes(b"\x01" * CHUNK)
            else:
                with p.open("wb") as f:
                    f.truncate(CHUNK)  # like the mount: not staged, no bytes yet
            os.setxattr(p, "user.faultfs.staged", b"1" if staged else b"0")
        with (d / f"{name}.bin").open("wb") as f:  # the whole-object view
            f.truncate(CHUNK * spec["n"])
        with (d / "page:0").open("wb") as f:
            f.truncate(CHUNK)
        (d / ".pagemap").write_text("pagemap\npage_size=4096\n")
    return root


class Recorder:
    """A BlobReader that records what it reads and can fail at the n-th read."""

    def __init__(self, fail_at=None, exc=KeyboardInterrupt):
        self.read = []
        self.fail_at, self.exc = fail_at, exc

    def __call__(self, path, size, buf):
        if self.fail_at is not None and len(self.read) == self.fail_at:
            raise self.exc()
        self.read.append(os.path.relpath(path, self.root))
        return size


def recorder(root, **kw):
    r = Recorder(**kw)
    r.root = str(root)
    return r


@pytest.fixture
def mount(tmp_path):
    return make_mount(
        tmp_path / "mnt",
        {
            "alpha": {"prefix": "chunk_", "n": 12, "staged": {0, 5}},
            "beta": {"prefix": "", "n": 3, "staged": set()},
            "gamma": {"prefix": "chunk_", "n": 2, "staged": {0, 1}},
        },
    )


def test_tag_blobs_are_indexed_files_of_the_dominant_prefix(tmp_path):
    d = tmp_path / "t"
    d.mkdir()
    for name in ["chunk_0", "chunk_2", "chunk_10", "chunk_1", "data2", "page:3", ".hidden9", "x.bin"]:
        (d / name).write_bytes(b"")
    (d / "sub7").mkdir()
    names = [Path(p).name for _, p in tag_blobs(str(d))]
    assert names == ["chunk_0", "chunk_1", "chunk_2", "chunk_10"]


def test_warm_reads_every_unstaged_blob_once_in_order(mount, tmp_path):
    r = recorder(mount)
    report = warm(mount, tmp_path / "w.meta", progress=False, read_blob=r)
    expected = [f"alpha/chunk_{i}" for i in range(12) if i not in (0, 5)] + ["beta/0", "beta/1", "beta/2"]
    assert r.read == expected
    assert (report.blobs_warmed, report.blobs_skipped, report.blobs_total) == (13, 4, 17)
    assert report.completed
    assert report.resumed_from is None
    with DualMetadataManager.open(tmp_path / "w.meta") as m:
        assert m.coord == StreamCoordinate(shard_id=3, global_row_idx=17)  # past the last tag


def test_default_reader_reads_whole_blobs(mount, tmp_path):
    report = warm(mount / "beta", tmp_path / "w.meta", progress=False)
    assert report.bytes_read == 3 * CHUNK
    assert report.tags == 1


def test_interrupted_warm_resumes_where_it_stopped(mount, tmp_path):
    state = tmp_path / "w.meta"
    first = recorder(mount, fail_at=6)
    with pytest.raises(KeyboardInterrupt):
        warm(mount, state, progress=False, read_blob=first, checkpoint_blobs=1000)
    assert len(first.read) == 6
    second = recorder(mount)
    report = warm(mount, state, progress=False, read_blob=second)
    assert report.resumed_from is not None
    assert report.resumed_from.shard_id == 0
    assert first.read + second.read == [
        f"alpha/chunk_{i}" for i in range(12) if i not in (0, 5)
    ] + ["beta/0", "beta/1", "beta/2"], "nothing read twice, nothing missed"


@pytest.mark.parametrize("change", ["a tag added before it", "a tag forgotten before it"])
def test_a_resume_finds_its_tag_by_name_when_tags_changed(mount, tmp_path, change):
    """Checkpoints named tags by their sorted position: a tag added or forgotten between an
    interrupted warm and its resume made it resume on the wrong tag."""
    state = tmp_path / "w.meta"
    first = recorder(mount, fail_at=11)  # 10 of alpha, then beta/0
    with pytest.raises(KeyboardInterrupt):
        warm(mount, state, progress=False, read_blob=first, checkpoint_blobs=1)
    assert first.read[-1] == "beta/0"
    if change == "a tag added before it":
        make_mount(tmp_path / "extra", {"aaa": {"prefix": "chunk_", "n": 4}})
        os.rename(tmp_path / "extra" / "aaa", mount / "aaa")
    else:
        import shutil

        shutil.rmtree(mount / "alpha")
    second = recorder(mount)
    report = warm(mount, state, progress=False, read_blob=second)
    assert second.read == ["beta/1", "beta/2"], "resumed in beta, after beta/0"
    assert any("resuming at beta" in note for note in report.notes)


def test_a_resume_whose_tag_is_gone_starts_over(mount, tmp_path):
    import shutil

    state = tmp_path / "w.meta"
    with pytest.raises(KeyboardInterrupt):
        warm(mount, state, progress=False, read_blob=recorder(mount, fail_at=11),
             checkpoint_blobs=1)
    shutil.rmtree(mount / "beta")
    second = recorder(mount)
    report = warm(mount, state, progress=False, read_blob=second)
    assert any("is gone; starting over" in note for note in report.notes)
    assert second.read[0] == "alpha/chunk_1"


def test_read_error_is_a_source_error_and_keeps_progress(mount, tmp_path):
    state = tmp_path / "w.meta"
    with pytest.raises(SourceError, match=r"alpha/chunk_3: warm read failed"):
        warm(mount, state, progress=False, read_blob=recorder(mount, fail_at=2, exc=lambda: OSError(5, "Input/output error")))
    second = recorder(mount)
    warm(mount, state, progress=False, read_blob=second)
    assert second.read[0] == "alpha/chunk_3"


WARM_AND_DIE = textwrap.dedent(
    """
    import os, sys
    from faultfs.warm import warm
    root, state, log, die_after = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    n = 0
    def read(path, size, buf):
        global n
        if n == die_after:
            os.kill(os.getpid(), 9)
        os.write(fd, os.path.relpath(path, root).encode() + b"\\n")
        n += 1
        return size
    warm(root, state, progress=False, read_blob=read, checkpoint_blobs=3, checkpoint_seconds=1e9)
    """
)


def test_kill_9_loses_at_most_one_checkpoint_interval(mount, tmp_path):
    state, log = tmp_path / "w.meta", tmp_path / "read.log"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-c", WARM_AND_DIE, str(mount), str(state), str(log)]
    proc = subprocess.run([*cmd, "8"], env=env, check=False)
    assert proc.returncode == -9
    killed_run = log.read_text().split()
    assert len(killed_run) == 8
    r = recorder(mount)
    warm(mount, state, progress=False, read_blob=r)
    everything = [f"alpha/chunk_{i}" for i in range(12) if i not in (0, 5)] + ["beta/0", "beta/1", "beta/2"]
    # checkpoints every 3 blobs done (skipped ones count): some of the 8 are read again, <= 3
    overlap = len(killed_run) + len(r.read) - len(everything)
    assert 0 <= overlap <= 3
    assert killed_run[: len(everything) - len(r.read)] + r.read == everything


def test_completed_warm_starts_over(mount, tmp_path):
    state = tmp_path / "w.meta"
    warm(mount, state, progress=False, read_blob=recorder(mount))
    again = recorder(mount)
    report = warm(mount, state, progress=False, read_blob=again)
    assert "starting over" in report.notes[0]
    assert len(again.read) == 13  # the sparse files are still "unstaged"


def test_warm_of_one_tag_and_bad_targets(mount, tmp_path):
    r = recorder(mount)
    warm(mount / "alpha", tmp_path / "w.meta", progress=False, read_blob=r)
    assert all(p.startswith("alpha/") for p in r.read)
    assert len(r.read) == 10
    with pytest.raises(InvalidInput, match="not a faultfs mount or tag directory"):
        warm(tmp_path, tmp_path / "x.meta", progress=False)
    with pytest.raises(InvalidInput, match="not a directory"):
        warm(mount / "alpha" / "chunk_1", tmp_path / "y.meta", progress=False)


def test_progress_bar_shows_bytes_rate_eta(mount, tmp_path):
    out = io.StringIO()
    warm(mount, tmp_path / "w.meta", progress=True, out=out, read_blob=recorder(mount))
    text = out.getvalue()
    assert text.endswith("\n")
    last = text.rstrip("\n").split("\r")[-1]
    assert "100%" in last
    assert "52.0 KiB/52.0 KiB" in last
    assert "/s ETA " in last
    assert "blobs 17/17 (4 staged)" in last


def test_default_state_path(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    p = default_state_path(tmp_path / "mnt")
    assert Path(p).parent == tmp_path / "cache" / "faultfs"
    assert Path(p).name.startswith("warm-")
    assert p.endswith(".meta")
    assert default_state_path(tmp_path / "mnt" / ".") == p
    assert default_state_path(tmp_path / "other") != p


def test_the_default_checkpoint_is_never_opened_through_a_link(mount, tmp_path, monkeypatch):
    """The default checkpoint lies in the store (or the cache): a link planted there (at the
    checkpoint or its temporary name) is refused, its target untouched."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    state = default_state_path(mount)
    os.makedirs(os.path.dirname(state))
    victim = tmp_path / "victim"
    victim.write_bytes(b"not a checkpoint")
    for planted in (state + ".tmp", state):
        os.symlink(victim, planted)
        with pytest.raises(InvalidInput, match="symbolic link"):
            warm(mount, progress=False, read_blob=recorder(mount))
        assert victim.read_bytes() == b"not a checkpoint"
        os.unlink(planted)
    assert warm(mount, progress=False, read_blob=recorder(mount)).completed


# ---------------------------------------------------------------------------------------------
# the CLI handlers


def parser():
    p = argparse.ArgumentParser(prog="faultfs")
    sub = p.add_subparsers(dest="command", required=True)
    warm_cli.register(sub)
    checkpoint_cli.register(sub)
    return p


def run(argv):
    args = parser().parse_args(argv)
    return args.func(args)


def test_cli_warm(mount, tmp_path, capsys):
    assert run(["warm", str(mount), "--state", str(tmp_path / "w.meta"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "warmed 13 blobs (53248 bytes), 4 already staged, 3 tags" in out
    with pytest.raises(InvalidInput, match="--checkpoint-every"):
        run(["warm", str(mount), "--state", str(tmp_path / "w.meta"), "--checkpoint-every", "0"])


def test_cli_checkpoint_show(tmp_path, capsys):
    meta = tmp_path / "s.meta"
    with DualMetadataManager.open(meta) as m:
        m.commit(1, StreamCoordinate(1, 10, global_row_idx=5), [1, 2])
        m.commit(2, StreamCoordinate(2, 20, global_row_idx=9), [3])
    assert run(["checkpoint", "show", str(meta)]) == 0
    text = capsys.readouterr().out
    assert "slot A @0   valid    epoch 1  batch 1  dedup_count 2" in text
    assert "slot B @64  valid    epoch 2  batch 2  dedup_count 3" in text
    assert "active: B: higher epoch (2 > 1)" in text
    assert "coordinate: shard_id=2  byte_offset=20" in text
    assert "dedup WAL:" in text
    assert "24 bytes, 0 uncommitted bytes" in text

    assert run(["checkpoint", "show", str(meta), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["active"] == "B"
    assert info["coord"]["global_row_idx"] == 9
    assert [s["status"] for s in info["slots"]] == ["valid", "valid"]


def test_cli_checkpoint_show_torn_and_corrupt(tmp_path, capsys):
    meta = tmp_path / "s.meta"
    with DualMetadataManager.open(meta) as m:
        m.commit(1, StreamCoordinate(), [])
    raw = bytearray(meta.read_bytes())
    raw[64 + 40] ^= 0xFF  # tear slot B (the genesis slot) inside its coordinate
    meta.write_bytes(bytes(raw))
    assert run(["checkpoint", "show", str(meta)]) == 0
    text = capsys.readouterr().out
    assert "slot B @64  bad crc (stored" in text
    assert "active: A: slot B is bad crc" in text

    raw[0:4] = b"JUNK"
    meta.write_bytes(bytes(raw))
    with pytest.raises(CorruptionError, match="no valid slot: slot A is bad magic"):
        run(["checkpoint", "show", str(meta), "--json"])
    info = json.loads(capsys.readouterr().out)
    assert info["recoverable"] is False
    assert info["slots"][0]["status"] == "bad magic"

    meta.write_bytes(b"short")
    with pytest.raises(CorruptionError, match="must be 128 bytes, is 5"):
        run(["checkpoint", "show", str(meta)])
    with pytest.raises(FaultfsError, match="no such checkpoint file"):
        run(["checkpoint", "show", str(tmp_path / "missing.meta")])


def test_cli_checkpoint_show_short_wal(tmp_path, capsys):
    meta = tmp_path / "s.meta"
    with DualMetadataManager.open(meta) as m:
        m.commit(1, StreamCoordinate(), [1, 2, 3])
    (tmp_path / "s.meta.dedup").write_bytes(bytes(8))
    with pytest.raises(CorruptionError, match="8 bytes but the checkpoint commits 3 hashes"):
        run(["checkpoint", "show", str(meta)])
    assert "UNRECOVERABLE" in capsys.readouterr().out


def test_cli_checkpoint_needs_a_subcommand():
    with pytest.raises(SystemExit):
        parser().parse_args(["checkpoint"])
