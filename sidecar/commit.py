"""Upload one node's files of one checkpoint, then commit them with the manifest.

The manifest is written only after every file is in the store, so a crash at
any point leaves either a committed node or one without a manifest, which
the validity rule calls torn. Re-running a commit is safe: objects are simply
overwritten with the same bytes.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

from sidecar import manifest as mf
from sidecar.storage.base import PartGate, Store

# Files open at once: parts and ranges are bounded by the store, this bounds descriptors
# and memory for checkpoints made of thousands of shards.
FILES_IN_FLIGHT = 16


@dataclass(frozen=True)
class CommitResult:
    manifest: mf.Manifest
    seconds: float
    retries: int

    @property
    def size(self) -> int:
        return self.manifest.size


async def commit_node(
    store: Store,
    *,
    step: int,
    kind: str,
    source: Path,
    files: list[str],
    node_rank: int,
    nnodes: int,
    pod: str = "",
    job: str = "",
    gate: PartGate | None = None,
) -> CommitResult:
    """Upload ``files`` (relative to ``source``) under ``checkpoint-<step>/`` and commit."""
    started = time.monotonic()
    slots = asyncio.Semaphore(FILES_IN_FLIGHT)

    async def one(relative: str) -> tuple[mf.FileEntry, int]:
        path = source / relative
        async with slots:
            result = await store.put_file(mf.file_key(step, relative), path, gate=gate)
        entry = mf.FileEntry(
            path=relative, size=result.size, crc32c=result.crc32c, parts=result.parts
        )
        return entry, result.retries

    done = await asyncio.gather(*(one(f) for f in sorted(files)))
    manifest = mf.Manifest(
        step=step,
        kind=kind,
        node_rank=node_rank,
        nnodes=nnodes,
        pod=pod,
        job=job,
        files=[entry for entry, _ in done],
    )
    await store.put_bytes(mf.manifest_key(step, node_rank), mf.encode(manifest))
    return CommitResult(
        manifest=manifest,
        seconds=time.monotonic() - started,
        retries=sum(retries for _, retries in done),
    )
