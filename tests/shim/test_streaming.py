"""The shim's side of a JIT checkpoint streamed file by file (``shim/streaming.py``).

Real agent, real S3 (moto), the shim's own link and writers watched as during
a JIT save: a file is handed over when the save writes the next one, a handed
file written again byte for byte (DeepSpeed ZeRO-3 under HF) keeps streaming.
When streaming cannot go on (a handed file written again with other bytes, or
renamed), the sidecar drops what it held and the checkpoint is handed over
whole, and what is committed is what was written last.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import torch

from local.s3server import LocalS3
from shim import protocol, streaming
from shim.channel import SidecarLink
from shim.trainrun import hand_over
from tests.shim.support import ShimEnv
from tests.sidecar import shimtalk
from tests.sidecar.agentproc import AgentProcess
from tests.sidecar.helpers import bucket_objects

MANIFEST = ".jitckpt/node-0.json"


def _stream(
    shim_env: ShimEnv, agent: AgentProcess, step: int
) -> tuple[SidecarLink, Path, str, streaming.Stream]:
    """A link to the agent after ``hello``, ``checkpoint-<step>`` made, and a stream of it."""
    link = SidecarLink(str(agent.socket), timeout=30)
    assert isinstance(link.hello(shimtalk.hello(os.getpid())), protocol.HelloAnswer)
    directory = shim_env.checkpoints / f"checkpoint-{step}"
    directory.mkdir(parents=True)
    staging = str(shim_env.local / "staging")
    return (
        link,
        directory,
        staging,
        streaming.Stream(link, str(directory), staging, step, protocol.KIND_JIT),
    )


def _committed(agent: AgentProcess, local_s3: LocalS3, step: int) -> dict[str, bytes]:
    """Each file of committed ``checkpoint-<step>`` as its manifest lists it: its bytes."""
    agent.wait_for(lambda: agent.committed_step() == step, 60, "the commit")
    bucket, root = agent.destination.removeprefix("s3://").split("/", 1)
    objects = bucket_objects(local_s3, bucket)
    manifest = json.loads(objects[f"{root}/checkpoint-{step}/{MANIFEST}"])
    return {e["path"]: objects[f"{root}/checkpoint-{step}/{e['path']}"] for e in manifest["files"]}


def test_a_file_is_handed_over_at_the_next_write_and_one_removed_at_once_never(
    shim_env: ShimEnv, agent: AgentProcess, local_s3: LocalS3
) -> None:
    """HF's save under DeepSpeed ZeRO-3 writes placeholder weights and removes them before
    DeepSpeed writes its files: a file is handed over once the save writes the next one,
    if it is still there, so the placeholder never reaches the sidecar."""
    _, directory, _, stream = _stream(shim_env, agent, 4)
    with streaming.watching(stream):
        torch.save({"w": torch.zeros(1000)}, directory / "config.pt")
        assert stream.handed == []  # complete, handed over at the next write
        torch.save({}, directory / "model.pt")
        assert stream.handed == ["config.pt"]
        os.remove(directory / "model.pt")
        torch.save({"w": torch.ones(1000)}, str(directory / "states.pt"))
    assert stream.handed == ["config.pt"] and not stream.broken
    (directory / "trainer_state.json").write_text("{}")
    assert stream.finish() is not None
    committed = _committed(agent, local_s3, 4)
    assert sorted(committed) == ["config.pt", "states.pt", "trainer_state.json"]
    assert all(committed[name] == (directory / name).read_bytes() for name in committed)
    assert agent.status()["superseded"] == []


def test_a_handed_file_written_again_byte_for_byte_goes_on_streaming(
    shim_env: ShimEnv, agent: AgentProcess, local_s3: LocalS3
) -> None:
    """DeepSpeed ZeRO-3's checkpoint saved twice by one HF save: the second write of a
    handed file makes a new file (the sidecar's stays as handed); the same bytes, and the
    checkpoint holds the handed inode again."""
    _, directory, _, stream = _stream(shim_env, agent, 5)
    states = {"w": torch.arange(1000.0)}
    with streaming.watching(stream):
        for _ in range(2):
            torch.save(states, directory / "model_states.pt")
            torch.save({"m": torch.ones(500)}, directory / "optim_states.pt")
    assert stream.handed == ["model_states.pt", "optim_states.pt"] and not stream.broken
    (directory / "latest").write_text("global_step5")
    # A rank's partitions are this node's own; the checkpoint is one the shim loads. Both
    # said by the completing request, after the upload of the streamed files began.
    staged_id = stream.finish(local=lambda name: name.endswith("_states.pt"), shim_loads=True)
    assert staged_id is not None
    committed = _committed(agent, local_s3, 5)
    assert sorted(committed) == ["latest", "model_states.pt", "optim_states.pt"]
    assert all(committed[name] == (directory / name).read_bytes() for name in committed)
    assert agent.status()["superseded"] == []
    bucket, root = agent.destination.removeprefix("s3://").split("/", 1)
    manifest = json.loads(bucket_objects(local_s3, bucket)[f"{root}/checkpoint-5/{MANIFEST}"])
    marked = sorted(entry["path"] for entry in manifest["files"] if entry.get("local"))
    assert marked == ["model_states.pt", "optim_states.pt"], manifest
    assert manifest["shim_loads"] is True, manifest


def test_a_handed_file_written_again_with_other_bytes_ends_streaming_and_goes_whole(
    shim_env: ShimEnv, agent: AgentProcess, local_s3: LocalS3
) -> None:
    """Written again with other bytes, the handed file is not what the checkpoint holds:
    the sidecar drops the streamed part, reading only the bytes it was handed (the new
    write made a new file), and the checkpoint is handed over whole."""
    link, directory, staging, stream = _stream(shim_env, agent, 6)
    with streaming.watching(stream):
        torch.save({"w": torch.zeros(1000)}, directory / "model.pt")
        torch.save({"step": 6}, directory / "extra.pt")
        assert stream.handed == ["model.pt"] and not stream.broken
        [row] = agent.status()["queue"]
        assert row["streaming"] is True
        handed = Path(stream.target or "") / "model.pt"
        first = handed.read_bytes()
        torch.save({"w": torch.ones(1000)}, str(directory / "model.pt"))
        assert stream.broken
        assert not handed.exists() or handed.read_bytes() == first
        torch.save({"step": 7}, directory / "extra.pt")  # after the break: not streamed
    assert not hasattr(torch.save, "__wrapped__")  # the writers are put back
    assert stream.broken and stream.finish() is None
    (directory / "trainer_state.json").write_text("{}")
    assert hand_over(link, str(directory), staging, 6, protocol.KIND_JIT) is not None
    committed = _committed(agent, local_s3, 6)
    assert sorted(committed) == ["extra.pt", "model.pt", "trainer_state.json"]
    assert all(committed[name] == (directory / name).read_bytes() for name in committed)
    dropped = agent.status()["superseded"]
    assert [d["step"] for d in dropped] == [6] and "connection closed" in dropped[0]["reason"]
    agent.wait_for(lambda: not any(Path(staging).iterdir()), 30, "staging cleanup")


def test_writes_outside_the_checkpoint_or_on_other_threads_are_not_streamed(
    shim_env: ShimEnv, agent: AgentProcess, tmp_path: Path
) -> None:
    _, directory, _, stream = _stream(shim_env, agent, 6)
    with streaming.watching(stream):
        torch.save({"w": 1}, tmp_path / "elsewhere.pt")
        worker = threading.Thread(target=torch.save, args=({"w": 2}, directory / "other.pt"))
        worker.start()
        worker.join()
    assert stream.handed == [] and stream.target is None and not stream.broken
    assert stream.finish() is None  # nothing streamed: the caller hands it over whole
    assert agent.status()["queue"] == []


def test_file_written_aside_and_renamed_is_not_committed_under_its_temporary_name(
    shim_env: ShimEnv, agent: AgentProcess, local_s3: LocalS3
) -> None:
    """A writer that saves to a temporary name and renames it once the save wrote another
    file: the temporary name was streamed, the checkpoint holds the renamed file; it is
    handed over whole, and the commit has no temporary file (one uploaded before the part
    was dropped is not in the manifest: a restore never reads it)."""
    link, directory, staging, stream = _stream(shim_env, agent, 8)
    with streaming.watching(stream):
        torch.save({"w": torch.zeros(100)}, directory / "state.pt.tmp-1")
        torch.save({"step": 8}, directory / "extra.pt")
        os.replace(directory / "state.pt.tmp-1", directory / "state.pt")
    assert stream.handed == ["state.pt.tmp-1"]
    assert stream.finish() is None and stream.broken
    assert hand_over(link, str(directory), staging, 8, protocol.KIND_JIT) is not None
    assert sorted(_committed(agent, local_s3, 8)) == ["extra.pt", "state.pt"]
