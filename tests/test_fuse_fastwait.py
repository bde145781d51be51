"""The FUSE fast wait (``faultfs/fuse/fastwait.py``): a queued request is taken without a
pass through trio's I/O wait, a stock wait whose request another worker took waits again,
the hook is installed only where it can work and always put back, and real mounts serve the
right bytes through it to many readers and writers, unmount cleanly under load, and serve
the same with it switched off."""

from __future__ import annotations

import os
import random
import select
import signal
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor

import pytest
import trio

from faultfs.config import FAST_READ_THREADS, FUSE_WORKERS, Config
from faultfs.errors import InvalidInput
from faultfs.fuse import fastwait
from faultfs.stats import Stats

KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture
def pipe():
    r, w = os.pipe()
    yield r, w
    for fd in (r, w):
        try:
            os.close(fd)
        except OSError:
            pass


class Original:
    """A stand-in for pyfuse3's wait: runs ``steps`` in turn (each may write to the pipe),
    then answers True; answers ``answer`` once they run out."""

    def __init__(self, steps=(), answer: bool = True) -> None:
        self.steps = list(steps)
        self.answer = answer
        self.calls = 0

    async def __call__(self) -> bool:
        self.calls += 1
        await trio.lowlevel.checkpoint()
        if self.steps:
            return self.steps.pop(0)()
        return self.answer


def test_a_queued_request_is_taken_without_the_stock_wait(pipe):
    r, w = pipe
    os.write(w, b"x")
    stats = Stats()
    original = Original()
    fast = fastwait.FastWait(r, original, stats)
    assert trio.run(fast.wait) is True
    assert original.calls == 0
    assert stats.counters["fuse_fast_waits"] == 1 and stats.counters["fuse_waits"] == 0


def test_a_streak_of_fast_answers_ends_in_one_stock_wait(pipe):
    r, w = pipe
    os.write(w, b"x")  # stays queued: nobody reads the pipe
    stats = Stats()
    original = Original()
    fast = fastwait.FastWait(r, original, stats, streak=3)

    async def main():
        return [await fast.wait() for _ in range(8)]

    assert trio.run(main) == [True] * 8
    # 3 fast, 1 stock (the turn of trio's other tasks), 3 fast, 1 stock
    assert original.calls == 2
    assert stats.counters["fuse_fast_waits"] == 6 and stats.counters["fuse_waits"] == 2


def test_nothing_queued_waits_the_stock_way(pipe):
    r, w = pipe
    stats = Stats()
    original = Original([lambda: os.write(w, b"x") > 0])
    fast = fastwait.FastWait(r, original, stats)
    assert trio.run(fast.wait) is True
    assert original.calls == 1 and stats.counters["fuse_waits_lost"] == 0


def test_a_request_taken_by_another_worker_means_waiting_again(pipe):
    r, w = pipe
    # the first wake finds the pipe empty again (a fast worker read it), the second is real
    original = Original([lambda: True, lambda: os.write(w, b"x") > 0])
    stats = Stats()
    fast = fastwait.FastWait(r, original, stats)
    assert trio.run(fast.wait) is True
    assert original.calls == 2
    assert stats.counters["fuse_waits"] == 2 and stats.counters["fuse_waits_lost"] == 1
    assert select.select([r], [], [], 0)[0] == [r], "it returned with the request there"


def test_the_end_of_the_session_is_passed_on(pipe):
    r, _w = pipe
    fast = fastwait.FastWait(r, Original(answer=False), Stats())
    assert trio.run(fast.wait) is False


def test_a_hang_up_is_left_to_the_stock_wait(pipe):
    r, w = pipe
    os.write(w, b"x")
    os.close(w)  # POLLIN | POLLHUP: not a plain queued request
    original = Original(answer=False)
    fast = fastwait.FastWait(r, original, Stats())
    assert trio.run(fast.wait) is False
    assert original.calls == 1


async def _stock() -> bool:
    return True


@pytest.mark.parametrize("case", ["off", "no-fd", "no-hook", "not-a-coroutine"])
def test_the_hook_is_left_alone_where_the_fast_wait_cannot_work(pipe, case):
    r, _w = pipe
    module = types.SimpleNamespace()
    if case != "no-hook":
        module._wait_fuse_readable = (lambda: True) if case == "not-a-coroutine" else _stock
    before = dict(vars(module))
    with fastwait.installed(module, None if case == "no-fd" else r, Stats(),
                            enabled=case != "off") as fast:
        assert fast is None
        assert vars(module) == before
    assert vars(module) == before


def test_the_hook_is_installed_for_the_block_and_put_back_after_an_error(pipe):
    r, _w = pipe
    module = types.SimpleNamespace(_wait_fuse_readable=_stock)
    seen = []

    def serve() -> None:
        with fastwait.installed(module, r, Stats()) as fast:
            seen.append(fast is not None and module._wait_fuse_readable == fast.wait)
            raise RuntimeError("the serving loop failed")

    with pytest.raises(RuntimeError):
        serve()
    assert seen == [True]
    assert module._wait_fuse_readable is _stock


def test_the_hook_of_the_installed_pyfuse3_is_a_coroutine_function():
    """The fast wait relies on this name in pyfuse3; a version without it serves stock (the
    test above), and this test says so when the pin moves."""
    import inspect

    import pyfuse3

    assert inspect.iscoroutinefunction(getattr(pyfuse3, fastwait.HOOK, None))


@pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse on this machine")
def test_the_session_descriptor_is_the_one_new_dev_fuse_descriptor():
    before = fastwait.fuse_device_fds()
    first = os.open("/dev/fuse", os.O_RDWR)
    try:
        assert fastwait.session_fd(before) == first
        second = os.open("/dev/fuse", os.O_RDWR)
        try:
            assert fastwait.session_fd(before) is None, "two new ones: which is the session's?"
        finally:
            os.close(second)
    finally:
        os.close(first)
    assert fastwait.session_fd(before) is None


# --- through real mounts ----------------------------------------------------------------------


def _drop(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _read_randomly(path: str, data: bytes, count: int, seed: int, lo: int = 0,
                   hi: int | None = None) -> int:
    """``count`` reads of 4 KiB, 64 KiB or 1000 bytes at random offsets in ``[lo, hi)``,
    each dropped from the page cache first (so each is a request), checked against ``data``."""
    rng = random.Random(seed)
    hi = len(data) if hi is None else hi
    fd = os.open(path, os.O_RDONLY)
    try:
        for _ in range(count):
            size = rng.choice((4 * KiB, 64 * KiB, 1000))
            off = rng.randrange(lo, hi)
            os.posix_fadvise(fd, off, size, os.POSIX_FADV_DONTNEED)
            assert os.pread(fd, size, off) == data[off:off + size], f"bytes at {off}"
    finally:
        os.close(fd)
    return count


@pytest.mark.mount
@pytest.mark.parametrize(("on", "workers"), [(True, ""), (False, ""), (True, "1"), (True, "0")],
                         ids=["fastwait", "stock", "one-worker", "pyfuse3-workers"])
def test_many_readers_get_the_right_bytes(mounter, sample, on, workers):
    """With the fixed pool of workers (the default), with one worker (every request in turn:
    a read that waits for the ring holds the only worker, and must still be woken) and with
    pyfuse3's own pool."""
    src = sample(8 * MiB + 321)
    with open(src, "rb") as f:
        data = f.read()
    env = {"FAULTFS_FUSE_FASTWAIT": "1" if on else "0"}
    if workers:
        env["FAULTFS_FUSE_WORKERS"] = workers
    m = mounter(src, env=env)
    view = os.path.join(m.tag("field"), "field.bin")
    with ThreadPoolExecutor(8) as pool:
        done = sum(pool.map(lambda s: _read_randomly(view, data, 400, s), range(8)))
    assert done == 3200
    c = m.counters()
    if on:
        assert c["fuse_fast_waits"] > 0, "8 readers queue requests: some were taken fast"
    else:
        assert c["fuse_fast_waits"] == c["fuse_waits"] == 0


def _write_randomly(path: str, model: bytearray, lo: int, hi: int, seed: int) -> None:
    """Random writes inside ``[lo, hi)`` (one writer's own range), each read back at once;
    ``model`` gets the same bytes."""
    rng = random.Random(seed)
    fd = os.open(path, os.O_RDWR)
    try:
        for _ in range(200):
            size = rng.choice((4 * KiB, 512, 70 * KiB))
            off = rng.randrange(lo, hi - size)
            piece = rng.randbytes(size)
            assert os.pwrite(fd, piece, off) == size
            model[off:off + size] = piece
            os.posix_fadvise(fd, off, size, os.POSIX_FADV_DONTNEED)
            assert os.pread(fd, size, off) == piece
        os.fsync(fd)
    finally:
        os.close(fd)


@pytest.mark.mount
def test_many_writers_and_readers_at_once_keep_every_byte(mounter, sample):
    size = 8 * MiB
    src = sample(size)
    with open(src, "rb") as f:
        model = bytearray(f.read())
    m = mounter(src, args=["--chunk-size", "1M"])
    view = os.path.join(m.tag("field"), "field.bin")
    writers, span = 6, size // 8
    with ThreadPoolExecutor(8) as pool:
        jobs = [pool.submit(_write_randomly, view, model, k * span, (k + 1) * span, k)
                for k in range(writers)]
        # two readers of the part nobody writes
        jobs += [pool.submit(_read_randomly, view, bytes(model), 300, s, writers * span, size)
                 for s in (100, 101)]
        for job in jobs:
            job.result()
    _drop(view)
    with open(view, "rb") as f:
        assert f.read() == bytes(model)
    m.umount()
    m2 = mounter(store=m.store)
    with open(os.path.join(m2.tag("field"), "field.bin"), "rb") as f:
        assert f.read() == bytes(model)


@pytest.mark.mount
def test_sigterm_under_many_readers_ends_the_daemon(mounter, sample):
    src = sample(4 * MiB)
    m = mounter(src)
    view = os.path.join(m.tag("field"), "field.bin")
    stop = threading.Event()
    errors: list[BaseException] = []

    def hammer(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            try:
                fd = os.open(view, os.O_RDONLY)
            except OSError:
                return  # unmounted
            try:
                while not stop.is_set():
                    off = rng.randrange(4 * MiB - 4 * KiB)
                    os.posix_fadvise(fd, off, 4 * KiB, os.POSIX_FADV_DONTNEED)
                    os.pread(fd, 4 * KiB, off)
            except OSError:
                return  # ENOTCONN / ENODEV once it is gone
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)
                return
            finally:
                try:
                    os.close(fd)
                except OSError:
                    pass  # ENOTCONN: the daemon ended with it open

    threads = [threading.Thread(target=hammer, args=(s,), daemon=True) for s in range(6)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    assert m.counters()["fuse_fast_waits"] > 0
    os.kill(m.pid, signal.SIGTERM)  # the signal watcher gets its turn between fast streaks
    assert m.wait_gone(), "the daemon did not exit on SIGTERM while readers kept it busy"
    stop.set()
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive(), "a reader hung on the file system of a daemon that ended"
    assert not errors


def test_the_pool_of_workers_comes_from_the_environment_within_bounds():
    assert Config.build(env={}).fuse_workers == FUSE_WORKERS
    assert Config.build(env={"FAULTFS_FUSE_WORKERS": "0"}).fuse_workers == 0  # pyfuse3's own
    assert Config.build(env={"FAULTFS_FUSE_WORKERS": "8"}).fuse_workers == 8
    for bad in ("-1", "100000"):
        with pytest.raises(InvalidInput, match="FAULTFS_FUSE_WORKERS"):
            Config.build(env={"FAULTFS_FUSE_WORKERS": bad})


def test_the_fast_read_path_s_threads_come_from_the_environment_within_bounds():
    assert Config.build(env={}).fast_read_threads == FAST_READ_THREADS
    assert Config.build(env={"FAULTFS_FAST_READ_THREADS": "64"}).fast_read_threads == 64
    assert not Config.build(env={"FAULTFS_FAST_READ": "0"}).fast_read
    for bad in ("0", "65", "256"):  # 64 is what the compiled piece starts at most
        with pytest.raises(InvalidInput, match="FAULTFS_FAST_READ_THREADS"):
            Config.build(env={"FAULTFS_FAST_READ_THREADS": bad})
