"""bench_s3_profile: sum up py-spy collapsed stacks (``scripts/bench_s3 --profile DIR``).

    .venv/bin/python scripts/bench_s3_profile.py DIR/faultfs-seq-1.txt [--top 25]

Prints, as shares of all running samples: the threads, the leaf functions (where the time is
spent), and the inclusive share of a few groups of frames that matter for the S3 read path
(the store write, hashing, the body read, botocore's request handling, pyfuse3/trio).
"""

from __future__ import annotations

import argparse
import collections
import re

GROUPS = {  # name -> regex over a frame "function (file:line)"
    "store write (tiers/local put, blobstore)": r"\(.*(tiers/local(/\w+)?|store/blob(store|file|read|write)|store/entries)\.py",
    "pwrite / write syscalls": r"^(pwrite|write|writev|_write)\b",
    "hashing (xxhash)": r"xxh|hash",
    "S3 body read (read_body_into)": r"read_body_into",
    "botocore request (get_object minus body)": r"\(.*botocore/",
    "urllib3 / http.client": r"\(.*(urllib3/|http/client\.py)",
    "aiohttp / aiobotocore": r"\(.*(aiohttp|aiobotocore)/",
    "pyfuse3 / trio loop": r"\(.*(pyfuse3|trio/)",
    "faultfs engine": r"\(.*faultfs/engine/",
}


def load(path: str) -> list[tuple[list[str], int]]:
    stacks = []
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            stack, _, count = line.rpartition(" ")
            stacks.append((stack.split(";"), int(count)))
    return stacks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    for path in args.files:
        stacks = load(path)
        total = sum(c for _, c in stacks) or 1
        threads: collections.Counter[str] = collections.Counter()
        leaves: collections.Counter[str] = collections.Counter()
        groups: collections.Counter[str] = collections.Counter()
        for frames, count in stacks:
            threads[re.sub(r"\s*\(?0x[0-9a-f]+\)?", "", frames[0])] += count
            leaves[frames[-1]] += count
            for name, pattern in GROUPS.items():
                if any(re.search(pattern, f) for f in frames[1:]):
                    groups[name] += count
        print(f"== {path}: {total} running samples")
        print("-- threads")
        for name, c in threads.most_common(8):
            print(f"{c / total:6.1%}  {name}")
        print("-- groups (inclusive)")
        for name, c in groups.most_common():
            print(f"{c / total:6.1%}  {name}")
        print("-- leaf frames")
        for name, c in leaves.most_common(args.top):
            print(f"{c / total:6.1%}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
