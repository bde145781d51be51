"""Make a store fixture with the faultfs installed in this venv (tests/test_store_compat_writes.py):
a tag over a local file with staged chunks, folded writes, user blobs (one renamed, one
unlinked), a grown and cut view, a reset chunk, a clone, then writes left in the journal by
kill -9 of the daemon. ``expected.json``: the sha256 of every name, read just before the kill.

    python tests/data/make_store_writes.py WORKDIR   # as root; then tar WORKDIR's store and
                                                     # expected.json (without store/log, lock)
"""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

work = sys.argv[1]
FAULTFS = [sys.executable, "-m", "faultfs.cli"]
SRC_DIR = "/tmp/faultfs-fixture-writes"  # the compat test puts the source here again
os.makedirs(SRC_DIR, exist_ok=True)
src = os.path.join(SRC_DIR, "field.bin")
store = os.path.join(work, "store")
mnt = os.path.join(work, "mnt")
os.makedirs(mnt, exist_ok=True)
data = bytes((i * 7 + i // 251) & 0xFF for i in range(70000))
with open(src, "wb") as f:
    f.write(data)


def run(*a):
    r = subprocess.run([*FAULTFS, *a], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout


def mount():
    first = [src, "--chunk-size", "4K"] if not os.path.exists(store) else []
    run("mount", *first[:1], mnt, "--store", store, "--reserve-mb", "0", *first[1:])


mount()
T = os.path.join(mnt, "field")
for i in (0, 3, 5):
    open(os.path.join(T, f"chunk_{i}"), "rb").read()  # staged
fd = os.open(os.path.join(T, "field.bin"), os.O_RDWR)
os.pwrite(fd, b"A" * 100, 10)            # chunk 0, staged base
os.pwrite(fd, b"B" * 5000, 8000)         # chunks 1-3
os.pwrite(fd, b"C" * 4096, 4096 * 6)     # chunk 6 whole (a direct file)
os.pwrite(fd, b"grown", 80000)           # past the source: the view grows
os.close(fd)
open(os.path.join(T, "notes.txt"), "w").write("first user blob\n")
open(os.path.join(T, "gone.txt"), "w").write("to be unlinked\n")
open(os.path.join(T, "old-name.txt"), "w").write("renamed\n")
run("umount", mnt)  # folds everything
mount()
run("clone", T, "snap")
os.rename(os.path.join(T, "old-name.txt"), os.path.join(T, "new-name.txt"))
os.unlink(os.path.join(T, "gone.txt"))
fd = os.open(os.path.join(T, "field.bin"), os.O_RDWR)
os.pwrite(fd, b"D" * 300, 4096 * 4 + 50)  # chunk 4
os.pwrite(fd, b"E" * 20, 4096 * 3 + 7)    # chunk 3 again
os.close(fd)
run("reset", T, "chunk_4")
fd = os.open(os.path.join(T, "field.bin"), os.O_RDWR)
os.pwrite(fd, b"F" * 64, 4096 * 2 + 1)    # chunk 2, after the reset: in the journal
os.ftruncate(fd, 75000)                   # cut the view (past the source still)
os.close(fd)
with open(os.path.join(T, "notes.txt"), "a") as f:
    f.write("appended, in the journal only\n")
S = os.path.join(mnt, "snap")
with open(os.path.join(S, "field.bin"), "r+b") as f:
    f.seek(123)
    f.write(b"snap wrote this")
expected = {}
for tag in ("field", "snap"):
    for name in sorted(os.listdir(os.path.join(mnt, tag))):
        with open(os.path.join(mnt, tag, name), "rb") as f:
            expected[f"{tag}/{name}"] = hashlib.sha256(f.read()).hexdigest()
pid = json.loads(open(os.path.join(mnt, ".faultfs", "stats")).read())["pid"]
os.kill(pid, signal.SIGKILL)
time.sleep(1)
subprocess.run(["fusermount3", "-u", "-z", mnt])
json.dump(expected, open(os.path.join(work, "expected.json"), "w"), indent=1, sort_keys=True)
print(len(expected), "names")
