"""Configuration: one frozen dataclass built from CLI flags, then environment, then defaults.

The upstream names ``CLIO_CAE_FAULT_*`` / ``CLIO_CAE_REF_IO_THREADS`` are accepted as aliases
of the ``FAULTFS_*`` variables; a ``FAULTFS_*`` variable wins over its alias.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from faultfs.errors import InvalidInput

RESERVE_MB = 512  # a re-ingestable blob must never take the last of a tier
IO_THREADS = 32  # upstream's pool size for blocking source reads
STORE_BACKOFF_FAULTS = 256  # after a full store, read through this many faults before retrying
STATS_INTERVAL_S = 5.0
MEMORY_MB = 64  # recently faulted blobs kept in memory: later pieces of a blob skip the store
PREFETCH_MB = 32  # what a sequential reader's window holds of memory (S3: it reaches twice as far)
READAHEAD_KB = 4096  # kernel readahead of the mount: 1 MiB requests, several in flight
# the kernel's background (readahead, async) requests in flight on the mount's connection;
# its default 12 left three 4 MiB readaheads' worth of 1 MiB requests queued behind each other
MAX_BACKGROUND = 64
MAX_MAX_BACKGROUND = 65535  # the kernel's limit (u16)
INLINE_READ_KB = 64  # staged reads up to this size block the event loop's thread, no pool trip
DIRTY_MB = 64  # written bytes held in memory before they are spilled (read back from the journal)
JOURNAL_MB = 1024  # journal bytes on disk before a checkpoint folds them into dirty files
URING_MODES = ("on", "always", "off")  # staged reads through io_uring (tiers/uring.py)
# FUSE requests served at once, by as many pyfuse3 workers kept for the mount's life (0:
# pyfuse3's own, 1 to 99 started and ended as the queue empties and fills)
FUSE_WORKERS = 64
MAX_FUSE_WORKERS = 1024
FAST_READ_THREADS = 8  # staged reads waiting for the disk at once in the fast read path
MAX_FAST_READ_THREADS = 64  # _fastread.c MAX_READERS

# Upper bounds: beyond them a value is a typo, not a setting (an absurd reserve silently
# turned every fault into a read-through).
MAX_IO_THREADS = 1024
MAX_MB = 1 << 30  # 1 PiB in MiB
MAX_READAHEAD_KB = 1 << 20  # 1 GiB
MAX_BYTES = (1 << 63) - 1

ENV_ALIASES = {
    "FAULTFS_RESERVE_MB": "CLIO_CAE_FAULT_RESERVE_MB",
    "FAULTFS_STORE": "CLIO_CAE_FAULT_STORE",
    "FAULTFS_STATS": "CLIO_CAE_FAULT_STATS",
    "FAULTFS_IO_THREADS": "CLIO_CAE_REF_IO_THREADS",
}


def env_value(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """``name`` from the environment, falling back to its upstream alias."""
    env = os.environ if env is None else env
    if name in env:
        return env[name]
    alias = ENV_ALIASES.get(name)
    return env.get(alias) if alias else None


def _env_int(name: str, default: int, env: Mapping[str, str] | None) -> int:
    raw = env_value(name, env)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise InvalidInput(f"environment {name}={raw!r} is not an integer") from None
    if value < 0:
        raise InvalidInput(f"environment {name}={raw!r} is negative")
    return value


def _env_flag(name: str, default: bool, env: Mapping[str, str] | None) -> bool:
    raw = env_value(name, env)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise InvalidInput(f"environment {name}={raw!r} is not 0 or 1")


def default_store_dir(env: Mapping[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "faultfs")


@dataclass(frozen=True)
class Config:
    store_dir: str
    reserve_mb: int = RESERVE_MB
    store_enabled: bool = True
    io_threads: int = IO_THREADS
    stats_log: bool = False
    cache_size: int = 0  # bytes; 0 = no cap beyond the reserve
    backoff_faults: int = STORE_BACKOFF_FAULTS
    memory_mb: int = MEMORY_MB
    prefetch_mb: int = PREFETCH_MB
    readahead_kb: int = READAHEAD_KB
    # --max-background: the FUSE connection's max_background (congestion_threshold 3/4 of it)
    max_background: int = MAX_BACKGROUND
    inline_read_kb: int = INLINE_READ_KB
    read_only: bool = False  # --read-only: writes get EROFS
    # --xattrs: answer the user.faultfs.* extended attributes. Off, the first getxattr is
    # answered ENOSYS and the kernel stops asking; on, it asks getxattr("security.capability")
    # before every write: two requests per write (docs/decisions.md, "Extended attributes")
    xattrs: bool = False
    dirty_mb: int = DIRTY_MB
    journal_mb: int = JOURNAL_MB
    shared_store: str = ""  # --shared-store URL (DESIGN §13); "" = none
    shared_store_endpoint_url: str = ""  # when the shared store's S3 endpoint is not the sources'
    # --shared-store-key FILE: the cluster key objects of the shared store are sealed with
    # (tiers/sealed.py); "" = none (checksums only)
    shared_store_key: str = ""
    # --no-shared-claims / FAULTFS_SHARED_CLAIMS=0: no cross-node single flight (DESIGN §17)
    shared_claims: bool = True
    metrics_addr: str = ""  # --metrics-addr HOST:PORT: Prometheus metrics over HTTP
    # FAULTFS_URING: staged reads through io_uring when the serving thread has other work
    # ("on"), for every read it can take ("always"), or never ("off", also "0")
    uring: str = "on"
    # FAULTFS_URING_PUNT=0: ring reads start their disk read on the serving thread, as a
    # blocking read would, instead of in the kernel's worker (IOSQE_ASYNC)
    uring_punt: bool = True
    # FAULTFS_FUSE_FASTWAIT=0: every FUSE request waits through pyfuse3's own trio wait, even
    # when the next one is already queued (faultfs/fuse/fastwait.py)
    fuse_fastwait: bool = True
    # FAULTFS_FUSE_WORKERS=N: requests served at once (see FUSE_WORKERS)
    fuse_workers: int = FUSE_WORKERS
    # FAULTFS_FAST_READ=0: every read goes through pyfuse3 and the engine, none is answered
    # by the compiled fast read path (faultfs/fuse/fastread.py)
    fast_read: bool = True
    # FAULTFS_FAST_READ_THREADS=N: its threads that wait for the disk
    fast_read_threads: int = FAST_READ_THREADS
    # FAULTFS_SOURCE_DIRECT=0: large reads of uncached local sources take the page cache too
    source_direct: bool = True
    # FAULTFS_STORE_DIRECT=0: new blobs are written through the page cache too
    store_direct: bool = True

    def __post_init__(self) -> None:
        if self.io_threads < 1:
            raise InvalidInput("--io-threads must be at least 1")
        if self.reserve_mb < 0:
            raise InvalidInput("--reserve-mb must not be negative")
        if self.cache_size < 0:
            raise InvalidInput("--cache-size must not be negative")
        if not 0 <= self.fuse_workers <= MAX_FUSE_WORKERS:
            raise InvalidInput(f"FAULTFS_FUSE_WORKERS must be 0 to {MAX_FUSE_WORKERS} "
                               f"(it is {self.fuse_workers})")
        if not 1 <= self.fast_read_threads <= MAX_FAST_READ_THREADS:
            raise InvalidInput(f"FAULTFS_FAST_READ_THREADS must be 1 to {MAX_FAST_READ_THREADS} "
                               f"(it is {self.fast_read_threads})")
        if self.uring not in URING_MODES:
            raise InvalidInput(f"FAULTFS_URING must be one of {', '.join(URING_MODES)} or 0 "
                               f"(it is {self.uring!r})")
        if min(self.memory_mb, self.prefetch_mb, self.readahead_kb, self.inline_read_kb,
               self.dirty_mb, self.journal_mb, self.max_background) < 0:
            raise InvalidInput("memory, prefetch, readahead, inline-read, dirty and journal sizes "
                               "and --max-background must not be negative")
        for flag, value, most in (("--io-threads", self.io_threads, MAX_IO_THREADS),
                                  ("--reserve-mb", self.reserve_mb, MAX_MB),
                                  ("--memory-mb", self.memory_mb, MAX_MB),
                                  ("--prefetch-mb", self.prefetch_mb, MAX_MB),
                                  ("--readahead-kb", self.readahead_kb, MAX_READAHEAD_KB),
                                  ("--max-background", self.max_background, MAX_MAX_BACKGROUND),
                                  ("--inline-read-kb", self.inline_read_kb, MAX_READAHEAD_KB),
                                  ("--dirty-mb", self.dirty_mb, MAX_MB),
                                  ("--journal-mb", self.journal_mb, MAX_MB),
                                  ("--cache-size", self.cache_size, MAX_BYTES)):
            if value > most:
                raise InvalidInput(f"{flag} must be at most {most} (it is {value})")

    @property
    def reserve_bytes(self) -> int:
        return self.reserve_mb << 20

    @classmethod
    def build(cls, *, store_dir: str | None = None, reserve_mb: int | None = None,
              store_enabled: bool | None = None, io_threads: int | None = None,
              stats_log: bool | None = None, cache_size: int | None = None,
              memory_mb: int | None = None, prefetch_mb: int | None = None,
              readahead_kb: int | None = None, inline_read_kb: int | None = None,
              max_background: int | None = None,
              read_only: bool | None = None, xattrs: bool | None = None,
              dirty_mb: int | None = None, journal_mb: int | None = None,
              shared_store: str | None = None,
              shared_store_endpoint_url: str | None = None,
              shared_store_key: str | None = None,
              shared_claims: bool | None = None,
              metrics_addr: str | None = None, uring: str | None = None,
              uring_punt: bool | None = None, fuse_fastwait: bool | None = None,
              fuse_workers: int | None = None, fast_read: bool | None = None,
              fast_read_threads: int | None = None, source_direct: bool | None = None,
              store_direct: bool | None = None,
              env: Mapping[str, str] | None = None) -> Config:
        """Flags (non-None arguments) win over the environment, which wins over defaults."""
        return cls(
            store_dir=os.path.abspath(os.path.expanduser(store_dir or default_store_dir(env))),
            reserve_mb=reserve_mb if reserve_mb is not None else _env_int("FAULTFS_RESERVE_MB", RESERVE_MB, env),
            store_enabled=store_enabled if store_enabled is not None else _env_flag("FAULTFS_STORE", True, env),
            io_threads=io_threads if io_threads is not None else _env_int("FAULTFS_IO_THREADS", IO_THREADS, env),
            stats_log=stats_log if stats_log is not None else _env_flag("FAULTFS_STATS", False, env),
            cache_size=cache_size if cache_size is not None else _env_int("FAULTFS_CACHE_SIZE", 0, env),
            memory_mb=memory_mb if memory_mb is not None else _env_int("FAULTFS_MEMORY_MB", MEMORY_MB, env),
            prefetch_mb=prefetch_mb if prefetch_mb is not None else _env_int("FAULTFS_PREFETCH_MB", PREFETCH_MB, env),
            readahead_kb=readahead_kb if readahead_kb is not None else _env_int("FAULTFS_READAHEAD_KB", READAHEAD_KB, env),
            max_background=(max_background if max_background is not None
                            else _env_int("FAULTFS_MAX_BACKGROUND", MAX_BACKGROUND, env)),
            inline_read_kb=inline_read_kb if inline_read_kb is not None else _env_int("FAULTFS_INLINE_READ_KB", INLINE_READ_KB, env),
            read_only=read_only if read_only is not None else _env_flag("FAULTFS_READ_ONLY", False, env),
            xattrs=xattrs if xattrs is not None else _env_flag("FAULTFS_XATTRS", False, env),
            dirty_mb=dirty_mb if dirty_mb is not None else _env_int("FAULTFS_DIRTY_MB", DIRTY_MB, env),
            journal_mb=journal_mb if journal_mb is not None else _env_int("FAULTFS_JOURNAL_MB", JOURNAL_MB, env),
            shared_store=(shared_store if shared_store is not None
                          else (env_value("FAULTFS_SHARED_STORE", env) or "").strip()),
            shared_store_endpoint_url=(
                shared_store_endpoint_url if shared_store_endpoint_url is not None
                else (env_value("FAULTFS_SHARED_STORE_ENDPOINT_URL", env) or "").strip()),
            shared_store_key=(
                shared_store_key if shared_store_key is not None
                else (env_value("FAULTFS_SHARED_STORE_KEY", env) or "").strip()),
            shared_claims=(shared_claims if shared_claims is not None
                           else _env_flag("FAULTFS_SHARED_CLAIMS", True, env)),
            metrics_addr=(metrics_addr if metrics_addr is not None
                          else (env_value("FAULTFS_METRICS_ADDR", env) or "").strip()),
            uring=uring if uring is not None else _uring_mode(env),
            uring_punt=(uring_punt if uring_punt is not None
                        else _env_flag("FAULTFS_URING_PUNT", True, env)),
            fuse_fastwait=(fuse_fastwait if fuse_fastwait is not None
                           else _env_flag("FAULTFS_FUSE_FASTWAIT", True, env)),
            fuse_workers=(fuse_workers if fuse_workers is not None
                          else _env_int("FAULTFS_FUSE_WORKERS", FUSE_WORKERS, env)),
            fast_read=(fast_read if fast_read is not None
                       else _env_flag("FAULTFS_FAST_READ", True, env)),
            fast_read_threads=(fast_read_threads if fast_read_threads is not None
                               else _env_int("FAULTFS_FAST_READ_THREADS", FAST_READ_THREADS, env)),
            source_direct=(source_direct if source_direct is not None
                           else _env_flag("FAULTFS_SOURCE_DIRECT", True, env)),
            store_direct=(store_direct if store_direct is not None
                          else _env_flag("FAULTFS_STORE_DIRECT", True, env)),
        )


def _uring_mode(env: Mapping[str, str] | None) -> str:
    raw = (env_value("FAULTFS_URING", env) or "").strip().lower()
    if raw in ("", "1", "true", "yes", "on"):
        return "on"
    if raw in ("0", "false", "no", "off"):
        return "off"
    return raw  # "always", or a value __post_init__ refuses
