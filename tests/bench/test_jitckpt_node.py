"""The bench's jitckpt node commits where its destination says, a pvc:// one included.

``bench.stall``'s diagnostic series at 2 GB (jitckpt with a ``pvc://``
destination) means something only if the agent really copies each periodic
checkpoint into the claim's directory and never to S3: a small real training
run under the real shim and agent shows it.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from bench.jitckpt_node import JitckptNode
from bench.training_run import ModelShape, workload_argv
from shim import layout


def test_a_pvc_destination_gets_every_periodic_checkpoint(tmp_path: Path) -> None:
    node = JitckptNode(
        tmp_path / "node",
        "pvc://bench-claim/bench/stall",
        {},  # no S3 credentials: nothing may go to a store
        pvc_mount=tmp_path / "claim",
    )
    argv = workload_argv(
        ModelShape.for_state("1 MB", 1_000_000),
        tmp_path / "output",
        tmp_path / "timeline.jsonl",
        max_steps=4,
        save_steps=2,
    )
    with node:
        env = node.trainer_env()
        done = subprocess.run(argv, env=env, capture_output=True, timeout=300, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
    root = tmp_path / "claim" / "bench" / "stall"
    manifests = sorted(
        p.parent.parent.name for p in root.glob(f"*/{layout.MANIFEST_DIR}/node-*.json")
    )
    assert manifests == ["checkpoint-2", "checkpoint-4"], (manifests, node.log_tail())
    log = (tmp_path / "node" / "agent.log").read_text()
    assert "committed checkpoint-4" in log and "pvc://bench-claim" in log, log
