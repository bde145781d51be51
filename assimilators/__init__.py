"""Format plugins: each turns a source into a blob layout and reads its blobs (DESIGN §1).

The registry maps a format name to an assimilator, imported lazily by name. Built-ins are
listed here by module path; third parties add theirs through the ``faultfs.assimilators``
entry-point group (``name = "package.module:Class"``); ``register`` adds an instance at run
time (tests, embedding programs). The protocol is ``assimilators.base.Assimilator``.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from assimilators.base import Assimilator
from faultfs.errors import FaultfsError, InvalidInput

BUILTIN = {
    "binary": "assimilators.binary:BinaryFileAssimilator",
}
ENTRY_POINTS = "faultfs.assimilators"  # the entry-point group third-party plugins use
_instances: dict[str, Assimilator] = {}


def _load(spec: str) -> Assimilator:
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)()


def available() -> list[str]:
    names = set(BUILTIN)
    names.update(ep.name for ep in entry_points(group=ENTRY_POINTS))
    return sorted(names)


def get(name: str) -> Assimilator:
    """The assimilator registered as ``name``; InvalidInput if there is none."""
    if name in _instances:
        return _instances[name]
    if name in BUILTIN:
        inst = _load(BUILTIN[name])
    else:
        eps = [ep for ep in entry_points(group=ENTRY_POINTS) if ep.name == name]
        if not eps:
            raise InvalidInput(
                f"no assimilator named {name!r} (available: {', '.join(available())})"
            )
        try:
            inst = eps[0].load()()
        except Exception as exc:
            raise FaultfsError(f"assimilator {name!r} failed to load: {exc}") from exc
    _instances[name] = inst
    return inst


def register(name: str, assimilator: Assimilator) -> None:
    """Register an assimilator instance under ``name`` (tests and embedding programs)."""
    _instances[name] = assimilator
