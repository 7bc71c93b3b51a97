"""How language models are pre-trained beyond HF's and Lightning's Trainer, through the demo.

Each case but the last is one ``jitckpt demo --script S --compare`` on 2 nodes with an
unchanged script (three jobs: the preempted one, its resume, an uninterrupted reference): a
plain DDP loop over a streaming dataset read by torchdata's ``StatefulDataLoader``,
a Lightning Fabric loop written as Fabric's examples are, and torchtitan's own
trainer (through the CPU adapter in ``scripts/``). The JIT checkpoint must be at the
preemption step and the resumed run bitwise equal to the uninterrupted one. The last
is a loop the shim cannot follow: the demo must say so, and why.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.e2e.support import JITCKPT, demo_summary

SCRIPTS = Path(__file__).with_name("scripts")
STREAMING = SCRIPTS / "loop_streaming.py"  # 24 steps on 2 nodes
FABRIC = SCRIPTS / "fabric_loop.py"  # 2 epochs of 12 steps on 2 nodes
CYCLE = SCRIPTS / "loop_cycle.py"  # 12 steps over itertools.cycle: not followed


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


@pytest.mark.slow
def test_a_lightning_fabric_loop_with_one_pod_of_two_preempted_resumes_bitwise(
    tmp_path: Path,
) -> None:
    """Fabric's DDP, bf16 precision plugin, DistributedSampler, a per-batch scheduler and
    augmentation in 2 workers that persist across epochs (their random states carried over
    from the first); stopped in its second epoch. What ``fabric.save`` wrote at
    the end (through a buffer, not a path torch.save sees), the loop's own step counter
    included, is the final model in the store, equal to the uninterrupted run's."""
    options = ["--nnodes", "2", "--preempt-at-step", "17", "--preempt-nodes", "one", "--keep"]
    summary = demo_summary(FABRIC, [*options, "--", "--persistent"], tmp_path)
    assert_resumed_bitwise(summary, 17)
    final = summary["final_model"]
    assert final is not None and final["valid"] and final["files"] == 1, summary["final_model"]
    saved = summary["saved_output"]
    assert saved["equal"] is True and saved["files"] == ["fabric_model.ckpt"], saved
    log = Path(summary["trainer_logs"]["preempted"][0]).read_text(errors="replace")
    assert "(Lightning Fabric: DDPStrategy, MixedPrecision)" in log
    assert "a JIT stop: its workers saved a JIT checkpoint" in log
    # The loop's step counter, which fabric.save writes beside the model, came back with it.
    resumed = Path(summary["trainer_logs"]["resumed"][0]).read_text(errors="replace")
    assert "the loop's own variables put back" in resumed, resumed[-2000:]


# Loops the shim cannot follow, and the words it gives: each trains to its end untouched.
GAVE_UP = {
    # itertools.cycle over a loader: its batches come from no DataLoader request.
    "cycle": (CYCLE, "without a new batch from a DataLoader"),
    # word_language_model without --use-optimizer: parameters updated by hand.
    "hand-written-sgd": (SCRIPTS / "loop_hand_sgd.py", "it trains with no optimizer"),
}


@pytest.mark.parametrize("case", list(GAVE_UP))
def test_the_demo_says_the_shim_gave_up_and_why_instead_of_an_early_end(
    case: str, tmp_path: Path
) -> None:
    """The shim says at the first steps that it cannot follow the loop and holds nothing,
    so the job trains to its end without a preemption, and the demo says that and why (the
    trainer's log and the sidecar's termination message), not "the job ended before step
    6"."""
    script, reason = GAVE_UP[case]
    command = [str(JITCKPT), "demo", "--script", str(script), "--nnodes", "1"]
    command += ["--preempt-at-step", "6", "--workdir", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode != 0
    said = done.stdout + done.stderr
    assert "ended before step" not in said
    assert "the shim gave up on this training, so nothing held it at step 6" in said
    assert "no preemption happened (the job ran to its end; last step reported" in said
    assert reason in said
    told = said.split("the sidecar's termination message: ", 1)[-1]
    gets_none = told.split("a training process gets no JIT checkpoint: ", 1)
    assert len(gets_none) == 2 and reason in gets_none[1], said[-3000:]
