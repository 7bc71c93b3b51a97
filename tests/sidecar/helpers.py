"""Checkpoint directories and commits for the sidecar tests."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

from local.s3server import LocalS3
from sidecar.commit import CommitResult, commit_node
from sidecar.config import AgentConfig
from sidecar.pieces import Handed, SpreadUpload
from sidecar.safefs import OpenedFile, open_path
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
    nproc_per_node: int | None = None,
    local: frozenset[str] = frozenset(),
    shim_loads: bool = False,
    replicas: frozenset[str] | None = None,
    handed: frozenset[str] | None = None,
    min_piece: int = 64 * 1024,
) -> CommitResult:
    """Node ``node_rank`` commits ``directory`` as ``checkpoint-<step>``; ``replicas``
    (not None): a ``copies`` checkpoint every node wrote, these files alike on each, and
    ``handed`` (None: all) the files its ``staged`` lists of those that arrived."""
    files = [open_file(directory, p) for p in sorted(directory.rglob("*")) if p.is_file()]
    spread = None
    if replicas is not None:
        spread = SpreadUpload(store, step, node_rank=node_rank, nnodes=nnodes, min_piece=min_piece)
    try:
        return await commit_node(
            store,
            step=step,
            kind=kind,
            files=files,
            node_rank=node_rank,
            nnodes=nnodes,
            nproc_per_node=nproc_per_node,
            local=local,
            shim_loads=shim_loads,
            pod="pod-a",
            job="job-1",
            spread=spread,
            handed=lambda: Handed(handed, replicas or frozenset()),
        )
    finally:
        for opened in files:
            opened.close()


def sharded_files(node: int, nproc: int) -> tuple[dict[str, int], frozenset[str]]:
    """Node ``node``'s files (name: size) as a plain FSDP2 loop of ``nproc`` processes per
    node stages them, and those marked node-local: each rank's shard and state its own,
    node 0's DCP ``.metadata`` read by every node."""
    sizes = {}
    for rank in range(node * nproc, (node + 1) * nproc):
        sizes[f"dcp/__{rank}_0.distcp"] = 48
        sizes[f"rank-{rank:05d}.pt"] = 48
    local = frozenset(sizes)
    if node == 0:
        sizes["dcp/.metadata"] = 48
    return sizes, local


async def commit_sharded(
    store: Store, scratch: Path, step: int, *, node: int, nnodes: int, nproc: int
) -> CommitResult:
    """Node ``node`` of ``nnodes`` commits its ``sharded_files`` of ``checkpoint-<step>``."""
    sizes, local = sharded_files(node, nproc)
    source = make_checkpoint(scratch, step, sizes, seed=node)
    return await commit(
        store, source, step, node_rank=node, nnodes=nnodes, nproc_per_node=nproc, local=local
    )


def replicated_files(node: int, nproc: int, writers: int) -> tuple[dict[str, int], frozenset[str]]:
    """Node ``node``'s files as a plain DDP loop stages them (``replicated``): each rank's
    file its own, and the shares of the replicated state, one per writer rank (the first
    rank of each of the first ``writers`` nodes), read by every node."""
    sizes = {f"loop-state/rank-{r:05d}.pt": 48 for r in range(node * nproc, (node + 1) * nproc)}
    local = frozenset(sizes)
    if node < writers:
        sizes[f"loop-state/replicated-{node * nproc:05d}.pt"] = 96
    return sizes, local


async def commit_replicated(
    store: Store, scratch: Path, step: int, *, node: int, nnodes: int, nproc: int
) -> CommitResult:
    """Node ``node`` of ``nnodes`` commits its ``replicated_files`` (every node a writer)."""
    sizes, local = replicated_files(node, nproc, writers=nnodes)
    source = make_checkpoint(scratch / f"node-{node}", step, sizes, seed=node)
    return await commit(
        store, source, step, node_rank=node, nnodes=nnodes, nproc_per_node=nproc, local=local
    )


def open_file(directory: Path, path: Path) -> OpenedFile:
    """A test's own file opened as the sidecar opens staged ones, named relative to
    ``directory`` (its name in the checkpoint)."""
    opened = open_path(path)
    opened.name = path.relative_to(directory).as_posix()
    return opened


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


def open_multipart_uploads(local_s3: LocalS3, bucket: str) -> list[str]:
    """The keys of the multipart uploads begun in ``bucket`` and neither completed nor
    aborted (what a dropped upload must not leave behind)."""
    answer = local_s3.client().list_multipart_uploads(Bucket=bucket)
    return [upload["Key"] for upload in answer.get("Uploads", [])]


def bucket_objects(local_s3: LocalS3, bucket: str) -> dict[str, bytes]:
    """Every object in ``bucket`` and its bytes, read back through a plain S3 client."""
    client = local_s3.client()
    objects: dict[str, bytes] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for item in page.get("Contents", []):
            body = client.get_object(Bucket=bucket, Key=item["Key"])["Body"]
            objects[item["Key"]] = body.read()
    return objects


def tree_snapshot(root: Path) -> dict[str, tuple[int, bytes | str | None]]:
    """Each entry under ``root`` (and root itself), never following a symlink: its mode
    and its bytes (files), its target (symlinks) or None (directories)."""
    found: dict[str, tuple[int, bytes | str | None]] = {}
    for here, dirs, files in os.walk(root):
        for name in [".", *dirs, *files]:
            path = Path(here) / name
            info = path.lstat()
            content: bytes | str | None = None
            if stat.S_ISLNK(info.st_mode):
                content = os.readlink(path)
            elif stat.S_ISREG(info.st_mode):
                content = path.read_bytes()
            found[path.relative_to(root).as_posix()] = (info.st_mode, content)
    return found
