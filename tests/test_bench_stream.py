"""The stream benchmark's shuffled case in its quick form (``scripts/bench_stream --quick
--cases shuffle --no-datasets``, ~7 s): the script runs on the code as it is, prints every
table, and its quality table shows a shuffled order with no trace of the sorted corpus. No
timing is asserted (the numbers of a quick run mean little)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_quick_shuffled_benchmark_prints_its_tables_and_a_shuffled_order():
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_stream"), "--quick", "--cases", "shuffle",
         "--no-datasets", "--no-install"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    for title in ("### Shuffled throughput", "### Resume inside a shuffled epoch",
                  "### Shuffled targets", "### Memory of a shuffled pass",
                  "### Shuffle quality"):
        assert title in out, title
    rows = {}
    for line in out.split("### Shuffle quality")[1].splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("RecordStream"):
            rows[cells[0]] = (float(cells[1]), int(cells[2].replace(",", "")))
    file_order = rows.pop("RecordStream, file order")
    assert file_order[0] == 1.0, "the corpus is sorted: file order keeps it"
    assert len(rows) == 2
    for name, (rho, run) in rows.items():
        assert abs(rho) < 0.2 and run < 100, (name, rho, run)
