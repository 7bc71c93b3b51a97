"""Bytes each node downloads when a plain FSDP2 loop resumes, same layout vs resharded.

`jitckpt demo` of the FSDP2 test script (tests/e2e/scripts/loop_fsdp2.py),
one pod preempted at step 3, the job re-created on the same number of nodes
(2 -> 2) or on another (2 -> 1, 1 -> 2). Each pod's sidecar says what it
committed (a node's own files: its ranks' shards and rank files, node 0 also
DCP's ``.metadata``) and what it restored; the whole checkpoint is the sum
of what the nodes committed. Resharded, every restoring node downloads the
union of all nodes' files (each new rank reads parts of every shard); on the
same layout (nodes and processes per node) a node downloads its own files and
the other nodes' shared ones only (DCP's ``.metadata``, rank 0's shard, which
holds the replicated state; ``sidecar/nodefiles.py``).

    python -m bench.restore_bytes [--quick]
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from bench import harness
from bench.harness import BenchOptions
from bench.procs import tool
from bench.results import Case, Series

NAME = "restore_bytes"
ROOT = Path(__file__).parents[1]
SCRIPT = ROOT / "tests" / "e2e" / "scripts" / "loop_fsdp2.py"
WHOLE, OWN = "whole checkpoint", "a node's own files (what it committed)"
LAYOUTS = ((2, 2), (2, 1), (1, 2))
COMMITTED = re.compile(r"committed checkpoint-\d+ \(jit, (\d+) bytes")
RESTORED = re.compile(r"restored checkpoint-\d+ \((\d+) bytes\)")


def subject(old: int, new: int) -> str:
    how = "same layout" if old == new else "resharded"
    return f"downloaded per node, {how} {old} -> {new}"


def _found(pattern: re.Pattern[str], logs: list[str]) -> list[float]:
    """The byte counts ``pattern`` finds in each sidecar log, in MB."""
    found = []
    for log in logs:
        match = pattern.search(Path(log).read_text(errors="replace"))
        if match is None:
            raise RuntimeError(f"no {pattern.pattern!r} in {log}")
        found.append(int(match[1]) / 1e6)
    return found


def demo(old: int, new: int, model: list[str], workdir: Path) -> dict:
    command = [tool("jitckpt"), "demo", "--script", str(SCRIPT), "--json", "--keep"]
    command += ["--nnodes", str(old), "--resume-nnodes", str(new), "--preempt-nodes", "one"]
    command += ["--preempt-at-step", "3", "--workdir", str(workdir), "--", *model]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1200, check=False)
    summary = json.loads(done.stdout)
    if not summary["ok"]:
        raise RuntimeError(f"demo {old} -> {new} failed: {summary.get('failed_checks')}")
    return summary


def run(options: BenchOptions) -> list[Case]:
    model = ["--epochs", "1"] + ([] if options.quick else ["--dim", "128", "--layers", "4"])
    by_writer: dict[int, dict[str, list[float]]] = {}
    for old, new in LAYOUTS:
        workdir = Path(tempfile.mkdtemp(prefix="jitckpt-bench-restore-"))
        try:
            summary = demo(old, new, model, workdir)
            committed = _found(COMMITTED, summary["sidecar_logs"]["preempted"])
            restored = _found(RESTORED, summary["sidecar_logs"]["resumed"])
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        series = by_writer.setdefault(old, {WHOLE: [sum(committed)], OWN: committed})
        series[subject(old, new)] = restored
    return [
        Case(
            benchmark=NAME,
            case=f"FSDP2 loop, checkpoint of {old} node(s) ({series[WHOLE][0]:.1f} MB), "
            "1 process per node",
            metric="bytes downloaded per node at restore",
            unit="MB",
            lower_is_better=True,
            series=[Series(name, samples, {}) for name, samples in series.items()],
            reference=WHOLE,
            note="restore_bytes: resharded, every node downloads the union of the nodes' "
            "files; on the same layout its own files and the shared ones (DCP's .metadata and "
            "rank 0's shard, which holds the replicated state): per node, node 0 first",
        )
        for old, series in by_writer.items()
    ]


if __name__ == "__main__":
    raise SystemExit(harness.main(NAME, "bench.restore_bytes", run, __doc__))
