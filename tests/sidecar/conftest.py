"""Shared fixtures: one moto S3 server for the whole area, a fresh bucket per test."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from local.s3server import LocalS3
from sidecar.config import AgentConfig
from tests.sidecar.agentproc import AgentProcess
from tests.support.faultproxy import FaultProxy


@pytest.fixture(scope="session")
def local_s3() -> Iterator[LocalS3]:
    with LocalS3() as server:
        yield server


@pytest.fixture
def s3_env(local_s3: LocalS3, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Credentials and endpoint in this process's env, as the Secret would give them."""
    env = local_s3.credentials_env()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    return env


@pytest.fixture
def bucket(local_s3: LocalS3) -> str:
    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    local_s3.create_bucket(name)
    return name


@pytest.fixture(params=["s3", "pvc"])
def destination(
    request: pytest.FixtureRequest, tmp_path: Path, local_s3: LocalS3, s3_env: dict[str, str]
) -> str:
    """A job root on each backend: S3 through moto, or a claim mounted at a temp dir."""
    if request.param == "s3":
        name = f"ckpt-{uuid.uuid4().hex[:12]}"
        local_s3.create_bucket(name)
        return f"s3://{name}/team/ns-a/job-1"
    return "pvc://claim-a/ckpts/ns-a/job-1"


@pytest.fixture
def config(destination: str, tmp_path: Path) -> AgentConfig:
    return AgentConfig(
        destination=destination,
        local_dir=tmp_path / "local",
        socket_path=tmp_path / "run" / "agent.sock",
        pvc_mount=tmp_path / "pvc",
        part_size=5 * 1024 * 1024,
        s3_read_timeout=5.0,
    )


@pytest.fixture
def proxy(local_s3: LocalS3) -> Iterator[FaultProxy]:
    """A proxy in front of the shared S3 server, for the faults a test injects."""
    with FaultProxy(local_s3.endpoint) as running:
        yield running


@pytest.fixture
def agent(
    tmp_path: Path, proxy: FaultProxy, bucket: str, s3_env: dict[str, str]
) -> Iterator[AgentProcess]:
    """A real agent for the job root ``ns/job``, its store reached through ``proxy``."""
    env = dict(s3_env, AWS_S3_ENDPOINT=proxy.endpoint)
    proc = AgentProcess(root=tmp_path, destination=f"s3://{bucket}/ns/job", s3_env=env)
    proc.start()
    proc.wait_ready()
    yield proc
    proc.kill()
