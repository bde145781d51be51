"""Claims of windows of blobs in a shared store (DESIGN §17), without a mount: the claim
object's bytes, the directory store's conditional operations under racing threads, and the
claim board's decisions (who fetches, who waits, who takes over) between boards standing for
nodes, each with its own node id, over one directory."""

from __future__ import annotations

import threading
import time

import pytest
import trio

from faultfs.errors import CorruptionError
from faultfs.stats import Stats
from faultfs.tiers.base import TierTag, version_hash
from faultfs.tiers.claimboard import ClaimBoard, sweep
from faultfs.tiers.claims import Claim, DirectoryClaims, open_claims, probe_claims
from faultfs.tiers.objects import LocalObjects

MiB = 1 << 20
TAG = TierTag(id=1, name="field", version="v1", num_blobs=64, blob_size=MiB,
              blob_name=lambda i: f"chunk_{i}", blob_index=lambda s: None,
              key="fault:0123456789abcdef")


def test_claim_bytes_are_pinned():
    raw = Claim("host-1-ab", 3, 1_700_000_000_123, 8, 4).encode()
    assert raw == (b'{"count":4,"deadline_ms":1700000000123,"done":"0","first":8,"gen":3,'
                   b'"node":"host-1-ab","state":"fetching","v":2}'), \
        "claim format changed: bump the version"
    assert Claim.decode(raw) == Claim("host-1-ab", 3, 1_700_000_000_123, 8, 4)
    done = Claim("n", 1, 5, 0, 1, published=True, done=0b1011_0000_0001)
    assert done.encode() == (b'{"count":1,"deadline_ms":5,"done":"b01","first":0,"gen":1,'
                             b'"node":"n","state":"published","v":2}')
    assert Claim.decode(done.encode()) == done
    assert done.published_of(16, [15, 16, 17, 20, 24, 27, 28]) == [16, 24, 27]


@pytest.mark.parametrize(("raw", "why"), [
    (b'{"count":4,"deadline_ms":1,"first":8,"gen":3,"node":"n","state":"fetching","v":1}', "unknown version"),
    (b'{"count":4,"deadline_ms":1,"done":"0","first":8,"gen":3,"node":"n","state":"fetching"}', "unknown version"),
    (b'{"count":-1,"deadline_ms":1,"done":"0","first":8,"gen":3,"node":"n","state":"fetching","v":2}', "wrong fields"),
    (b'{"count":4,"deadline_ms":1,"done":"0","first":8,"gen":true,"node":"n","state":"fetching","v":2}', "wrong fields"),
    (b'{"count":4,"deadline_ms":1,"done":"0","first":8,"gen":3,"node":"n","state":"done","v":2}', "wrong fields"),
    (b'{"count":4,"deadline_ms":1,"first":8,"gen":3,"node":"n","state":"fetching","v":2}', "wrong fields"),
    (b'{"count":4,"deadline_ms":1,"done":"0f","first":8,"gen":3,"node":"n","state":"fetching","v":2}', "wrong fields"),
    (b'{"count":4,"deadline_ms":1,"done":"-1","first":8,"gen":3,"node":"n","state":"fetching","v":2}', "wrong fields"),
    (b'{"count":4,"deadline_ms":1,"done":15,"first":8,"gen":3,"node":"n","state":"fetching","v":2}', "wrong fields"),
    (b'{"count":4,"deadline_ms":1,"fir', "not JSON"),
    (b"\xff\xfe", "not JSON"),
    (b"x" * 5000, "5000 bytes"),
])
def test_a_torn_or_foreign_claim_object_is_a_clear_error(raw, why):
    with pytest.raises(CorruptionError, match=why):
        Claim.decode(raw)


def test_directory_claims_create_once_and_replace_only_what_was_read(tmp_path):
    store = DirectoryClaims(LocalObjects(str(tmp_path)))
    first = store.create("claims/a/b/0", b"one")
    assert first is not None and store.create("claims/a/b/0", b"two") is None
    assert store.read("claims/a/b/0") == (b"one", first)
    assert store.replace("claims/a/b/0", b"two", "0-0-0") is None
    assert store.read("claims/a/b/0")[0] == b"one"  # a lost replace put it back
    second = store.replace("claims/a/b/0", b"two", first)
    assert second is not None and store.read("claims/a/b/0")[0] == b"two"
    assert store.replace("claims/a/b/0", b"three", first) is None  # stale tag
    store.delete("claims/a/b/0")
    assert store.read("claims/a/b/0") is None and store.list("claims/") == []
    assert probe_claims(store)


@pytest.mark.parametrize("op", ["create", "replace"])
def test_of_threads_racing_for_one_claim_exactly_one_wins(tmp_path, op):
    store = DirectoryClaims(LocalObjects(str(tmp_path)))
    old = store.create("claims/k/v/0", b"old") if op == "replace" else None
    start = threading.Barrier(8)
    wins = []

    def race(i: int) -> None:
        start.wait()
        body = f"node-{i}".encode()
        got = store.create("claims/k/v/0", body) if op == "create" else \
            store.replace("claims/k/v/0", body, old)
        if got is not None:
            wins.append(body)

    threads = [threading.Thread(target=race, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1 and store.read("claims/k/v/0")[0] == wins[0]
    assert [k for k in store.list("claims/")] == ["claims/k/v/0"]  # no temporary left


class IgnoringClaims(DirectoryClaims):
    """A store that ignores the conditions (some S3 look-alikes do): every create wins."""

    def create(self, key, data):
        self.objects.put(key, data)
        return self.read(key)[1]


def test_a_store_that_ignores_conditions_is_found_out_and_claims_are_off(tmp_path):
    assert not probe_claims(IgnoringClaims(LocalObjects(str(tmp_path))))
    store, note = open_claims(LocalObjects(str(tmp_path)))
    assert store is not None and "exclusive creates" in note
    store, note = open_claims(LocalObjects(str(tmp_path)), enabled=False)
    assert store is None and "claims off" in note
    assert LocalObjects(str(tmp_path)).list("claims/") == []


# -- the board ---------------------------------------------------------------------------


class Cluster:
    """Boards standing for nodes over one directory, and the blob objects they publish."""

    def __init__(self, root: str) -> None:
        self.store = DirectoryClaims(LocalObjects(root))
        self.blobs: dict[int, bytes] = {}
        self.fetches: list[tuple[str, int]] = []
        self.asked: list[int] = []  # blobs the boards loaded (a GET each on a store)

    def board(self, name: str) -> ClaimBoard:
        return ClaimBoard(self.store, Stats(), node=name)

    async def load(self, indices: list[int]) -> dict:
        self.asked.extend(indices)
        return {i: self.blobs[i] for i in indices if i in self.blobs}

    def marker_key(self, window: int = 0) -> str:
        return f"claims/0123456789abcdef/{version_hash('v1')}/{window}"

    def marker(self, window: int = 0) -> Claim:
        """The claim object of ``window`` (of TAG): after a release, the window's marker."""
        return Claim.decode(self.store.read(self.marker_key(window))[0])

    async def fault(self, board: ClaimBoard, indices: list[int], fetch_s: float = 0.05,
                    die: bool = False, ahead: bool = False) -> dict[int, bytes]:
        """What a node's fault does: coordinate, fetch what is left (each blob lands when
        fetched: ``fetch_s`` each), publish, release."""
        got, held = await board.coordinate(TAG, indices, self.load, ahead=ahead)
        out = dict(got)
        left = [i for i in indices if i not in got]
        for i in left:
            await trio.sleep(fetch_s)
            if die:
                return out  # a killed claimer: nothing published, nothing released
            self.fetches.append((board.node, i))
            self.blobs[i] = out[i] = f"blob {i}".encode()
        await board.release(held, fetched=left)
        return out


def test_nodes_claiming_one_window_at_once_fetch_it_once(tmp_path):
    c = Cluster(str(tmp_path))
    boards = [c.board(f"n{i}") for i in range(4)]
    results = {}

    async def main():
        async with trio.open_nursery() as nursery:
            for b in boards:
                async def one(b=b):
                    results[b.node] = await c.fault(b, [0, 1, 2], fetch_s=0.2)
                nursery.start_soon(one)

    trio.run(main)
    assert sorted(i for _, i in c.fetches) == [0, 1, 2]  # once, by one node
    assert all(r == {i: f"blob {i}".encode() for i in (0, 1, 2)} for r in results.values())
    assert sum(b.stats.counters["claims_won"] for b in boards) == 1
    assert sum(b.stats.counters["claim_waits"] for b in boards) == 3
    assert sum(b.stats.counters["claims_released"] for b in boards) == 1
    marker = c.marker()  # released: the window's marker names the blobs published
    assert marker.published and marker.published_of(0, list(range(8))) == [0, 1, 2]
    # the waiters rang the holder's mailbox (a holder that held its publishes back sends them)
    holder = c.fetches[0][0]
    assert c.store.list("claims/wanted/") == [f"claims/wanted/{holder}"]
    assert all(b.mailbox.company for b in boards if b.node != holder)


def test_an_expired_claim_is_taken_over_by_exactly_one_of_three_nodes(tmp_path):
    c = Cluster(str(tmp_path))
    dead = c.board("dead")
    boards = [c.board(f"n{i}") for i in range(3)]

    async def main():
        await c.fault(dead, [5], die=True)  # claimed, then killed: its claim stays
        assert len(c.store.list("claims/")) == 1
        async with trio.open_nursery() as nursery:
            for b in boards:
                nursery.start_soon(c.fault, b, [5])

    started = time.monotonic()
    trio.run(main)
    assert c.fetches == [(c.fetches[0][0], 5)]  # one fetch besides the dead node's
    # one node holds the window next: by a takeover, or (a directory's takeover moves the
    # expired claim aside before it creates its own) by a create in that moment
    assert sum(b.stats.counters["claims_won"] for b in boards) == 1
    assert sum(b.stats.counters["claim_takeovers"] for b in boards) <= 1
    assert time.monotonic() - started < dead.lease(MiB) + 2  # bounded by the dead claim's lease
    assert c.marker().published_of(0, list(range(8))) == [5]


def test_a_taker_finds_the_blobs_its_predecessor_published_without_a_mark(tmp_path):
    """A holder that fetched and published blobs 1 and 2 under its claim, then died before
    it released it (no marker names them): the node that takes the window over looks in the
    store for each blob its later faults of the window need, not only for the first one's,
    and its marker names what it found. Before, a later fault trusted the window's index
    (empty) and fetched blob 2 from the source a second time."""
    c = Cluster(str(tmp_path))
    dead, taker, third = c.board("dead"), c.board("taker"), c.board("third")

    async def main():
        await c.fault(dead, [0], die=True)  # claimed, then killed: its claim stays
        for i in (1, 2):  # ... after it had published these (its claim grown to them)
            c.blobs[i] = f"blob {i}".encode()
        await trio.sleep(dead.lease(MiB) + 0.1)
        _, held = await taker.coordinate(TAG, [0], c.load)  # takes the window over
        assert held and held[0].unindexed
        got, more = await taker.coordinate(TAG, [2, 3], c.load)  # a later fault: joins
        assert got == {2: b"blob 2"} and more == held
        for i in (0, 3):
            c.fetches.append(("taker", i))
            c.blobs[i] = f"blob {i}".encode()
        await taker.release(held + more, fetched=[0, 3])
        assert c.marker().published_of(0, list(range(8))) == [0, 2, 3]
        # a node after them loads what the marker names, without a claim of its own
        assert await c.fault(third, [2, 3]) == {2: b"blob 2", 3: b"blob 3"}

    trio.run(main)
    assert c.fetches == [("taker", 0), ("taker", 3)]
    assert taker.stats.counters["claim_takeovers"] == 1
    assert third.stats.counters["claims_won"] == 0


def test_a_holders_renewals_name_what_it_published_so_its_taker_passes_them_on(tmp_path):
    """A holder whose claim lives on for one fault after another published its blobs names
    those blobs at its next renewal; killed then, its taker's claim carries them on, and a
    node after both loads them from the store. Before, only a release named them: blobs of
    a holder taken over stayed unnamed unless a fault of the taker looked for them, and the
    node after fetched them from the source again."""
    c = Cluster(str(tmp_path))
    holder, taker, third = c.board("holder"), c.board("taker"), c.board("third")

    async def main():
        with trio.CancelScope() as life:  # the holder's life: its renewals run in it
            async with trio.open_nursery() as nursery:
                holder.attach(nursery)
                holder.mailbox.company = True  # renews at its node's pace
                await holder.coordinate(TAG, [0], c.load)  # a fault that never ends
                _, second = await holder.coordinate(TAG, [1, 2], c.load)  # joins the claim
                for i in (1, 2):
                    c.fetches.append(("holder", i))
                    c.blobs[i] = f"blob {i}".encode()
                await holder.release(second, fetched=[1, 2])  # published; the claim lives on
                renewed = holder.stats.counters["claims_renewed"]
                for _ in range(500):  # its next renewal (about half a second on)
                    if holder.stats.counters["claims_renewed"] > renewed:
                        break
                    await trio.sleep(0.02)
                life.cancel()  # killed: no release, no more renewals
        live = c.marker()
        assert not live.published and live.published_of(0, list(range(8))) == [1, 2]
        await trio.sleep(max(0.0, live.deadline_ms / 1000 - time.time()) + 0.1)
        _, held = await taker.coordinate(TAG, [0], c.load)  # takes the window over
        assert held and held[0].claim.node == "taker"
        c.fetches.append(("taker", 0))
        c.blobs[0] = b"blob 0"
        await taker.release(held, fetched=[0])
        assert c.marker().published_of(0, list(range(8))) == [0, 1, 2]
        assert await c.fault(third, [1, 2]) == {1: b"blob 1", 2: b"blob 2"}

    trio.run(main)
    assert c.fetches == [("holder", 1), ("holder", 2), ("taker", 0)]
    assert taker.stats.counters["claim_takeovers"] == 1


def test_a_holder_taken_over_before_its_end_leaves_the_takers_claim_and_counts_no_release(
        tmp_path):
    """A holder cut off past its deadline (it renewed nothing) ends its claim after another
    node took the window over: its conditional replace loses, the taker's claim stays as it
    is, and the holder does not count the claim as released (it was not its to release)."""
    c = Cluster(str(tmp_path))
    holder, taker = c.board("holder"), c.board("taker")

    async def main():
        _, held = await holder.coordinate(TAG, [0], c.load)  # not attached: no renewals
        await trio.sleep(holder.lease(MiB) + 0.1)
        _, taken = await taker.coordinate(TAG, [0], c.load)
        assert taken and taken[0].claim.node == "taker"
        c.blobs[0] = b"blob 0"
        await holder.release(held, fetched=[0])  # too late: not its claim any more
        claim, _ = c.store.read(c.marker_key())
        assert Claim.decode(claim).node == "taker" and not Claim.decode(claim).published
        await taker.release(taken, fetched=[])

    trio.run(main)
    assert holder.stats.counters["claims_released"] == 0
    assert taker.stats.counters["claim_takeovers"] == 1
    assert taker.stats.counters["claims_released"] == 1


def test_a_waiter_takes_over_a_live_slow_claim_after_its_own_estimate(tmp_path):
    c = Cluster(str(tmp_path))
    slow, waiter = c.board("slow"), c.board("waiter")
    slow._seconds_per_byte = 1e-5  # a slow node: its lease is ~21 s
    waiter.observe(MiB, 0.1)  # the waiter has measured its own source: fast
    out = {}

    async def main():
        async with trio.open_nursery() as nursery:
            async def claimer():
                _, held = await slow.coordinate(TAG, [3], c.load)
                await trio.sleep(4.0)
                await slow.release(held)
            nursery.start_soon(claimer)
            await trio.sleep(0.05)
            started = time.monotonic()
            out["got"] = await c.fault(waiter, [3])
            out["waited"] = time.monotonic() - started

    trio.run(main)
    assert out["got"] == {3: b"blob 3"} and c.fetches == [("waiter", 3)]
    assert waiter.stats.counters["claim_waits_given_up"] == 1
    assert waiter.stats.counters["claim_takeovers"] == 1
    # its own bound (doubled: the first wait on a holder, which may have held its publishes
    # back until told), not the slow node's lease
    assert out["waited"] < 2 * waiter.lease(MiB) + 1 < slow.lease(MiB)


def test_a_waiter_gives_up_on_a_live_slow_holder_by_fetching_its_blob_not_the_window(
        tmp_path):
    """A holder that renews its claim (alive) but is slower than the waiter's own estimate:
    the waiter fetches its blob itself after its bound and leaves the claim to its holder,
    which goes on (no takeover: a taken-over holder that has not noticed yet and its taker
    would both fetch the window's next blobs). The waiter's other blobs named by the claim
    are still waited for, and it never waits past its own estimate."""
    c = Cluster(str(tmp_path))
    holder, waiter = c.board("holder"), c.board("waiter")
    waiter.observe(MiB, 0.1)  # the waiter has measured its own source: fast
    out = {}

    async def main():
        async with trio.open_nursery() as nursery:
            holder.attach(nursery)
            holder.mailbox.company = True  # its lease: its estimate, renewed every ~0.6 s
            nursery.start_soon(c.fault, holder, [3], 4.0)  # alive, and slow
            await trio.sleep(0.05)
            started = time.monotonic()
            out["got"] = await c.fault(waiter, [3])
            out["waited"] = time.monotonic() - started
            assert c.marker().node == "holder" and not c.marker().published

    trio.run(main)
    assert out["got"] == {3: b"blob 3"}
    assert out["waited"] < 2 * waiter.lease(MiB) + 1  # its own bound, doubled for the ring
    assert waiter.stats.counters["claim_waits_given_up"] == 1
    assert waiter.stats.counters["claim_takeovers"] == 0
    assert holder.stats.counters["claims_renewed"] >= 1
    assert sorted(c.fetches) == [("holder", 3), ("waiter", 3)]  # the one blob, once more
    assert c.marker().published_of(0, list(range(8))) == [3]  # the holder's marker


def test_a_lone_holder_mid_fetch_hears_a_ring_and_is_not_taken_over_live(tmp_path):
    """A holder alone (its claim made with the long lone lease, renewed every 2 s) and slow,
    with no publish held back yet: a waiter that comes rings it. The holder hears the ring
    within a mailbox look (it looks while it holds claims alone, not only with publishes held
    back), renews at company pace, and the waiter, whose bound passes, sees it live: it
    fetches its blob itself and leaves the claim (its first version took the live holder
    over: both would then fetch the window's next blobs)."""
    c = Cluster(str(tmp_path))
    holder, waiter = c.board("holder"), c.board("waiter")
    waiter.observe(MiB, 0.1)  # measured: its bound is its own (~1.2 s; doubled once for the ring)
    out = {}

    async def main():
        async with trio.open_nursery() as nursery:
            holder.attach(nursery)  # alone: nothing has rung it, nothing is held back
            nursery.start_soon(c.fault, holder, [3], 5.0)  # alive, and slow
            await trio.sleep(1.0)  # between the lone claim's renewals (every 2 s)
            out["got"] = await c.fault(waiter, [3])

    trio.run(main)
    assert out["got"] == {3: b"blob 3"}
    assert holder.mailbox.company, "the holder heard the ring"
    assert waiter.stats.counters["claim_waits_given_up"] == 1
    assert waiter.stats.counters["claim_takeovers"] == 0
    assert sorted(c.fetches) == [("holder", 3), ("waiter", 3)]


def test_a_whole_window_claim_on_a_slow_source_renews_within_a_one_blob_waiters_bound(
        tmp_path):
    """In company a holder of a whole window (8 blobs, a prefetch's claim) on a slow source
    renews as often as a waiter of ONE blob must see it do to know it lives: the waiter's
    bound passes, it fetches its blob and leaves the claim, and the holder's marker names the
    rest, so a later node loads them instead of fetching (renewing by the claim's size, every
    ~3 s here against the waiter's ~1.8 s bound, had the live holder taken over and its
    marker lost)."""
    c = Cluster(str(tmp_path))
    holder, waiter, later = c.board("holder"), c.board("waiter"), c.board("later")
    for b in (holder, waiter):
        b._seconds_per_byte, b._measured = 2e-7, True  # ~5 MB/s, measured by both
        b.mailbox.company = True
    waiter.mailbox._rung.add("holder")  # it rang this holder before: no doubled bound
    out = {}

    async def main():
        async with trio.open_nursery() as nursery:
            holder.attach(nursery)
            nursery.start_soon(c.fault, holder, list(range(8)), 0.25, False, True)
            await trio.sleep(0.05)
            out["got"] = await c.fault(waiter, [7])
        out["later"] = await c.fault(later, [0, 1, 2, 3])

    trio.run(main)
    assert out["got"] == {7: b"blob 7"}
    assert out["later"] == {i: f"blob {i}".encode() for i in range(4)}
    assert waiter.stats.counters["claim_waits_given_up"] == 1
    assert waiter.stats.counters["claim_takeovers"] == 0
    assert [f for f in c.fetches if f[0] != "holder"] == [("waiter", 7)], c.fetches


def test_a_holder_whose_blob_landed_and_that_then_went_silent_is_taken_over(tmp_path):
    """A holder published one blob of its claim, then died (it renews nothing): the blob
    that landed says it lived then, not now, so the waiter whose bound passed takes the
    claim over (one taker; the others wait on it) instead of fetching its blob beside a
    claim nobody serves."""
    c = Cluster(str(tmp_path))
    dead, waiter = c.board("dead"), c.board("waiter")
    dead._seconds_per_byte = 1e-5  # a long lease: the waiter's own bound passes first
    waiter.observe(MiB, 0.1)
    out = {}

    async def main():
        await dead.coordinate(TAG, [3, 4], c.load)

        async def publish_one_then_die():
            await trio.sleep(0.3)
            c.fetches.append(("dead", 3))
            c.blobs[3] = b"blob 3"  # ... and blob 4 never comes

        async with trio.open_nursery() as nursery:
            nursery.start_soon(publish_one_then_die)
            out["got"] = await c.fault(waiter, [3, 4])

    trio.run(main)
    assert out["got"] == {3: b"blob 3", 4: b"blob 4"}
    assert waiter.stats.counters["claim_waits_given_up"] == 1
    assert waiter.stats.counters["claim_takeovers"] == 1
    assert c.fetches == [("dead", 3), ("waiter", 4)]


def test_a_waiter_that_has_not_measured_its_source_takes_the_holders_estimate(tmp_path):
    """Before its first source read a node's estimate is a guess (50 MB/s): waiting on a
    holder whose measured source is slower, it waits for the holder's deadline (the same
    source, measured) instead of taking the claim over after its guess and fetching twice."""
    c = Cluster(str(tmp_path))
    holder, waiter = c.board("holder"), c.board("waiter")
    holder.observe(MiB, 1.6)  # its source: ~1 s a MiB; its lease of 2 MiB: ~4 s

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(c.fault, holder, [3, 4], 0.9)
            await trio.sleep(0.05)
            out["got"] = await c.fault(waiter, [4])

    out = {}
    trio.run(main)
    assert out["got"] == {4: b"blob 4"} and c.fetches == [("holder", 3), ("holder", 4)]
    assert waiter.stats.counters["claim_waits_given_up"] == 0
    assert waiter.lease(2 * MiB) < 1.8  # its own guess would have given up before blob 4


def test_a_live_holder_renews_its_claim_and_keeps_it_past_its_first_deadline(tmp_path):
    """A holder slowed down (a busy machine) well past its lease renews its claim while it
    lives: a waiter that has not measured its source waits for the blob instead of taking
    the expired claim over and fetching it twice (a dead holder renews nothing: the
    takeover tests)."""
    c = Cluster(str(tmp_path))
    holder, waiter = c.board("holder"), c.board("waiter")
    out = {}

    async def main():
        async with trio.open_nursery() as nursery:
            holder.attach(nursery)
            holder.mailbox.company = True  # (alone, its first lease would be ALONE_LEASE_S)
            nursery.start_soon(c.fault, holder, [3], 3.0)  # its lease: ~1.2 s
            await trio.sleep(0.05)
            out["got"] = await c.fault(waiter, [3])

    trio.run(main)
    assert out["got"] == {3: b"blob 3"} and c.fetches == [("holder", 3)]
    assert holder.stats.counters["claims_renewed"] >= 2
    assert waiter.stats.counters["claim_takeovers"] == 0


def test_a_windows_marker_is_its_index_and_a_won_create_asks_for_no_blob(tmp_path):
    """A node that wins a window's create (no claim object: nothing of the window was
    published under a claim) asks the store for none of its blobs; its release leaves a
    marker naming what it published, kept, so a node coming any time later loads those (and
    only those) and claims the rest; a third finds both nodes' blobs in the marker."""
    c = Cluster(str(tmp_path))
    a, b, d = c.board("a"), c.board("b"), c.board("d")
    trio.run(c.fault, a, [0, 1, 2])
    assert c.asked == [] and a.stats.counters["shared_index_misses"] == 3
    time.sleep(0.1)
    assert trio.run(c.fault, b, [1, 2, 3, 4]) == {i: f"blob {i}".encode() for i in (1, 2, 3, 4)}
    assert c.asked == [1, 2] and sorted(i for _, i in c.fetches) == [0, 1, 2, 3, 4]
    assert c.marker().published_of(0, list(range(8))) == [0, 1, 2, 3, 4]
    assert trio.run(c.fault, d, [0, 4]) == {0: b"blob 0", 4: b"blob 4"}
    assert len(c.fetches) == 5 and d.stats.counters["claims_won"] == 0


def test_a_marker_naming_a_blob_that_is_gone_costs_a_fetch_never_a_wrong_byte(tmp_path):
    c = Cluster(str(tmp_path))
    a, b = c.board("a"), c.board("b")
    trio.run(c.fault, a, [6])
    del c.blobs[6]  # removed from the store behind the marker's back
    assert trio.run(c.fault, b, [6]) == {6: b"blob 6"}
    assert c.fetches == [("a", 6), ("b", 6)] and c.marker().published_of(0, [6]) == [6]


def test_a_foreign_object_where_a_claim_should_be_is_replaced(tmp_path):
    c = Cluster(str(tmp_path))
    LocalObjects(str(tmp_path)).put(c.board("x")._key(TAG, 0), b"\x00garbage")
    b = c.board("n")
    assert trio.run(c.fault, b, [1]) == {1: b"blob 1"}
    assert b.stats.counters["claim_takeovers"] == 1 and c.marker().published_of(0, [1]) == [1]


def test_one_nodes_faults_share_its_claim_and_the_last_releases_it(tmp_path):
    c = Cluster(str(tmp_path))
    b = c.board("n")

    async def main():
        _, held1 = await b.coordinate(TAG, [0], c.load)
        _, held2 = await b.coordinate(TAG, [1, 2], c.load)
        assert held1 == held2 and held1[0].users == 2
        await b.release(held1, fetched=[0])
        assert not c.marker().published  # still held
        await b.release(held2, fetched=[1, 2])
        assert c.marker().published and c.marker().published_of(0, [0, 1, 2, 3]) == [0, 1, 2]

    trio.run(main)
    assert b.stats.counters["claims_won"] == 1


def test_a_holders_later_run_grows_its_claim_and_a_waiter_waits_past_the_first_deadline(
        tmp_path):
    """A node's first fault claims blob 0 with a short lease; its prefetch of the rest of the
    window joins the claim and grows it (covering blobs 1..7, deadline renewed). Another node
    needing blob 6 waits for it to land, past the first claim's deadline, and never fetches
    it: before claims grew, the first deadline passed and the waiter took the window over
    (blob 6 fetched twice)."""
    c = Cluster(str(tmp_path))
    a, b = c.board("a"), c.board("b")

    async def main():
        async with trio.open_nursery() as nursery:
            async def holder():
                _, held = await a.coordinate(TAG, [0], c.load)  # its lease: ~1.2 s
                first = Claim.decode(c.store.read(held[0].key)[0])
                assert (first.first, first.count) == (0, 1)
                await trio.sleep(0.1)
                c.fetches.append(("a", 0))
                c.blobs[0] = b"blob 0"
                # the prefetch of the rest of the window, fetched slower than the first lease
                await c.fault(a, list(range(1, 8)), fetch_s=0.25, ahead=True)
                await a.release(held, fetched=[0])
            nursery.start_soon(holder)
            await trio.sleep(0.05)
            out["b"] = await c.fault(b, [6])

    out = {}
    started = time.monotonic()
    trio.run(main)
    assert out["b"] == {6: b"blob 6"}
    assert sorted(i for _, i in c.fetches) == list(range(8))  # each once, all by a
    assert {n for n, _ in c.fetches} == {"a"}
    assert a.stats.counters["claims_grown"] == 1
    assert b.stats.counters["claim_takeovers"] == 0
    assert time.monotonic() - started > a.lease(MiB)  # blob 6 landed after the first deadline


def test_a_lone_holder_defers_its_grows_until_a_renewal_or_another_node_waits(tmp_path):
    """Attached to a mount and alone (no node met), a holder's later fault outside its claim
    does not replace the claim object (nobody waits for those blobs); its next renewal covers
    them. A node that comes meanwhile waits for a blob outside the claim and rings the holder;
    the holder's look at its mailbox (what ``HeldBack`` does) sends the deferred grow, so the
    waiter takes the blob as it lands: it is fetched once, by the holder."""
    from faultfs.tiers.upkeep import ALONE_LEASE_S

    c = Cluster(str(tmp_path))
    a, b = c.board("a"), c.board("b")

    def stored(window: int) -> tuple[int, int]:
        claim = c.marker(window)
        return claim.first, claim.first + claim.count

    async def main():
        async with trio.open_nursery() as nursery:
            a.attach(nursery)
            _, [h0] = await a.coordinate(TAG, [0], c.load)
            # alone: a long first lease (a short read renews nothing)
            assert h0.lease_s == pytest.approx(ALONE_LEASE_S, abs=0.5)
            assert a.lease(MiB) < ALONE_LEASE_S - 1
            _, [j0] = await a.coordinate(TAG, [1, 2], c.load)  # joins: the grow waits
            assert j0 is h0 and h0.want == (0, 3) and stored(0) == (0, 1)
            await a._grow(TAG, h0, renew=True)  # the renewal covers them
            assert stored(0) == (0, 3) and a._deferred == {}
            grown = a.stats.counters["claims_grown"]

            _, [h1] = await a.coordinate(TAG, [8], c.load)
            _, _ = await a.coordinate(TAG, [9, 10], c.load)
            assert stored(1) == (8, 9) and a.stats.counters["claims_grow_deferred"] == 2
            out = {}
            done = trio.Event()

            async def waiter():
                out["b"] = await c.fault(b, [10])
                done.set()
            nursery.start_soon(waiter)
            for _ in range(250):  # the holder's look at its mailbox, until b rang it
                if a.mailbox.look():
                    break
                await trio.sleep(0.02)
            else:
                raise AssertionError("the waiter never rang the holder")
            a.in_company()
            await trio.sleep(0.05)
            assert stored(1) == (8, 11) and a.stats.counters["claims_grown"] == grown + 1
            for i in (8, 9, 10):  # the holder fetches what it claimed
                await trio.sleep(0.05)
                c.fetches.append(("a", i))
                c.blobs[i] = f"blob {i}".encode()
            with trio.fail_after(10):
                await done.wait()
            await a.release([h0, h0, h1, h1], fetched=[0, 1, 2, 8, 9, 10])
            assert out["b"] == {10: b"blob 10"}
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert c.fetches == [("a", 8), ("a", 9), ("a", 10)]
    assert b.stats.counters["claim_takeovers"] == 0 and b.stats.counters["claim_waits"] == 1


def test_a_window_seen_with_an_object_is_read_first_not_created(tmp_path):
    """A node that has seen an object at a window (another's claim, a marker, its own
    claim) reads it before anything else at its next fault there: a create would only lose
    (markers stay). A window whose object went (a claim that published nothing is
    deleted) is created again after the read finds nothing."""
    c = Cluster(str(tmp_path))
    a, b = c.board("a"), c.board("b")
    creates: list[str] = []

    class Counting:
        def __getattr__(self, name):
            return getattr(c.store, name)

        def create(self, key, data):
            creates.append(key.rsplit("/", 1)[1])
            return c.store.create(key, data)

    b.store = Counting()

    async def main():
        await c.fault(a, [0])  # a's marker names blob 0
        assert await c.fault(b, [1]) == {1: b"blob 1"}  # create lost, read, took the rest
        assert await c.fault(b, [2]) == {2: b"blob 2"}  # read first: the marker
        assert await c.fault(b, [9]) == {9: b"blob 9"}  # window 1: never seen, created
        _, held = await b.coordinate(TAG, [17], c.load)  # window 2: b's claim, then
        await b.release(held, fetched=[])  # deleted (nothing published)
        _, held = await b.coordinate(TAG, [17], c.load)  # read (nothing), created again
        assert held

    trio.run(main)
    assert creates == ["0", "1", "2", "2"]
    assert c.fetches == [("a", 0), ("b", 1), ("b", 2), ("b", 9)]


def test_a_claim_made_alone_renews_at_its_nodes_pace_once_the_node_meets_another(tmp_path):
    """A claim made alone has a 4 s lease, its first renewal 2 s away. Once its node meets
    another, it renews every half of the node's own estimate (~0.6 s here) instead: a waiter
    takes a renewal within its own bound as the sign that the holder lives (and leaves a live
    holder its claim), so a long quiet lease would get a live holder taken over."""
    c = Cluster(str(tmp_path))
    a = c.board("a")

    async def main():
        async with trio.open_nursery() as nursery:
            a.attach(nursery)
            await a.coordinate(TAG, [0], c.load)
            first = c.store.read(c.marker_key())[1]
            await trio.sleep(0.3)
            a.mailbox.company = True
            a.in_company()
            # one renewal at the node's pace, well before the 2 s of the lease made alone ...
            await trio.sleep(a.lease(MiB) / 2 + 0.45)
            assert c.store.read(c.marker_key())[1] != first
            renewed = a.stats.counters["claims_renewed"]
            await trio.sleep(a.lease(MiB) / 2 + 0.45)  # ... and the next
            assert a.stats.counters["claims_renewed"] > renewed >= 1
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_grow_never_brings_its_claims_deadline_nearer(tmp_path):
    """A claim made alone has a long lease, and its renewal is timed by it; a grow after the
    node met another names more blobs but keeps the deadline. Before, the grow gave the claim
    its node's short estimate while the renewal still slept on the long one: the claim
    expired under a live holder and a waiter took it over (a 4-node random bench run read
    1.08x the object so)."""
    c = Cluster(str(tmp_path))
    a = c.board("a")

    async def main():
        async with trio.open_nursery() as nursery:
            a.attach(nursery)
            _, [held] = await a.coordinate(TAG, [0], c.load)
            assert held.lease_s > a.lease(MiB)  # made alone: a long lease
            before = c.marker().deadline_ms
            a.mailbox.company = True  # it met another node: grows go at once
            await a.coordinate(TAG, [1], c.load)
            await trio.sleep(0.1)
            grown = c.marker()
            assert (grown.first, grown.count) == (0, 2)
            assert grown.deadline_ms >= before > time.time() * 1000 + 1000 * a.lease(2 * MiB)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert a.stats.counters["claims_grown"] == 1


def test_a_waiter_on_a_run_looks_at_two_blobs_a_poll_and_takes_each_soon_after_it_lands(
        tmp_path):
    """A waiter on another node's run of 8 blobs (fetched in order, one each 0.15 s) GETs two
    of them a look while nothing lands (not all 8: those GETs would load the store serving the
    holder), all of them once one has landed, and looks again soon after (its poll starts
    over), so it takes most blobs soon after they land; each is fetched once."""
    c = Cluster(str(tmp_path))
    a, b = c.board("a"), c.board("b")
    landed: dict[int, float] = {}
    taken: dict[int, float] = {}
    looks: list[tuple[list[int], bool]] = []

    async def load_b(indices: list[int]) -> dict:
        got = await c.load(indices)
        looks.append((list(indices), bool(got)))
        for i in got:
            taken.setdefault(i, time.monotonic())
        return got

    async def main():
        async with trio.open_nursery() as nursery:
            async def holder():
                _, held = await a.coordinate(TAG, list(range(8)), c.load)
                for i in range(8):
                    await trio.sleep(0.15)
                    c.fetches.append(("a", i))
                    c.blobs[i] = f"blob {i}".encode()
                    landed[i] = time.monotonic()
                await a.release(held, fetched=list(range(8)))
            nursery.start_soon(holder)
            await trio.sleep(0.05)
            got, held = await b.coordinate(TAG, list(range(8)), load_b)
            assert sorted(got) == list(range(8)) and held == []

    trio.run(main)
    assert sorted(i for _, i in c.fetches) == list(range(8))  # each once, by the holder
    assert b.stats.counters["claim_takeovers"] == 0
    # a look that found nothing (not the one taking the rest after a landing): two GETs
    empty = [asked for n, (asked, found) in enumerate(looks)
             if not found and not (n and looks[n - 1][1])]
    assert empty and all(len(asked) <= 2 for asked in empty), looks
    # looks 20 ms after a landing, then 40, 80, 160: most blobs are taken within 80 ms
    # (at a steady 200 ms, half the fetch's time on average), none a look late
    lags = sorted(taken[i] - landed[i] for i in range(8))
    assert lags[4] < 0.08 and lags[-1] < 0.25, lags


def test_a_published_marker_covers_every_blob_fetched_under_the_claim(tmp_path):
    """The holder fetched blobs 2..5 under one claim in two faults; its released claim (kept
    marked published) tells a node arriving then to load all four, not claim them again:
    before, the marker covered the first fault's blobs only and the node re-fetched blob 5."""
    c = Cluster(str(tmp_path))
    a, b = c.board("a"), c.board("b")

    async def main():
        async with trio.open_nursery() as nursery:
            async def holder():
                _, held = await a.coordinate(TAG, [2], c.load)
                await c.fault(a, [3, 4, 5])  # shares the claim (grown to cover them)
                c.fetches.append(("a", 2))
                c.blobs[2] = b"blob 2"
                await a.release(held, fetched=[2])
            nursery.start_soon(holder)
            await trio.sleep(0.3)  # the marker is there now
            marker = Claim.decode(c.store.read(a._key(TAG, 0))[0])
            assert marker.published and (marker.first, marker.count) == (2, 4)
            out["b"] = await c.fault(b, [5])

    out = {}
    trio.run(main)
    assert out["b"] == {5: b"blob 5"}
    assert sorted(i for _, i in c.fetches) == [2, 3, 4, 5]
    assert b.stats.counters["claims_won"] == 0 and b.stats.counters["claim_takeovers"] == 0


def test_a_prefetch_claim_is_held_on_for_its_next_run_and_ends_when_none_comes(tmp_path):
    """A prefetch run claims to its window's end; released with blobs of the window not
    fetched, the claim waits ``idle_hold_s`` for the node's next run (which joins it: one
    claim, no second create), then ends with a marker over what was fetched."""
    c = Cluster(str(tmp_path))
    a = c.board("a")
    a.idle_hold_s = 0.3

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(c.fault, a, [0, 1], 0.01, False, True)
            await trio.sleep(0.15)  # the first run released, held on
            assert Claim.decode(c.store.read(a._key(TAG, 0))[0]).count == 8  # to the end
            nursery.start_soon(c.fault, a, [2, 3], 0.01, False, True)
            await trio.sleep(0.45)  # the second run released, held on, ended: marked
            marker = Claim.decode(c.store.read(a._key(TAG, 0))[0])
            assert marker.published and (marker.first, marker.count) == (0, 4)

    trio.run(main)
    assert a.stats.counters["claims_won"] == 1 and a.stats.counters["claims_released"] == 1


def test_a_lone_node_claims_windows_ahead_its_faults_join_them_and_unread_ones_end(tmp_path):
    """A node that looks alone claims the windows ahead of its sequential reader in the
    background (``claim_ahead``): whole windows, each tried once. A fault of such a window
    joins the claim without a request of its own (no create on its path: before, the first
    fault of every window made one and waited for it); a window claimed ahead that no fault
    joins is ended ``ahead_hold_s`` after it was made, and at once when its node meets
    another, so it keeps nobody waiting; and a node in company claims nothing ahead."""
    c = Cluster(str(tmp_path))
    a, b = c.board("a"), c.board("b")
    a.ahead_hold_s = a.idle_hold_s = 0.3
    b.mailbox.company = True

    async def main():
        async with trio.open_nursery() as nursery:
            a.attach(nursery)
            b.attach(nursery)
            _, held = await a.coordinate(TAG, [0], c.load)
            assert a.claim_ahead(TAG, 23) == 2  # windows 1 and 2 (window 0: held)
            assert a.claim_ahead(TAG, 23) == 0  # tried already
            assert b.claim_ahead(TAG, 40) == 0  # in company
            await trio.sleep(0.1)
            for window in (1, 2):
                claim = Claim.decode(c.store.read(a._key(TAG, window))[0])
                assert (claim.node, claim.first, claim.count, claim.published) == (
                    "a", 8 * window, 8, False)
            creates = a.stats.counters["claims_won"]
            got = await c.fault(a, [8, 9], ahead=True)  # joins window 1's claim
            assert got == {8: b"blob 8", 9: b"blob 9"}
            assert a.stats.counters["claims_won"] == creates
            assert a.stats.counters["shared_index_misses"] == 3  # fresh claims: no loads
            await trio.sleep(1.0)  # nobody joined window 2: ended; window 1 marked
            assert c.store.read(a._key(TAG, 2)) is None
            assert c.marker(1).published and c.marker(1).published_of(8, [8, 9, 10]) == [8, 9]
            d = c.board("d")  # another node, alone too: claims 2..4 (1 is a's marker)
            d.attach(nursery)
            assert d.claim_ahead(TAG, 39) == 5
            await trio.sleep(0.1)
            assert [c.store.read(d._key(TAG, w)) is not None for w in (2, 3, 4)] == [True] * 3
            d.mailbox.company = True  # it meets another node: what it claimed ahead ends
            await trio.sleep(0.3)
            assert [c.store.read(d._key(TAG, w)) for w in (2, 3, 4)] == [None] * 3
            assert d.stats.counters["claims_ahead"] == 3
            await a.release(held, fetched=[0])
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert a.stats.counters["claims_ahead"] == 2 and c.asked == []
    assert sorted(i for _, i in c.fetches) == [8, 9]


@pytest.mark.parametrize("alone", [False, True])
def test_a_settled_claim_doubles_its_lease_at_each_renewal_up_to_a_bound(tmp_path, alone):
    """A claim whose blobs are fetched and whose publishes are all held back (``parked``)
    is renewed with twice its last lease, up to ``SETTLED_LEASE_MAX_S``: a lone node's long
    read renews its held claims a few times, not every half lease. One still fetching keeps
    its node's estimate when the node has met another; alone, it doubles too."""
    from faultfs.tiers.upkeep import SETTLED_LEASE_MAX_S

    c = Cluster(str(tmp_path))
    a = c.board("a")
    a.mailbox.company = not alone

    async def main():
        _, [h] = await a.coordinate(TAG, [0, 1, 2], c.load, ahead=True)
        base = a.lease(8 * MiB)
        await a._grow(TAG, h, renew=True)
        # fetching: its estimate in company, twice it alone
        assert h.lease_s == pytest.approx(min(SETTLED_LEASE_MAX_S, 2 * base) if alone
                                          else base, rel=0.01)
        if alone:
            h.lease_s = base
        h.parked = 1  # its one user holds its publishes back
        leases = []
        for _ in range(4):
            await a._grow(TAG, h, renew=True)
            leases.append(h.lease_s)
        stored = Claim.decode(c.store.read(h.key)[0])
        assert stored.deadline_ms / 1000 - time.time() == pytest.approx(leases[-1], abs=0.5)
        return leases, base

    leases, base = trio.run(main)
    assert leases == [pytest.approx(min(SETTLED_LEASE_MAX_S, base * 2 ** (i + 1)))
                      for i in range(4)]
    assert leases[-1] == SETTLED_LEASE_MAX_S


def test_sweep_removes_expired_and_foreign_claims_and_keeps_live_ones_and_markers(tmp_path):
    c = Cluster(str(tmp_path))
    now = int(time.time() * 1000)
    c.store.create("claims/f/v/0", Claim("a", 1, now - 120_000, 0, 1).encode())  # long expired
    c.store.create("claims/f/v/1", Claim("b", 1, now + 60_000, 8, 1).encode())  # live
    c.store.create("claims/f/v/2", b"not a claim")
    c.store.create("claims/f/v/3", Claim("c", 1, now - 120_000, 24, 1, published=True,
                                         done=3).encode())  # a marker: the index
    c.store.create("claims/f/v/4", Claim("d", 2, now - 120_000, 33, 1, done=1).encode())
    assert sweep(c.store, dry_run=True) == ["claims/f/v/0", "claims/f/v/2", "claims/f/v/4"]
    assert len(c.store.list("claims/")) == 5
    assert sweep(c.store) == ["claims/f/v/0", "claims/f/v/2", "claims/f/v/4"]
    assert c.store.list("claims/") == ["claims/f/v/1", "claims/f/v/3", "claims/f/v/4"]
    kept = Claim.decode(c.store.read("claims/f/v/4")[0])  # a dead holder's: its marker now
    assert kept.published and kept.done == 1


def test_faultfs_gc_removes_stray_claims_of_a_shared_store(tmp_path):
    from conftest import run_faultfs

    c = Cluster(str(tmp_path / "shared"))
    now = int(time.time() * 1000)
    c.store.create("claims/f/v/0", Claim("dead", 2, now - 120_000, 0, 1).encode())
    c.store.create("claims/f/v/1", Claim("live", 1, now + 60_000, 8, 1).encode())
    shown = run_faultfs("gc", "--shared-store", str(tmp_path / "shared"), "--dry-run", "-v",
                        check=True).stdout
    assert "would remove 1 stray claims" in shown and "claims/f/v/0" in shown
    assert len(c.store.list("claims/")) == 2
    run_faultfs("gc", "--shared-store", str(tmp_path / "shared"), check=True)
    assert c.store.list("claims/") == ["claims/f/v/1"]
    refused = run_faultfs("gc")
    assert refused.returncode == 2 and "give a STORE" in refused.stderr
