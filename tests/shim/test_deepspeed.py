"""DeepSpeed's engine under the shim, real processes (gloo on the CPU, no sidecar).

A loop of the program's own over ``deepspeed.initialize``'s engine is saved
by the engine's own ``save_checkpoint`` at the agreed step and resumed by its
``load_checkpoint``, bitwise; of the checkpoint the engine writes, a rank's
ZeRO partitions are the files marked node-local (``shim/zerofiles.py``), none
of them when the ZeRO config makes every rank read every rank's.
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from local.ports import free_port
from tests.shim.support import PYTHON, REPO, TORCHRUN, ShimEnv, Spawn, checkpoint_steps

DS_LOOP = Path(__file__).resolve().parents[1] / "e2e" / "scripts" / "loop_deepspeed.py"
HOLD = "JITCKPT_DEMO_HOLD_AT_STEP"
STEP = 5

LOOP = """
import json, os, sys
import deepspeed
import torch
from torch import nn
from _jitckpt_shim import zerofiles

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
config = {
    "train_micro_batch_size_per_gpu": 4,
    "zero_optimization": {"stage": int(sys.argv[1]), "elastic_checkpoint": sys.argv[2] == "1"},
    "zero_allow_untested_optimizer": True,
}
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
for _ in range(3):
    engine.backward(engine(torch.randn(4, 4)).sum())
    engine.step()
engine.save_checkpoint(sys.argv[3], tag="global_step3")
local = zerofiles.marker(engine)
names = sorted(
    os.path.relpath(os.path.join(here, name), sys.argv[3])
    for here, _, files in os.walk(sys.argv[3])
    for name in files
)
print(json.dumps({name: bool(local and local(name)) for name in names}))
"""


def run_loop(shim_env: ShimEnv, stage: int, elastic: bool) -> subprocess.CompletedProcess[str]:
    env = {
        **shim_env.env,
        **{"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"},
        **{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())},
    }
    out = shim_env.root / "ds-checkpoint"
    argv = [PYTHON, "-c", LOOP, str(stage), "1" if elastic else "0", str(out)]
    return subprocess.run(
        argv, env=env, cwd=str(REPO), capture_output=True, text=True, timeout=300, check=True
    )


def deepspeed_loop(output: Path, stage: int) -> list[str]:
    command = [TORCHRUN, "--standalone", "--nproc-per-node", "2", str(DS_LOOP)]
    return [*command, "--zero-stage", str(stage), "--epochs", "2", "--save-model", str(output)]


@pytest.mark.slow
def test_a_deepspeed_loop_is_saved_by_its_engine_at_the_step_and_resumed_bitwise(
    shim_env: ShimEnv, spawn: Spawn, tmp_path: Path
) -> None:
    """ZeRO-3 on 2 ranks (ZeRO-2 and Accelerate's ZeRO-3 run end to end in
    ``tests/e2e/test_deepspeed_loops.py``): SIGTERM at step 5 (two parameter groups: one
    engine step, two optimizer steps, counted once), the JIT checkpoint by the engine's own
    save_checkpoint, with no ``latest``; the resume by its load_checkpoint: bitwise."""
    stage = 3
    reference = spawn(
        deepspeed_loop(tmp_path / "reference.pt", stage), shim_env.ranks_without_shim()
    )
    cut = spawn(deepspeed_loop(tmp_path / "cut.pt", stage), {**shim_env.env, HOLD: str(STEP)})
    cut.wait_for(f"holding at step {STEP} ", timeout=240)
    cut.signal(signal.SIGTERM)
    assert cut.wait(timeout=120) == 143, cut.output()[-3000:]
    assert reference.wait(timeout=240) == 0, reference.output()[-3000:]
    output = cut.output()
    assert f"DeepSpeed (ZeRO stage {stage}): the engine's state saved" in output, output[-3000:]
    assert checkpoint_steps(shim_env.checkpoints) == [STEP]
    engine = shim_env.checkpoints / f"checkpoint-{STEP}" / "loop-state" / "deepspeed" / "engine-0"
    names = sorted(p.name for p in (engine / f"global_step{STEP}").iterdir())
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in names, names
    assert not (engine / "latest").exists()
    states = engine / f"global_step{STEP}" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    assert torch.load(states, weights_only=False)["global_steps"] == STEP  # counted once

    resumed = spawn(deepspeed_loop(tmp_path / "resumed.pt", stage), shim_env.env)
    assert resumed.wait(timeout=240) == 0, resumed.output()[-3000:]
    output = resumed.output()
    assert output.count(f"resumed at step {STEP}:") == 2, output[-3000:]
    assert output.count("with its engine's load_checkpoint") == 2, output[-3000:]
    left = torch.load(tmp_path / "resumed.pt", weights_only=True)
    right = torch.load(tmp_path / "reference.pt", weights_only=True)
    assert left["books"] == right["books"], (left["books"], right["books"])
    model = right["model"]
    assert [k for k in model if not torch.equal(left["model"][k], model[k])] == []


@pytest.mark.slow
def test_with_elastic_checkpoints_every_rank_reads_every_partition_so_none_is_node_local(
    shim_env: ShimEnv,
) -> None:
    marks = json.loads(run_loop(shim_env, 2, elastic=True).stdout.splitlines()[-1])
    assert "global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt" in marks
    assert "global_step3/mp_rank_00_model_states.pt" in marks
    assert not any(marks.values()), marks
