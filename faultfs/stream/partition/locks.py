"""The flocks that keep a partition's openers, its open readers and a repartition apart.

Invariants:
- Whoever creates, checks or replaces a partition holds an exclusive ``flock`` on
  ``<state>.partition.lock`` (``locked``), so the readers of a fresh run, started at once,
  agree on one partition, and the sidecar is never written by two at a time.
- Every open reader of a partition holds a shared ``flock`` on ``<state>.partition.readers``
  (``reading``; taken while holding the partition lock, released by ``close`` or its
  process's end); a repartition needs it exclusively and is refused while one is held: a
  reader still running would deliver its uncommitted records while a new reader delivers them
  too.
- The unpartitioned stream of before holds no such lock, so a repartition also takes the
  exclusive ``flock`` every open stream holds on its ``.meta``
  (``DualMetadataManager.open(exclusive=True)``) of each old state (``claim_states``), for as
  long as it runs, and is refused while one is held.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator, Sequence

from faultfs.errors import InvalidInput
from faultfs.stream.partition.names import LOCK_SUFFIX, READERS_SUFFIX
from faultfs.stream.partition.sidecar import Partition


@contextlib.contextmanager
def locked(state: str) -> Iterator[None]:
    """Hold the partition lock of ``state`` (an exclusive flock; waits for other openers)."""
    path = state + LOCK_SUFFIX
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as err:
        raise InvalidInput(f"{path}: cannot open the partition lock: {err.strerror}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as err:
            raise InvalidInput(
                f"{path}: cannot take the partition lock ({err.strerror}); the state directory "
                "must support flock"
            ) from None
        yield
    finally:
        os.close(fd)


def reading(state: str, part: Partition, replacing: bool) -> int:
    """A descriptor of ``<state>.partition.readers`` holding a shared flock (this reader is
    open), or (``replacing``) an exclusive one, taken only if no reader of ``part`` is open —
    a repartition under running readers would hand their uncommitted records to new ones
    too. Called holding the partition lock, so neither waits for a repartition."""
    path = state + READERS_SUFFIX
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except OSError as err:
        raise InvalidInput(f"{path}: cannot open the readers' lock: {err.strerror}") from None
    try:
        if not replacing:
            fcntl.flock(fd, fcntl.LOCK_SH)
            return fd
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise InvalidInput(
                f"{state}: readers of the recorded partition (world_size {part.world_size}, "
                f"num_workers {part.num_workers}) are still open; close them before "
                "repartitioning") from None
        return fd
    except BaseException:
        os.close(fd)
        raise


def claim_states(paths: Sequence[str]) -> list[int]:
    """Descriptors of the existing state files ``paths``, each holding the exclusive flock an
    open stream holds on its ``.meta`` (see the module doc); InvalidInput if a stream has one
    open: it would go on committing into a state the repartition supersedes."""
    claims: list[int] = []
    try:
        for path in paths:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
            except FileNotFoundError:
                continue
            claims.append(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise InvalidInput(
                    f"{path}: this reader's state is open in a stream; close it before "
                    "repartitioning"
                ) from None
            except OSError as err:  # no flock here: no guard, as for the stream itself
                if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise
    except BaseException:
        for fd in claims:
            os.close(fd)
        raise
    return claims
