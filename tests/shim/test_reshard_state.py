"""What resharding keeps exactly: the model and optimizer state a plain FSDP2 loop saved
with DCP on 2 ranks, read back by ``shardedstate`` on 1 rank and on 3 (uneven shards),
is bitwise the saved one once put back (every parameter, AdamW's step and moments, the
parameter groups). The loop around it is tests/e2e/test_fsdp2_reshard.py."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from local.demo.weights import compare_saved
from tests.shim.support import EXIT_WAIT_DIR, REPO, TORCHRUN

WORKER = Path(__file__).with_name("reshard_worker.py")


def torchrun(ranks: int, mode: str, directory: Path, out: Path) -> None:
    path = os.pathsep.join([str(EXIT_WAIT_DIR), str(REPO)])  # gloo's exit wait: no abort at exit
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    command = [TORCHRUN, "--standalone", "--nproc-per-node", str(ranks), str(WORKER)]
    done = subprocess.run(
        [*command, mode, str(directory), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
def test_the_state_read_back_on_another_number_of_ranks_is_the_saved_one(tmp_path: Path) -> None:
    checkpoint = tmp_path / "checkpoint"
    torchrun(2, "save", checkpoint, tmp_path / "saved.pt")
    saved = torch.load(tmp_path / "saved.pt", weights_only=True)
    assert saved["optim"]["state"], "AdamW has a state after 3 steps"
    for ranks in (1, 3):
        torchrun(ranks, "load", checkpoint, tmp_path / f"read-{ranks}.pt")
        assert compare_saved(tmp_path / f"read-{ranks}.pt", tmp_path / "saved.pt") == [], ranks
    # Rank 1's shard file holds only its own parts (what AdamW's step and the parameter
    # groups hold is in rank 0's): on the same layout only rank 1 reads it (``nodelocal``).
    assert json.loads((tmp_path / "saved.pt.marks").read_text()) == ["__1_0.distcp"]
    # A file missing at a same-layout read fails DCP's read on every rank, none hangs or
    # reads on: the loop then starts over everywhere (``loop._load_sharded``).
    (checkpoint / "loop-state" / "dcp" / "__0_0.distcp").unlink()
    torchrun(2, "probe", checkpoint, tmp_path / "probe")
    assert [(tmp_path / f"probe.{rank}").exists() for rank in (0, 1)] == [True, True]
