"""DESIGN 7's rule: which checkpoints in a store are valid, and why the others are torn.

Valid means: manifests from all ``nnodes`` nodes are present and agree on
``nnodes``; every file a manifest lists exists with the listed size, and with
the listed CRC32C where the store keeps a whole-object checksum (S3 keeps one
for single-part objects; a multipart object's is a composite and a directory
keeps none, so there the CRC32C is checked by every download instead).
Files that several nodes upload under the same relative path must be the same
bytes (same size and CRC32C); if they differ the checkpoint is torn, because
the store holds only one of them.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime

from pydantic import ValidationError

from shim import layout
from sidecar import manifest as mf
from sidecar.storage.base import ObjectInfo, Store, StoreError

HEAD_CONCURRENCY = 16


@dataclass
class CheckpointState:
    """One ``checkpoint-<step>`` in the store, judged."""

    step: int
    valid: bool
    reason: str  # empty when valid
    objects: list[ObjectInfo]
    manifests: list[mf.Manifest] = field(default_factory=list)

    @property
    def size(self) -> int:
        return sum(o.size for o in self.objects)

    @property
    def mtime(self) -> float:
        return max((o.mtime for o in self.objects), default=0.0)

    @property
    def time(self) -> str:
        if self.manifests:
            return max(m.time for m in self.manifests)
        return datetime.fromtimestamp(self.mtime, UTC).isoformat(timespec="seconds")

    @property
    def kind(self) -> str:
        kinds = sorted({m.kind for m in self.manifests})
        return "+".join(kinds) if kinds else "-"

    @property
    def nnodes(self) -> int | None:
        return self.manifests[0].nnodes if self.manifests else None

    def files(self) -> dict[str, mf.FileEntry]:
        """The union of all nodes' files, one entry per relative path."""
        union: dict[str, mf.FileEntry] = {}
        for manifest in sorted(self.manifests, key=lambda m: m.node_rank):
            for entry in manifest.files:
                union.setdefault(entry.path, entry)
        return union


def group_by_step(objects: list[ObjectInfo]) -> dict[int, list[ObjectInfo]]:
    """Objects under each ``checkpoint-<step>/``; anything else is ignored."""
    groups: dict[int, list[ObjectInfo]] = defaultdict(list)
    for obj in objects:
        top, _, rest = obj.key.partition("/")
        step = layout.step_of(top)
        if step is not None and rest:
            groups[step].append(obj)
    return groups


async def _load_manifests(
    store: Store, step: int, objects: list[ObjectInfo]
) -> tuple[list[mf.Manifest], str]:
    prefix = f"{mf.checkpoint_dir(step)}/{layout.MANIFEST_DIR}/"
    manifests: list[mf.Manifest] = []
    for obj in sorted(objects, key=lambda o: o.key):
        if not obj.key.startswith(prefix) or "/" in obj.key[len(prefix) :]:
            continue
        name = obj.key[len(prefix) :]
        rank = mf.node_of(name)
        if rank is None:
            continue
        try:
            loaded = mf.decode(await store.get_bytes(obj.key))
        except (ValidationError, ValueError) as exc:
            return [], f"manifest {name} is unreadable: {str(exc).splitlines()[0]}"
        except StoreError as exc:
            return [], f"manifest {name} could not be read: {exc}"
        if loaded.node_rank != rank or loaded.step != step:
            return [], f"manifest {name} names node {loaded.node_rank}, step {loaded.step}"
        manifests.append(loaded)
    return manifests, ""


async def judge(store: Store, step: int, objects: list[ObjectInfo]) -> CheckpointState:
    """Apply the validity rule to one checkpoint's objects."""
    manifests, problem = await _load_manifests(store, step, objects)
    state = CheckpointState(step=step, valid=False, reason="", objects=objects)
    if problem:
        state.reason = problem
        return state
    state.manifests = manifests
    if not manifests:
        state.reason = "no manifest: no node committed it (upload interrupted?)"
        return state
    counts = {m.nnodes for m in manifests}
    if len(counts) > 1:
        state.reason = f"manifests disagree on the number of nodes: {sorted(counts)}"
        return state
    nnodes = counts.pop()
    present = {m.node_rank for m in manifests}
    missing = [k for k in range(nnodes) if k not in present]
    if missing:
        names = ", ".join(f"node-{k}" for k in missing)
        state.reason = f"manifests from {len(present)} of {nnodes} nodes (missing {names})"
        return state
    by_key = {o.key: o for o in objects}
    seen: dict[str, tuple[int, mf.FileEntry]] = {}
    to_check: list[mf.FileEntry] = []
    for manifest in sorted(manifests, key=lambda m: m.node_rank):
        for entry in manifest.files:
            earlier = seen.get(entry.path)
            if earlier is not None:
                rank, other = earlier
                if (other.size, other.crc32c) != (entry.size, entry.crc32c):
                    state.reason = (
                        f"nodes {rank} and {manifest.node_rank} uploaded different "
                        f"{entry.path} under the same name"
                    )
                    return state
                continue
            seen[entry.path] = (manifest.node_rank, entry)
            obj = by_key.get(mf.file_key(step, entry.path))
            if obj is None:
                state.reason = f"missing object {entry.path} (node {manifest.node_rank})"
                return state
            if obj.size != entry.size:
                state.reason = (
                    f"{entry.path} is {obj.size} bytes, manifest of node "
                    f"{manifest.node_rank} says {entry.size}"
                )
                return state
            if store.keeps_checksums and entry.parts == 1:
                to_check.append(entry)
    mismatch = await _checksum_mismatch(store, step, to_check)
    if mismatch:
        state.reason = mismatch
        return state
    state.valid = True
    return state


async def _checksum_mismatch(store: Store, step: int, entries: list[mf.FileEntry]) -> str:
    slots = asyncio.Semaphore(HEAD_CONCURRENCY)

    async def check(entry: mf.FileEntry) -> str:
        async with slots:
            info = await store.head(mf.file_key(step, entry.path))
        if info is None:
            return f"missing object {entry.path}"
        if info.crc32c is not None and info.crc32c != entry.crc32c:
            return f"{entry.path}: store CRC32C {info.crc32c}, manifest says {entry.crc32c}"
        return ""

    for problem in await asyncio.gather(*(check(e) for e in entries)):
        if problem:
            return problem
    return ""


async def scan(store: Store) -> AsyncIterator[CheckpointState]:
    """Every checkpoint in the store, newest step first, each judged when reached."""
    groups = group_by_step(await store.list_objects())
    for step in sorted(groups, reverse=True):
        yield await judge(store, step, groups[step])
