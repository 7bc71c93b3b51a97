"""The cheapest benchmark end to end: real servers over TLS, real load generator, real files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench import table

REPO = Path(__file__).resolve().parents[2]


def test_admission_quick_single_rep_records_and_renders(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{table.START}\n{table.END}\n")
    results = tmp_path / "latest.json"
    quick = ["--quick", "--reps", "1", "--results", str(results), "--readme", str(readme)]
    completed = subprocess.run(
        [sys.executable, "-m", "bench.admission", *quick],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    section = json.loads(results.read_text())["benchmarks"]["admission"]
    assert section["command"].endswith("-m bench.admission --quick --reps 1")
    subjects = {s["subject"] for case in section["cases"] for s in case["series"]}
    assert subjects == {"jitckpt", "fastapi echo (floor)"}
    for case in section["cases"]:
        assert set(case["ratios"]) == {"fastapi echo (floor)"}
        for series in case["series"]:
            assert len(series["samples"]) == 1 and series["samples"][0] > 0
    assert "| admission | 8 concurrent: p99 latency (ms) | jitckpt |" in readme.read_text()
