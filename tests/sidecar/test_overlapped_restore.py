"""Overlapped restore and the in-place restart, through the real agent, a real S3 behind the
fault proxy, and the shim's own session and resume agreement (DESIGN 5 and 7).

The trainer side is the shim's ``TrainingRun`` of one process: ``hello`` when the
framework starts, ``resume_step`` where it reads the checkpoint. A slowed or
failing download is the proxy's; no timing is asserted, only what each side
knew when (pending at ``hello``, the complete checkpoint at the load point).
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from local.s3server import LocalS3
from shim import protocol
from shim import session as shim_session
from shim.channel import Client
from shim.config import ShimConfig
from shim.staging import stage
from shim.trainrun import TrainingRun
from sidecar.config import AgentConfig
from sidecar.storage.factory import open_store
from tests.sidecar import shimtalk
from tests.sidecar.agentproc import AgentProcess
from tests.sidecar.helpers import commit, make_checkpoint
from tests.support.faultproxy import FaultProxy

MODEL = {"model.bin": 64 * 1024, "trainer_state.json": 40}


@pytest.fixture
def fresh_sessions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's trainer is a new process as far as the shim is concerned."""
    monkeypatch.setattr(shim_session, "_SESSIONS", {})
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)


def _seed(destination: str, scratch: Path, steps: dict[int, bool]) -> dict[int, Path]:
    """Checkpoints of ``steps`` in the store, each saying whether the shim loads it."""
    made = {step: make_checkpoint(scratch, step, MODEL, seed=step) for step in steps}

    async def main() -> None:
        async with open_store(AgentConfig(destination=destination)) as store:
            for step, shim_loads in steps.items():
                await commit(store, made[step], step, shim_loads=shim_loads)

    asyncio.run(main())
    return made


@pytest.fixture
def slow_pod(
    tmp_path: Path, local_s3: LocalS3, bucket: str, s3_env: dict[str, str]
) -> Iterator[tuple[AgentProcess, FaultProxy]]:
    with FaultProxy(local_s3.endpoint) as proxy:
        agent = AgentProcess(
            root=tmp_path / "pod",
            destination=f"s3://{bucket}/ns/job",
            s3_env=dict(s3_env, AWS_S3_ENDPOINT=proxy.endpoint),
            extra_env={"JITCKPT_S3_READ_TIMEOUT": "2", "JITCKPT_S3_MAX_ATTEMPTS": "1"},
        )
        agent.root.mkdir()
        yield agent, proxy
        agent.kill()


def _trainer(agent: AgentProcess) -> TrainingRun:
    config = ShimConfig(local_dir=str(agent.local_dir), socket_path=str(agent.socket))
    return TrainingRun(config, "transformers", "trainer_state.json")


def _restored(agent: AgentProcess) -> dict[str, object]:
    return agent.status()["restored"] or {}


@pytest.mark.usefixtures("fresh_sessions")
def test_the_trainer_starts_during_the_download_and_waits_where_it_loads(
    slow_pod: tuple[AgentProcess, FaultProxy], tmp_path: Path
) -> None:
    """Started at once for a checkpoint the shim loads; the trainer hears "pending" at its
    hello, and its resume agreement returns only once the verified checkpoint is in place.
    While the download runs, what the untrusted trainer tries fails as it does after it:
    a symlink planted at the checkpoint's name is replaced, never followed; a staged
    checkpoint (it would upload over the one being fetched) and malformed or early
    ``await_restore`` lines are refused."""
    agent, proxy = slow_pod
    made = _seed(agent.destination, tmp_path, {3: True})
    proxy.delay(4, times=1, method="GET", path="model.bin")
    agent.start()
    agent.wait_ready()
    status = agent.status()
    assert status["restoring"] == 3 and status["restored"] is None, status

    outside = tmp_path / "outside"
    outside.mkdir()
    checkpoints = agent.local_dir / "checkpoints"
    (checkpoints / "checkpoint-3").symlink_to(outside)

    # A forged client, during the restore: a staged checkpoint-3 is refused, and so are
    # lines that are not the op's schema; waiting is bounded and answers "pending".
    forged = Client(str(agent.socket))
    forged.call(shimtalk.hello(999_999))
    planted = agent.staging / "planted"
    planted.mkdir(mode=0o777)
    (planted / "model.bin").write_bytes(b"forged")
    refused = forged.call(shimtalk.staged(3, "periodic", planted, ["model.bin"]))
    assert isinstance(refused, protocol.ErrorAnswer), refused
    assert "restore is in progress" in refused.error
    early = forged.call(protocol.AwaitRestore(seconds=0.1))
    assert isinstance(early, protocol.HelloAnswer) and early.restored is None, early
    assert early.pending is not None and early.pending > 0
    forged.close()
    with socket.socket(socket.AF_UNIX) as raw:
        raw.connect(str(agent.socket))
        raw.sendall(b'{"v":1,"op":"await_restore","seconds":3600}\n')
        assert b"seconds must be between 0 and 60" in raw.recv(4096)

    run = _trainer(agent)
    run.process.hello(run.framework)
    assert run.process.pending_until is not None  # not waiting at the trainer's start
    assert run.process.restored is None
    assert _restored(agent) == {}  # the download still runs

    assert run.resume_step() == 3  # the load point: waits for the restore
    path = checkpoints / "checkpoint-3"
    assert not path.is_symlink() and path.is_dir()
    assert (path / "model.bin").read_bytes() == (made[3] / "model.bin").read_bytes()
    assert run.process.restored == protocol.Restored(step=3, path=str(path))
    assert not list(outside.iterdir())
    doc = agent.status()
    assert doc["restoring"] is None
    assert doc["restored"]["downloaded"] == doc["downloaded_bytes"] == sum(MODEL.values())
    run.process.bye(0)
    assert agent.terminate() == 0


@pytest.mark.usefixtures("fresh_sessions")
def test_a_download_that_fails_while_the_trainer_waits_ends_in_the_older_checkpoint(
    slow_pod: tuple[AgentProcess, FaultProxy], tmp_path: Path
) -> None:
    agent, proxy = slow_pod
    _seed(agent.destination, tmp_path, {3: True, 5: True})
    # checkpoint-5's model never comes (the read times out after 2 s, one attempt).
    proxy.stall(30, times=20, method="GET", path="checkpoint-5/model.bin")
    agent.start()
    agent.wait_ready()
    run = _trainer(agent)
    run.process.hello(run.framework)
    assert run.process.pending_until is not None
    assert run.resume_step() == 3
    skipped = agent.status()["restore_skipped"]
    assert [s["step"] for s in skipped] == [5], skipped
    assert not (agent.local_dir / "checkpoints" / "checkpoint-5").exists()
    run.process.bye(0)
    assert agent.terminate() == 0


@pytest.mark.usefixtures("fresh_sessions")
def test_a_restore_past_its_limit_starts_the_trainer_fresh(
    slow_pod: tuple[AgentProcess, FaultProxy], tmp_path: Path
) -> None:
    agent, proxy = slow_pod
    _seed(agent.destination, tmp_path, {3: True})
    agent.extra_env.update({"JITCKPT_RESTORE_TIMEOUT": "1", "JITCKPT_S3_READ_TIMEOUT": "30"})
    proxy.stall(20, times=1, method="GET", path="model.bin")
    agent.start()
    agent.wait_ready()
    run = _trainer(agent)
    run.process.hello(run.framework)
    assert run.process.pending_until is not None
    assert run.resume_step() is None
    assert "longer than jitckpt's limit of 1 s" in agent.status()["last_error"]
    assert not (agent.local_dir / "checkpoints" / "checkpoint-3").exists()


def test_a_trainer_restarted_in_the_pod_resumes_from_its_own_copy_without_a_download(
    tmp_path: Path, local_s3: LocalS3, bucket: str, s3_env: dict[str, str]
) -> None:
    """The surviving pod of a one-pod preemption: its trainer staged JIT checkpoint-8 and
    exited 143; the one restarted in the same pod is told checkpoint-8, the copy on the
    local volume, verified, and nothing is downloaded (the pod's start restored step 3)."""
    with FaultProxy(local_s3.endpoint) as proxy:
        agent = AgentProcess(
            root=tmp_path / "pod",
            destination=f"s3://{bucket}/ns/job",
            s3_env=dict(s3_env, AWS_S3_ENDPOINT=proxy.endpoint),
        )
        agent.root.mkdir()
        try:
            _seed(agent.destination, tmp_path, {3: True})
            agent.start()
            agent.wait_ready()
            first = Client(str(agent.socket))
            answer = first.call(shimtalk.hello(os.getpid()))
            if isinstance(answer, protocol.HelloAnswer) and answer.pending is not None:
                answer = first.call(protocol.AwaitRestore(seconds=30))
            assert isinstance(answer, protocol.HelloAnswer) and answer.restored is not None
            assert answer.restored.step == 3
            restored_bytes = agent.status()["downloaded_bytes"]
            assert restored_bytes == sum(MODEL.values())

            # The trainer saves checkpoint-8 where frameworks save, and stages it.
            own = agent.local_dir / "checkpoints" / "checkpoint-8"
            own.mkdir()
            for name, size in MODEL.items():
                (own / name).write_bytes(os.urandom(size))
            request = stage(str(own), str(agent.staging), 8, "jit", shim_loads=True)
            # Its upload is slowed: the trainer restarts before checkpoint-8 is committed.
            proxy.delay(2, times=1, method="PUT", path="checkpoint-8/model.bin")
            assert isinstance(first.call(request), protocol.StagedAnswer)
            assert first.call(protocol.Bye(exit_code=143)) == protocol.OkAnswer()
            first.close()
            assert agent.committed_step() != 8

            before = len(proxy.requests)
            again = Client(str(agent.socket))
            hello = again.call(shimtalk.hello(os.getpid() + 1))
            assert isinstance(hello, protocol.HelloAnswer) and hello.pending is not None, hello
            answer = again.call(protocol.AwaitRestore(seconds=30))
            assert answer == protocol.HelloAnswer(
                restored=protocol.Restored(step=8, path=str(own))
            ), answer
            again.close()
            status = agent.status()
            assert status["restored"]["downloaded"] == 0
            assert status["downloaded_bytes"] == restored_bytes
            fetched = [r.target for r in proxy.requests[before:] if r.method == "GET"]
            assert not [t for t in fetched if any(name in t for name in MODEL)], fetched
            assert "checkpoint-8 is already here and matches its manifests" in agent.log()
            assert agent.terminate() == 0
            assert agent.termination()["downloaded_bytes"] == restored_bytes
        finally:
            agent.kill()
