"""The mount daemon stays lean: numpy (and the OpenBLAS threads it starts, which spin on the
CPUs the daemon needs) is loaded only by the commands that use it (warm, checkpoint, stream)."""

from __future__ import annotations

import subprocess
import sys


def test_the_mount_daemon_does_not_import_numpy():
    code = (
        "import sys\n"
        "import faultfs.cli\n"
        "faultfs.cli.build_parser()\n"
        "import faultfs.daemon, faultfs.fuse.serve, faultfs.engine, faultfs.namespace\n"
        "import faultfs.sources.remote, assimilators.binary\n"
        "print('numpy' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
