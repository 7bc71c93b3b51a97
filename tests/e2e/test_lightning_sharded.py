"""Lightning with ``ModelParallelStrategy`` (FSDP2) through ``jitckpt demo``, as a user runs it.

The script (``scripts/train_lightning_fsdp2.py``) shards its model in
``configure_model`` with ``fully_shard`` over two nodes (one process each,
gloo on the CPU), so every rank holds half of each parameter and of AdamW's
state. One demo: two nodes, SIGTERM to one pod only, mid-epoch. The JIT
checkpoint, and the periodic ones (every 4 steps, their shards written behind
training by DCP's ``async_save``), are the strategy's own distributed
checkpoints, each node committing its own rank's shards; the
resumed run ends bitwise equal to the uninterrupted one, in the shim's
final weights and in what the script itself saves after ``fit()`` (a
distributed checkpoint too: both runs' shards, optimizer state and
Lightning's ``meta.pt`` of loops, schedulers and callbacks are compared).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from local.demo.weights import compare_saved
from tests.e2e.test_lightning import demo

SCRIPT = Path(__file__).with_name("scripts") / "train_lightning_fsdp2.py"
MAX_STEPS = 16
EVERY = 4  # periodic saves: one before the stop, the others after the resume
# Mid-epoch (6 steps an epoch: 96 samples in batches of 8 over 2 ranks), between the
# periodic saves of steps 4 and 8 (the JIT checkpoint lands at 5 or 6).
STOP = 5


def files_accepted(sidecar_logs: list[str], step: int, kind: str) -> list[int]:
    """How many files each node's sidecar took for ``checkpoint-<step>``, sorted."""
    pattern = rf"accepted checkpoint-{step} \({kind}, (\d+) files"
    return sorted(
        int(found) for log in sidecar_logs for found in re.findall(pattern, Path(log).read_text())
    )


def merged_final(work: Path, run: str, into: Path) -> Path:
    """The script's ``final.ckpt`` of ``run``: every node's shards in one directory, and the
    tensors (weights, optimizer state) read back into one ``torch.save`` file beside them."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    into.mkdir(parents=True)
    for node in sorted((work / run).glob("node-*")):
        for shard in (node / "lightning-out" / "final.ckpt").iterdir():
            shutil.copy(shard, into / shard.name)
    dcp_to_torch_save(into, into / "tensors.pt")
    return into


@pytest.mark.slow
def test_model_parallel_two_nodes_one_pod_preempted_resumes_bitwise(tmp_path: Path) -> None:
    step = STOP
    summary = demo(
        tmp_path,
        *("--keep", "--nnodes", "2", "--preempt-at-step", str(step), "--preempt-nodes", "one"),
        *("--set", f"save-steps={EVERY}"),
        "--",
        *("--max-steps", str(MAX_STEPS)),
        script=SCRIPT,
    )
    jit = summary["jit_checkpoint_step"]
    assert jit in (step, step + 1), summary
    assert summary["resumed_from_step"] == jit
    assert summary["trainer_exit_codes"] == [143, 143]
    assert summary["final_exit_codes"] == [0, 0]
    assert summary["final_step"] == MAX_STEPS
    assert summary["equal_to_uninterrupted"] is True
    # Each node staged its own rank's shards: node 0 its rank file, its shard, the
    # coordinator's .metadata and meta.pt; node 1 its rank file and its shard. So did the
    # periodic saves, whose shards DCP wrote behind training (staged once every rank's
    # write was done).
    preempted = summary["sidecar_logs"]["preempted"]
    assert files_accepted(preempted, jit, "jit") == [2, 4]
    assert files_accepted(preempted, EVERY, "periodic") == [2, 4]
    assert files_accepted(summary["sidecar_logs"]["resumed"], 2 * EVERY, "periodic") == [2, 4]
    for log in summary["trainer_logs"]["preempted"] + summary["trainer_logs"]["resumed"]:
        text = Path(log).read_text(errors="replace")
        assert text.count("shards are written behind the training loop") == 1, log
    for log in summary["trainer_logs"]["resumed"]:
        text = Path(log).read_text(errors="replace")
        assert f"resuming from /mnt/jitckpt/checkpoints/checkpoint-{jit}" in text
    # What the script saved after fit(): the same shards, optimizer state and meta.pt.
    work = Path(summary["workdir"]) / "work"
    resumed = sorted(p.name for p in work.glob("run-*"))[-1]
    reference = merged_final(work, "reference", tmp_path / "final-reference")
    again = merged_final(work, resumed, tmp_path / "final-resumed")
    for name in ("tensors.pt", "meta.pt"):
        assert compare_saved(reference / name, again / name) == [], name
