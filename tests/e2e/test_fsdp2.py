"""Plain FSDP2 loops (``fully_shard`` per block, DCP checkpoints) through ``jitckpt demo``.

The script is written as a torchtitan-style user writes it and knows nothing
about jitckpt: two pods of one process each (gloo on CPU), one pod told to
stop, the JIT checkpoint saved with ``torch.distributed.checkpoint`` (each
rank its shards), the job re-created and resumed. Equal means bitwise: the
shim's final weights (rank 0's shards) and the full model the script gathers
and saves at its end, tensor by tensor.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.e2e.support import demo_summary

SCRIPT = Path(__file__).with_name("scripts") / "loop_fsdp2.py"


def demo(tmp_path: Path, *options: str) -> dict:
    return demo_summary(SCRIPT, list(options), tmp_path / "demo", timeout=600)


@pytest.mark.slow
def test_fsdp2_loop_two_nodes_one_pod_preempted_resumes_bitwise(tmp_path: Path) -> None:
    options = ["--nnodes", "2", "--preempt-nodes", "one", "--preempt-at-step", "7", "--keep"]
    summary = demo(tmp_path, *options)
    assert summary["ok"] is True, summary
    assert summary["jit_checkpoint_step"] == summary["resumed_from_step"] == 7
    assert summary["final_step"] == 24
    assert summary["equal_to_uninterrupted"] is True
    assert summary["saved_output"]["equal"] is True, summary["saved_output"]
    assert summary["saved_output"]["files"] == ["lm_final.pt"]
    for log in summary["trainer_logs"]["resumed"]:  # stopped in the first epoch: read there
        assert "with DCP (at the resume point)" in Path(log).read_text(errors="replace")
    # Same layout: each node downloaded its own files and the shared ones only. Node 1's
    # are all its own (its rank's, and its marker); node 0's shard holds the replicated
    # state, read by both, as are its marker and DCP's .metadata.
    committed = byte_counts(summary["sidecar_logs"]["preempted"], COMMITTED)
    restored = byte_counts(summary["sidecar_logs"]["resumed"], RESTORED)
    assert restored[0] == committed[0], (committed, restored)
    assert committed[1] < restored[1] < sum(committed), (committed, restored)
    # The demo's summary says each pod's bytes, from its sidecar: the same downloads.
    [resumed] = summary["resumed_runs"]
    assert sorted(resumed["downloaded_bytes"].values()) == sorted(restored), resumed


COMMITTED = re.compile(r"committed checkpoint-7 \(jit, (\d+) bytes")
RESTORED = re.compile(r"restored checkpoint-7 \((\d+) bytes\)")


def byte_counts(logs: list[str], pattern: re.Pattern[str]) -> list[int]:
    """What ``pattern`` finds in each node's sidecar log, node 0 first."""
    found = [pattern.search(Path(log).read_text(errors="replace")) for log in logs]
    assert all(found), logs
    return [int(match[1]) for match in found if match]


def lines(log: str, text: str) -> list[int]:
    """The numbers of the lines of ``log`` that hold ``text``."""
    found = Path(log).read_text(errors="replace").splitlines()
    return [number for number, line in enumerate(found) if text in line]


@pytest.mark.slow
def test_fsdp2_jit_stop_while_a_periodic_save_is_in_flight_resumes_bitwise(
    tmp_path: Path,
) -> None:
    """Periodic saves every 3 steps, written behind training; the stop is agreed at step 7,
    before the ranks agreed that step 6's shards are written: the JIT save completes and
    stages checkpoint-6 first, then writes checkpoint-7, which resumes exactly."""
    summary = demo(
        tmp_path,
        *("--nnodes", "2", "--preempt-nodes", "one", "--preempt-at-step", "7"),
        *("--set", "save-steps=3", "--keep"),  # --keep: the trainers' logs are read below
    )
    assert summary["ok"] is True, summary
    assert summary["jit_checkpoint_step"] == summary["resumed_from_step"] == 7
    assert summary["equal_to_uninterrupted"] is True
    assert summary["saved_output"]["equal"] is True, summary["saved_output"]
    for log in summary["trainer_logs"]["preempted"]:  # each node's: its local rank 0 stages
        stop = lines(log, "stopping at step 7 for a JIT checkpoint")
        periodic = lines(log, "periodic checkpoint-6 handed to the sidecar")
        jit = lines(log, "jit checkpoint-7 handed to the sidecar")
        assert stop and jit and stop[0] < periodic[0] < jit[0], log
