"""DeepSpeed's engine under the shim, one real process each (gloo on the CPU, no sidecar).

A loop of the program's own over ``deepspeed.initialize``'s engine is named
for what it is (its optimizer is DeepSpeed's, not a bare tensor's), and of the
checkpoint the engine's own ``save_checkpoint`` writes, a rank's ZeRO
partitions are the files marked node-local (``shim/zerofiles.py``), none of
them when the ZeRO config makes every rank read every rank's.
"""

from __future__ import annotations

import json
import socket
import subprocess

import pytest

from tests.shim.support import PYTHON, REPO, ShimEnv

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


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run_loop(shim_env: ShimEnv, stage: int, elastic: bool) -> subprocess.CompletedProcess[str]:
    env = {
        **shim_env.env,
        **{"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"},
        **{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())},
    }
    out = shim_env.root / "ds-checkpoint"
    argv = [PYTHON, "-c", LOOP, str(stage), "1" if elastic else "0", str(out)]
    return subprocess.run(
        argv, env=env, cwd=str(REPO), capture_output=True, text=True, timeout=300, check=True
    )


@pytest.mark.slow
def test_a_deepspeed_loop_is_named_and_its_ranks_partitions_are_node_local(
    shim_env: ShimEnv,
) -> None:
    done = run_loop(shim_env, 3, elastic=False)
    said = [line for line in done.stderr.splitlines() if "cannot be resumed exactly" in line]
    assert len(said) == 1, done.stderr[-3000:]
    assert "DeepSpeed's engine steps its optimizer (ZeRO stage 3)" in said[0]
    assert "no module the shim saw" not in said[0]
    marks = json.loads(done.stdout.splitlines()[-1])
    own = {name for name, local in marks.items() if local}
    assert own == {
        "global_step3/zero_pp_rank_0_mp_rank_00_model_states.pt",
        "global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt",
    }, marks
    assert "latest" in marks


@pytest.mark.slow
def test_with_elastic_checkpoints_every_rank_reads_every_partition_so_none_is_node_local(
    shim_env: ShimEnv,
) -> None:
    marks = json.loads(run_loop(shim_env, 2, elastic=True).stdout.splitlines()[-1])
    assert "global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt" in marks
    assert "global_step3/mp_rank_00_model_states.pt" in marks
    assert not any(marks.values()), marks
