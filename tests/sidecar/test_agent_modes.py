"""Legacy mode (restore init container + run container that exits with the trainer), and the
agent on a ``pvc://`` destination."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

from shim import protocol
from sidecar.config import AgentConfig
from sidecar.demo.s3server import LocalS3
from sidecar.storage.factory import open_store
from sidecar.validity import scan
from tests.sidecar.agentproc import AgentProcess
from tests.sidecar.helpers import commit, make_checkpoint, stage


def _valid_steps(destination: str, pvc: Path) -> list[int]:
    config = AgentConfig(destination=destination, pvc_mount=pvc)

    async def main() -> list[int]:
        async with open_store(config) as store:
            return [s.step async for s in scan(store) if s.valid]

    return asyncio.run(main())


def test_legacy_restore_then_run_exits_when_the_trainer_is_gone(
    tmp_path: Path, local_s3: LocalS3, bucket: str, s3_env: dict[str, str]
) -> None:
    destination = f"s3://{bucket}/ns/job"

    async def seed() -> None:
        async with open_store(AgentConfig(destination=destination)) as store:
            await commit(store, make_checkpoint(tmp_path, 4, {"m": 100}), 4)

    asyncio.run(seed())
    init = AgentProcess(root=tmp_path, destination=destination, s3_env=s3_env, phase="restore")
    init.start()
    assert init.wait(60) == 0, init.log()
    assert (init.local_dir / "checkpoints" / "checkpoint-4" / "m").stat().st_size == 100

    run = AgentProcess(root=tmp_path, destination=destination, s3_env=s3_env, phase="run")
    run.runs = init.runs
    trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        pids = run.socket.parent / "pids"
        pids.mkdir(parents=True, exist_ok=True)
        (pids / f"{trainer.pid}.pid").write_text(str(trainer.pid))
        run.start()
        run.wait_ready()
        client = protocol.Client(str(run.socket))
        hello = client.call(protocol.OP_HELLO, pid=trainer.pid)
        assert hello["restored"]["step"] == 4
        directory, files = stage(run.staging, "final", {"model": 2000})
        client.call(protocol.OP_STAGED, step=8, kind="final", dir=str(directory), files=files)
        assert client.call(protocol.OP_BYE, exit_code=0)["ok"]
        client.close()
        time.sleep(1.5)
        assert run.process is not None and run.process.poll() is None, "trainer pid still alive"
        trainer.kill()
        trainer.wait()
        assert run.wait(30) == 0, run.log()
    finally:
        trainer.kill()
        run.kill()
    assert "the trainer is gone" in run.log()
    assert run.termination()["last_committed"]["step"] == 8
    assert _valid_steps(destination, tmp_path) == [8, 4]


def test_agent_on_a_pvc_destination(tmp_path: Path, s3_env: dict[str, str]) -> None:
    claim = tmp_path / "claim-mount"
    claim.mkdir()
    destination = "pvc://claim-a/ckpts/ns-a/job-1"
    agent = AgentProcess(
        root=tmp_path / "pod-1",
        destination=destination,
        s3_env={},
        extra_env={"JITCKPT_PVC_MOUNT": str(claim)},
    )
    agent.root.mkdir()
    try:
        agent.start()
        agent.wait_ready()
        client = protocol.Client(str(agent.socket))
        client.call(protocol.OP_HELLO, pid=9)
        directory, files = stage(agent.staging, "jit", {"model": 6 * 1024 * 1024, "s/rng": 9})
        source = (directory / "model").read_bytes()
        client.call(protocol.OP_STAGED, step=12, kind="jit", dir=str(directory), files=files)
        client.close()
        assert agent.terminate() == 0, agent.log()
    finally:
        agent.kill()
    stored = claim / "ckpts" / "ns-a" / "job-1" / "checkpoint-12"
    assert (stored / "model").read_bytes() == source
    assert (stored / ".jitckpt" / "node-0.json").is_file()
    assert not [p for p in stored.rglob("*") if ".jitckpt-tmp-" in p.name]
    assert _valid_steps(destination, claim) == [12]

    second = AgentProcess(
        root=tmp_path / "pod-2",
        destination=destination,
        s3_env={},
        extra_env={"JITCKPT_PVC_MOUNT": str(claim)},
    )
    second.root.mkdir()
    try:
        second.start()
        second.wait_ready()
        restored = second.local_dir / "checkpoints" / "checkpoint-12" / "model"
        assert restored.read_bytes() == source
        assert second.terminate() == 0
    finally:
        second.kill()


def test_pvc_claim_not_mounted_fails_fast(tmp_path: Path) -> None:
    agent = AgentProcess(
        root=tmp_path,
        destination="pvc://claim-a/x/ns/job",
        s3_env={},
        extra_env={"JITCKPT_PVC_MOUNT": str(tmp_path / "not-mounted")},
    )
    agent.start()
    try:
        assert agent.wait(30) == 3
    finally:
        agent.kill()
    assert "is not mounted at" in agent.termination()["message"]


def test_resume_false_starts_fresh(
    tmp_path: Path, local_s3: LocalS3, bucket: str, s3_env: dict[str, str]
) -> None:
    destination = f"s3://{bucket}/ns/job"

    async def seed() -> None:
        async with open_store(AgentConfig(destination=destination)) as store:
            await commit(store, make_checkpoint(tmp_path, 4, {"m": 100}), 4)

    asyncio.run(seed())
    agent = AgentProcess(
        root=tmp_path / "pod",
        destination=destination,
        s3_env=s3_env,
        extra_env={"JITCKPT_RESUME": "false"},
    )
    agent.root.mkdir()
    try:
        agent.start()
        agent.wait_ready()
        client = protocol.Client(str(agent.socket))
        assert client.call(protocol.OP_HELLO, pid=3)["restored"] is None
        client.close()
        assert not (agent.local_dir / "checkpoints" / "checkpoint-4").exists()
        assert agent.terminate() == 0
    finally:
        agent.kill()
    assert "jitckpt.io/resume is false: not restoring" in agent.log()
