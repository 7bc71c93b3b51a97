"""How language models are pre-trained beyond HF's and Lightning's Trainer, through the demo.

Each case is one ``jitckpt demo --script S --compare`` on 2 nodes with an unchanged
script (three jobs: the preempted one, its resume, an uninterrupted reference): a
plain DDP loop over a streaming dataset read by torchdata's ``StatefulDataLoader``,
a Lightning Fabric loop written as Fabric's examples are, and torchtitan's own
trainer (through the CPU adapter in ``scripts/``). The JIT checkpoint must be at the
preemption step and the resumed run bitwise equal to the uninterrupted one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.support import demo_summary

SCRIPTS = Path(__file__).with_name("scripts")
STREAMING = SCRIPTS / "loop_streaming.py"  # 24 steps on 2 nodes


def assert_resumed_bitwise(summary: dict, step: int) -> None:
    assert summary["ok"], (summary["failed_checks"], summary["_stderr"])
    assert summary["jit_checkpoint_step"] == step
    assert summary["resumed_from_step"] == step
    assert summary["equal_to_uninterrupted"] is True


@pytest.mark.slow
def test_a_streaming_dataset_read_by_a_stateful_loader_resumes_bitwise(tmp_path: Path) -> None:
    """HF ``datasets`` streamed from JSONL, split by node, in a worker of torchdata's loader:
    its place comes from the loader's own ``state_dict()``, there is no index to skip to."""
    options = ["--nnodes", "2", "--preempt-at-step", "10", "--keep"]
    summary = demo_summary(STREAMING, options, tmp_path)
    assert_resumed_bitwise(summary, 10)
    log = Path(summary["trainer_logs"]["resumed"][0]).read_text(errors="replace")
    assert "resumed at step 10: DataLoader #0, pass 0, after batch 10" in log
