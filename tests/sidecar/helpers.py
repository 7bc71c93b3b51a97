"""Checkpoint directories and commits for the sidecar tests."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from sidecar.commit import CommitResult, commit_node
from sidecar.config import AgentConfig
from sidecar.storage.base import Store
from sidecar.storage.factory import open_store


def make_checkpoint(root: Path, step: int, sizes: dict[str, int], seed: int = 0) -> Path:
    """A checkpoint-like directory with random files of the given sizes."""
    directory = root / f"src-{step}-{seed}"
    for name, size in sizes.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(size))
    return directory


async def commit(
    store: Store,
    directory: Path,
    step: int,
    *,
    node_rank: int = 0,
    nnodes: int = 1,
    kind: str = "periodic",
) -> CommitResult:
    files = sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())
    return await commit_node(
        store,
        step=step,
        kind=kind,
        source=directory,
        files=files,
        node_rank=node_rank,
        nnodes=nnodes,
        pod="pod-a",
        job="job-1",
    )


def seed_store(destination: str, scratch: Path, step: int, sizes: dict[str, int]) -> None:
    """Commit one valid checkpoint to ``destination`` before an agent starts: a job's past."""

    async def main() -> None:
        async with open_store(AgentConfig(destination=destination)) as store:
            await commit(store, make_checkpoint(scratch, step, sizes), step)

    asyncio.run(main())


def stage(staging_root: Path, name: str, sizes: dict[str, int]) -> tuple[Path, list[str]]:
    """A staging dir as the shim makes it: dirs 0777 (sidecar may be another uid)."""
    directory = staging_root / name
    directory.mkdir(parents=True, mode=0o777)
    os.chmod(directory, 0o777)
    files = []
    for relative, size in sizes.items():
        path = directory / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(path.parent, 0o777)
        path.write_bytes(os.urandom(size))
        files.append(relative)
    return directory, files
