"""The compiled pieces, all optional (without a compiler the install goes on):
``faultfs.fuse._fastread`` (staged reads answered in C, see faultfs/fuse/fastread.py; without
it or libfuse3's headers mounts serve every read through pyfuse3), ``faultfs.stream._cut``
(a line block's records cut in one pass, see faultfs/stream/readers.py; without it they are
split and picked in Python) and ``faultfs.stream._flatjson`` (flat JSON records parsed in one
pass, see faultfs/stream/columns.py; without it pyarrow's reader parses them)."""

import shutil
import subprocess

from setuptools import Extension, setup


def fuse3_flags() -> tuple[list[str], list[str]]:
    """Include directories and libraries of libfuse3, from pkg-config where it is."""
    if shutil.which("pkg-config"):
        try:
            cflags = subprocess.run(["pkg-config", "--cflags-only-I", "fuse3"], check=True,
                                    capture_output=True, text=True).stdout.split()
            libs = subprocess.run(["pkg-config", "--libs-only-l", "fuse3"], check=True,
                                  capture_output=True, text=True).stdout.split()
            return [f[2:] for f in cflags], [lib[2:] for lib in libs]
        except (OSError, subprocess.CalledProcessError):
            pass
    return ["/usr/include/fuse3"], ["fuse3"]


includes, libraries = fuse3_flags()
setup(ext_modules=[Extension(
    "faultfs.fuse._fastread", ["faultfs/fuse/_fastread.c"], include_dirs=includes,
    libraries=[*libraries, "pthread", "dl"], extra_compile_args=["-O2", "-Wall", "-Wextra"],
    optional=True), Extension(
    "faultfs.stream._cut", ["faultfs/stream/_cut.c"], extra_compile_args=["-O2", "-Wall", "-Wextra"],
    optional=True), Extension(
    "faultfs.stream._flatjson", ["faultfs/stream/_flatjson.c"],
    extra_compile_args=["-O2", "-Wall", "-Wextra"], optional=True)])
