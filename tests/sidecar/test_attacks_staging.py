"""Attacks from the trainer's side of the shared volume (issue 10, findings 1, 2, 5).

The trainer container is untrusted code: it shares ``/mnt/jitckpt`` and the
socket with the sidecar, which holds the store's credentials. Each test runs
the real ``jitckpt agent`` against a real S3 server (moto), speaks to it
through the socket as a trainer would, and plants real files, symlinks and
records in the shared directory. A secret the agent can read (a canary file)
must never reach the store, and nothing outside the shared volume may be
chmodded, overwritten or deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from local.s3server import LocalS3
from shim import protocol
from shim.channel import Client
from sidecar.config import AgentConfig
from sidecar.storage.factory import open_store
from tests.sidecar import shimtalk
from tests.sidecar.agentproc import AgentProcess
from tests.sidecar.helpers import (
    bucket_objects,
    commit,
    make_checkpoint,
    seed_store,
    stage,
    tree_snapshot,
)

SIZE = 64  # the staged file and the canary have the same size, so a size check cannot tell


@pytest.fixture
def agent(
    tmp_path: Path, local_s3: LocalS3, bucket: str, s3_env: dict[str, str]
) -> Iterator[AgentProcess]:
    proc = AgentProcess(root=tmp_path, destination=f"s3://{bucket}/team/ns-a/job-1", s3_env=s3_env)
    yield proc
    proc.kill()


def _canary(directory: Path, name: str = "model.bin") -> bytes:
    """A file the agent can read and the trainer wants: stands for the agent's secrets."""
    directory.mkdir(parents=True, exist_ok=True)
    secret = (b"CANARY-" + secrets.token_hex(16).encode()).ljust(SIZE, b"!")
    path = directory / name
    path.write_bytes(secret)
    os.chmod(path, 0o600)
    return secret


def _hello(agent: AgentProcess) -> Client:
    client = Client(str(agent.socket), timeout=30)
    answer = client.call(shimtalk.hello(os.getpid()))
    assert isinstance(answer, protocol.HelloAnswer), answer
    return client


def _idle(agent: AgentProcess) -> bool:
    return agent.status()["queue"] == []


def _settle(agent: AgentProcess, timeout: float) -> bool:
    """Wait for the queue to empty; False if it did not (the store is checked anyway)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _idle(agent):
            return True
        time.sleep(0.2)
    return False


class Flipper:
    """Swaps staged paths to symlinks and back, in its own thread, until ``stop``.

    ``flip(path, target)``: ``path`` (a file or directory the trainer staged) turns
    into a symlink to ``target`` and back, again and again, each state held for a
    fraction of a millisecond. ``settle(path, target)``: stop flipping it and leave
    the symlink there for good, as a trainer does right after the sidecar's answer.
    """

    def __init__(self) -> None:
        self._paths: list[tuple[Path, Path]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.swaps = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def flip(self, path: Path, target: Path) -> None:
        with self._lock:
            self._paths = [*self._paths[-3:], (path, target)]

    def settle(self, path: Path, target: Path) -> None:
        with self._lock:
            self._paths = [p for p in self._paths if p[0] != path]
            if not path.is_symlink():
                with contextlib.suppress(OSError):  # gone: the agent committed and removed it
                    self._to_link(path, target)

    @staticmethod
    def _to_link(path: Path, target: Path) -> None:
        os.rename(path, path.with_name(path.name + ".real"))  # the staged thing steps aside
        link = path.with_name(path.name + ".link")
        os.symlink(target, link)
        os.rename(link, path)  # a symlink takes its name, atomically

    @staticmethod
    def _to_real(path: Path) -> None:
        real = path.with_name(path.name + ".real")
        if real.is_dir():
            os.unlink(path)  # a directory cannot be renamed over a symlink
        os.rename(real, path)

    def _run(self) -> None:
        while not self._stop.is_set():
            for to_link in (True, False):
                with self._lock:
                    for path, target in self._paths:
                        try:
                            if to_link:
                                self._to_link(path, target)
                            else:
                                self._to_real(path)
                            self.swaps += 1
                        except OSError:
                            continue  # the agent removed it (committed), or a swap half-done
                time.sleep(0.0003)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.mark.slow
def test_symlink_swaps_raced_many_times_never_upload_the_canary(
    agent: AgentProcess, tmp_path: Path, local_s3: LocalS3, bucket: str
) -> None:
    """Finding 1: 200 staged checkpoints, each with a file, a subdirectory or the whole
    staged directory flipping to a symlink to the canary while the agent accepts, reads,
    checksums and uploads it. The store must hold staged bytes only."""
    secret_dir = tmp_path / "sidecar-private"
    canary = _canary(secret_dir)
    _canary(secret_dir / "sub")  # for the subdirectory swap: sub/model.bin
    agent.start()
    agent.wait_ready()
    client = _hello(agent)
    staged: set[bytes] = set()
    answers = {"ok": 0, "refused": 0, "connection lost": 0}
    flipper = Flipper()
    try:
        for i in range(200):
            name = f"checkpoint-{i + 1}-periodic-{i}"
            mode = i % 3
            files = ["model.bin"] if mode != 1 else ["sub/model.bin"]
            directory, _ = stage(agent.staging, name, {files[0]: SIZE})
            payload = (directory / files[0]).read_bytes()
            staged.add(payload)
            flipped = (
                (directory / "model.bin", secret_dir / "model.bin"),
                (directory / "sub", secret_dir / "sub"),
                (directory, secret_dir),
            )[mode]
            flipper.flip(*flipped)
            try:
                answer = client.call(shimtalk.staged(i + 1, "periodic", directory, files))
            except ConnectionError:
                answers["connection lost"] += 1
                client = _hello(agent)
                continue
            answers["ok" if isinstance(answer, protocol.StagedAnswer) else "refused"] += 1
            if i % 2 == 0:
                flipper.settle(*flipped)
        settled = _settle(agent, 60)
    finally:
        flipper.stop()
        client.close()
    assert flipper.swaps > 200, flipper.swaps
    objects = bucket_objects(local_s3, bucket)
    uploaded = {k: v for k, v in objects.items() if k.endswith("model.bin")}
    leaked = sorted(k for k, v in objects.items() if b"CANARY-" in v)
    assert leaked == [], f"the canary reached the store: {leaked}"
    assert all(body in staged for body in uploaded.values())
    assert len(uploaded) >= 20, (answers, agent.log()[-3000:])  # the race did not stop uploads
    assert canary not in agent.log().encode()
    assert answers["connection lost"] == 0, answers
    assert settled, agent.status()["queue"]
    assert agent.terminate() == 0


def test_forged_job_record_is_not_trusted_after_a_restart(
    agent: AgentProcess, tmp_path: Path, local_s3: LocalS3, bucket: str
) -> None:
    """Finding 2: a job record the trainer writes into the staging directory names a
    directory outside it; a restarted agent must neither upload nor delete it."""
    victim = tmp_path / "other-job"
    canary = _canary(victim, "secret.txt")
    before = tree_snapshot(victim)
    agent.staging.mkdir(parents=True)
    forged = {
        "id": "evil",
        "step": 7,
        "kind": "jit",
        "dir": str(victim),
        "files": ["secret.txt"],
        "staged_at": 0.0,
    }
    (agent.staging / "evil.job.json").write_text(json.dumps(forged))
    agent.start()
    agent.wait_ready()
    agent.wait_for(lambda: _idle(agent), 30, "the queue to be empty")
    assert tree_snapshot(victim) == before
    assert not any(canary in body for body in bucket_objects(local_s3, bucket).values())
    assert agent.terminate() == 0


def test_planted_symlink_at_the_record_temp_name_is_not_followed(
    agent: AgentProcess, tmp_path: Path
) -> None:
    """Finding 2: the trainer predicts the sidecar's temp file name next to its staged
    directory and plants a symlink there; accepting the checkpoint must not write
    through it."""
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"do not overwrite\n")
    agent.start()
    agent.wait_ready()
    os.symlink(victim, agent.staging / ".ckpt-1.job.json.tmp")
    client = _hello(agent)
    directory, files = stage(agent.staging, "ckpt-1", {"model.bin": 100})
    answer = client.call(shimtalk.staged(1, "jit", directory, files))
    assert isinstance(answer, protocol.StagedAnswer), answer
    agent.wait_for(lambda: agent.committed_step() == 1, 30, "the commit")
    assert victim.read_bytes() == b"do not overwrite\n"
    client.close()
    assert agent.terminate() == 0


@pytest.mark.parametrize("planted", ["checkpoints", "checkpoint-3", ".restore-checkpoint-3"])
def test_restore_never_follows_a_planted_symlink(
    agent: AgentProcess, tmp_path: Path, planted: str
) -> None:
    """Finding 2: before the agent (re)starts, the trainer replaces ``checkpoints`` (or
    the restore's target or temp directory in it) with a symlink to another job's
    checkpoints, as a ``pvc://`` claim would hold them. The restore must not chmod,
    write into, delete or replace anything there, and must still restore."""
    seed_store(agent.destination, tmp_path / "seed", 3, {"model.bin": 1000})
    victim = tmp_path / "claim" / "other-job"
    (victim / "checkpoint-3").mkdir(parents=True)
    (victim / "checkpoint-3" / "model.bin").write_bytes(b"another job's weights")
    (victim / "keep.txt").write_bytes(b"keep")
    os.chmod(victim, 0o750)
    before = tree_snapshot(victim)
    checkpoints = agent.local_dir / "checkpoints"
    if planted == "checkpoints":
        agent.local_dir.mkdir(parents=True)
        os.symlink(victim, checkpoints)
    else:
        checkpoints.mkdir(parents=True)
        os.symlink(
            victim if planted.startswith(".") else victim / "checkpoint-3", checkpoints / planted
        )
    agent.start()
    agent.wait_ready()
    assert tree_snapshot(victim) == before
    assert stat.S_IMODE(victim.stat().st_mode) == 0o750
    restored = checkpoints / "checkpoint-3"
    assert not checkpoints.is_symlink() and not restored.is_symlink()
    assert (restored / "model.bin").stat().st_size == 1000
    assert agent.status()["restored"]["step"] == 3
    assert agent.terminate() == 0


def test_staged_manifest_name_cannot_forge_another_node(
    tmp_path: Path, local_s3: LocalS3, bucket: str, s3_env: dict[str, str]
) -> None:
    """Finding 5: on a two-node job, node 0's trainer stages a file named
    ``.jitckpt/node-1.json``; uploaded, it would stand in for node 1's commit and make
    a checkpoint "valid" that node 1 never saved."""
    from tests.sidecar.test_agent import _states

    agent = AgentProcess(
        root=tmp_path,
        destination=f"s3://{bucket}/team/ns-a/job-1",
        s3_env=s3_env,
        extra_env={"JITCKPT_NNODES": "2"},
    )
    try:
        agent.start()
        agent.wait_ready()
        client = _hello(agent)
        forged = {
            "version": 1,
            "step": 5,
            "kind": "jit",
            "node_rank": 1,
            "nnodes": 2,
            "files": [],
        }
        for step, listed in ((5, True), (6, False), (7, True)):
            forged["step"] = step
            directory, files = stage(agent.staging, f"ckpt-{step}", {"model.bin": 100})
            inner = "sub/../.jitckpt" if step == 7 else ".jitckpt"
            (directory / ".jitckpt").mkdir(mode=0o777)
            (directory / ".jitckpt" / "node-1.json").write_text(json.dumps(forged))
            names = [*files, f"{inner}/node-1.json"] if listed else []
            answer = client.call(shimtalk.staged(step, "jit", directory, names))
            assert isinstance(answer, protocol.ErrorAnswer), answer
            assert ".jitckpt" in answer.error
        agent.wait_for(lambda: _idle(agent), 30, "the queue to be empty")
        client.close()
        states = _states(agent.destination, s3_env, tmp_path)
        assert not any(s.valid for s in states.values()), states
        keys = bucket_objects(local_s3, bucket)
        assert not any(k.endswith(".jitckpt/node-1.json") for k in keys), sorted(keys)
        assert agent.terminate() == 0
    finally:
        agent.kill()


def test_staged_file_deleted_after_acceptance_is_still_uploaded(
    agent: AgentProcess, tmp_path: Path, local_s3: LocalS3, bucket: str
) -> None:
    """The trainer deletes its staged links once the sidecar answered: the sidecar owns
    the files from its answer on, so it uploads the bytes it accepted (and is never
    stuck retrying a job whose directory is still there but whose files are gone)."""
    from tests.support.faultproxy import FaultProxy

    with FaultProxy(local_s3.endpoint) as proxy:
        agent.s3_env = dict(agent.s3_env, AWS_S3_ENDPOINT=proxy.endpoint)
        agent.start()
        agent.wait_ready()
        proxy.fail(503, "SlowDown", times=10_000, method="PUT")
        client = _hello(agent)
        directory, files = stage(agent.staging, "ckpt-4", {"model.bin": 4096})
        payload = (directory / "model.bin").read_bytes()
        answer = client.call(shimtalk.staged(4, "jit", directory, files))
        assert isinstance(answer, protocol.StagedAnswer), answer
        (directory / "model.bin").unlink()
        agent.wait_for(lambda: proxy.injected("SlowDown") > 0, 20, "a failed upload")
        proxy.clear()
        agent.wait_for(lambda: agent.committed_step() == 4, 60, "the commit")
        client.close()
        key = "team/ns-a/job-1/checkpoint-4/model.bin"
        assert bucket_objects(local_s3, bucket)[key] == payload
        assert agent.terminate() == 0


def test_staged_file_that_changes_size_is_dropped_after_bounded_retries(
    agent: AgentProcess, tmp_path: Path, local_s3: LocalS3, bucket: str
) -> None:
    """Finding 5 (low): a staged file that shrinks after acceptance can never be
    uploaded as accepted; the job is dropped with an error in the status, not retried
    forever, and nothing of it is committed."""
    from tests.support.faultproxy import FaultProxy

    with FaultProxy(local_s3.endpoint) as proxy:
        agent.s3_env = dict(agent.s3_env, AWS_S3_ENDPOINT=proxy.endpoint)
        agent.extra_env = {"JITCKPT_S3_MAX_ATTEMPTS": "1"}
        agent.start()
        agent.wait_ready()
        proxy.fail(503, "SlowDown", times=10_000, method="PUT")  # nothing can be committed
        client = _hello(agent)
        directory, files = stage(agent.staging, "ckpt-8", {"model.bin": 4096})
        answer = client.call(shimtalk.staged(8, "jit", directory, files))
        assert isinstance(answer, protocol.StagedAnswer), answer
        os.truncate(directory / "model.bin", 100)
        agent.wait_for(lambda: _idle(agent), 90, "the job to be dropped")
        assert agent.status()["last_error"] is not None
        proxy.clear()
        status = agent.status()
        assert status["last_committed"] is None
        assert "checkpoint-8" in status["last_error"] and "dropped" in status["last_error"]
        client.close()
        assert not any("checkpoint-8/" in k for k in bucket_objects(local_s3, bucket))
        assert agent.terminate() == 0


def test_job_whose_files_vanished_across_a_restart_is_dropped(
    agent: AgentProcess, tmp_path: Path, local_s3: LocalS3, bucket: str
) -> None:
    """Finding 5 (low): the agent is killed with a job queued; the trainer deletes the
    staged files meanwhile. The restarted agent drops the job with an error in the
    status instead of retrying it forever."""
    from tests.support.faultproxy import FaultProxy

    with FaultProxy(local_s3.endpoint) as proxy:
        agent.s3_env = dict(agent.s3_env, AWS_S3_ENDPOINT=proxy.endpoint)
        agent.start()
        agent.wait_ready()
        proxy.fail(503, "SlowDown", times=10_000, method="PUT")
        client = _hello(agent)
        directory, files = stage(agent.staging, "ckpt-9", {"model.bin": 4096})
        answer = client.call(shimtalk.staged(9, "jit", directory, files))
        assert isinstance(answer, protocol.StagedAnswer), answer
        agent.wait_for(lambda: proxy.injected("SlowDown") > 0, 20, "a failed upload")
        agent.kill()
        client.close()
        (directory / "model.bin").unlink()
        proxy.clear()
        agent.start()
        agent.wait_ready()
        agent.wait_for(lambda: _idle(agent), 60, "the job to be dropped")
        status = agent.status()
        assert status["last_committed"] is None
        assert "checkpoint-9" in (status["last_error"] or ""), status
        assert not any("checkpoint-9/" in k for k in bucket_objects(local_s3, bucket))
        assert agent.terminate() == 0


def test_planted_pid_files_neither_block_nor_are_followed(tmp_path: Path) -> None:
    """The legacy run phase reads pid files from the run volume the trainer writes: a FIFO
    there must not hang the agent's loop, and a symlink (to ``/dev/zero``, or to a file
    that looks like a pid file of the agent's namespace) is not followed."""
    from sidecar.presence import own_namespace_pids, pid_namespace

    pids = tmp_path / "run" / "pids"
    pids.mkdir(parents=True)
    os.mkfifo(pids / "fifo.pid")
    os.symlink("/dev/zero", pids / "zero.pid")
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text(f"1\n{pid_namespace()}\n")
    os.symlink(elsewhere, pids / "link.pid")
    (pids / "42.pid").write_text(f"42\n{pid_namespace()}\n")
    found: list[list[int]] = []
    reader = threading.Thread(target=lambda: found.append(own_namespace_pids(pids)), daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():
        with open(pids / "fifo.pid", "wb"):  # let the blocked reader go
            pass
        reader.join(10)
        pytest.fail("reading the pid files blocked on a FIFO")
    assert found == [[42]]


def _record(job_id: str, step: int, kind: object, files: dict[str, Path]) -> dict[str, object]:
    """A job record as the sidecar writes one, for ``files`` (name: the staged file)."""
    entries = []
    for name, path in files.items():
        info = path.stat()
        entries.append(
            {"path": name, "size": info.st_size, "device": info.st_dev, "inode": info.st_ino}
        )
    return {"id": job_id, "step": step, "kind": kind, "staged_at": 0.0, "files": entries}


def test_forged_records_in_the_state_dir_neither_forge_a_node_nor_stop_the_lanes(
    tmp_path: Path, local_s3: LocalS3, bucket: str, s3_env: dict[str, str]
) -> None:
    """Issue 22, class 5: a pod whose trainer could write the sidecar's record volume
    (the webhook refuses those now; this is the sidecar's own line) forges records: one
    names a staged ``.jitckpt/node-1.json`` so a restarted node-0 sidecar would upload
    another node's manifest and make checkpoint-5, committed by one node of two, valid;
    one has a kind no upload knows, which ended the lane it was queued on. Each is
    refused when read back, and a real checkpoint staged afterwards is committed."""
    agent = AgentProcess(
        root=tmp_path,
        destination=f"s3://{bucket}/team/ns-a/job-1",
        s3_env=s3_env,
        extra_env={"JITCKPT_NNODES": "2"},
    )
    forged_node = {
        "version": 1, "step": 5, "kind": "periodic", "node_rank": 1, "nnodes": 2,
        "pod": "p", "job": "job-1", "time": "2025-01-01T00:00:00+00:00", "files": [],
    }  # fmt: skip
    client = local_s3.client()
    seeded = make_checkpoint(tmp_path, 5, {"model.bin": 100})

    async def seed() -> None:
        async with open_store(AgentConfig(destination=agent.destination)) as store:
            await commit(store, seeded, 5, node_rank=0, nnodes=2)

    asyncio.run(seed())
    records = agent.shim_target.parent / "agent" / "staged"
    records.mkdir(parents=True)
    for number, (kind, names) in enumerate(
        [
            ("periodic", [".jitckpt/node-1.json"]),
            ("periodic", ["model.bin", "x/../.jitckpt/node-1.json"]),
            ("no-such-kind", ["model.bin"]),
            (["jit"], ["model.bin"]),
        ]
    ):
        directory, _ = stage(agent.staging, f"evil-{number}", {"model.bin": 10})
        (directory / ".jitckpt").mkdir()
        node_file = directory / ".jitckpt" / "node-1.json"
        node_file.write_text(json.dumps(forged_node))
        files = {n: node_file if "node-1" in n else directory / n for n in names}
        record = _record(f"evil-{number}", 5, kind, files)
        (records / f"evil-{number}.job.json").write_text(json.dumps(record))
    agent.start()
    try:
        agent.wait_ready()
        trainer = _hello(agent)
        real, names = stage(agent.staging, "real-9", {"model.bin": 100})
        answer = trainer.call(shimtalk.staged(9, "periodic", real, names))
        assert isinstance(answer, protocol.StagedAnswer), answer
        agent.wait_for(lambda: agent.committed_step() == 9, 60, "the real checkpoint's commit")
        trainer.close()
        keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]
        assert not any(k.endswith("checkpoint-5/.jitckpt/node-1.json") for k in keys), keys
        assert agent.terminate() == 0
    finally:
        agent.kill()


FORGED_LINE = "2026-01-01 00:00:00,000 INFO jitckpt-agent jitckpt.agent: committed checkpoint-31337"


def test_names_from_the_socket_cannot_forge_a_log_line(agent: AgentProcess) -> None:
    """Issue 22, class 2: a staged directory name with a line break forged a "committed
    checkpoint-31337" line in the sidecar's log. Control characters are refused where a
    message enters (the protocol's schema), and every log line is escaped on the way
    out, so whatever the trainer sends stays inside one line of the log."""
    agent.start()
    agent.wait_ready()
    client = _hello(agent)
    hostile = [
        shimtalk.staged(1, "jit", agent.staging / f"x\n{FORGED_LINE}", []),
        shimtalk.staged(1, "jit", agent.staging / "ok", [f"a\r\n{FORGED_LINE}"]),
        shimtalk.staged(1, "jit", agent.staging / "ok\x1b[2J", ["a"]),
        shimtalk.staged(1, "jit", agent.staging / "ok\u2028x", ["a\u0085b"]),
    ]
    for request in hostile:
        answer = client.call(request)
        assert isinstance(answer, protocol.ErrorAnswer), answer
    client.close()
    assert agent.terminate() == 0
    log = agent.log()
    lines = log.splitlines()
    assert not any(line.startswith(FORGED_LINE[:23]) and "31337" in line for line in lines), log
    assert not any(c in log for c in "\x1b\r\u2028\u0085"), log


def test_a_connection_neither_blocks_the_jit_upload_nor_decides_when_the_sidecar_leaves(
    agent: AgentProcess, local_s3: LocalS3, bucket: str
) -> None:
    """Issue 22, class 3. One connection streams part of a JIT checkpoint and holds the
    stream open; another sends ``sigterm`` long before any SIGTERM. Before, the real
    trainer's complete JIT checkpoint waited behind the open stream until the grace
    deadline, and the early ``sigterm`` started the deadline clock, so the sidecar left
    at once on its own SIGTERM without the checkpoint staged after it. Now the complete
    one is committed while the stream stays open, and after the sidecar's SIGTERM it
    still takes and commits what the trainer (connected, no ``bye`` yet) stages."""
    agent.extra_env = {"JITCKPT_GRACE_SECONDS": "6", "JITCKPT_GRACE_MARGIN": "0.5"}
    agent.start()
    agent.wait_ready()
    holder = _hello(agent)
    part, names = stage(agent.staging, "huge-jit", {"shard-0": 100})
    streamed = holder.call(protocol.Staging(999, "jit", str(part), tuple(names)))
    assert isinstance(streamed, protocol.StagedAnswer), streamed
    early = _hello(agent)
    assert early.call(protocol.Sigterm(step=1)) == protocol.OkAnswer()
    trainer = _hello(agent)
    directory, files = stage(agent.staging, "checkpoint-50", {"model.bin": 1000})
    assert isinstance(
        trainer.call(shimtalk.staged(50, "jit", directory, files)), protocol.StagedAnswer
    )
    agent.wait_for(lambda: agent.committed_step() == 50, 30, "the complete JIT checkpoint")
    assert agent.status()["queue"][0]["streaming"] is True  # the stream is still open
    holder.close()
    early.close()
    time.sleep(7)  # past the grace period, counted from the early sigterm
    assert agent.process is not None
    agent.process.send_signal(15)
    directory, files = stage(agent.staging, "checkpoint-60", {"model.bin": 1000})
    answer = trainer.call(shimtalk.staged(60, "jit", directory, files))
    assert isinstance(answer, protocol.StagedAnswer), answer
    assert trainer.call(protocol.Bye(exit_code=143)) == protocol.OkAnswer()
    trainer.close()
    assert agent.wait(30) == 0, agent.log()
    assert agent.termination()["last_committed"]["step"] == 60, agent.log()
    keys = bucket_objects(local_s3, bucket)
    assert any(k.endswith("checkpoint-60/.jitckpt/node-0.json") for k in keys), sorted(keys)


def test_a_sparse_file_larger_than_the_volume_is_refused_within_the_memory_limit(
    tmp_path: Path, local_s3: LocalS3, bucket: str, s3_env: dict[str, str]
) -> None:
    """Issue 22, class 4: one staged 4 TiB sparse file (no disk used) drove the agent past
    its 512Mi memory limit: a task per part was made before any part was sent. A staged
    size beyond the staging volume is refused at once, and the agent, held to 512 MiB
    here, goes on to commit the next checkpoint."""
    agent = AgentProcess(
        root=tmp_path,
        destination=f"s3://{bucket}/team/ns-a/job-1",
        s3_env=s3_env,
        memory_limit=512 * 1024 * 1024,
    )
    agent.start()
    try:
        agent.wait_ready(60)
        client = _hello(agent)
        directory, files = stage(agent.staging, "sparse", {"model.bin": 10})
        with (directory / "model.bin").open("r+b") as handle:
            handle.truncate(4 << 40)
        answer = client.call(shimtalk.staged(3, "jit", directory, files))
        assert isinstance(answer, protocol.ErrorAnswer), answer
        assert "more than the staging volume" in answer.error, answer.error
        directory, files = stage(agent.staging, "checkpoint-4", {"model.bin": 1000})
        answer = client.call(shimtalk.staged(4, "jit", directory, files))
        assert isinstance(answer, protocol.StagedAnswer), answer
        agent.wait_for(lambda: agent.committed_step() == 4, 60, "the next checkpoint")
        client.close()
        assert agent.terminate() == 0
    finally:
        agent.kill()
