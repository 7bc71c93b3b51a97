"""A plain FSDP2 loop under the shim, without a sidecar: what its checkpoint holds, and a
resume on another number of processes.

The JIT checkpoint stays in the local dir, where the next process finds it
(the sidecar, the store and two pods are exercised in tests/e2e/test_fsdp2.py).
The data position and per-rank random states of one world size are not mapped
onto another yet, so a checkpoint written by 2 processes is said and not used
by 1 (and by 2 after 1): training starts over and ends normally, as it would
without jitckpt.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from tests.shim.support import TORCHRUN, ShimEnv, Spawn, checkpoint_steps

SCRIPT = Path(__file__).resolve().parents[1] / "e2e" / "scripts" / "loop_fsdp2.py"
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
def test_a_checkpoint_of_two_ranks_is_said_and_not_used_by_one(
    shim_env: ShimEnv, spawn: Spawn, tmp_path: Path
) -> None:
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
    assert "it was written by 2 processes, this job has 1" in output
    assert "training starts over" in output and "resumed at step" not in output
    assert output.count("training done") == 1
    assert (tmp_path / "alone.pt").exists()
