"""The set-aside rule, both sides: failed resumes set a checkpoint aside; the training's own
errors never do; records from a hostile store are ignored, never trusted."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from local.s3server import LocalS3
from shim import protocol
from shim.channel import Client
from sidecar import retention, setaside
from sidecar.config import AgentConfig
from sidecar.restore import restore
from sidecar.storage.base import Store
from sidecar.storage.factory import open_store
from tests.sidecar import shimtalk
from tests.sidecar.agentproc import AgentProcess
from tests.sidecar.helpers import commit, make_checkpoint

OLDER, NEWER = 10, 20
HELD = 1.5  # seconds a slow store holds the guard's record write


def _run(tmp_path: Path, body: Callable[[Store], Awaitable[None]], nnodes: int = 1) -> None:
    config = AgentConfig(
        destination="pvc://claim-a/ckpts/ns-a/job-1",
        pvc_mount=tmp_path / "pvc",
        local_dir=tmp_path / "local",
        socket_path=tmp_path / "run" / "agent.sock",
    )

    async def main() -> None:
        async with open_store(config) as store:
            for step in (OLDER, NEWER):
                source = make_checkpoint(tmp_path, step, {"model.ckpt": 64})
                for node in range(nnodes):
                    await commit(store, source, step, node_rank=node, nnodes=nnodes)
            await body(store)

    asyncio.run(main())


async def _failed_start(watch: setaside.ResumeWatch, pid: int, step: int | None = None) -> str:
    """A trainer start that resumes from the restored checkpoint and exits with status 1."""
    watch.hello()
    assert watch.step is not None
    watch.resumed(pid, watch.step)
    return await watch.exited(pid, 1, step)


async def _restores(store: Store, tmp_path: Path) -> int | None:
    target = tmp_path / f"restore-{len(list(tmp_path.iterdir()))}"
    target.mkdir()
    return (await restore(store, target)).step


def test_two_failed_resumes_in_a_row_set_it_aside(tmp_path: Path) -> None:
    async def body(store: Store) -> None:
        watch = setaside.ResumeWatch(store, NEWER, 0, 1, "job-1-master-0")
        assert await _failed_start(watch, 100) == ""  # the first: counted, not yet set aside
        assert await _restores(store, tmp_path) == NEWER
        # A second process of the same start (torchrun's other worker) is the same failure.
        watch.resumed(101, NEWER)
        assert await watch.exited(101, 1, None) == ""
        why = await _failed_start(watch, 102, step=NEWER + 1)  # failed in the first step
        assert "exited with code 1 before completing a step, 2 times in a row" in why
        assert await _restores(store, tmp_path) == OLDER  # the one before it
        states = {s.step: s async for s in setaside.scan(store)}
        assert states[NEWER].set_aside == why and not states[NEWER].valid
        assert states[NEWER].reason == f"set aside: {why}"
        # Kept in the store: retention neither counts nor deletes it.
        deleted = await retention.apply(store, 1, set(), 0)
        assert deleted == []
        assert {s.step async for s in setaside.scan(store)} == {OLDER, NEWER}

    _run(tmp_path, body)


def test_errors_of_the_training_itself_are_not_blamed_on_the_checkpoint(tmp_path: Path) -> None:
    async def body(store: Store) -> None:
        watch = setaside.ResumeWatch(store, NEWER, 0, 1, "job-1-master-0")
        # Before it resumed (its own code failed before loading: the same without a resume).
        watch.hello()
        assert await watch.exited(200, 1, None) == ""
        # A resumed process past its first step: the error is the training's, and happens
        # the same without a resume; it clears the count of an earlier failed resume.
        assert await _failed_start(watch, 201) == ""
        assert await _failed_start(watch, 202, step=NEWER + 2) == ""
        watch.hello()
        watch.resumed(203, NEWER)
        await watch.progressed(NEWER + 2)
        assert await watch.exited(203, 1, None) == ""
        assert await _failed_start(watch, 204) == ""  # one in a row again, not two
        # Stopped for a JIT checkpoint (143) or ending well is no failure.
        watch.hello()
        watch.resumed(205, NEWER)
        assert await watch.exited(205, 143, None) == ""
        record = await setaside.read(store, NEWER, 0)
        assert record is not None and record.failures == 1 and not record.set_aside
        assert await _restores(store, tmp_path) == NEWER

    _run(tmp_path, body)


def test_any_node_sets_it_aside_for_every_node(tmp_path: Path) -> None:
    async def body(store: Store) -> None:
        node0 = setaside.ResumeWatch(store, NEWER, 0, 2, "job-1-master-0", refresh_seconds=0)
        node1 = setaside.ResumeWatch(store, NEWER, 1, 2, "job-1-worker-0")
        assert await node0.refresh() == ""
        await _failed_start(node1, 300)
        assert await _failed_start(node1, 301)
        # Node 0's next start hears of it at its hello, and a restore of either node skips it.
        assert "node 1" in await node0.refresh()
        assert await _restores(store, tmp_path) == OLDER

    _run(tmp_path, body, nnodes=2)


def test_records_a_hostile_store_holds_are_ignored(tmp_path: Path) -> None:
    def record(**fields: object) -> bytes:
        base: dict[str, object] = {"step": NEWER, "node_rank": 0, "failures": 9}
        base |= {"set_aside": True, "reason": "planted"} | fields
        return setaside.ResumeRecord.model_validate(base).model_dump_json().encode()

    async def body(store: Store) -> None:
        planted = {
            0: record(step=OLDER),  # another checkpoint's record
            1: record(node_rank=0),  # node 0's record under node 1's name
        }
        for node, data in planted.items():
            await store.put_bytes(setaside.record_key(NEWER, node), data)
        assert await setaside.read(store, NEWER, 0) is None
        await store.put_bytes(setaside.record_key(NEWER, 0), b'{"step": 20, "node_rank": 0, ')
        assert await setaside.read(store, NEWER, 0) is None
        escape = record().replace(b"planted", b"\\u001b[2Jplanted")
        await store.put_bytes(setaside.record_key(NEWER, 0), escape)
        assert await setaside.read(store, NEWER, 0) is None
        await store.put_bytes(setaside.record_key(NEWER, 0), b" " * 5000 + record())
        assert await setaside.read(store, NEWER, 0) is None
        # Node 1 is beyond this one-node checkpoint's nnodes: never read.
        assert await _restores(store, tmp_path) == NEWER

    _run(tmp_path, body)


def _start_over_older(agent: AgentProcess, tmp_path: Path) -> None:
    """Commit checkpoint ``OLDER`` to the agent's destination, then start the agent: it
    restores that checkpoint, so the trainers it hears from are resumed ones."""

    async def seed() -> None:
        async with open_store(AgentConfig(destination=agent.destination)) as store:
            await commit(store, make_checkpoint(tmp_path, OLDER, {"model.ckpt": 64}), OLDER)

    asyncio.run(seed())
    agent.start()
    agent.wait_ready()


def test_the_agent_sets_it_aside_and_says_so_once(
    tmp_path: Path, local_s3: LocalS3, bucket: str, s3_env: dict[str, str]
) -> None:
    """Through the real agent and the shim's client: two starts that resume from the restored
    checkpoint and fail; the third start is told not to resume from it."""
    agent = AgentProcess(root=tmp_path, destination=f"s3://{bucket}/ns/job", s3_env=s3_env)
    try:
        _start_over_older(agent, tmp_path)
        for pid in (501, 502):
            client = Client(str(agent.socket))
            hello = client.call(shimtalk.hello(pid))
            assert isinstance(hello, protocol.HelloAnswer) and hello.restored is not None
            client.send(protocol.Progress(step=OLDER, max_steps=0, epoch=0.0, resumed=OLDER))
            assert client.call(protocol.Bye(exit_code=1, step=None)) == protocol.OkAnswer()
            client.close()
        client = Client(str(agent.socket))
        assert client.call(shimtalk.hello(503)) == protocol.HelloAnswer(None, set_aside=OLDER)
        status = agent.status()
        assert status["set_aside"]["step"] == OLDER
        assert "2 times in a row" in status["set_aside"]["reason"]
        client.close()
        assert agent.terminate() == 0
        assert agent.termination()["set_aside"]["step"] == OLDER
        assert agent.log().count(f"checkpoint-{OLDER} set aside (") == 1
    finally:
        agent.kill()


def test_the_last_step_reported_is_the_one_kept_while_the_guards_record_is_written(
    tmp_path: Path, local_s3: LocalS3, bucket: str, s3_env: dict[str, str]
) -> None:
    """The first step report past a resume clears the guard's record, a write to the store;
    a slow store holds that write while the trainer's final report arrives on its other
    connection. The final step is what ``/status`` and the termination message keep (the
    periodic report read first must not land after it)."""
    from tests.support.faultproxy import FaultProxy

    with FaultProxy(local_s3.endpoint) as proxy:
        env = dict(s3_env, AWS_S3_ENDPOINT=proxy.endpoint)
        agent = AgentProcess(root=tmp_path, destination=f"s3://{bucket}/ns/job", s3_env=env)
        try:
            _start_over_older(agent, tmp_path)
            requests = Client(str(agent.socket))  # the shim's request connection
            requests.call(shimtalk.hello(601))
            requests.send(protocol.Progress(step=OLDER, max_steps=0, epoch=0.0, resumed=OLDER))
            proxy.delay(HELD, times=1, method="PUT", path="resume-node-0")
            reports = Client(str(agent.socket))  # the shim's once-a-second reports
            reports.send(protocol.Progress(step=OLDER + 5, max_steps=OLDER + 9, epoch=0.0))
            agent.wait_for(lambda: proxy.injected("delay-request") == 1, 20, "the record write")
            held_until = time.monotonic() + HELD
            requests.send(protocol.Progress(step=OLDER + 9, max_steps=OLDER + 9, epoch=0.0))
            assert requests.call(protocol.Bye(exit_code=0, step=OLDER + 9)) == protocol.OkAnswer()
            time.sleep(max(0.0, held_until - time.monotonic()) + 0.5)  # the write went on
            assert agent.status()["progress"]["step"] == OLDER + 9
            requests.close()
            reports.close()
            assert agent.terminate() == 0
            assert agent.termination()["last_step"] == OLDER + 9
        finally:
            agent.kill()
