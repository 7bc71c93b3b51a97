"""A job of many nodes that exists only as what its sidecars commit: the checkpoint files.

`bench.scale` needs the store of a job of up to 1,024 nodes x 8 processes;
no machine here runs that many trainers, but each node's sidecar commits the
same objects whatever wrote them. So each simulated node writes the files a
plain FSDP2 loop stages (names and node-local marks as
`shim/frameworks/plain/nodelocal.py` gives them), 48 bytes each so that only
requests count, and commits them through the sidecar's own `commit_node`.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from aiobotocore.session import get_session

from sidecar.commit import commit_node
from sidecar.config import AgentConfig
from sidecar.safefs import OpenedFile, open_path
from sidecar.storage.base import Store
from sidecar.storage.s3 import S3Store

FILE_BYTES = 48
# Nodes committing at once in one process: each holds its files open while it uploads.
NODES_AT_ONCE = 32


@dataclass(frozen=True)
class SimJob:
    """``nnodes`` nodes of ``nproc`` processes each, one sharded (FSDP2) checkpoint a step."""

    nnodes: int
    nproc: int

    def files(self, node: int) -> dict[str, bool]:
        """Node ``node``'s files and whether each is marked node-local: each rank's DCP
        shard and loop state, the node's marker; node 0 also DCP's ``.metadata``, and its
        marker is read by every node."""
        files: dict[str, bool] = {}
        for rank in range(node * self.nproc, (node + 1) * self.nproc):
            files[f"loop-state/dcp/__{rank}_0.distcp"] = True
            files[f"loop-state/rank-{rank:05d}.pt"] = True
        files[f"loop-state/node-{node}.json"] = node != 0
        if node == 0:
            files["loop-state/dcp/.metadata"] = False
        return files

    def needs(self, node: int) -> int:
        """How many files node ``node`` downloads when the job resumes on this layout."""
        shared = sum(not local for local in self.files(0).values())
        return len(self.files(node)) + (shared if node else 0)


def s3_store(destination: str, env: Mapping[str, str]) -> S3Store:
    """The sidecar's S3 store of ``destination`` (``s3://bucket/prefix``), with the agent's
    default settings, reached through the endpoint and with the keys in ``env``."""
    config = AgentConfig(destination=destination)
    session = get_session()
    session.set_credentials(env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"])
    bucket, _, prefix = destination.removeprefix("s3://").partition("/")
    return S3Store(
        bucket,
        prefix,
        destination,
        part_size=config.part_size,
        concurrency=config.concurrency,
        read_timeout=config.s3_read_timeout,
        max_attempts=config.s3_max_attempts,
        env=env,
        session=session,
    )


def _open(job: SimJob, node: int, scratch: Path) -> tuple[list[OpenedFile], frozenset[str]]:
    """Node ``node``'s files written under ``scratch`` and opened as staged ones are."""
    opened: list[OpenedFile] = []
    for name in job.files(node):
        path = scratch / f"node-{node}" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(FILE_BYTES))
        source = open_path(path)
        source.name = name
        opened.append(source)
    return opened, frozenset(name for name, local in job.files(node).items() if local)


async def commit(store: Store, job: SimJob, step: int, nodes: Iterable[int], scratch: Path) -> None:
    """Nodes ``nodes`` commit ``checkpoint-<step>`` into ``store``, ``NODES_AT_ONCE`` at a
    time, each as its sidecar would."""
    slots = asyncio.Semaphore(NODES_AT_ONCE)

    async def one(node: int) -> None:
        async with slots:
            files, local = await asyncio.to_thread(_open, job, node, scratch)
            try:
                await commit_node(
                    store,
                    step=step,
                    kind="jit",
                    files=files,
                    node_rank=node,
                    nnodes=job.nnodes,
                    nproc_per_node=job.nproc,
                    local=local,
                    pod=f"bench-node-{node}",
                    job="bench",
                )
            finally:
                for source in files:
                    source.close()

    await asyncio.gather(*(one(node) for node in nodes))
