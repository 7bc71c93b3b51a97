"""A job of many nodes that exists only as what its sidecars commit: the checkpoint files.

`bench.scale` needs the store of a job of up to 1,024 nodes x 8 processes;
no machine here runs that many trainers, but each node's sidecar commits the
same objects whatever wrote them. So each simulated node writes the files a
plain loop stages (names and node-local marks as
`shim/frameworks/plain/layout/nodelocal.py` gives them) and commits them through the
sidecar's own `commit_node`. Two layouts:

- ``SimJob``: a plain FSDP2 loop's, 48 bytes a file so that only requests count;
- ``DdpJob``: a plain DDP loop's, at real sizes so that bytes count: each rank's
  file without the model and optimizer (a few KB), and the replicated state once,
  in shares placed by the shim's own ``replicated.owners`` (each written by its
  writer rank's node).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Protocol

from aiobotocore.session import get_session

from shim.frameworks.plain.layout import replicated
from sidecar.commit import commit_node
from sidecar.config import AgentConfig
from sidecar.safefs import OpenedFile, open_path
from sidecar.storage.base import Store
from sidecar.storage.s3 import S3Store

FILE_BYTES = 48
# Nodes committing at once in one process: each holds its files open while it uploads.
NODES_AT_ONCE = 32
# A DDP rank's file once its model and optimizer are in the shares: the structure with
# each tensor's number, the random states, the data position. An assumed size: a real
# one follows the program (its own variables and objects), not the job's size.
RANK_FILE_BYTES = 20_000
MARKER_BYTES = 64  # loop-state/node-<K>.json


class Layout(Protocol):
    """A simulated job: its size, and each node's files with their sizes and marks."""

    @property
    def nnodes(self) -> int: ...

    @property
    def nproc(self) -> int: ...

    def files(self, node: int) -> dict[str, bool]: ...

    def size(self, name: str) -> int: ...


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

    def size(self, name: str) -> int:
        return FILE_BYTES

    def needs(self, node: int) -> int:
        """How many files node ``node`` downloads when the job resumes on this layout."""
        shared = sum(not local for local in self.files(0).values())
        return len(self.files(node)) + (shared if node else 0)


@dataclass(frozen=True)
class StateTensor:
    """A tensor as ``replicated.owners`` sees it: its element count and element size."""

    elements: int
    element_bytes: int = 4  # float32

    def numel(self) -> int:
        return self.elements

    def element_size(self) -> int:
        return self.element_bytes


def gpt_state(hidden: int, layers: int, vocab: int, positions: int) -> list[StateTensor]:
    """A GPT-2 shaped model's parameters with AdamW's two moments and step each, in the
    order a state dict lists them: what a DDP loop's replicated state holds."""
    shapes = [vocab * hidden, positions * hidden]
    for _ in range(layers):
        shapes += [hidden, hidden, hidden * 3 * hidden, 3 * hidden, hidden * hidden, hidden]
        shapes += [hidden, hidden, hidden * 4 * hidden, 4 * hidden, 4 * hidden * hidden, hidden]
    shapes += [hidden, hidden]
    parameters = [StateTensor(n) for n in shapes]
    moments = [StateTensor(n) for n in shapes for _ in range(2)]
    steps = [StateTensor(1) for _ in shapes]
    return parameters + moments + steps


@dataclass(frozen=True)
class DdpJob:
    """``nnodes`` nodes of ``nproc`` processes each of a plain DDP loop, as the shim writes
    its checkpoint: every rank's file (its own state, marked node-local), each node's
    marker (node-local but node 0's), and the replicated ``state`` once, in shares written
    by the ranks ``replicated.owners`` picks (read by every node)."""

    nnodes: int
    nproc: int
    state: tuple[StateTensor, ...]

    @cached_property
    def shares(self) -> dict[int, int]:
        """Each writer rank's share of the replicated state, in bytes."""
        world = self.nnodes * self.nproc
        written: dict[int, int] = {}
        writers = replicated.owners(list(self.state), world)
        for tensor, rank in zip(self.state, writers, strict=True):
            written[rank] = written.get(rank, 0) + tensor.numel() * tensor.element_size()
        return written

    @property
    def state_bytes(self) -> int:
        return sum(self.shares.values())

    def files(self, node: int) -> dict[str, bool]:
        ranks = range(node * self.nproc, (node + 1) * self.nproc)
        files = {replicated.PART_FILE % rank: False for rank in ranks if rank in self.shares}
        files.update({f"loop-state/rank-{rank:05d}.pt": True for rank in ranks})
        files[f"loop-state/node-{node}.json"] = node != 0
        return files

    def size(self, name: str) -> int:
        for rank, share in self.shares.items():
            if name == replicated.PART_FILE % rank:
                return share
        return MARKER_BYTES if name.endswith(".json") else RANK_FILE_BYTES

    def downloads(self, node: int) -> list[str]:
        """What node ``node`` downloads when the job resumes on this layout: its own files
        and every node's shared ones (every share, node 0's marker)."""
        shared = [
            name
            for other in range(self.nnodes)
            if other != node
            for name, local in self.files(other).items()
            if not local
        ]
        return [*self.files(node), *shared]

    def needs(self, node: int) -> int:
        """How many files node ``node`` downloads when the job resumes on this layout."""
        return len(self.downloads(node))

    def needs_bytes(self, node: int) -> int:
        """How many bytes node ``node`` downloads when the job resumes on this layout."""
        return sum(self.size(name) for name in self.downloads(node))


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


def _write(path: Path, size: int) -> None:
    """``size`` random bytes (a random block repeated: a share of a GB is written in
    a second, and no store here compresses)."""
    block = os.urandom(min(size, 1 << 20))
    with path.open("wb") as out:
        for start in range(0, size, len(block)):
            out.write(block[: size - start])


def _open(job: Layout, node: int, scratch: Path) -> tuple[list[OpenedFile], frozenset[str]]:
    """Node ``node``'s files written under ``scratch`` and opened as staged ones are."""
    opened: list[OpenedFile] = []
    for name in job.files(node):
        path = scratch / f"node-{node}" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        _write(path, job.size(name))
        source = open_path(path)
        source.name = name
        opened.append(source)
    return opened, frozenset(name for name, local in job.files(node).items() if local)


async def commit(store: Store, job: Layout, step: int, nodes: Iterable[int], scratch: Path) -> None:
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
