"""Lightning's ModelParallelStrategy (FSDP2) under the shim: a checkpoint of another layout.

Two one-process "nodes" (torchrun each, gloo on the CPU) run the user-style
FSDP2 script of the end-to-end tests, unchanged, and are stopped at step 3:
each rank writes its shards of ``checkpoint-3/model.ckpt/`` (rank 0 also
the ``.metadata`` and ``meta.pt``). Given every node's files, as a restore
gives them, a run with one process must not resume from it: the sharded
weights would load (DCP reshards) but each rank's data position and random
states belong to two ranks. It says so once and trains from the start.
(The resume on the same layout is ``tests/e2e/test_lightning_sharded.py``.)
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.shim.support import PYTHON, TORCHRUN, Proc, ShimEnv, jit_lines
from tests.shim.test_lightning import _worker_pid

SCRIPT = str(Path(__file__).parents[1] / "e2e" / "scripts" / "train_lightning_fsdp2.py")
HOLD = "JITCKPT_DEMO_HOLD_AT_STEP"
# What the two ranks write into checkpoint-3/ (rank 0 also the coordinator's files).
WRITTEN = [
    "jitckpt_rank_0.pt",
    "jitckpt_rank_1.pt",
    "model.ckpt",
    "model.ckpt/.metadata",
    "model.ckpt/__0_0.distcp",
    "model.ckpt/__1_0.distcp",
    "model.ckpt/meta.pt",
]


@pytest.mark.slow
def test_a_checkpoint_of_two_ranks_is_not_resumed_by_one(tmp_path: Path) -> None:
    nodes = []
    for rank in range(2):
        env = ShimEnv(tmp_path / f"node-{rank}")
        env.env[HOLD] = "3"
        command = [TORCHRUN, "--nnodes=2", "--nproc-per-node=1", f"--node-rank={rank}"]
        command += ["--master-addr=127.0.0.1", "--master-port=29563", SCRIPT]
        command += ["--output-dir", str(tmp_path / f"out-{rank}"), "--max-steps", "5"]
        nodes.append((env, Proc(command, env.env, tmp_path / f"node-{rank}.log")))
    try:
        nodes[0][1].wait_for("holding at step 3 until", timeout=180)
        subprocess.run(["kill", "-TERM", str(_worker_pid(nodes[0][0]))], check=True)
        codes = [proc.wait(timeout=120) for _, proc in nodes]
    finally:
        for _, proc in nodes:
            if proc.popen.poll() is None:
                proc.popen.kill()
    assert codes == [143, 143], nodes[0][1].output()[-3000:] + nodes[1][1].output()[-3000:]
    (env0, _), (env1, _) = nodes
    # Every node's files in node 0's volume, as the sidecar's restore brings them. (Here
    # the nodes' volumes have different paths, and Lightning writes the shards under the
    # path rank 0 names, so node 1's shard is there already; in pods both are the same.)
    shutil.copytree(env1.checkpoints, env0.checkpoints, dirs_exist_ok=True)
    checkpoint = env0.checkpoints / "checkpoint-3"
    written = sorted(str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*"))
    assert written == WRITTEN
    alone = Proc(
        [PYTHON, SCRIPT, "--output-dir", str(tmp_path / "alone"), "--max-steps", "5"],
        {key: value for key, value in env0.env.items() if key != HOLD},
        tmp_path / "alone.log",
    )
    assert alone.wait(timeout=180) == 0, alone.output()[-3000:]
    output = alone.output()
    said = [line for line in jit_lines(output) if "was written by 2 processes" in line]
    assert len(said) == 1 and "this run has 1" in said[0], jit_lines(output)
    assert "resuming from" in output  # the step was agreed, then the layout refused
    assert "fit() returned at step 5" in output
