"""Transfer contexts: the 12 fields one registration carries, their canonical bytes, the fault key.

Invariants:
- ``encode()`` is deterministic: UTF-8 JSON, keys sorted, no spaces, integers as integers,
  secrets (``src_token``/``dst_token``) always blanked. Equal contexts give equal bytes.
- The fault key is ``fault:`` + 16 lower-case hex digits of FNV-1a 64 over ``encode()``.
- ``decode(encode(c)) == c.redacted()`` and ``decode`` refuses anything it would not produce.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace

from faultfs.core.names import check_blob_prefix
from faultfs.errors import InvalidInput

FNV64_OFFSET_BASIS = 0xCBF29CE484222325
FNV64_PRIME = 0x100000001B3
FAULT_KEY_PREFIX = "fault:"
REGISTRY_TAG = "__cae_on_fault"  # upstream's name for the tag holding fault contexts
CLONE_OF = "clone of "  # a clone's src_data: this, then the fault key of the tag it copies

MAX_CHUNK_SIZE = 1 << 30  # a blob is held whole in memory while it faults: cap it at 1 GiB
MAX_INT = (1 << 63) - 1  # offsets and sizes must fit a signed 64-bit off_t
MAX_CONTEXT_BYTES = 1 << 20  # a registry entry larger than this is not one we wrote

STRING_FIELDS = (
    "src", "dst", "format", "src_token", "dst_token", "s3_region", "s3_profile",
    "src_data", "blob_prefix",
)
INT_FIELDS = ("range_off", "range_size", "chunk_size")


def fnv1a64(data: bytes) -> int:
    """64-bit FNV-1a of ``data``."""
    h = FNV64_OFFSET_BASIS
    for byte in data:
        h ^= byte
        h = (h * FNV64_PRIME) & 0xFFFFFFFFFFFFFFFF
    return h


@dataclass(frozen=True)
class FaultContext:
    """What one registration says: where bytes come from, where they go, how they are cut."""

    src: str
    dst: str
    format: str = "binary"
    src_token: str = ""
    dst_token: str = ""
    s3_region: str = ""
    s3_profile: str = ""
    src_data: str = ""
    blob_prefix: str = "chunk_"
    range_off: int = 0
    range_size: int = 0
    chunk_size: int = 0
    on_fault: bool = True

    def __post_init__(self) -> None:
        for name in STRING_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, str):
                raise InvalidInput(f"context field {name} must be a string, not {value!r}")
            if "\x00" in value:
                raise InvalidInput(f"context field {name} contains NUL")
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                what = f"source {value!r}" if name == "src" else f"context field {name}"
                raise InvalidInput(f"{what} is not valid UTF-8 (faultfs keeps names as "
                                   "UTF-8: rename it, or link it under a UTF-8 name)") from None
        for name in INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidInput(f"context field {name} must be an integer, not {value!r}")
            if value < 0 or value > MAX_INT:
                raise InvalidInput(f"context field {name}={value} is out of range [0, 2**63)")
        if self.chunk_size > MAX_CHUNK_SIZE:
            raise InvalidInput(f"chunk size {self.chunk_size} is over the 1 GiB limit")
        if not isinstance(self.on_fault, bool):
            raise InvalidInput(f"context flag on_fault must be a bool, not {self.on_fault!r}")
        if not self.src:
            raise InvalidInput("context has no source")
        check_blob_prefix(self.blob_prefix)

    def redacted(self) -> FaultContext:
        """The context with secrets blanked: what may be hashed, persisted or shown."""
        return replace(self, src_token="", dst_token="")

    def encode(self) -> bytes:
        """Canonical bytes (secrets blanked), see docs/FORMAT.md."""
        doc = asdict(self.redacted())
        return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()

    @property
    def key(self) -> str:
        """The fault key: ``fault:`` + FNV-1a 64 of the canonical encoding, 16 hex digits."""
        return f"{FAULT_KEY_PREFIX}{fnv1a64(self.encode()):016x}"

    @property
    def cloned_from(self) -> str | None:
        """The fault key of the tag this context's tag is a clone of (``faultfs clone``), or
        None when it is no clone."""
        return self.src_data[len(CLONE_OF):] if self.src_data.startswith(CLONE_OF) else None

    @classmethod
    def decode(cls, data: bytes) -> FaultContext:
        """Parse canonical bytes; anything not produced by ``encode`` is refused."""
        if len(data) > MAX_CONTEXT_BYTES:
            raise InvalidInput(f"fault context of {len(data)} bytes is too large")
        try:
            doc = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise InvalidInput(f"fault context is not canonical JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise InvalidInput("fault context is not a JSON object")
        expected = {f.name for f in fields(cls)}
        if set(doc) != expected:
            missing = sorted(expected - set(doc))
            extra = sorted(set(doc) - expected)
            raise InvalidInput(f"fault context fields differ: missing {missing}, unknown {extra}")
        ctx = cls(**doc)
        if ctx.encode() != data:
            raise InvalidInput("fault context bytes are not in canonical form")
        return ctx


def is_fault_key(name: str) -> bool:
    """True when ``name`` is ``fault:`` followed by exactly 16 lower-case hex digits."""
    if not name.startswith(FAULT_KEY_PREFIX):
        return False
    digits = name[len(FAULT_KEY_PREFIX):]
    return len(digits) == 16 and all(c in "0123456789abcdef" for c in digits)
