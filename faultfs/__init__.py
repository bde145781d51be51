"""faultfs: mount big, slow or remote data and copy nothing until a byte is touched.

``faultfs.mounted(...)`` (a context manager) and ``faultfs.stat(root)`` are the Python API
(``faultfs.api``); ``faultfs.Error`` is the base of every error the library raises.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["Error", "MountError", "__version__", "mounted", "stat"]


def __getattr__(name: str) -> Any:
    # lazily: `import faultfs` stays cheap, and the layers below never import the API
    if name == "Error":
        from faultfs.errors import FaultfsError

        return FaultfsError
    if name in ("mounted", "stat", "MountError", "unmount"):
        from faultfs import api

        return getattr(api, name)
    raise AttributeError(f"module 'faultfs' has no attribute {name!r}")
