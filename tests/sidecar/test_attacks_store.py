"""Attacks from the store's side (issue 10, findings 4 and 5): hostile manifests.

The store is not trusted either: anyone who can write the bucket (another
namespace's job sharing it, a leaked key) can plant manifests. A real S3
server (moto) is seeded with hostile checkpoints newer than a good one; the
real ``jitckpt agent`` restores at start. It must skip every hostile one as
torn, say why, write nothing outside its target, stay within its memory, and
restore the good one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import google_crc32c
import pytest

from local.s3server import LocalS3
from sidecar import checksum
from tests.sidecar.agentproc import AgentProcess
from tests.sidecar.helpers import seed_store, tree_snapshot

PREFIX = "team/ns-a/job-1"
MIB = 1024 * 1024


class Seeder:
    """Writes raw objects under the job root, as a hostile writer of the bucket would."""

    def __init__(self, local_s3: LocalS3, bucket: str) -> None:
        self.bucket = bucket
        self.client = local_s3.client()

    def put(self, key: str, body: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=f"{PREFIX}/{key}", Body=body)

    def checkpoint(
        self,
        number: int,
        objects: dict[str, bytes],
        *,
        node: int = 0,
        padding: int = 0,
        **fields: object,
    ) -> None:
        """``objects`` (keys exactly as named) and node ``node``'s manifest
        listing them, with ``fields`` overriding the manifest's."""
        entries = []
        for path, body in objects.items():
            self.put(f"checkpoint-{number}/{path}", body)
            crc = checksum.encode(google_crc32c.value(body))
            entries.append({"path": path, "size": len(body), "crc32c": crc, "parts": 1})
        manifest: dict[str, object] = {
            "version": 1,
            "step": number,
            "kind": "periodic",
            "node_rank": node,
            "nnodes": 1,
            "pod": "p",
            "job": "job-1",
            "time": "2025-01-01T00:00:00+00:00",
            "files": entries,
        }
        manifest.update(fields)
        body = json.dumps(manifest).encode() + b" " * padding
        self.put(f"checkpoint-{number}/.jitckpt/node-{node}.json", body)


@pytest.fixture
def hostile(
    tmp_path: Path, local_s3: LocalS3, bucket: str, s3_env: dict[str, str]
) -> tuple[AgentProcess, Seeder]:
    agent = AgentProcess(
        root=tmp_path / "pod",
        destination=f"s3://{bucket}/{PREFIX}",
        s3_env=s3_env,
        memory_limit=1024 * MIB,  # the pod's limit is 512 Mi; a hostile store must not OOM it
    )
    agent.root.mkdir()
    seed_store(agent.destination, tmp_path / "seed", 2, {"model.bin": 1000, "sub/rng.pth": 10})
    return agent, Seeder(local_s3, bucket)


def _skipped(agent: AgentProcess) -> dict[int, str]:
    return {s["step"]: s["reason"] for s in agent.status()["restore_skipped"]}


def test_hostile_manifests_are_torn_and_restore_writes_only_its_target(
    hostile: tuple[AgentProcess, Seeder], tmp_path: Path
) -> None:
    agent, seeder = hostile
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_bytes(b"keep")
    absolute = outside / "absolute.txt"
    # restore's temp dir is pod/local/checkpoints/.restore-*/: four levels up is tmp_path
    seeder.checkpoint(10, {"../../../../outside/traversal.txt": b"pwned"})
    seeder.checkpoint(11, {str(absolute): b"pwned"})
    seeder.checkpoint(12, {"model.bin": b"w", ".jitckpt/node-1.json": b"{}"})
    seeder.checkpoint(13, {"model.bin": b"w"}, nnodes=10**6)
    seeder.checkpoint(14, {"model.bin": b"w"}, padding=17 * MIB)  # valid JSON, too large
    seeder.checkpoint(15, {"a\\..\\b": b"w", "ok/./x": b"w", "a//b": b"w"})
    seeder.checkpoint(16, {"model.bin": b"w"}, node=1, nnodes=1)  # node 1 of 1 nodes
    seeder.put("checkpoint-16/.jitckpt/node-0.json", b"[" * 100_000)  # deep nesting
    seeder.checkpoint(17, {"model.bin": b"w"}, step=10**30)
    entry = {"path": "model.bin", "size": 1, "crc32c": "AAAAAA==", "parts": 1}
    seeder.checkpoint(18, {"model.bin": b"w"}, files=[entry, dict(entry, size=2)])
    seeder.checkpoint(19, {"model.bin": b"w"}, nnodes=True)
    before = tree_snapshot(outside)

    agent.start()
    agent.wait_ready(60)
    assert agent.status()["restored"]["step"] == 2
    skipped = _skipped(agent)
    assert sorted(skipped) == list(range(10, 20)), skipped
    assert all(len(reason) < 600 for reason in skipped.values()), skipped
    assert "16777216" in skipped[14] or "16 MiB" in skipped[14], skipped[14]
    assert "nnodes" in skipped[13], skipped[13]
    assert tree_snapshot(outside) == before
    assert not (tmp_path / "traversal.txt").exists() and not absolute.exists()
    checkpoints = agent.local_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint-2"]
    restored = sorted(
        p.relative_to(checkpoints).as_posix() for p in checkpoints.rglob("*") if p.is_file()
    )
    assert restored == ["checkpoint-2/model.bin", "checkpoint-2/sub/rng.pth"]
    assert agent.terminate() == 0


def test_manifests_beyond_nnodes_are_never_read(
    hostile: tuple[AgentProcess, Seeder],
) -> None:
    """Only node-0..nnodes-1 count: an extra garbage ``node-7.json`` (or ``node-01.json``)
    neither tears a good checkpoint nor is read."""
    agent, seeder = hostile
    seeder.checkpoint(20, {"model.bin": b"weights"})
    seeder.put("checkpoint-20/.jitckpt/node-7.json", b"not json at all")
    seeder.put("checkpoint-20/.jitckpt/node-01.json", os.urandom(64))
    agent.start()
    agent.wait_ready(60)
    assert agent.status()["restored"]["step"] == 20, agent.status()
    assert (agent.local_dir / "checkpoints" / "checkpoint-20" / "model.bin").read_bytes() == (
        b"weights"
    )
    assert agent.terminate() == 0


def test_a_checkpoint_that_cannot_be_restored_is_skipped_not_fatal(
    hostile: tuple[AgentProcess, Seeder], tmp_path: Path
) -> None:
    """Issue 22, class 1: checkpoints that pass the validity rule but cannot be restored
    here. Before, each one made the native sidecar exit at start (a crash loop, the
    trainer never started); now each is skipped, said once, and the next one tried:
    an object in an archive storage class (InvalidObjectState on GET), a manifest listing
    both ``d0`` and ``d0/f`` (a file and a directory of one name), and one where node 1
    lists ``d0`` and node 0 ``d0/f`` (the clash only in the union)."""
    agent, seeder = hostile
    seeder.checkpoint(10, {"model.bin": b"w" * 100, "optimizer.pt": b"o" * 10})
    body = b"archived" * 10
    seeder.client.put_object(
        Bucket=seeder.bucket,
        Key=f"{PREFIX}/checkpoint-10/optimizer.pt",
        Body=body,
        StorageClass="GLACIER",
    )
    crc = checksum.encode(google_crc32c.value(body))
    seeder.checkpoint(
        10,
        {"model.bin": b"w" * 100},
        files=[
            {"path": "model.bin", "size": 100, "crc32c": _crc(b"w" * 100), "parts": 1},
            {"path": "optimizer.pt", "size": len(body), "crc32c": crc, "parts": 1},
        ],
    )
    seeder.checkpoint(11, {"d0": b"a", "d0/f": b"b"})
    seeder.checkpoint(12, {"d0/f": b"b"}, nnodes=2)
    seeder.checkpoint(12, {"d0": b"a"}, node=1, nnodes=2)
    agent.start()
    agent.wait_ready(60)
    status = agent.status()
    assert status["restored"]["step"] == 2, status
    skipped = _skipped(agent)
    assert sorted(skipped) == [10, 11, 12], skipped
    assert "InvalidObjectState" in skipped[10], skipped[10]
    assert "d0 is listed as a file and as a directory" in skipped[11], skipped[11]
    assert "d0 is listed as a file and as a directory" in skipped[12], skipped[12]
    log = agent.log()
    for step in (10, 11, 12):
        assert log.count(f"skipping checkpoint-{step}:") == 1, log
    checkpoints = agent.local_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint-2"]
    assert agent.terminate() == 0


def _crc(body: bytes) -> str:
    return checksum.encode(google_crc32c.value(body))


def test_hostile_commit_records_are_torn(hostile: tuple[AgentProcess, Seeder]) -> None:
    """Issue 38: the record is read by every node, so it is validated where it is read like
    a manifest (bounded, strict, consecutive nodes, printable) and then held to the
    listing: a record that names manifests that are not there makes nothing valid."""
    agent, seeder = hostile
    entry = {
        "node": 0, "manifest_size": 10, "sha256": "0" * 64, "kind": "jit", "files": 1,
        "file_bytes": 1, "shared": 1, "time": "2025-01-01T00:00:00+00:00",
    }  # fmt: skip

    def record(step: int, padding: int = 0, **fields: object) -> None:
        body = {"version": 1, "step": step, "nnodes": 1, "first": 0, "nodes": [entry], **fields}
        data = json.dumps(body).encode() + b" " * padding
        seeder.put(f"checkpoint-{step}/.jitckpt/commit.json", data)
        seeder.put(f"checkpoint-{step}/model.bin", b"w")

    record(10)  # names a manifest nobody wrote
    record(11, padding=5 * MIB)  # too large to be read
    record(12, nnodes=10**6)
    record(13, nodes=[dict(entry, time="2025-01-01T00:00:00+00:00\x1b[2J")])
    record(14, nodes=[dict(entry, node=1)])  # not node 0 first
    seeder.put("checkpoint-15/.jitckpt/commit.json", b"[" * 100_000)
    seeder.checkpoint(16, {"model.bin": b"weights"})  # a good manifest, a record of another
    record(16, nodes=[dict(entry, manifest_size=12345)])
    agent.start()
    agent.wait_ready(60)
    assert agent.status()["restored"]["step"] == 2
    skipped = _skipped(agent)
    assert sorted(skipped) == list(range(10, 17)), skipped
    assert skipped[10] == "manifests from 0 of 1 nodes (missing node-0)", skipped[10]
    assert "more than the 4194304 a record may have" in skipped[11], skipped[11]
    assert all(skipped[s].startswith("the commit record is invalid") for s in (12, 13, 14, 15))
    assert "the commit record says 12345" in skipped[16], skipped[16]
    assert all("\x1b" not in reason for reason in skipped.values())
    assert agent.terminate() == 0
