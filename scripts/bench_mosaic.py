"""MosaicML streaming's shuffles beside RecordStream's, for ``scripts/bench_stream --cases
shuffle --mosaic DIR``: the same JSON-lines shards written once as MDS (one ``bytes`` column
holding each line, the conversion timed on its own), then in a process of its own:
- a shuffled epoch (``StreamingDataset(shuffle=True, shuffle_seed=42)``, py1e, its default,
  and py1s), per sample as it is consumed, the first ``limit`` samples;
- resume at 10 / 50 / 90 % of a shuffled epoch of the resume shard: ``state_dict(n,
  from_beginning=True)``, then a new ``StreamingDataset``, ``load_state_dict`` and its first
  sample (building the dataset timed, as it reads its index file);
- the quality order of the sorted corpus (``(key, shard)`` of every sample of one epoch).

`streaming` is not a dependency: ``--mosaic DIR`` names a directory it is installed in
(``pip install --no-deps --target DIR mosaicml-streaming transformers safetensors tokenizers
cramjam pillow xxhash zstd python-snappy brotli catalogue``; its own dependencies would put a
CUDA torch over the CPU one). `streaming` imports torchvision for its vision datasets when it
is imported; where no torchvision build matches this torch, the child gives it a stand-in
module with the two names it imports (never called on the text path measured).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import importlib.machinery, json, shutil, statistics, sys, time, types
args = json.loads(sys.argv[1])
sys.path.insert(0, args["site"])
try:
    import torchvision  # noqa: F401
except Exception:  # no build matching this torch: a stand-in for streaming.vision's imports
    for name in list(sys.modules):
        if name.startswith("torchvision"):
            del sys.modules[name]
    tv = types.ModuleType("torchvision")
    ds, tr, fn = (types.ModuleType(f"torchvision.{n}") for n in
                  ("datasets", "transforms", "transforms.functional"))
    ds.VisionDataset = type("VisionDataset", (), {})
    def to_tensor(pic):
        raise RuntimeError("torchvision is a stand-in here")
    fn.to_tensor = to_tensor
    tv.datasets, tv.transforms, tr.functional = ds, tr, fn
    for mod in (tv, ds, tr, fn):  # find_spec (transformers asks) needs a spec
        mod.__spec__ = importlib.machinery.ModuleSpec(mod.__name__, None)
        sys.modules[mod.__name__] = mod
import streaming
from streaming import MDSWriter, StreamingDataset
from streaming.base.util import clean_stale_shared_memory

def convert(files, out):
    shutil.rmtree(out, ignore_errors=True)
    t = time.perf_counter()
    n = 0
    with MDSWriter(out=out, columns={"line": "bytes"}, size_limit=1 << 26) as w:
        for f in files:
            with open(f, "rb") as fh:
                for line in fh:
                    w.write({"line": line.rstrip(b"\n")})
                    n += 1
    return time.perf_counter() - t, n

def dataset(local, algo="py1e"):
    return StreamingDataset(local=local, shuffle=True, shuffle_seed=42, shuffle_algo=algo,
                            batch_size=args["batch"], num_canonical_nodes=1)

out = {"version": streaming.__version__}
work = args["work"]
out["convert"] = convert(args["files"], work + "/mds")
out["rate"] = {}
for algo in ("py1e", "py1s"):
    times = []
    for _ in range(args["runs"]):
        clean_stale_shared_memory()  # a dataset's shared memory left by the one before
        ds = dataset(work + "/mds", algo)
        t, n = time.perf_counter(), 0
        for sample in ds:
            n += 1
            if n >= args["limit"]:
                break
        times.append(time.perf_counter() - t)
        del ds
    out["rate"][algo] = (n, statistics.median(times))
out["resume_convert"] = convert([args["resume_file"]], work + "/mds-resume")
out["resume"] = {}
for frac in (0.1, 0.5, 0.9):
    target = int(out["resume_convert"][1] * frac)
    clean_stale_shared_memory()
    state = dataset(work + "/mds-resume").state_dict(target, True)
    times = []
    for _ in range(args["runs"]):
        clean_stale_shared_memory()
        t = time.perf_counter()
        ds = dataset(work + "/mds-resume")
        ds.load_state_dict(state)
        next(iter(ds))
        times.append(time.perf_counter() - t)
        del ds
    out["resume"][str(frac)] = statistics.median(times)
if args["sorted"]:
    convert(args["sorted"], work + "/mds-sorted")
    clean_stale_shared_memory()
    order = []
    for sample in dataset(work + "/mds-sorted"):
        rec = json.loads(sample["line"])
        order.append((rec["key"], rec["shard"]))
    out["order"] = order
clean_stale_shared_memory()
print(json.dumps(out))
"""


def run(site: str, work: Path, files: list[Path], resume_file: Path, sorted_files: list[Path],
        limit: int, runs: int, batch: int) -> dict:
    """The child's measurements (module doc); raises if `streaming` cannot run there."""
    work.mkdir(parents=True, exist_ok=True)
    args = {"site": site, "work": str(work), "files": [str(p) for p in files],
            "resume_file": str(resume_file), "sorted": [str(p) for p in sorted_files],
            "limit": limit, "runs": runs, "batch": batch}
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], capture_output=True,
                          text=True, timeout=3600)
    if done.returncode:
        raise RuntimeError(f"mosaicml streaming failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def tables(got: dict, rs_rate: float, rs_resume: dict[float, float], limit: int) -> list[str]:
    """Markdown tables of MosaicML streaming's numbers beside RecordStream's (``rs_rate``: its
    shuffled raw records/s; ``rs_resume``: its shuffled arrow restart seconds by fraction).
    Its quality order (``got["order"]``) goes into the quality table of the caller."""
    secs, n = got["convert"]
    lines = [f"### MosaicML streaming {got['version']} shuffled, beside RecordStream (MDS written "
             f"once from the same shards: {n:,} samples in {secs:.1f} s, not counted below)", "",
             "| reader | samples | seconds | records/s | RecordStream shuffled raw / it |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for algo, (count, t) in got["rate"].items():
        rate = count / t
        lines.append(f"| `StreamingDataset(shuffle=True, shuffle_algo=\"{algo}\")` per sample "
                     f"(first {limit:,}) | {count:,} | {t:.3f} | {rate / 1e6:.3f} M | "
                     f"{rs_rate / rate:.1f}x |")
    lines += ["", "| point | MosaicML `load_state_dict` + first sample (s) | RecordStream arrow, "
              "dedup=False (s) | MosaicML / RecordStream |", "| --- | ---: | ---: | ---: |"]
    for frac, t in got["resume"].items():
        rs = rs_resume[float(frac)]
        lines.append(f"| {float(frac):.0%} | {t:.4f} | {rs:.4f} | {t / rs:.1f}x |")
    return lines
