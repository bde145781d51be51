"""pyfuse3, imported with faultfs's fast read path in front of it.

The fast read path (``_fastread``, see ``fastread.py``) has to be loaded into the process's
global symbol scope before pyfuse3 is, so that pyfuse3's call of ``fuse_session_new`` reaches
the fast path's stand-in first. Every module of the adapter imports pyfuse3 from here for that
reason. ``native`` is None where the compiled piece is missing (an install without a compiler)
or loaded too late (pyfuse3 was imported before this module): mounts then serve every read
through pyfuse3, as before, and cannot be taken over by a new daemon (fuse/holder.py needs the
library's record and replay of the INIT). ``FAULTFS_FAST_READ=0`` does not unload it: reads
are then all pyfuse3's (``FastReads.prepare``), and the library only passes requests on (with a
holder) or stands aside (without one).
"""

from __future__ import annotations

import logging
import os
import sys
from types import ModuleType

log = logging.getLogger("faultfs.mount")


def _load_native() -> ModuleType | None:
    if "pyfuse3" in sys.modules:
        return None  # too late: its session would not be made through the stand-in
    flags = sys.getdlopenflags()
    sys.setdlopenflags(flags | os.RTLD_GLOBAL)
    try:
        from faultfs.fuse import _fastread  # type: ignore[attr-defined]
    except ImportError as exc:
        log.debug("no fast read path: %s", exc)
        return None
    finally:
        sys.setdlopenflags(flags)
    return _fastread


native = _load_native()

import pyfuse3  # noqa: E402  (after the fast read path: see above)

__all__ = ["native", "pyfuse3"]
