"""The shim's side of a JIT checkpoint streamed file by file (``shim/streaming.py``).

Real agent, real S3 (moto), the shim's own link and writers watched as during
a JIT save. When streaming cannot go on (here: a file written a second time
after it was handed over, as an in-place rewrite would change bytes the
sidecar may have uploaded), the sidecar drops what it held and the checkpoint
is handed over whole, and what is committed is what was written last.
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


def test_file_written_twice_ends_streaming_and_the_checkpoint_goes_whole(
    shim_env: ShimEnv, agent: AgentProcess, local_s3: LocalS3
) -> None:
    link, directory, staging, stream = _stream(shim_env, agent, 5)
    with streaming.watching(stream):
        torch.save({"w": torch.zeros(1000)}, directory / "model.pt")
        assert stream.handed == ["model.pt"] and not stream.broken
        [row] = agent.status()["queue"]
        assert row["streaming"] is True
        torch.save({"w": torch.ones(1000)}, str(directory / "model.pt"))
        torch.save({"step": 5}, directory / "extra.pt")  # after the break: not streamed
    assert not hasattr(torch.save, "__wrapped__")  # the writers are put back
    assert stream.broken and stream.finish() is None
    (directory / "trainer_state.json").write_text("{}")
    assert hand_over(link, str(directory), staging, 5, protocol.KIND_JIT) is not None
    agent.wait_for(lambda: agent.committed_step() == 5, 60, "the commit")
    bucket, root = agent.destination.removeprefix("s3://").split("/", 1)
    objects = bucket_objects(local_s3, bucket)
    for name in ("model.pt", "extra.pt", "trainer_state.json"):
        assert objects[f"{root}/checkpoint-5/{name}"] == (directory / name).read_bytes()
    dropped = agent.status()["superseded"]
    assert [d["step"] for d in dropped] == [5] and "connection closed" in dropped[0]["reason"]
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
    """A writer that saves to a temporary name and renames it (as plain loops' own
    state files are written): the temporary name was streamed, the checkpoint holds the
    renamed file; it is handed over whole, and the commit has no temporary file (one
    uploaded before the part was dropped is not in the manifest: a restore never reads it)."""
    link, directory, staging, stream = _stream(shim_env, agent, 8)
    with streaming.watching(stream):
        torch.save({"w": torch.zeros(100)}, directory / "state.pt.tmp-1")
        os.replace(directory / "state.pt.tmp-1", directory / "state.pt")
    assert stream.handed == ["state.pt.tmp-1"]
    assert stream.finish() is None and stream.broken
    assert hand_over(link, str(directory), staging, 8, protocol.KIND_JIT) is not None
    agent.wait_for(lambda: agent.committed_step() == 8, 60, "the commit")
    bucket, root = agent.destination.removeprefix("s3://").split("/", 1)
    manifest = json.loads(bucket_objects(local_s3, bucket)[f"{root}/checkpoint-8/{MANIFEST}"])
    assert [entry["path"] for entry in manifest["files"]] == ["state.pt"]
