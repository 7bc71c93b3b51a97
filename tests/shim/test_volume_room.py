"""Uploads slower than saves: the local volume holds two checkpoints, never three.

A real HF run with the shim saves every 2 steps behind the loop, through the real
agent, to S3 behind a proxy that delays every checkpoint upload request: each
checkpoint takes several saves' time to upload. Without the room's wait
(``shim/volumeroom.py``) the volume held three checkpoints then, the one
uploading, the one queued behind it and the one being written; with it the
writer waits, its snapshot in host memory, and the sidecar holds the queued one
back so that the held one supersedes it. Sampled every 20 ms, each inode once.
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import pytest

from bench.volume import VolumePeak, bytes_on_disk
from local.s3server import LocalS3
from tests.shim.support import PYTHON, TRAIN_TINY, ShimEnv, Spawn
from tests.sidecar.agentproc import AgentProcess
from tests.support.faultproxy import FaultProxy

STEPS = 16
# What the file system's blocks add to the final model's bytes (a few small files).
SLACK = 256 * 1024


@pytest.mark.slow
def test_uploads_slower_than_saves_keep_two_checkpoints_on_the_volume(
    shim_env: ShimEnv, local_s3: LocalS3, spawn: Spawn, tmp_path: Path
) -> None:
    bucket = f"room-{uuid.uuid4().hex[:12]}"
    local_s3.create_bucket(bucket)
    with FaultProxy(local_s3.endpoint) as proxy:
        proxy.delay(1.0, times=100_000, method="PUT", path=r"/checkpoint-\d+/")
        agent = AgentProcess(
            root=shim_env.root,
            destination=f"s3://{bucket}/ns-a/job-1",
            s3_env=dict(local_s3.credentials_env(), AWS_S3_ENDPOINT=proxy.endpoint),
            extra_env={"JITCKPT_GRACE_SECONDS": "60"},
        )
        agent.start()
        try:
            agent.wait_ready()
            args = ["--output-dir", str(tmp_path / "out"), "--max-steps", str(STEPS)]
            args += ["--save-steps", "2", "--step-sleep", "0.15", "--hidden-size", "256"]
            with VolumePeak([shim_env.checkpoints, agent.staging], interval=0.02) as peak:
                run = spawn([PYTHON, *TRAIN_TINY, *args], shim_env.env)
                assert run.wait() == 0, run.output()
                agent.wait_for(lambda: agent.status()["queue"] == [], 120, "the uploads")
            status = agent.status()
        finally:
            agent.kill()
    output = run.output()
    checkpoint = bytes_on_disk([shim_env.checkpoints / f"checkpoint-{STEPS}"])
    # The uploads fell behind: a save waited for room, and the sidecar held one back for it.
    assert "waits in host memory before it is written" in output, output[-4000:]
    assert "the trainer holds checkpoint-" in agent.log()
    # Beside the two checkpoints, the final model that ``save_model()`` wrote after ``train()``.
    [final] = re.findall(r"final model handed to the sidecar: \d+ files, (\d+) bytes", output)
    assert peak.peak <= 2 * checkpoint + int(final) + SLACK, (peak.peak, checkpoint, final)
    # Nothing was lost for it: the last save is committed, and every save the sidecar was
    # handed was committed or superseded by a newer one, none by a hold that timed out.
    assert status["last_committed"]["step"] == STEPS
    assert "was not staged within" not in agent.log()
    assert "Traceback" not in output
