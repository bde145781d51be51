"""Assimilator registry: format name -> class, imported lazily by name.

Built-ins are listed here by module path; third parties add theirs through the
``faultfs.assimilators`` entry-point group (``name = "package.module:Class"``).
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from faultfs.errors import FaultfsError, InvalidInput

BUILTIN = {
    "binary": "faultfs.assimilators.binary:BinaryFileAssimilator",
}
_instances: dict[str, object] = {}


def _load(spec: str) -> object:
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)()


def available() -> list[str]:
    names = set(BUILTIN)
    names.update(ep.name for ep in entry_points(group="faultfs.assimilators"))
    return sorted(names)


def get(name: str):
    """The assimilator registered as ``name``; InvalidInput if there is none."""
    if name in _instances:
        return _instances[name]
    if name in BUILTIN:
        inst = _load(BUILTIN[name])
    else:
        eps = [ep for ep in entry_points(group="faultfs.assimilators") if ep.name == name]
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


def register(name: str, assimilator: object) -> None:
    """Register an assimilator instance under ``name`` (tests and embedding programs)."""
    _instances[name] = assimilator
