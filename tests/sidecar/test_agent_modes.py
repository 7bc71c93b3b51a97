"""Legacy mode (restore init container + run container that exits with the trainer), and the
agent on a ``pvc://`` destination."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from local.s3server import LocalS3
from shim import protocol
from shim.channel import Client
from sidecar.config import AgentConfig
from sidecar.storage.factory import open_store
from sidecar.validity import scan
from tests.shim.support import PYTHON, REPO, TRAIN_TINY, ShimEnv
from tests.sidecar import shimtalk
from tests.sidecar.agentproc import AgentProcess
from tests.sidecar.helpers import seed_store, stage


def _valid_steps(destination: str, pvc: Path) -> list[int]:
    config = AgentConfig(destination=destination, pvc_mount=pvc)

    async def main() -> list[int]:
        async with open_store(config) as store:
            return [s.step async for s in scan(store) if s.valid]

    return asyncio.run(main())


# A trainer process as the shim makes it: one lease held open for its whole life.
LEASE_HOLDER = (
    "import os, sys, time; from shim import protocol; from shim.channel import Client;"
    "c = Client(sys.argv[1]); c.send(protocol.Lease(pid=os.getpid()));"
    "print('leased', flush=True); time.sleep(120)"
)


def test_legacy_restore_then_run_exits_when_the_trainer_is_gone(
    tmp_path: Path, local_s3: LocalS3, bucket: str, s3_env: dict[str, str]
) -> None:
    destination = f"s3://{bucket}/ns/job"

    seed_store(destination, tmp_path, 4, {"m": 100})
    init = AgentProcess(root=tmp_path, destination=destination, s3_env=s3_env, phase="restore")
    init.start()
    assert init.wait(60) == 0, init.log()
    assert (init.local_dir / "checkpoints" / "checkpoint-4" / "m").stat().st_size == 100

    run = AgentProcess(root=tmp_path, destination=destination, s3_env=s3_env, phase="run")
    run.runs = init.runs
    # A pid file from the trainer's own PID namespace: pid 1 there is not our pid 1 (alive).
    pids = run.socket.parent / "pids"
    pids.mkdir(parents=True, exist_ok=True)
    (pids / "1.pid").write_text("1\npid:[1]\n")
    run.start()
    run.wait_ready()
    trainer = subprocess.Popen(
        [sys.executable, "-c", LEASE_HOLDER, str(run.socket)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert trainer.stdout is not None and trainer.stdout.readline() == "leased\n"
        client = Client(str(run.socket))
        hello = client.call(shimtalk.hello(trainer.pid))
        assert isinstance(hello, protocol.HelloAnswer)
        assert hello.restored is not None and hello.restored.step == 4
        directory, files = stage(run.staging, "last", {"model": 2000})
        client.call(shimtalk.staged(8, "periodic", directory, files))
        assert client.call(protocol.Bye(exit_code=0)) == protocol.OkAnswer()
        client.close()
        time.sleep(1.5)
        assert run.process is not None and run.process.poll() is None, "lease still held"
        trainer.kill()  # SIGKILL: no bye, no cleanup; the kernel closes the lease
        trainer.wait()
        killed = time.monotonic()
        assert run.wait(30) == 0, run.log()
        assert time.monotonic() - killed < 5
    finally:
        trainer.kill()
        run.kill()
    assert "the trainer is gone: every lease" in run.log()
    assert run.termination()["last_committed"]["step"] == 8
    assert _valid_steps(destination, tmp_path) == [8, 4]


@pytest.mark.slow
def test_legacy_run_exits_promptly_after_a_sigkilled_trainer_in_its_own_pid_namespace(
    tmp_path: Path, local_s3: LocalS3, bucket: str, s3_env: dict[str, str]
) -> None:
    """A real shim'd trainer as PID 1 of its own PID namespace (a pod without
    shareProcessNamespace), SIGKILLed: its pid file stays behind and names "1"."""
    destination = f"s3://{bucket}/ns/job"
    init = AgentProcess(root=tmp_path, destination=destination, s3_env=s3_env, phase="restore")
    init.start()
    assert init.wait(60) == 0, init.log()
    run = AgentProcess(root=tmp_path, destination=destination, s3_env=s3_env, phase="run")
    run.runs = init.runs
    run.start()
    run.wait_ready()
    pod = ShimEnv(tmp_path / "trainer")
    env = {**pod.env, "JITCKPT_DIR": str(run.local_dir), "JITCKPT_SOCKET": str(run.socket)}
    args = ["--output-dir", str(tmp_path / "out"), "--max-steps", "200", "--save-steps", "2"]
    log = tmp_path / "trainer.log"
    with log.open("wb") as out:
        trainer = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--mount-proc", PYTHON, *TRAIN_TINY, *args],
            env=env,
            cwd=str(REPO),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 90
        # The second periodic checkpoint handed over (which one it is depends on the
        # uploads: a save that waits for room on the volume is dropped by the next).
        while (
            len(re.findall(r"periodic checkpoint-\d+ handed", log.read_text(errors="replace"))) < 2
        ):
            assert trainer.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        [pid_file] = (run.socket.parent / "pids").glob("*.pid")
        assert pid_file.read_text().split()[0] == "1"  # its namespace's pid, not ours
        [namespace_init] = (
            Path(f"/proc/{trainer.pid}/task/{trainer.pid}/children").read_text().split()
        )
        os.kill(int(namespace_init), signal.SIGKILL)  # the node's kernel OOM killer, say
        assert trainer.wait(30) != 0
        killed = time.monotonic()
        assert run.wait(60) == 0, run.log()
        assert time.monotonic() - killed < 15
    finally:
        trainer.kill()
        run.kill()
    assert pid_file.exists()  # stale, and ignored: it is not of the agent's namespace
    assert "the trainer is gone: every lease" in run.log()
    staged = re.findall(r"accepted checkpoint-(\d+)", run.log())
    assert staged and run.termination()["uncommitted"] == []
    assert run.termination()["last_committed"]["step"] == max(int(step) for step in staged)


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
        client = Client(str(agent.socket))
        client.call(shimtalk.hello(9))
        directory, files = stage(agent.staging, "jit", {"model": 6 * 1024 * 1024, "s/rng": 9})
        source = (directory / "model").read_bytes()
        client.call(shimtalk.staged(12, "jit", directory, files))
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
        assert "is not mounted at" in agent.runs_unprotected()
    finally:
        agent.kill()


def test_resume_false_starts_fresh(
    tmp_path: Path, local_s3: LocalS3, bucket: str, s3_env: dict[str, str]
) -> None:
    destination = f"s3://{bucket}/ns/job"

    seed_store(destination, tmp_path, 4, {"m": 100})
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
        client = Client(str(agent.socket))
        assert client.call(shimtalk.hello(3)) == protocol.HelloAnswer(None)
        client.close()
        assert not (agent.local_dir / "checkpoints" / "checkpoint-4").exists()
        assert agent.terminate() == 0
    finally:
        agent.kill()
    assert "jitckpt.io/resume is false: not restoring" in agent.log()


def _stage_and_wait(
    agent: AgentProcess, client: Client, step: int, kind: str, name: str = "w"
) -> None:
    directory, files = stage(agent.staging, f"s{step}", {name: 1000 + step})
    answer = client.call(shimtalk.staged(step, kind, directory, files))
    assert isinstance(answer, protocol.StagedAnswer), answer
    agent.wait_for(lambda: agent.committed_step() == step, 30, f"checkpoint-{step}")


def test_retention_in_the_agent_keeps_newest_and_the_restored_one(
    tmp_path: Path, local_s3: LocalS3, bucket: str, s3_env: dict[str, str]
) -> None:
    destination = f"s3://{bucket}/ns/job"

    seed_store(destination, tmp_path, 1, {"m": 10})
    agent = AgentProcess(
        root=tmp_path / "pod",
        destination=destination,
        s3_env=s3_env,
        extra_env={"JITCKPT_S3_RETENTION": "2"},
    )
    agent.root.mkdir()
    try:
        agent.start()
        agent.wait_ready()
        client = Client(str(agent.socket))
        hello = client.call(shimtalk.hello(1))
        assert isinstance(hello, protocol.HelloAnswer)
        assert hello.restored is not None and hello.restored.step == 1
        for step in (2, 3, 4, 5):
            _stage_and_wait(agent, client, step, "periodic")
        client.close()
        assert agent.terminate() == 0
    finally:
        agent.kill()
    assert _valid_steps(destination, tmp_path) == [5, 4, 1]
    assert "retention deleted checkpoint-3: beyond the newest 2 valid" in agent.log()


def test_two_nodes_commit_one_checkpoint(
    tmp_path: Path, local_s3: LocalS3, bucket: str, s3_env: dict[str, str]
) -> None:
    destination = f"s3://{bucket}/ns/job"
    nodes = []
    for rank in (0, 1):
        node = AgentProcess(
            root=tmp_path / f"node-{rank}",
            destination=destination,
            s3_env=s3_env,
            extra_env={"JITCKPT_NODE_RANK": str(rank), "JITCKPT_NNODES": "2"},
        )
        node.root.mkdir()
        nodes.append(node)
    try:
        for node in nodes:
            node.start()
        for node in nodes:
            node.wait_ready()
        second = Client(str(nodes[1].socket))
        second.call(shimtalk.hello(11))
        _stage_and_wait(nodes[1], second, 40, "jit", name="rng_state_1.pth")
        assert _valid_steps(destination, tmp_path) == [], "only node 1 committed so far"
        first = Client(str(nodes[0].socket))
        first.call(shimtalk.hello(10))
        _stage_and_wait(nodes[0], first, 40, "jit", name="model.safetensors")
        assert _valid_steps(destination, tmp_path) == [40]
        for client in (first, second):
            client.close()
        assert [node.terminate() for node in nodes] == [0, 0]
    finally:
        for node in nodes:
            node.kill()
