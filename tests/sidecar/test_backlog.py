"""A slow store: the local backlog stays bounded, and the pod ends right after its JIT commit.

The real agent uploads through the fault proxy, which delays the periodic
checkpoints' PUTs (a store that is slow, not failing), so uploads fall behind
saves as they do for a large model. The trainer's side is the shim's own
staging code on an HF-like output directory that keeps `save_total_limit`
checkpoints, so the local volume is measured as it would be in the pod.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from local.s3server import LocalS3
from shim import protocol
from shim.channel import Client
from shim.staging import link_file, new_target
from shim.staging import stage as shim_stage
from tests.sidecar import shimtalk
from tests.sidecar.agentproc import AgentProcess
from tests.sidecar.helpers import bucket_objects, open_multipart_uploads
from tests.support.faultproxy import FaultProxy

SAVE_TOTAL_LIMIT = 2
# One node's checkpoint: a multipart file (the agent's parts are 5 MiB here) and small ones.
FILES = {"model.safetensors": 6 * 1024 * 1024, "optimizer.pt": 300_000, "trainer_state.json": 200}
CHECKPOINT_BYTES = sum(FILES.values())


class HFLikeTrainer:
    """Saves as HF's Trainer does (write checkpoint-<step>, rotate to the newest
    ``save_total_limit``), then hands the checkpoint over as the shim does."""

    def __init__(self, agent: AgentProcess, pid: int) -> None:
        self.agent = agent
        self.output = agent.local_dir / "checkpoints"
        self.client = Client(str(agent.socket))
        assert isinstance(self.client.call(shimtalk.hello(pid)), protocol.HelloAnswer)

    def save(self, step: int, kind: str = protocol.KIND_PERIODIC, stream: bool = False) -> None:
        """``stream``: each file is handed over as soon as it is written (``staging``), as
        the shim does with a JIT save, and the ``staged`` completes the checkpoint."""
        directory = self.output / f"checkpoint-{step}"
        directory.mkdir(parents=True)
        staging = str(self.agent.staging)
        target = new_target(str(directory), staging, kind) if stream else None
        for name, size in FILES.items():
            (directory / name).write_bytes(os.urandom(size))
            if target is not None:
                link_file(str(directory), target, name)
                part = protocol.Staging(step=step, kind=kind, dir=target, files=(name,))
                assert isinstance(self.client.call(part), protocol.StagedAnswer)
        kept = sorted(self.output.iterdir(), key=lambda p: int(p.name.split("-")[1]))
        for old in kept[:-SAVE_TOTAL_LIMIT]:
            shutil.rmtree(old)
        linked = list(FILES) if stream else []
        staged = shim_stage(str(directory), staging, step, kind, target_root=target, linked=linked)
        answer = self.client.call(staged)
        assert isinstance(answer, protocol.StagedAnswer), answer

    def close(self, exit_code: int) -> None:
        assert self.client.call(protocol.Bye(exit_code=exit_code)) == protocol.OkAnswer()
        self.client.close()


def _local_bytes(root: Path) -> int:
    """Bytes the local volume holds: every inode once, however many links it has."""
    seen: dict[tuple[int, int], int] = {}
    for here, _dirs, files in os.walk(root):
        for name in files:
            info = os.lstat(os.path.join(here, name))
            seen[(info.st_dev, info.st_ino)] = info.st_size
    return sum(seen.values())


def _uploading(agent: AgentProcess, step: int) -> bool:
    return any(
        row["step"] == step and row["state"] == "uploading" for row in agent.status()["queue"]
    )


def _manifest_steps(local_s3: LocalS3, bucket: str) -> set[int]:
    return {
        int(key.split("/")[2].split("-")[1])
        for key in bucket_objects(local_s3, bucket)
        if key.endswith("/.jitckpt/node-0.json")
    }


def test_backlog_stays_within_save_total_limit_plus_one(
    agent: AgentProcess, proxy: FaultProxy, local_s3: LocalS3, bucket: str
) -> None:
    proxy.delay(1.0, times=10_000, method="PUT", path=r"/checkpoint-\d+/")
    trainer = HFLikeTrainer(agent, pid=501)
    trainer.save(1)
    agent.wait_for(lambda: _uploading(agent, 1), 20, "checkpoint-1 uploading")
    for step in range(2, 7):
        trainer.save(step)
        # Once the sidecar answered: the one uploading and the newest, nothing else.
        assert len(list(agent.staging.iterdir())) <= 2
        assert len(agent.status()["queue"]) <= 2
        assert _local_bytes(agent.local_dir) <= (SAVE_TOTAL_LIMIT + 1) * CHECKPOINT_BYTES
    agent.wait_for(lambda: agent.status()["queue"] == [], 60, "the uploads to finish")
    status = agent.status()
    assert status["last_committed"]["step"] == 6
    assert status["superseded_count"] == 4
    assert [(item["step"], item["reason"]) for item in status["superseded"]] == [
        (step, f"superseded by checkpoint-{step + 1} before its upload began")
        for step in range(2, 6)
    ]
    assert "jitckpt_checkpoints_dropped_total 4.0" in agent.get("/metrics")[1]
    assert _manifest_steps(local_s3, bucket) == {1, 6}
    assert list(agent.staging.iterdir()) == []
    trainer.close(0)
    assert agent.terminate() == 0


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_pod_ends_once_the_jit_checkpoint_is_committed(
    agent: AgentProcess, proxy: FaultProxy, local_s3: LocalS3, bucket: str, streamed: bool
) -> None:
    # The periodic uploads crawl; the JIT one (checkpoint-4) is not held back by the store.
    proxy.delay(2.0, times=10_000, method="PUT", path=r"/checkpoint-[1-3]/")
    trainer = HFLikeTrainer(agent, pid=502)
    trainer.save(1)
    agent.wait_for(lambda: _uploading(agent, 1), 20, "checkpoint-1 uploading")
    trainer.save(2)
    trainer.save(3)

    # Preemption: the trainer's sigterm, the kubelet's SIGTERM to the sidecar, the JIT save.
    assert trainer.client.call(protocol.Sigterm(step=4)) == protocol.OkAnswer()
    assert agent.process is not None
    agent.process.terminate()
    trainer.save(4, protocol.KIND_JIT, stream=streamed)
    trainer.close(143)
    assert agent.wait(60) == 0

    message = agent.termination()
    assert message["last_committed"]["step"] == 4
    assert message["last_committed"]["kind"] == "jit"
    assert message["uncommitted"] == []
    assert sorted(message["superseded"]) == [1, 2, 3]
    log = agent.log()
    committed = log.index("committed checkpoint-4 (jit")
    assert ("checkpoint-4 (jit) streamed: model.safetensors" in log) == streamed
    assert log.index("dropping checkpoint-1 (periodic): superseded by the committed") > committed
    assert log.index("dropping checkpoint-3 (periodic): superseded by the committed") > committed
    assert "committed checkpoint-1" not in log and "committed checkpoint-3" not in log
    # Nothing of the superseded ones was committed, no multipart upload was left open (the
    # cancelled upload aborted its own), and no upload of checkpoint-3 ever began.
    assert _manifest_steps(local_s3, bucket) == {4}
    assert open_multipart_uploads(local_s3, bucket) == []
    assert not any("checkpoint-3/" in r.target for r in proxy.requests)
    assert list(agent.staging.iterdir()) == []
