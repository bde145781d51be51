"""`faultfs pagemap set|show` against a plain temporary directory standing in for a tag."""

from __future__ import annotations

import argparse
import errno
import io
import os
import sys

import pytest

from faultfs.cli import pagemap as pagemap_cli
from faultfs.errors import FaultfsError, InvalidInput

GOOD = "pagemap\npage_size=1024\ntotal=1536\na 0 0 400\nd 16 1024 512\n"


def run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="faultfs")
    pagemap_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return args.func(args)


@pytest.fixture
def tag(tmp_path):
    d = tmp_path / "mnt" / "field"
    d.mkdir(parents=True)
    return d


@pytest.fixture
def map_file(tmp_path):
    def write(text: str | bytes):
        p = tmp_path / "map.txt"
        p.write_bytes(text.encode() if isinstance(text, str) else text)
        return str(p)

    return write


def test_set_writes_the_text_verbatim(tag, map_file):
    assert run("pagemap", "set", str(tag), map_file(GOOD)) == 0
    assert (tag / ".pagemap").read_text() == GOOD


def test_set_replaces_an_existing_map(tag, map_file):
    (tag / ".pagemap").write_text("pagemap\npage_size=1\n" + "x 0 0 1\n" * 100)
    run("pagemap", "set", str(tag), map_file(GOOD))
    assert (tag / ".pagemap").read_text() == GOOD


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("a 0 0 10\n", "no page_size"),
        ("page_size=1024\nnot an extent\n", "line 2"),
        ("page_size=1024\na 0 0 -1\n", "negative"),
        (f"page_size={2**31}\n", "over 1 GiB"),
        ("page_size=1024\nx/y 0 0 1\n", "'/'"),
        (b"page_size=1024\n\xff 0 0 1\n", "not UTF-8"),
    ],
)
def test_set_refuses_a_bad_map_with_one_line_and_writes_nothing(tag, map_file, text, reason):
    (tag / ".pagemap").write_text(GOOD)
    with pytest.raises(InvalidInput, match=reason) as info:
        run("pagemap", "set", str(tag), map_file(text))
    assert "\n" not in str(info.value)
    assert info.value.errno == errno.EINVAL
    assert (tag / ".pagemap").read_text() == GOOD


def test_set_refuses_an_oversized_file_before_reading_it_all(tag, map_file, monkeypatch):
    monkeypatch.setattr(pagemap_cli, "MAX_PAGEMAP_TEXT", 16)
    with pytest.raises(InvalidInput, match="over 16 bytes"):
        run("pagemap", "set", str(tag), map_file(GOOD))
    assert not (tag / ".pagemap").exists()


def test_set_reads_stdin(tag, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(GOOD.encode())))
    run("pagemap", "set", str(tag), "-")
    assert (tag / ".pagemap").read_text() == GOOD


def test_set_needs_a_tag_directory_and_a_readable_file(tmp_path, tag, map_file):
    with pytest.raises(InvalidInput, match="not a tag directory"):
        run("pagemap", "set", str(tmp_path / "nope"), map_file(GOOD))
    with pytest.raises(FaultfsError, match="cannot read") as info:
        run("pagemap", "set", str(tag), str(tmp_path / "missing.txt"))
    assert info.value.errno == errno.ENOENT


def fail_on_our_fd(monkeypatch, call: str, code: int):
    """Make os.<call> fail with ``code`` for the fd pagemap_cli opens, like a refusing mount."""
    real_open, real = os.open, getattr(os, call)
    ours: list[int] = []

    def fake_open(*args, **kwargs):
        fd = real_open(*args, **kwargs)
        ours.append(fd)
        return fd

    def fake(fd, *args):
        result = real(fd, *args)
        if fd in ours:
            raise OSError(code, os.strerror(code))
        return result

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, call, fake)


@pytest.mark.parametrize("call", ["close", "write"])
def test_set_turns_a_mount_einval_into_a_clear_message(tag, map_file, monkeypatch, call):
    fail_on_our_fd(monkeypatch, call, errno.EINVAL)
    with pytest.raises(InvalidInput, match="refused the pagemap as malformed"):
        run("pagemap", "set", str(tag), map_file(GOOD))


def test_set_reports_other_os_errors_with_their_errno(tag, map_file, monkeypatch):
    fail_on_our_fd(monkeypatch, "close", errno.EIO)
    with pytest.raises(FaultfsError, match="cannot install") as info:
        run("pagemap", "set", str(tag), map_file(GOOD))
    assert info.value.errno == errno.EIO


def test_show_prints_a_summary_then_the_text(tag, capsys):
    (tag / ".pagemap").write_text(GOOD)
    assert run("pagemap", "show", str(tag)) == 0
    out = capsys.readouterr().out
    assert out == (
        "page_size 1024\ntotal     1536\npages     2\nextents   2\nblobs     2\n\n" + GOOD
    )


def test_show_raw_prints_the_text_only(tag, capsys):
    (tag / ".pagemap").write_text(GOOD)
    run("pagemap", "show", "--raw", str(tag))
    assert capsys.readouterr().out == GOOD


def test_show_an_unusable_map_says_so(tag, capsys):
    (tag / ".pagemap").write_text("page_size=1024\na 0 0 -1\n")
    run("pagemap", "show", str(tag))
    assert capsys.readouterr().out.startswith("pagemap   unusable")


def test_show_without_a_map(tag, tmp_path):
    with pytest.raises(FaultfsError, match="has no pagemap") as info:
        run("pagemap", "show", str(tag))
    assert info.value.errno == errno.ENOENT
    with pytest.raises(InvalidInput, match="not a tag directory"):
        run("pagemap", "show", str(tmp_path / "nope"))


def test_pagemap_needs_a_subcommand(capsys):
    with pytest.raises(SystemExit):
        run("pagemap")
    assert "COMMAND" in capsys.readouterr().err
