"""Uploads through a fault-injecting proxy in front of moto all end committed and verified."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from local.s3server import LocalS3
from sidecar.config import AgentConfig
from sidecar.restore import restore
from sidecar.storage.factory import open_store
from sidecar.validity import scan
from tests.sidecar.helpers import commit, make_checkpoint
from tests.support.faultproxy import FaultProxy

SIZES = {"model.safetensors": 11 * 1024 * 1024, "optimizer.pt": 700_000, "config.json": 90}


@pytest.fixture
def s3_config(
    proxy: FaultProxy,
    bucket: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    local_s3: LocalS3,
) -> AgentConfig:
    for name, value in local_s3.credentials_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_S3_ENDPOINT", proxy.endpoint)
    return AgentConfig(
        destination=f"s3://{bucket}/ns/job",
        local_dir=tmp_path / "local",
        part_size=5 * 1024 * 1024,
        s3_read_timeout=1.5,
    )


def _commit_and_restore(config: AgentConfig, tmp_path: Path) -> tuple[bool, str]:
    """Commit through the proxy, judge the store, restore and compare every byte."""
    source = make_checkpoint(tmp_path, 5, SIZES)

    async def main() -> tuple[bool, str, str | None]:
        async with open_store(config) as store:
            await commit(store, source, 5)
            states = [s async for s in scan(store)]
            result = await restore(store, config.checkpoints_dir)
        return states[0].valid, states[0].reason, result.path

    valid, reason, restored = asyncio.run(main())
    assert restored is not None
    for name in SIZES:
        assert (Path(restored) / name).read_bytes() == (source / name).read_bytes(), name
    return valid, reason


FAULTS = {
    "500 on parts": lambda p: p.fail(500, "InternalError", times=3, path="partNumber="),
    "503 SlowDown on every kind of put": lambda p: p.fail(503, "SlowDown", times=6, method="PUT"),
    "503 on the manifest": lambda p: p.fail(503, "SlowDown", times=2, path=r"\.jitckpt/node-0"),
    "reset mid-upload": lambda p: p.reset(times=3, method="PUT", during="request"),
    "reset mid-download": lambda p: p.reset(times=3, method="GET", during="response"),
    "stall": lambda p: p.stall(4.0, times=2, method="PUT"),
    "500 on list and the commit record": lambda p: (
        p.fail(500, "InternalError", times=2, path="list-type"),
        p.fail(503, "SlowDown", times=2, method="GET", path=r"\.jitckpt/commit\.json"),
    ),
    "503 on the commit record's write": lambda p: p.fail(
        503, "SlowDown", times=2, method="PUT", path=r"\.jitckpt/commit\.json"
    ),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_upload_commits_despite_faults(
    fault: str, proxy: FaultProxy, s3_config: AgentConfig, tmp_path: Path
) -> None:
    FAULTS[fault](proxy)
    armed = proxy.pending()
    valid, reason = _commit_and_restore(s3_config, tmp_path)
    assert valid, reason
    assert proxy.pending() == 0, "every programmed fault was hit"
    assert proxy.injected() == armed
