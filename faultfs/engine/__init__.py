"""The fault engine: tags over one store, the hit/fault/store path, pages and stats (DESIGN §5).

One duty a module: ``tags`` (register, recover), ``flights`` (single-flight), ``faults``
(source runs, zero tail), ``prefetch``, ``pages`` (over a narrow blob protocol), ``stats``
(the snapshot), and ``engine`` composing them with the read path. Public here: ``Engine``,
``Tag`` and the registration helpers the daemon uses.
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
