"""One decoder fuzzed by atheris (libFuzzer, coverage-guided): ``python -m
faultfs.testing.torture.fuzz_atheris TARGET [libFuzzer flags]``, ``TARGET`` a class name of
``decoders.TARGETS``.

faultfs's modules are imported under ``atheris.instrument_imports`` (only they are instrumented:
instrumenting everything loaded takes minutes). The target's seeds are the starting corpus; an
input whose first byte is 0xFF has the format's checksums recomputed first. Any exception but
the library's own is a crash, which libFuzzer reports and saves. libFuzzer ends the process
itself, so scratch directories are made under ``TMPDIR`` (the torture run points it into its
own root, which it removes).
"""

from __future__ import annotations

import os
import sys
import tempfile


def main(argv: list[str]) -> int:
    import atheris  # an optional tool: only this entry point needs it

    with atheris.instrument_imports(include=["faultfs"]):
        from faultfs.errors import FaultfsError
        from faultfs.testing.torture.decoders import by_key

    target = by_key(argv[0])(tempfile.mkdtemp(prefix="faultfs-atheris-"))
    corpus = tempfile.mkdtemp(prefix="faultfs-atheris-corpus-")
    for i, seed in enumerate(target.seeds()):
        with open(os.path.join(corpus, f"seed-{i}"), "wb") as f:
            f.write(seed)

    def one(data: bytes) -> None:
        try:
            target(data if data[:1] != b"\xff" else target.fix(data[1:]))
        except FaultfsError:
            pass

    atheris.Setup([sys.argv[0], *argv[1:], corpus], one)
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
