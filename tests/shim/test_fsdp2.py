"""A plain FSDP2 loop under the shim, without a sidecar: what its checkpoint holds, a resume
whose first sharded forward pass comes before the resume point, and a resume on another
number of processes.

The JIT checkpoint stays in the local dir, where the next process finds it
(the sidecar, the store and two pods are exercised in tests/e2e/test_fsdp2.py,
stopped in the first epoch: there the resume point comes first). A checkpoint
written by 2 processes is resumed by 1: the shards are read resharded and the
data position mapped onto the one process (``reshard``; the samples themselves
are checked in tests/e2e/test_fsdp2_reshard.py).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch

from tests.shim.support import TORCHRUN, ShimEnv, Spawn, checkpoint_steps

SCRIPT = Path(__file__).resolve().parents[1] / "e2e" / "scripts" / "loop_fsdp2.py"
DDP_SCRIPT = SCRIPT.with_name("loop_ddp_mnist.py")
HOLD = "JITCKPT_DEMO_HOLD_AT_STEP"


def torchrun(processes: int, output: Path) -> list[str]:
    command = [TORCHRUN, "--standalone", "--nproc-per-node", str(processes), str(SCRIPT)]
    return [*command, "--save-model", str(output)]


def cut_at(shim_env: ShimEnv, spawn: Spawn, processes: int, step: int, tmp_path: Path) -> Path:
    """Run on ``processes`` ranks, stopped by SIGTERM at ``step``: the checkpoint's loop state."""
    cut = spawn(torchrun(processes, tmp_path / "cut.pt"), {**shim_env.env, HOLD: str(step)})
    cut.wait_for(f"holding at step {step} ", timeout=240)
    cut.signal(signal.SIGTERM)
    assert cut.wait(timeout=120) == 143, cut.output()[-3000:]
    assert checkpoint_steps(shim_env.checkpoints) == [step]
    return shim_env.checkpoints / f"checkpoint-{step}" / "loop-state"


@pytest.mark.slow
def test_a_checkpoint_of_two_ranks_is_resumed_resharded_by_one(
    shim_env: ShimEnv, spawn: Spawn, tmp_path: Path
) -> None:
    """Then stopped again on the one process, in the pass it resumed between the old
    batches, and resumed there: bitwise equal to the one process never stopped again."""
    state = cut_at(shim_env, spawn, 2, 5, tmp_path)
    names = sorted(p.name for p in state.iterdir())
    assert names == ["dcp", "node-0.json", "rank-00000.pt", "rank-00001.pt"]
    assert sorted(p.name for p in (state / "dcp").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    assert json.loads((state / "node-0.json").read_text())["world_size"] == 2

    alone = spawn(torchrun(1, tmp_path / "alone.pt"), shim_env.env)
    assert alone.wait(timeout=240) == 0, alone.output()[-3000:]
    output = alone.output()
    assert "checkpoint-5 was written by 2 processes, this job has 1: the sharded" in output
    assert "from position 40 of its order (the 2 old processes took positions 0 to 39)" in output
    assert "resumed at step 5: DataLoader #0, pass 0, after 40 sample(s) and batch 0" in output
    assert "training starts over" not in output
    assert output.count("training done") == 1

    again = spawn(torchrun(1, tmp_path / "cut-again.pt"), {**shim_env.env, HOLD: "9"})
    again.wait_for("holding at step 9 ", timeout=240)
    again.signal(signal.SIGTERM)
    assert again.wait(timeout=120) == 143, again.output()[-3000:]
    assert checkpoint_steps(shim_env.checkpoints) == [5, 9]
    resumed = spawn(torchrun(1, tmp_path / "resumed.pt"), shim_env.env)
    assert resumed.wait(timeout=240) == 0, resumed.output()[-3000:]
    assert "resumed at step 9: DataLoader #0, pass 0, after 56 sample(s)" in resumed.output()
    left = torch.load(tmp_path / "resumed.pt", weights_only=True)
    right = torch.load(tmp_path / "alone.pt", weights_only=True)
    assert [name for name in right if not torch.equal(left[name], right[name])] == []


@pytest.mark.slow
def test_a_ddp_checkpoint_of_two_ranks_is_said_and_not_used_by_one(
    shim_env: ShimEnv, spawn: Spawn, tmp_path: Path
) -> None:
    """A DDP loop's rank files are not resharded: said once, training starts over."""

    def ddp(processes: int, output: str) -> list[str]:
        command = [TORCHRUN, "--standalone", "--nproc-per-node", str(processes), str(DDP_SCRIPT)]
        return [*command, "--epochs", "1", "--save-model", str(tmp_path / output)]

    cut = spawn(ddp(2, "cut.pt"), {**shim_env.env, HOLD: "3"})
    cut.wait_for("holding at step 3 ", timeout=240)
    cut.signal(signal.SIGTERM)
    assert cut.wait(timeout=120) == 143, cut.output()[-3000:]
    alone = spawn(ddp(1, "alone.pt"), shim_env.env)
    assert alone.wait(timeout=240) == 0, alone.output()[-3000:]
    output = alone.output()
    assert output.count("it was written by 2 processes, this job has 1: only a training") == 1
    assert "training starts over" in output and "resumed at step" not in output


@pytest.mark.slow
def test_resumed_in_the_second_epoch_after_the_first_epochs_evaluation_is_bitwise_equal(
    shim_env: ShimEnv, spawn: Spawn, tmp_path: Path
) -> None:
    """Stopped at step 17 (12 steps an epoch): on resume the first epoch yields no batch,
    and its evaluation, a sharded forward pass, comes before the resume point, so the
    shards are read there (and put back once more at the resume point)."""
    reference = spawn(torchrun(2, tmp_path / "reference.pt"), shim_env.ranks_without_shim())
    assert reference.wait(timeout=240) == 0, reference.output()[-3000:]
    cut_at(shim_env, spawn, 2, 17, tmp_path)
    resumed = spawn(torchrun(2, tmp_path / "resumed.pt"), shim_env.env)
    assert resumed.wait(timeout=240) == 0, resumed.output()[-3000:]
    output = resumed.output()
    assert "resumed at step 17: DataLoader #0, pass 1, after batch 5" in output, output[-3000:]
    assert output.count("training done") == 1
    assert output.count("with DCP (at the first sharded forward pass)") == 2  # each rank
    left = torch.load(tmp_path / "resumed.pt", weights_only=True)
    right = torch.load(tmp_path / "reference.pt", weights_only=True)
    assert left.keys() == right.keys()
    assert [name for name in left if not torch.equal(left[name], right[name])] == []
    held_out = [line for line in output.splitlines() if "epoch 1 held-out loss" in line]
    assert held_out and held_out[0] in reference.output()
