"""faultfs/core must stay pure: no I/O module is imported by any of its modules."""

import ast
import pathlib

FORBIDDEN = {
    "os", "io", "pathlib", "trio", "pyfuse3", "fsspec", "s3fs", "threading",
    "subprocess", "socket", "shutil", "tempfile", "asyncio", "mmap", "sys",
}
CORE = pathlib.Path(__file__).resolve().parent.parent / "faultfs" / "core"


def test_core_imports_no_io_module():
    offenders = []
    for path in sorted(CORE.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                if name.split(".")[0] in FORBIDDEN:
                    offenders.append(f"{path.name}: {name}")
    assert offenders == [], f"faultfs/core imports I/O modules: {offenders}"
    assert list(CORE.glob("*.py")), "no core modules found"
