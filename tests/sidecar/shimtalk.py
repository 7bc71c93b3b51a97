"""Requests as a trainer's shim builds them, for tests that speak to a real agent."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from shim import protocol


def hello(pid: int, rank: int = 0, framework: str = "transformers") -> protocol.Hello:
    """The ``hello`` of one process of a single-node job."""
    return protocol.Hello(
        pid=pid,
        rank=rank,
        local_rank=rank,
        world_size=max(rank + 1, 1),
        node_rank=0,
        nnodes=1,
        framework=framework,
    )


def staged(step: int, kind: str, directory: Path, files: Iterable[str]) -> protocol.Staged:
    return protocol.Staged(step=step, kind=kind, dir=str(directory), files=tuple(files))
