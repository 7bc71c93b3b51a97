"""Upload one node's files of one checkpoint, then commit them with the manifest.

The manifest is written only after every file is in the store, so a crash at
any point leaves either a committed node or one without a manifest, which
the validity rule calls torn. Then the node does its part of writing the
commit record (``fanin``): the checkpoint is committed once every node's
manifest is in and the record says so. Re-running a commit is safe: objects
are simply overwritten with the same bytes, the manifest too (its ``time``
is when the checkpoint was staged, not when it is uploaded).

A checkpoint streamed while it is being written (``arrivals``) has each file
uploaded as soon as it is accepted; its manifest still comes last, once the
arrivals are closed (the checkpoint complete) and every file is uploaded.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from sidecar import fanin, pieces, settle
from sidecar import manifest as mf
from sidecar.arrivals import Arrivals
from sidecar.safefs import OpenedFile
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
    files: list[OpenedFile],
    node_rank: int,
    nnodes: int,
    nproc_per_node: int | None = None,
    local: frozenset[str] = frozenset(),
    shim_loads: bool = False,
    pod: str = "",
    job: str = "",
    gate: PartGate | None = None,
    arrivals: Arrivals | None = None,
    marks: Callable[[], tuple[frozenset[str], bool]] | None = None,
    committing: Callable[[], None] | None = None,
    staged_at: float | None = None,
    spread: pieces.SpreadUpload | None = None,
    handed: Callable[[], pieces.Handed] | None = None,
) -> CommitResult:
    """Upload ``files`` under ``checkpoint-<step>/`` and commit (``arrivals``: the files
    arrive while this runs, ``files`` is ignored; ``marks``: then ``local`` and
    ``shim_loads`` as the ``staged`` that completed them said, read once every file is
    in, since that request comes after this began).

    ``committing`` is called once every file is in the store, just before the manifest is
    written: from there on the caller must not cancel the commit. A manifest PUT cut short
    may still land, and then no one could say whether the checkpoint was committed.
    ``local`` and ``nproc_per_node`` let a restore on the same layout skip the other
    nodes' files that only their own ranks read (``nodefiles``). ``staged_at`` (seconds
    since the epoch) is the manifest's time; None: now. ``shim_loads``: the manifest's.
    ``spread``: a ``copies`` checkpoint, its large files uploaded in pieces by every node
    (``pieces``); ``handed`` then says, once every file is in, which files this node
    hands over and which every node wrote alike.
    """
    started = time.monotonic()

    def key_of(relative: str) -> str:
        return mf.file_key(step, relative)

    sent: list[mf.Sent] = []
    if spread is not None:
        arriving = arrivals if arrivals is not None else _arrived(files)
        assert handed is not None, "a copies checkpoint says what is handed over"
        spreaded = await upload_spread(spread, arriving, handed)
        entries, sent, retries = spreaded.entries, spreaded.sent, spreaded.retries
    elif arrivals is None:
        entries, retries = await upload_files(store, files, key_of, gate)
    else:
        entries, retries = await upload_arriving(store, arrivals, key_of, gate)
    if marks is not None:
        local, shim_loads = marks()
    entries = [e.model_copy(update={"local": True}) if e.path in local else e for e in entries]
    manifest = mf.Manifest(
        step=step,
        kind=kind,
        node_rank=node_rank,
        nnodes=nnodes,
        nproc_per_node=nproc_per_node,
        pod=pod,
        job=job,
        time=mf.iso_time(time.time() if staged_at is None else staged_at),
        files=entries,
        shim_loads=shim_loads,
        sent=sent,
    )
    if committing is not None:
        committing()
    await store.put_bytes(mf.manifest_key(step, node_rank), mf.encode(manifest))
    await fanin.complete(store, step, node_rank, nnodes)
    return CommitResult(manifest=manifest, seconds=time.monotonic() - started, retries=retries)


async def upload_files(
    store: Store,
    files: list[OpenedFile],
    key_of: Callable[[str], str],
    gate: PartGate | None = None,
) -> tuple[list[mf.FileEntry], int]:
    """Upload ``files`` (opened once at acceptance and read only through their descriptors;
    named by their path in the checkpoint, which ``manifest.check_path`` accepted) to
    ``key_of(name)``: their manifest entries, sorted, and the retries it took. Checkpoints
    and the final model both upload through it."""
    return await upload_arriving(store, _arrived(files), key_of, gate)


def _arrived(files: list[OpenedFile]) -> Arrivals:
    """``files`` as arrivals that are all in."""
    arrivals = Arrivals(sorted(files, key=lambda f: f.name))
    arrivals.close()
    return arrivals


async def upload_arriving(
    store: Store,
    arrivals: Arrivals,
    key_of: Callable[[str], str],
    gate: PartGate | None = None,
) -> tuple[list[mf.FileEntry], int]:
    """``upload_files`` for files that may arrive while it runs: each is started as soon as
    it is accepted, ``FILES_IN_FLIGHT`` at a time; the answer comes once the arrivals are
    closed and every upload is done (one that fails cancels the others)."""
    slots = asyncio.Semaphore(FILES_IN_FLIGHT)

    async def one(source: OpenedFile) -> tuple[mf.FileEntry, int]:
        async with slots:
            result = await store.put_file(key_of(source.name), source, gate=gate)
        entry = mf.FileEntry(
            path=source.name, size=result.size, crc32c=result.crc32c, parts=result.parts
        )
        return entry, result.retries

    uploads: list[asyncio.Task[tuple[mf.FileEntry, int]]] = []
    try:
        async for source in arrivals.each():
            uploads.append(asyncio.create_task(one(source)))
        done = await asyncio.gather(*uploads)
    except BaseException:
        await settle.cancel_and_wait(uploads)
        raise
    entries = sorted((entry for entry, _ in done), key=lambda e: e.path)
    return entries, sum(retries for _, retries in done)


async def upload_spread(
    spread: pieces.SpreadUpload, arrivals: Arrivals, handed: Callable[[], pieces.Handed]
) -> pieces.SpreadResult:
    """``upload_arriving`` for a ``copies`` checkpoint (``pieces``): each file handled as
    it is accepted, the rest once the arrivals are closed and ``handed`` can say."""
    slots = asyncio.Semaphore(FILES_IN_FLIGHT)

    async def one(source: OpenedFile) -> None:
        async with slots:
            await spread.arrived(source)

    tasks: list[asyncio.Task[None]] = []
    try:
        async for source in arrivals.each():
            tasks.append(asyncio.create_task(one(source)))
        await asyncio.gather(*tasks)
        return await spread.finish(handed())
    except BaseException:
        await settle.cancel_and_wait(tasks)
        await spread.close()
        raise
