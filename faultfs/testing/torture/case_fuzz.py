"""Case 6: fuzzing every decoder (``decoders.TARGETS``) with Hypothesis at a large budget, and
with atheris (libFuzzer, coverage-guided) when it is installed.

Inputs are random bytes, valid encodings mutated (bits flipped, fields set to 0, 2**31-1,
2**32-1, 2**63-1 or 2**64-1, bytes cut, inserted or repeated, aimed at the formats' fields half
the time — then, half the time, the format's checksums recomputed so the mutation reaches the
checks behind them), and for the text and JSON formats documents built from their grammar
with values of every JSON type and size. Each Hypothesis example is a base input and a seed
for 15 more variants of it (Hypothesis's draws are slow on two cores; the decoders are fast).
Each target first gets a sweep (every field of every seed set to every extreme value at every
width, checksums recomputed; a seeded tenth of it in ``--quick``), then Hypothesis runs from a
fixed seed for the target's share of the case's budget (the number of inputs is what that time
allows).

What must hold, for every input: no exception other than the library's own errors escapes a
decoder, what a decoder accepts keeps its promises (``decoders.Finding``), and one call
allocates at most ``ALLOC_BOUND`` + ``ALLOC_PER_BYTE`` bytes per input byte (tracemalloc's peak).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import struct
import subprocess
import sys
import time
import tracemalloc

from faultfs.errors import FaultfsError
from faultfs.testing.torture import decoders
from faultfs.testing.torture.harness import Budget, CaseResult, MiB, Run

NAME = "decoder fuzzing"
ALLOC_BOUND = 16 * MiB  # one decode of a hostile input may allocate this much ...
ALLOC_PER_BYTE = 64  # ... plus this many bytes per input byte (parsed Python objects)
ATHERIS_SHARE = 0.3  # of the case's budget, when atheris is installed (default run only)
INTERESTING = (0, 1, 2, 3, 6, 0x7F, 0x80, 0xFF, 0xFFFF, 2**31 - 1, 2**32 - 1, 2**63 - 1,
               2**64 - 1)  # small values reach flags and kinds, large ones lengths


def strategies(target: decoders.Target):
    from hypothesis import strategies as st

    seeds = target.seeds() or [b""]
    offsets = target.offsets()
    pos = st.one_of(st.integers(0, 1 << 20), st.sampled_from(offsets)) if offsets else \
        st.integers(0, 1 << 20)
    mutation = st.one_of(
        st.tuples(st.just("flip"), pos, st.integers(0, 7)),
        st.tuples(st.just("u64"), pos, st.sampled_from(INTERESTING)),
        st.tuples(st.just("u32"), pos, st.sampled_from(INTERESTING)),
        st.tuples(st.just("u16"), pos, st.integers(0, 0xFFFF)),
        st.tuples(st.just("cut"), pos, st.just(0)),
        st.tuples(st.just("insert"), pos, st.binary(max_size=64)),
        st.tuples(st.just("repeat"), pos, st.integers(1, 4096)),
    )
    mutated = st.builds(lambda seed, ops, fix: _mutate(target, seed, ops, fix),
                        st.sampled_from(seeds), st.lists(mutation, max_size=6), st.booleans())
    noise = st.builds(lambda s, n: random.Random(s).randbytes(n), st.integers(0, 2**32),
                      st.integers(0, 8192))  # big random inputs, cheap to draw
    kinds = [st.binary(max_size=300), noise, mutated, mutated]
    if offsets:  # one field of a valid input set to an extreme, checksums made right again
        kinds += 2 * [st.builds(
            lambda seed, at, width, value: _mutate(target, seed, [(width, at, value)], True),
            st.sampled_from(seeds), st.sampled_from(offsets),
            st.sampled_from(("u64", "u32", "u16")), st.sampled_from(INTERESTING))]
    grammar = _grammar(target)
    if grammar is not None:  # the text and JSON formats: mostly documents of their grammar
        kinds += 4 * [grammar]
    # each example is a base input and a seed for VARIANTS more made from it: Hypothesis
    # draws are slow on two cores, the decoders are fast
    return st.tuples(st.one_of(*kinds), st.integers(0, 2**32))


VARIANTS = 15


def variants(target: decoders.Target, base: bytes, seed: int) -> list[bytes]:
    """``base`` and ``VARIANTS`` inputs made from it by 1 to 4 more seeded mutations each."""
    rng = random.Random(seed)
    offsets = target.offsets()
    out = [base]
    for _ in range(VARIANTS):
        ops = []
        for _ in range(rng.randint(1, 4)):
            kind = rng.choice(("flip", "u64", "u32", "u16", "cut", "insert", "repeat"))
            pos = rng.choice(offsets) if offsets and rng.random() < 0.5 else \
                rng.randrange(len(base) + 1)
            arg = {"flip": lambda: rng.randrange(8),
                   "u64": lambda: rng.choice(INTERESTING),
                   "u32": lambda: rng.choice(INTERESTING),
                   "u16": lambda: rng.randrange(1 << 16),
                   "cut": lambda: 0,
                   "insert": lambda: rng.randbytes(rng.randrange(64)),
                   "repeat": lambda: rng.randrange(1, 4096)}[kind]()
            ops.append((kind, pos, arg))
        out.append(_mutate(target, base, ops, rng.random() < 0.5))
    return out


def _mutate(target: decoders.Target, seed: bytes, ops: list, fix: bool) -> bytes:
    data = bytearray(seed)
    for kind, pos, arg in ops:
        pos = pos % (len(data) + 1)
        if kind == "flip" and pos < len(data):
            data[pos] ^= 1 << arg
        elif kind in ("u64", "u32", "u16"):
            width = {"u64": 8, "u32": 4, "u16": 2}[kind]
            if pos + width <= len(data):
                data[pos:pos + width] = (arg % (1 << (8 * width))).to_bytes(width, "little")
        elif kind == "cut":
            del data[pos:]
        elif kind == "insert":
            data[pos:pos] = arg
        elif kind == "repeat":
            data[pos:pos] = data[pos:pos + arg] * 2
    out = bytes(data[:decoders.MAX_INPUT])
    return target.fix(out) if fix else out


def _json_values():
    from hypothesis import strategies as st

    scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
               | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12))
    return st.recursive(scalars, lambda c: st.lists(c, max_size=3)
                        | st.dictionaries(st.text(max_size=6), c, max_size=3), max_leaves=6)


def _grammar(target: decoders.Target):
    """Documents of the target's own text or JSON format, with hostile values."""
    from hypothesis import strategies as st

    values = _json_values()

    def doc(keys: list[str]):
        return st.dictionaries(st.sampled_from([*keys, "extra"]), values, max_size=len(keys) + 1)

    def dumps(d: dict) -> bytes:
        return json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()

    if isinstance(target, decoders.PagemapText):
        number = st.one_of(st.integers(0, 2**70).map(str), st.integers(-(2**64), -1).map(str),
                           st.integers(0, 9999).map(lambda n: "0" * 5 + str(n)),
                           st.sampled_from(["", "x", "1e9", "٣", "0x10", " 7"]))
        name = st.one_of(st.sampled_from(["chunk_0", "chunk_1", "a", "page:1", "x/y", "é",
                                          "a\x00b", ".pagemap", "b" * 300]),
                         st.text(max_size=8))
        line = st.one_of(
            st.just("pagemap"), number.map(lambda n: f"page_size={n}"),
            number.map(lambda n: f"total={n}"),
            st.tuples(name, number, number, number, st.sampled_from(["", " extra", " 1 2"]))
            .map(lambda t: f"{t[0]} {t[1]} {t[2]} {t[3]}{t[4]}"),
            st.text(max_size=20))
        return st.lists(line, max_size=40).map(lambda ls: "\n".join(ls).encode("utf-8",
                                                                              "surrogatepass"))
    if isinstance(target, decoders.ContextBytes):
        from faultfs.core.context import FaultContext

        base = json.loads(FaultContext("/d/f.bin", "f").encode())
        return st.one_of(doc(sorted(base)).map(dumps),
                         st.tuples(st.sampled_from(sorted(base)), values)
                         .map(lambda kv: dumps({**base, kv[0]: kv[1]})))
    if isinstance(target, decoders.TagStateFile):
        return doc(["key", "source_version", "shard", "view_name", "mtime", "remote"]).map(dumps)
    if isinstance(target, decoders.DirtyState):
        keys = ["view_size", "view_seq", "users", "next_user", "ancestors", "voided",
                "voided_blobs", "mtime_ns"]
        seed = json.loads(target.seeds()[1][2:])
        state = st.one_of(doc(keys).map(dumps), st.tuples(st.sampled_from(keys), values)
                          .map(lambda kv: dumps({**seed, kv[0]: kv[1]})))
        return state.map(lambda s: struct.pack("<H", len(s) % 65536) + s)
    return None


class Driver:
    """Calls a target, counts calls, bounds each call's allocation, keeps the last failure."""

    def __init__(self, target: decoders.Target) -> None:
        self.target = target
        self.calls = 0
        self.max_alloc = 0
        self.failure: tuple[bytes, BaseException] | None = None

    def __call__(self, data: bytes) -> None:
        self.calls += 1
        tracemalloc.start(1)  # only this call's allocations are traced, not Hypothesis's
        try:
            self.target(data)
        except FaultfsError:
            pass
        except Exception as exc:
            self.failure = (data, exc)
            raise
        finally:
            alloc = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        self.max_alloc = max(self.max_alloc, alloc)
        if alloc > ALLOC_BOUND + ALLOC_PER_BYTE * len(data):
            exc = decoders.Finding(f"one call allocated {alloc} bytes for {len(data)} input bytes")
            self.failure = (data, exc)
            raise exc


class _TimeUp(BaseException):
    """The target's time is over: stops Hypothesis at once (it lets BaseException through)."""


def hypothesis_run(driver: Driver, seconds: float, seed: int) -> BaseException | None:
    """Fuzz ``driver``'s target for ``seconds`` from a fixed seed; the failure, if any."""
    from hypothesis import HealthCheck, Phase, Verbosity, given, settings
    from hypothesis import seed as fixed_seed

    stop_at = time.monotonic() + seconds

    @fixed_seed(seed)
    @settings(max_examples=10**7, deadline=None, database=None,
              suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet,
              phases=[Phase.generate], report_multiple_bugs=False)
    @given(strategies(driver.target))
    def fuzz(example: tuple[bytes, int]) -> None:
        if time.monotonic() > stop_at:
            raise _TimeUp
        base, variant_seed = example
        for data in variants(driver.target, base, variant_seed):
            driver(data)

    try:
        fuzz()
    except _TimeUp:
        return None
    except Exception as exc:
        return exc
    return None


def _atheris_available() -> bool:
    probe = subprocess.run([sys.executable, "-c", "import atheris"], capture_output=True,
                           timeout=60)
    return probe.returncode == 0


def atheris_run(run: Run, cls: type[decoders.Target], seconds: float
                ) -> tuple[int, str | None]:
    """Run one target under atheris for ``seconds``; (executions, the crash or None)."""
    scratch = run.fresh_dir("atheris")
    env = dict(os.environ, TMPDIR=scratch)
    proc = run.popen([sys.executable, "-m", "faultfs.testing.torture.fuzz_atheris", cls.__name__,
                      f"-max_total_time={max(1, int(seconds))}", "-seed=1",
                      "-rss_limit_mb=2048", "-print_final_stats=1",
                      f"-artifact_prefix={scratch}/"],
                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        out, _ = proc.communicate(timeout=seconds + 120)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        return 0, "atheris did not stop in time"
    runs = re.findall(r"stat::number_of_executed_units:\s*(\d+)", out)
    executed = int(runs[-1]) if runs else 0
    if proc.returncode != 0:
        lines = [ln for ln in out.splitlines() if ln.strip()]
        where = next((i for i, ln in enumerate(lines) if "Uncaught Python exception" in ln), None)
        detail = " | ".join(lines[where:where + 12]) if where is not None else " | ".join(lines[-8:])
        return executed, detail[-600:]
    return executed, None


def sweep(target: decoders.Target) -> list[bytes]:
    """Every field of every seed set to every extreme, at every width, checksums made right:
    the attacks a random draw may miss, each tried once."""
    out = []
    for seed in target.seeds():
        for at in target.offsets():
            for width in ("u64", "u32", "u16"):
                for value in INTERESTING:
                    out.append(_mutate(target, seed, [(width, at, value)], True))
    return out


def run_sweep(driver: Driver, inputs: list[bytes]) -> BaseException | None:
    for data in inputs:
        try:
            driver(data)
        except Exception as exc:
            return exc
    return None


def run_case(run: Run, budget: Budget, res: CaseResult) -> None:
    use_atheris = not run.quick and _atheris_available()
    share = budget.seconds * (1 - ATHERIS_SHARE if use_atheris else 1) - 2
    findings: list[str] = []
    swept = 0
    scratch = run.tmpfs("fuzz", 512 * 1024)  # fsyncs of the durable formats cost nothing here
    quiet = logging.getLogger("faultfs")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL + 1)  # the decoders log what they refuse
    try:
        for k, cls in enumerate(decoders.TARGETS):
            target = cls(os.path.join(scratch, f"t{k}"))
            os.makedirs(target.scratch)
            driver = Driver(target)
            attacks = sweep(target)
            if run.quick:  # a seeded tenth of them
                attacks = random.Random(run.seed + k).sample(attacks, len(attacks) // 10)
            exc = run_sweep(driver, attacks)
            swept += driver.calls
            if exc is None:
                left = (share - budget.elapsed()) / (len(decoders.TARGETS) - k)
                exc = hypothesis_run(driver, max(0.5, left), seed=run.seed * 1000 + k)
            res.operations += driver.calls
            res.notes.append(f"{cls.name}: {driver.calls} inputs, largest allocation "
                             f"{driver.max_alloc / MiB:.1f} MiB")
            if exc is not None:
                data, err = driver.failure or (b"", exc)
                findings.append(f"{cls.name}: {type(err).__name__}: {str(err)[:120]}")
                res.notes.append(f"{cls.name}: the input ({len(data)} bytes): "
                                 f"{data[:400]!r}{'…' if len(data) > 400 else ''}")
            res.trials += 1
    finally:
        quiet.setLevel(level)
        run.drop_tmpfs(scratch)
    broke = {f.split(":", 1)[0] for f in findings}
    held = [cls.name for cls in decoders.TARGETS if cls.name not in broke]
    res.held.append(f"{swept:,} field attacks and {res.operations - swept:,} inputs from "
                    f"Hypothesis; {len(held)} of "
                    f"{len(decoders.TARGETS)} decoders raised only library errors and allocated "
                    f"within {ALLOC_BOUND // MiB} MiB + {ALLOC_PER_BYTE} B per input byte")
    res.failed.extend(findings)  # one entry per decoder that broke
    if not use_atheris:
        res.notes.append("atheris: not run (" + ("--quick" if run.quick else
                         "not installed: `pip install atheris` failed or was not tried") + ")")
        if not run.quick:
            res.held.append("atheris not installed")
        return
    crashes = []
    executed = 0
    seconds = max(2.0, budget.left() / len(decoders.TARGETS) - 1.5)
    for cls in decoders.TARGETS:
        n, crash = atheris_run(run, cls, seconds)
        executed += n
        res.operations += n
        if crash:
            crashes.append(f"{cls.name}: {crash}")
    res.check(not crashes, f"atheris: {executed:,} executions, no crash",
              f"atheris: {len(crashes)} crashes: " + "; ".join(crashes))
    res.notes.extend(crashes)
