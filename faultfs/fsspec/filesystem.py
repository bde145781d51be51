"""``faultfs::<url>``: an fsspec file system over a target file system (S3, HTTP, local, any
fsspec protocol) whose reads go through a faultfs store that many processes share
(DESIGN §18). Listing, ``info``, globbing and ``find`` are the target's; every object opened
is pinned at the version it has now (S3 VersionId/ETag, HTTP validators, a local file's
identity — as the mount pins sources, ``faultfs.sources``) and read chunk by chunk through
the store: verified hits, one source read per blob per store, the free-space reserve, a cap
with least-recently-used eviction across processes, read-ahead for sequential readers.

    import fsspec, xarray
    with fsspec.open("faultfs::s3://bucket/run42/field.h5", faultfs={"store": "/scratch/ff"},
                     s3={"anon": True}) as f:
        ds = xarray.open_dataset(f, engine="h5netcdf")

Invariants:
- Read-only: every write (``open(..., "wb")``, ``rm``, ``mv``, ``put``, ``mkdir``, ...) is
  refused with one line naming a faultfs mount as the way to write.
- Bad options and URLs are refused in one line before anything is written.
- A file system used in a forked child (a DataLoader or Dask worker) builds its own pool
  and sources: nothing of the parent's threads is waited on.
"""

from __future__ import annotations

import errno
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from json.encoder import encode_basestring_ascii as _json_str
from typing import TYPE_CHECKING, Any, ClassVar

import fsspec
from fsspec.spec import AbstractBufferedFile

from faultfs.config import default_store_dir
from faultfs.core.context import MAX_CHUNK_SIZE
from faultfs.core.units import parse_size
from faultfs.errors import FaultfsError, InvalidInput
from faultfs.fsspec.claims import Claims
from faultfs.fsspec.mounted import MountTags
from faultfs.fsspec.objects import Counters, PinnedObject, Shared, tag_for
from faultfs.fsspec.pins import DEFAULT_PIN_TTL, PinRecords
from faultfs.fsspec.planning import PlannedFlights
from faultfs.fsspec.space import SharedSpace
from faultfs.sources import Source, SourceOptions, open_source
from faultfs.sources.secrets import persistable_src
from faultfs.store.blobstore import BlobStore

if TYPE_CHECKING:  # the shared tier's code (and trio under it) loads only when one is used
    from faultfs.fsspec.shared import SharedBlobs

try:  # fsspec >= 2025.9 marks file systems made to sit over another
    from fsspec.implementations.chained import ChainedFileSystem as _Base
except ImportError:  # pragma: no cover - older fsspec
    _Base = fsspec.AbstractFileSystem  # type: ignore[misc,assignment]

PROTOCOL = "faultfs"
DEFAULT_CHUNK = 4 << 20  # one source request per 4 MiB: a remote object's latency, amortized
MIN_CHUNK = 4 << 10
DEFAULT_RESERVE_MB = 512  # as the mount's FAULTFS_RESERVE_MB
DEFAULT_READ_AHEAD = 4  # chunks faulted ahead of a sequential reader, at most
DEFAULT_IO_THREADS = 16  # faults and read-aheads at once, per process
# what fsspec itself passes to every file system (its instance and listings caches)
FSSPEC_OPTIONS = frozenset({"skip_instance_cache", "use_listings_cache", "listings_expiry_time",
                            "max_paths", "fo", "asynchronous", "loop"})
WRITES_REFUSED = ("faultfs:: is read-only: {what} refused; write through a faultfs mount "
                  "(copy-on-write over the source) or to the target file system itself")


class OptionError(InvalidInput, ValueError):
    """A ``faultfs::`` option or URL that cannot be used (one line)."""


class ReadOnlyError(FaultfsError, PermissionError):
    """A write through ``faultfs::`` (one line naming the mount's writes)."""

    def __init__(self, what: str) -> None:
        FaultfsError.__init__(self, WRITES_REFUSED.format(what=what), errno.EROFS)


class FaultFileSystem(_Base):
    """The ``faultfs`` protocol; see the module docstring."""

    protocol: ClassVar[str] = PROTOCOL  # type: ignore[misc]
    root_marker = ""

    def __init__(self, target_protocol: str | None = None, target_options: dict | None = None,
                 fs: fsspec.AbstractFileSystem | None = None, store: str | None = None,
                 chunk_size: int | str = DEFAULT_CHUNK, reserve_mb: int = DEFAULT_RESERVE_MB,
                 cache_size: int | str = 0, read_ahead: int = DEFAULT_READ_AHEAD,
                 io_threads: int = DEFAULT_IO_THREADS, no_store: bool = False,
                 shared_store: str | None = None, shared_store_endpoint_url: str = "",
                 pin_ttl: float = DEFAULT_PIN_TTL, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - FSSPEC_OPTIONS)
        if unknown:
            raise OptionError(f"faultfs:: has no option {unknown[0]!r} (options: store, "
                              "chunk_size, cache_size, reserve_mb, read_ahead, io_threads, "
                              "no_store, shared_store, shared_store_endpoint_url, pin_ttl, "
                              "target_protocol, target_options)")
        kwargs.pop("fo", None)
        super().__init__(**kwargs)
        self.target, self.target_protocol, self.target_options = _target(
            target_protocol, target_options, fs)
        self._endpoint = _endpoint(self.target_protocol, self.target_options)
        self.chunk_size = _size(chunk_size, "chunk_size")
        if not MIN_CHUNK <= self.chunk_size <= MAX_CHUNK_SIZE:
            raise OptionError(f"faultfs:: chunk_size {self.chunk_size} is not in [4 KiB, 1 GiB]")
        self.cache_size = _size(cache_size, "cache_size")
        self.reserve_bytes = _count(reserve_mb, "reserve_mb") << 20
        self.read_ahead = _count(read_ahead, "read_ahead")
        self.io_threads = max(1, _count(io_threads, "io_threads"))
        self.store_enabled = not no_store
        if isinstance(pin_ttl, bool) or not isinstance(pin_ttl, (int, float)) or not (
                0 <= pin_ttl < float("inf")):
            raise OptionError(f"faultfs:: pin_ttl {pin_ttl!r} is not a number of seconds >= 0")
        self.pin_ttl = float(pin_ttl)
        if store is not None and not isinstance(store, (str, os.PathLike)):
            raise OptionError(f"faultfs:: store must be a local directory, not {store!r}")
        store_dir = os.fspath(store) if store is not None else default_store_dir()
        if "://" in store_dir or "::" in store_dir:
            raise OptionError(f"faultfs:: store {store_dir!r} must be a local directory "
                              "(a shared object store is the mount's --shared-store)")
        self.store_dir = os.path.abspath(os.path.expanduser(store_dir))
        if shared_store is not None and not isinstance(shared_store, str):
            raise OptionError(f"faultfs:: shared_store must be a URL, not {shared_store!r}")
        self.shared_store = shared_store or ""
        self.shared_store_endpoint_url = str(shared_store_endpoint_url or "")
        self._pid = -1
        self._shared: Shared | None = None
        self._here = threading.Lock()
        self._shared_here()  # the store is made or checked now: a bad one is refused here

        def _strip_protocol(path: str) -> str:  # per instance: each has its own target
            return self.target._strip_protocol(type(self)._strip_protocol(path))

        self._strip_protocol = _strip_protocol  # type: ignore[method-assign]

    @classmethod
    def _strip_protocol(cls, path: str) -> str:  # type: ignore[override]
        path = fsspec.core.stringify_path(path)
        for prefix in (f"{PROTOCOL}::", f"{PROTOCOL}://"):
            if path.startswith(prefix):
                path = path[len(prefix):]
        return path

    # -- the store, per process --------------------------------------------------------------

    def _shared_here(self) -> Shared:
        """This process's store, claims, space and pool (rebuilt in a forked child)."""
        with self._here:
            if self._shared is not None and self._pid == os.getpid():
                return self._shared
            store = BlobStore(self.store_dir)
            claims = Claims(store.root)
            if store.writable:
                claims.sweep()  # faults that died with their process: their temp files go
            space = SharedSpace(store, reserve_bytes=self.reserve_bytes,
                                cache_size=self.cache_size)
            pool = ThreadPoolExecutor(self.io_threads, thread_name_prefix="faultfs-fsspec")
            self._shared = Shared(store, claims, space, pool, Counters(), PinRecords(store.root),
                                  MountTags(store), self.store_enabled, self._tier(),
                                  planned=PlannedFlights(self.io_threads))
            self._pid = os.getpid()
            return self._shared

    def _tier(self) -> SharedBlobs | None:
        """The shared tier of ``shared_store``, checked (listed, written, read); one line when
        it cannot be used."""
        if not self.shared_store:
            return None
        from faultfs.fsspec.shared import SharedBlobs  # trio and the tiers: only for this
        from faultfs.tiers.objects import open_objects, probe

        try:
            objects = open_objects(self.shared_store, SourceOptions(),
                                   endpoint_url=self.shared_store_endpoint_url)
            probe(objects)
        except InvalidInput as exc:
            raise OptionError(f"faultfs:: {exc.message}") from None
        return SharedBlobs(objects)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait for this process's faults, store writes and publishes under way (they run
        behind the readers); True when all ended. A process exiting waits for them anyway."""
        return self._shared_here().drain(timeout)

    def stats(self) -> dict[str, int]:
        """What this file system did in this process: faults, hits, source bytes, stored ..."""
        return self._shared_here().stats.snapshot()

    def pin(self, path: str) -> PinnedObject:
        """``path`` opened at the version it has now (or had less than ``pin_ttl`` seconds
        ago, by any process of the store), read through the store."""
        path = self._checked(path)
        url = self.target.unstrip_protocol(path)
        options = SourceOptions(storage_options=dict(self.target_options))
        shared = self._shared_here()
        # the object's name: query values kept but credentials' (two URLs that differ in a
        # query value are two objects; ``display_url`` shows them alike: they shared a pin)
        named = persistable_src(url)
        # json.dumps([named, endpoint, chunk_size]) without its encoder's setup per process
        identity = f"[{_json_str(named)}, {_json_str(self._endpoint)}, {self.chunk_size}]"
        version = shared.pins.fresh(identity, self.pin_ttl)
        source: Source | Callable[[], Source]
        forget = None
        if version is None:
            try:
                source = open_source(url, options)
            except FaultfsError as exc:
                raise as_oserror(exc, path) from None
            version = source.pinned  # type: ignore[attr-defined]
            shared.pins.record(identity, version)
        else:
            source = functools.partial(open_source, url, options)
            forget = functools.partial(shared.pins.forget, identity, version)
            shared.stats.add("pins_reused")
        tag = tag_for(named, self._endpoint, version.to_text(), self.chunk_size)
        mounted = shared.mounts.find(url, version.size, self.chunk_size, version.to_text())
        return PinnedObject(source, tag, version.to_text(), version.size, self.chunk_size,
                            shared, forget=forget, mounted=mounted)

    def _checked(self, path: str) -> str:
        path = self._strip_protocol(path)
        if "\x00" in path:
            raise OptionError(f"faultfs:: path {path!r} contains a NUL byte")
        if "::" in path:
            raise OptionError(f"faultfs:: path {path!r} chains another protocol: give it as "
                              "target_protocol")
        return path

    # -- reads -------------------------------------------------------------------------------

    def _open(self, path: str, mode: str = "rb", block_size: int | None = None,
              autocommit: bool = True, cache_options: dict | None = None,
              **kwargs: Any) -> FaultFile:
        if mode != "rb":
            raise ReadOnlyError(f"open({path!r}, {mode!r})")
        obj = self.pin(path)
        return FaultFile(self, self._strip_protocol(path), obj, block_size=block_size,
                         cache_type=kwargs.get("cache_type", "none"),
                         cache_options=cache_options)

    def cat_ranges(self, paths: list[str], starts: list[int] | int, ends: list[int] | int,
                   max_gap: int | None = None, on_error: str = "return",
                   **kwargs: Any) -> list[bytes | Exception]:
        """Byte ranges of objects, each object pinned once for all its ranges."""
        if isinstance(starts, int):
            starts = [starts] * len(paths)
        if isinstance(ends, int):
            ends = [ends] * len(paths)
        if not len(paths) == len(starts) == len(ends):
            raise OptionError("faultfs:: cat_ranges needs as many starts and ends as paths")
        pinned: dict[str, PinnedObject | Exception] = {}
        out: list[bytes | Exception] = []
        for path, start, end in zip(paths, starts, ends, strict=True):
            if path not in pinned:
                try:
                    pinned[path] = self.pin(path)
                except Exception as exc:
                    if on_error == "raise":
                        raise
                    pinned[path] = exc
            obj = pinned[path]
            if isinstance(obj, Exception):
                out.append(obj)
                continue
            lo = 0 if start is None else (start if start >= 0 else max(0, obj.size + start))
            hi = obj.size if end is None else (end if end >= 0 else max(0, obj.size + end))
            try:
                out.append(obj.read(lo, hi))
            except Exception as exc:
                if on_error == "raise":
                    raise
                out.append(exc)
        for obj in pinned.values():
            if isinstance(obj, PinnedObject):
                obj.close()
        return out

    # -- the target's: listings and metadata ---------------------------------------------------

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list:
        return self.target.ls(self._checked(path), detail=detail, **kwargs)

    def info(self, path: str, **kwargs: Any) -> dict:
        return self.target.info(self._checked(path), **kwargs)

    def find(self, path: str, maxdepth: int | None = None, withdirs: bool = False,
             detail: bool = False, **kwargs: Any) -> Any:
        return self.target.find(self._checked(path), maxdepth=maxdepth, withdirs=withdirs,
                                detail=detail, **kwargs)

    def glob(self, path: str, maxdepth: int | None = None, **kwargs: Any) -> Any:
        return self.target.glob(self._checked(path), maxdepth=maxdepth, **kwargs)

    def exists(self, path: str, **kwargs: Any) -> bool:
        return self.target.exists(self._checked(path), **kwargs)

    def isdir(self, path: str) -> bool:
        return self.target.isdir(self._checked(path))

    def isfile(self, path: str) -> bool:
        return self.target.isfile(self._checked(path))

    def ukey(self, path: str) -> str:
        return self.target.ukey(self._checked(path))

    def unstrip_protocol(self, name: str) -> str:
        return f"{PROTOCOL}::{self.target.unstrip_protocol(name)}"

    # -- writes: refused -------------------------------------------------------------------------

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        raise ReadOnlyError(f"pipe_file({path!r})")

    def put_file(self, lpath: str, rpath: str, callback: Any = None, mode: str = "overwrite",
                 **kwargs: Any) -> None:
        raise ReadOnlyError(f"put_file({rpath!r})")

    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        raise ReadOnlyError(f"cp_file({path2!r})")

    def mv(self, path1: str, path2: str, recursive: bool = False, maxdepth: int | None = None,
           **kwargs: Any) -> None:
        raise ReadOnlyError(f"mv({path1!r})")

    def rm(self, path: str, recursive: bool = False, maxdepth: int | None = None) -> None:
        raise ReadOnlyError(f"rm({path!r})")

    def rm_file(self, path: str) -> None:
        raise ReadOnlyError(f"rm_file({path!r})")

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        raise ReadOnlyError(f"mkdir({path!r})")

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        raise ReadOnlyError(f"makedirs({path!r})")

    def rmdir(self, path: str) -> None:
        raise ReadOnlyError(f"rmdir({path!r})")

    def touch(self, path: str, truncate: bool = True, **kwargs: Any) -> None:
        raise ReadOnlyError(f"touch({path!r})")


class FaultFile(AbstractBufferedFile):
    """An object open for reading at its pinned version: fsspec's buffered file (seek,
    read, readinto, readline ...), fetching ranges through the store."""

    def __init__(self, fs: FaultFileSystem, path: str, obj: PinnedObject, *,
                 block_size: int | None, cache_type: str, cache_options: dict | None) -> None:
        self._obj = obj
        self._next = -1  # where the last fetch ended: a fetch from there is sequential
        self._ahead = 0
        super().__init__(fs, path, mode="rb", block_size=block_size or obj.chunk_size,
                         cache_type=cache_type, cache_options=cache_options, size=obj.size)
        self._direct = self.cache.name == "none"  # reads go to the store as they come

    def _fetch_range(self, start: int, end: int) -> bytes:
        try:
            return self._obj.read(start, end, ahead=self._sequential(start, end))
        except FaultfsError as exc:
            raise as_oserror(exc, self.path) from None

    def _sequential(self, start: int, end: int) -> int:
        """The read-ahead for a read of ``[start, end)``: doubled for a read where the last
        ended (or from the start), up to ``read_ahead`` chunks; none for a jump."""
        if start == self._next or start == 0:  # a read from the start is taken as sequential
            self._ahead = min(max(1, self._ahead * 2), self.fs.read_ahead)
        else:
            self._ahead = 0
        self._next = end
        return self._ahead

    def read(self, length: int = -1) -> bytes:
        """fsspec's ``read`` without its cache layer when there is none to use (the default,
        ``cache_type="none"``: a hit is a pread of a blob file, already in the page cache, so
        a second buffer in front of it would only copy) — and without the statistics string
        fsspec formats for its debug log on every read."""
        if self._direct:
            length = -1 if length is None else int(length)
            if length < 0:
                length = self.size - self.loc
            if self.closed:
                raise ValueError("I/O operation on closed file.")
            if length <= 0 or self.loc >= self.size:
                return b""
            out = self._fetch_range(self.loc, self.loc + length)
            self.loc += len(out)
            return out
        return super().read(length)  # type: ignore[no-any-return]

    def readinto(self, b: Any) -> int:
        """fsspec's ``readinto`` reads and then copies; without a cache layer a hit is read
        straight into ``b`` (h5py and numpy read this way)."""
        if not self._direct:
            return super().readinto(b)  # type: ignore[no-any-return]
        if self.closed:
            raise ValueError("I/O operation on closed file.")
        out = memoryview(b).cast("B")
        start = self.loc
        end = min(start + len(out), self.size)
        if end <= start:
            return 0
        try:
            got = self._obj.read_into(start, out[:end - start],
                                      ahead=self._sequential(start, end))
        except FaultfsError as exc:
            raise as_oserror(exc, self.path) from None
        self.loc += got
        return got

    def close(self) -> None:
        super().close()
        self._obj.close()


def as_oserror(exc: FaultfsError, path: str) -> OSError:
    """A library error as the OSError an fsspec caller expects (FileNotFoundError for a
    missing object ...), with its one-line message."""
    if isinstance(exc, OSError):
        return exc
    return OSError(exc.errno, exc.message, path)  # picks the subclass (ENOENT: FileNotFound)


def _target(protocol: str | None, options: dict | None, fs: fsspec.AbstractFileSystem | None
            ) -> tuple[fsspec.AbstractFileSystem, str, dict]:
    if fs is not None:
        if protocol is not None:
            raise OptionError("faultfs:: takes a target file system (fs) or a target_protocol, "
                              "not both")
        name = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        return fs, name, dict(fs.storage_options)
    if not protocol or not isinstance(protocol, str):
        raise OptionError("faultfs:: needs a target: a chained URL (faultfs::s3://bucket/key) "
                          "or target_protocol=")
    if protocol == PROTOCOL:
        raise OptionError("faultfs:: cannot sit over itself")
    if options is not None and not isinstance(options, dict):
        raise OptionError(f"faultfs:: target_options must be a dict, not {type(options).__name__}")
    options = dict(options or {})
    try:
        target = fsspec.filesystem(protocol, **options)
    except ValueError as exc:
        raise OptionError(f"faultfs:: target protocol {protocol!r}: {exc}") from None
    except ImportError as exc:
        raise OptionError(f"faultfs:: target protocol {protocol!r} needs a package that is not "
                          f"installed: {exc}") from None
    except TypeError as exc:
        raise OptionError(f"faultfs:: target options for {protocol!r}: {exc}") from None
    return target, protocol, options


def _endpoint(protocol: str, options: dict) -> str:
    """Where an S3 object lives beyond its URL (two endpoints may both have s3://b/k)."""
    if protocol not in ("s3", "s3a"):
        return ""
    client = options.get("client_kwargs") or {}
    return str(options.get("endpoint_url") or client.get("endpoint_url")
               or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
               or "")


def _size(value: int | str, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise OptionError(f"faultfs:: {what} {value!r} is not a size (try 4M)")
    try:
        return parse_size(str(value), f"faultfs:: {what}")
    except InvalidInput as exc:
        raise OptionError(exc.message) from None


def _count(value: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise OptionError(f"faultfs:: {what} {value!r} is not a whole number >= 0")
    return value
