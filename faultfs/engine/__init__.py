"""The fault engine: tags over one store, the hit/fault/store path, pages, writes and stats
(DESIGN §5, §11, §12).

One duty a module: ``tags`` (register, recover, clone, remove), ``flights`` (single-flight),
``faults`` (source runs, zero tail), ``prefetch``, ``reads`` (the clean read path: memory, a
read-ahead in flight, the store, the source), ``pages`` (over a narrow blob protocol),
``changes`` (a clone's hold on its tag), ``sharing`` and ``refresh`` (the registry shared by
the nodes of a shared store, and the tags other nodes registered), ``stats`` (the snapshot),
``writes/`` (copy-on-write: a package of rooms over one table of dirty blobs), and
``engine`` composing them. ``Engine`` is the face the namespace, the FUSE layer and the
daemon call, for writes as for reads. Public here: ``Engine``, ``Tag`` and the
registration helpers the daemon uses.
"""

from faultfs.engine.engine import Engine
from faultfs.engine.tags import (
    RegistrationPlan,
    Tag,
    default_tag_name,
    persistable,
    recovery_options,
    remote_settings,
    view_name_for,
)

__all__ = [
    "Engine", "RegistrationPlan", "Tag", "default_tag_name", "persistable", "recovery_options",
    "remote_settings", "view_name_for",
]
