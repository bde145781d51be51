"""A third-party assimilator, installed with pip as its own distribution, is found through the
``faultfs.assimilators`` entry-point group and serves a real mount."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from conftest import FAULTFS, ROOT

PLUGIN = '''
"""A test plugin: the binary cut, every byte XORed with 0x5A (a format that decodes)."""

from assimilators.binary import BinaryFileAssimilator


class XorAssimilator(BinaryFileAssimilator):
    name = "xor"

    def read_blobs(self, source, ctx, layout, first, count):
        return [bytes(b ^ 0x5A for b in blob)
                for blob in super().read_blobs(source, ctx, layout, first, count)]
'''
PYPROJECT = '''
[build-system]
requires = ["setuptools", "wheel"]
build-backend = "setuptools.build_meta"

[project]
name = "faultfs-xor-plugin"
version = "0.1"

[project.entry-points."faultfs.assimilators"]
xor = "faultfs_xor_plugin:XorAssimilator"
'''


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory):
    """The plugin pip-installed into a directory of its own; PYTHONPATH puts it beside the
    project's venv."""
    src = tmp_path_factory.mktemp("plugin-src")
    (src / "faultfs_xor_plugin").mkdir()
    (src / "faultfs_xor_plugin" / "__init__.py").write_text(textwrap.dedent(PLUGIN))
    (src / "pyproject.toml").write_text(textwrap.dedent(PYPROJECT))
    site = tmp_path_factory.mktemp("plugin-site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--no-build-isolation", "--target", str(site), str(src)],
                   check=True, capture_output=True, timeout=300)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), ROOT]))
    return env


def test_the_registry_lists_an_installed_plugin(plugin_site):
    code = "import assimilators; print(assimilators.available()); print(assimilators.get('xor').name)"
    out = subprocess.run([sys.executable, "-c", code], env=plugin_site, capture_output=True,
                         text=True, check=True).stdout.split("\n")
    assert "'xor'" in out[0] and "'binary'" in out[0]
    assert out[1] == "xor"


@pytest.mark.mount
def test_a_plugin_serves_a_mount(plugin_site, tmp_path, sample):
    src = sample(300_000)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    run = subprocess.run([*FAULTFS, "mount", src, str(mnt), "--store", str(tmp_path / "store"),
                          "--format", "xor", "--chunk-size", "64K", "--reserve-mb", "0"],
                         env=plugin_site, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    try:
        with open(src, "rb") as f:
            want = bytes(b ^ 0x5A for b in f.read())
        with open(mnt / "field" / "field.bin", "rb") as f:
            assert f.read() == want
    finally:
        subprocess.run([*FAULTFS, "umount", str(mnt)], env=plugin_site, capture_output=True,
                       timeout=60, cwd=ROOT)


def test_an_unknown_format_names_the_available_ones(tmp_path, sample):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    run = subprocess.run([*FAULTFS, "mount", sample(10), str(mnt), "--store", str(tmp_path / "s"),
                          "--format", "nope"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert run.returncode == 1
    assert "no assimilator named 'nope' (available: binary" in run.stderr
