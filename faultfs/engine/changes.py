"""TagChanges: the changes of each tag under way, and a tag held still while a clone takes its
snapshot (DESIGN §12: a clone is its tag at one instant).

A *change* is anything that changes what a tag reads: a write, a truncate, a user blob's
create, unlink or rename, a reset — whole: a write through the view or a page, however many
blobs it lands in, is one change. ``hold`` makes new changes of its tag wait, waits for the
changes under way to end, and lets its holder take the snapshot while nothing of the tag
changes; then the changes that waited go on. So a clone holds every change answered before
it began, and a change only with every change answered before that one.

Invariants:
- With no tag held, starting a change costs a truth test of a dict and a count (no await
  that passes through the scheduler).
- A change waits for a hold only as it starts, before it holds any lock or has changed
  anything; a change under way never waits for one. So a hold's wait for the changes under
  way ends once they end, and they wait only for what ends without it (their blobs' locks,
  a checkpoint, a fault, the I/O pool).
- A change started inside another change of the same tag by the same task (the pieces of a
  page write) never waits: its outer change is under way, so the hold has not begun its
  snapshot, and it waits for this one too.
- Holds of one tag are taken one at a time; holds of different tags are independent. A
  hold ends when its holder leaves it, also when it is cancelled or fails.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from contextvars import ContextVar, Token
from typing import Any, TypeVar, cast

import trio

from faultfs.engine.tags import Tag

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])

# the tag whose change the current task is inside (-1: none). A task started inside a change
# inherits it; that is harmless: it lets a change in only while one of that tag is under way
# (the hold then still waits for it)
_INSIDE: ContextVar[int] = ContextVar("faultfs_inside_change", default=-1)


class TagChanges:
    """``async with changes.change(tag_id)`` around every change of a tag; ``async with
    changes.hold(tag_id)`` around a snapshot of it."""

    def __init__(self) -> None:
        self._under_way: dict[int, int] = {}  # tag id -> changes of it under way (or 0)
        self._held: dict[int, trio.Event] = {}  # tag id -> set when its hold ends
        self._drained: dict[int, trio.Event] = {}  # tag id -> set when its changes end
        self._holds: dict[int, trio.Lock] = {}  # tag id -> taken by its hold (one at a time)

    def change(self, tag_id: int) -> _Change:
        return _Change(self, tag_id)

    def under_way(self, tag_id: int) -> int:
        """Changes of the tag under way."""
        return self._under_way.get(tag_id, 0)

    def held(self, tag_id: int) -> bool:
        """Whether a hold of the tag is under way (its changes wait)."""
        return tag_id in self._held

    def _start(self, tag_id: int) -> Token[int]:
        """A change of ``tag_id`` starts (nothing awaited since ``_wait``)."""
        under_way = self._under_way
        under_way[tag_id] = under_way.get(tag_id, 0) + 1
        return _INSIDE.set(tag_id)

    def _end(self, tag_id: int, token: Token[int]) -> None:
        _INSIDE.reset(token)
        left = self._under_way[tag_id] = self._under_way[tag_id] - 1
        if not left and self._drained:
            self._ended(tag_id)

    def _ended(self, tag_id: int) -> None:
        """No change of ``tag_id`` is under way any more: a hold waiting for that goes on."""
        drained = self._drained.pop(tag_id, None)
        if drained is not None:
            drained.set()

    async def _wait(self, tag_id: int) -> None:
        """Wait while ``tag_id`` is held, unless this task is inside a change of it."""
        while tag_id in self._held:
            if _INSIDE.get() == tag_id and self._under_way.get(tag_id):
                return
            await self._held[tag_id].wait()

    @asynccontextmanager
    async def hold(self, tag_id: int) -> AsyncIterator[None]:
        """Hold ``tag_id`` still: new changes of it wait, and the body runs once the changes
        under way have ended."""
        lock = self._holds.get(tag_id)
        if lock is None:
            lock = self._holds[tag_id] = trio.Lock()
        async with lock:
            released = self._held[tag_id] = trio.Event()
            try:
                if self._under_way.get(tag_id):
                    drained = self._drained[tag_id] = trio.Event()
                    await drained.wait()
                yield
            finally:
                del self._held[tag_id]
                self._drained.pop(tag_id, None)
                released.set()


class _Change:
    """One change of a tag (``TagChanges.change``)."""

    __slots__ = ("_changes", "_tag_id", "_token")

    def __init__(self, changes: TagChanges, tag_id: int) -> None:
        self._changes = changes
        self._tag_id = tag_id

    async def __aenter__(self) -> None:
        changes = self._changes
        if changes._held:  # some tag is held: this one perhaps
            await changes._wait(self._tag_id)
        self._token = changes._start(self._tag_id)

    async def __aexit__(self, *exc: object) -> None:
        self._changes._end(self._tag_id, self._token)


def one_change(method: F) -> F:
    """Make each call of ``method`` (of an object with ``changes``, given the tag first) one
    change of that tag: ``async with
    self.changes.change(tag.id)`` around its body, without a context manager's calls on the
    path of every write."""

    @functools.wraps(method)
    async def change(self: Any, tag: Tag, *args: Any, **kwargs: Any) -> Any:
        changes, tag_id = self.changes, tag.id
        if changes._held:  # some tag is held: this one perhaps
            await changes._wait(tag_id)
        # (``_start`` and ``_end`` inline: this runs on every write)
        under_way = changes._under_way
        under_way[tag_id] = under_way.get(tag_id, 0) + 1
        token = _INSIDE.set(tag_id)
        try:
            return await method(self, tag, *args, **kwargs)
        finally:
            _INSIDE.reset(token)
            left = under_way[tag_id] = under_way[tag_id] - 1
            if not left and changes._drained:
                changes._ended(tag_id)

    return cast(F, change)
