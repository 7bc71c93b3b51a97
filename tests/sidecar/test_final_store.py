"""``<job root>/final/``: the final model committed whole, replaced whole, never a checkpoint.

The agent is the real ``jitckpt agent``, spoken to with the shim's protocol
types; the stores are moto's S3 server and a directory standing for a
mounted claim. Readers go through ``sidecar.final`` (what ``jitckpt ls`` and
the demo use) and read the bytes back from the store.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest

from local.s3server import LocalS3
from shim import layout, protocol
from shim.channel import Client
from sidecar import checksum, final, safefs
from sidecar import manifest as mf
from sidecar.config import AgentConfig
from sidecar.staging import StagedJob
from sidecar.storage.base import ObjectInfo, Store, StoreError
from sidecar.storage.factory import open_store
from sidecar.validity import scan
from tests.sidecar import shimtalk
from tests.sidecar.agentproc import JITCKPT, AgentProcess
from tests.sidecar.helpers import stage

Model = dict[str, bytes]


def _agent(
    root: Path, destination: str, pvc: Path, env: dict[str, str], **extra: str
) -> AgentProcess:
    root.mkdir(parents=True, exist_ok=True)
    pvc.mkdir(exist_ok=True)  # the claim's mount (used only by pvc:// destinations)
    return AgentProcess(
        root=root,
        destination=destination,
        s3_env=env,
        extra_env={layout.ENV_PVC_MOUNT: str(pvc), **extra},
    )


def _stage(
    agent: AgentProcess, client: Client, name: str, step: int, *, kind: str, sizes: dict[str, int]
) -> Model:
    """Stage files as the shim does; their bytes (the sidecar removes the links once uploaded)."""
    directory, files = stage(agent.staging, name, sizes)
    content = {f: (directory / f).read_bytes() for f in files}
    answer = client.call(shimtalk.staged(step, kind, directory, files))
    assert isinstance(answer, protocol.StagedAnswer), answer
    return content


async def _read(store: Store, state: final.FinalState) -> Model:
    """Download every file of the committed run, each verified against the record."""
    assert state.run is not None
    model: Model = {}
    for entry in state.files:
        with tempfile.TemporaryFile() as out:
            key = final.file_key(state.run, entry.path)
            await store.get_file(key, out.fileno(), entry.size, entry.crc32c)
            out.seek(0)
            model[entry.path] = out.read()
    return model


def read_final(destination: str, pvc: Path) -> tuple[final.FinalState | None, Model]:
    """The final model as a reader finds it: its state, and its files' bytes when valid."""

    async def main() -> tuple[final.FinalState | None, Model]:
        async with open_store(AgentConfig(destination=destination, pvc_mount=pvc)) as store:
            state = await final.judge(store)
            if state is None or not state.valid:
                return state, {}
            return state, await _read(store, state)

    return asyncio.run(main())


def final_keys(destination: str, pvc: Path) -> set[str]:
    async def main() -> set[str]:
        async with open_store(AgentConfig(destination=destination, pvc_mount=pvc)) as store:
            return {o.key for o in await store.list_objects(final.PREFIX)}

    return asyncio.run(main())


class Reader(threading.Thread):
    """Reads the final model again and again while a new one is committed: what it saw."""

    def __init__(self, destination: str, pvc: Path) -> None:
        super().__init__(daemon=True)
        self.destination, self.pvc = destination, pvc
        self.seen: list[Model] = []
        self.errors = 0
        self.failure: BaseException | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            asyncio.run(self._loop())
        except BaseException as failure:  # the test asserts on it: a thread's raise is lost
            self.failure = failure

    async def _loop(self) -> None:
        config = AgentConfig(destination=self.destination, pvc_mount=self.pvc)
        async with open_store(config) as store:
            while not self.stop.is_set():
                try:
                    state = await final.judge(store)
                    assert state is not None and state.valid, state
                    self.seen.append(await _read(store, state))
                except (StoreError, OSError):
                    self.errors += 1  # the files of a record just replaced are gone: read again


def test_final_model_replaced_whole_and_readers_never_see_a_mix(
    destination: str, tmp_path: Path, s3_env: dict[str, str]
) -> None:
    pvc = tmp_path / "pvc"
    # JITCKPT_TORN_MIN_AGE=0: a run nobody committed counts as stale at once (else 1 h).
    agent = _agent(tmp_path / "pod", destination, pvc, s3_env, JITCKPT_TORN_MIN_AGE="0")
    try:
        agent.start()
        agent.wait_ready()
        client = Client(str(agent.socket))
        assert isinstance(client.call(shimtalk.hello(os.getpid())), protocol.HelloAnswer)
        first = _stage(
            agent,
            client,
            "out-final-1",
            10,
            kind="final",
            sizes={"model.safetensors": 200_000, "config.json": 300, "tokenizer/vocab.json": 500},
        )
        agent.wait_for(lambda: agent.status()["final"] is not None, 30, "the first final model")
        state, model = read_final(destination, pvc)
        assert state is not None and state.valid and state.step == 10
        assert model == first
        assert state.size == sum(len(b) for b in first.values())
        # A run uploaded but never committed (a pod killed mid-upload) is not the model.
        stray = final.file_key("run-20000101T000000Z-0123456789ab", "model.safetensors")

        async def plant() -> None:
            async with open_store(AgentConfig(destination=destination, pvc_mount=pvc)) as store:
                await store.put_bytes(stray, b"half of an older upload")

        asyncio.run(plant())
        assert read_final(destination, pvc)[1] == first

        reader = Reader(destination, pvc)
        reader.start()
        second = _stage(
            agent,
            client,
            "out-final-2",
            20,
            kind="final",
            sizes={"model.safetensors": 250_000, "config.json": 310, "extra.bin": 1000},
        )
        agent.wait_for(lambda: (agent.status()["final"] or {}).get("step") == 20, 30, "final 2")
        reader.stop.set()
        reader.join(30)
        client.close()
        assert agent.terminate() == 0, agent.log()
    finally:
        agent.kill()
    assert list(agent.staging.iterdir()) == [], "the staged links are released once committed"
    assert reader.failure is None, repr(reader.failure)
    assert reader.seen, "the reader read nothing"
    assert all(seen in (first, second) for seen in reader.seen), "a reader saw a mix"
    state, model = read_final(destination, pvc)
    assert state is not None and state.valid and state.step == 20 and model == second
    # The replaced run and the stray one are gone: only the record and the new files remain.
    assert final_keys(destination, pvc) == {
        final.RECORD_KEY,
        *(final.file_key(state.run or "", name) for name in second),
    }
    done = agent.termination()["final"]
    assert done["uri"].endswith(f"/{final.run_prefix(state.run or '').rstrip('/')}")
    assert done["size"] == sum(len(b) for b in second.values())
    assert "final model:" in agent.termination()["message"]


def test_retention_restore_and_ls_leave_the_final_model_alone(
    tmp_path: Path, local_s3: LocalS3, bucket: str, s3_env: dict[str, str]
) -> None:
    destination = f"s3://{bucket}/team/ns-a/job-1"
    pvc = tmp_path / "pvc"
    agent = _agent(tmp_path / "pod-1", destination, pvc, s3_env, JITCKPT_S3_RETENTION="1")
    try:
        agent.start()
        agent.wait_ready()
        client = Client(str(agent.socket))
        client.call(shimtalk.hello(os.getpid()))
        for step in (4, 8):
            _stage(
                agent, client, f"checkpoint-{step}-x", step, kind="periodic", sizes={"model": 500}
            )
            agent.wait_for(lambda s=step: agent.committed_step() == s, 30, f"checkpoint-{step}")
        # A final model whose step is above every checkpoint's: still never resumed from.
        model = _stage(
            agent, client, "out-final", 99, kind="final", sizes={"model.safetensors": 4000}
        )
        agent.wait_for(lambda: agent.status()["final"] is not None, 30, "the final model")
        # Retention (keep the newest 1) runs after this commit: checkpoint-4 and -8 go.
        _stage(agent, client, "checkpoint-12-x", 12, kind="periodic", sizes={"model": 500})
        agent.wait_for(lambda: agent.committed_step() == 12, 30, "checkpoint-12")
        client.close()
        assert agent.terminate() == 0, agent.log()
    finally:
        agent.kill()
    assert "retention deleted checkpoint-8" in agent.log()

    async def steps() -> list[int]:
        async with open_store(AgentConfig(destination=destination)) as store:
            return [s.step async for s in scan(store)]

    assert asyncio.run(steps()) == [12]
    state, stored = read_final(destination, pvc)
    assert state is not None and state.valid and stored == model

    second = _agent(tmp_path / "pod-2", destination, pvc, s3_env)
    try:
        second.start()
        second.wait_ready()
        assert second.status()["restored"]["step"] == 12
        assert sorted(p.name for p in (second.local_dir / "checkpoints").iterdir()) == [
            "checkpoint-12"
        ]
        assert second.terminate() == 0
    finally:
        second.kill()

    listed = subprocess.run(
        [JITCKPT, "ls", destination, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert listed.returncode == 0, listed.stderr
    document = json.loads(listed.stdout)
    assert [row["step"] for row in document["checkpoints"]] == [12]
    row = document["final"]
    assert row["state"] == "valid" and row["step"] == 99 and row["files"] == 1
    assert row["size"] == 4000 and row["uri"] == f"{destination}/{state.key}"
    table = subprocess.run(
        [JITCKPT, "ls", destination], capture_output=True, text=True, timeout=60, check=False
    )
    last = table.stdout.splitlines()[-1].split()
    assert last[:3] == ["final", "valid", "model"], table.stdout


def test_torn_final_models_are_reported_with_the_reason(config: AgentConfig) -> None:
    data = b"weights" * 100
    entry = mf.FileEntry(path="model.safetensors", size=len(data), crc32c=checksum.of_bytes(data))
    manifest = mf.Manifest(step=5, kind="final", node_rank=0, nnodes=1, files=[entry])
    run = "run-20260101T000000Z-00000000000a"
    record = final.FinalRecord(run=run, staged_at=1.0, manifest=manifest)

    async def main() -> list[str]:
        reasons = []
        async with open_store(config) as store:
            assert await final.judge(store) is None  # nothing under final/ at all
            await store.put_bytes(final.file_key(run, entry.path), data)
            reasons.append((await final.judge(store)).reason)  # type: ignore[union-attr]
            await store.put_bytes(final.RECORD_KEY, record.model_dump_json().encode())
            state = await final.judge(store)
            assert state is not None and state.valid, state
            await store.put_bytes(final.file_key(run, entry.path), data[:-1])
            reasons.append((await final.judge(store)).reason)  # type: ignore[union-attr]
            await store.delete([final.file_key(run, entry.path)])
            reasons.append((await final.judge(store)).reason)  # type: ignore[union-attr]
            await store.put_bytes(final.RECORD_KEY, b'{"run": "../../checkpoint-5"}')
            reasons.append((await final.judge(store)).reason)  # type: ignore[union-attr]
        return reasons

    reasons = asyncio.run(main())
    assert reasons[0] == "no commit record: the final model's upload did not finish"
    assert reasons[1] == "model.safetensors is 699 bytes, the record says 700"
    assert reasons[2] == "missing object model.safetensors"
    assert reasons[3].startswith("the record is unreadable")


def _final_record(run: str, data: bytes, staged_at: float) -> final.FinalRecord:
    entry = mf.FileEntry(path="model.safetensors", size=len(data), crc32c=checksum.of_bytes(data))
    manifest = mf.Manifest(step=5, kind="final", node_rank=0, nnodes=1, files=[entry])
    return final.FinalRecord(run=run, staged_at=staged_at, manifest=manifest)


@pytest.mark.parametrize("replaced", ["before-the-listing", "after-the-listing"])
def test_a_model_replaced_while_it_is_judged_is_never_reported_broken(
    config: AgentConfig, replaced: str
) -> None:
    """A commit lands between ``judge``'s two reads (the record, the listing), in the order
    ``final.commit`` writes: the new run's files, its record, the old run's files deleted.
    Whichever read it falls between, the verdict is a valid model, never "missing object"."""
    old, new = b"old weights" * 50, b"new weights" * 60
    old_run, new_run = "run-20260101T000000Z-00000000000a", "run-20260102T000000Z-00000000000b"

    async def commit(store: Store, run: str, data: bytes, staged_at: float) -> None:
        await store.put_bytes(final.file_key(run, "model.safetensors"), data)
        record = _final_record(run, data, staged_at)
        await store.put_bytes(final.RECORD_KEY, record.model_dump_json().encode())

    async def main() -> final.FinalState | None:
        async with open_store(config) as store:
            await commit(store, old_run, old, 1.0)
            listing = store.list_objects
            pending = [True]

            async def list_objects(prefix: str = "") -> list[ObjectInfo]:
                if not pending:
                    return await listing(prefix)
                pending.clear()
                if replaced == "after-the-listing":
                    seen = await listing(prefix)
                await commit(store, new_run, new, 2.0)
                await store.delete([final.file_key(old_run, "model.safetensors")])
                return seen if replaced == "after-the-listing" else await listing(prefix)

            store.list_objects = list_objects  # type: ignore[method-assign]
            return await final.judge(store)

    state = asyncio.run(main())
    assert state is not None and state.valid, state
    assert state.run in (old_run, new_run)  # the old one while its files were all there


def test_an_older_final_model_never_replaces_a_newer_one(
    config: AgentConfig, tmp_path: Path
) -> None:
    """A sidecar restarted with an old final model still queued must not undo a newer one."""

    def job(name: str, staged_at: float, data: bytes) -> StagedJob:
        directory = tmp_path / name
        directory.mkdir()
        (directory / "model.safetensors").write_bytes(data)
        opened = safefs.open_path(directory / "model.safetensors")
        return StagedJob(name, 7, "final", [opened], staged_at)

    async def main() -> tuple[final.FinalCommit, final.FinalCommit, Model, set[str]]:
        async with open_store(config) as store:
            newer = await final.commit(store, job("new", 2000.0, b"new"), node_rank=0, nnodes=1)
            older = await final.commit(store, job("old", 1000.0, b"old"), node_rank=0, nnodes=1)
            state = await final.judge(store)
            assert state is not None and state.valid
            keys = {o.key for o in await store.list_objects(final.PREFIX)}
            return newer, older, await _read(store, state), keys

    newer, older, model, keys = asyncio.run(main())
    assert not newer.superseded and older.superseded
    assert model == {"model.safetensors": b"new"}
    assert keys == {final.RECORD_KEY, final.file_key(newer.run, "model.safetensors")}


def test_the_record_of_a_model_of_many_files_is_read_whole(
    config: AgentConfig, tmp_path: Path
) -> None:
    """A sharded model's record is larger than one network read: S3 answers it in pieces."""
    source = tmp_path / "sharded"
    deep = "/".join(c * 200 for c in "abcd")  # 4 levels of 200-character names
    names = [f"{deep}/shard-{i:04d}.safetensors" for i in range(200)]
    for name in names:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_bytes(name.encode()[-16:])
    root = safefs.open_root(source)
    try:
        opened = [safefs.open_regular(root, name, None) for name in names]
    finally:
        os.close(root)
    job = StagedJob("sharded", 3, "final", opened, 1000.0)

    async def main() -> tuple[int, final.FinalState | None]:
        async with open_store(config) as store:
            await final.commit(store, job, node_rank=0, nnodes=1)
            record = await store.head(final.RECORD_KEY)
            assert record is not None
            return record.size, await final.judge(store)

    try:
        size, state = asyncio.run(main())
    finally:
        job.close()
    assert size > 150_000
    assert state is not None and state.valid, state
    assert sorted(e.path for e in state.files) == sorted(names)
