"""The write state of a tag (``writes/t-<tag>/state.json``): one format, parsed and written here
for a mount, a clone and ``faultfs fsck`` alike (docs/FORMAT.md, "Write state").

What a tag's writes changed beyond its blobs: the view's size and the last size record it
includes, the user blob table (names to ids, the next id, the ids cut into parts), a clone's
ancestors (whose files it linked), a reset's void marks (of the tag, of single blobs), the
time it was last written, the blobs whose writes were found damaged, and each user blob's
mode and times and the tag directory's mode (``user_attrs``, ``dir_mode``: version 2).

Invariants:
- One parser decides whether a document is a write state (``parse``); fsck's verdict
  (``problem``) is its error, word for word, so what fsck calls fine a mount reads.
- Every integer is one a file offset or a journal seq can be: in ``[0, 2**63)``.
- Written with ``version`` 2, every field present (``damaged_blobs``, ``user_attrs`` and
  ``dir_mode`` only when they say something: an empty table is absent); version 1 is the
  same without the last two and reads as it always did (its user blobs take the defaults: mode 0644,
  the tag's time); a document without ``version`` is the format before versions and takes
  defaults for what it lacks. Another version is refused, never guessed at. A change of
  the serialised form bumps ``VERSION`` (a golden-bytes test pins it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, TypeVar

from faultfs.errors import CorruptionError

VERSION = 2
READS = (1, 2)  # the versions this faultfs reads
MODE_BITS = 0o7777  # what a user blob's mode may hold (its type is always a regular file)
MAX_INT = (1 << 63) - 1  # a file offset's limit (the kernel's), and far past any seq
_INTS = ("view_size", "view_seq", "next_user", "voided", "mtime_ns")
_REQUIRED = (*_INTS, "users", "parted", "ancestors", "voided_blobs")  # of a version-1 doc

S = TypeVar("S", bound="WriteState")


@dataclass
class WriteState:
    """A tag's write state as saved."""

    view_size: int
    view_seq: int = 0  # the last size record the state file includes
    users: dict[str, int] = field(default_factory=dict)  # user blob name -> id
    next_user: int = 1
    parted: set[int] = field(default_factory=set)  # user blob ids cut into parts
    ancestors: tuple[str, ...] = ()  # a clone's parent, grandparent ...: its linked files
    voided: int = 0  # records at or below this seq are void (a reset of the tag)
    voided_blobs: dict[str, int] = field(default_factory=dict)  # a reset of single blobs
    mtime_ns: int = 0  # when it was last written
    # blobs whose writes were found damaged in the journal: name -> {"reason", "size"}; kept,
    # EIO, until a reset drops them (their records go to writes/damaged/, not away)
    damaged_blobs: dict[str, dict] = field(default_factory=dict)
    # user blob id -> [mode bits, atime_ns, mtime_ns] (one it lacks: 0644, the tag's mtime)
    user_attrs: dict[int, list[int]] = field(default_factory=dict)
    dir_mode: int | None = None  # the tag directory's mode bits, once chmod set them (0755)

    @classmethod
    def parse(cls: type[S], doc: object, source_size: int) -> S:
        """The state a document holds (``source_size``: the view's size when a document of
        the format before versions has none); CorruptionError naming what is wrong."""
        if not isinstance(doc, dict):
            raise CorruptionError("not a JSON object")
        if "version" in doc:
            version = doc["version"]
            if type(version) is not int or version not in READS:
                raise CorruptionError(f"version {version!r} is not one this faultfs reads "
                                      f"({', '.join(map(str, READS))})")
            for name in _REQUIRED:
                if name not in doc:
                    raise CorruptionError(f"field {name} is missing")
        users = _table(doc, "users")
        voided_blobs = _table(doc, "voided_blobs")
        ancestors = doc.get("ancestors", [])
        if not isinstance(ancestors, list) or not all(isinstance(a, str) for a in ancestors):
            raise CorruptionError("field ancestors is not a list of tag names")
        parted = doc.get("parted", [])
        if not isinstance(parted, list):
            raise CorruptionError("field parted is not a list of user blob ids")
        damaged = doc.get("damaged_blobs", {})
        if not isinstance(damaged, dict):
            raise CorruptionError("field damaged_blobs is not a table of blob names")
        marks = {}
        for name, mark in damaged.items():
            if not (isinstance(mark, dict) and isinstance(mark.get("reason"), str)):
                raise CorruptionError(f"field damaged_blobs gives {name} no reason")
            marks[name] = {"reason": mark["reason"],
                           "size": _uint(f"damaged_blobs.{name}.size", mark.get("size", 0))}
        ints = {name: _uint(name, doc[name]) for name in _INTS if name in doc}
        attrs = doc.get("user_attrs", {})
        if not isinstance(attrs, dict):
            raise CorruptionError("field user_attrs is not a table of user blob ids")
        user_attrs = {}
        for uid, value in attrs.items():
            if not (isinstance(value, list) and len(value) == 3):
                raise CorruptionError(f"field user_attrs gives {uid} no [mode, atime, mtime]")
            what = f"user_attrs.{uid}"
            mode, atime, mtime = (_uint(what, v) for v in value)
            if mode & ~MODE_BITS:
                raise CorruptionError(f"field {what} has mode {mode:#o}, past {MODE_BITS:#o}")
            if not uid.isdigit():
                raise CorruptionError(f"field user_attrs names {uid!r}, not a user blob id")
            user_attrs[int(uid)] = [mode, atime, mtime]
        dir_mode = doc.get("dir_mode")
        if dir_mode is not None and _uint("dir_mode", dir_mode) & ~MODE_BITS:
            raise CorruptionError(f"field dir_mode is {dir_mode:#o}, past {MODE_BITS:#o}")
        return cls(view_size=ints.get("view_size", source_size),
                   view_seq=ints.get("view_seq", 0), users=users,
                   next_user=ints.get("next_user", 1),
                   parted={_uint("parted", u) for u in parted}, ancestors=tuple(ancestors),
                   voided=ints.get("voided", 0), voided_blobs=voided_blobs,
                   mtime_ns=ints.get("mtime_ns", 0), damaged_blobs=marks,
                   user_attrs=user_attrs, dir_mode=dir_mode)

    def saved(self) -> WriteState:
        """A copy of what is saved, tables and all (a save writes it on the I/O pool while
        the tables change)."""
        return WriteState(
            view_size=self.view_size, view_seq=self.view_seq, users=dict(self.users),
            next_user=self.next_user, parted=set(self.parted), ancestors=self.ancestors,
            voided=self.voided, voided_blobs=dict(self.voided_blobs), mtime_ns=self.mtime_ns,
            damaged_blobs={k: dict(v) for k, v in self.damaged_blobs.items()},
            user_attrs={k: list(v) for k, v in self.user_attrs.items()},
            dir_mode=self.dir_mode)

    def to_doc(self) -> dict[str, Any]:
        """The document saved."""
        doc: dict[str, Any] = {
            "version": VERSION, "view_size": self.view_size, "view_seq": self.view_seq,
            "users": dict(self.users), "next_user": self.next_user,
            "parted": sorted(self.parted), "ancestors": list(self.ancestors),
            "voided": self.voided, "voided_blobs": dict(self.voided_blobs),
            "mtime_ns": self.mtime_ns}
        if self.damaged_blobs:
            doc["damaged_blobs"] = {k: dict(v) for k, v in self.damaged_blobs.items()}
        if self.dir_mode is not None:
            doc["dir_mode"] = self.dir_mode
        if self.user_attrs:
            doc["user_attrs"] = {str(k): list(v) for k, v in sorted(self.user_attrs.items())}
        return doc


def encode(state: WriteState) -> bytes:
    """The bytes of the state file (sorted keys: the same state, the same bytes)."""
    return json.dumps(state.to_doc(), sort_keys=True, indent=1).encode()


def problem(doc: object) -> str:
    """What is wrong with a write state document ("" when a mount reads it): the message of
    the error ``WriteState.parse`` raises, so fsck and a mount say the same."""
    try:
        WriteState.parse(doc, 0)
    except CorruptionError as exc:
        return exc.message
    return ""


def _uint(name: str, value: object) -> int:
    if type(value) is not int or not 0 <= value <= MAX_INT:
        raise CorruptionError(f"field {name} is {value!r}, not an integer in [0, 2**63)")
    return value


def _table(doc: dict, name: str) -> dict[str, int]:
    table = doc.get(name, {})
    if not isinstance(table, dict):
        raise CorruptionError(f"field {name} is not a table of names")
    return {str(k): _uint(f"{name}.{k}", v) for k, v in table.items()}
