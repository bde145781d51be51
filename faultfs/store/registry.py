"""Registry entries: the persisted fault contexts, blobs ``fault:<16 hex>`` of the registry tag
``__cae_on_fault`` (DESIGN §2, §3), so a remount (or another node) can serve their faults.

Invariants:
- An entry holds the canonical encoding of a context (secrets blanked), is written durably and
  flagged no-fault, and is named by that context's fault key.
- ``entries()`` yields only entries that verify, decode and hash to their own name; anything
  else is reported (``RegistryProblem``) and never served as a context.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from faultfs.core.context import MAX_CONTEXT_BYTES, REGISTRY_TAG, FaultContext, is_fault_key
from faultfs.errors import InvalidInput
from faultfs.store.blobfile import FLAG_NO_FAULT
from faultfs.store.blobstore import BlobStore


@dataclass(frozen=True)
class RegistryProblem:
    """An entry that cannot be used, and why (shown in the log, never served)."""

    key: str
    reason: str


class Registry:
    """The fault contexts persisted in a store (blocking: file I/O)."""

    def __init__(self, store: BlobStore) -> None:
        self.store = store

    def put(self, ctx: FaultContext) -> bytes:
        """Persist ``ctx`` under its fault key; returns the stored bytes."""
        data = ctx.encode()  # secrets are blanked by encode()
        self.store.put(REGISTRY_TAG, ctx.key, data, flags=FLAG_NO_FAULT, durable=True)
        return data

    def delete(self, key: object) -> None:
        if isinstance(key, str) and is_fault_key(key):
            self.store.delete(REGISTRY_TAG, key)

    def entries(self) -> Iterator[tuple[str, FaultContext, bytes] | RegistryProblem]:
        """Every entry, in key order: ``(key, context, bytes)`` or a problem."""
        for key in sorted(self.store.list_blobs(REGISTRY_TAG)):
            if not is_fault_key(key):
                continue
            data = self.store.read(REGISTRY_TAG, key, max_len=MAX_CONTEXT_BYTES)
            if data is None:
                yield RegistryProblem(key, "damaged")
                continue
            try:
                ctx = FaultContext.decode(data)
            except InvalidInput as exc:
                yield RegistryProblem(key, f"not a context ({exc})")
                continue
            if ctx.key != key:
                yield RegistryProblem(key, f"holds a context with key {ctx.key}")
                continue
            yield key, ctx, data
