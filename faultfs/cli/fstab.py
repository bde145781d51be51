"""``mount -t fuse.faultfs SRC MNT -o store=DIR,chunk_size=4M,…`` and fstab lines.

``mount(8)`` runs ``mount.fuse``, which runs ``faultfs SRC MNT -o OPTIONS``; ``mount.faultfs``
(installed with the package, for ``mount -t faultfs``) takes the same arguments. Both turn
into ``faultfs mount SRC MNT --store DIR --chunk-size 4M …``: each option ``name=value`` is
the flag ``--name value`` (underscores as dashes), a bare ``name`` the flag ``--name``; the
generic mount options (``rw``, ``nofail``, ``_netdev``, ``noauto``, ``x-systemd.*`` …) are
left to mount and systemd; ``ro`` is ``--read-only``. A source of ``none`` or ``faultfs``
remounts what the store has registered.
"""

from __future__ import annotations

from faultfs.errors import InvalidInput

VALUED = ("store", "tag", "chunk_size", "blob_prefix", "range", "format", "page_size",
          "reserve_mb", "cache_size", "dirty_mb", "journal_mb", "io_threads", "memory_mb", "prefetch_mb",
          "readahead_kb", "max_background", "inline_read_kb", "shared_store", "shared_store_endpoint_url",
          "shared_store_key",
          "metrics_addr", "s3_endpoint_url", "s3_region", "s3_profile", "uid", "gid", "umask",
          "file_mode", "dir_mode")
FLAGS = ("no_store", "read_only", "xattrs", "anon", "allow_other", "stats", "debug", "no_holder",
         "no_shared_claims")
GENERIC = {"rw", "dev", "nodev", "suid", "nosuid", "exec", "noexec", "auto", "noauto",
           "user", "nouser", "users", "owner", "group", "defaults", "nofail", "_netdev",
           "async", "atime", "noatime", "relatime", "strictatime", "nodiratime", "lazytime",
           "silent", "loud"}
NO_SOURCE = ("none", "faultfs")


def is_helper_call(argv: list[str]) -> bool:
    """``SRC MNT -o …`` (or ``SRC MNT``) rather than ``faultfs COMMAND …``."""
    return "-o" in argv[2:3] or (len(argv) == 2 and not argv[0].startswith("-")
                                 and argv[0] in NO_SOURCE)


def mount_argv(argv: list[str]) -> list[str]:
    """The ``faultfs mount`` arguments of a mount-helper call; InvalidInput when bad."""
    positional: list[str] = []
    options: list[str] = []
    args = iter(argv)
    for arg in args:
        if arg == "-o":
            value = next(args, None)
            if value is None:
                raise InvalidInput("-o needs a list of options")
            options.extend(o for o in value.split(",") if o)
        elif arg in ("-n", "-v", "-s"):  # no mtab, verbose, sloppy: nothing to do here
            continue
        elif arg.startswith("-"):
            raise InvalidInput(f"unknown mount helper argument {arg!r}")
        else:
            positional.append(arg)
    if len(positional) != 2:
        raise InvalidInput("usage: mount.faultfs SOURCE MOUNTPOINT [-o OPTIONS]")
    source, mountpoint = positional
    out = ["mount"]
    if source not in NO_SOURCE:
        out.append(source)
    out.append(mountpoint)
    for option in options:
        name, eq, value = option.partition("=")
        if name in GENERIC or name.startswith(("x-", "comment=")) or name == "comment":
            continue
        if name == "ro":
            out.append("--read-only")
        elif name in VALUED and eq:
            out += [f"--{name.replace('_', '-')}", value]
        elif name in FLAGS and not eq:
            out.append(f"--{name.replace('_', '-')}")
        else:
            raise InvalidInput(f"unknown faultfs mount option {option!r}")
    return out
