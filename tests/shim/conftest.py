"""Fixtures for the shim's tests (helpers live in ``support.py``)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from local.s3server import LocalS3
from tests.shim.support import ShimEnv, Spawn, Spawner
from tests.sidecar.agentproc import AgentProcess


@pytest.fixture
def shim_env(tmp_path: Path) -> ShimEnv:
    return ShimEnv(tmp_path)


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Spawn]:
    """Start processes that are killed at the end of the test if still running."""
    spawner = Spawner(tmp_path)
    yield spawner
    spawner.close()


@pytest.fixture(scope="session")
def local_s3() -> Iterator[LocalS3]:
    with LocalS3() as server:
        yield server


@pytest.fixture
def agent(shim_env: ShimEnv, local_s3: LocalS3) -> Iterator[AgentProcess]:
    """The real ``jitckpt agent`` serving this test's socket, with a fresh bucket."""
    bucket = f"shim-{uuid.uuid4().hex[:12]}"
    local_s3.create_bucket(bucket)
    process = AgentProcess(
        root=shim_env.root,
        destination=f"s3://{bucket}/ns-a/job-1",
        s3_env=local_s3.credentials_env(),
        extra_env={"JITCKPT_GRACE_SECONDS": "60"},
    )
    process.start()
    process.wait_ready()
    yield process
    process.kill()
