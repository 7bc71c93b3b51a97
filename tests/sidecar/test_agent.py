"""The real ``jitckpt agent`` process, spoken to with the shim's own protocol client."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import socket
import stat
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from local.s3server import LocalS3
from shim import layout, protocol
from shim.channel import Client
from sidecar.config import AgentConfig
from sidecar.storage.factory import open_store
from sidecar.validity import CheckpointState, scan
from tests.sidecar import shimtalk
from tests.sidecar.agentproc import AgentProcess
from tests.sidecar.helpers import commit, make_checkpoint, seed_store, stage


def _states(destination: str, env: dict[str, str], pvc: Path) -> dict[int, CheckpointState]:
    config = AgentConfig(destination=destination, pvc_mount=pvc)

    async def main() -> dict[int, CheckpointState]:
        async with open_store(config) as store:
            return {s.step: s async for s in scan(store)}

    return asyncio.run(main())


@pytest.fixture
def agent(
    tmp_path: Path, local_s3: LocalS3, bucket: str, s3_env: dict[str, str]
) -> Iterator[AgentProcess]:
    proc = AgentProcess(root=tmp_path, destination=f"s3://{bucket}/team/ns-a/job-1", s3_env=s3_env)
    yield proc
    proc.kill()


def _seed(agent: AgentProcess, tmp_path: Path) -> Path:
    """A valid checkpoint-10 and a torn checkpoint-20 already in the store."""
    config = AgentConfig(destination=agent.destination)
    good = make_checkpoint(tmp_path, 10, {"model.bin": 1000, "trainer_state.json": 20})

    async def main() -> None:
        async with open_store(config) as store:
            await commit(store, good, 10)
            await commit(store, make_checkpoint(tmp_path, 20, {"a": 1}), 20, nnodes=2)

    asyncio.run(main())
    return good


def test_a_trainer_on_the_sidecars_python_loads_the_shim_compiled(
    agent: AgentProcess, tmp_path: Path
) -> None:
    """The shim's volume is read-only in the trainer, whose Python cannot cache what it
    compiles. Once Started, the sidecar writes the copy's bytecode for its own Python,
    readable by any uid; a trainer process on that Python then imports the shim from it
    and compiles none of its modules."""
    agent.start()
    agent.wait_ready()
    agent.wait_for(lambda: "shim bytecode written" in agent.log(), 30, "the shim's bytecode")
    sources = [path for path in agent.shim_target.rglob("*.py")]
    compiled = {Path(importlib.util.cache_from_source(str(path))) for path in sources}
    assert set(agent.shim_target.rglob("*.pyc")) == compiled
    for path in compiled:
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o755, path

    env = {k: v for k, v in os.environ.items() if not k.startswith(("JITCKPT_", "PYTHON"))}
    env.update(
        {
            "PYTHONPATH": str(agent.shim_target),
            layout.ENV_DIR: str(agent.local_dir),
            layout.ENV_SOCKET: str(agent.socket),
        }
    )
    code = "import sys; assert '_jitckpt_shim.activate' in sys.modules"
    done = subprocess.run(
        [sys.executable, "-v", "-c", code],
        env=env,
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    # -v says "code object from '<the .pyc>'" for a module loaded from bytecode, and
    # "code object from '<the .py>'" for one compiled at import.
    target = str(agent.shim_target)
    loaded = [line for line in done.stderr.splitlines() if f"code object from '{target}" in line]
    assert any(line.endswith(f"activate.{sys.implementation.cache_tag}.pyc'") for line in loaded), (
        done.stderr[-3000:]
    )
    assert not [line for line in loaded if line.endswith(".py'")], done.stderr[-3000:]


def test_lifecycle_restore_upload_status_and_stop(agent: AgentProcess, tmp_path: Path) -> None:
    good = _seed(agent, tmp_path)
    agent.start()
    agent.wait_ready()
    assert agent.get("/healthz")[0] == 200

    # Shim copied, world-readable for a trainer of another uid.
    copied = agent.shim_target / "protocol.py"
    assert copied.read_bytes() == Path(protocol.__file__).read_bytes()
    assert stat.S_IMODE(copied.stat().st_mode) == 0o644
    # Never the sidecar's own bytecode files: only what it compiles into __pycache__ for
    # trainers of its Python (tested below).
    assert all(path.parent.name == "__pycache__" for path in agent.shim_target.rglob("*.pyc"))
    # Shared dirs the trainer writes into.
    assert stat.S_IMODE(agent.staging.stat().st_mode) == 0o777
    assert stat.S_IMODE(agent.socket.stat().st_mode) == 0o666

    client = Client(str(agent.socket))
    hello = client.call(shimtalk.hello(4242))
    restored_path = agent.local_dir / "checkpoints" / "checkpoint-10"
    assert hello == protocol.HelloAnswer(protocol.Restored(step=10, path=str(restored_path)))
    assert (restored_path / "model.bin").read_bytes() == (good / "model.bin").read_bytes()
    status = agent.status()
    assert status["restore_skipped"] == [
        {"step": 20, "reason": "manifests from 1 of 2 nodes (missing node-1)"}
    ]

    # Unknown op and malformed lines get an error answer; the connection stays usable.
    with socket.socket(socket.AF_UNIX) as raw:
        raw.connect(str(agent.socket))
        raw.sendall(b'{"v":1,"op":"teleport"}\n')
        assert b"unknown op 'teleport'" in raw.recv(4096)
        raw.sendall(b"not json\n")
        assert b'"ok":false' in raw.recv(4096)

    client.send(protocol.Progress(step=31, max_steps=100, epoch=0.3))
    directory, files = stage(
        agent.staging, "checkpoint-30-periodic-1", {"w.bin": 7 * 1024 * 1024, "s/x": 5}
    )
    answer = client.call(shimtalk.staged(30, "periodic", directory, files))
    assert isinstance(answer, protocol.StagedAnswer), answer
    agent.wait_for(lambda: agent.committed_step() == 30, 30, "checkpoint-30 committed")
    agent.wait_for(lambda: not directory.exists(), 10, "staging links removed")
    status = agent.status()
    assert status["progress"]["step"] == 31
    assert status["last_committed"]["uri"] == f"{agent.destination}/checkpoint-30"
    metrics = agent.get("/metrics")[1]
    assert "jitckpt_last_committed_step 30.0" in metrics
    assert "jitckpt_restored_step 10.0" in metrics
    assert 'jitckpt_checkpoints_committed_total{kind="periodic"} 1.0' in metrics
    assert agent.termination()["last_committed"]["step"] == 30

    # A staged request outside the staging dir is refused.
    refused = client.call(shimtalk.staged(1, "jit", tmp_path, []))
    assert isinstance(refused, protocol.ErrorAnswer)
    assert "not a directory directly under" in refused.error

    # Preemption: the trainer's sigterm, its JIT save, its exit; then the kubelet's SIGTERM.
    assert client.call(protocol.Sigterm(step=35)) == protocol.OkAnswer()
    directory, files = stage(agent.staging, "checkpoint-35-jit-1", {"w.bin": 300})
    staged_answer = client.call(shimtalk.staged(35, "jit", directory, files))
    assert isinstance(staged_answer, protocol.StagedAnswer)
    assert client.call(protocol.Bye(exit_code=143)) == protocol.OkAnswer()
    client.close()
    assert agent.terminate() == 0
    message = agent.termination()
    assert message["last_committed"]["step"] == 35
    assert message["last_committed"]["kind"] == "jit"
    assert message["uncommitted"] == []
    assert "last committed checkpoint: step 35 (jit)" in message["message"]
    states = _states(agent.destination, agent.s3_env, tmp_path)
    assert states[35].valid and states[30].valid
    assert not directory.exists() and not list(agent.staging.iterdir())
    log = agent.log()
    assert log.count("Kubernetes Events off") == 1, log
    assert "not running in a cluster" in log


def test_many_concurrent_clients(agent: AgentProcess) -> None:
    agent.start()
    agent.wait_ready()
    errors: list[BaseException] = []

    def worker(rank: int) -> None:
        try:
            client = Client(str(agent.socket))
            assert client.call(shimtalk.hello(1000 + rank, rank)) == protocol.HelloAnswer(None)
            for step in range(20):
                client.send(protocol.Progress(step=step, max_steps=0, epoch=0.0))
                status = client.call(protocol.Status())
                assert isinstance(status, protocol.StatusAnswer)
                assert status.status["phase"] == "ready"
            assert client.call(protocol.Bye(exit_code=0)) == protocol.OkAnswer()
            client.close()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == []
    assert sorted(c["pid"] for c in agent.status()["clients"]) == list(range(1000, 1008))
    assert agent.terminate() == 0


def test_sigkill_mid_upload_then_restart_finishes(
    tmp_path: Path, local_s3: LocalS3, bucket: str, s3_env: dict[str, str]
) -> None:
    from tests.support.faultproxy import FaultProxy

    with FaultProxy(local_s3.endpoint) as proxy:
        env = dict(s3_env, AWS_S3_ENDPOINT=proxy.endpoint)
        agent = AgentProcess(root=tmp_path, destination=f"s3://{bucket}/ns/job", s3_env=env)
        try:
            agent.start()
            agent.wait_ready()
            proxy.stall(60, times=1000, path="partNumber=")
            client = Client(str(agent.socket))
            client.call(shimtalk.hello(77))
            directory, files = stage(
                agent.staging, "checkpoint-50-jit-9", {"model.bin": 12 * 1024 * 1024}
            )
            source = (directory / "model.bin").read_bytes()
            answer = client.call(shimtalk.staged(50, "jit", directory, files))
            assert isinstance(answer, protocol.StagedAnswer)
            agent.wait_for(lambda: proxy.injected("stall-request") > 0, 20, "an upload in flight")
            agent.kill()
            client.close()
            record = agent.root / "opt" / "agent" / "staged" / "checkpoint-50-jit-9.job.json"
            assert directory.is_dir() and record.is_file()
            assert (
                50 not in _states(agent.destination, env, tmp_path)
                or not _states(agent.destination, env, tmp_path)[50].valid
            )

            proxy.clear()
            agent.start()
            agent.wait_ready()
            agent.wait_for(lambda: agent.committed_step() == 50, 60, "the re-queued upload")
            assert "re-queueing checkpoint-50 (jit)" in agent.log()
            agent.wait_for(lambda: not directory.exists(), 10, "staging removed")
            assert agent.terminate() == 0
        finally:
            agent.kill()
        # A fresh restore gets exactly the bytes the trainer staged.
        second = AgentProcess(root=tmp_path / "next-pod", destination=agent.destination, s3_env=env)
        second.root.mkdir()
        try:
            second.start()
            second.wait_ready()
            restored = second.local_dir / "checkpoints" / "checkpoint-50" / "model.bin"
            assert restored.read_bytes() == source
            assert second.terminate() == 0
        finally:
            second.kill()


def test_verify_access_fails_fast(
    tmp_path: Path, local_s3: LocalS3, s3_env: dict[str, str]
) -> None:
    """A bucket that does not exist: held (exit 3) when the platform chose fail-closed;
    by default the trainer runs unprotected, and the shim copied before the probe is
    taken back (the trainer then runs as without jitckpt)."""
    missing = f"nope-{uuid.uuid4().hex[:8]}"
    closed = AgentProcess(
        root=tmp_path / "closed",
        destination=f"s3://{missing}/ns/job",
        s3_env=s3_env,
        extra_env={"JITCKPT_STORE_UNREACHABLE": "fail-closed"},
    )
    closed.root.mkdir()
    closed.start()
    try:
        assert closed.wait(30) == 3
    finally:
        closed.kill()
    message = closed.termination()["message"]
    assert f"cannot list in s3://{missing}/ns/job" in message
    assert "NoSuchBucket" in message

    agent = AgentProcess(
        root=tmp_path / "open", destination=f"s3://{missing}/ns/job", s3_env=s3_env
    )
    agent.root.mkdir()
    agent.start()
    try:
        reason = agent.runs_unprotected()
    finally:
        agent.kill()
    assert f"cannot list in s3://{missing}/ns/job" in reason and "NoSuchBucket" in reason
    assert "shim copied to" in agent.log()


def test_the_restore_downloads_while_the_access_probe_runs(
    tmp_path: Path, local_s3: LocalS3, bucket: str, s3_env: dict[str, str]
) -> None:
    """The probe's three round trips do not hold the download: the checkpoint is in place
    while the probe's write is still held, and the trainer starts once both are done."""
    from tests.support.faultproxy import FaultProxy

    destination = f"s3://{bucket}/ns/job"
    seed_store(destination, tmp_path, 3, {"model.bin": 4096})
    with FaultProxy(local_s3.endpoint) as proxy:
        proxy.delay(3, times=1, method="PUT", path=".jitckpt-probe-")
        env = dict(s3_env, AWS_S3_ENDPOINT=proxy.endpoint)
        agent = AgentProcess(root=tmp_path / "pod", destination=destination, s3_env=env)
        agent.root.mkdir()
        try:
            agent.start()
            agent.wait_ready()
            log = agent.log()
            assert log.index("restored checkpoint-3") < log.index("access to s3://"), log
            assert agent.status()["restored"]["step"] == 3
            assert agent.terminate() == 0
        finally:
            agent.kill()


def test_a_failed_access_probe_records_no_restore(
    tmp_path: Path, local_s3: LocalS3, bucket: str, s3_env: dict[str, str]
) -> None:
    """The probe's write refused: the trainer runs unprotected, whatever the download that
    ran beside the probe found; no restore is recorded for a later run of the container."""
    from tests.support.faultproxy import FaultProxy

    destination = f"s3://{bucket}/ns/job"
    seed_store(destination, tmp_path, 3, {"model.bin": 4096})
    with FaultProxy(local_s3.endpoint) as proxy:
        proxy.fail(403, "AccessDenied", times=1, method="PUT", path=".jitckpt-probe-")
        env = dict(s3_env, AWS_S3_ENDPOINT=proxy.endpoint)
        agent = AgentProcess(root=tmp_path / "pod", destination=destination, s3_env=env)
        agent.root.mkdir()
        try:
            agent.start()
            reason = agent.runs_unprotected()
        finally:
            agent.kill()
    assert f"cannot write in {destination}" in reason
    assert not list(agent.root.rglob("restored.json"))
    assert not (agent.local_dir / "checkpoints" / "checkpoint-3").exists()


def test_grace_too_short_is_reported(agent: AgentProcess) -> None:
    agent.extra_env = {"JITCKPT_GRACE_SECONDS": "2", "JITCKPT_GRACE_MARGIN": "0.5"}
    agent.start()
    agent.wait_ready()
    client = Client(str(agent.socket))
    client.call(shimtalk.hello(5))
    directory, files = stage(agent.staging, "p", {"w": 200_000})
    client.call(shimtalk.staged(1, "periodic", directory, files))
    agent.wait_for(lambda: agent.committed_step() == 1, 20, "periodic commit")
    client.call(protocol.Sigterm(step=2))
    time.sleep(1.8)  # a save that takes most of the grace period
    directory, files = stage(agent.staging, "j", {"w": 200_000})
    client.call(shimtalk.staged(2, "jit", directory, files))
    grace = agent.status()["grace"]
    assert grace["short_by_seconds"] > 0
    assert grace["save_seconds"] >= 1.8
    client.close()
    agent.terminate()
    message = agent.termination()["message"]
    assert "grace period 2 s is too short for the measured checkpoint" in message
    assert "raise jitckpt.io/grace-period-seconds by at least 1 s" in message
    assert "too short" in agent.log()


def test_readyz_waits_for_the_restore(
    tmp_path: Path, local_s3: LocalS3, bucket: str, s3_env: dict[str, str]
) -> None:
    """The startupProbe: /healthz answers at once, /readyz only once the restore is done."""
    from tests.support.faultproxy import FaultProxy

    destination = f"s3://{bucket}/ns/job"

    seed_store(destination, tmp_path, 3, {"model.bin": 4096})
    with FaultProxy(local_s3.endpoint) as proxy:
        proxy.stall(10, times=1, method="GET", path="model.bin")
        env = dict(s3_env, AWS_S3_ENDPOINT=proxy.endpoint)
        agent = AgentProcess(
            root=tmp_path / "pod",
            destination=destination,
            s3_env=env,
            extra_env={"JITCKPT_S3_READ_TIMEOUT": "2"},
        )
        agent.root.mkdir()
        seen: list[tuple[int, str]] = []

        def probe() -> bool:
            try:
                code, body = agent.get("/readyz")
            except OSError:
                return False
            seen.append((code, body.strip()))
            return code == 200

        try:
            agent.start()
            agent.wait_for(probe, 60, "ready")
            assert (503, "not ready: restoring") in seen, seen
            assert agent.get("/healthz")[0] == 200
            assert agent.status()["restored"]["step"] == 3
            assert agent.terminate() == 0
        finally:
            agent.kill()
