"""A JIT checkpoint handed over file by file while it is written (the ``staging`` op).

The real agent, a real S3 server (moto), requests sent through the shim's own
client as a trainer would: the first file is in the store before the
checkpoint is complete, the ``staged`` that completes it commits it, and a
checkpoint whose process goes away before completing it is never committed
and leaves no multipart upload open. Hostile parts are refused as hostile
``staged`` requests are (tests/sidecar/test_attacks_staging.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from local.s3server import LocalS3
from shim import protocol
from shim.channel import Client
from tests.sidecar import shimtalk
from tests.sidecar.agentproc import AgentProcess
from tests.sidecar.helpers import bucket_objects, open_multipart_uploads, stage
from tests.support.faultproxy import FaultProxy

ROOT = "ns/job"  # the conftest agent's job root
# A multipart file (the agent's parts are 5 MiB here) and the small file HF writes last.
FIRST = {"model.safetensors": 6 * 1024 * 1024}
LAST = {"trainer_state.json": 300}


def _hello(agent: AgentProcess, pid: int | None = None) -> Client:
    client = Client(str(agent.socket), timeout=30)
    answer = client.call(shimtalk.hello(pid or os.getpid()))
    assert isinstance(answer, protocol.HelloAnswer), answer
    return client


def part(step: int, directory: Path, files: list[str], kind: str = "jit") -> protocol.Staging:
    return protocol.Staging(step=step, kind=kind, dir=str(directory), files=tuple(files))


def _add(directory: Path, sizes: dict[str, int]) -> None:
    for name, size in sizes.items():
        (directory / name).write_bytes(os.urandom(size))


def test_streamed_checkpoint_uploads_before_it_is_complete_and_commits_after(
    agent: AgentProcess, local_s3: LocalS3, bucket: str
) -> None:
    client = _hello(agent)
    directory, _ = stage(agent.staging, "checkpoint-7-jit-1-1", FIRST)
    answer = client.call(part(7, directory, list(FIRST)))
    assert isinstance(answer, protocol.StagedAnswer), answer
    first = f"{ROOT}/checkpoint-7/model.safetensors"
    # The save goes on; its first file is uploaded meanwhile, and nothing is committed.
    agent.wait_for(lambda: first in bucket_objects(local_s3, bucket), 60, "the first file")
    [row] = agent.status()["queue"]
    assert row["streaming"] is True and row["state"] == "uploading", row
    assert agent.committed_step() is None
    assert not any(".jitckpt/" in key for key in bucket_objects(local_s3, bucket))
    _add(directory, LAST)
    expected = {n: (directory / n).read_bytes() for n in (*FIRST, *LAST)}
    # The completing ``staged`` may list every file again; the held one is not taken twice.
    answer = client.call(shimtalk.staged(7, "jit", directory, [*FIRST, *LAST]))
    assert isinstance(answer, protocol.StagedAnswer), answer
    agent.wait_for(lambda: agent.committed_step() == 7, 60, "the commit")
    client.close()
    objects = bucket_objects(local_s3, bucket)
    for name, body in expected.items():
        assert objects[f"{ROOT}/checkpoint-7/{name}"] == body
    assert f"{ROOT}/checkpoint-7/.jitckpt/node-0.json" in objects
    assert not directory.exists()  # the links went once committed
    assert agent.terminate() == 0


def test_checkpoint_whose_process_dies_mid_stream_is_never_committed(
    agent: AgentProcess, proxy: FaultProxy, local_s3: LocalS3, bucket: str, tmp_path: Path
) -> None:
    """The process streams its first file and is killed before its ``staged``: its
    multipart upload (held back by a store refusing parts) is aborted, nothing of
    the checkpoint is committed, its links are removed, and the status says why."""
    directory, _ = stage(agent.staging, "checkpoint-9-jit-1-1", FIRST)
    proxy.fail(503, "SlowDown", times=10_000, method="PUT")  # parts fail: the upload stays open
    script = (
        "import os, sys, time\n"
        "from shim import protocol\n"
        "from shim.channel import Client\n"
        "from tests.sidecar import shimtalk\n"
        "client = Client(sys.argv[1], timeout=30)\n"
        "client.call(shimtalk.hello(os.getpid()))\n"
        "answer = client.call(protocol.Staging(step=9, kind='jit', dir=sys.argv[2],"
        " files=('model.safetensors',)))\n"
        "print(type(answer).__name__, flush=True)\n"
        "time.sleep(600)\n"
    )
    trainer = subprocess.Popen(
        [sys.executable, "-c", script, str(agent.socket), str(directory)],
        stdout=subprocess.PIPE,
        cwd=Path(__file__).parents[2],
    )
    try:
        assert trainer.stdout is not None
        assert trainer.stdout.readline().strip() == b"StagedAnswer"
        agent.wait_for(lambda: proxy.injected("SlowDown") > 0, 30, "a part refused")
        assert open_multipart_uploads(local_s3, bucket) != []
    finally:
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
    agent.wait_for(lambda: agent.status()["queue"] == [], 30, "the checkpoint to be dropped")
    proxy.clear()
    assert open_multipart_uploads(local_s3, bucket) == []
    status = agent.status()
    assert status["last_committed"] is None
    assert any(
        d["step"] == 9 and "connection closed" in d["reason"] for d in status["superseded"]
    ), status
    assert not any(k.endswith(".jitckpt/node-0.json") for k in bucket_objects(local_s3, bucket))
    assert not directory.exists()
    assert agent.terminate() == 0


def test_hostile_parts_are_refused(
    agent: AgentProcess, local_s3: LocalS3, bucket: str, tmp_path: Path
) -> None:
    secret = tmp_path / "sidecar-private" / "secret.bin"
    secret.parent.mkdir()
    secret.write_bytes(b"CANARY-" + os.urandom(64))
    client = _hello(agent)

    def refused(request: protocol.Request, why: str) -> None:
        answer = client.call(request)
        assert isinstance(answer, protocol.ErrorAnswer), answer
        assert why in answer.error, answer.error

    directory, _ = stage(agent.staging, "ckpt-3", {"model.bin": 100})
    os.symlink(secret, directory / "link.bin")
    refused(part(3, directory, ["link.bin"]), "link.bin")  # a symlink is never followed
    refused(part(3, secret.parent, ["secret.bin"]), "not a directory directly under")
    refused(part(3, directory, ["../secret.bin"]), "normalized relative path")
    (directory / ".jitckpt").mkdir(mode=0o777)
    (directory / ".jitckpt" / "node-0.json").write_text("{}")
    refused(part(3, directory, [".jitckpt/node-0.json"]), ".jitckpt")
    too_many = [f"f{i}" for i in range(protocol.MAX_FILES + 1)]
    refused(part(3, directory, too_many), "more than")
    refused(part(3, directory, []), "at least one file")
    refused(part(3, directory, ["model.bin"], kind="periodic"), "only a JIT checkpoint")
    # One checkpoint streamed per connection; another connection cannot add to it.
    assert isinstance(client.call(part(3, directory, ["model.bin"])), protocol.StagedAnswer)
    other, _ = stage(agent.staging, "ckpt-4", {"model.bin": 100})
    refused(part(4, other, ["model.bin"]), "streaming another checkpoint")
    refused(part(5, directory, ["model.bin"]), "is checkpoint-3")
    intruder = _hello(agent, pid=os.getpid() + 1)
    answer = intruder.call(part(3, directory, ["model.bin"]))
    assert isinstance(answer, protocol.ErrorAnswer) and "staged already" in answer.error
    answer = intruder.call(shimtalk.staged(3, "jit", directory, ["model.bin"]))
    assert isinstance(answer, protocol.ErrorAnswer) and "staged already" in answer.error
    intruder.close()
    # The file streamed is swapped for another inode: the completion is refused and the
    # checkpoint dropped, never committed with bytes the trainer changed.
    os.unlink(directory / "model.bin")
    (directory / "model.bin").write_bytes(b"x" * 100)
    refused(shimtalk.staged(3, "jit", directory, ["model.bin"]), "no longer the file accepted")
    agent.wait_for(lambda: agent.status()["queue"] == [], 30, "the checkpoint to be dropped")
    client.close()
    status = agent.status()
    assert status["last_committed"] is None
    assert any(d["step"] == 3 for d in status["superseded"]), status
    objects = bucket_objects(local_s3, bucket)
    assert not any(b"CANARY-" in body for body in objects.values())
    assert not any(k.endswith(".jitckpt/node-0.json") for k in objects), sorted(objects)
    assert secret.exists()
    assert agent.terminate() == 0


def test_checkpoint_never_completed_is_dropped_after_its_idle_time(
    tmp_path: Path, local_s3: LocalS3, bucket: str, s3_env: dict[str, str]
) -> None:
    """The process lives on, its connection open, but the ``staged`` never comes: the
    partial checkpoint is dropped once nothing more came for it in time, never committed,
    and a late ``staged`` of it is refused."""
    agent = AgentProcess(
        root=tmp_path,
        destination=f"s3://{bucket}/{ROOT}",
        s3_env=s3_env,
        extra_env={"JITCKPT_STREAM_IDLE_SECONDS": "1"},
    )
    try:
        agent.start()
        agent.wait_ready()
        client = _hello(agent)
        directory, _ = stage(agent.staging, "checkpoint-11-jit-1-1", {"model.bin": 1000})
        assert isinstance(client.call(part(11, directory, ["model.bin"])), protocol.StagedAnswer)
        agent.wait_for(lambda: agent.status()["queue"] == [], 30, "the checkpoint to be dropped")
        status = agent.status()
        assert [d["step"] for d in status["superseded"]] == [11], status
        assert "nothing more came for 1s" in status["superseded"][0]["reason"]
        answer = client.call(shimtalk.staged(11, "jit", directory, ["model.bin"]))
        assert isinstance(answer, protocol.ErrorAnswer), answer
        client.close()
        assert agent.status()["last_committed"] is None
        assert not any(k.endswith(".jitckpt/node-0.json") for k in bucket_objects(local_s3, bucket))
        assert agent.terminate() == 0
    finally:
        agent.kill()


def test_a_committed_step_is_never_overwritten_by_a_later_checkpoint_of_it(
    agent: AgentProcess, local_s3: LocalS3, bucket: str
) -> None:
    """Once checkpoint-7 is committed, neither a stream nor a whole ``staged`` of step 7
    (or older) touches its objects: the parts would land on the committed keys before
    the new checkpoint is whole, and a torn one would leave step 7 unrestorable."""
    client = _hello(agent)
    committed, _ = stage(agent.staging, "checkpoint-7-periodic-1-1", {**FIRST, **LAST})
    answer = client.call(shimtalk.staged(7, "periodic", committed, [*FIRST, *LAST]))
    assert isinstance(answer, protocol.StagedAnswer), answer
    agent.wait_for(lambda: agent.committed_step() == 7, 60, "the commit of step 7")
    before = bucket_objects(local_s3, bucket)
    for step in (7, 6):
        again, _ = stage(agent.staging, f"checkpoint-{step}-jit-1-1", {**FIRST, **LAST})
        answer = client.call(part(step, again, list(FIRST)))
        assert isinstance(answer, protocol.ErrorAnswer), answer
        assert "checkpoint-7 is committed" in answer.error
        # Handed over whole instead (what the shim does once a part is refused): dropped.
        answer = client.call(shimtalk.staged(step, "jit", again, [*FIRST, *LAST]))
        assert isinstance(answer, protocol.StagedAnswer), answer
        agent.wait_for(lambda: agent.status()["queue"] == [], 30, "the drop")
    client.close()
    assert bucket_objects(local_s3, bucket) == before
    status = agent.status()
    assert {d["step"] for d in status["superseded"]} == {6, 7}, status
    assert status["last_committed"]["step"] == 7
    assert agent.terminate() == 0


def test_the_restored_step_is_never_overwritten_by_the_next_pod(
    agent: AgentProcess, local_s3: LocalS3, bucket: str, tmp_path: Path
) -> None:
    """The next pod restores checkpoint-7; a SIGTERM before its first step makes a JIT
    save of step 7 again: neither its parts nor its whole ``staged`` touch the objects
    the restore came from (committed by the pod before, not by this agent)."""
    client = _hello(agent)
    committed, _ = stage(agent.staging, "checkpoint-7-periodic-1-1", {**FIRST, **LAST})
    answer = client.call(shimtalk.staged(7, "periodic", committed, [*FIRST, *LAST]))
    assert isinstance(answer, protocol.StagedAnswer), answer
    agent.wait_for(lambda: agent.committed_step() == 7, 60, "the commit of step 7")
    client.close()
    assert agent.terminate() == 0
    before = bucket_objects(local_s3, bucket)

    (tmp_path / "next-pod").mkdir()
    following = AgentProcess(
        root=tmp_path / "next-pod", destination=agent.destination, s3_env=agent.s3_env
    )
    following.start()
    try:
        following.wait_ready()
        client = _hello(following)
        assert following.status()["restored"]["step"] == 7
        again, _ = stage(following.staging, "checkpoint-7-jit-1-1", {**FIRST, **LAST})
        answer = client.call(part(7, again, list(FIRST)))
        assert isinstance(answer, protocol.ErrorAnswer), answer
        assert "checkpoint-7 is committed" in answer.error
        answer = client.call(shimtalk.staged(7, "jit", again, [*FIRST, *LAST]))
        assert isinstance(answer, protocol.StagedAnswer), answer
        following.wait_for(lambda: following.status()["queue"] == [], 30, "the drop")
        client.close()
        assert bucket_objects(local_s3, bucket) == before
        assert following.terminate() == 0
    finally:
        following.kill()
